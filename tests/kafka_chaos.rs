//! The chaos test: three server binaries on Apache Kafka with persistent
//! stores, a remote-processor pipeline (examples/rust-processor: a count per
//! key through state operations, one output per record to a sink topic) and
//! a producer at a steady rate, through a seeded schedule of faults, one at a
//! time: an instance SIGKILLed and restarted; SIGSTOPped past the session
//! timeout and continued (a zombie its group has fenced); SIGTERMed and
//! restarted; the broker killed and restarted; the remote processor killed
//! and restarted. At the end every record the source topic holds must be
//! counted once in the stores and be in the sink topic (read_committed)
//! once under exactly_once_v2 — at least once under at_least_once, the
//! duplicates reported — nothing dead-lettered, every partition processing.
//!
//! `TASKSTREAM_CHAOS_FAULTS` (default 10), `TASKSTREAM_CHAOS_SEED` and
//! `TASKSTREAM_CHAOS_KINDS` (e.g. `kill,pause`; default: every kind the test
//! takes) set the schedule. A long run:
//! `TASKSTREAM_CHAOS_FAULTS=100 cargo test --release --test kafka_chaos -- --include-ignored`.
//!
//! Under exactly_once_v2 the broker restart is a test of its own: a single
//! broker that restarts and times out a transaction open across the outage
//! before its partitions have a leader skips the transaction's abort
//! markers ("Couldn't find leader endpoint … likely deleted already"), and
//! read_committed readers then see the aborted records (see README,
//! exactly-once).

mod common;

use common::instance::{Instance, Launch, counts_of, runtime, share_all};
use common::kafka::{Broker, launch, missing_tool, unique};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use taskstream_server::Log as _;
use taskstream_server::log::KafkaLog;

const PARTITIONS: u32 = 6;
const KEYS: u64 = 60;
/// Bound on a recovery: generous; the report says how long each took.
const DEADLINE: Duration = Duration::from_secs(180);
/// The tests' broker times a group session out after 6 s.
const PAST_THE_SESSION: Duration = Duration::from_secs(9);

/// A small seeded generator (xorshift64*): the schedule is reproducible from its seed.
struct Schedule(u64);

