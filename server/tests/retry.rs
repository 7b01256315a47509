//! The failure path end to end through `StreamsApp`: failing records go to the
//! retry topic and the partition moves on; retries run with backoff on reserve
//! threads; the last failure goes to the dead-letter topic with its headers;
//! `key` order parks later records of a failing key; `blocking` waits in place.
//! Order claims are checked by completion order, never by wall time.

use bytes::Bytes;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use taskstream_server::*;

const WAIT: Duration = Duration::from_secs(60);

fn config(n: usize, t: usize, order: ProcessingOrder, partitions: u32, processor: &str) -> Config {
    let mut pipeline = PipelineConfig::new(
        "p",
        "in",
        match processor {
            "latest" => ProcessorSpec::Latest,
            name => ProcessorSpec::Custom { name: name.into() },
        },
    );
    pipeline.partitions = Some(partitions);
    Config {
        application_id: "app".into(),
        num_stream_threads: n,
        num_threads_per_task: t,
        processing_order: order,
        commit_interval_ms: 20,
        retry_backoff_ms: 20,
        retry_backoff_max_ms: 100,
        pipelines: vec![pipeline],
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

/// Every record outcome of partitions `0..partitions` up to `end` (exclusive),
/// in the order they were published: completes once each has a final outcome.
fn outcomes(app: &StreamsApp, ends: BTreeMap<u32, u64>) -> Vec<RecordOutcome> {
    let request = SubscribeRequest {
        start: StartAt::Offsets(ends.keys().map(|&p| (p, 0)).collect()),
        end: EndAt::Offsets(ends),
        ..SubscribeRequest::default()
    };
    let mut subscription = app.subscribe("p", request).unwrap();
    rt().block_on(async {
        let mut records = Vec::new();
        while let Some(event) = tokio::time::timeout(WAIT, subscription.next())
            .await
            .expect("stream stalled")
        {
            match event.unwrap() {
                SubscriptionEvent::Batch(batch) => records.extend(batch.records.iter().cloned()),
                SubscriptionEvent::Lagged { missed_batches } => panic!("lagged by {missed_batches}"),
            }
        }
        records
    })
}

/// Counts per key, failing the records of `poisoned` keys on their first
/// `fail_attempts` attempts (before writing anything, as a processor should).
fn poison_processor(poisoned: HashSet<Bytes>, fail_attempts: u32) -> Arc<dyn Processor> {
    gated_poison_processor(poisoned, fail_attempts, None)
}

/// As `poison_processor`; with a gate, a poisoned record's successful attempt
/// first waits (up to 10 s) until the gate opens.
fn gated_poison_processor(
    poisoned: HashSet<Bytes>,
    fail_attempts: u32,
    gate: Option<Arc<AtomicBool>>,
) -> Arc<dyn Processor> {
    Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
        let key = record.key.clone().unwrap_or_default();
        if poisoned.contains(&key) && (fail_attempts == 0 || ctx.attempt <= fail_attempts) {
            return Err(ProcessError::new(
                "Poisoned",
                format!("offset {} attempt {}", record.offset, ctx.attempt),
            ));
        }
        if let Some(gate) = gate.as_ref().filter(|_| poisoned.contains(&key)) {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !gate.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        ctx.store.update(&key, &mut |old| {
            let n: u64 = old.map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
            Some(Bytes::from((n + 1).to_string()))
        })?;
        Ok(())
    })
}

fn ends(app: &StreamsApp, partitions: u32) -> BTreeMap<u32, u64> {
    (0..partitions)
        .map(|p| (p, app.log().end_offset("in", p).unwrap()))
        .collect()
}

#[test]
fn poisoned_keys_retry_off_the_partition_and_apply_exactly_once() {
    for order in [
        ProcessingOrder::Offset,
        ProcessingOrder::Key,
        ProcessingOrder::Unordered,
    ] {
        let poisoned: HashSet<Bytes> = ["k3", "k7"].into_iter().map(Bytes::from).collect();
        // The gate opens once a subscriber has seen all 1600 healthy records
        // processed: were they stuck behind the poisoned ones, it never would,
        // and the poisoned records would finish first after the gate's timeout.
        let gate = Arc::new(AtomicBool::new(false));
        let mut cfg = config(4, 2, order, 2, "poison");
        // In key order each poisoned key's 200 records retry one after another.
        cfg.retry_backoff_ms = 1;
        cfg.retry_backoff_max_ms = 2;
        let app = StreamsApp::builder(cfg)
            .processor(
                "poison",
                gated_poison_processor(poisoned.clone(), 2, Some(gate.clone())),
            )
            .start()
            .unwrap();
        let mut watch = app
            .subscribe(
                "p",
                SubscribeRequest {
                    start: StartAt::Offsets([(0, 0), (1, 0)].into()),
                    ..SubscribeRequest::default()
                },
            )
            .unwrap();
        let opener = {
            let (gate, poisoned) = (gate.clone(), poisoned.clone());
            std::thread::spawn(move || {
                rt().block_on(async {
                    let mut healthy = 0;
                    while healthy < 1600 {
                        match tokio::time::timeout(WAIT, watch.next()).await {
                            Ok(Some(Ok(SubscriptionEvent::Batch(batch)))) => {
                                healthy += batch
                                    .records
                                    .iter()
                                    .filter(|r| !poisoned.contains(r.key.as_ref().unwrap()))
                                    .filter(|r| r.outcome == Outcome::Processed)
                                    .count();
                            }
                            other => panic!("stream ended early: {other:?}"),
                        }
                    }
                });
                gate.store(true, Ordering::SeqCst);
            })
        };
        app.produce("in", keyed(2000, 10)).unwrap();
        opener.join().unwrap();
        assert!(app.wait_until_caught_up(WAIT), "{order}");
        for k in 0..10 {
            let key = format!("k{k}");
            assert_eq!(
                app.get("p", key.as_bytes()).unwrap().as_deref(),
                Some(&b"200"[..]),
                "{order}: {key} applied exactly once per record"
            );
        }

        let records = outcomes(&app, ends(&app, 2));
        let mut by_offset: HashMap<(Bytes, u64), Vec<(Outcome, u32)>> = HashMap::new();
        for r in &records {
            by_offset
                .entry((r.key.clone().unwrap(), r.offset))
                .or_default()
                .push((r.outcome, r.attempts));
        }
        assert_eq!(by_offset.len(), 2000, "{order}: every record has outcomes");
        for ((key, offset), history) in &by_offset {
            let last = *history.last().unwrap();
            if poisoned.contains(key) {
                // Parked records of a key (key order) start at attempt 0.
                assert!(
                    history[..history.len() - 1]
                        .iter()
                        .all(|(o, _)| *o == Outcome::Retrying),
                    "{order}: {key:?}@{offset}: {history:?}"
                );
                assert_eq!(
                    last.0,
                    Outcome::Processed,
                    "{order}: {key:?}@{offset}: {history:?}"
                );
                assert_eq!(last.1, 3, "{order}: failed twice, then succeeded");
            } else {
                assert_eq!(
                    history,
                    &vec![(Outcome::Processed, 1)],
                    "{order}: {key:?}@{offset}"
                );
            }
        }
        // Healthy records never waited: in each partition's history (kept in
        // completion order), every one completed before the first poisoned one.
        for partition in 0..2u32 {
            let key_partition = |r: &RecordOutcome| log::partition_for_key(r.key.as_ref().unwrap(), 2);
            let history: Vec<&RecordOutcome> =
                records.iter().filter(|r| key_partition(r) == partition).collect();
            let last_healthy = history
                .iter()
                .rposition(|r| !poisoned.contains(r.key.as_ref().unwrap()));
            let first_poisoned_final = history
                .iter()
                .position(|r| poisoned.contains(r.key.as_ref().unwrap()) && r.outcome == Outcome::Processed);
            if let (Some(healthy), Some(poisoned)) = (last_healthy, first_poisoned_final) {
                assert!(healthy < poisoned, "{order}: partition {partition}");
            }
        }

        let described = app.describe();
        assert_eq!(described.pipelines[0].retry_topic, "app-p-retry");
        assert_eq!(described.pipelines[0].retry_backlog, 0);
        assert_eq!(described.pipelines[0].dead_lettered, 0);
        let failed: u64 = described.tasks.iter().map(|t| t.records_failed).sum();
        // 400 poisoned records fail twice each.
        assert_eq!(failed, 800, "{order}");
    }
}

#[test]
fn an_always_failing_record_is_dead_lettered_with_every_header_and_nothing_else_is_lost() {
    let poisoned: HashSet<Bytes> = [Bytes::from("bad")].into_iter().collect();
    let mut cfg = config(2, 2, ProcessingOrder::Offset, 1, "poison");
    cfg.retry_max_attempts = 3;
    let app = StreamsApp::builder(cfg)
        .processor("poison", poison_processor(poisoned, 0))
        .start()
        .unwrap();
    let mut records = keyed(500, 5);
    let mut original = ProducerRecord::keyed("bad", "payload");
    original.headers = vec![("trace".into(), Bytes::from("t-1"))];
    original.timestamp_ms = Some(1_700_000_000_000);
    records.insert(250, original.clone());
    app.produce("in", records).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    for k in 0..5 {
        assert_eq!(app.get("p", format!("k{k}").as_bytes()).unwrap().unwrap(), "100");
    }

    let log = app.log();
    let mut dead = Vec::new();
    log.read("app-p-dlq", 0, 0, 10, &mut dead).unwrap();
    assert_eq!(dead.len(), 1, "{dead:#?}");
    let dead = &dead[0];
    assert_eq!(dead.key.as_deref(), Some(&b"bad"[..]), "raw key unchanged");
    assert_eq!(dead.value, "payload", "raw value unchanged");
    let header = |name: &str| -> String {
        let (_, value) = dead.headers.iter().find(|(n, _)| n == name).unwrap_or_else(|| {
            panic!("no header {name} in {:?}", dead.headers);
        });
        String::from_utf8(value.to_vec()).unwrap()
    };
    use failure_headers::*;
    assert_eq!(header("trace"), "t-1", "the record's own headers are kept");
    assert_eq!(header(EXCEPTION), "Poisoned");
    assert_eq!(header(MESSAGE), "offset 250 attempt 3");
    assert_eq!(header(TOPIC), "in");
    assert_eq!(header(PARTITION), "0");
    assert_eq!(header(OFFSET), "250");
    assert_eq!(header(ATTEMPTS), "3");
    let first: i64 = header(FIRST_FAILURE_MS).parse().unwrap();
    let last: i64 = header(LAST_FAILURE_MS).parse().unwrap();
    assert!(
        first > 0 && last >= first + 20,
        "two backoffs between {first} and {last}"
    );
    assert_eq!(dead.timestamp_ms, 1_700_000_000_000, "original timestamp");

    let outcomes = outcomes(&app, ends(&app, 1));
    let bad: Vec<_> = outcomes.iter().filter(|r| r.offset == 250).collect();
    assert_eq!(
        bad.iter().map(|r| (r.outcome, r.attempts)).collect::<Vec<_>>(),
        vec![
            (Outcome::Retrying, 1),
            (Outcome::Retrying, 2),
            (Outcome::DeadLettered, 3)
        ]
    );
    assert!(bad[2].error.as_deref().unwrap().contains("Poisoned"));
    assert_eq!(
        outcomes
            .iter()
            .filter(|r| r.outcome == Outcome::Processed)
            .count(),
        500,
        "nothing else is lost"
    );
    let described = app.describe();
    assert_eq!(described.pipelines[0].dead_lettered, 1);
    assert_eq!(described.pipelines[0].dead_letter_topic, "app-p-dlq");
    assert_eq!(described.tasks[0].records_dead_lettered, 1);
}

#[test]
fn key_order_parks_a_failing_keys_later_records_so_latest_wins() {
    // Every record of `k1` fails its first attempt: later records of `k1` must
    // wait behind it, so the store ends with `k1`'s highest offset.
    let fails_once = Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        if record.key.as_deref() == Some(b"k1") && ctx.attempt == 1 {
            return Err(ProcessError::new("Flaky", "first attempt"));
        }
        ctx.store.put(record.key.clone().unwrap(), record.value.clone())?;
        Ok(())
    });
    let app = StreamsApp::builder(config(4, 4, ProcessingOrder::Key, 1, "flaky"))
        .processor("flaky", fails_once)
        .start()
        .unwrap();
    let records = keyed(400, 8);
    app.produce("in", records).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    for k in 0..8 {
        let highest = (0..400).filter(|i| i % 8 == k).max().unwrap();
        assert_eq!(
            app.get("p", format!("k{k}").as_bytes()).unwrap().unwrap(),
            highest.to_string(),
            "k{k} holds its highest offset's value"
        );
    }
    let outcomes = outcomes(&app, ends(&app, 1));
    // The k1 records after the first were held in memory behind it, not
    // parked on the retry topic: only the failures went there.
    let k1: Vec<_> = outcomes
        .iter()
        .filter(|r| r.key.as_deref() == Some(b"k1"))
        .collect();
    let finals: Vec<u64> = k1
        .iter()
        .filter(|r| r.outcome == Outcome::Processed)
        .map(|r| r.offset)
        .collect();
    let mut sorted = finals.clone();
    sorted.sort_unstable();
    assert_eq!(finals, sorted, "k1 completes in offset order across retries");
    assert_eq!(finals.len(), 50);
    assert!(
        !k1.iter()
            .any(|r| r.outcome == Outcome::Retrying && r.attempts == 0),
        "nothing parked on the retry topic"
    );
    assert_eq!(
        app.log().end_offset("app-p-retry", 0).unwrap(),
        50,
        "one retry entry per failed attempt, no detour"
    );
    // Other keys flowed: all their records were final before k1's last.
    let last_k1 = outcomes
        .iter()
        .rposition(|r| r.key.as_deref() == Some(b"k1"))
        .unwrap();
    let last_other = outcomes
        .iter()
        .rposition(|r| r.key.as_deref() != Some(b"k1"))
        .unwrap();
    assert!(last_other < last_k1);
}

