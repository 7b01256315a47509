//! taskstream on Apache Kafka, end to end: the server binary started with
//! `--bootstrap-servers` against a real broker (tests/common/kafka.rs), records
//! through the gRPC Produce, counts through Query, the topics in Kafka, and the
//! watermarks committed to the group's offsets at SIGTERM, keys on the Java
//! partitioner's partitions and every offset streamed once; instances of one
//! application sharing partitions (both group protocols), stores following
//! their partitions through the changelog, REBALANCING / RESTORING and
//! UNAVAILABLE with RetryInfo meanwhile; sink topics on Kafka; failover.

mod common;

use common::instance::{Instance, Launch, add, counts_of, own_partitions, share_all};
use common::kafka::{broker, unique};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use taskstream_client::v1::streams_service_client::StreamsServiceClient;
use taskstream_client::{StreamsClient, keyed_record};
use tonic_types::StatusExt as _;

/// Bound on anything the server should do promptly (start, catch up).
const DEADLINE: Duration = Duration::from_secs(60);

/// The keys of the repository's Kafka partitioner vectors (computed with
/// Kafka's own partitioner) with the partition Kafka picks among 8; the
/// empty key is left out (an empty key is no key on the gRPC Produce).
fn java_partitioner_vectors() -> Vec<(String, u32)> {
    let text = include_str!("../server/tests/data/kafka-default-partitioner.tsv");
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| {
            let cols: Vec<&str> = line.split('\t').collect();
            (!cols[0].is_empty()).then(|| (cols[0].to_string(), cols[2].parse().expect("a partition")))
        })
        .collect()
}

