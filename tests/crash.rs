//! Crash test of the durable embedded mode through the real binary: 200,000 keyed
//! records produced in batches while the server processes them into a persistent
//! `count` store, SIGKILL at 5 random moments (restarting on the same data dir),
//! then every count must be exact and every acknowledged record in the log.
//! Two variants share one body (`crash_test`): plain `count` in offset order, and
//! `simulate` in key order failing 2 % of the records on their first attempt, so
//! the kills land while records go through the retry topic (and later records of
//! their keys are parked behind them): retries must be exactly-once too.
//! Seeded (`TASKSTREAM_CRASH_SEED` replays a seed; the seed in use is printed).

mod common;

use bytes::Bytes;
use common::{server_binary, temp_dir};
use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use taskstream_client::{ClientError, StreamsClient, keyed_record, v1};
use taskstream_server::log::partition_for_key;
use taskstream_server::processor::Simulate;
use taskstream_server::{Log, RedbLog};

const RECORDS: usize = 200_000;
const BATCH: usize = 1_000;
const BATCHES: usize = RECORDS / BATCH;
const KEYS: u64 = 1_000;
const KILLS: usize = 5;
const PARTITIONS: u32 = 4;
const TOPIC: &str = "events";
const STORE: &str = "count";
const APPLICATION_ID: &str = "crash";
/// The pipeline's retry and dead-letter topics (`<application_id>-<pipeline>-…`).
const RETRY_TOPIC: &str = "crash-count-retry";
const DEAD_LETTER_TOPIC: &str = "crash-count-dlq";
/// Bound on one thing the server should do promptly (start, answer, catch up).
const DEADLINE: Duration = Duration::from_secs(30);
/// Bound on the last retries reaching the store once every one is final.
const SETTLE: Duration = Duration::from_secs(5);
/// Bound on the whole test.
const TEST_DEADLINE: Duration = Duration::from_secs(120);

const CONFIG: &str = r#"
application_id = "crash"
num_stream_threads = 4
num_threads_per_task = 2
processing_order = "offset"
commit_interval_ms = 50
max_batch_records = 200

[[topics]]
name = "events"
partitions = 4

[[pipelines]]
name = "count"
source_topic = "events"
processor = "count"
store = "persistent"
"#;

/// The failing records of the variant with retries: the processor's settings,
/// shared with the test's own `Simulate::is_failing_record`.
const FAILURE_RATE: f64 = 0.02;
const FAIL_ATTEMPTS: u32 = 1;
const FAILURE_SEED: u64 = 11;

/// `CONFIG` in key order, with `simulate` failing `FAILURE_RATE` of the records
/// on their first attempt and a short retry backoff.
fn config_with_retries() -> String {
    format!(
        r#"
application_id = "crash"
num_stream_threads = 4
num_threads_per_task = 2
processing_order = "key"
commit_interval_ms = 50
max_batch_records = 200
retry_backoff_ms = 5
retry_backoff_max_ms = 50
retry_max_attempts = 5

[[topics]]
name = "events"
partitions = 4

[[pipelines]]
name = "count"
source_topic = "events"
processor = {{ type = "simulate", failure_rate = {FAILURE_RATE}, fail_attempts = {FAIL_ATTEMPTS}, seed = {FAILURE_SEED} }}
store = "persistent"
"#
    )
}

/// The processor of `config_with_retries`, to tell its failing records.
fn simulate() -> Simulate {
    Simulate {
        latency_ms: None,
        cpu_work_us: 0,
        failure_rate: FAILURE_RATE,
        fail_attempts: FAIL_ATTEMPTS,
        seed: FAILURE_SEED,
    }
}

/// Whether the record at (partition, offset) fails its first attempt.
type Failing<'a> = &'a dyn Fn(u32, u64) -> bool;

/// splitmix64: small, seedable, good enough to pick keys and moments.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `low..high`.
    fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low)
    }
}

