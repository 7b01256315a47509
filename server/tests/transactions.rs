//! Aborted transactions under exactly_once_v2 on Apache Kafka
//! (tests/common/kafka.rs): a task whose transaction aborts is closed without
//! a commit and revived from its last committed transaction, so every record
//! of the aborted one runs again and nothing is lost or applied twice — read
//! back `read_committed` from the sink, retry and dead-letter topics, and
//! from the stores. The abort is injected (the `fault-injection` feature),
//! and real: a transaction held past a short `transaction.timeout.ms`.

#[path = "../../tests/common/kafka.rs"]
mod kafka;

use bytes::Bytes;
use kafka::{Broker, broker, unique};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use taskstream_server::log::KafkaLog;
use taskstream_server::{
    Config, GroupProtocol, Log as _, PipelineConfig, ProcessError, ProcessingGuarantee, ProcessorContext,
    ProcessorSpec, ProducerRecord, Record, StoreKind, StreamsApp, TopicConfig,
};

const DEADLINE: Duration = Duration::from_secs(120);
const PARTITIONS: u32 = 2;

/// The runtime's log lines, on the test's output (`RUST_LOG`, default warn).
fn log_to_test_output() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "within {DEADLINE:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One application under exactly_once_v2: `counts` counts records per key
/// with the `audit` processor, which also emits one output per record (its
/// source as a header) to `<application>-out`.
fn config(broker: &Broker, application: &str, topic: &str, store: StoreKind) -> Config {
    let mut config = Config {
        application_id: application.to_string(),
        num_stream_threads: 2,
        commit_interval_ms: 100,
        bootstrap_servers: Some(broker.bootstrap.clone()),
        replication_factor: 1,
        group_protocol: GroupProtocol::Consumer,
        processing_guarantee: ProcessingGuarantee::ExactlyOnceV2,
        retry_backoff_ms: 50,
        retry_max_attempts: 2,
        ..Default::default()
    };
    config
        .kafka
        .insert("transaction.timeout.ms".into(), "10000".into());
    config.topics.push(TopicConfig::new(topic, PARTITIONS));
    let mut pipeline = PipelineConfig::new("counts", topic, ProcessorSpec::Custom { name: "audit".into() });
    pipeline.sink_topic = Some(format!("{application}-out"));
    pipeline.store = Some(store);
    config.pipelines.push(pipeline);
    config
}

/// The value of every record: its index. Records whose index is a multiple
/// of 7 fail their first attempt (a retry entry in the transaction), of 50
/// fail every attempt (a dead letter in it).
fn audit(calls: Arc<AtomicU64>) -> Arc<dyn taskstream_server::Processor> {
    Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
        calls.fetch_add(1, Ordering::Relaxed);
        let index: u64 = std::str::from_utf8(&record.value)
            .ok()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| ProcessError::new("BadValue", "not an index"))?;
        if index.is_multiple_of(50) {
            return Err(ProcessError::new("Poison", "always fails"));
        }
        if index.is_multiple_of(7) && ctx.attempt == 1 {
            return Err(ProcessError::new("Flaky", "first attempt"));
        }
        let key = record.key.clone().unwrap_or_default();
        ctx.store.update(&key, &mut |old| {
            let n: u64 = old
                .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                .unwrap_or(0);
            Some(Bytes::from((n + 1).to_string()))
        })?;
        let mut output = ProducerRecord::keyed(key, record.value.clone());
        output.headers.push(("index".into(), record.value.clone()));
        ctx.emit(output);
        Ok(())
    })
}

fn records(from: u64, to: u64) -> (Vec<ProducerRecord>, BTreeMap<String, u64>) {
    let mut counted = BTreeMap::new();
    let records = (from..to)
        .map(|i| {
            let key = format!("key-{}", i % 23);
            if i % 50 != 0 {
                *counted.entry(key.clone()).or_default() += 1;
            }
            ProducerRecord::keyed(key, i.to_string())
        })
        .collect();
    (records, counted)
}

