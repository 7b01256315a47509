//! The durable embedded mode in-process (`StreamsApp` with a `data_dir`): a
//! persistent store keeps exact counts across a restart and resumes after its
//! watermark; a memory store is restored from the log (UNAVAILABLE meanwhile);
//! queries during heavy processing see whole commits; retention never removes
//! what is not committed, and a stream starting before it is OUT_OF_RANGE.

use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use taskstream_server::processor::Count;
use taskstream_server::*;

/// Bound on anything expected to happen promptly (catch up, commit, restore).
const WAIT: Duration = Duration::from_secs(30);
const TOPIC: &str = "in";
const STORE: &str = "count";

/// A fresh directory under the temp dir, removed on drop.
fn temp_dir(name: &str) -> scratch::TempDir {
    scratch::scratch_dir(&format!("durable-{name}")).expect("create a temp dir")
}

/// Topic `in` with `partitions`, pipeline and store `count` (`processor`,
/// `store`), N = 4, T = 2, offset order, commits every 50 ms, in `dir`.
fn config(dir: &Path, partitions: u32, processor: ProcessorSpec, store: StoreKind) -> Config {
    Config {
        application_id: "durable".into(),
        num_stream_threads: 4,
        num_threads_per_task: 2,
        processing_order: ProcessingOrder::Offset,
        commit_interval_ms: 50,
        max_batch_records: 100,
        data_dir: Some(dir.to_path_buf()),
        topics: vec![TopicConfig::new(TOPIC, partitions)],
        pipelines: vec![PipelineConfig {
            store: Some(store),
            ..PipelineConfig::new(STORE, TOPIC, processor)
        }],
        ..Config::default()
    }
}

/// `count` records keyed `k<i % keys>` for i in `from..from + count`.
fn keyed(from: usize, count: usize, keys: usize) -> Vec<ProducerRecord> {
    (from..from + count)
        .map(|i| ProducerRecord::keyed(format!("k{}", i % keys), format!("v{i}")))
        .collect()
}

fn add_expected(expected: &mut BTreeMap<Bytes, u64>, records: &[ProducerRecord]) {
    for record in records {
        *expected.entry(record.key.clone().expect("keyed")).or_default() += 1;
    }
}

fn parse_count(value: &Bytes) -> u64 {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not a count: {value:?}"))
}

/// Counts per key, and the position each partition answered at.
type StoreRead = (BTreeMap<Bytes, u64>, BTreeMap<u32, u64>);

/// Every entry of the store, all partitions, with each partition's position.
fn read_store(app: &StreamsApp) -> Result<StoreRead, RuntimeError> {
    let mut counts = BTreeMap::new();
    let mut positions = BTreeMap::new();
    for result in app.query_range(STORE, None, None, &[], 0)? {
        positions.insert(result.partition, result.position);
        for (key, value) in result.entries {
            assert!(
                counts.insert(key.clone(), parse_count(&value)).is_none(),
                "key {key:?} answered by two partitions"
            );
        }
    }
    Ok((counts, positions))
}

fn end_offsets(app: &StreamsApp, partitions: u32) -> BTreeMap<u32, u64> {
    (0..partitions)
        .map(|p| (p, app.log().end_offset(TOPIC, p).expect("end offset")))
        .collect()
}

