//! The runtime end to end, in-process: threads per task, the three orders,
//! thread death, commits and restart, bounded subscriptions and lag.

use bytes::Bytes;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use taskstream_server::*;

const WAIT: Duration = Duration::from_secs(60);

fn config(n: usize, t: usize, order: ProcessingOrder, partitions: u32, processor: &str) -> Config {
    Config {
        application_id: "test".into(),
        num_stream_threads: n,
        num_threads_per_task: t,
        processing_order: order,
        commit_interval_ms: 50,
        pipelines: vec![PipelineConfig {
            name: "p".into(),
            source_topic: "in".into(),
            partitions: Some(partitions),
            processor: match processor {
                "count" => ProcessorSpec::Count,
                name => ProcessorSpec::Custom { name: name.into() },
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

fn keyed(count: usize, keys: usize) -> Vec<ProducerRecord> {
    (0..count)
        .map(|i| ProducerRecord::keyed(format!("k{}", i % keys), format!("{i}")))
        .collect()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

/// Collects every outcome of a bounded subscription.
fn collect(app: &StreamsApp, request: SubscribeRequest) -> Vec<Arc<OutcomeBatch>> {
    let mut subscription = app.subscribe("p", request).unwrap();
    rt().block_on(async {
        let mut batches = Vec::new();
        while let Some(event) = tokio::time::timeout(WAIT, subscription.next())
            .await
            .expect("stream stalled")
        {
            match event.unwrap() {
                SubscriptionEvent::Batch(batch) => batches.push(batch),
                SubscriptionEvent::Lagged { missed_batches } => panic!("lagged by {missed_batches}"),
            }
        }
        batches
    })
}

/// Counts threads inside one task at once, and the most ever seen.
#[derive(Default)]
struct Concurrency {
    inside: AtomicUsize,
    most: AtomicUsize,
}

impl Concurrency {
    fn processor(self: &Arc<Self>, sleep: Duration) -> Arc<dyn Processor> {
        let me = self.clone();
        Arc::new(move |_: &Record, _: &ProcessorContext<'_>| {
            let now = me.inside.fetch_add(1, Ordering::SeqCst) + 1;
            me.most.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(sleep);
            me.inside.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

#[test]
fn never_more_than_t_threads_in_a_task_and_t_under_load() {
    for t in [1, 2, 4] {
        let seen = Arc::new(Concurrency::default());
        // More threads than T, so the limit (not a lack of threads) is what holds.
        let app = StreamsApp::builder(config(t + 2, t, ProcessingOrder::Offset, 1, "c"))
            .processor("c", seen.processor(Duration::from_millis(1)))
            .start()
            .unwrap();
        app.produce("in", keyed(400, 50)).unwrap();
        assert!(app.wait_until_caught_up(WAIT));
        assert_eq!(seen.most.load(Ordering::SeqCst), t, "T = {t}");
        app.shutdown().unwrap();
    }
}

#[test]
fn offset_order_with_four_threads_delivers_every_partition_in_order_without_gaps() {
    let app = StreamsApp::builder(config(6, 4, ProcessingOrder::Offset, 3, "s"))
        .processor(
            "s",
            Arc::new(|r: &Record, _: &ProcessorContext<'_>| {
                std::thread::sleep(Duration::from_micros(r.offset * 7919 % 500));
                Ok(())
            }),
        )
        .start()
        .unwrap();
    app.produce("in", keyed(1500, 97)).unwrap();
    let batches = collect(
        &app,
        SubscribeRequest {
            in_order: true,
            start: StartAt::Earliest,
            end: EndAt::Current,
            partitions: vec![],
        },
    );
    let mut next: HashMap<u32, u64> = HashMap::new();
    for batch in &batches {
        for record in &batch.records {
            let expected = next.entry(batch.partition).or_insert(0);
            assert_eq!(record.offset, *expected, "partition {}", batch.partition);
            *expected += 1;
        }
    }
    let total: u64 = next.values().sum();
    assert_eq!(total, 1500);
    let threads: HashSet<_> = batches.iter().map(|b| b.thread.clone()).collect();
    assert!(threads.len() > 1, "several threads worked: {threads:?}");
}

/// Records per key the order processed and whether two ran at once.
#[derive(Default)]
struct KeyWatch {
    running: Mutex<HashSet<Bytes>>,
    order: Mutex<HashMap<Bytes, Vec<u64>>>,
    overlaps: AtomicUsize,
}

fn key_watch_processor(watch: &Arc<KeyWatch>, seed: u64) -> Arc<dyn Processor> {
    let watch = watch.clone();
    Arc::new(move |r: &Record, _: &ProcessorContext<'_>| {
        let key = r.key.clone().unwrap_or_default();
        if !watch.running.lock().unwrap().insert(key.clone()) {
            watch.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let micros = (r.offset.wrapping_mul(2654435761) ^ seed) % 300;
        std::thread::sleep(Duration::from_micros(micros));
        watch
            .order
            .lock()
            .unwrap()
            .entry(key.clone())
            .or_default()
            .push(r.offset);
        watch.running.lock().unwrap().remove(&key);
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, .. ProptestConfig::default() })]

    /// `key` order never runs two records of one key at once and keeps each
    /// key's offset order; `unordered` delivers every record exactly once.
    #[test]
    fn key_order_never_overlaps_a_key_and_unordered_delivers_exactly_once(
        keys in 1usize..40,
        records in 50usize..400,
        t in 2usize..5,
        seed in any::<u64>(),
    ) {
        let watch = Arc::new(KeyWatch::default());
        let app = StreamsApp::builder(config(t, t, ProcessingOrder::Key, 1, "w"))
            .processor("w", key_watch_processor(&watch, seed))
            .start()
            .unwrap();
        app.produce("in", keyed(records, keys)).unwrap();
        let batches = collect(&app, SubscribeRequest { start: StartAt::Earliest, end: EndAt::Current, ..Default::default() });
        prop_assert_eq!(watch.overlaps.load(Ordering::SeqCst), 0);
        for (key, offsets) in watch.order.lock().unwrap().iter() {
            prop_assert!(offsets.windows(2).all(|w| w[0] < w[1]), "key {:?}: {:?}", key, offsets);
        }
        let delivered: usize = batches.iter().map(|b| b.records.len()).sum();
        prop_assert_eq!(delivered, records);
        app.shutdown().unwrap();

        let seen = Arc::new(Concurrency::default());
        let app = StreamsApp::builder(config(t, t, ProcessingOrder::Unordered, 2, "u"))
            .processor("u", seen.processor(Duration::from_micros(seed % 200)))
            .start()
            .unwrap();
        app.produce("in", keyed(records, keys)).unwrap();
        let batches = collect(&app, SubscribeRequest { start: StartAt::Earliest, end: EndAt::Current, ..Default::default() });
        let mut seen_offsets: HashMap<(u32, u64), usize> = HashMap::new();
        for batch in &batches {
            for record in &batch.records {
                *seen_offsets.entry((batch.partition, record.offset)).or_default() += 1;
            }
        }
        prop_assert_eq!(seen_offsets.len(), records);
        prop_assert!(seen_offsets.values().all(|&n| n == 1));
    }
}

#[test]
fn fewer_threads_than_threads_per_task_is_rejected_with_the_fix() {
    let err = StreamsApp::start(config(2, 3, ProcessingOrder::Offset, 1, "count"))
        .err()
        .unwrap();
    let RuntimeError::InvalidConfig(err) = err else {
        panic!("{err}")
    };
    assert_eq!(err.setting, "num_stream_threads");
    assert!(
        err.message.contains("raise num_stream_threads to at least 3"),
        "{err}"
    );
}

#[test]
fn remainder_threads_do_work_when_n_is_not_a_multiple_of_t() {
    let seen = Arc::new(Concurrency::default());
    // N = 3, T = 2, two tasks: the third thread is a remainder and must still help.
    let app = StreamsApp::builder(config(3, 2, ProcessingOrder::Offset, 2, "c"))
        .processor("c", seen.processor(Duration::from_millis(2)))
        .start()
        .unwrap();
    app.produce("in", keyed(600, 200)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    let described = app.describe();
    assert_eq!(described.threads.len(), 3);
    for thread in &described.threads {
        assert!(
            thread.records_processed > 0,
            "{} did no work: {described:?}",
            thread.name
        );
    }
}

#[test]
fn a_crashed_thread_is_replaced_and_processing_completes_exactly_once() {
    let app = StreamsApp::builder(config(2, 2, ProcessingOrder::Offset, 2, "count"))
        .processor(
            "count",
            Arc::new(|r: &Record, ctx: &ProcessorContext<'_>| {
                std::thread::sleep(Duration::from_micros(200));
                taskstream_server::processor::Count.process(r, ctx)
            }),
        )
        .start()
        .unwrap();
    let before: Vec<String> = app.describe().threads.iter().map(|t| t.name.clone()).collect();
    app.produce("in", keyed(2000, 10)).unwrap();
    app.inject_thread_crash(&before[0]).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while app.describe().threads.iter().any(|t| t.name == before[0]) {
        assert!(std::time::Instant::now() < deadline, "the thread never died");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(app.wait_until_caught_up(WAIT));
    let after = app.describe();
    assert_eq!(after.num_stream_threads, 2);
    assert!(
        !after.threads.iter().any(|t| t.name == before[0]),
        "dead thread gone"
    );
    let total: u64 = (0..10)
        .map(|k| {
            let v = app.get("p", format!("k{k}").as_bytes()).unwrap().unwrap();
            std::str::from_utf8(&v).unwrap().parse::<u64>().unwrap()
        })
        .sum();
    assert_eq!(total, 2000, "every record counted once");
}

#[test]
fn shutdown_commits_the_watermark_and_a_restart_restores_the_memory_store_then_resumes() {
    let log = MemoryLog::new();
    let app = StreamsApp::builder(config(2, 1, ProcessingOrder::Offset, 2, "count"))
        .log(log.clone())
        .processor("count", Arc::new(taskstream_server::processor::Count))
        .start()
        .unwrap();
    app.produce("in", keyed(1000, 1)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    app.shutdown().unwrap();
    assert_eq!(app.state(), AppState::Stopped);
    let ends: Vec<u64> = (0..2).map(|p| log.end_offset("in", p).unwrap()).collect();
    for p in 0..2 {
        // A partition that never saw a record has nothing to commit.
        assert_eq!(
            log.committed("test", "in", p).unwrap().unwrap_or(0),
            ends[p as usize]
        );
    }
    drop(app);

    let app = StreamsApp::builder(config(2, 1, ProcessingOrder::Offset, 2, "count"))
        .log(log.clone())
        .processor("count", Arc::new(taskstream_server::processor::Count))
        .start()
        .unwrap();
    // The memory store is rebuilt from the log up to the committed watermark…
    assert!(app.wait_until_caught_up(WAIT));
    assert_eq!(app.get("p", b"k0").unwrap().unwrap(), "1000");
    let task = app
        .describe()
        .tasks
        .into_iter()
        .find(|t| t.end_offset > 0)
        .unwrap();
    assert_eq!(
        task.records_processed, 0,
        "restoring is not processing: no outcomes"
    );
    // …and processing resumes after it, each record applied once.
    app.produce("in", keyed(300, 1)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    assert_eq!(app.get("p", b"k0").unwrap().unwrap(), "1300");
}

#[test]
fn async_commits_report_to_the_callback_in_order() {
    let reports: Arc<Mutex<Vec<CommitReport>>> = Arc::default();
    let sink = reports.clone();
    let mut cfg = config(2, 2, ProcessingOrder::Offset, 1, "slow");
    cfg.commit_mode = CommitMode::Async;
    cfg.commit_interval_ms = 5;
    cfg.max_batch_records = 50;
    let app = StreamsApp::builder(cfg)
        .processor(
            "slow",
            Arc::new(|_: &Record, _: &ProcessorContext<'_>| {
                std::thread::sleep(Duration::from_micros(100));
                Ok(())
            }),
        )
        .on_commit(move |report| sink.lock().unwrap().push(report.clone()))
        .start()
        .unwrap();
    app.produce("in", keyed(3000, 5)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    app.shutdown().unwrap();
    let reports = reports.lock().unwrap();
    assert!(reports.len() >= 2, "{} commits: {reports:?}", reports.len());
    assert!(reports.iter().all(|r| r.result.is_ok()));
    assert!(
        reports.windows(2).all(|w| w[0].offset < w[1].offset),
        "in order: {reports:?}"
    );
    assert_eq!(reports.last().unwrap().offset, 3000);
}

#[test]
fn a_full_sequencer_stops_fetching() {
    let gate = Arc::new(Mutex::new(()));
    let held = gate.lock().unwrap();
    let blocker = gate.clone();
    let mut cfg = config(4, 4, ProcessingOrder::Offset, 1, "g");
    cfg.max_in_flight_records = 40;
    cfg.max_batch_records = 10;
    let app = StreamsApp::builder(cfg)
        .processor(
            "g",
            Arc::new(move |r: &Record, _: &ProcessorContext<'_>| {
                if r.offset == 0 {
                    drop(blocker.lock().unwrap());
                }
                Ok(())
            }),
        )
        .start()
        .unwrap();
    app.produce("in", keyed(500, 3)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let task = app.describe().tasks.remove(0);
    assert_eq!(task.watermark, 0);
    assert!(task.in_flight <= 40, "in flight {}", task.in_flight);
    assert!(task.in_flight > 0);
    drop(held);
    assert!(app.wait_until_caught_up(WAIT));
}

#[test]
fn a_slow_subscriber_is_told_what_it_missed_and_processing_goes_on() {
    let mut cfg = config(2, 2, ProcessingOrder::Offset, 1, "count");
    cfg.subscriber_buffer_batches = 4;
    cfg.max_batch_records = 10;
    let app = StreamsApp::builder(cfg)
        .processor("count", Arc::new(taskstream_server::processor::Count))
        .start()
        .unwrap();
    let mut subscription = app.subscribe("p", SubscribeRequest::default()).unwrap();
    for _ in 0..50 {
        app.produce("in", keyed(20, 3)).unwrap();
    }
    assert!(
        app.wait_until_caught_up(WAIT),
        "processing never waits for the subscriber"
    );
    let first = rt().block_on(subscription.next()).unwrap().unwrap();
    assert!(
        matches!(first, SubscriptionEvent::Lagged { missed_batches } if missed_batches > 0),
        "{first:?}"
    );
}

#[test]
fn in_order_is_refused_for_key_and_unordered_with_several_threads() {
    for order in [ProcessingOrder::Key, ProcessingOrder::Unordered] {
        let app = StreamsApp::start(config(2, 2, order, 1, "count")).unwrap();
        let err = app.process_metadata_for_store("p", true).unwrap_err();
        assert!(matches!(err, RuntimeError::OrderNotGuaranteed { .. }), "{err}");
        assert!(
            app.subscribe(
                "p",
                SubscribeRequest {
                    in_order: true,
                    ..Default::default()
                }
            )
            .is_err()
        );
        assert!(app.process_metadata_for_store("p", false).is_ok());
        // One thread per task is always in order.
        let app = StreamsApp::start(config(2, 1, order, 1, "count")).unwrap();
        assert!(app.process_metadata_for_store("p", true).unwrap().in_order);
    }
}

#[test]
fn thread_add_rebalances_and_remove_refuses_to_go_below_t() {
    let app = StreamsApp::start(config(2, 2, ProcessingOrder::Offset, 4, "count")).unwrap();
    let err = app.remove_stream_thread(None).unwrap_err();
    assert!(
        matches!(err, RuntimeError::InvalidArgument { ref field, .. } if field == "num_stream_threads"),
        "{err}"
    );
    let added = app.add_stream_thread().unwrap();
    let described = app.describe();
    assert_eq!(described.num_stream_threads, 3);
    let owned = described
        .threads
        .iter()
        .find(|t| t.name == added)
        .unwrap()
        .owned_tasks
        .len();
    assert_eq!(owned, 1, "the new thread took its share of four tasks");
    let removed = app.remove_stream_thread(Some(&added)).unwrap();
    assert_eq!(removed, added);
    app.produce("in", keyed(100, 7)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    let described = app.describe();
    let owners: BTreeMap<String, usize> = described
        .threads
        .iter()
        .filter(|t| t.name != added)
        .map(|t| (t.name.clone(), t.owned_tasks.len()))
        .collect();
    assert_eq!(owners.values().sum::<usize>(), 4, "{owners:?}");
}

#[test]
fn start_offsets_before_the_retained_history_are_out_of_range() {
    let mut cfg = config(1, 1, ProcessingOrder::Offset, 1, "count");
    cfg.outcome_retention_records = 100;
    cfg.max_batch_records = 10;
    let app = StreamsApp::builder(cfg)
        .processor("count", Arc::new(taskstream_server::processor::Count))
        .start()
        .unwrap();
    app.produce("in", keyed(1000, 3)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    let request = |start: u64| SubscribeRequest {
        start: StartAt::Offsets(BTreeMap::from([(0, start)])),
        end: EndAt::Current,
        ..Default::default()
    };
    let err = app.subscribe("p", request(5)).err().unwrap();
    assert!(
        matches!(
            err,
            RuntimeError::OffsetOutOfRange {
                partition: 0,
                requested: 5,
                ..
            }
        ),
        "{err}"
    );
    let batches = collect(&app, request(950));
    let offsets: Vec<u64> = batches
        .iter()
        .flat_map(|b| b.records.iter().map(|r| r.offset))
        .collect();
    assert_eq!(offsets, (950..1000).collect::<Vec<_>>());
}