/// One instance on Kafka, as issue 11 asks: 50,000 keyed records through the
/// gRPC Produce (the keys of the Java partitioner vectors among them) land
/// where Kafka's Java client puts them, the counts in the store equal the
/// expected ones, and GetMetadataAsync in offset order gives every offset
/// once, in order, each record on its key's partition.
#[test]
fn produce_through_grpc_and_query_counts_with_the_topics_in_kafka() {
    const PARTITIONS: u32 = 8;
    const RECORDS: usize = 50_000;
    const BATCH: usize = 5_000;
    const PARTLY_WRITTEN: u64 = 10;
    let Some(broker) = broker() else { return };
    let application = unique("smoke");
    let topic = format!("{application}-events");
    let dir = taskstream_server::scratch::scratch_dir("kafka-smoke").expect("a scratch dir");
    let config = dir.path().join("taskstream.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            application_id = "{application}"
            num_stream_threads = 2
            num_threads_per_task = 2
            commit_interval_ms = 100
            replication_factor = 1
            [kafka]
            "message.timeout.ms" = 30000
            [[topics]]
            name = "{topic}"
            partitions = {PARTITIONS}
            [[pipelines]]
            name = "counts"
            source_topic = "{topic}"
            processor = "count"
            "#
        ),
    )
    .expect("write the config");
    let mut server = Launch::kafka(&config, &broker.bootstrap).start();
    assert!(
        server
            .stdout
            .iter()
            .any(|line| line.contains(&format!("Apache Kafka at {}", broker.bootstrap))),
        "the banner names the Kafka log:\n{}",
        server.stdout.join("\n")
    );
    let vectors = java_partitioner_vectors();
    assert!(vectors.len() >= 17, "the vectors file has its rows");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let client = StreamsClient::connect(server.addr.as_str())
            .await
            .expect("connect to the server");
        let mut expected: BTreeMap<String, u64> = BTreeMap::new();
        // Every key with the partition it must land on: the vectors' keys
        // as Kafka computed them, the others by the partitioner those
        // vectors test (server/src/log/partitioner.rs).
        let mut java_partition: BTreeMap<String, u32> = vectors.iter().cloned().collect();
        let keys: Vec<String> = (0..RECORDS)
            .map(|i| {
                if i < vectors.len() {
                    vectors[i].0.clone()
                } else {
                    format!("key-{}", (i * 7919) % 1_009)
                }
            })
            .collect();
        let mut positions = Vec::new();
        for batch in keys.chunks(BATCH) {
            let records: Vec<_> = batch
                .iter()
                .map(|key| {
                    *expected.entry(key.clone()).or_default() += 1;
                    java_partition.entry(key.clone()).or_insert_with(|| {
                        taskstream_server::log::partition_for_key(key.as_bytes(), PARTITIONS)
                    });
                    keyed_record(key.clone(), "1")
                })
                .collect();
            let response = client.produce(&topic, records).await.expect("Produce");
            assert_eq!(response.record_count, batch.len() as u64);
            assert_eq!(response.positions.len(), batch.len());
            for (key, position) in batch.iter().zip(&response.positions) {
                assert_eq!(
                    position.partition, java_partition[key],
                    "key {key:?} lands on the Java client's partition"
                );
            }
            positions.extend(response.positions);
        }
        // Offsets answered from Kafka's delivery reports: each partition's
        // offsets are 0, 1, 2, … with no gap and no repeat.
        let mut per_partition: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
        for position in &positions {
            per_partition
                .entry(position.partition)
                .or_default()
                .push(position.offset);
        }
        assert_eq!(
            per_partition.len(),
            PARTITIONS as usize,
            "every partition holds records"
        );
        for (partition, offsets) in &per_partition {
            assert_eq!(
                *offsets,
                (0..offsets.len() as i64).collect::<Vec<_>>(),
                "offsets of partition {partition}"
            );
        }

        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            // UNAVAILABLE (with RetryInfo) while the group still assigns partitions.
            let answer = match client.range("counts", None, None).await {
                Ok(answer) => answer,
                Err(taskstream_client::ClientError::NotAvailable { retry_after, message }) => {
                    assert!(retry_after.is_some(), "UNAVAILABLE carries RetryInfo: {message}");
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "still unavailable: {message}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(e) => panic!("Query: {e:?}"),
            };
            let counts: BTreeMap<String, u64> = answer
                .into_iter()
                .map(|(key, value)| {
                    let key = String::from_utf8_lossy(&key).into_owned();
                    let count = String::from_utf8_lossy(&value).parse().expect("a count");
                    (key, count)
                })
                .collect();
            if counts == expected {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the counts did not reach the expected ones within {DEADLINE:?}: {} keys, {} counted, \
                 expected {} keys, {RECORDS} records",
                counts.len(),
                counts.values().sum::<u64>(),
                expected.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let metadata = client
            .process_metadata_for_store("counts", true)
            .await
            .expect("ProcessMetadataForStore");
        let tasks: Vec<_> = metadata.metadata.into_iter().flat_map(|m| m.tasks).collect();
        assert_eq!(tasks.len(), PARTITIONS as usize);
        let end: i64 = tasks.iter().map(|t| t.end_offset).sum();
        assert_eq!(end, RECORDS as i64, "the end offsets Kafka reports: {tasks:#?}");

        // GetMetadataAsync in offset order, from the start to the end at the
        // time of the request: every offset once, in order per partition,
        // each record processed, on its key's partition.
        let (sender, mut received) = tokio::sync::mpsc::unbounded_channel();
        let handle = client.get_metadata_async(
            "counts",
            taskstream_client::MetadataOptions::bounded().in_order(true),
            move |batch: Result<taskstream_client::MetadataBatch, taskstream_client::ClientError>| {
                let _ = sender.send(batch);
            },
        );
        tokio::time::timeout(DEADLINE, handle.join())
            .await
            .expect("the bounded stream completed");
        let mut next: BTreeMap<u32, i64> = BTreeMap::new();
        while let Ok(batch) = received.try_recv() {
            let batch = batch.expect("no error callback");
            for record in batch.records {
                let expected_offset = next.entry(record.partition).or_insert(0);
                assert_eq!(
                    record.offset, *expected_offset,
                    "partition {}: every offset once, in order",
                    record.partition
                );
                *expected_offset += 1;
                assert_eq!(
                    record.outcome,
                    taskstream_client::v1::RecordOutcome::Processed,
                    "offset {} of partition {}",
                    record.offset,
                    record.partition
                );
                let key =
                    String::from_utf8_lossy(record.key.as_deref().expect("a keyed record")).into_owned();
                assert_eq!(record.partition, java_partition[&key], "the partition of {key:?}");
            }
        }
        let streamed: BTreeMap<u32, i64> = per_partition
            .iter()
            .map(|(partition, offsets)| (*partition, offsets.len() as i64))
            .collect();
        assert_eq!(next, streamed, "every produced offset streamed, per partition");

        // ProduceStream on Kafka cannot take a batch back: batch 0 stays written when
        // batch 1 holds a key over max_key_bytes, and the error says how much was.
        let mut raw = StreamsServiceClient::connect(server.addr.clone())
            .await
            .expect("connect");
        let written: Vec<_> = (0..PARTLY_WRITTEN).map(|_| keyed_record("partly", "1")).collect();
        let refused = vec![keyed_record(vec![b'k'; (64 << 10) + 1], "1")];
        let requests =
            tokio_stream::iter(
                [written, refused].map(|records| taskstream_client::v1::ProduceRequest {
                    topic: topic.clone(),
                    records,
                }),
            );
        let status = raw
            .produce_stream(requests)
            .await
            .expect_err("batch 1 is over max_key_bytes");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        let info = status.get_details_error_info().expect("ErrorInfo");
        assert_eq!(info.reason, "LIMIT_EXCEEDED");
        assert_eq!(info.metadata["setting"], "max_key_bytes");
        assert_eq!(info.metadata["written_batches"], "1");
        assert_eq!(info.metadata["written_records"], PARTLY_WRITTEN.to_string());
        assert!(status.message().contains("resend from batch 1"), "{status:?}");
        // What was written is there, and counted before the shutdown below.
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while client.get("counts", "partly").await.ok().flatten().as_deref()
            != Some(PARTLY_WRITTEN.to_string().as_bytes())
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the written batch was not counted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });

    // The topics live in Kafka: a second client of the cluster sees them,
    // internal topics included, with the source's partition count.
    let log = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1)
        .expect("connect to the broker");
    use taskstream_server::Log as _;
    assert_eq!(log.partitions(&topic).unwrap(), PARTITIONS);
    assert_eq!(
        log.partitions(&format!("{application}-counts-retry")).unwrap(),
        PARTITIONS
    );
    assert_eq!(
        log.partitions(&format!("{application}-counts-dlq")).unwrap(),
        PARTITIONS
    );
    let total: u64 = (0..PARTITIONS).map(|p| log.end_offset(&topic, p).unwrap()).sum();
    assert_eq!(total, RECORDS as u64 + PARTLY_WRITTEN);

    // SIGTERM drains and commits: the memory store's watermarks reach the
    // group's committed offsets in Kafka (the group is the application id).
    assert!(server.terminate(), "the server did not exit 0 after SIGTERM");
    for partition in 0..PARTITIONS {
        assert_eq!(
            log.committed(&application, &topic, partition).unwrap(),
            Some(log.end_offset(&topic, partition).unwrap()),
            "the committed offset of partition {partition}"
        );
    }
}

/// A config of one application on Kafka, in process: `partitions` of a
/// keyed topic counted in memory stores, short commit interval.
fn group_config(
    broker: &common::kafka::Broker,
    application: &str,
    topic: &str,
    partitions: u32,
    protocol: taskstream_server::GroupProtocol,
) -> taskstream_server::Config {
    let mut config = taskstream_server::Config {
        application_id: application.to_string(),
        num_stream_threads: 2,
        commit_interval_ms: 100,
        bootstrap_servers: Some(broker.bootstrap.clone()),
        replication_factor: 1,
        group_protocol: protocol,
        ..Default::default()
    };
    if protocol == taskstream_server::GroupProtocol::Classic {
        // The classic protocol's session is the client's to set; the test
        // broker allows short ones (KIP-848 sessions are the broker's).
        config.kafka.insert("session.timeout.ms".into(), "6000".into());
        config.kafka.insert("heartbeat.interval.ms".into(), "500".into());
    }
    config
        .topics
        .push(taskstream_server::TopicConfig::new(topic, partitions));
    config.pipelines.push(taskstream_server::PipelineConfig::new(
        "counts",
        topic,
        taskstream_server::ProcessorSpec::Count,
    ));
    config
}