#[test]
fn keys_longer_than_outcome_keys_keep_their_order_on_the_retry_path() {
    // Outcomes carry keys cut to `outcome_key_bytes`; the key gate must hold
    // the record's own key, or a long key's later records would run before
    // its failed one is retried (and the cut key would stay gated).
    let long_key = |k: usize| Bytes::from(format!("k{k}-{}", "x".repeat(100)));
    // Only its first record fails (once): its later ones must wait for it.
    let failing = long_key(1);
    for order in [ProcessingOrder::Key, ProcessingOrder::Offset] {
        let succeeded: Arc<Mutex<Vec<(Bytes, u64)>>> = Arc::default();
        let processor = {
            let (failing, succeeded) = (failing.clone(), succeeded.clone());
            Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
                let key = record.key.clone().unwrap_or_default();
                if key == failing && record.offset == 1 && ctx.attempt == 1 {
                    return Err(ProcessError::new("Flaky", "first attempt"));
                }
                ctx.store.put(key.clone(), record.value.clone())?;
                succeeded.lock().unwrap().push((key, record.offset));
                Ok(())
            })
        };
        let mut cfg = config(4, 4, order, 1, "flaky");
        cfg.outcome_key_bytes = 16;
        let app = StreamsApp::builder(cfg)
            .processor("flaky", processor)
            .start()
            .unwrap();
        let records: Vec<ProducerRecord> = (0..400)
            .map(|i| ProducerRecord::keyed(long_key(i % 8), i.to_string()))
            .collect();
        app.produce("in", records).unwrap();
        assert!(app.wait_until_caught_up(WAIT), "{order}");
        for k in 0..8 {
            let highest = (0..400).filter(|i| i % 8 == k).max().unwrap();
            assert_eq!(
                app.get("p", &long_key(k)).unwrap().unwrap(),
                highest.to_string(),
                "{order}: key {k} holds its highest offset's value"
            );
        }
        let succeeded = succeeded.lock().unwrap();
        for k in 0..8 {
            let offsets: Vec<u64> = succeeded
                .iter()
                .filter(|(key, _)| *key == long_key(k))
                .map(|&(_, offset)| offset)
                .collect();
            assert_eq!(offsets.len(), 50, "{order}: key {k} ran each record once");
            assert!(
                offsets.is_sorted(),
                "{order}: key {k} ran in offset order: {offsets:?}"
            );
        }
    }
}

