//! Every RPC end to end through the Rust client: a real server on port 0 over
//! TCP, the status codes of the error table, and the RecordCallback contract
//! (one callback per batch, offset order with `in_order`, coalesced mode).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use taskstream::v1;
use taskstream_client::{
    ClientError, End, MetadataBatch, MetadataOptions, Start, StreamsClient, keyed_record,
};
use taskstream_server::config::LatencySpec;
use taskstream_server::{
    Config, Log, MemoryLog, PipelineConfig, ProcessingOrder, ProcessorSpec, ProducerRecord, Retention,
    StreamsApp, TopicConfig,
};
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(60);

fn pipeline(
    name: &str,
    processor: ProcessorSpec,
    t: Option<usize>,
    order: Option<ProcessingOrder>,
) -> PipelineConfig {
    PipelineConfig {
        name: name.into(),
        source_topic: "events".into(),
        partitions: None,
        processor,
        num_threads_per_task: t,
        processing_order: order,
        store: None,
        retry_policy: None,
        sink_topic: None,
    }
}

/// Stores: `counts` (offset, T = 2), `ukeys` (unordered, T = 2), `kkeys` (key, T = 2),
/// `single` (unordered but T = 1, so in order).
fn config() -> Config {
    Config {
        application_id: "e2e".into(),
        num_stream_threads: 4,
        num_threads_per_task: 2,
        commit_interval_ms: 50,
        topics: vec![TopicConfig::new("events", 8)],
        pipelines: vec![
            pipeline("counts", ProcessorSpec::Count, None, None),
            pipeline(
                "ukeys",
                ProcessorSpec::Count,
                None,
                Some(ProcessingOrder::Unordered),
            ),
            pipeline("kkeys", ProcessorSpec::Latest, None, Some(ProcessingOrder::Key)),
            pipeline(
                "single",
                ProcessorSpec::Count,
                Some(1),
                Some(ProcessingOrder::Unordered),
            ),
        ],
        ..Config::default()
    }
}

/// A server on 127.0.0.1:0; dropping it shuts the server down.
struct Server {
    app: StreamsApp,
    client: StreamsClient,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Server {
    async fn start(config: Config) -> Server {
        Server::start_on(config, None).await
    }

    /// On `log` (with what a test put there before), or a new embedded log.
    async fn start_on(mut config: Config, log: Option<Arc<dyn Log>>) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        config.application_server = addr.to_string();
        let mut builder = StreamsApp::builder(config);
        if let Some(log) = log {
            builder = builder.log(log);
        }
        let app = builder.start().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(taskstream_server::service::serve(app.clone(), listener, async {
            let _ = stopped.await;
        }));
        let client = StreamsClient::connect(format!("http://{addr}")).await.unwrap();
        Server {
            app,
            client,
            stop: Some(stop),
            task: Some(tokio::spawn(async move {
                let _ = task.await;
            })),
        }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(WAIT, task)
                .await
                .expect("server stopped in time")
                .unwrap();
        }
    }

    async fn produce(&self, count: usize, keys: usize) -> v1::ProduceResponse {
        let records = (0..count)
            .map(|i| keyed_record(format!("k{}", i % keys), format!("{i}")))
            .collect();
        self.client.produce("events", records).await.unwrap()
    }

    async fn caught_up(&self) {
        let app = self.app.clone();
        let done = tokio::task::spawn_blocking(move || app.wait_until_caught_up(WAIT))
            .await
            .unwrap();
        assert!(done, "processing caught up");
    }
}

