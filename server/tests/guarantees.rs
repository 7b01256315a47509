//! What the runtime promises beyond throughput: records of one key run in
//! offset order with several threads (`offset` and `key` order), a failed
//! attempt leaves no writes, outcomes flow while records are slow, errors
//! of commits and fetches are reported or retried, never swallowed.

use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use taskstream_server::scratch::scratch_dir;
use taskstream_server::*;

const WAIT: Duration = Duration::from_secs(60);

fn config(n: usize, t: usize, order: ProcessingOrder, processor: &str) -> Config {
    Config {
        application_id: "promises".into(),
        num_stream_threads: n,
        num_threads_per_task: t,
        processing_order: order,
        commit_interval_ms: 50,
        retry_backoff_ms: 2,
        retry_backoff_max_ms: 20,
        pipelines: vec![PipelineConfig {
            name: "p".into(),
            source_topic: "in".into(),
            partitions: Some(1),
            processor: ProcessorSpec::Custom {
                name: processor.into(),
            },
            num_threads_per_task: None,
            processing_order: None,
            store: None,
            retry_policy: None,
            sink_topic: None,
        }],
        ..Config::default()
    }
}

/// A pseudo-random draw in [0, 1) from an offset.
fn draw(offset: u64) -> f64 {
    let mut x = offset.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// `latest` with a random latency of up to a millisecond per record.
fn slow_latest() -> Arc<dyn Processor> {
    Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        std::thread::sleep(Duration::from_micros((draw(record.offset) * 1_000.0) as u64));
        if let Some(key) = &record.key {
            ctx.store.put(key.clone(), record.value.clone())?;
        }
        Ok(())
    })
}

#[test]
fn with_eight_threads_every_key_ends_at_its_highest_offsets_value() {
    for order in [ProcessingOrder::Offset, ProcessingOrder::Key] {
        let app = StreamsApp::builder(config(8, 8, order, "latest"))
            .processor("latest", slow_latest())
            .start()
            .unwrap();
        let records: Vec<ProducerRecord> = (0..2_000)
            .map(|i| ProducerRecord::keyed(format!("k{}", i % 20), format!("{i}")))
            .collect();
        app.produce("in", records).unwrap();
        assert!(app.wait_until_caught_up(WAIT));
        for k in 0..20 {
            let highest = (0..2_000).filter(|i| i % 20 == k).max().unwrap();
            assert_eq!(
                app.get("p", format!("k{k}").as_bytes()).unwrap().unwrap(),
                highest.to_string(),
                "k{k} in {order} order"
            );
        }
    }
}

/// Increments its key, then fails the first attempt of every seventh record
/// (an error, a panic or a timeout, in turn).
fn increment_then_fail(timeout: Duration) -> Arc<dyn Processor> {
    Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
        let key = record.key.clone().unwrap_or_default();
        ctx.store.update(&key, &mut |old| {
            let n: u64 = old.map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
            Some(Bytes::from((n + 1).to_string()))
        })?;
        if ctx.attempt == 1 && record.offset.is_multiple_of(7) {
            match (record.offset / 7) % 3 {
                0 => return Err(ProcessError::new("AfterWrite", "failed after its write")),
                1 => panic!("panicked after its write"),
                _ => std::thread::sleep(timeout * 2),
            }
        }
        Ok(())
    })
}