/// A one-pipeline application on the KIP-848 consumer protocol, named after
/// `prefix` (made unique): its name, its source topic and its config.
fn consumer_app(
    broker: &common::kafka::Broker,
    prefix: &str,
    partitions: u32,
) -> (String, String, taskstream_server::Config) {
    let application = unique(prefix);
    let topic = format!("{application}-events");
    let config = group_config(
        broker,
        &application,
        &topic,
        partitions,
        taskstream_server::GroupProtocol::Consumer,
    );
    (application, topic, config)
}

/// Starts a lone instance of `config` with `processor` registered as `name`,
/// once it hosts all `partitions` of its pipeline.
fn start_hosting(
    config: taskstream_server::Config,
    name: &str,
    processor: std::sync::Arc<dyn taskstream_server::Processor>,
    partitions: usize,
) -> taskstream_server::StreamsApp {
    let app = taskstream_server::StreamsApp::builder(config)
        .processor(name, processor)
        .start()
        .expect("start the instance");
    eventually(&format!("the instance hosts all {partitions} partitions"), || {
        app.hosted_partitions("counts").unwrap().len() == partitions
    });
    app
}

/// Polls `condition` until it holds or `DEADLINE` passes (then panics with `what`).
fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "within {DEADLINE:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Two instances of one application share the partitions through the
/// consumer group (either protocol): each hosts a disjoint share, together
/// all; a second instance joining takes some without stopping the first's
/// other tasks; one leaving hands its partitions back, committed.
fn two_instances_share_partitions(protocol: taskstream_server::GroupProtocol) {
    use taskstream_server::{ProducerRecord, StreamsApp};
    let Some(broker) = broker() else { return };
    let application = unique(&format!("group-{}", protocol.as_str()));
    let topic = format!("{application}-events");
    let config = group_config(broker, &application, &topic, 6, protocol);
    let first = StreamsApp::builder(config.clone())
        .start()
        .expect("start the first instance");
    eventually("the first instance hosts all 6 partitions", || {
        first.hosted_partitions("counts").unwrap().len() == 6
    });
    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    let mut produce = |app: &StreamsApp, round: usize| {
        let records: Vec<ProducerRecord> = (0..300)
            .map(|i| {
                let key = format!("key-{}", (i * 13 + round) % 41);
                *expected.entry(key.clone()).or_default() += 1;
                ProducerRecord::keyed(key, "1")
            })
            .collect();
        app.produce(&topic, records).expect("produce");
    };
    produce(&first, 0);
    let second = StreamsApp::builder(config.clone())
        .start()
        .expect("start the second instance");
    eventually("both instances host a disjoint share covering all 6", || {
        let a = first.hosted_partitions("counts").unwrap();
        let b = second.hosted_partitions("counts").unwrap();
        !a.is_empty() && !b.is_empty() && a.len() + b.len() == 6 && a.iter().all(|p| !b.contains(p))
    });
    produce(&second, 1);
    let counts = |apps: &[&StreamsApp]| -> BTreeMap<String, u64> {
        let mut counts = BTreeMap::new();
        for app in apps {
            let Ok(results) = app.query_range("counts", None, None, &[], 0) else {
                continue;
            };
            for result in results {
                for (key, value) in result.entries {
                    let count: u64 = String::from_utf8_lossy(&value).parse().unwrap();
                    *counts
                        .entry(String::from_utf8_lossy(&key).into_owned())
                        .or_default() += count;
                }
            }
        }
        counts
    };
    eventually("the two instances' counts add up to what was produced", || {
        counts(&[&first, &second]) == expected
    });
    for app in [&first, &second] {
        assert_eq!(app.state(), taskstream_server::AppState::Running);
    }
    second
        .shutdown()
        .expect("the second instance commits as it leaves");
    eventually("the first instance hosts all 6 partitions again", || {
        first.hosted_partitions("counts").unwrap().len() == 6
    });
    // Memory stores rebuilt from the committed offsets: nothing lost, nothing twice.
    eventually("the first instance alone counts everything once", || {
        counts(&[&first]) == expected
    });
    first.shutdown().expect("shutdown");
}

#[test]
fn two_instances_share_partitions_with_the_kip848_protocol() {
    two_instances_share_partitions(taskstream_server::GroupProtocol::Consumer);
}

#[test]
fn two_instances_share_partitions_with_the_classic_protocol() {
    two_instances_share_partitions(taskstream_server::GroupProtocol::Classic);
}

/// A fresh application's tasks are added, and its partitions read, without
/// waiting behind fetches. A broker answers one connection's requests one at
/// a time, in order, and holds a fetch of a partition with nothing new for
/// `fetch.wait.max.ms`; adding a task asks for four partition offsets, and
/// when those went over the connection of the consumer that reads the
/// metadata topic (caught up, so always held), each waited for that fetch.
/// Held 20 s here, that was minutes for 16 tasks (at the default 100 ms, 7 s:
/// bench scenario `peers`); asked on a connection that never fetches, moments.
#[test]
fn a_fresh_application_adds_its_tasks_without_waiting_behind_held_fetches() {
    use taskstream_server::{ProducerRecord, StreamsApp};
    const PARTITIONS: u32 = 16;
    let Some(broker) = broker() else { return };
    let (_, topic, mut config) = consumer_app(broker, "held-fetches", PARTITIONS);
    config.kafka.insert("fetch.wait.max.ms".into(), "20000".into());
    let app = StreamsApp::builder(config).start().expect("start");
    let records: Vec<ProducerRecord> = (0..PARTITIONS)
        .flat_map(|p| {
            (0..5).map(move |i| ProducerRecord {
                partition: Some(p),
                ..ProducerRecord::keyed(format!("p{p}-k{i}"), "1")
            })
        })
        .collect();
    let expected = records.len() as u64;
    app.produce(&topic, records).expect("produce");
    // Within DEADLINE: each query waiting for a held fetch would take 20 s.
    eventually("all 16 tasks added and every record counted", || {
        let counted: u64 = app
            .query_range("counts", None, None, &[], 0)
            .map(|results| {
                results
                    .iter()
                    .flat_map(|r| &r.entries)
                    .map(|(_, v)| String::from_utf8_lossy(v).parse::<u64>().unwrap_or(0))
                    .sum()
            })
            .unwrap_or(0);
        app.hosted_partitions("counts").unwrap().len() == PARTITIONS as usize && counted == expected
    });
    app.shutdown().expect("shutdown");
}