#[test]
fn a_record_running_past_the_processing_timeout_takes_the_retry_path() {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let slow_once = Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
        if record.offset == 3 && ctx.attempt == 1 {
            seen.fetch_add(1, Ordering::SeqCst);
            // Ignores its deadline: the runtime must still fail it.
            std::thread::sleep(Duration::from_millis(150));
        }
        ctx.store
            .put(record.key.clone().unwrap(), Bytes::from(ctx.attempt.to_string()))?;
        Ok(())
    });
    let mut cfg = config(2, 1, ProcessingOrder::Offset, 1, "slow");
    cfg.processing_timeout_ms = 50;
    let app = StreamsApp::builder(cfg)
        .processor("slow", slow_once)
        .start()
        .unwrap();
    let records = (0..6)
        .map(|i| ProducerRecord::keyed(format!("k{i}"), "v"))
        .collect();
    app.produce("in", records).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let outcomes = outcomes(&app, ends(&app, 1));
    let third: Vec<_> = outcomes.iter().filter(|r| r.offset == 3).collect();
    assert_eq!(third.len(), 2, "{third:#?}");
    assert_eq!(third[0].outcome, Outcome::Retrying);
    assert!(
        third[0].error.as_deref().unwrap().starts_with("Timeout"),
        "{third:#?}"
    );
    assert_eq!((third[1].outcome, third[1].attempts), (Outcome::Processed, 2));
    assert_eq!(app.get("p", b"k3").unwrap().unwrap(), "2");
}

