//! Every bound on what a client controls, hit once end to end (real server on port 0, the
//! Rust client): each answers RESOURCE_EXHAUSTED with ErrorInfo reason LIMIT_EXCEEDED naming
//! its setting (the client's `LimitExceeded`), or pages the answer (ReadTopic, range Query),
//! or cuts what outcome history keeps (long keys). Limits are set small so that hitting them
//! costs little.

use std::time::Duration;
use taskstream::v1;
use taskstream_client::{ClientError, MetadataOptions, StreamsClient, keyed_record};
use taskstream_server::{Config, PipelineConfig, ProcessorSpec, StreamsApp, TopicConfig};
use tokio::sync::oneshot;
use tokio_stream::StreamExt as _;

const WAIT: Duration = Duration::from_secs(60);

/// Topic `events` (2 partitions) into `latest` (the last value per key), with small limits.
fn config() -> Config {
    Config {
        application_id: "limits".into(),
        num_stream_threads: 2,
        commit_interval_ms: 50,
        topics: vec![TopicConfig::new("events", 2)],
        pipelines: vec![PipelineConfig::new("latest", "events", ProcessorSpec::Latest)],
        max_message_bytes: 1 << 20,
        max_key_bytes: 1024,
        max_value_bytes: 64 << 10,
        max_header_bytes: 1024,
        max_records_per_produce: 100,
        max_produce_stream_bytes: 256 << 10,
        max_response_bytes: 16 << 10,
        max_stream_threads: 3,
        max_concurrent_streams: 4,
        max_subscribers: 2,
        outcome_key_bytes: 32,
        ..Config::default()
    }
}

struct Server {
    app: StreamsApp,
    addr: String,
    client: StreamsClient,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), taskstream_server::service::ServeError>>,
}

impl Server {
    async fn start() -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut config = config();
        config.application_server = addr.to_string();
        let app = StreamsApp::start(config).unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(taskstream_server::service::serve(app.clone(), listener, async {
            let _ = stopped.await;
        }));
        let addr = format!("http://{addr}");
        let client = StreamsClient::connect(&addr).await.unwrap();
        Server {
            app,
            addr,
            client,
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("server stopped in time")
            .unwrap()
            .unwrap();
    }

    async fn caught_up(&self) {
        let app = self.app.clone();
        let done = tokio::task::spawn_blocking(move || app.wait_until_caught_up(WAIT))
            .await
            .unwrap();
        assert!(done, "processing caught up");
    }
}

/// The setting a call's `LimitExceeded` names.
fn limit_of<T: std::fmt::Debug>(result: Result<T, ClientError>) -> String {
    match result.expect_err("the call should be over a limit") {
        ClientError::LimitExceeded {
            setting: Some(setting),
            limit: Some(_),
            ..
        } => setting,
        other => panic!("expected LimitExceeded naming its setting, got {other:?}"),
    }
}