/// While an instance rebalances or restores, DescribeRuntime says so as
/// Kafka Streams names it (REBALANCING until the group's first assignment,
/// RESTORING while a task rebuilds its store from the changelog, the task
/// itself RESTORING), and a Query of a partition concerned answers
/// UNAVAILABLE with RetryInfo; then RUNNING, and the query answers the count.
#[test]
fn rebalancing_and_restoring_are_described_and_answered_unavailable_with_retry_info() {
    use taskstream_client::ClientError;
    use taskstream_client::v1::{ServiceState, TaskState};
    use taskstream_server::{ProducerRecord, StreamsApp};
    const KEYS: usize = 200_000;
    let Some(broker) = broker() else { return };
    let (_, topic, mut config) = consumer_app(broker, "states", 2);
    config.commit_interval_ms = 500;
    // A changelog long enough that restoring it takes a visible while:
    // every record a key of its own.
    let first = StreamsApp::builder(config.clone())
        .start()
        .expect("start the first instance");
    eventually("the first instance hosts both partitions", || {
        first.hosted_partitions("counts").unwrap().len() == 2
    });
    for batch in 0..KEYS / 10_000 {
        let records = (0..10_000)
            .map(|i| ProducerRecord::keyed(format!("key-{}", batch * 10_000 + i), "1"))
            .collect();
        first.produce(&topic, records).expect("produce");
    }
    // The key asked for below is written last, twice, so its count is 2.
    first
        .produce(
            &topic,
            vec![
                ProducerRecord::keyed("asked", "1"),
                ProducerRecord::keyed("asked", "1"),
            ],
        )
        .expect("produce");
    assert!(
        first.wait_until_caught_up(DEADLINE),
        "the first instance counts everything"
    );
    first.shutdown().expect("the first instance commits as it leaves");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind port 0");
    config.application_server = listener.local_addr().expect("the bound address").to_string();
    let url = format!("http://{}", config.application_server);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let second = StreamsApp::builder(config)
        .start()
        .expect("start the second instance");
    // Before the group's first assignment: rebalancing (asked at once, in
    // process; the broker takes round trips to assign).
    let first_state = second.state();
    let serving = runtime.spawn(taskstream_server::service::serve(
        second.clone(),
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    let (states, task_restoring, retry_after, others) = runtime.block_on(async {
        let client = StreamsClient::connect(url.as_str()).await.expect("connect");
        // In process, before the server answered anything (Debug: `Rebalancing`).
        let mut states = vec![format!("{first_state:?}").to_uppercase()];
        let mut task_restoring = false;
        let mut retry_after = Vec::new();
        let mut others = Vec::new();
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let described = client.describe_runtime().await.expect("DescribeRuntime");
            let state = ServiceState::try_from(described.state)
                .map_or_else(|_| described.state.to_string(), |s| s.as_str_name().to_string());
            if states.last() != Some(&state) {
                states.push(state);
            }
            task_restoring |= described
                .tasks
                .iter()
                .any(|t| t.state == TaskState::Restoring as i32);
            match client.get("counts", "asked").await {
                Ok(Some(count)) if &count[..] == b"2" && described.state == ServiceState::Running as i32 => {
                    break;
                }
                Ok(answer) => others.push(format!("{answer:?}")),
                Err(ClientError::NotAvailable {
                    retry_after: after,
                    message,
                }) => {
                    retry_after.push((after, message));
                }
                Err(e) => others.push(e.to_string()),
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the second instance did not answer the count within {DEADLINE:?}: states {states:?}, \
                 other answers {others:?}"
            );
        }
        (states, task_restoring, retry_after, others)
    });
    println!(
        "states seen: {states:?}; {} UNAVAILABLE answers; others: {others:?}",
        retry_after.len()
    );
    assert!(
        states.iter().any(|s| s.contains("REBALANCING")),
        "REBALANCING before the first assignment: {states:?}"
    );
    assert!(
        task_restoring && states.iter().any(|s| s.contains("RESTORING")),
        "RESTORING while the changelog is read back (service: {states:?}, a task: {task_restoring})"
    );
    assert!(
        !retry_after.is_empty(),
        "a query during rebalance or restore answers UNAVAILABLE"
    );
    for (after, message) in &retry_after {
        assert!(
            after.is_some_and(|d| !d.is_zero()),
            "UNAVAILABLE carries RetryInfo: {message}"
        );
    }
    assert_eq!(states.last().map(String::as_str), Some("SERVICE_STATE_RUNNING"));
    let _ = stop.send(());
    runtime
        .block_on(serving)
        .expect("the server task")
        .expect("the server stops cleanly");
}

/// Sink topics on Kafka: a Rust processor's outputs land in the pipeline's
/// sink topic (created with the source's partitions), each source record's
/// output once, in source-offset order per partition (offset order, T = 2);
/// under exactly_once_v2 they are produced in the task's transactions and a
/// read_committed reader sees them all, once.
fn sink_outputs_reach_kafka(guarantee: taskstream_server::ProcessingGuarantee) {
    use bytes::Bytes;
    use taskstream_server::{ProcessError, ProcessorContext, ProducerRecord, Record};
    let Some(broker) = broker() else { return };
    let prefix = format!("sink-{}", guarantee.as_str().replace('_', "-"));
    let (application, topic, mut config) = consumer_app(broker, &prefix, 3);
    let sink = format!("{application}-out");
    config.num_threads_per_task = 2;
    config.processing_guarantee = guarantee;
    config.pipelines[0].processor = taskstream_server::ProcessorSpec::Custom { name: "echo".into() };
    config.pipelines[0].sink_topic = Some(sink.clone());
    let processor = std::sync::Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        let mut output = ProducerRecord::keyed(record.key.clone().unwrap_or_default(), record.value.clone());
        output.headers.push((
            "source".into(),
            Bytes::from(format!("{}:{}", record.partition, record.offset)),
        ));
        ctx.emit(output);
        Ok::<(), ProcessError>(())
    });
    let app = start_hosting(config, "echo", processor, 3);
    let records: Vec<ProducerRecord> = (0..3_000)
        .map(|i| ProducerRecord::keyed(format!("key-{}", i % 101), i.to_string()))
        .collect();
    app.produce(&topic, records).expect("produce");
    assert!(
        app.wait_until_caught_up(DEADLINE),
        "the instance processes everything"
    );
    app.shutdown().expect("shutdown commits");

    let mut settings = BTreeMap::new();
    settings.insert("isolation.level".to_string(), "read_committed".to_string());
    settings.insert("enable.partition.eof".to_string(), "true".to_string());
    let reader = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &settings, 1)
        .expect("connect to the broker");
    use taskstream_server::Log as _;
    assert_eq!(
        reader.partitions(&sink).unwrap(),
        3,
        "the sink takes the source's partitions"
    );
    let mut outputs = 0;
    for partition in 0..3 {
        let end = reader.end_offset(&sink, partition).unwrap();
        let mut next = 0;
        let mut sources = Vec::new();
        let mut batch = Vec::new();
        while next < end {
            batch.clear();
            reader
                .read(&sink, partition, next, 1_000, &mut batch)
                .expect("read the sink");
            if batch.is_empty() {
                break;
            }
            for record in &batch {
                let (_, source) = record
                    .headers
                    .iter()
                    .find(|(name, _)| name == "source")
                    .expect("the source header");
                let source = String::from_utf8_lossy(source).into_owned();
                let (from, offset) = source.split_once(':').expect("partition:offset");
                assert_eq!(
                    from,
                    partition.to_string(),
                    "a key's output stays on its partition"
                );
                sources.push(offset.parse::<u64>().expect("an offset"));
                next = record.offset + 1;
            }
        }
        let source_end = reader.end_offset(&topic, partition).unwrap();
        assert_eq!(
            sources,
            (0..source_end).collect::<Vec<_>>(),
            "partition {partition}: every source record's output once, in offset order ({})",
            guarantee.as_str()
        );
        outputs += sources.len();
    }
    assert_eq!(outputs, 3_000);
}

