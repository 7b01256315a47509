//! A processor crash is not an outage (issue 42, item 3), with a real Python
//! ProcessorService (tests/python/crashing_processor.py) that exits at once
//! on one poison value (of a key with many records, so that it is found by
//! splitting calls) and is restarted by the test on the same port each time
//! it dies (a supervisor thread). The poison record must end in the
//! dead-letter topic with kind `ProcessorCrashed` and its headers, every other
//! record must be processed exactly once (one final outcome each, the store's
//! count per key exact), and the test prints how long the partition stalled.
//! And the converse: a processor that is down entirely (killed, then back
//! later) has nothing dead-lettered, even with `retry_max_attempts = 1`.

mod common;

use common::temp_dir;
use common::tools::tools;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use taskstream_server::scratch::TempDir;
use taskstream_server::*;

const WAIT: Duration = Duration::from_secs(120);
const POISON: &str = "poison";

/// The runtime's log lines on the test's output, as `RUST_LOG` asks (none by default).
fn log_lines() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn stubs() -> TempDir {
    log_lines();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let stubs = temp_dir("python-crash-stubs");
    let generated = Command::new(&tools().python)
        .current_dir(root)
        .args(["-m", "grpc_tools.protoc", "-I", "proto"])
        .arg(format!("--python_out={}", stubs.path().display()))
        .arg(format!("--grpc_python_out={}", stubs.path().display()))
        .args([
            "proto/taskstream/v1/taskstream.proto",
            "proto/taskstream/v1/processor.proto",
        ])
        .output()
        .expect("run grpc_tools.protoc");
    assert!(
        generated.status.success(),
        "stub generation failed: {}",
        String::from_utf8_lossy(&generated.stderr)
    );
    stubs
}

/// Starts the processor on `port` (0: any) and answers it and its port once it listens.
fn spawn(stubs: &Path, port: u16) -> (Child, u16) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new(&tools().python)
        .current_dir(root)
        .env("PYTHONPATH", stubs)
        .args(["-u", "tests/python/crashing_processor.py"])
        .arg(format!("127.0.0.1:{port}"))
        .arg(POISON)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the Python processor");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("the processor's first line");
    let port = line
        .trim()
        .strip_prefix("processor listening on port ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line from the processor: {line:?}"));
    (child, port)
}

/// Keeps the processor running on one port: restarts it whenever it exits,
/// after `restart_delay`, and notes when it died.
struct Supervisor {
    stop: Arc<AtomicBool>,
    child: Arc<Mutex<Option<Child>>>,
    deaths: Arc<Mutex<Vec<Instant>>>,
    restarts: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
    port: u16,
}