#[test]
fn a_failed_attempt_leaves_no_writes_so_counters_are_exact_after_retries() {
    for (order, t, persistent) in [
        (ProcessingOrder::Key, 4, false),
        (ProcessingOrder::Offset, 4, true),
        (ProcessingOrder::Unordered, 4, false),
        (ProcessingOrder::Offset, 1, true),
    ] {
        let dir = scratch_dir("attempts").unwrap();
        let mut cfg = config(4, t, order, "flaky");
        cfg.processing_timeout_ms = 20;
        if order == ProcessingOrder::Unordered {
            // Records of one key run at once here, so an update can wait on its
            // key behind a sleeping attempt, past its own deadline, time and
            // again: enough attempts that every record ends processed.
            cfg.retry_max_attempts = 20;
        }
        if persistent {
            cfg.data_dir = Some(dir.path().to_path_buf());
        }
        let app = StreamsApp::builder(cfg)
            .processor("flaky", increment_then_fail(Duration::from_millis(20)))
            .start()
            .unwrap();
        let mut expected: BTreeMap<String, u64> = BTreeMap::new();
        let records: Vec<ProducerRecord> = (0..700)
            .map(|i| {
                let key = format!("k{}", i % 9);
                *expected.entry(key.clone()).or_default() += 1;
                ProducerRecord::keyed(key, "x")
            })
            .collect();
        app.produce("in", records).unwrap();
        assert!(
            app.wait_until_caught_up(WAIT),
            "{order} order: {:#?}",
            app.describe()
        );
        for (key, count) in &expected {
            let value = app.get("p", key.as_bytes()).unwrap().unwrap();
            assert_eq!(
                value,
                count.to_string(),
                "{key} in {order} order, T = {t}, persistent {persistent}"
            );
        }
        let task = &app.describe().tasks[0];
        assert_eq!(task.records_dead_lettered, 0, "{order} order: {task:?}");
        let failed = task.records_failed;
        if order == ProcessingOrder::Unordered {
            // Records of one key run at once here: an update waiting on its
            // key past its deadline fails too, and is retried like any failure.
            assert!(failed >= 100, "{failed}");
        } else {
            assert_eq!(failed, 100, "every seventh record failed once, nothing else");
        }
        if order == ProcessingOrder::Key {
            // Counted by the end offset: entries already final may be gone
            // to retention once a commit covered them.
            let retry = app.read_topic("promises-p-retry", 0, u64::MAX, 1).unwrap();
            assert_eq!(retry.end_offset, 100, "key order holds parked records in memory");
        }
    }
}

#[test]
fn with_slow_records_outcomes_flow_before_a_whole_batch_is_done() {
    let slow = Arc::new(|_: &Record, _: &ProcessorContext<'_>| {
        std::thread::sleep(Duration::from_millis(50));
        Ok(())
    });
    let mut cfg = config(1, 1, ProcessingOrder::Offset, "slow");
    cfg.max_batch_ms = 100;
    let app = StreamsApp::builder(cfg).processor("slow", slow).start().unwrap();
    let mut subscription = app
        .subscribe(
            "p",
            SubscribeRequest {
                start: StartAt::Earliest,
                ..SubscribeRequest::default()
            },
        )
        .unwrap();
    app.produce(
        "in",
        (0..40)
            .map(|i| ProducerRecord::keyed("k", format!("{i}")))
            .collect(),
    )
    .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let first = runtime.block_on(async {
        match tokio::time::timeout(WAIT, subscription.next()).await.unwrap() {
            Some(Ok(SubscriptionEvent::Batch(batch))) => batch,
            other => panic!("{other:?}"),
        }
    });
    // The unit of 40 records (2 s) was cut at about 100 ms: a few records.
    assert!(
        first.records.len() < 10,
        "{} records in the first batch",
        first.records.len()
    );
}

/// A log whose commits fail, or whose first reads fail, or whose appends to
/// retry topics fail while `failing_retry_appends` is set.
struct FaultyLog {
    inner: Arc<MemoryLog>,
    fail_commits: bool,
    failing_reads: AtomicUsize,
    failing_retry_appends: AtomicBool,
    /// Retry appends with a value longer than this are refused whole, as
    /// Kafka's producer refuses a batch with a record over its limit (0: off).
    rejecting_retries_over: AtomicUsize,
    /// Dead-letter appends are refused as too large.
    rejecting_dead_letters: AtomicBool,
    /// Records for topic `out` with a value longer than this are refused as
    /// too large (0: off), as Kafka's producer refuses them.
    refusing_outputs_over: AtomicUsize,
}