fn counts(app: &StreamsApp) -> BTreeMap<String, u64> {
    let Ok(results) = app.query_range("counts", None, None, &[], 0) else {
        return BTreeMap::new();
    };
    results
        .into_iter()
        .flat_map(|result| result.entries)
        .filter_map(|(key, value)| {
            let count = std::str::from_utf8(&value).ok()?.parse().ok()?;
            Some((String::from_utf8_lossy(&key).into_owned(), count))
        })
        .collect()
}

/// Every record of `topic` a read_committed reader sees, by the value of
/// header `index` (or the record's value), counted.
fn committed_values(broker: &Broker, topic: &str, header: Option<&str>) -> BTreeMap<u64, u32> {
    let mut settings = BTreeMap::new();
    settings.insert("isolation.level".to_string(), "read_committed".to_string());
    settings.insert("enable.partition.eof".to_string(), "true".to_string());
    let reader = KafkaLog::with_settings(&broker.bootstrap, &settings, 1).expect("connect to the broker");
    let mut seen = BTreeMap::new();
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
                if let Some(index) = std::str::from_utf8(&value).ok().and_then(|v| v.parse().ok()) {
                    *seen.entry(index).or_default() += 1;
                }
            }
        }
    }
    seen
}

/// The outputs (read_committed) hold each processed record once, the
/// dead-letter topic each always-failing one once, and the counts every
/// counted record once.
fn assert_exactly_once(
    broker: &Broker,
    application: &str,
    app: &StreamsApp,
    total: u64,
    expected: &BTreeMap<String, u64>,
) {
    let outputs = committed_values(broker, &format!("{application}-out"), Some("index"));
    let twice: Vec<_> = outputs.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "outputs seen more than once: {twice:?}");
    let missing: Vec<u64> = (0..total)
        .filter(|i| i % 50 != 0 && !outputs.contains_key(i))
        .collect();
    assert!(missing.is_empty(), "outputs missing: {missing:?}");
    let dead = committed_values(broker, &format!("{application}-counts-dlq"), None);
    let poison: BTreeMap<u64, u32> = (0..total).filter(|i| i % 50 == 0).map(|i| (i, 1)).collect();
    assert_eq!(
        dead, poison,
        "each poison record dead-lettered once, nothing else"
    );
    assert_eq!(&counts(app), expected, "every counted record counted once");
}