#[test]
fn a_hand_written_retry_record_dated_in_the_future_is_retried_not_stuck() {
    // Only `admin` may write a retry topic through the service; what it writes
    // there must still drain. A last failure in the future counts as now.
    let app = StreamsApp::start(config(2, 1, ProcessingOrder::Offset, 1, "latest")).unwrap();
    app.produce("in", vec![ProducerRecord::keyed("k", "v")]).unwrap();
    let forged = ProducerRecord {
        key: Some(Bytes::from_static(b"forged")),
        value: Bytes::from_static(b"f"),
        partition: Some(0),
        timestamp_ms: Some(i64::MAX),
        headers: Vec::new(),
    };
    app.produce("app-p-retry", vec![forged]).unwrap();
    assert!(app.wait_until_caught_up(WAIT), "the retry backlog drains");
    assert_eq!(app.get("p", b"forged").unwrap().unwrap(), "f");
    assert_eq!(app.get("p", b"k").unwrap().unwrap(), "v");
}

#[test]
fn reserve_threads_are_lent_to_retries_and_return_when_the_backlog_is_drained() {
    // Retries are slow, so the lent threads can be seen.
    let slow_retries = Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        if record.offset.is_multiple_of(10) {
            if ctx.attempt == 1 {
                return Err(ProcessError::new("Flaky", "first attempt"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    });
    let mut cfg = config(4, 1, ProcessingOrder::Offset, 1, "flaky");
    cfg.retry_backoff_ms = 1;
    cfg.retry_backoff_max_ms = 1;
    let app = StreamsApp::builder(cfg)
        .processor("flaky", slow_retries)
        .start()
        .unwrap();
    let idle = app.describe().num_reserve_threads;
    assert_eq!(idle, 4, "nothing to do: every thread in reserve");
    app.produce("in", keyed(400, 4)).unwrap();
    let mut most_lent = 0;
    let mut most_backlog = 0;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let now = app.describe();
        most_lent = most_lent.max(now.num_retry_threads);
        most_backlog = most_backlog.max(now.pipelines[0].retry_backlog);
        let retry_threads = now
            .threads
            .iter()
            .filter(|t| t.state == ThreadState::Retry)
            .count();
        assert_eq!(retry_threads as u32, now.num_retry_threads);
        if now.tasks[0].watermark == 400 && now.pipelines[0].retry_backlog == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{now:#?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(most_backlog > 0, "records waited in the retry topic");
    assert!(
        most_lent >= 2,
        "reserve threads drained retries in parallel ({most_lent})"
    );
    // Back to idle: the lent threads return to reserve.
    let deadline = std::time::Instant::now() + WAIT;
    while app.describe().num_reserve_threads != idle {
        assert!(std::time::Instant::now() < deadline, "{:#?}", app.describe());
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(app.describe().num_retry_threads, 0);
}

#[test]
fn blocking_policy_makes_the_partition_wait_for_the_failing_record() {
    let order_seen: Arc<Mutex<Vec<u64>>> = Arc::default();
    let log = order_seen.clone();
    let flaky = Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
        if record.offset == 10 && ctx.attempt <= 2 {
            return Err(ProcessError::new("Flaky", "twice"));
        }
        log.lock().unwrap().push(record.offset);
        Ok(())
    });
    let mut cfg = config(2, 1, ProcessingOrder::Offset, 1, "flaky");
    cfg.retry_policy = RetryPolicy::Blocking;
    let app = StreamsApp::builder(cfg)
        .processor("flaky", flaky)
        .start()
        .unwrap();
    app.produce("in", keyed(50, 5)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    let seen = order_seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        (0..50).collect::<Vec<_>>(),
        "every later record waited for offset 10"
    );
    let outcomes = outcomes(&app, ends(&app, 1));
    let tenth: Vec<_> = outcomes.iter().filter(|r| r.offset == 10).collect();
    assert_eq!(tenth.len(), 1, "retried in place: one final outcome");
    assert_eq!((tenth[0].outcome, tenth[0].attempts), (Outcome::Processed, 3));
    assert_eq!(
        app.log().end_offset("app-p-retry", 0).unwrap(),
        0,
        "no retry topic used"
    );

    // Same workload on the retry topic: offset 10 completes after later offsets.
    let order_seen: Arc<Mutex<Vec<u64>>> = Arc::default();
    let log = order_seen.clone();
    let flaky = Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
        if record.offset == 10 && ctx.attempt <= 2 {
            return Err(ProcessError::new("Flaky", "twice"));
        }
        log.lock().unwrap().push(record.offset);
        Ok(())
    });
    let app = StreamsApp::builder(config(2, 1, ProcessingOrder::Offset, 1, "flaky"))
        .processor("flaky", flaky)
        .start()
        .unwrap();
    app.produce("in", keyed(50, 5)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    let seen = order_seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 50);
    // Offset 10's key (every fifth offset) waits behind it; the other keys
    // flowed past it. `keyed` gives offset o the key k{o % 5}.
    let at = |offset: u64| seen.iter().position(|&o| o == offset).unwrap();
    for offset in (0..50).filter(|o| o % 5 != 0 && *o > 10) {
        assert!(
            at(offset) < at(10),
            "non-blocking: offset {offset} finished before 10"
        );
    }
    for offset in (15..50).step_by(5) {
        assert!(
            at(10) < at(offset),
            "offset {offset} of 10's key waited behind it"
        );
    }
}

