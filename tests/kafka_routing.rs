//! Any instance answers for all, on Apache Kafka (tests/common/kafka.rs): the
//! instances of one application publish who holds what to the compacted
//! `<application_id>-metadata` topic, and three server binaries sharing 12
//! partitions answer metadata, key lookups and queries for each other
//! (forwarding, or naming the owner with `forward_queries = false`), and the
//! client merges the record outcomes of all three (`get_metadata_async_all`).
//! Two instances serving mutual TLS forward queries to each other over TLS
//! (`tls_peer_ca`, each presenting its own certificate).

mod common;

use common::instance::{Instance, Launch};
use common::kafka::{Broker, broker, unique};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use taskstream_client::{ClientError, MetadataBatch, MetadataOptions, StreamsClient, keyed_record, v1};
use taskstream_server::Log as _;
use taskstream_server::metadata::cluster::{ClusterView, InstanceRecord};
use taskstream_server::{Config, PipelineConfig, ProcessorSpec, StreamsApp, TopicConfig};

/// Bound on anything that should happen promptly (a start, a rebalance).
const DEADLINE: Duration = Duration::from_secs(90);

/// Polls `condition` until it holds or `DEADLINE` passes (then panics with `what`).
fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "within {DEADLINE:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The metadata topic as a fresh reader sees it: every record from the
/// start applied to a view, and the latest value per key (empty: a tombstone).
fn read_metadata_topic(
    log: &taskstream_server::log::KafkaLog,
    topic: &str,
) -> (ClusterView, BTreeMap<String, bool>) {
    let mut view = ClusterView::new();
    let mut latest = BTreeMap::new();
    let end = log
        .end_offset(topic, 0)
        .expect("end offset of the metadata topic");
    let mut next = 0;
    let mut records = Vec::new();
    while next < end {
        records.clear();
        log.read(topic, 0, next, 500, &mut records)
            .expect("read the metadata topic");
        for record in &records {
            let key =
                String::from_utf8(record.key.clone().expect("a keyed record").to_vec()).expect("UTF-8 key");
            let decoded = (!record.value.is_empty())
                .then(|| InstanceRecord::decode(&record.value).expect("a readable record"));
            latest.insert(key.clone(), decoded.is_some());
            view.apply(&key, decoded);
            next = record.offset + 1;
        }
    }
    (view, latest)
}

fn in_process_config(broker: &Broker, application: &str, topic: &str, server: &str) -> Config {
    let mut config = Config {
        application_id: application.to_string(),
        application_server: server.to_string(),
        num_stream_threads: 2,
        commit_interval_ms: 100,
        bootstrap_servers: Some(broker.bootstrap.clone()),
        replication_factor: 1,
        ..Default::default()
    };
    config.topics.push(TopicConfig::new(topic, 6));
    config
        .pipelines
        .push(PipelineConfig::new("counts", topic, ProcessorSpec::Count));
    config
}