fn run_with_injected_aborts(store: StoreKind, label: &str) {
    log_to_test_output();
    let Some(broker) = broker() else { return };
    let application = unique(&format!("eos-abort-{label}"));
    let topic = format!("{application}-events");
    let dir = taskstream_server::scratch::scratch_dir("eos-abort").expect("a scratch dir");
    let mut config = config(broker, &application, &topic, store);
    config.data_dir = Some(dir.path().to_path_buf());
    let calls = Arc::new(AtomicU64::new(0));
    let app = StreamsApp::builder(config)
        .processor("audit", audit(calls.clone()))
        .start()
        .expect("start the instance");
    eventually("the instance hosts both partitions", || {
        app.hosted_partitions("counts").unwrap().len() == PARTITIONS as usize
    });
    let mut expected = BTreeMap::new();
    let total = 2_000;
    for round in 0..10 {
        let (batch, counted) = records(round * 200, (round + 1) * 200);
        for (key, n) in counted {
            *expected.entry(key).or_default() += n;
        }
        app.produce(&topic, batch).expect("produce");
        // Each round aborts the next commit of one task or the other.
        app.inject_transaction_abort(&format!("counts_{}", round % 2))
            .expect("inject an abort");
        std::thread::sleep(Duration::from_millis(150));
    }
    let within = Instant::now() + DEADLINE;
    loop {
        let last = counts(&app);
        if last == expected {
            break;
        }
        assert!(
            Instant::now() < within,
            "every counted record shows in the counts: {} counted of {}; differing: {:?}",
            last.values().sum::<u64>(),
            expected.values().sum::<u64>(),
            expected
                .iter()
                .filter(|(k, n)| last.get(*k) != Some(n))
                .map(|(k, n)| (k, *n, last.get(k).copied()))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        app.wait_until_caught_up(DEADLINE),
        "the instance processes everything: {:#?}",
        app.describe()
    );
    let calls = calls.load(Ordering::Relaxed);
    println!("{label}: {total} records, {calls} processor calls (records of aborted transactions ran again)");
    assert!(
        calls > total + total / 7,
        "aborted transactions ran their records again: {calls} calls"
    );
    app.shutdown().expect("shutdown commits");
    // Counted again from a fresh instance: what was committed is all there is.
    let mut config = self::config(broker, &application, &topic, store);
    let second = taskstream_server::scratch::scratch_dir("eos-abort-b").expect("a scratch dir");
    config.data_dir = Some(second.path().to_path_buf());
    let again = StreamsApp::builder(config)
        .processor("audit", audit(Arc::new(AtomicU64::new(0))))
        .start()
        .expect("start a fresh instance");
    eventually("a fresh instance restores the same counts", || {
        counts(&again) == expected
    });
    assert_exactly_once(broker, &application, &again, total, &expected);
    again.shutdown().expect("shutdown");
}

#[test]
fn an_injected_abort_revives_the_task_and_loses_nothing_with_memory_stores() {
    run_with_injected_aborts(StoreKind::Memory, "memory");
}

#[test]
fn an_injected_abort_revives_the_task_and_loses_nothing_with_persistent_stores() {
    run_with_injected_aborts(StoreKind::Persistent, "persistent");
}

/// A real abort: one record takes longer than the transaction timeout, so
/// the broker aborts the transaction its task had opened (with the outputs
/// of the records before it); the commit fails, the task is revived and
/// runs them again (the slow record is slow once).
#[test]
fn a_transaction_past_its_timeout_is_revived_and_loses_nothing() {
    log_to_test_output();
    let Some(broker) = broker() else { return };
    let application = unique("eos-timeout");
    let topic = format!("{application}-events");
    let dir = taskstream_server::scratch::scratch_dir("eos-timeout").expect("a scratch dir");
    let mut config = config(broker, &application, &topic, StoreKind::Persistent);
    config.data_dir = Some(dir.path().to_path_buf());
    config
        .kafka
        .insert("transaction.timeout.ms".into(), "2000".into());
    config.processing_timeout_ms = 60_000;
    let calls = Arc::new(AtomicU64::new(0));
    let slow_once = Arc::new(AtomicBool::new(true));
    let inner = audit(calls.clone());
    let processor = {
        let slow_once = slow_once.clone();
        Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
            if record.value.as_ref() == b"1001" && slow_once.swap(false, Ordering::SeqCst) {
                std::thread::sleep(Duration::from_secs(5));
            }
            inner.process(record, ctx)
        })
    };
    let app = StreamsApp::builder(config)
        .processor("audit", processor)
        .start()
        .expect("start the instance");
    eventually("the instance hosts both partitions", || {
        app.hosted_partitions("counts").unwrap().len() == PARTITIONS as usize
    });
    let total = 1_500;
    let (batch, expected) = records(0, total);
    app.produce(&topic, batch).expect("produce");
    eventually("every counted record shows in the counts", || {
        counts(&app) == expected
    });
    assert!(
        app.wait_until_caught_up(DEADLINE),
        "the instance processes everything"
    );
    assert!(!slow_once.load(Ordering::SeqCst), "the slow record ran");
    let calls = calls.load(Ordering::Relaxed);
    println!("timeout: {total} records, {calls} processor calls");
    assert_exactly_once(broker, &application, &app, total, &expected);
    app.shutdown().expect("shutdown");
}