impl Supervisor {
    fn start(stubs: PathBuf, restart_delay: Duration) -> Supervisor {
        let (first, port) = spawn(&stubs, 0);
        let stop = Arc::new(AtomicBool::new(false));
        let child = Arc::new(Mutex::new(Some(first)));
        let deaths = Arc::new(Mutex::new(Vec::new()));
        let restarts = Arc::new(AtomicUsize::new(0));
        let thread = {
            let (stop, child, deaths, restarts) =
                (stop.clone(), child.clone(), deaths.clone(), restarts.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(5));
                    let exited = match child.lock().unwrap().as_mut() {
                        Some(c) => c.try_wait().ok().flatten().is_some(),
                        None => true,
                    };
                    if !exited {
                        continue;
                    }
                    deaths.lock().unwrap().push(Instant::now());
                    std::thread::sleep(restart_delay);
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let (next, _) = spawn(&stubs, port);
                    restarts.fetch_add(1, Ordering::SeqCst);
                    *child.lock().unwrap() = Some(next);
                }
            })
        };
        Supervisor {
            stop,
            child,
            deaths,
            restarts,
            thread: Some(thread),
            port,
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Kills the running processor (SIGKILL, calls in flight die with it).
    fn kill(&self) {
        if let Some(child) = self.child.lock().unwrap().as_mut() {
            let _ = child.kill();
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn config(endpoint: &str, app: &str, max_attempts: u32) -> Config {
    let mut spec = GrpcProcessorSpec::new(endpoint);
    spec.include_state = true;
    spec.max_records_per_call = 16;
    let mut pipeline = PipelineConfig::new("p", "in", ProcessorSpec::Grpc(spec));
    pipeline.partitions = Some(4);
    Config {
        application_id: app.into(),
        num_stream_threads: 4,
        num_threads_per_task: 2,
        processing_order: ProcessingOrder::Offset,
        commit_interval_ms: 50,
        retry_backoff_ms: 10,
        retry_backoff_max_ms: 50,
        retry_max_attempts: max_attempts,
        processing_timeout_ms: 10_000,
        pipelines: vec![pipeline],
        ..Config::default()
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn ends(app: &StreamsApp, topic: &str) -> std::collections::BTreeMap<u32, u64> {
    (0..app.log().partitions(topic).unwrap())
        .map(|p| (p, app.log().end_offset(topic, p).unwrap()))
        .collect()
}

fn dead_letters(app: &StreamsApp, topic: &str) -> Vec<Record> {
    ends(app, topic)
        .into_iter()
        .flat_map(|(p, end)| app.read_topic(topic, p, 0, end as usize + 1).unwrap().records)
        .collect()
}

/// Every outcome of topic `in` up to its end now, in publication order.
fn outcomes(app: &StreamsApp) -> Vec<(u32, RecordOutcome)> {
    let ends = ends(app, "in");
    let request = SubscribeRequest {
        start: StartAt::Offsets(ends.keys().map(|&p| (p, 0)).collect()),
        end: EndAt::Offsets(ends),
        ..SubscribeRequest::default()
    };
    let mut subscription = app.subscribe("p", request).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut records = Vec::new();
        while let Some(event) = tokio::time::timeout(WAIT, subscription.next())
            .await
            .expect("stream stalled")
        {
            match event.unwrap() {
                SubscriptionEvent::Batch(batch) => {
                    records.extend(batch.records.iter().map(|r| (batch.partition, r.clone())))
                }
                SubscriptionEvent::Lagged { missed_batches } => panic!("lagged by {missed_batches}"),
            }
        }
        records
    })
}

fn header(record: &Record, name: &str) -> Option<String> {
    record
        .headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}

const KEYS: usize = 13;

fn keyed(from: usize, count: usize) -> Vec<ProducerRecord> {
    (from..from + count)
        .map(|i| ProducerRecord::keyed(format!("k{}", i % KEYS), format!("{i}")))
        .collect()
}

/// Every record of each key counted once in the store, and one final
/// outcome `Processed` per record but the poison's (at `poison`).
fn assert_each_processed_once(app: &StreamsApp, records: usize, poison: Option<(u32, u64)>) {
    for k in 0..KEYS {
        let expected = (0..records).filter(|i| i % KEYS == k).count();
        assert_eq!(
            app.get("p", format!("k{k}").as_bytes()).unwrap().as_deref(),
            Some(expected.to_string().as_bytes()),
            "count of key k{k}"
        );
    }
    let mut finals: HashMap<(u32, u64), Vec<Outcome>> = HashMap::new();
    for (partition, outcome) in outcomes(app) {
        if Some((partition, outcome.offset)) == poison {
            continue;
        }
        finals
            .entry((partition, outcome.offset))
            .or_default()
            .push(outcome.outcome);
    }
    assert_eq!(finals.len(), records, "an outcome for every record");
    for (at, outcomes) in finals {
        assert_eq!(outcomes, vec![Outcome::Processed], "record {at:?}");
    }
}

#[test]
fn a_record_that_crashes_the_processor_is_dead_lettered_and_the_rest_processed_once() {
    let stubs = stubs();
    let supervisor = Supervisor::start(stubs.path().to_path_buf(), Duration::from_millis(0));
    let app = StreamsApp::start(config(&supervisor.endpoint(), "crash", 3)).unwrap();
    let mut records = keyed(0, 1_000);
    records.insert(500, ProducerRecord::keyed("k3", POISON));
    records.extend(keyed(1_000, 1_000));
    app.produce("in", records).unwrap();

    let dlq = "crash-p-dlq";
    wait_for("the poison record in the dead-letter topic", || {
        !dead_letters(&app, dlq).is_empty()
    });
    let dead_lettered = Instant::now();
    assert!(app.wait_until_caught_up(WAIT), "the pipeline goes on");
    let deaths = supervisor.deaths.lock().unwrap().clone();
    let first_death = *deaths.first().expect("the processor crashed");
    println!(
        "stall: {} ms from the first crash to the dead letter, {} crashes, {} restarts",
        dead_lettered.duration_since(first_death).as_millis(),
        deaths.len(),
        supervisor.restarts.load(Ordering::SeqCst)
    );

    let dead = dead_letters(&app, dlq);
    assert_eq!(dead.len(), 1, "only the poison record: {dead:?}");
    let dead = &dead[0];
    assert_eq!(&dead.value[..], POISON.as_bytes());
    assert_eq!(
        header(dead, failure_headers::EXCEPTION).as_deref(),
        Some("ProcessorCrashed")
    );
    assert_eq!(header(dead, failure_headers::ATTEMPTS).as_deref(), Some("3"));
    assert_eq!(header(dead, failure_headers::TOPIC).as_deref(), Some("in"));
    assert_eq!(
        header(dead, failure_headers::PARTITION),
        Some(dead.partition.to_string())
    );
    let offset: u64 = header(dead, failure_headers::OFFSET).unwrap().parse().unwrap();
    let message = header(dead, failure_headers::MESSAGE).unwrap_or_default();
    assert!(message.contains("failed at the transport"), "{message}");
    // 3 crashes alone, after those of the calls it was in as they were split.
    assert!(deaths.len() >= 3, "{} crashes", deaths.len());

    assert_each_processed_once(&app, 2_000, Some((dead.partition, offset)));
    let poison_outcomes: Vec<_> = outcomes(&app)
        .into_iter()
        .filter(|(p, o)| (*p, o.offset) == (dead.partition, offset))
        .map(|(_, o)| (o.outcome, o.attempts))
        .collect();
    assert_eq!(poison_outcomes, vec![(Outcome::DeadLettered, 3)]);
    app.shutdown().unwrap();
}

#[test]
fn a_processor_down_for_a_while_has_nothing_dead_lettered() {
    let stubs = stubs();
    let supervisor = Supervisor::start(stubs.path().to_path_buf(), Duration::from_secs(2));
    // One attempt: a record blamed for the outage would be dead-lettered at once.
    let app = StreamsApp::start(config(&supervisor.endpoint(), "down", 1)).unwrap();
    app.produce("in", keyed(0, 2_000)).unwrap();
    // Killed with calls in flight, and down for 2 s before it comes back.
    std::thread::sleep(Duration::from_millis(100));
    supervisor.kill();
    app.produce("in", keyed(2_000, 1_000)).unwrap();
    assert!(app.wait_until_caught_up(WAIT), "resumed and caught up");
    assert!(
        dead_letters(&app, "down-p-dlq").is_empty(),
        "nothing dead-lettered"
    );
    assert_each_processed_once(&app, 3_000, None);
    let deaths = supervisor.deaths.lock().unwrap().len();
    assert!(deaths >= 1, "the processor was killed");
    app.shutdown().unwrap();
}