fn code_of(result: Result<impl std::fmt::Debug, ClientError>) -> ClientError {
    result.expect_err("the call should fail")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn produce_query_metadata_and_admin_rpcs() {
    let server = Server::start(config()).await;
    let client = &server.client;
    let produced = server.produce(1000, 10).await;
    assert_eq!(produced.record_count, 1000);
    assert_eq!(produced.positions.len(), 1000);
    server.caught_up().await;

    // Key routing is Kafka's: "a" → partition 4 of 8 (shared/testdata).
    let key = client.metadata_for_key("counts", "a").await.unwrap();
    assert_eq!(key.partition, 4);
    assert_eq!(key.task_id, "counts_4");

    assert_eq!(client.get("counts", "k3").await.unwrap().unwrap(), "100");
    assert_eq!(client.get("counts", "nope").await.unwrap(), None);
    let range = client
        .range("counts", Some("k2".into()), Some("k4".into()))
        .await
        .unwrap();
    let keys: Vec<_> = range.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    assert_eq!(
        keys,
        vec![
            ("k2".into(), "100".into()),
            ("k3".into(), "100".into()),
            ("k4".into(), "100".into())
        ]
    );

    let metadata = client.process_metadata_for_store("counts", true).await.unwrap();
    assert!(metadata.in_order);
    assert_eq!(metadata.threads_per_task, 2);
    let instance = &metadata.metadata[0];
    assert_eq!(instance.tasks.len(), 8);
    assert_eq!(instance.host_info.as_ref().unwrap().host, "127.0.0.1");
    assert!(instance.state_store_names.contains(&"counts".to_string()));
    let total_end: i64 = instance.tasks.iter().map(|t| t.end_offset).sum();
    let total_watermark: i64 = instance.tasks.iter().map(|t| t.watermark).sum();
    assert_eq!((total_end, total_watermark), (1000, 1000));

    let described = client.describe_runtime().await.unwrap();
    assert_eq!(described.num_stream_threads, 4);
    assert_eq!(described.pipelines.len(), 4);
    let added = client.add_stream_thread().await.unwrap();
    assert_eq!(added.num_stream_threads, 5);
    let removed = client
        .remove_stream_thread(Some(&added.thread_name))
        .await
        .unwrap();
    assert_eq!(removed.thread_name, added.thread_name);
    assert_eq!(removed.num_stream_threads, 4);

    // Bulk produce on a client stream.
    let batches = tokio_stream::iter((0..5).map(|b| {
        (0..200)
            .map(|i| keyed_record(format!("s{b}"), format!("{i}")))
            .collect()
    }));
    let bulk = client.produce_stream("events", batches).await.unwrap();
    assert_eq!(bulk.record_count, 1000);
    server.caught_up().await;
    assert_eq!(client.get("counts", "s3").await.unwrap().unwrap(), "200");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_the_documented_status_codes() {
    let mut cfg = config();
    cfg.outcome_retention_records = 50;
    cfg.max_batch_records = 10;
    let server = Server::start(cfg).await;
    let client = &server.client;
    server.produce(800, 5).await;
    server.caught_up().await;

    // in_order on key/unordered with T > 1: FAILED_PRECONDITION.
    for store in ["ukeys", "kkeys"] {
        let err = code_of(client.process_metadata_for_store(store, true).await);
        assert!(
            matches!(err, ClientError::IllegalState { ref violations, .. } if !violations.is_empty()),
            "{err:?}"
        );
        assert!(client.process_metadata_for_store(store, false).await.is_ok());
    }
    // in_order with offset order and T > 1, and T = 1 with any order: OK.
    assert!(
        client
            .process_metadata_for_store("counts", true)
            .await
            .unwrap()
            .in_order
    );
    assert!(
        client
            .process_metadata_for_store("single", true)
            .await
            .unwrap()
            .in_order
    );

    let err = code_of(client.process_metadata_for_store("missing", false).await);
    assert!(matches!(err, ClientError::UnknownStore { .. }), "{err:?}");
    let err = code_of(client.process_metadata_for_store("", false).await);
    assert!(
        matches!(err, ClientError::IllegalArgument { ref field_violations, .. }
            if field_violations.iter().any(|v| v.field == "store")),
        "{err:?}"
    );

    // Malformed offsets, bounds before starts, start offsets no longer retained.
    let stream_error = |options: MetadataOptions| {
        let (tx, rx) = oneshot::channel();
        let tx = Mutex::new(Some(tx));
        let handle =
            client.get_metadata_async("counts", options, move |r: Result<MetadataBatch, ClientError>| {
                if let (Err(e), Some(tx)) = (r, tx.lock().unwrap().take()) {
                    let _ = tx.send(e);
                }
            });
        async move {
            let err = tokio::time::timeout(WAIT, rx).await.unwrap().unwrap();
            handle.join().await;
            err
        }
    };
    let negative = MetadataOptions::bounded().start(Start::Offsets(BTreeMap::from([(0, -1)])));
    assert!(matches!(
        stream_error(negative).await,
        ClientError::IllegalArgument { .. }
    ));
    let backwards = MetadataOptions::bounded()
        .start(Start::Offsets(BTreeMap::from([(0, 100_000)])))
        .end(End::Offsets(BTreeMap::from([(0, 10)])));
    assert!(matches!(
        stream_error(backwards).await,
        ClientError::IllegalArgument { .. }
    ));
    let bad_partition = MetadataOptions::bounded().partitions([99]);
    assert!(matches!(
        stream_error(bad_partition).await,
        ClientError::IllegalArgument { .. }
    ));
    let too_old = MetadataOptions::bounded().start(Start::Offsets(BTreeMap::from([(0, 0)])));
    let err = stream_error(too_old).await;
    assert!(matches!(err, ClientError::OutOfRange { .. }), "{err:?}");

    // Removing a thread below T: INVALID_ARGUMENT naming the setting.
    let mut small = config();
    small.num_stream_threads = 2;
    let small_server = Server::start(small).await;
    let err = code_of(small_server.client.remove_stream_thread(None).await);
    assert!(
        matches!(err, ClientError::IllegalArgument { ref field_violations, .. }
            if field_violations.iter().any(|v| v.field == "num_stream_threads")),
        "{err:?}"
    );
    small_server.stop().await;

    // Shutting down: UNAVAILABLE with a retry delay.
    server.app.begin_shutdown();
    let err = code_of(client.process_metadata_for_store("counts", false).await);
    assert!(
        matches!(
            err,
            ClientError::NotAvailable {
                retry_after: Some(_),
                ..
            }
        ),
        "{err:?}"
    );
    server.stop().await;
}

fn simulated_config() -> Config {
    Config {
        application_id: "callbacks".into(),
        num_stream_threads: 4,
        num_threads_per_task: 4,
        max_batch_records: 20,
        topics: vec![TopicConfig::new("events", 3)],
        pipelines: vec![pipeline(
            "slow",
            ProcessorSpec::Simulate {
                latency_ms: Some(LatencySpec::Uniform([0.0, 1.0])),
                cpu_work_us: 0,
                failure_rate: 0.0,
                fail_attempts: 0,
                seed: 42,
            },
            None,
            None,
        )],
        ..Config::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbacks_once_per_batch_in_offset_order_and_coalesced_once() {
    let server = Server::start(simulated_config()).await;
    let client = &server.client;
    // Subscribe before producing: the bounded end is what exists now, so produce first
    // and stream while the four threads of each task are still at work.
    server.produce(1200, 97).await;

    let calls: Arc<Mutex<Vec<Result<MetadataBatch, ClientError>>>> = Arc::default();
    let sink = calls.clone();
    let handle = client.get_metadata_async(
        "slow",
        MetadataOptions::bounded().in_order(true),
        move |r: Result<MetadataBatch, ClientError>| sink.lock().unwrap().push(r),
    );
    tokio::time::timeout(WAIT, handle.join())
        .await
        .expect("bounded stream completed");
    let calls = std::mem::take(&mut *calls.lock().unwrap());
    let mut next: HashMap<u32, i64> = HashMap::new();
    let mut threads = std::collections::HashSet::new();
    for call in &calls {
        let batch = call.as_ref().expect("no error callback");
        assert_eq!(batch.ranges.len(), 1, "one streamed batch per callback");
        threads.insert(batch.ranges[0].thread.clone());
        for record in &batch.records {
            let expected = next.entry(record.partition).or_insert(0);
            assert_eq!(
                record.offset, *expected,
                "partition {} strictly increasing, no gap",
                record.partition
            );
            *expected += 1;
        }
    }
    assert_eq!(next.values().sum::<i64>(), 1200);
    assert!(calls.len() > 3, "{} callbacks", calls.len());
    assert!(threads.len() > 1, "several threads served the tasks: {threads:?}");

    // Coalesced: exactly one callback with every record, sorted by (partition, offset).
    server.produce(300, 7).await;
    let calls: Arc<Mutex<Vec<Result<MetadataBatch, ClientError>>>> = Arc::default();
    let sink = calls.clone();
    let handle = client.get_metadata_async(
        "slow",
        MetadataOptions::bounded().in_order(true).coalesce(true),
        move |r: Result<MetadataBatch, ClientError>| sink.lock().unwrap().push(r),
    );
    tokio::time::timeout(WAIT, handle.join())
        .await
        .expect("coalesced stream completed");
    let calls = std::mem::take(&mut *calls.lock().unwrap());
    assert_eq!(calls.len(), 1, "exactly one callback");
    let batch = calls[0].as_ref().unwrap();
    assert_eq!(batch.records.len(), 1500);
    let keys: Vec<(u32, i64)> = batch.records.iter().map(|r| (r.partition, r.offset)).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(keys, sorted);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_stream_follows_new_records_and_cancel_stops_it() {
    let server = Server::start(simulated_config()).await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let handle = server.client.get_metadata_async(
        "slow",
        MetadataOptions::follow(),
        move |r: Result<MetadataBatch, ClientError>| {
            let _ = tx.send(r.map(|b| b.records.len()));
        },
    );
    server.produce(100, 5).await;
    let mut seen = 0;
    while seen < 100 {
        let got = tokio::time::timeout(WAIT, rx.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen += got;
    }
    assert_eq!(seen, 100);
    handle.cancel();
    tokio::time::timeout(WAIT, handle.join())
        .await
        .expect("cancel ends the stream");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_too_slow_for_its_buffer_gets_resource_exhausted_when_configured() {
    let mut cfg = config();
    cfg.slow_subscriber = taskstream_server::config::SlowSubscriberPolicy::Fail;
    cfg.subscriber_buffer_batches = 2;
    cfg.max_batch_records = 1;
    let server = Server::start(cfg).await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // The first callback blocks, so the client stops reading and the server's bounded buffers fill.
    let handle = server.client.get_metadata_async(
        "counts",
        MetadataOptions::follow(),
        move |r: Result<MetadataBatch, ClientError>| {
            if r.is_ok() {
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = tx.send(r.err());
        },
    );
    for _ in 0..20 {
        server.produce(1000, 50).await;
    }
    let error = loop {
        match tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("the stream ended")
            .expect("callback")
        {
            Some(error) => break error,
            None => continue,
        }
    };
    assert!(matches!(error, ClientError::Lagged { .. }), "{error:?}");
    tokio::time::timeout(WAIT, handle.join())
        .await
        .expect("the stream ended");
    server.caught_up().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_outcomes_reach_the_record_callback_and_bounded_streams_wait_for_final_outcomes() {
    let mut config = simulated_config();
    config.application_id = "retries".into();
    config.retry_backoff_ms = 5;
    config.retry_backoff_max_ms = 20;
    config.pipelines = vec![pipeline(
        "flaky",
        ProcessorSpec::Simulate {
            latency_ms: None,
            cpu_work_us: 0,
            failure_rate: 0.05,
            fail_attempts: 1,
            seed: 9,
        },
        None,
        None,
    )];
    let server = Server::start(config).await;
    server.produce(600, 13).await;

    let calls: Arc<Mutex<Vec<MetadataBatch>>> = Arc::default();
    let sink = calls.clone();
    let handle = server.client.get_metadata_async(
        "flaky",
        MetadataOptions::bounded().start(Start::Earliest),
        move |r: Result<MetadataBatch, ClientError>| sink.lock().unwrap().push(r.expect("no error")),
    );
    tokio::time::timeout(WAIT, handle.join())
        .await
        .expect("bounded stream completed");
    let mut history: BTreeMap<(u32, i64), Vec<(v1::RecordOutcome, u32)>> = BTreeMap::new();
    for batch in calls.lock().unwrap().iter() {
        for record in &batch.records {
            history
                .entry((record.partition, record.offset))
                .or_default()
                .push((record.outcome, record.attempts));
        }
    }
    assert_eq!(history.len(), 600, "every record reached a callback");
    let retried: Vec<_> = history.values().filter(|h| h.len() > 1).collect();
    assert!(!retried.is_empty(), "about 5% of the records failed once");
    use v1::RecordOutcome::{Processed, Retrying};
    // A failed record: retrying, then processed on its second attempt. In
    // `offset` order a record whose key has an earlier record on the retry
    // path is parked behind it first (retrying, attempt 0), in order.
    let failed = vec![(Retrying, 1), (Processed, 2)];
    let parked = vec![(Retrying, 0), (Processed, 1)];
    let parked_then_failed = vec![(Retrying, 0), (Retrying, 1), (Processed, 2)];
    for h in &retried {
        assert!(
            **h == failed || **h == parked || **h == parked_then_failed,
            "outcomes of a record out of order: {h:?}"
        );
    }
    assert!(retried.iter().any(|h| **h == failed));
    // The stream completed only once every record had its final outcome.
    assert!(
        history
            .values()
            .all(|h| h.last().map(|(o, _)| *o) == Some(v1::RecordOutcome::Processed))
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_topic_shows_dead_lettered_records_with_their_error_headers() {
    let config = Config {
        application_id: "dlq".into(),
        num_stream_threads: 2,
        num_threads_per_task: 1,
        retry_max_attempts: 2,
        retry_backoff_ms: 1,
        retry_backoff_max_ms: 2,
        topics: vec![TopicConfig::new("events", 2)],
        pipelines: vec![pipeline(
            "doomed",
            // Every record fails every attempt: all of them end in the dead-letter topic.
            ProcessorSpec::Simulate {
                latency_ms: None,
                cpu_work_us: 0,
                failure_rate: 1.0,
                fail_attempts: 0,
                seed: 1,
            },
            None,
            None,
        )],
        ..Config::default()
    };
    let server = Server::start(config).await;
    let client = &server.client;
    let records: Vec<v1::ProducerRecord> = (0..6)
        .map(|i| v1::ProducerRecord {
            headers: HashMap::from([("origin".to_string(), "test".into())]),
            ..keyed_record(format!("k{}", i % 3), format!("v{i}"))
        })
        .collect();
    let produced = client.produce("events", records.clone()).await.unwrap();
    server.caught_up().await;

    // Source (partition, offset) → (key, value), from the positions Produce answered.
    let mut expected: BTreeMap<(u32, i64), (Option<bytes::Bytes>, bytes::Bytes)> = produced
        .positions
        .iter()
        .zip(&records)
        .map(|(p, r)| ((p.partition, p.offset), (r.key.clone(), r.value.clone())))
        .collect();
    assert_eq!(expected.len(), 6);
    let dlq = "dlq-doomed-dlq";
    let mut seen = 0;
    for partition in 0..2 {
        let read = client.read_topic(dlq, partition, 0, 0).await.unwrap();
        assert_eq!((read.topic.as_str(), read.partition), (dlq, partition));
        assert_eq!(read.start_offset, 0);
        assert_eq!(read.end_offset, read.records.len() as i64, "{read:?}");
        for (i, record) in read.records.iter().enumerate() {
            assert_eq!((record.partition, record.offset), (partition, i as i64));
            let header = |name: &str| -> String {
                let values: Vec<_> = record.headers.iter().filter(|h| h.name == name).collect();
                assert_eq!(values.len(), 1, "one `{name}` header: {record:?}");
                String::from_utf8_lossy(&values[0].value).into_owned()
            };
            assert_eq!(header("__streams.errors.exception"), "SimulatedFailure");
            assert_eq!(header("__streams.errors.topic"), "events");
            assert_eq!(header("__streams.errors.partition"), partition.to_string());
            assert_eq!(header("taskstream.errors.attempts"), "2");
            assert_eq!(header("origin"), "test", "the producer's headers stay");
            let source_offset: i64 = header("__streams.errors.offset").parse().unwrap();
            let (key, value) = expected
                .remove(&(partition, source_offset))
                .unwrap_or_else(|| panic!("unexpected or repeated dead letter: {record:?}"));
            assert_eq!(record.key, key, "key unchanged");
            assert_eq!(record.value, value, "value unchanged");
            seen += 1;
        }
        // At the end: no records, but the offsets.
        let past = client
            .read_topic(dlq, partition, read.end_offset, 0)
            .await
            .unwrap();
        assert!(past.records.is_empty());
        assert_eq!(past.end_offset, read.end_offset);
    }
    assert_eq!(seen, 6);
    assert!(expected.is_empty(), "not dead-lettered: {expected:?}");

    // A page of one record, from the source topic: the end says how much is left.
    let busiest = produced.partitions.iter().max_by_key(|p| p.count).unwrap();
    let page = client
        .read_topic("events", busiest.partition, 0, 1)
        .await
        .unwrap();
    assert_eq!(page.records.len(), 1);
    assert_eq!(page.records[0].offset, 0);
    assert_eq!(page.end_offset, busiest.count as i64);

    // Errors: NOT_FOUND, then INVALID_ARGUMENT naming the field.
    let err = code_of(client.read_topic("no-such-topic", 0, 0, 0).await);
    assert!(matches!(err, ClientError::UnknownStore { .. }), "{err:?}");
    let invalid = |err: ClientError, field: &str| {
        assert!(
            matches!(&err, ClientError::IllegalArgument { field_violations, .. }
                if field_violations.iter().any(|v| v.field == field)),
            "{err:?}"
        );
        err
    };
    invalid(code_of(client.read_topic(dlq, 0, -1, 0).await), "offset");
    invalid(code_of(client.read_topic(dlq, 0, 0, 20_000).await), "max_records");
    let err = invalid(code_of(client.read_topic(dlq, 2, 0, 0).await), "partition");
    assert!(err.to_string().contains("2 partitions"), "{err}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_topic_below_the_retained_start_is_out_of_range() {
    // A topic no pipeline reads, whose oldest five records retention removed.
    let log = MemoryLog::new();
    log.ensure_topic("archive", 1).unwrap();
    let records = (0..10)
        .map(|i| ProducerRecord {
            value: format!("v{i}").into(),
            partition: Some(0),
            ..Default::default()
        })
        .collect();
    log.append("archive", records).unwrap();
    let everything = Retention {
        max_bytes: Some(0),
        max_age_ms: None,
    };
    assert_eq!(log.enforce_retention("archive", 0, everything, 5, 0).unwrap(), 5);
    let server = Server::start_on(config(), Some(log)).await;
    let client = &server.client;

    let err = code_of(client.read_topic("archive", 0, 4, 0).await);
    assert!(matches!(err, ClientError::OutOfRange { .. }), "{err:?}");
    assert!(err.to_string().contains("earliest is 5"), "{err}");
    let read = client.read_topic("archive", 0, 5, 0).await.unwrap();
    assert_eq!((read.start_offset, read.end_offset), (5, 10));
    let offsets: Vec<i64> = read.records.iter().map(|r| r.offset).collect();
    assert_eq!(offsets, (5..10).collect::<Vec<_>>());
    assert_eq!(read.records[0].value, "v5");
    assert_eq!(read.records[0].key, None);
    server.stop().await;
}

/// The first error a GetMetadataAsync stream of `store` reports.
async fn stream_error(client: &StreamsClient, store: &str, options: MetadataOptions) -> ClientError {
    let (tx, rx) = oneshot::channel();
    let tx = Mutex::new(Some(tx));
    let handle = client.get_metadata_async(store, options, move |r: Result<MetadataBatch, ClientError>| {
        if let (Err(e), Some(tx)) = (r, tx.lock().unwrap().take()) {
            let _ = tx.send(e);
        }
    });
    let err = tokio::time::timeout(WAIT, rx)
        .await
        .expect("the stream failed in time")
        .expect("the stream reported an error");
    handle.join().await;
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_past_the_partition_end_is_out_of_range_naming_the_end_on_every_path() {
    let server = Server::start(config()).await;
    let client = &server.client;
    server.produce(80, 16).await;
    server.caught_up().await;
    let end = server.app.log().end_offset("events", 0).unwrap() as i64;
    assert!(end > 0, "partition 0 got records");

    for start in [end + 1, i64::MAX] {
        let past = || Start::Offsets(BTreeMap::from([(0, start)]));
        let paths = [
            ("END_POSITION_CURRENT", MetadataOptions::bounded().start(past())),
            ("END_POSITION_OPEN", MetadataOptions::follow().start(past())),
            (
                "explicit end",
                MetadataOptions::bounded()
                    .start(past())
                    .end(End::Offsets(BTreeMap::from([(0, i64::MAX)]))),
            ),
        ];
        for (path, options) in paths {
            let err = stream_error(client, "counts", options).await;
            assert!(
                matches!(err, ClientError::OutOfRange { .. }),
                "{path}, start {start}: {err:?}"
            );
            assert!(
                err.to_string().contains(&format!("end offset {end}")),
                "{path}, start {start}: {err}"
            );
        }
    }

    // At the end is fine: a bounded stream there is empty and completes.
    let at_end = MetadataOptions::bounded()
        .start(Start::Offsets(BTreeMap::from([(0, end)])))
        .coalesce(true);
    let (tx, rx) = oneshot::channel();
    let tx = Mutex::new(Some(tx));
    let handle = client.get_metadata_async("counts", at_end, move |r: Result<MetadataBatch, ClientError>| {
        if let Some(tx) = tx.lock().unwrap().take() {
            let _ = tx.send(r.map(|batch| batch.len()));
        }
    });
    let records = tokio::time::timeout(WAIT, rx).await.unwrap().unwrap();
    handle.join().await;
    assert_eq!(records, Ok(0));
    // An explicit end before the start stays a malformed request.
    let backwards = MetadataOptions::bounded()
        .start(Start::Offsets(BTreeMap::from([(0, end + 5)])))
        .end(End::Offsets(BTreeMap::from([(0, 1)])));
    let err = stream_error(client, "counts", backwards).await;
    assert!(matches!(err, ClientError::IllegalArgument { .. }), "{err:?}");
    server.stop().await;
}

/// One rule for the empty key, as in Kafka: a present-but-empty key is a key.
/// Produce takes it, `count` counts it, and Query, MetadataForKey and the
/// CLI's `get` (a key Query) find it in its partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_empty_key_is_a_key_for_every_rpc() {
    let server = Server::start(config()).await;
    let client = &server.client;
    let records = vec![
        keyed_record("", "a"),
        keyed_record("", "b"),
        keyed_record("x", "c"),
    ];
    let produced = client.produce("events", records).await.unwrap();
    server.caught_up().await;
    // Kafka's partitioner puts the empty key in partition 1 of 8
    // (server/tests/data/kafka-default-partitioner.tsv, first row).
    let partition = taskstream_server::log::partitioner::partition_for_key(b"", 8);
    assert_eq!(partition, 1);
    assert_eq!(produced.positions[0].partition, partition, "{produced:?}");

    let metadata = client.metadata_for_key("counts", "").await.unwrap();
    assert_eq!(metadata.partition, partition);
    assert_eq!(
        client.get("counts", "").await.unwrap().as_deref(),
        Some(&b"2"[..])
    );
    let keys: Vec<Vec<u8>> = client
        .range("counts", None, None)
        .await
        .unwrap()
        .into_iter()
        .map(|(key, _)| key.to_vec())
        .collect();
    assert!(keys.contains(&Vec::new()), "range lists the empty key: {keys:?}");
    server.stop().await;
}