/// Item 1 of "any instance answers for all": each instance publishes its
/// address, partitions and generation to the compacted metadata topic; a
/// graceful stop leaves a tombstone. Every instance's view, and a fresh
/// reader of the topic, agree on who holds what.
#[test]
fn instances_publish_what_they_hold_to_the_metadata_topic() {
    let Some(broker) = broker() else { return };
    let application = unique("published");
    let topic = format!("{application}-events");
    let metadata_topic = format!("{application}-metadata");
    let first = StreamsApp::builder(in_process_config(broker, &application, &topic, "127.0.0.1:40001"))
        .start()
        .expect("start the first instance");
    let second = StreamsApp::builder(in_process_config(broker, &application, &topic, "127.0.0.1:40002"))
        .start()
        .expect("start the second instance");
    let log = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1)
        .expect("connect to the broker");

    eventually(
        "the topic says both instances hold disjoint partitions covering all 6",
        || {
            let (view, _) = read_metadata_topic(&log, &metadata_topic);
            let holders = view.holders("counts");
            let ports: Vec<u16> = holders.iter().map(|(record, _)| record.port).collect();
            let held: Vec<u32> = holders
                .iter()
                .flat_map(|(_, partitions)| partitions.clone())
                .collect();
            ports == [40001, 40002] && held.len() == 6 && held.iter().collect::<BTreeSet<_>>().len() == 6
        },
    );
    let (view, _) = read_metadata_topic(&log, &metadata_topic);
    for (record, partitions) in view.holders("counts") {
        let app = if record.port == 40001 { &first } else { &second };
        assert_eq!(app.hosted_partitions("counts").unwrap(), partitions, "{record:?}");
        assert!(record.generation >= 0, "{record:?}");
    }
    // Each instance answers for both, from its own view of the topic.
    for app in [&first, &second] {
        eventually("ProcessMetadataForStore lists both instances", || {
            let Ok(metadata) = app.process_metadata_for_store("counts", true) else {
                return false;
            };
            let mut all: Vec<u32> = metadata
                .instances
                .iter()
                .flat_map(|i| i.topic_partitions.iter().map(|tp| tp.partition))
                .collect();
            all.sort_unstable();
            metadata.instances.len() == 2 && all == (0..6).collect::<Vec<_>>()
        });
    }

    second.shutdown().expect("the second instance stops");
    eventually("the second instance's latest record is a tombstone", || {
        let (view, latest) = read_metadata_topic(&log, &metadata_topic);
        latest.get("127.0.0.1:40002") == Some(&false)
            && view.instances().map(|r| r.port).collect::<Vec<_>>() == [40001]
            && view
                .holders("counts")
                .first()
                .is_some_and(|(_, ps)| ps.len() == 6)
    });
    first.shutdown().expect("the first instance stops");
}

/// The server binary on Kafka with memory stores, logging warnings only.
fn start(config: &std::path::Path, bootstrap: &str, env: &[(&str, &str)]) -> Instance {
    env.iter()
        .fold(
            Launch::kafka(config, bootstrap).log_filter("warn"),
            |launch, (name, value)| launch.env(name, value),
        )
        .start()
}

fn host_of(host: Option<&v1::HostInfo>) -> String {
    host.map(|h| format!("{}:{}", h.host, h.port)).unwrap_or_default()
}