fn record_with(key: usize, value: usize, header: usize) -> v1::ProducerRecord {
    let mut record = keyed_record(vec![b'k'; key], vec![b'v'; value]);
    if header > 0 {
        record.headers.insert("h".into(), vec![b'h'; header - 1].into());
    }
    record
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn produce_limits_refuse_the_request_and_write_nothing() {
    let server = Server::start().await;
    let client = &server.client;
    let cases = [
        (vec![record_with(1, 600 << 10, 0); 2], "max_message_bytes"),
        (vec![record_with(1025, 1, 0)], "max_key_bytes"),
        (vec![record_with(1, (64 << 10) + 1, 0)], "max_value_bytes"),
        (vec![record_with(1, 1, 1025)], "max_header_bytes"),
        (vec![record_with(1, 1, 0); 101], "max_records_per_produce"),
    ];
    for (records, setting) in cases {
        assert_eq!(limit_of(client.produce("events", records).await), setting);
    }
    // At the limits exactly, accepted.
    let accepted = client
        .produce("events", vec![record_with(1024, 64 << 10, 1024); 2])
        .await
        .unwrap();
    assert_eq!(accepted.record_count, 2);
    // Nothing of the refused requests was written.
    assert_eq!(events_end_offsets(&server), 2);
    server.stop().await;
}

/// Records in both partitions of `events`, read back from the log itself.
fn events_end_offsets(server: &Server) -> u64 {
    (0..2)
        .map(|p| server.app.read_topic("events", p, 0, 1).unwrap().end_offset)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn produce_stream_on_the_embedded_log_is_all_or_nothing() {
    let server = Server::start().await;
    let client = &server.client;
    let batch = |n: usize| {
        (0..n)
            .map(|i| keyed_record(format!("k{i}"), vec![b'v'; 1000]))
            .collect::<Vec<_>>()
    };

    // Batch 3 of 4 holds a key over max_key_bytes: the call fails and batches 1-2 stay unwritten.
    let mut third = batch(10);
    third[5] = record_with(1025, 1, 0);
    let batches = vec![batch(50), batch(50), third, batch(50)];
    let refused = client.produce_stream("events", tokio_stream::iter(batches)).await;
    assert_eq!(limit_of(refused), "max_key_bytes");
    assert_eq!(
        events_end_offsets(&server),
        0,
        "nothing of the refused stream was written"
    );

    // 300 records of ~1 KB pass max_produce_stream_bytes (256 KiB): refused, nothing written.
    let over = vec![batch(100), batch(100), batch(100)];
    let refused = client.produce_stream("events", tokio_stream::iter(over)).await;
    assert_eq!(limit_of(refused), "max_produce_stream_bytes");
    assert_eq!(
        events_end_offsets(&server),
        0,
        "nothing of the over-long stream was written"
    );

    // A stream within the bound is written whole, in one append.
    let fits = vec![batch(100), batch(100)];
    let written = client
        .produce_stream("events", tokio_stream::iter(fits))
        .await
        .unwrap();
    assert_eq!(written.record_count, 200);
    let counted: u64 = written.partitions.iter().map(|r| r.count).sum();
    assert_eq!(counted, 200);
    assert_eq!(events_end_offsets(&server), 200);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_topic_and_range_query_answer_in_pages_of_max_response_bytes() {
    let server = Server::start().await;
    let client = &server.client;
    // 40 keys of 4 KiB values, all in partition 0: 160 KiB, ten pages of 16 KiB.
    let records: Vec<v1::ProducerRecord> = (0..40)
        .map(|i| {
            let mut record = keyed_record(format!("key-{i:02}"), vec![b'v'; 4096]);
            record.partition = Some(0);
            record
        })
        .collect();
    client.produce("events", records).await.unwrap();
    server.caught_up().await;

    let mut offset = 0;
    let mut pages = 0;
    loop {
        let read = client.read_topic("events", 0, offset, 1000).await.unwrap();
        if read.records.is_empty() {
            break;
        }
        let bytes: usize = read
            .records
            .iter()
            .map(|r| r.value.len() + r.key.as_ref().map_or(0, |k| k.len()))
            .sum();
        assert!(bytes <= 16 << 10, "a ReadTopic page of {bytes} bytes");
        pages += 1;
        offset = read.records.last().unwrap().offset + 1;
    }
    assert_eq!(offset, 40);
    assert!(pages >= 10, "{pages} pages");

    // A range query pages too, and the client's `range` follows the pages to the end.
    let first = client
        .query(v1::QueryRequest {
            store: "latest".into(),
            query: Some(v1::query_request::Query::Range(v1::RangeQuery::default())),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        !first.next_page_token.is_empty(),
        "the first page says there is more"
    );
    let entries: usize = first.results.iter().map(|r| r.entries.len()).sum();
    assert!((1..40).contains(&entries), "{entries} entries in the first page");
    let all = client.range("latest", None, None).await.unwrap();
    let keys: Vec<String> = all
        .iter()
        .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
        .collect();
    let expected: Vec<String> = (0..40).map(|i| format!("key-{i:02}")).collect();
    assert_eq!(keys, expected);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_threads_and_subscribers_are_bounded() {
    let server = Server::start().await;
    let client = &server.client;
    client.add_stream_thread().await.unwrap();
    assert_eq!(limit_of(client.add_stream_thread().await), "max_stream_threads");
    assert_eq!(client.describe_runtime().await.unwrap().num_stream_threads, 3);

    let open = || v1::GetMetadataAsyncRequest {
        store: "latest".into(),
        ..Default::default()
    };
    // Two open-ended streams take both places; a third is refused.
    let mut streams = client.streams();
    let first = streams.get_metadata_async(open()).await.unwrap();
    let _second = streams.get_metadata_async(open()).await.unwrap();
    let refused = streams
        .get_metadata_async(open())
        .await
        .map_err(ClientError::from);
    assert_eq!(limit_of(refused), "max_subscribers");
    // A closed stream gives its place back (its pump notices the client left).
    drop(first);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match streams.get_metadata_async(open()).await {
            Ok(_third) => break,
            Err(status) if tokio::time::Instant::now() < deadline => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                tokio::task::yield_now().await;
            }
            Err(status) => panic!("the place never came back: {status:?}"),
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_per_connection_are_bounded() {
    let server = Server::start().await;
    // One connection: max_concurrent_streams = 4 calls in flight on it at once. Health
    // `Watch` calls stay open until cancelled and are not subscribers.
    let channel = tonic::transport::Endpoint::from_shared(server.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let watch = || tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    };
    let mut open = Vec::new();
    for _ in 0..4 {
        let mut stream = health.watch(watch()).await.unwrap().into_inner();
        stream.next().await.unwrap().unwrap();
        open.push(stream);
    }
    // A fifth call on the same connection waits for a free stream...
    let mut fifth_client = health.clone();
    let mut fifth = tokio::spawn(async move { fifth_client.watch(watch()).await.map(|_| ()) });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut fifth)
            .await
            .is_err(),
        "a fifth concurrent call went through"
    );
    // ...while another connection is served...
    let other = StreamsClient::connect(&server.addr).await.unwrap();
    other.describe_runtime().await.unwrap();
    // ...and it goes through once one of the four ends.
    drop(open.pop());
    tokio::time::timeout(WAIT, fifth).await.unwrap().unwrap().unwrap();
    drop(open);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_history_keeps_long_keys_cut_and_hashed() {
    let server = Server::start().await;
    let client = &server.client;
    let long_a = format!("{}a", "x".repeat(1000));
    let long_b = format!("{}b", "x".repeat(1000));
    let mut records = vec![
        keyed_record(long_a.clone(), "1"),
        keyed_record(long_b, "2"),
        keyed_record("short", "3"),
    ];
    for record in &mut records {
        record.partition = Some(1);
    }
    client.produce("events", records).await.unwrap();
    server.caught_up().await;

    let batches = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = batches.clone();
    let handle = client.get_metadata_async(
        "latest",
        MetadataOptions::bounded().coalesce(true).in_order(true),
        move |result: Result<taskstream_client::MetadataBatch, ClientError>| {
            seen.lock().unwrap().push(result.expect("the stream completes"));
        },
    );
    tokio::time::timeout(WAIT, handle.join()).await.unwrap();
    let records: Vec<_> = batches
        .lock()
        .unwrap()
        .iter()
        .flat_map(|batch: &taskstream_client::MetadataBatch| batch.records.clone())
        .collect();
    assert_eq!(records.len(), 3);
    let keys: Vec<(usize, bool)> = records
        .iter()
        .map(|r| (r.key.as_ref().map_or(0, |k| k.len()), r.key_truncated))
        .collect();
    assert_eq!(keys, vec![(32, true), (32, true), (5, false)]);
    assert_ne!(records[0].key, records[1].key, "the hash keeps long keys apart");
    assert_eq!(&records[0].key.as_ref().unwrap()[..24], &long_a.as_bytes()[..24]);
    server.stop().await;
}