#[test]
fn sink_outputs_reach_kafka_at_least_once() {
    sink_outputs_reach_kafka(taskstream_server::ProcessingGuarantee::AtLeastOnce);
}

#[test]
fn sink_outputs_reach_kafka_in_transactions_with_exactly_once_v2() {
    sink_outputs_reach_kafka(taskstream_server::ProcessingGuarantee::ExactlyOnceV2);
}

/// Records Kafka refuses for good (over the producer's `message.max.bytes`)
/// fail alone and wedge nothing: a produced one is answered INVALID_ARGUMENT
/// (it was UNAVAILABLE, which clients retry forever); a processed record
/// whose store write is too large for the changelog, or whose output is too
/// large for the sink, is dead-lettered at once without its writes, and the
/// others run and are committed (each used to fail every commit of its task).
#[test]
fn records_too_large_for_kafka_fail_alone_and_wedge_nothing() {
    use taskstream_server::{ProcessError, ProcessorContext, ProducerRecord, Record, RuntimeError};
    let Some(broker) = broker() else { return };
    let (application, topic, mut config) = consumer_app(broker, "too-large", 1);
    config.kafka.insert("message.max.bytes".into(), "2000".into());
    config.pipelines[0].processor = taskstream_server::ProcessorSpec::Custom { name: "sized".into() };
    config.pipelines[0].sink_topic = Some(format!("{application}-out"));
    let processor = std::sync::Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        let key = record.key.clone().unwrap_or_default();
        let size = |what: &str| if record.value == what { 3_000 } else { 10 };
        ctx.store.put(key.clone(), vec![b's'; size("big write")].into())?;
        ctx.emit(ProducerRecord::keyed(key, vec![b'o'; size("big output")]));
        Ok::<(), ProcessError>(())
    });
    let app = start_hosting(config, "sized", processor, 1);
    match app.produce(&topic, vec![ProducerRecord::keyed("k", vec![b'v'; 3_000])]) {
        Err(RuntimeError::InvalidArgument { field, message }) => {
            assert_eq!(field, "records");
            assert!(message.contains("message.max.bytes"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let records = [("a", "ok"), ("b", "big write"), ("c", "big output"), ("d", "ok")];
    app.produce(
        &topic,
        records
            .iter()
            .map(|(k, v)| ProducerRecord::keyed(*k, *v))
            .collect(),
    )
    .expect("produce");
    assert!(app.wait_until_caught_up(DEADLINE), "{:#?}", app.describe());
    let task = &app.describe().tasks[0];
    assert_eq!(
        (task.records_processed, task.records_dead_lettered),
        (2, 2),
        "{task:#?}"
    );
    for (key, written) in [("a", true), ("b", false), ("c", false), ("d", true)] {
        assert_eq!(
            app.get("counts", key.as_bytes()).unwrap().is_some(),
            written,
            "{key}"
        );
    }
    app.shutdown().expect("the commits go on");
}

/// An exactly_once_v2 application of `partitions` partitions whose pipeline
/// `counts` runs the custom processor `flaky` in `order`.
fn exactly_once_config(
    broker: &common::kafka::Broker,
    application: &str,
    topic: &str,
    partitions: u32,
    order: taskstream_server::ProcessingOrder,
) -> taskstream_server::Config {
    let mut config = group_config(
        broker,
        application,
        topic,
        partitions,
        taskstream_server::GroupProtocol::Consumer,
    );
    config.processing_order = order;
    config.processing_guarantee = taskstream_server::ProcessingGuarantee::ExactlyOnceV2;
    config.pipelines[0].processor = taskstream_server::ProcessorSpec::Custom { name: "flaky".into() };
    config
}

/// Adds one to `key`'s count (a decimal) in the processor's store.
fn count_one(
    ctx: &taskstream_server::ProcessorContext<'_>,
    key: &[u8],
) -> Result<(), taskstream_server::ProcessError> {
    ctx.store.update(key, &mut |old| {
        let n: u64 = old.map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
        Some(bytes::Bytes::from((n + 1).to_string()))
    })?;
    Ok(())
}

/// `key`'s count in the store `counts` of `app` (0 if none yet).
fn count_in(app: &taskstream_server::StreamsApp, key: &str) -> u64 {
    app.get("counts", key.as_bytes())
        .ok()
        .flatten()
        .map_or(0, |v| std::str::from_utf8(&v).unwrap().parse().unwrap())
}

/// Failures under exactly_once_v2 in `key` order, T = 2: a retry entry is
/// readable once its transaction commits, and a commit waits for every
/// fetched record, so a failed key's later records park on the retry topic
/// (held in memory, they and the commit waited for each other for good:
/// batch 0 never finished). The retry partition, written in transactions,
/// holds a marker after each one's entries: the committed retry position
/// passes them (it stopped at the first one, 40 of 205, and a restart would
/// have run every later entry again). Every record is counted exactly once,
/// batch after batch.
#[test]
fn exactly_once_v2_retries_in_key_order_count_every_record_once() {
    use taskstream_server::{ProcessError, ProcessorContext, ProducerRecord, Record, StreamsApp};
    let Some(broker) = broker() else { return };
    let application = unique("eos-retries");
    let topic = format!("{application}-events");
    let mut config = exactly_once_config(
        broker,
        &application,
        &topic,
        2,
        taskstream_server::ProcessingOrder::Key,
    );
    config.num_threads_per_task = 2;
    config.retry_backoff_ms = 20;
    config.retry_backoff_max_ms = 40;
    // Counts per key; a tenth of the records fail their first attempt.
    let processor = std::sync::Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        let value: u64 = std::str::from_utf8(&record.value).unwrap().parse().unwrap();
        if value % 10 == 3 && ctx.attempt == 1 {
            return Err(ProcessError::new("Flaky", "first attempt"));
        }
        count_one(ctx, record.key.as_deref().unwrap_or_default())
    });
    let app = StreamsApp::builder(config)
        .processor("flaky", processor)
        .start()
        .expect("start the instance");
    eventually("the instance hosts both partitions", || {
        app.hosted_partitions("counts").unwrap().len() == 2
    });
    let keys = 20;
    let count_of = |key: usize| count_in(&app, &format!("key-{key}"));
    // Batches apart, so their retries go into different transactions.
    for batch in 0..5u64 {
        let records: Vec<ProducerRecord> = (batch * 400..(batch + 1) * 400)
            .map(|i| ProducerRecord::keyed(format!("key-{}", i % keys as u64), i.to_string()))
            .collect();
        app.produce(&topic, records).expect("produce");
        let expected = (batch + 1) * 400 / keys as u64;
        eventually(
            &format!("batch {batch}: every key counted {expected} times"),
            || (0..keys).all(|key| count_of(key) >= expected),
        );
        for key in 0..keys {
            assert_eq!(
                count_of(key),
                expected,
                "batch {batch}: key-{key} counted once per record"
            );
        }
    }
    app.shutdown().expect("shutdown commits");
    // The committed retry position passes every entry: all but the last
    // transaction's marker (no read reports that one) are behind it.
    let reader = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1)
        .expect("connect to the broker");
    use taskstream_server::Log as _;
    let retry = format!("{application}-counts-retry");
    for partition in 0..2 {
        let end = reader.end_offset(&retry, partition).unwrap();
        let committed = reader
            .committed(&application, &retry, partition)
            .unwrap()
            .unwrap_or(0);
        assert!(
            committed + 1 >= end,
            "partition {partition}: retry position {committed} of {end}"
        );
    }
}