impl Log for FaultyLog {
    fn ensure_topic(&self, topic: &str, partitions: u32) -> Result<(), LogError> {
        self.inner.ensure_topic(topic, partitions)
    }
    fn partitions(&self, topic: &str) -> Result<u32, LogError> {
        self.inner.partitions(topic)
    }
    fn check_record(&self, topic: &str, record: &ProducerRecord) -> Result<(), LogError> {
        let limit = self.refusing_outputs_over.load(Ordering::SeqCst);
        if topic == "out" && limit > 0 && record.value.len() > limit {
            return Err(LogError::Rejected {
                topic: topic.into(),
                reason: "a record is too large".into(),
            });
        }
        Ok(())
    }
    fn append(&self, topic: &str, records: Vec<ProducerRecord>) -> Result<Vec<RecordPosition>, LogError> {
        if topic.ends_with("-retry") && self.failing_retry_appends.load(Ordering::SeqCst) {
            return Err(LogError::Unavailable("injected append failure".into()));
        }
        if topic.ends_with("-dlq") && self.rejecting_dead_letters.load(Ordering::SeqCst) {
            return Err(LogError::Rejected {
                topic: topic.into(),
                reason: "a record is too large".into(),
            });
        }
        for record in &records {
            self.check_record(topic, record)?;
        }
        let limit = self.rejecting_retries_over.load(Ordering::SeqCst);
        if topic.ends_with("-retry") && limit > 0 && records.iter().any(|r| r.value.len() > limit) {
            return Err(LogError::Rejected {
                topic: topic.into(),
                reason: "a record is too large".into(),
            });
        }
        self.inner.append(topic, records)
    }
    fn read(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
        out: &mut Vec<Record>,
    ) -> Result<(), LogError> {
        if topic == "in"
            && self
                .failing_reads
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(LogError::Unavailable("injected read failure".into()));
        }
        self.inner.read(topic, partition, offset, max, out)
    }
    fn end_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError> {
        self.inner.end_offset(topic, partition)
    }
    fn start_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError> {
        self.inner.start_offset(topic, partition)
    }
    fn commit(&self, group: &str, topic: &str, partition: u32, offset: u64) -> Result<(), LogError> {
        if self.fail_commits {
            return Err(LogError::Unavailable("injected commit failure".into()));
        }
        self.inner.commit(group, topic, partition, offset)
    }
    fn committed(&self, group: &str, topic: &str, partition: u32) -> Result<Option<u64>, LogError> {
        self.inner.committed(group, topic, partition)
    }
    fn add_append_listener(&self, listener: log::AppendListener) {
        self.inner.add_append_listener(listener)
    }
    fn enforce_retention(
        &self,
        topic: &str,
        partition: u32,
        retention: Retention,
        keep_from: u64,
        now_ms: i64,
    ) -> Result<u64, LogError> {
        self.inner
            .enforce_retention(topic, partition, retention, keep_from, now_ms)
    }
}

fn faulty(fail_commits: bool, failing_reads: usize) -> Arc<FaultyLog> {
    Arc::new(FaultyLog {
        inner: MemoryLog::new(),
        fail_commits,
        failing_reads: AtomicUsize::new(failing_reads),
        failing_retry_appends: AtomicBool::new(false),
        rejecting_retries_over: AtomicUsize::new(0),
        rejecting_dead_letters: AtomicBool::new(false),
        refusing_outputs_over: AtomicUsize::new(0),
    })
}

/// Starts an app over `log` with `processor` under the custom name `cfg`
/// gives it, produces `records` (key, value) and waits until they are all final.
fn run_over(
    log: &Arc<FaultyLog>,
    cfg: Config,
    processor: Arc<dyn Processor>,
    records: &[(&str, &str)],
) -> StreamsApp {
    let ProcessorSpec::Custom { name } = cfg.pipelines[0].processor.clone() else {
        panic!("a custom processor's config")
    };
    let app = StreamsApp::builder(cfg)
        .log(log.clone())
        .processor(&name, processor)
        .start()
        .unwrap();
    let records = records
        .iter()
        .map(|(k, v)| ProducerRecord::keyed(k.to_string(), v.to_string()));
    app.produce("in", records.collect()).unwrap();
    assert!(app.wait_until_caught_up(WAIT), "{:#?}", app.describe());
    app
}

/// A failed record whose retry entry cannot be appended (the log is down)
/// when the app shuts down is not lost: it goes back undone, the final
/// commit stops before it, and after a restart it runs again from the
/// source. (It used to end `failed`, and the commit passed it.)
#[test]
fn a_failed_record_whose_retry_cannot_be_appended_at_shutdown_runs_after_a_restart() {
    let log = faulty(false, 0);
    log.failing_retry_appends.store(true, Ordering::SeqCst);
    let (failed, failures) = std::sync::mpsc::channel();
    let processor: Arc<dyn Processor> = Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
        if record.value == "bad" && ctx.attempt == 1 && failed.send(()).is_ok() {
            return Err(ProcessError::new("Bad", "fails until the test is gone"));
        }
        ctx.store
            .put(record.key.clone().unwrap_or_default(), record.value.clone())?;
        Ok(())
    });
    let cfg = config(1, 1, ProcessingOrder::Offset, "bad");
    let app = StreamsApp::builder(cfg.clone())
        .log(log.clone())
        .processor("bad", processor.clone())
        .start()
        .unwrap();
    let records = [("a", "ok"), ("b", "bad"), ("c", "ok")];
    app.produce(
        "in",
        records
            .iter()
            .map(|(k, v)| ProducerRecord::keyed(*k, *v))
            .collect(),
    )
    .unwrap();
    failures.recv_timeout(WAIT).expect("b fails");
    // Its thread now waits for the log to take the retry entry; shutting
    // down ends the wait.
    let _ = app.shutdown();
    assert_eq!(
        log.committed("promises", "in", 0).unwrap(),
        Some(1),
        "the final commit stops before b"
    );
    drop(failures);
    log.failing_retry_appends.store(false, Ordering::SeqCst);
    let app = StreamsApp::builder(cfg)
        .log(log)
        .processor("bad", processor)
        .start()
        .unwrap();
    assert!(app.wait_until_caught_up(WAIT), "{:#?}", app.describe());
    for (key, value) in records {
        assert_eq!(app.get("p", key.as_bytes()).unwrap().unwrap(), value, "{key}");
    }
    app.shutdown().unwrap();
}

