//! Crash test of the durable embedded mode through the real binary: 200,000 keyed
//! records produced in batches while the server processes them into a persistent
//! `count` store, SIGKILL at 5 random moments (restarting on the same data dir),
//! then every count must be exact and every acknowledged record in the log.
//! Seeded (`TASKSTREAM_CRASH_SEED` replays a seed; the seed in use is printed).

mod common;

use bytes::Bytes;
use common::server_binary;
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use taskstream_client::{ClientError, StreamsClient, keyed_record, v1};
use taskstream_server::log::partition_for_key;
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
/// Bound on one thing the server should do promptly (start, answer, catch up).
const DEADLINE: Duration = Duration::from_secs(30);
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

/// A fresh directory under the temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!("taskstream-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create the temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
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

async fn tasks(client: &StreamsClient) -> Vec<v1::TaskMetadata> {
    let runtime = retry("DescribeRuntime", || client.describe_runtime()).await;
    let tasks: Vec<v1::TaskMetadata> = runtime
        .tasks
        .into_iter()
        .filter(|t| t.pipeline == STORE)
        .collect();
    assert_eq!(tasks.len(), PARTITIONS as usize, "{tasks:#?}");
    tasks
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
/// in-doubt one entirely or not at all; the store is exactly its checkpoint.
async fn check_restart(
    client: &StreamsClient,
    expected: &mut Expected,
    in_doubt: Option<Vec<Sent>>,
    kill: usize,
) -> &'static str {
    let ends = end_offsets(&tasks(client).await);
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
    assert_eq!(
        counts,
        expected.counts_at(&positions),
        "kill {kill}: the store after the restart is not exactly its checkpoint {positions:?}"
    );
    println!("  after restart {kill}: end offsets {ends:?}, store checkpoint {positions:?}");
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
) -> StreamsClient {
    let started = Instant::now();
    *server = Server::start(config, data_dir);
    let client = connect(&server.addr).await;
    let verdict = check_restart(&client, expected, in_doubt, kill).await;
    println!(
        "  restarted in {:?} on {}: {verdict}",
        started.elapsed(),
        server.addr
    );
    client
}

#[test]
fn sigkill_at_random_moments_loses_and_double_applies_nothing() {
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
    println!("seed {seed} (TASKSTREAM_CRASH_SEED={seed} replays keys and kill moments; timing varies)");
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

    let dir = TempDir::new("crash");
    let data_dir = dir.0.join("data");
    let config = dir.0.join("crash.toml");
    std::fs::write(&config, CONFIG).expect("write the config");
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
    let (mut server, expected) = runtime.block_on(async move {
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
                client = restart(&mut server, config, data_dir, &mut expected, in_doubt, kills_done).await;
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
            client = restart(&mut server, config, data_dir, &mut expected, None, kills_done).await;
        }

        // Every task's watermark reaches its end offset, then the store answers there.
        let ends = expected.ends();
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let tasks = tasks(&client).await;
            assert_eq!(
                end_offsets(&tasks),
                ends,
                "the log holds other records than expected"
            );
            if tasks.iter().all(|t| t.watermark == t.end_offset) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the tasks did not catch up within {DEADLINE:?}: {tasks:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let counts = loop {
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
        let total: u64 = counts.values().sum();
        let in_log: i64 = ends.values().sum();
        println!(
            "{} batches acknowledged, {} landed, {in_log} records in the log, {total} counted over {} keys",
            expected.batches_acknowledged,
            expected.batches_landed,
            counts.len()
        );
        let wrong: Vec<_> = want
            .iter()
            .filter(|(key, count)| counts.get(*key) != Some(count))
            .map(|(key, count)| (key.clone(), *count, counts.get(key).copied()))
            .take(10)
            .collect();
        assert!(
            wrong.is_empty() && counts.len() == want.len(),
            "counts differ (key, expected, actual), first 10: {wrong:?}; {} keys counted, {} expected",
            counts.len(),
            want.len()
        );
        assert_eq!(
            total, in_log as u64,
            "the counts do not add up to the records in the log"
        );
        assert_eq!(in_log as usize, expected.batches_landed * BATCH);
        assert!(expected.batches_acknowledged >= BATCHES - KILLS);
        (server, expected)
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

    // Record by record: every landed batch (so every acknowledged one) is in the
    // log once, at its place, with its key and value.
    let log = RedbLog::open(data_dir).expect("open the log after the run");
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
    println!("done in {:?}", started.elapsed());
}