/// Under exactly-once, retry entries that became final above the committed
/// retry position (behind one still waiting out a long backoff) are not run
/// again by the instance that takes the partition next: the position's
/// offset commit carries them. Before, the new owner ran them all again and
/// counted each of those records twice.
#[test]
fn exactly_once_v2_final_retries_above_the_retry_position_are_not_run_again() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use taskstream_server::{ProcessError, ProcessorContext, ProducerRecord, Record, StreamsApp};
    let Some(broker) = broker() else { return };
    let application = unique("eos-retry-done");
    let topic = format!("{application}-events");
    let mut config = exactly_once_config(
        broker,
        &application,
        &topic,
        1,
        taskstream_server::ProcessingOrder::Unordered,
    );
    config.retry_backoff_ms = 100;
    config.retry_backoff_max_ms = 600_000;
    config.retry_max_attempts = 1_000;
    // `slow` fails until healed; every other record fails its first attempt.
    let healed = std::sync::Arc::new(AtomicBool::new(false));
    let slow_failures = std::sync::Arc::new(AtomicU32::new(0));
    let processor = {
        let (healed, slow_failures) = (healed.clone(), slow_failures.clone());
        std::sync::Arc::new(move |record: &Record, ctx: &ProcessorContext<'_>| {
            let key = record.key.as_deref().unwrap_or_default();
            if key == b"slow" && !healed.load(Ordering::SeqCst) {
                slow_failures.fetch_add(1, Ordering::SeqCst);
                return Err(ProcessError::new("Slow", "not yet"));
            }
            if key != b"slow" && ctx.attempt == 1 {
                return Err(ProcessError::new("Flaky", "first attempt"));
            }
            count_one(ctx, key)
        })
    };
    let count_of = count_in;
    let fast_keys: Vec<String> = (0..50).map(|i| format!("fast-{i}")).collect();

    let first = StreamsApp::builder(config.clone())
        .processor("flaky", processor.clone())
        .start()
        .expect("start the first instance");
    eventually("the first instance hosts the partition", || {
        first.hosted_partitions("counts").unwrap().len() == 1
    });
    first
        .produce(&topic, vec![ProducerRecord::keyed("slow", "1")])
        .expect("produce");
    // After its 6th failure `slow` waits 3.2-6.4 s (100 ms doubling, jittered
    // by half at most): long enough for the others to finish behind it.
    eventually("slow failed 6 times", || {
        slow_failures.load(Ordering::SeqCst) >= 6
    });
    let records = fast_keys
        .iter()
        .map(|key| ProducerRecord::keyed(key.clone(), "1"))
        .collect();
    first.produce(&topic, records).expect("produce");
    eventually("every fast record counted after its retry", || {
        fast_keys.iter().all(|key| count_of(&first, key) == 1)
    });
    first.shutdown().expect("the first instance commits as it leaves");

    let reader = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1)
        .expect("connect to the broker");
    use taskstream_server::Log as _;
    let retry = format!("{application}-counts-retry");
    let end = reader.end_offset(&retry, 0).unwrap();
    let position = reader.committed(&application, &retry, 0).unwrap().unwrap_or(0);
    assert!(
        position + fast_keys.len() as u64 <= end,
        "the fast records' entries are above the retry position (`slow`'s): position {position}, end {end}"
    );

    healed.store(true, Ordering::SeqCst);
    let second = StreamsApp::builder(config)
        .processor("flaky", processor)
        .start()
        .expect("start the second instance");
    eventually("the second instance counts slow", || {
        count_of(&second, "slow") == 1
    });
    // Every entry final and committed: nothing is left to run again.
    eventually("the retry position passes every entry", || {
        reader.committed(&application, &retry, 0).unwrap().unwrap_or(0) + 1 >= end
    });
    for key in &fast_keys {
        assert_eq!(count_of(&second, key), 1, "{key} counted once");
    }
    second
        .shutdown()
        .expect("the second instance commits as it leaves");
}