/// A failed record the log refuses for good on the retry path (too large
/// for it, as Kafka refuses a record over `message.max.bytes`) ends
/// `failed`; the other failed and parked records of its unit, appended with
/// it, still take the retry path and run. (The refusal of the unit's whole
/// append used to fail them all, parked records never attempted.)
#[test]
fn a_failed_record_the_retry_topic_refuses_fails_alone() {
    let log = faulty(false, 0);
    log.rejecting_retries_over.store(100, Ordering::SeqCst);
    let processor: Arc<dyn Processor> = Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        if record.value.starts_with(b"bad") && ctx.attempt == 1 {
            return Err(ProcessError::new("Bad", "fails its first attempt"));
        }
        ctx.store
            .put(record.key.clone().unwrap_or_default(), record.value.clone())?;
        Ok(())
    });
    // Written before the app starts, so its first fetch takes them all, and
    // its one thread runs them as one unit.
    let big = format!("bad{}", "x".repeat(200));
    log.ensure_topic("in", 1).unwrap();
    log.append(
        "in",
        vec![
            ProducerRecord::keyed("a", "ok"),
            ProducerRecord::keyed("b", big),
            ProducerRecord::keyed("c", "bad"),
            ProducerRecord::keyed("b", "after"),
        ],
    )
    .unwrap();
    let app = StreamsApp::builder(config(1, 1, ProcessingOrder::Offset, "bad"))
        .log(log.clone())
        .processor("bad", processor)
        .start()
        .unwrap();
    assert!(app.wait_until_caught_up(WAIT), "{:#?}", app.describe());
    assert_eq!(app.get("p", b"a").unwrap().unwrap(), "ok");
    assert_eq!(
        app.get("p", b"c").unwrap().unwrap(),
        "bad",
        "c ran again from the retry path"
    );
    assert_eq!(
        app.get("p", b"b").unwrap().unwrap(),
        "after",
        "b's later record, parked behind it, ran"
    );
    let task = &app.describe().tasks[0];
    assert_eq!(task.records_processed, 3, "{task:#?}");
    // b's one attempt (final) and c's first.
    assert_eq!(task.records_failed, 2, "{task:#?}");
    app.shutdown().unwrap();
}

/// A record out of attempts whose dead letter the log refuses for good
/// (too large for the topic) ends `failed` instead of staying on the retry
/// path forever, where its key's later records waited behind it.
#[test]
fn a_record_whose_dead_letter_is_refused_ends_failed_and_its_key_moves_on() {
    let log = faulty(false, 0);
    log.rejecting_dead_letters.store(true, Ordering::SeqCst);
    let processor: Arc<dyn Processor> = Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        if record.value == "bad" {
            return Err(ProcessError::new("Bad", "fails every attempt"));
        }
        ctx.store
            .put(record.key.clone().unwrap_or_default(), record.value.clone())?;
        Ok(())
    });
    let mut cfg = config(1, 1, ProcessingOrder::Offset, "bad");
    cfg.retry_max_attempts = 2;
    let app = run_over(&log, cfg, processor, &[("b", "bad"), ("b", "after"), ("a", "ok")]);
    assert_eq!(
        app.get("p", b"b").unwrap().unwrap(),
        "after",
        "b's later record ran"
    );
    assert_eq!(app.get("p", b"a").unwrap().unwrap(), "ok");
    let task = &app.describe().tasks[0];
    assert_eq!(
        (task.records_processed, task.records_dead_lettered),
        (2, 0),
        "{task:#?}"
    );
    assert_eq!(log.end_offset("promises-p-dlq", 0).unwrap_or(0), 0);
    app.shutdown().unwrap();
}