impl Schedule {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn between(&mut self, from: Duration, to: Duration) -> Duration {
        let span = (to - from).as_millis() as u64;
        from + Duration::from_millis(self.below(span.max(1)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    Pause,
    Terminate,
    Broker,
    Processor,
}

const KINDS: [Fault; 5] = [
    Fault::Kill,
    Fault::Pause,
    Fault::Terminate,
    Fault::Broker,
    Fault::Processor,
];

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The remote processor on its fixed port, restartable.
struct Processor {
    binary: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Processor {
    fn start(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut child = Command::new(&self.binary)
                .arg(format!("127.0.0.1:{}", self.port))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start the processor");
            // Its port may still be in TIME_WAIT use for a moment after a kill.
            std::thread::sleep(Duration::from_millis(300));
            if matches!(child.try_wait(), Ok(None)) {
                self.child = Some(child);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the processor does not start on its port"
            );
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Processor {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Application {
    name: String,
    topic: String,
    sink: String,
    config: PathBuf,
    dir: taskstream_server::scratch::TempDir,
}

impl Application {
    fn new(guarantee: &str, processor_port: u16) -> Application {
        let name = unique(&format!("chaos-{}", guarantee.replace('_', "-")));
        let topic = format!("{name}-events");
        let sink = format!("{name}-out");
        let dir = taskstream_server::scratch::scratch_dir("chaos").expect("a scratch dir");
        let config = dir.path().join("taskstream.toml");
        std::fs::write(
            &config,
            format!(
                r#"
                application_id = "{name}"
                num_stream_threads = 2
                replication_factor = 1
                processing_guarantee = "{guarantee}"
                [kafka]
                "transaction.timeout.ms" = 10000
                [[topics]]
                name = "{topic}"
                partitions = {PARTITIONS}
                [[topics]]
                name = "{sink}"
                partitions = {PARTITIONS}
                [[pipelines]]
                name = "enriched"
                source_topic = "{topic}"
                processor = {{ type = "grpc", endpoint = "http://127.0.0.1:{processor_port}", include_state = true }}
                sink_topic = "{sink}"
                "#
            ),
        )
        .expect("write the config");
        Application {
            name,
            topic,
            sink,
            config,
            dir,
        }
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("instance-{i}.log"))
    }

    fn start(&self, broker: &Broker, i: usize) -> Instance {
        let data_dir = self.dir.path().join(format!("data-{i}"));
        Launch::kafka(&self.config, &broker.bootstrap)
            .data_dir(Some(&data_dir))
            .log_file(self.log(i))
            .start()
    }
}

/// Every record of `topic` (read_committed): per partition and offset, its
/// key and the value or the header `header`.
fn read_all(broker: &Broker, topic: &str, header: Option<&str>) -> Vec<(u32, u64, String, String)> {
    let mut settings = BTreeMap::new();
    settings.insert("isolation.level".to_string(), "read_committed".to_string());
    settings.insert("enable.partition.eof".to_string(), "true".to_string());
    let reader = KafkaLog::with_settings(&broker.bootstrap, &settings, 1).expect("connect to the broker");
    let mut all = Vec::new();
    for partition in 0..reader.partitions(topic).unwrap_or(0) {
        let end = reader.end_offset(topic, partition).expect("end offset");
        let mut next = reader.start_offset(topic, partition).expect("start offset");
        let mut batch = Vec::new();
        while next < end {
            batch.clear();
            reader
                .read(topic, partition, next, 1_000, &mut batch)
                .expect("read the topic");
            let Some(last) = batch.last() else { break };
            next = last.offset + 1;
            for record in &batch {
                let value = match header {
                    Some(name) => record
                        .headers
                        .iter()
                        .find(|(n, _)| n == name)
                        .map(|(_, v)| v.clone())
                        .unwrap_or_default(),
                    None => record.value.clone(),
                };
                all.push((
                    partition,
                    record.offset,
                    String::from_utf8_lossy(record.key.as_deref().unwrap_or_default()).into_owned(),
                    String::from_utf8_lossy(&value).into_owned(),
                ));
            }
        }
    }
    all
}

/// The sum of every task's watermark the instances describe, sampled by a
/// thread: the longest time it did not grow while records flowed is the
/// run's longest stall.
struct StallMeter {
    addresses: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    longest_ms: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StallMeter {
    fn start(addresses: Vec<String>) -> StallMeter {
        let addresses = Arc::new(Mutex::new(addresses));
        let stop = Arc::new(AtomicBool::new(false));
        let longest_ms = Arc::new(AtomicU64::new(0));
        let thread = {
            let (addresses, stop, longest_ms) = (addresses.clone(), stop.clone(), longest_ms.clone());
            std::thread::spawn(move || {
                let runtime = runtime();
                let mut last = 0i64;
                let mut since = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let now_addresses = addresses.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let total: i64 = runtime.block_on(async {
                        let mut total = 0;
                        for address in &now_addresses {
                            let Ok(client) =
                                taskstream_client::StreamsClient::connect(address.as_str()).await
                            else {
                                continue;
                            };
                            if let Ok(described) = client.describe_runtime().await {
                                total += described.tasks.iter().map(|t| t.watermark).sum::<i64>();
                            }
                        }
                        total
                    });
                    if total > last {
                        last = total;
                        since = Instant::now();
                    }
                    let stalled = since.elapsed().as_millis() as u64;
                    longest_ms.fetch_max(stalled, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(250));
                }
            })
        };
        StallMeter {
            addresses,
            stop,
            longest_ms,
            thread: Some(thread),
        }
    }

    fn set(&self, i: usize, address: String) {
        self.addresses.lock().unwrap_or_else(|e| e.into_inner())[i] = address;
    }

    fn stop(&mut self) -> Duration {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        Duration::from_millis(self.longest_ms.load(Ordering::Relaxed))
    }
}

/// Produces keyed records `v<n>` at a steady rate until stopped; answers
/// how many the broker acknowledged. A batch the broker did not acknowledge
/// (it was down) may still have landed: the source topic, read back, is
/// what the run is checked against.
fn producer(
    bootstrap: String,
    topic: String,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, Vec<String>)> {
    std::thread::spawn(move || {
        let log = KafkaLog::with_settings(&bootstrap, &BTreeMap::new(), 1).expect("connect to the broker");
        let mut n = 0u64;
        let mut acknowledged = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let values: Vec<String> = (n..n + 10).map(|i| format!("v{i}")).collect();
            let batch = values
                .iter()
                .enumerate()
                .map(|(j, value)| {
                    taskstream_server::ProducerRecord::keyed(
                        format!("k{}", (n + j as u64) % KEYS),
                        value.clone(),
                    )
                })
                .collect();
            if log.append(&topic, batch).is_ok() {
                acknowledged.extend(values);
            }
            n += 10;
            std::thread::sleep(Duration::from_millis(50));
        }
        (n, acknowledged)
    })
}

/// `eventually_within` the test's `DEADLINE`.
fn eventually(what: &str, logs: &[PathBuf], condition: impl FnMut() -> bool) -> Duration {
    common::instance::eventually_within(DEADLINE, what, logs, condition)
}

fn all(instances: &[Instance]) -> Vec<&Instance> {
    instances.iter().collect()
}

/// Copies the instances' and the broker's logs out of the scratch dir when
/// the test fails (it is removed then), for the post-mortem.
struct LogKeeper {
    kept: PathBuf,
    logs: Vec<(PathBuf, String)>,
}

impl Drop for LogKeeper {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let _ = std::fs::create_dir_all(&self.kept);
        for (log, name) in &self.logs {
            let _ = std::fs::copy(log, self.kept.join(name));
        }
        eprintln!("logs kept in {}", self.kept.display());
    }
}

/// Every kind but the broker restart (see the module's doc).
const KINDS_BUT_BROKER: [Fault; 4] = [Fault::Kill, Fault::Pause, Fault::Terminate, Fault::Processor];

fn chaos(guarantee: &str, default_kinds: &[Fault]) {
    if let Some(reason) = missing_tool() {
        eprintln!("skipping: {reason}");
        return;
    }
    let faults = env_number("TASKSTREAM_CHAOS_FAULTS", 10) as usize;
    let seed = env_number("TASKSTREAM_CHAOS_SEED", 0x5eed_2026);
    let broker = launch().expect("start a broker of this test's own");
    let mut processor = Processor {
        binary: common::example_binary("rust-processor"),
        port: free_port(),
        child: None,
    };
    processor.start();
    let app = Application::new(guarantee, processor.port);
    let logs: Vec<PathBuf> = (0..3).map(|i| app.log(i)).collect();
    println!(
        "chaos {guarantee}: application {} in {}, seed {seed:#x}, {faults} faults",
        app.name,
        app.dir.path().display()
    );
    let _keeper = LogKeeper {
        kept: std::env::temp_dir().join(format!("taskstream-chaos-logs-{}", app.name)),
        logs: logs
            .iter()
            .enumerate()
            .map(|(i, log)| (log.clone(), format!("instance-{i}.log")))
            .chain([(broker.dir.join("broker.log"), "broker.log".to_string())])
            .collect(),
    };
    let mut instances: Vec<Instance> = (0..3).map(|i| app.start(&broker, i)).collect();
    let runtime = runtime();
    eventually("three instances share the partitions", &logs, || {
        runtime.block_on(share_all(&all(&instances), "enriched", PARTITIONS))
    });
    let stop = Arc::new(AtomicBool::new(false));
    let producing = producer(broker.bootstrap.clone(), app.topic.clone(), stop.clone());
    let mut stalls = StallMeter::start(instances.iter().map(|i| i.addr.clone()).collect());

    // `TASKSTREAM_CHAOS_KINDS=kill,pause,…` keeps to those kinds (to bisect a failure).
    let kinds: Vec<Fault> = match std::env::var("TASKSTREAM_CHAOS_KINDS") {
        Ok(list) => default_kinds
            .iter()
            .copied()
            .filter(|k| {
                list.split(',')
                    .any(|name| name.trim().eq_ignore_ascii_case(&format!("{k:?}")))
            })
            .collect(),
        Err(_) => default_kinds.to_vec(),
    };
    assert!(!kinds.is_empty(), "TASKSTREAM_CHAOS_KINDS names no fault kind");
    let mut schedule = Schedule(seed | 1);
    let mut injected: BTreeMap<Fault, usize> = BTreeMap::new();
    let started = Instant::now();
    for round in 0..faults {
        std::thread::sleep(schedule.between(Duration::from_secs(2), Duration::from_secs(5)));
        let fault = kinds[schedule.below(kinds.len() as u64) as usize];
        let victim = schedule.below(3) as usize;
        let began = Instant::now();
        match fault {
            Fault::Kill => {
                instances[victim].kill();
                std::thread::sleep(schedule.between(Duration::from_secs(1), Duration::from_secs(8)));
                instances[victim] = app.start(&broker, victim);
            }
            Fault::Pause => {
                instances[victim].signal("STOP");
                std::thread::sleep(PAST_THE_SESSION);
                instances[victim].signal("CONT");
            }
            Fault::Terminate => {
                assert!(
                    instances[victim].terminate(),
                    "an instance exits cleanly on SIGTERM"
                );
                instances[victim] = app.start(&broker, victim);
            }
            Fault::Broker => {
                let gone = broker.restart().expect("restart the broker");
                println!("  the broker answered again {gone:?} after it was killed");
            }
            Fault::Processor => {
                processor.kill();
                std::thread::sleep(schedule.between(Duration::from_millis(500), Duration::from_secs(4)));
                processor.start();
            }
        }
        stalls.set(victim, instances[victim].addr.clone());
        *injected.entry(fault).or_default() += 1;
        println!(
            "  fault {}: {fault:?} (instance {victim}) for {:?}",
            round + 1,
            began.elapsed()
        );
    }
    stop.store(true, Ordering::Relaxed);
    let (attempted, acknowledged) = producing.join().expect("the producer");
    let longest_stall = stalls.stop();

    let took = eventually("three instances share the partitions again", &logs, || {
        runtime.block_on(share_all(&all(&instances), "enriched", PARTITIONS))
    });
    println!("  settled {took:?} after the last fault");
    // What landed in the source topic is what must be processed.
    let source = read_all(&broker, &app.topic, None);
    let landed: std::collections::HashSet<&str> = source.iter().map(|(_, _, _, v)| v.as_str()).collect();
    let lost_by_producer = acknowledged
        .iter()
        .filter(|v| !landed.contains(v.as_str()))
        .count();
    assert_eq!(
        lost_by_producer, 0,
        "every acknowledged record is in the source topic"
    );
    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    for (_, _, key, _) in &source {
        *expected.entry(key.clone()).or_default() += 1;
    }
    let mut last = BTreeMap::new();
    eventually("the stores count every record", &logs, || {
        let Some(counts) = runtime.block_on(counts_of(&all(&instances), "enriched")) else {
            return false;
        };
        let done = expected
            .iter()
            .all(|(key, n)| counts.get(key).is_some_and(|c| c >= n));
        last = counts;
        done
    });
    let counted_twice: u64 = last.values().sum::<u64>() - expected.values().sum::<u64>();

    // The sink: each source record's output once (key and source offset).
    let outputs = read_all(&broker, &app.sink, Some("source-offset"));
    let mut seen: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut placed: BTreeMap<(String, String), Vec<(u32, u64)>> = BTreeMap::new();
    for (partition, at, key, offset) in outputs {
        *seen.entry((key.clone(), offset.clone())).or_default() += 1;
        placed.entry((key, offset)).or_default().push((partition, at));
    }
    let missing = source
        .iter()
        .filter(|(_, offset, key, _)| !seen.contains_key(&(key.clone(), offset.to_string())))
        .count();
    let duplicated: u64 = seen.values().map(|n| n - 1).sum();
    let dead = read_all(&broker, &format!("{}-enriched-dlq", app.name), None).len();
    println!(
        "chaos {guarantee}: {} faults {injected:?} in {:?}; {} records produced ({attempted} sent, {} acknowledged), \
         lost {missing}, duplicated in the sink {duplicated}, counted twice {counted_twice}, \
         dead-lettered {dead}, longest stall {longest_stall:?}",
        faults,
        started.elapsed(),
        source.len(),
        acknowledged.len()
    );
    let failing =
        missing > 0 || dead > 0 || (guarantee == "exactly_once_v2" && (duplicated > 0 || last != expected));
    if failing {
        let twice: Vec<_> = placed.iter().filter(|(_, at)| at.len() > 1).take(40).collect();
        eprintln!("outputs seen twice (first 40, with their sink partition and offset): {twice:?}");
    }
    assert_eq!(missing, 0, "every record's output is in the sink topic");
    assert_eq!(dead, 0, "nothing was meant to fail");
    if guarantee == "exactly_once_v2" {
        assert_eq!(
            duplicated, 0,
            "exactly_once_v2: each output once in the sink (read_committed)"
        );
        assert_eq!(last, expected, "exactly_once_v2: each record counted once");
    }
    // Every partition still processes: a record to each lands in the counts.
    let probe: Vec<taskstream_server::ProducerRecord> = (0..PARTITIONS)
        .map(|p| taskstream_server::ProducerRecord {
            partition: Some(p),
            ..taskstream_server::ProducerRecord::keyed(format!("probe-{p}"), "probe")
        })
        .collect();
    let log = KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1).expect("connect to the broker");
    log.append(&app.topic, probe).expect("produce the probes");
    eventually(
        "every partition processes a record after the faults",
        &logs,
        || {
            runtime
                .block_on(counts_of(&all(&instances), "enriched"))
                .is_some_and(|counts| (0..PARTITIONS).all(|p| counts.contains_key(&format!("probe-{p}"))))
        },
    );
    drop(instances);
    broker.stop();
}

#[test]
fn chaos_on_kafka_loses_nothing_and_applies_nothing_twice_exactly_once() {
    chaos("exactly_once_v2", &KINDS_BUT_BROKER);
}

#[test]
#[ignore = "the broker's limit (see the module's doc): after a restart of the one broker it skips abort markers of transactions it times out, so the sink shows aborted outputs (68-155 of ~9,900 with seed 0x5eed2026)"]
fn chaos_on_kafka_with_broker_restarts_exactly_once() {
    chaos("exactly_once_v2", &KINDS);
}

#[test]
#[ignore = "known open (issue 42): in 2 of 3 runs here, after broker restarts, some records' counts never reached the stores though every task's watermark and commit reached its end (seed 0xb: 17 of 8,570 in two partitions)"]
fn chaos_on_kafka_loses_nothing_at_least_once() {
    chaos("at_least_once", &KINDS);
}