/// Waits until every record is processed and the store answers at every
/// partition's end offset (a persistent store answers from its last commit),
/// then reads it.
fn caught_up_store(app: &StreamsApp, partitions: u32) -> BTreeMap<Bytes, u64> {
    assert!(
        app.wait_until_caught_up(WAIT),
        "not caught up within {WAIT:?}: {:#?}",
        app.describe().tasks
    );
    let ends = end_offsets(app, partitions);
    let deadline = Instant::now() + WAIT;
    loop {
        let (counts, positions) = read_store(app).expect("query_range");
        if positions == ends {
            return counts;
        }
        assert!(
            Instant::now() < deadline,
            "the store never answered at the end offsets {ends:?}: positions {positions:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn task_metadata(app: &StreamsApp) -> BTreeMap<u32, TaskMetadata> {
    app.describe()
        .tasks
        .into_iter()
        .map(|t| (t.partition, t))
        .collect()
}

#[test]
fn a_persistent_store_keeps_exact_counts_across_a_restart_and_resumes_after_its_watermark() {
    const PARTITIONS: u32 = 4;
    let dir = temp_dir("persistent-restart");
    let mut expected = BTreeMap::new();

    let app = StreamsApp::start(config(
        dir.path(),
        PARTITIONS,
        ProcessorSpec::Count,
        StoreKind::Persistent,
    ))
    .expect("first start");
    for batch in 0..10 {
        let records = keyed(batch * 500, 500, 97);
        add_expected(&mut expected, &records);
        app.produce(TOPIC, records).expect("produce");
    }
    let before = caught_up_store(&app, PARTITIONS);
    assert_eq!(before, expected, "counts before the restart");
    let ends_before = end_offsets(&app, PARTITIONS);
    app.shutdown().expect("shutdown");
    drop(app);

    let app = StreamsApp::start(config(
        dir.path(),
        PARTITIONS,
        ProcessorSpec::Count,
        StoreKind::Persistent,
    ))
    .expect("second start on the same data dir");
    assert_eq!(
        app.state(),
        AppState::Running,
        "a persistent store has nothing to restore"
    );
    // Straight from disk: the counts and the position of the last commit.
    let (counts, positions) = read_store(&app).expect("query after restart");
    assert_eq!(counts, expected, "counts right after the restart");
    assert_eq!(positions, ends_before, "positions right after the restart");
    for (p, task) in task_metadata(&app) {
        assert_eq!(
            task.watermark, ends_before[&p],
            "task {}: resumes at its watermark",
            task.task_id
        );
        assert_eq!(task.committed_offset, ends_before[&p], "task {}", task.task_id);
    }

    // Only what comes after the watermark is processed: nothing is applied twice.
    let more = keyed(5_000, 2_000, 97);
    add_expected(&mut expected, &more);
    let mut new_per_partition: HashMap<u32, u64> = HashMap::new();
    for position in app.produce(TOPIC, more).expect("produce after restart") {
        *new_per_partition.entry(position.partition).or_default() += 1;
    }
    let after = caught_up_store(&app, PARTITIONS);
    assert_eq!(after, expected, "counts after producing more");
    for (p, task) in task_metadata(&app) {
        assert_eq!(
            task.records_processed,
            new_per_partition.get(&p).copied().unwrap_or(0),
            "task {} processed exactly the records after its watermark",
            task.task_id
        );
    }
    app.shutdown().expect("shutdown");
}

/// `count` behind a gate: while the gate is closed every call waits, so a
/// restore can be held in progress for as long as a test needs.
struct GatedCount {
    open: Mutex<bool>,
    opened: Condvar,
    waiting: AtomicUsize,
}

impl GatedCount {
    fn new(open: bool) -> Arc<GatedCount> {
        Arc::new(GatedCount {
            open: Mutex::new(open),
            opened: Condvar::new(),
            waiting: AtomicUsize::new(0),
        })
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl Processor for GatedCount {
    fn process(&self, record: &Record, ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
        let mut open = self.open.lock().unwrap();
        if !*open {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        drop(open);
        Count.process(record, ctx)
    }
}

fn gated_app(dir: &Path, gate: &Arc<GatedCount>) -> StreamsApp {
    let spec = ProcessorSpec::Custom {
        name: "gated_count".into(),
    };
    StreamsApp::builder(config(dir, 3, spec, StoreKind::Memory))
        .processor("gated_count", gate.clone())
        .start()
        .expect("start")
}

#[test]
fn a_memory_store_is_restored_to_the_same_values_and_answers_unavailable_while_restoring() {
    const PARTITIONS: u32 = 3;
    let dir = temp_dir("memory-restore");
    let mut expected = BTreeMap::new();

    let app = gated_app(dir.path(), &GatedCount::new(true));
    for batch in 0..6 {
        let records = keyed(batch * 500, 500, 61);
        add_expected(&mut expected, &records);
        app.produce(TOPIC, records).expect("produce");
    }
    let before = caught_up_store(&app, PARTITIONS);
    assert_eq!(before, expected, "counts before the restart");
    let (_, positions_before) = read_store(&app).expect("query");
    app.shutdown().expect("shutdown");
    drop(app);

    // The gate is closed: the restore replays the log through the processor and stops in it.
    let gate = GatedCount::new(false);
    let app = gated_app(dir.path(), &gate);
    let deadline = Instant::now() + WAIT;
    while gate.waiting.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "no restore reached the processor");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(app.state(), AppState::Starting);
    let unavailable = |what: &str, result: Result<(), RuntimeError>| match result {
        Err(RuntimeError::Unavailable { .. }) => {}
        other => panic!("{what} while restoring: expected Unavailable, got {other:?}"),
    };
    unavailable("query_range", read_store(&app).map(drop));
    unavailable("get", app.get(STORE, b"k1").map(drop));
    unavailable("produce", app.produce(TOPIC, keyed(0, 1, 61)).map(drop));
    unavailable(
        "subscribe",
        app.subscribe(STORE, SubscribeRequest::default()).map(drop),
    );
    assert!(
        app.describe()
            .tasks
            .iter()
            .any(|t| t.state == taskstream_server::metadata::TaskState::Restoring),
        "{:#?}",
        app.describe().tasks
    );

    gate.open();
    let after = caught_up_store(&app, PARTITIONS);
    assert_eq!(app.state(), AppState::Running);
    assert_eq!(after, before, "values after the restore");
    let (_, positions_after) = read_store(&app).expect("query");
    assert_eq!(positions_after, positions_before);
    // Every task resumed at its committed watermark: nothing new to process.
    for task in app.describe().tasks {
        assert_eq!(task.records_processed, 0, "{task:#?}");
    }
    app.shutdown().expect("shutdown");
}

#[test]
fn queries_during_heavy_processing_see_exactly_a_committed_watermarks_worth_of_records() {
    const PARTITIONS: u32 = 4;
    const BATCHES: usize = 80;
    const BATCH: usize = 1_000;
    let dir = temp_dir("snapshots");
    let app = StreamsApp::start(config(
        dir.path(),
        PARTITIONS,
        ProcessorSpec::Count,
        StoreKind::Persistent,
    ))
    .expect("start");

    let producer = {
        let app = app.clone();
        std::thread::spawn(move || {
            for batch in 0..BATCHES {
                app.produce(TOPIC, keyed(batch * BATCH, BATCH, 1_009))
                    .expect("produce");
            }
        })
    };

    // Every record adds 1 to one key of its own partition, so a partition's
    // counts add up to exactly the number of records its snapshot reflects.
    let mut snapshots = 0u64;
    let mut positions_seen: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    let mut check = || {
        for result in app.query_range(STORE, None, None, &[], 0).expect("query_range") {
            let sum: u64 = result.entries.iter().map(|(_, v)| parse_count(v)).sum();
            assert_eq!(
                sum, result.position,
                "partition {}: the counts add up to {sum} but the snapshot claims position {}",
                result.partition, result.position
            );
            let seen = positions_seen.entry(result.partition).or_default();
            if seen.last() != Some(&result.position) {
                assert!(
                    seen.last().is_none_or(|&last| last < result.position),
                    "partition {}: position went back from {:?} to {}",
                    result.partition,
                    seen.last(),
                    result.position
                );
                seen.push(result.position);
            }
        }
        snapshots += 1;
    };
    let deadline = Instant::now() + WAIT * 2;
    while !producer.is_finished() || !app.wait_until_caught_up(Duration::ZERO) {
        check();
        assert!(Instant::now() < deadline, "not done within {:?}", WAIT * 2);
    }
    producer.join().expect("the producer panicked");
    let final_counts = caught_up_store(&app, PARTITIONS);
    check();

    let total: u64 = final_counts.values().sum();
    assert_eq!(total, (BATCHES * BATCH) as u64);
    let ends = end_offsets(&app, PARTITIONS);
    let intermediate: usize = positions_seen
        .iter()
        .map(|(p, seen)| seen.iter().filter(|&&pos| pos > 0 && pos < ends[p]).count())
        .sum();
    println!(
        "{} snapshots checked; distinct intermediate positions seen: {intermediate}; per partition: {:?}",
        snapshots,
        positions_seen
            .iter()
            .map(|(p, s)| (p, s.len()))
            .collect::<Vec<_>>()
    );
    assert!(
        intermediate >= PARTITIONS as usize,
        "the queries never saw processing in progress (positions seen: {positions_seen:?})"
    );
    app.shutdown().expect("shutdown");
}

#[test]
fn retention_removes_only_committed_records_and_a_stream_before_them_is_out_of_range() {
    const PARTITIONS: u32 = 2;
    const RETENTION_BYTES: u64 = 2_000;
    let dir = temp_dir("retention");
    let mut cfg = config(
        dir.path(),
        PARTITIONS,
        ProcessorSpec::Count,
        StoreKind::Persistent,
    );
    cfg.topics[0].log_retention_bytes = Some(RETENTION_BYTES);
    let app = StreamsApp::start(cfg.clone()).expect("start");
    let mut expected = BTreeMap::new();

    // Start offsets are read before the committed watermarks; both only grow,
    // so start <= committed must hold for every such pair.
    let check = |app: &StreamsApp| -> BTreeMap<u32, (u64, u64)> {
        let starts: Vec<u64> = (0..PARTITIONS)
            .map(|p| app.log().start_offset(TOPIC, p).expect("start offset"))
            .collect();
        let tasks = task_metadata(app);
        (0..PARTITIONS)
            .map(|p| {
                let committed = tasks[&p].committed_offset;
                assert!(
                    starts[p as usize] <= committed,
                    "partition {p}: retention removed up to {} past the committed watermark {committed}",
                    starts[p as usize]
                );
                (p, (starts[p as usize], committed))
            })
            .collect()
    };
    for batch in 0..40 {
        let records = keyed(batch * 100, 100, 13);
        add_expected(&mut expected, &records);
        app.produce(TOPIC, records).expect("produce");
        check(&app);
        std::thread::sleep(Duration::from_millis(20));
    }
    let counts = caught_up_store(&app, PARTITIONS);
    assert_eq!(counts, expected);

    // Retention runs at most once a second, at a commit round.
    let ends = end_offsets(&app, PARTITIONS);
    let deadline = Instant::now() + WAIT;
    let starts = loop {
        let state = check(&app);
        // Most records are gone: what is left fits the byte limit (a record counts >= 16 bytes).
        if state
            .iter()
            .all(|(p, (start, _))| ends[p] - start <= RETENTION_BYTES / 16)
        {
            break state;
        }
        assert!(
            Instant::now() < deadline,
            "retention did not bring partitions within {RETENTION_BYTES} bytes: (start, committed) {state:?}, ends {ends:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    println!("(start, committed) per partition: {starts:?}; ends {ends:?}");

    for p in 0..PARTITIONS {
        let start = starts[&p].0;
        assert!(start > 0, "partition {p}: nothing removed");
        let request = |offset: u64| SubscribeRequest {
            start: StartAt::Offsets(BTreeMap::from([(p, offset)])),
            end: EndAt::Current,
            ..SubscribeRequest::default()
        };
        match app.subscribe(STORE, request(0)) {
            Err(RuntimeError::OffsetOutOfRange {
                partition,
                requested,
                earliest,
            }) => {
                assert_eq!((partition, requested), (p, 0));
                assert!(earliest >= start, "earliest {earliest} < start {start}");
            }
            Err(other) => panic!("partition {p}: expected OffsetOutOfRange, got {other:?}"),
            Ok(_) => panic!("partition {p}: a stream from offset 0 was accepted after retention"),
        }
        match app.subscribe(STORE, request(start.saturating_sub(1))) {
            Err(RuntimeError::OffsetOutOfRange { .. }) => {}
            Err(other) => panic!("partition {p}: expected OffsetOutOfRange, got {other:?}"),
            Ok(_) => panic!("partition {p}: a stream from just before the start was accepted"),
        }
        let earliest = app.log().start_offset(TOPIC, p).expect("start offset");
        assert!(
            app.subscribe(STORE, request(earliest)).is_ok(),
            "partition {p}: a stream from the earliest retained offset {earliest} is refused"
        );
    }
    app.shutdown().expect("shutdown");
    drop(app);

    // The removal is durable, and the persistent store resumes from its checkpoint.
    let app = StreamsApp::start(cfg).expect("restart");
    for p in 0..PARTITIONS {
        assert!(app.log().start_offset(TOPIC, p).expect("start offset") >= starts[&p].0);
    }
    check(&app);
    assert_eq!(
        caught_up_store(&app, PARTITIONS),
        expected,
        "counts after the restart"
    );
    app.shutdown().expect("shutdown");
}

/// A memory store is rebuilt by replaying its source topic from the start, so
/// log retention on that topic would restore only the retained tail: the
/// config refuses the combination, naming the setting and the fix.
#[test]
fn log_retention_on_the_source_of_a_memory_store_is_refused() {
    const PARTITIONS: u32 = 2;
    let dir = temp_dir("memory-retention");
    let mut cfg = config(dir.path(), PARTITIONS, ProcessorSpec::Count, StoreKind::Memory);
    cfg.topics[0].log_retention_bytes = Some(2_000);
    match StreamsApp::start(cfg.clone()) {
        Err(RuntimeError::InvalidConfig(e)) => {
            assert!(e.setting.contains("log_retention"), "{e}");
            assert!(e.message.contains("persistent"), "the fix is named: {e}");
        }
        Err(e) => panic!("start: {e:?}"),
        Ok(_) => panic!("retention on a memory store's source was accepted"),
    }
    // The same topic with a persistent store is fine.
    cfg.pipelines[0].store = Some(StoreKind::Persistent);
    let app = StreamsApp::start(cfg).expect("persistent store with retention");
    app.shutdown().expect("shutdown");
}