#[test]
fn a_retry_finished_out_of_order_is_not_applied_again_after_a_restart() {
    // `slow` (retry offset 0) fails three attempts, `fast` (retry offset 1) one:
    // `fast` is final while `slow` still waits, above the retry watermark. The
    // persistent store's checkpoint must say so, or a restart would count it twice.
    let dir = taskstream_server::scratch::scratch_dir("retry-restart").expect("a temp dir");
    let processor = || -> Arc<dyn Processor> {
        Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
            let key = record.key.clone().unwrap_or_default();
            let failures = if key == "slow" { 3 } else { 1 };
            if ctx.attempt <= failures {
                return Err(ProcessError::new("Flaky", format!("attempt {}", ctx.attempt)));
            }
            ctx.store.update(&key, &mut |old| {
                let n: u64 = old.map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
                Some(Bytes::from((n + 1).to_string()))
            })?;
            Ok(())
        })
    };
    let mut cfg = config(2, 1, ProcessingOrder::Offset, 1, "flaky");
    cfg.data_dir = Some(dir.path().to_path_buf());
    cfg.retry_max_attempts = 10;
    cfg.retry_backoff_ms = 100;
    cfg.retry_backoff_max_ms = 1_000;
    let app = StreamsApp::builder(cfg.clone())
        .processor("flaky", processor())
        .start()
        .unwrap();
    app.produce(
        "in",
        vec![
            ProducerRecord::keyed("slow", "1"),
            ProducerRecord::keyed("fast", "2"),
        ],
    )
    .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while app.describe().tasks[0].records_processed < 1 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(app.describe().pipelines[0].retry_backlog, 1, "slow still waits");
    app.shutdown().unwrap();
    drop(app);

    let app = StreamsApp::builder(cfg)
        .processor("flaky", processor())
        .start()
        .unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    assert_eq!(
        app.get("p", b"fast").unwrap().unwrap(),
        "1",
        "applied once across the restart"
    );
    assert_eq!(app.get("p", b"slow").unwrap().unwrap(), "1");
    app.shutdown().unwrap();
    drop(app);
}