/// The server process on port 0 with the crash config and data dir.
struct Server {
    child: Child,
    addr: String,
    /// The last lines of stderr, for diagnosis.
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Server {
    fn start(config: &Path, data_dir: &Path) -> Server {
        let mut command = Command::new(server_binary());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("TASKSTREAM_") {
                command.env_remove(name);
            }
        }
        command
            .env("RUST_LOG", "info")
            .arg("--config")
            .arg(config)
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("start the server binary");
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        {
            let tail = tail.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                    if tail.len() == 200 {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            });
        }
        let mut server = Server {
            child,
            addr: String::new(),
            stderr: tail,
        };
        let deadline = Instant::now() + DEADLINE;
        let mut banner = Vec::new();
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    if let Some(addr) = line.strip_prefix("taskstream listening on ") {
                        server.addr = addr.to_string();
                        return server;
                    }
                    banner.push(line);
                }
                Err(_) => {
                    let _ = server.child.kill();
                    let status = server.child.wait();
                    panic!(
                        "the server did not print `taskstream listening on` within {DEADLINE:?} \
                         (exit: {status:?})\nstdout:\n{}\nstderr:\n{}",
                        banner.join("\n"),
                        server.stderr_tail()
                    );
                }
            }
        }
    }

    fn stderr_tail(&self) -> String {
        let tail = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
        tail.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// SIGKILL (what `Child::kill` sends on Unix), and reap it.
    fn kill(&mut self) {
        self.child.kill().expect("SIGKILL the server");
        let status = self.child.wait().expect("wait for the killed server");
        assert!(!status.success(), "the server was not killed: {status}");
    }

    /// SIGTERM, then a bounded wait for its exit status.
    fn terminate(&mut self) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed: {status}");
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the server did not exit within {DEADLINE:?} of SIGTERM\nstderr:\n{}",
                self.stderr_tail()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One record as the test knows it: where it must land and what it carries.
#[derive(Clone)]
struct Sent {
    partition: u32,
    key: Bytes,
    value: Bytes,
}

/// What the log must hold: per partition, every landed record in offset order.
/// Batches are sent one at a time, so a partition is their concatenation.
#[derive(Default)]
struct Expected {
    partitions: BTreeMap<u32, Vec<Sent>>,
    batches_landed: usize,
    batches_acknowledged: usize,
}

impl Expected {
    fn ends(&self) -> BTreeMap<u32, i64> {
        (0..PARTITIONS)
            .map(|p| (p, self.partitions.get(&p).map_or(0, Vec::len) as i64))
            .collect()
    }

    fn ends_with(&self, batch: &[Sent]) -> BTreeMap<u32, i64> {
        let mut ends = self.ends();
        for record in batch {
            *ends.entry(record.partition).or_default() += 1;
        }
        ends
    }

    fn land(&mut self, batch: Vec<Sent>) {
        for record in batch {
            self.partitions.entry(record.partition).or_default().push(record);
        }
        self.batches_landed += 1;
    }

    /// Counts per key of the first `positions[p]` records of each partition.
    fn counts_at(&self, positions: &BTreeMap<u32, i64>) -> BTreeMap<Bytes, u64> {
        let mut counts = BTreeMap::new();
        for (p, records) in &self.partitions {
            let upto = positions.get(p).copied().unwrap_or(0) as usize;
            for record in &records[..upto.min(records.len())] {
                *counts.entry(record.key.clone()).or_default() += 1;
            }
        }
        counts
    }

    /// Per key, how many of the first `positions[p]` records a store at that
    /// checkpoint has surely applied when `failing` records may still be on the
    /// retry path: those before the key's first failing record. From it on, the
    /// failing record may wait for its retry and (key order) every later record
    /// of its key may be parked behind it.
    fn settled_counts_at(&self, positions: &BTreeMap<u32, i64>, failing: Failing) -> BTreeMap<Bytes, u64> {
        let mut counts = BTreeMap::new();
        for (p, records) in &self.partitions {
            let upto = positions.get(p).copied().unwrap_or(0) as usize;
            let mut waiting: HashSet<&Bytes> = HashSet::new();
            for (offset, record) in records[..upto.min(records.len())].iter().enumerate() {
                if waiting.contains(&record.key) {
                    continue;
                }
                if failing(*p, offset as u64) {
                    waiting.insert(&record.key);
                    continue;
                }
                *counts.entry(record.key.clone()).or_default() += 1;
            }
        }
        counts
    }

    /// How many of the first `positions[p]` records are failing ones.
    fn failing_below(&self, positions: &BTreeMap<u32, i64>, failing: Failing) -> usize {
        self.partitions
            .iter()
            .map(|(p, records)| {
                let upto = (positions.get(p).copied().unwrap_or(0) as usize).min(records.len());
                (0..upto).filter(|&o| failing(*p, o as u64)).count()
            })
            .sum()
    }

    /// A key's records, for diagnosis: its partition and its offsets (`!` marks
    /// a failing one, `|` the position).
    fn key_history(&self, key: &Bytes, positions: &BTreeMap<u32, i64>, failing: Option<Failing>) -> String {
        let p = partition_for_key(key, PARTITIONS);
        let position = positions.get(&p).copied().unwrap_or(0) as usize;
        let records = self.partitions.get(&p).map_or(&[][..], Vec::as_slice);
        let mut offsets = Vec::new();
        for (offset, record) in records.iter().enumerate() {
            if offset == position {
                offsets.push("|".to_string());
            }
            if record.key == *key {
                let mark = if failing.is_some_and(|f| f(p, offset as u64)) {
                    "!"
                } else {
                    ""
                };
                offsets.push(format!("{offset}{mark}"));
            }
        }
        format!(
            "{key:?} in partition {p} (position {position}): {}",
            offsets.join(" ")
        )
    }
}

fn make_batch(rng: &mut Rng, index: usize) -> Vec<Sent> {
    (0..BATCH)
        .map(|i| {
            let key = Bytes::from(format!("key-{:04}", rng.range(0, KEYS)));
            Sent {
                partition: partition_for_key(&key, PARTITIONS),
                key,
                value: Bytes::from(format!("{index}-{i}")),
            }
        })
        .collect()
}

/// Retries a call while the server answers UNAVAILABLE or cannot be reached yet.
async fn retry<T, F, Fut>(what: &str, mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut backoff = Duration::from_millis(5);
    loop {
        match call().await {
            Ok(value) => return value,
            Err(e @ (ClientError::NotAvailable { .. } | ClientError::Transport { .. })) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{what}: still failing after {DEADLINE:?}: {e}"
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

/// The pipeline's metadata (retry backlog, dead-lettered) and its tasks.
async fn describe(client: &StreamsClient) -> (v1::PipelineMetadata, Vec<v1::TaskMetadata>) {
    let runtime = retry("DescribeRuntime", || client.describe_runtime()).await;
    let pipeline = runtime
        .pipelines
        .iter()
        .find(|p| p.name == STORE)
        .cloned()
        .unwrap_or_else(|| panic!("no pipeline `{STORE}`: {:#?}", runtime.pipelines));
    let tasks: Vec<v1::TaskMetadata> = runtime
        .tasks
        .into_iter()
        .filter(|t| t.pipeline == STORE)
        .collect();
    assert_eq!(tasks.len(), PARTITIONS as usize, "{tasks:#?}");
    (pipeline, tasks)
}

fn end_offsets(tasks: &[v1::TaskMetadata]) -> BTreeMap<u32, i64> {
    tasks.iter().map(|t| (t.partition, t.end_offset)).collect()
}

/// The whole store (every partition) with each partition's position.
async fn read_store(client: &StreamsClient) -> (BTreeMap<Bytes, u64>, BTreeMap<u32, i64>) {
    let request = v1::QueryRequest {
        store: STORE.to_string(),
        query: Some(v1::query_request::Query::Range(v1::RangeQuery {
            from: None,
            to: None,
        })),
        ..Default::default()
    };
    let response = retry("Query range", || client.query(request.clone())).await;
    let mut counts = BTreeMap::new();
    let mut positions = BTreeMap::new();
    for result in response.results {
        positions.insert(result.partition, result.position);
        for entry in result.entries {
            let count: u64 = std::str::from_utf8(&entry.value)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("not a count: {:?}", entry.value));
            assert!(
                counts.insert(entry.key.clone(), count).is_none(),
                "key {:?} answered by two partitions",
                entry.key
            );
        }
    }
    (counts, positions)
}

async fn connect(addr: &str) -> StreamsClient {
    retry("connect", || StreamsClient::connect(addr)).await
}

/// Right after a restart: the log holds every acknowledged batch, plus the
/// in-doubt one entirely or not at all; the store is exactly its checkpoint
/// (with `failing` records: but for records below it still on the retry path).
async fn check_restart(
    client: &StreamsClient,
    expected: &mut Expected,
    in_doubt: Option<Vec<Sent>>,
    kill: usize,
    failing: Option<Failing<'_>>,
) -> &'static str {
    let (pipeline, tasks) = describe(client).await;
    let ends = end_offsets(&tasks);
    let without = expected.ends();
    let verdict = match in_doubt {
        None => {
            assert_eq!(
                ends, without,
                "kill {kill}: the log does not hold exactly the acknowledged batches"
            );
            "no batch in doubt"
        }
        Some(batch) => {
            let with = expected.ends_with(&batch);
            if ends == with {
                expected.land(batch);
                "the batch in doubt landed (counted, not re-sent)"
            } else {
                assert_eq!(
                    ends, without,
                    "kill {kill}: end offsets match neither the acknowledged batches ({without:?}) \
                     nor them plus the batch in flight ({with:?}): a batch half-written or an \
                     acknowledged record lost"
                );
                "the batch in doubt did not land (dropped, not re-sent)"
            }
        }
    };
    let (counts, positions) = read_store(client).await;
    for (p, position) in &positions {
        assert!(
            *position <= ends[p],
            "kill {kill}: partition {p} answers at {position}, past its end {}",
            ends[p]
        );
    }
    let exact = expected.counts_at(&positions);
    let Some(failing) = failing else {
        assert_eq!(
            counts, exact,
            "kill {kill}: the store after the restart is not exactly its checkpoint {positions:?}"
        );
        println!("  after restart {kill}: end offsets {ends:?}, store checkpoint {positions:?}");
        return verdict;
    };
    // A record below the checkpoint may still be on the retry path (failing, or
    // parked behind a failing record of its key): never applied twice, never
    // applied before the checkpoint's position, and settled ones applied.
    let settled = expected.settled_counts_at(&positions, failing);
    let mut waiting = 0;
    let mut wrong = Vec::new();
    for key in exact.keys().chain(counts.keys()).collect::<BTreeSet<_>>() {
        let (low, got, high) = (
            settled.get(key).copied().unwrap_or(0),
            counts.get(key).copied().unwrap_or(0),
            exact.get(key).copied().unwrap_or(0),
        );
        waiting += high.saturating_sub(got);
        if got < low || got > high {
            wrong.push((key.clone(), low, got, high));
        }
    }
    assert!(
        wrong.is_empty(),
        "kill {kill}: {} keys counted outside [settled, exact] at the checkpoint {positions:?}; \
         (key, settled, actual, exact), first 10: {:?}\nfirst: {}",
        wrong.len(),
        &wrong[..wrong.len().min(10)],
        expected.key_history(&wrong[0].0, &positions, Some(failing))
    );
    println!(
        "  after restart {kill}: end offsets {ends:?}, store checkpoint {positions:?}, {} failing \
         records below it, {waiting} records below it not applied yet, retry backlog {} (per task {:?})",
        expected.failing_below(&positions, failing),
        pipeline.retry_backlog,
        tasks.iter().map(|t| t.retry_backlog).collect::<Vec<_>>()
    );
    verdict
}

/// Starts the server again on the same data dir (a new port), then checks what
/// survived the kill (`check_restart`).
async fn restart(
    server: &mut Server,
    config: &Path,
    data_dir: &Path,
    expected: &mut Expected,
    in_doubt: Option<Vec<Sent>>,
    kill: usize,
    failing: Option<Failing<'_>>,
) -> StreamsClient {
    let started = Instant::now();
    *server = Server::start(config, data_dir);
    let client = connect(&server.addr).await;
    let verdict = check_restart(&client, expected, in_doubt, kill, failing).await;
    println!(
        "  restarted in {:?} on {}: {verdict}",
        started.elapsed(),
        server.addr
    );
    client
}

/// What the retry topic retains after the run, per source record (the retry
/// topic's partition is the source's): how often it was appended, with which
/// attempt counts (1: its first attempt failed; 0: parked behind its key).
struct RetryTopic {
    /// Per partition, the retained range of retry offsets.
    retained: Vec<(u64, u64)>,
    appended: BTreeMap<(u32, u64), Vec<u32>>,
}

impl RetryTopic {
    /// Reads the retained retry topic and checks each entry against the source
    /// record it names: same key and value, and a first failure only for a
    /// failing record (so `failing` is the processor's own choice).
    fn read(log: &RedbLog, expected: &Expected, failing: Failing) -> RetryTopic {
        use taskstream_server::{RetryEntry, failure_headers::VOID};
        let mut retained = Vec::new();
        let mut appended: BTreeMap<(u32, u64), Vec<u32>> = BTreeMap::new();
        for p in 0..PARTITIONS {
            let start = log.start_offset(RETRY_TOPIC, p).expect("start offset");
            let end = log.end_offset(RETRY_TOPIC, p).expect("end offset");
            retained.push((start, end));
            let sources = expected.partitions.get(&p).map_or(&[][..], Vec::as_slice);
            let mut next = start;
            while next < end {
                let mut records = Vec::new();
                log.read(RETRY_TOPIC, p, next, 10_000, &mut records)
                    .expect("read the retry topic");
                let Some(last) = records.last() else {
                    panic!("partition {p}: the retry topic ends at {next}, not {end}")
                };
                next = last.offset + 1;
                for record in &records {
                    // A restart's marker voiding entries of the pass it discarded.
                    if record.headers.iter().any(|(n, _)| n == VOID) {
                        continue;
                    }
                    let entry = RetryEntry::of(record)
                        .unwrap_or_else(|| panic!("retry record without its entry: {record:?}"));
                    assert_eq!(
                        entry.partition, p,
                        "a retry partition holds its source partition's records"
                    );
                    let (offset, attempts) = (entry.offset, entry.attempts);
                    let source = sources
                        .get(offset as usize)
                        .unwrap_or_else(|| panic!("retry record of a source never written: {record:?}"));
                    assert_eq!(
                        (record.key.as_ref(), &record.value),
                        (Some(&source.key), &source.value),
                        "retry record {} of partition {p} (source offset {offset})",
                        record.offset
                    );
                    assert!(
                        attempts == 0 || failing(p, offset),
                        "partition {p} offset {offset} failed ({attempts} attempts) but is not a \
                         failing record: the test's Simulate is not the server's"
                    );
                    appended.entry((p, offset)).or_default().push(attempts);
                }
            }
        }
        RetryTopic { retained, appended }
    }

    /// Source records appended more than once (each append is a retry item
    /// that runs once, unless final in the store's checkpoint).
    fn summary(&self) -> String {
        let repeated: Vec<_> = self.appended.iter().filter(|(_, a)| a.len() > 1).collect();
        let extra: usize = repeated.iter().map(|(_, a)| a.len() - 1).sum();
        format!(
            "retry topic: retained {:?}, {} entries for {} source records; {} source records \
             appended more than once ({extra} extra entries), first 10 ((partition, offset), \
             attempts of each entry): {:?}",
            self.retained,
            self.appended.values().map(Vec::len).sum::<usize>(),
            self.appended.len(),
            repeated.len(),
            &repeated[..repeated.len().min(10)]
        )
    }
}

/// The two variants share one machine: run them one after the other so each
/// gets the CPU its timing assumes.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn sigkill_at_random_moments_loses_and_double_applies_nothing() {
    crash_test("crash", CONFIG, None);
}

/// Records fail (and, in key order, park their keys) while the kills land:
/// each must still be applied exactly once.
#[test]
fn sigkill_while_records_go_through_the_retry_topic_applies_each_once() {
    let simulate = simulate();
    let failing = |partition: u32, offset: u64| simulate.is_failing_record(partition, offset);
    crash_test("crash-retries", &config_with_retries(), Some(&failing));
}

/// Produces every batch while the server started with `config_text` processes
/// them, kills it at random moments and checks each restart (`check_restart`),
/// then checks the final counts, the retry and dead-letter topics and the log.
/// `failing`: the records the processor fails on their first attempt, if any.
fn crash_test(name: &str, config_text: &str, failing: Option<Failing<'_>>) {
    let _one_at_a_time = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let seed = std::env::var("TASKSTREAM_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!(
        "{name}: seed {seed} (TASKSTREAM_CRASH_SEED={seed} replays keys and kill moments; timing varies)"
    );
    let mut rng = Rng(seed);

    // One kill in each fifth of the batches (after the first few), each after a
    // random delay: during a produce, between produces, during a commit.
    let kill_after: Vec<usize> = (0..KILLS)
        .map(|k| {
            let span = (BATCHES - 20) / KILLS;
            10 + k * span + rng.range(0, span as u64) as usize
        })
        .collect();
    let kill_delay: Vec<Duration> = (0..KILLS)
        .map(|_| Duration::from_millis(rng.range(0, 120)))
        .collect();
    println!("kills after batch {kill_after:?} plus {kill_delay:?}");

    let dir = temp_dir(name);
    let data_dir = dir.path().join("data");
    let config = dir.path().join("crash.toml");
    std::fs::write(&config, config_text).expect("write the config");
    server_binary();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut server = Server::start(&config, &data_dir);
    let mut expected = Expected::default();
    let mut kills_done = 0;

    let (config, data_dir) = (config.as_path(), data_dir.as_path());
    let (mut server, expected, counted) = runtime.block_on(async move {
        let mut client = connect(&server.addr).await;
        let mut kill_at: Option<tokio::time::Instant> = None;
        let mut next = 0;
        let mut batch = make_batch(&mut rng, next);
        while next < BATCHES {
            assert!(
                started.elapsed() < TEST_DEADLINE,
                "the test ran past {TEST_DEADLINE:?}"
            );
            if kill_at.is_none() && kills_done < KILLS && expected.batches_landed >= kill_after[kills_done] {
                kill_at = Some(tokio::time::Instant::now() + kill_delay[kills_done]);
            }
            // Produces are spread over time, so some kills land between them.
            let pause = Duration::from_micros(rng.range(0, 3_000));
            let records: Vec<v1::ProducerRecord> = batch
                .iter()
                .map(|r| keyed_record(r.key.clone(), r.value.clone()))
                .collect();
            let sender = client.clone();
            let mut call = tokio::spawn(async move {
                tokio::time::sleep(pause).await;
                sender.produce(TOPIC, records).await
            });
            let (killed, finished) = match kill_at {
                Some(at) => tokio::select! {
                    done = &mut call => (false, Some(done)),
                    _ = tokio::time::sleep_until(at) => (true, None),
                },
                None => (false, Some((&mut call).await)),
            };
            if killed {
                let in_flight = !call.is_finished();
                server.kill();
                kill_at = None;
                kills_done += 1;
                println!(
                    "kill {kills_done} at {:?}: {} batches acknowledged, batch {next} {}",
                    started.elapsed(),
                    expected.batches_acknowledged,
                    if in_flight { "in flight" } else { "answered" }
                );
            }
            let result = match finished {
                Some(done) => done,
                // A call cut by the kill ends with a transport error at once.
                None => tokio::time::timeout(DEADLINE, call)
                    .await
                    .expect("a produce call outlived its server"),
            }
            .expect("the produce task panicked");
            let landed = match result {
                Ok(response) => {
                    // Acknowledged: it is in the log at exactly the predicted offsets.
                    assert_eq!(
                        response.positions.len(),
                        BATCH,
                        "batch {next}: one position per record"
                    );
                    let mut predicted = expected.ends();
                    for (record, position) in batch.iter().zip(&response.positions) {
                        let offset = predicted.get_mut(&record.partition).expect("partition");
                        assert_eq!(
                            (position.partition, position.offset),
                            (record.partition, *offset),
                            "batch {next}: a record landed elsewhere than predicted"
                        );
                        *offset += 1;
                    }
                    expected.batches_acknowledged += 1;
                    expected.land(std::mem::take(&mut batch));
                    true
                }
                Err(ClientError::NotAvailable { .. }) if !killed => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    false
                }
                Err(e) if killed => {
                    assert!(
                        matches!(
                            e,
                            ClientError::Transport { .. } | ClientError::NotAvailable { .. }
                        ),
                        "batch {next} cut by the kill: {e:?}"
                    );
                    false
                }
                Err(e) => panic!("batch {next}: {e:?}\nstderr:\n{}", server.stderr_tail()),
            };
            if killed {
                // Never re-sent: a batch that landed without its answer is counted once.
                let in_doubt = (!landed).then(|| std::mem::take(&mut batch));
                client = restart(
                    &mut server,
                    config,
                    data_dir,
                    &mut expected,
                    in_doubt,
                    kills_done,
                    failing,
                )
                .await;
            }
            if batch.is_empty() {
                next += 1;
                if next < BATCHES {
                    batch = make_batch(&mut rng, next);
                }
            }
        }
        // A kill still due once every batch is sent lands while the backlog is processed.
        while kills_done < KILLS {
            let at = kill_at.unwrap_or_else(|| tokio::time::Instant::now() + kill_delay[kills_done]);
            tokio::time::sleep_until(at).await;
            server.kill();
            kill_at = None;
            kills_done += 1;
            println!(
                "kill {kills_done} at {:?}: every batch sent, {} acknowledged",
                started.elapsed(),
                expected.batches_acknowledged
            );
            client = restart(
                &mut server,
                config,
                data_dir,
                &mut expected,
                None,
                kills_done,
                failing,
            )
            .await;
        }

        // Every task's watermark reaches its end offset and every retry its
        // final outcome, then the store answers there.
        let ends = expected.ends();
        let deadline = tokio::time::Instant::now() + DEADLINE;
        let (pipeline, tasks) = loop {
            let (pipeline, tasks) = describe(&client).await;
            assert_eq!(
                end_offsets(&tasks),
                ends,
                "the log holds other records than expected"
            );
            if tasks
                .iter()
                .all(|t| t.watermark == t.end_offset && t.retry_backlog == 0)
                && pipeline.retry_backlog == 0
            {
                break (pipeline, tasks);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the tasks did not catch up within {DEADLINE:?}: {pipeline:#?}\n{tasks:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let caught_up = started.elapsed();
        let mut counts = loop {
            let (counts, positions) = read_store(&client).await;
            if positions == ends {
                break counts;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the store never answered at the end offsets {ends:?}: positions {positions:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let want = expected.counts_at(&ends);
        // With retries, the last ones may finish after the commit of the end
        // offsets and reach the store with the next commit (every
        // `commit_interval_ms`): wait while some key is short, a few seconds at
        // most. A count above the expected one is never taken back.
        let settle_deadline = tokio::time::Instant::now() + SETTLE;
        let mut polls = 1;
        while failing.is_some()
            && want
                .iter()
                .any(|(key, count)| counts.get(key).copied().unwrap_or(0) < *count)
            && tokio::time::Instant::now() < settle_deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let (now, positions) = read_store(&client).await;
            assert_eq!(positions, ends, "the store moved past the end offsets");
            counts = now;
            polls += 1;
        }
        let total: u64 = counts.values().sum();
        let in_log: i64 = ends.values().sum();
        println!(
            "caught up at {caught_up:?}; {} batches acknowledged, {} landed, {in_log} records in the log, \
             {total} counted over {} keys ({polls} store reads at the end offsets); final run: {} failed \
             attempts, {} dead-lettered, retry backlog {}",
            expected.batches_acknowledged,
            expected.batches_landed,
            counts.len(),
            tasks.iter().map(|t| t.records_failed).sum::<u64>(),
            pipeline.dead_lettered,
            pipeline.retry_backlog
        );
        assert_eq!(
            pipeline.dead_lettered, 0,
            "records were dead-lettered: {pipeline:#?}\n{tasks:#?}"
        );
        assert_eq!(
            tasks.iter().map(|t| t.records_dead_lettered).sum::<u64>(),
            0,
            "{tasks:#?}"
        );
        let wrong: Vec<_> = want
            .iter()
            .map(|(key, count)| (key, Some(*count)))
            .chain(
                counts
                    .keys()
                    .filter(|key| !want.contains_key(*key))
                    .map(|key| (key, None)),
            )
            .filter(|(key, count)| counts.get(*key).copied() != *count)
            .map(|(key, count)| (key.clone(), count, counts.get(key).copied()))
            .collect();
        // Checked after the server's exit, with what its retry topic shows.
        let counted = if wrong.is_empty() && total == in_log as u64 {
            Ok(())
        } else {
            let histories: Vec<String> = wrong
                .iter()
                .take(3)
                .map(|(key, _, _)| expected.key_history(key, &ends, failing))
                .collect();
            Err(format!(
                "{} keys counted wrong (key, expected, actual), first 10: {:?}; {} keys counted, {} \
                 expected; {total} counted for {in_log} records in the log\n{}",
                wrong.len(),
                &wrong[..wrong.len().min(10)],
                counts.len(),
                want.len(),
                histories.join("\n")
            ))
        };
        assert_eq!(in_log as usize, expected.batches_landed * BATCH);
        assert!(expected.batches_acknowledged >= BATCHES - KILLS);
        (server, expected, counted)
    });
    drop(runtime);

    let status = server.terminate();
    assert_eq!(
        status.code(),
        Some(0),
        "exit after SIGTERM\nstderr:\n{}",
        server.stderr_tail()
    );

    for p in 0..PARTITIONS {
        let store = data_dir
            .join("stores")
            .join(APPLICATION_ID)
            .join(format!("{STORE}_{p}.redb"));
        assert!(store.is_file(), "no persistent store at {}", store.display());
    }

    let log = RedbLog::open(data_dir).expect("open the log after the run");
    // Nothing dead-lettered; every failing record went through the retry topic
    // (at least once: parked records and the first failures re-made after a
    // kill are appended too), and without failures nothing did.
    let end_of = |topic: &str| -> u64 {
        (0..PARTITIONS)
            .map(|p| log.end_offset(topic, p).expect("end offset"))
            .sum()
    };
    let (retried, dead_lettered) = (end_of(RETRY_TOPIC), end_of(DEAD_LETTER_TOPIC));
    let failing_in_log = failing.map_or(0, |f| expected.failing_below(&expected.ends(), f));
    let retry_topic = failing.map(|f| RetryTopic::read(&log, &expected, f));
    println!(
        "{retried} records appended to `{RETRY_TOPIC}` for {failing_in_log} failing records; \
         {dead_lettered} in `{DEAD_LETTER_TOPIC}`"
    );
    if let Some(retry_topic) = &retry_topic {
        println!("{}", retry_topic.summary());
    }
    if let Err(message) = counted {
        panic!(
            "{message}\n{}\nstderr:\n{}",
            retry_topic.as_ref().map_or(String::new(), RetryTopic::summary),
            server.stderr_tail()
        );
    }
    assert_eq!(dead_lettered, 0, "records were dead-lettered");
    match failing {
        None => assert_eq!(
            retried, 0,
            "records went through the retry topic without failures"
        ),
        Some(_) => {
            assert!(failing_in_log > 0, "no failing record among the records sent");
            assert!(
                retried >= failing_in_log as u64,
                "{retried} records appended to the retry topic for {failing_in_log} failing records"
            );
        }
    }

    // Record by record: every landed batch (so every acknowledged one) is in the
    // log once, at its place, with its key and value.
    for p in 0..PARTITIONS {
        let want = expected.partitions.get(&p).map_or(&[][..], Vec::as_slice);
        assert_eq!(log.start_offset(TOPIC, p).expect("start"), 0);
        assert_eq!(log.end_offset(TOPIC, p).expect("end"), want.len() as u64);
        let mut records = Vec::new();
        while records.len() < want.len() {
            let before = records.len();
            log.read(TOPIC, p, before as u64, 10_000, &mut records)
                .expect("read the log");
            assert!(records.len() > before, "partition {p}: the log ends at {before}");
        }
        for (offset, (record, sent)) in records.iter().zip(want).enumerate() {
            assert_eq!(record.offset, offset as u64);
            assert_eq!(
                (record.key.as_ref(), &record.value),
                (Some(&sent.key), &sent.value),
                "partition {p} offset {offset}"
            );
        }
    }
    drop(log);
    println!("{name}: done in {:?}", started.elapsed());
}