/// State moves with its partition: one instance counts into persistent
/// stores; a second one with an empty data dir takes every partition over
/// and answers the same counts, restored from the changelog (the group's
/// offsets are at the end, so nothing is processed again); the first one,
/// back with its older copy, restores only what the changelog gained since.
#[test]
fn a_fresh_instance_restores_the_stores_from_the_changelog() {
    use taskstream_server::{ProducerRecord, StreamsApp};
    let Some(broker) = broker() else { return };
    let (application, topic, mut config) = consumer_app(broker, "changelog", 4);
    let first_dir = taskstream_server::scratch::scratch_dir("kafka-changelog-a").expect("a scratch dir");
    let second_dir = taskstream_server::scratch::scratch_dir("kafka-changelog-b").expect("a scratch dir");
    config.data_dir = Some(first_dir.path().to_path_buf());
    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    let produce = |app: &StreamsApp, round: usize, expected: &mut BTreeMap<String, u64>| {
        let records: Vec<ProducerRecord> = (0..500)
            .map(|i| {
                let key = format!("key-{}", (i * 11 + round) % 53);
                *expected.entry(key.clone()).or_default() += 1;
                ProducerRecord::keyed(key, "1")
            })
            .collect();
        app.produce(&topic, records).expect("produce");
    };
    let counts = |app: &StreamsApp| -> BTreeMap<String, u64> {
        let Ok(results) = app.query_range("counts", None, None, &[], 0) else {
            return BTreeMap::new();
        };
        results
            .into_iter()
            .flat_map(|result| result.entries)
            .map(|(key, value)| {
                let count: u64 = String::from_utf8_lossy(&value).parse().unwrap();
                (String::from_utf8_lossy(&key).into_owned(), count)
            })
            .collect()
    };

    let first = StreamsApp::builder(config.clone())
        .start()
        .expect("start the first instance");
    eventually("the first instance hosts all 4 partitions", || {
        first.hosted_partitions("counts").unwrap().len() == 4
    });
    produce(&first, 0, &mut expected);
    produce(&first, 1, &mut expected);
    eventually("the first instance counts everything", || {
        counts(&first) == expected
    });
    first.shutdown().expect("the first instance commits as it leaves");

    // The changelog: compacted (see the KafkaLog test), one partition per task.
    let log = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1)
        .expect("connect to the broker");
    use taskstream_server::Log as _;
    let changelog = format!("{application}-counts-changelog");
    assert_eq!(log.partitions(&changelog).unwrap(), 4);
    let records: u64 = (0..4).map(|p| log.end_offset(&changelog, p).unwrap()).sum();
    assert!(records > 0, "the changelog holds the stores' writes");

    let mut fresh = config.clone();
    fresh.data_dir = Some(second_dir.path().to_path_buf());
    let second = StreamsApp::builder(fresh)
        .start()
        .expect("start the second instance");
    eventually("the second instance hosts all 4 partitions", || {
        second.hosted_partitions("counts").unwrap().len() == 4
    });
    eventually("the second instance answers the same counts", || {
        counts(&second) == expected
    });
    assert_eq!(second.state(), taskstream_server::AppState::Running);
    produce(&second, 2, &mut expected);
    eventually("the second instance counts the new records", || {
        counts(&second) == expected
    });
    second
        .shutdown()
        .expect("the second instance commits as it leaves");

    let first = StreamsApp::builder(config)
        .start()
        .expect("restart the first instance");
    eventually("the first instance, restored, answers every count", || {
        counts(&first) == expected
    });
    first.shutdown().expect("shutdown");
}

/// Records produced straight to Kafka by a background thread, keyed
/// `key-0` … `key-63`, counted per key once Kafka acknowledged them.
struct Flow {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<BTreeMap<String, u64>>,
}

impl Flow {
    fn start(bootstrap: &str, topic: &str) -> Flow {
        use taskstream_server::Log as _;
        let log = taskstream_server::log::KafkaLog::with_settings(bootstrap, &BTreeMap::new(), 1)
            .expect("connect to the broker");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        let topic = topic.to_string();
        let thread = std::thread::spawn(move || {
            let mut produced: BTreeMap<String, u64> = BTreeMap::new();
            let mut n = 0u64;
            while !stopping.load(std::sync::atomic::Ordering::Acquire) {
                let keys: Vec<String> = (0..100)
                    .map(|_| {
                        n += 1;
                        format!("key-{}", (n * 7) % 64)
                    })
                    .collect();
                let records = keys
                    .iter()
                    .map(|key| taskstream_server::ProducerRecord::keyed(key.clone(), "1"))
                    .collect();
                log.append(&topic, records).expect("produce to Kafka");
                for key in keys {
                    *produced.entry(key).or_default() += 1;
                }
                // A steady trickle (about 5,000 records/s), not a flood.
                std::thread::sleep(Duration::from_millis(20));
            }
            produced
        });
        Flow { stop, thread }
    }