/// Retries a call while the instances rebalance (UNAVAILABLE).
async fn settled<T, F: std::future::Future<Output = Result<T, ClientError>>>(
    what: &str,
    mut call: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        match call().await {
            Ok(value) => return value,
            Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(e.retry_after().unwrap_or(Duration::from_millis(100))).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Three instances of the server binary share 12 partitions: every one
/// lists all three with disjoint partitions covering the 12; MetadataForKey
/// on any names the instance whose Query answers the key; a Query on
/// another instance is forwarded to it (the answer names it), a range
/// fans out to all three; with `forward_queries = false` (here through its
/// environment variable) the owner comes back in ErrorInfo instead.
/// Asks each instance for the store's metadata until it lists exactly
/// `addresses`, with disjoint partitions covering `partitions`, and says what
/// the instances asked before it said; answers partition → owner.
async fn settled_owners(
    clients: &[StreamsClient],
    addresses: &[String],
    partitions: usize,
) -> BTreeMap<u32, String> {
    let expected: BTreeSet<String> = addresses.iter().cloned().collect();
    let mut owners: BTreeMap<u32, String> = BTreeMap::new();
    for (i, client) in clients.iter().enumerate() {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let listed = match client.process_metadata_for_store("counts", true).await {
                Ok(metadata) => metadata.metadata,
                Err(e) if e.is_retryable() => Vec::new(),
                Err(e) => panic!("ProcessMetadataForStore on instance {i}: {e}"),
            };
            let mut seen: BTreeMap<u32, String> = BTreeMap::new();
            let mut disjoint = true;
            for instance in &listed {
                for tp in &instance.topic_partitions {
                    disjoint &= seen
                        .insert(tp.partition, host_of(instance.host_info.as_ref()))
                        .is_none();
                }
            }
            let hosts: BTreeSet<String> = listed.iter().map(|m| host_of(m.host_info.as_ref())).collect();
            if disjoint && seen.len() == partitions && hosts == expected {
                // Once settled, every instance tells the same story; a change
                // (a late rebalance) is asked again at once.
                if owners.is_empty() || owners == seen {
                    owners = seen;
                    break;
                }
                owners = seen;
                continue;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "instance {i} did not list the {} instances with disjoint partitions covering {partitions}: {listed:#?}",
                addresses.len()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    owners
}

#[test]
fn three_server_binaries_answer_for_each_other() {
    let Some(broker) = broker() else { return };
    let application = unique("routing");
    let topic = format!("{application}-events");
    let dir = taskstream_server::scratch::scratch_dir("kafka-routing").expect("a scratch dir");
    let config = dir.path().join("taskstream.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            application_id = "{application}"
            num_stream_threads = 2
            commit_interval_ms = 100
            replication_factor = 1
            # Range answers come in pages of about 100 bytes: a fanned-out
            # range pages across the instances.
            max_response_bytes = 100
            [[topics]]
            name = "{topic}"
            partitions = 12
            [[pipelines]]
            name = "counts"
            source_topic = "{topic}"
            processor = "count"
            "#
        ),
    )
    .expect("write the config");
    let servers = [
        start(&config, &broker.bootstrap, &[]),
        start(&config, &broker.bootstrap, &[]),
        start(
            &config,
            &broker.bootstrap,
            &[("TASKSTREAM_FORWARD_QUERIES", "false")],
        ),
    ];
    let addresses: Vec<String> = servers.iter().map(|s| s.address.clone()).collect();
    let started = Instant::now();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let mut clients = Vec::new();
        for address in &addresses {
            clients.push(StreamsClient::connect(address).await.expect("connect"));
        }

        // Every instance lists all three, disjoint, covering all 12.
        let owners = settled_owners(&clients, &addresses, 12).await;
        eprintln!(
            "three instances settled {:.1} s after the last start: {owners:?}",
            started.elapsed().as_secs_f64()
        );

        // Records through one instance; their counts land on all three.
        let keys: Vec<String> = (0..36).map(|i| format!("user-{i}")).collect();
        let records = keys
            .iter()
            .enumerate()
            .flat_map(|(i, key)| (0..=i % 3).map(move |_| keyed_record(key.clone(), "1")))
            .collect();
        let produced = clients[0].produce(&topic, records).await.expect("Produce");
        let expected: BTreeMap<String, u64> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| (key.clone(), (i % 3 + 1) as u64))
            .collect();
        assert_eq!(produced.record_count, expected.values().sum::<u64>());

        // A range Query on the instance that forwards nothing would be
        // refused; on the others it fans out and merges the 12 partitions,
        // each answered by its owner, page after page.
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let mut request = v1::QueryRequest {
                store: "counts".into(),
                query: Some(v1::query_request::Query::Range(v1::RangeQuery::default())),
                ..Default::default()
            };
            let mut results = Vec::new();
            let mut pages = 0;
            loop {
                let response = settled("range Query", || clients[1].query(request.clone())).await;
                pages += 1;
                results.extend(response.results);
                if response.next_page_token.is_empty() {
                    break;
                }
                request.page_token = response.next_page_token;
            }
            let mut partitions: Vec<u32> = results.iter().map(|r| r.partition).collect();
            assert!(
                partitions.is_sorted(),
                "partitions ascend across pages: {partitions:?}"
            );
            partitions.dedup();
            assert_eq!(
                partitions,
                (0..12).collect::<Vec<_>>(),
                "every partition answered"
            );
            assert!(pages > 1, "about 300 bytes of entries come in pages of 100");
            for result in &results {
                assert_eq!(
                    host_of(result.host.as_ref()),
                    owners[&result.partition],
                    "partition {} answered by its owner",
                    result.partition
                );
            }
            let mut counts: BTreeMap<String, u64> = BTreeMap::new();
            for entry in results.iter().flat_map(|r| &r.entries) {
                let key = String::from_utf8_lossy(&entry.key).into_owned();
                let count = String::from_utf8_lossy(&entry.value).parse().expect("a count");
                assert!(counts.insert(key, count).is_none(), "an entry on two pages");
            }
            if counts == expected {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the fanned-out range did not reach the produced counts: {counts:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // Every record's outcome, from the three instances at once, merged
        // by the client into one callback in offset order per partition.
        let (sender, received) = tokio::sync::oneshot::channel();
        let mut sender = Some(sender);
        clients[2]
            .get_metadata_async_all(
                "counts",
                MetadataOptions::bounded().in_order(true).coalesce(true),
                move |result: Result<MetadataBatch, ClientError>| {
                    if let Some(sender) = sender.take() {
                        let _ = sender.send(result);
                    }
                },
            )
            .join()
            .await;
        let all = received
            .await
            .expect("one callback")
            .expect("every record's outcome");
        let mut offsets: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
        for record in &all.records {
            offsets.entry(record.partition).or_default().push(record.offset);
        }
        let mut produced_offsets: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
        for position in &produced.positions {
            produced_offsets
                .entry(position.partition)
                .or_default()
                .push(position.offset);
        }
        for list in produced_offsets.values_mut() {
            list.sort_unstable();
        }
        assert_eq!(
            offsets, produced_offsets,
            "every produced offset once, in order per partition"
        );
        let tasks: BTreeSet<&str> = all.ranges.iter().map(|r| r.task_id.as_str()).collect();
        assert_eq!(
            tasks.len(),
            produced_offsets.len(),
            "one task per partition written"
        );

        for key in &keys {
            let mut named = BTreeSet::new();
            for client in &clients {
                let metadata = settled("MetadataForKey", || {
                    client.metadata_for_key("counts", key.clone())
                })
                .await;
                named.insert(host_of(metadata.active_host.as_ref()));
                assert_eq!(
                    owners[&metadata.partition],
                    host_of(metadata.active_host.as_ref())
                );
            }
            assert_eq!(
                named.len(),
                1,
                "every instance names the same owner of {key}: {named:?}"
            );
            let owner = named.into_iter().next().expect("an owner");
            let owner_index = addresses
                .iter()
                .position(|a| *a == owner)
                .expect("a listed instance");
            let request = v1::QueryRequest {
                store: "counts".into(),
                query: Some(v1::query_request::Query::Key(v1::KeyQuery {
                    key: key.clone().into(),
                })),
                ..Default::default()
            };
            // The owner answers from its own store ...
            let local = v1::QueryRequest {
                local_only: true,
                ..request.clone()
            };
            let answer = settled("Query on the owner", || clients[owner_index].query(local.clone())).await;
            assert_eq!(host_of(answer.results[0].host.as_ref()), owner);
            assert_eq!(answer.results[0].entries[0].value, expected[key].to_string());
            // ... the others forward to it, or, not forwarding, name it.
            for (i, client) in clients.iter().enumerate().filter(|(i, _)| *i != owner_index) {
                if i == 2 {
                    match client.query(request.clone()).await {
                        Err(ClientError::NotHosted { owner: named, .. }) => {
                            assert_eq!(named.as_deref(), Some(owner.as_str()), "the owner of {key}");
                        }
                        other => panic!("instance 2 (forward_queries = false) answered {other:?}"),
                    }
                    continue;
                }
                let answer = settled("forwarded Query", || client.query(request.clone())).await;
                assert_eq!(answer.results.len(), 1);
                assert_eq!(
                    host_of(answer.results[0].host.as_ref()),
                    owner,
                    "{key} answered by its owner"
                );
                assert_eq!(answer.results[0].entries[0].value, expected[key].to_string());
            }
        }
    });
}

/// A file of the test certificates (tests/data/tls; see its make.sh), as text for the
/// environment.
fn tls_file(name: &str) -> String {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tls")
        .join(name)
        .display()
        .to_string()
}

/// Two server binaries serving mutual TLS with the test certificate (for 127.0.0.1, the
/// host they advertise) share 6 partitions; a key Query on the instance that does not
/// hold the key is forwarded over TLS to the one that does (which requires a client
/// certificate: the forwarding instance presents its own), and a range fans out to both.
#[test]
fn two_tls_instances_forward_queries_to_each_other_over_mutual_tls() {
    let Some(broker) = broker() else { return };
    let application = unique("routing-tls");
    let topic = format!("{application}-events");
    let dir = taskstream_server::scratch::scratch_dir("kafka-routing-tls").expect("a scratch dir");
    let config = dir.path().join("taskstream.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            application_id = "{application}"
            num_stream_threads = 2
            commit_interval_ms = 100
            replication_factor = 1
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
    let (cert, key, ca) = (tls_file("server.pem"), tls_file("server.key"), tls_file("ca.pem"));
    let env = [
        ("TASKSTREAM_TLS_CERT", cert.as_str()),
        ("TASKSTREAM_TLS_KEY", key.as_str()),
        ("TASKSTREAM_TLS_CLIENT_CA", ca.as_str()),
        ("TASKSTREAM_TLS_PEER_CA", ca.as_str()),
    ];
    let servers = [
        start(&config, &broker.bootstrap, &env),
        start(&config, &broker.bootstrap, &env),
    ];
    for server in &servers {
        assert!(
            server
                .stdout
                .iter()
                .any(|line| line.contains("forwarding:  queries to other instances over TLS")),
            "{:#?}",
            server.stdout
        );
    }
    let addresses: Vec<String> = servers.iter().map(|s| s.address.clone()).collect();
    let pem = |name: &str| std::fs::read(tls_file(name)).expect("a test certificate");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let mut clients = Vec::new();
        for address in &addresses {
            let client = StreamsClient::builder(format!("https://{address}"))
                .ca_cert_pem(pem("ca.pem"))
                .client_identity(pem("client.pem"), pem("client.key"))
                .connect()
                .await
                .expect("connect over mutual TLS");
            clients.push(client);
        }

        // Both instances listed by both, with disjoint partitions covering all 6.
        let owners = settled_owners(&clients, &addresses, 6).await;

        let keys: Vec<String> = (0..24).map(|i| format!("user-{i}")).collect();
        let records = keys
            .iter()
            .enumerate()
            .flat_map(|(i, key)| (0..=i % 3).map(move |_| keyed_record(key.clone(), "1")))
            .collect();
        clients[0].produce(&topic, records).await.expect("Produce");
        let expected: BTreeMap<String, u64> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| (key.clone(), (i % 3 + 1) as u64))
            .collect();

        // A range on each instance fans out over TLS to the other and merges all 6.
        for (i, client) in clients.iter().enumerate() {
            let deadline = tokio::time::Instant::now() + DEADLINE;
            loop {
                let request = v1::QueryRequest {
                    store: "counts".into(),
                    query: Some(v1::query_request::Query::Range(v1::RangeQuery::default())),
                    ..Default::default()
                };
                let response = settled("range Query over TLS", || client.query(request.clone())).await;
                assert!(response.next_page_token.is_empty(), "one page");
                let mut partitions: Vec<u32> = response.results.iter().map(|r| r.partition).collect();
                partitions.dedup();
                assert_eq!(partitions, (0..6).collect::<Vec<_>>(), "every partition answered");
                for result in &response.results {
                    assert_eq!(
                        host_of(result.host.as_ref()),
                        owners[&result.partition],
                        "partition {} answered by its owner",
                        result.partition
                    );
                }
                let counts: BTreeMap<String, u64> = response
                    .results
                    .iter()
                    .flat_map(|r| &r.entries)
                    .map(|entry| {
                        let count = String::from_utf8_lossy(&entry.value).parse().expect("a count");
                        (String::from_utf8_lossy(&entry.key).into_owned(), count)
                    })
                    .collect();
                if counts == expected {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the range on instance {i} did not reach the produced counts: {counts:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }

        // Each key asked of the instance that does not hold it: forwarded to its owner.
        let mut forwarded_from = [0usize; 2];
        for key in &keys {
            let metadata = settled("MetadataForKey", || {
                clients[0].metadata_for_key("counts", key.clone())
            })
            .await;
            let owner = host_of(metadata.active_host.as_ref());
            let owner_index = addresses
                .iter()
                .position(|a| *a == owner)
                .expect("a listed instance");
            let other = 1 - owner_index;
            let request = v1::QueryRequest {
                store: "counts".into(),
                query: Some(v1::query_request::Query::Key(v1::KeyQuery {
                    key: key.clone().into(),
                })),
                ..Default::default()
            };
            let answer = settled("forwarded Query over TLS", || {
                clients[other].query(request.clone())
            })
            .await;
            assert_eq!(answer.results.len(), 1);
            assert_eq!(
                host_of(answer.results[0].host.as_ref()),
                owner,
                "{key} answered by its owner"
            );
            assert_eq!(answer.results[0].entries[0].value, expected[key].to_string());
            forwarded_from[other] += 1;
        }
        assert!(
            forwarded_from.iter().all(|&n| n > 0),
            "both instances forwarded some key: {forwarded_from:?}"
        );
    });
}