/// A processor's output the sink topic would refuse for good (too large
/// for it) fails its record at once, before its writes apply: the record is
/// dead-lettered, and the other outputs and the commits go on. (It used to
/// fail every later append of the sink, and so every commit of the task.)
#[test]
fn an_output_the_sink_topic_refuses_dead_letters_its_record_at_once() {
    let log = faulty(false, 0);
    log.refusing_outputs_over.store(10, Ordering::SeqCst);
    let processor: Arc<dyn Processor> = Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        ctx.store
            .put(record.key.clone().unwrap_or_default(), record.value.clone())?;
        ctx.emit(ProducerRecord::keyed(
            record.key.clone().unwrap_or_default(),
            record.value.clone(),
        ));
        Ok(())
    });
    let mut cfg = config(1, 1, ProcessingOrder::Offset, "echo");
    cfg.pipelines[0].sink_topic = Some("out".into());
    let records = [("a", "small"), ("b", "far too large"), ("c", "small too")];
    let app = run_over(&log, cfg, processor, &records);
    let task = &app.describe().tasks[0];
    assert_eq!(
        (task.records_processed, task.records_dead_lettered),
        (2, 1),
        "{task:#?}"
    );
    assert_eq!(app.get("p", b"b").unwrap(), None, "b's write did not apply");
    let mut dead = Vec::new();
    log.read("promises-p-dlq", 0, 0, 10, &mut dead).unwrap();
    assert_eq!(dead.len(), 1);
    let exception = dead[0]
        .headers
        .iter()
        .find(|(n, _)| n == "__streams.errors.exception");
    assert_eq!(exception.map(|(_, v)| &v[..]), Some(&b"InvalidOutput"[..]));
    let mut outputs = Vec::new();
    log.read("out", 0, 0, 10, &mut outputs).unwrap();
    let values: Vec<&[u8]> = outputs.iter().map(|r| &r.value[..]).collect();
    assert_eq!(values, [&b"small"[..], &b"small too"[..]]);
    // The commits go on past it.
    app.shutdown().unwrap();
    assert_eq!(log.committed("promises", "in", 0).unwrap(), Some(3));
}

#[test]
fn shutdown_reports_the_commits_that_failed() {
    let mut cfg = config(1, 1, ProcessingOrder::Offset, "count");
    cfg.pipelines[0].processor = ProcessorSpec::Count;
    cfg.commit_interval_ms = 60_000;
    let app = StreamsApp::builder(cfg).log(faulty(true, 0)).start().unwrap();
    app.produce("in", vec![ProducerRecord::keyed("k", "1")]).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    match app.shutdown() {
        Err(RuntimeError::CommitFailed(failures)) => {
            assert_eq!(failures.len(), 1);
            assert!(failures[0].starts_with("p_0: "), "{failures:?}");
        }
        other => panic!("{other:?}"),
    }
}

/// What the binary does on SIGTERM (`service::serve` drains and commits):
/// commits that fail make it end with an error naming the tasks, so the
/// binary exits non-zero instead of printing "watermarks committed".
#[test]
fn a_server_stopped_while_commits_fail_ends_with_an_error() {
    let mut cfg = config(1, 1, ProcessingOrder::Offset, "count");
    cfg.pipelines[0].processor = ProcessorSpec::Count;
    cfg.commit_interval_ms = 60_000;
    let app = StreamsApp::builder(cfg).log(faulty(true, 0)).start().unwrap();
    app.produce("in", vec![ProducerRecord::keyed("k", "1")]).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        // Shut down at once, as on a signal that arrives right away.
        service::serve(app, listener, async {}).await
    });
    let error = served
        .expect_err("failed commits end the server with an error")
        .to_string();
    assert!(error.contains("p_0"), "{error}");
}

#[test]
fn a_failed_fetch_is_retried_without_waiting_for_the_next_append() {
    let mut cfg = config(1, 1, ProcessingOrder::Offset, "count");
    cfg.pipelines[0].processor = ProcessorSpec::Count;
    let app = StreamsApp::builder(cfg).log(faulty(false, 3)).start().unwrap();
    app.produce("in", (0..10).map(|_| ProducerRecord::keyed("k", "1")).collect())
        .unwrap();
    assert!(app.wait_until_caught_up(WAIT), "{:#?}", app.describe());
    assert_eq!(app.get("p", b"k").unwrap().unwrap(), "10");
}

#[test]
fn a_store_error_fails_the_record_with_its_own_kind() {
    let error: ProcessError = StoreError {
        path: "s.redb".into(),
        message: "disk full".into(),
    }
    .into();
    assert_eq!(error.kind, "StoreError");
    assert!(error.message.contains("disk full"));
}