    /// Stops producing; answers what was produced, per key.
    fn stop(self) -> BTreeMap<String, u64> {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.thread.join().expect("the producer thread")
    }
}

/// Three instances of the server binary (memory stores) share 6 partitions
/// while records flow. One is killed with SIGKILL: its partitions move to
/// the two others, which restore its stores from the changelog and count
/// every record at least once (how many twice is printed; with
/// exactly_once_v2 none, asserted). Restarted, it gets partitions back and
/// metadata shows it. Then one is stopped with SIGTERM while records flow:
/// it commits before its partitions move, and no record is counted twice.
#[test]
fn instances_fail_over_on_sigkill_and_hand_over_on_sigterm() {
    fail_over("at_least_once", Stores::Memory);
}

#[test]
fn exactly_once_v2_applies_nothing_twice_after_sigkill() {
    fail_over("exactly_once_v2", Stores::Memory);
}

/// The same with persistent stores, each instance in its own data dir: the
/// killed one comes back to its own older copy, which under exactly-once is
/// not where the group's offsets are and is rebuilt from the changelog.
#[test]
fn exactly_once_v2_with_persistent_stores_applies_nothing_twice_after_sigkill() {
    fail_over("exactly_once_v2", Stores::Persistent);
}

#[derive(Clone, Copy, PartialEq)]
enum Stores {
    Memory,
    Persistent,
}

fn fail_over(guarantee: &str, stores: Stores) {
    let Some(broker) = broker() else { return };
    let application = unique(&format!("failover-{}", guarantee.replace('_', "-")));
    let topic = format!("{application}-events");
    let dir = taskstream_server::scratch::scratch_dir("kafka-failover").expect("a scratch dir");
    let data_dirs: Vec<Option<std::path::PathBuf>> = (0..3)
        .map(|i| (stores == Stores::Persistent).then(|| dir.path().join(format!("data-{i}"))))
        .collect();
    let config = dir.path().join("taskstream.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            application_id = "{application}"
            num_stream_threads = 2
            commit_interval_ms = 200
            replication_factor = 1
            processing_guarantee = "{guarantee}"
            [kafka]
            # A killed member's open transaction is aborted when its tasks'
            # producers are fenced; this bounds it otherwise.
            "transaction.timeout.ms" = 10000
            [[topics]]
            name = "{topic}"
            partitions = 6
            [[pipelines]]
            name = "counts"
            source_topic = "{topic}"
            processor = "count"
            "#
        ),
    )
    .expect("write the config");
    let start = |i: usize| {
        Launch::kafka(&config, &broker.bootstrap)
            .data_dir(data_dirs[i].as_deref())
            .start()
    };
    let mut servers: Vec<Instance> = (0..3).map(start).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let share = |servers: &[&Instance]| runtime.block_on(share_all(servers, "counts", 6));
    let counts = |servers: &[&Instance]| runtime.block_on(counts_of(servers, "counts"));
    eventually("three instances share the 6 partitions", || {
        share(&[&servers[0], &servers[1], &servers[2]])
    });

    // SIGKILL while records flow.
    let flow = Flow::start(&broker.bootstrap, &topic);
    eventually("the instances count records", || {
        counts(&[&servers[0], &servers[1], &servers[2]]).is_some_and(|c| c.values().sum::<u64>() >= 3_000)
    });
    let victim = runtime
        .block_on(own_partitions(&servers[1], "counts"))
        .expect("the victim's partitions");
    servers[1].kill();
    let killed_at = Instant::now();
    eventually("the survivors take over every partition", || {
        share(&[&servers[0], &servers[2]])
    });
    println!(
        "SIGKILL ({guarantee}): partitions {victim:?} processing on the survivors after {:?}",
        killed_at.elapsed()
    );
    servers[1] = start(1);
    eventually(
        "the restarted instance gets partitions back and metadata shows it",
        || share(&[&servers[0], &servers[1], &servers[2]]),
    );
    let produced = flow.stop();
    let total: u64 = produced.values().sum();
    let mut settled = BTreeMap::new();
    eventually("every produced record is counted at least once", || {
        let Some(now) = counts(&[&servers[0], &servers[1], &servers[2]]) else {
            return false;
        };
        let done = produced
            .iter()
            .all(|(key, n)| now.get(key).is_some_and(|c| c >= n));
        settled = now;
        done
    });
    let twice = settled.values().sum::<u64>() - total;
    println!("SIGKILL: {total} records produced, {twice} applied twice ({guarantee})");
    if guarantee == "exactly_once_v2" {
        assert_eq!(
            settled, produced,
            "exactly_once_v2 applies no record twice after a SIGKILL"
        );
    }

    // SIGTERM while records flow: nothing twice.
    let before = settled;
    let before_total: u64 = before.values().sum();
    let flow = Flow::start(&broker.bootstrap, &topic);
    eventually("records flow again", || {
        counts(&[&servers[0], &servers[1], &servers[2]])
            .is_some_and(|c| c.values().sum::<u64>() >= before_total + 2_000)
    });
    let stopped_at = Instant::now();
    assert!(
        servers[0].terminate(),
        "the instance did not exit 0 after SIGTERM"
    );
    eventually("the others take over its partitions", || {
        share(&[&servers[1], &servers[2]])
    });
    println!(
        "SIGTERM: every partition processing on the others after {:?}",
        stopped_at.elapsed()
    );
    let produced = flow.stop();
    let expected = add(&before, &produced);
    let expected_total: u64 = expected.values().sum();
    let mut last = BTreeMap::new();
    eventually("every record produced since is counted", || {
        let Some(now) = counts(&[&servers[1], &servers[2]]) else {
            return false;
        };
        let done = now.values().sum::<u64>() >= expected_total;
        last = now;
        done
    });
    assert_eq!(last, expected, "a graceful stop applies no record twice");
}
