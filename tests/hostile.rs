//! Hostile input (issue 15): proptest sends random instances of every request message of
//! StreamsService and AdminService, and raw bytes that are not protobuf, to a real server on
//! port 0 over the generated tonic clients. Every answer must be a documented status code
//! (never INTERNAL or UNKNOWN) with a short message that leaks no Rust type path; afterwards
//! the server must still serve and count exactly the records it acknowledged.
//! `TASKSTREAM_HOSTILE_CASES` sets the number of proptest cases (default 512, about 5,000 requests).

mod common;

use bytes::{Buf as _, BufMut as _, Bytes};
use common::auth::{Bearer, TOKENS};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use taskstream::v1;
use taskstream::v1::admin_service_client::AdminServiceClient;
use taskstream::v1::streams_service_client::StreamsServiceClient;
use taskstream_server::{Config, PipelineConfig, ProcessorSpec, StreamsApp, TopicConfig};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::oneshot;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Code, Status};

const WAIT: Duration = Duration::from_secs(60);
/// How long one answer may take; a stream that is still open after this is dropped.
const CALL: Duration = Duration::from_secs(10);
/// A stream that sends nothing for this long is open and healthy: dropped.
const QUIET: Duration = Duration::from_millis(50);
/// The longest status message accepted.
const MAX_MESSAGE: usize = 1536;

/// Topic `events` (2 partitions) counted by `counts`, plus a topic no pipeline reads; small
/// limits so that large inputs are cheap; tokens, so that the internal topics are closed to
/// the `write` role the Produce calls use (an admin's records there would be processed).
fn config(tokens: &std::path::Path) -> Config {
    Config {
        application_id: "hostile".into(),
        num_stream_threads: 2,
        commit_interval_ms: 50,
        topics: vec![TopicConfig::new("events", 2), TopicConfig::new("other", 1)],
        pipelines: vec![PipelineConfig::new("counts", "events", ProcessorSpec::Count)],
        max_message_bytes: 128 << 10,
        max_key_bytes: 1024,
        max_value_bytes: 16 << 10,
        max_header_bytes: 1024,
        max_records_per_produce: 16,
        max_produce_stream_bytes: 64 << 10,
        max_response_bytes: 16 << 10,
        max_stream_threads: 3,
        max_concurrent_streams: 16,
        max_subscribers: 4,
        outcome_key_bytes: 32,
        auth_tokens: Some(tokens.to_path_buf()),
        ..Config::default()
    }
}

struct Server {
    app: StreamsApp,
    addr: std::net::SocketAddr,
    channel: Channel,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), taskstream_server::service::ServeError>>,
    _dir: taskstream_server::scratch::TempDir,
}

impl Server {
    async fn start() -> Server {
        let dir = taskstream_server::scratch::scratch_dir("hostile-tokens").unwrap();
        let tokens = dir.path().join("tokens");
        std::fs::write(&tokens, TOKENS).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut config = config(&tokens);
        config.application_server = addr.to_string();
        let app = StreamsApp::start(config).unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(taskstream_server::service::serve(app.clone(), listener, async {
            let _ = stopped.await;
        }));
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Server {
            app,
            addr,
            channel,
            stop: Some(stop),
            task,
            _dir: dir,
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
}

/// Sends and receives message bodies as they are, so that bytes which are not protobuf
/// reach the server's decoder.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

const METHODS: [&str; 12] = [
    "/taskstream.v1.StreamsService/ProcessMetadataForStore",
    "/taskstream.v1.StreamsService/GetMetadataAsync",
    "/taskstream.v1.StreamsService/MetadataForKey",
    "/taskstream.v1.StreamsService/Query",
    "/taskstream.v1.StreamsService/Produce",
    "/taskstream.v1.StreamsService/ProduceStream",
    "/taskstream.v1.StreamsService/ReadTopic",
    "/taskstream.v1.AdminService/DescribeRuntime",
    "/taskstream.v1.AdminService/AddStreamThread",
    "/taskstream.v1.AdminService/RemoveStreamThread",
    "/taskstream.v1.AdminService/RedriveDeadLetters",
    "/taskstream.v1.StreamsService/NoSuchMethod",
];

/// One hostile call.
#[derive(Debug, Clone)]
enum Call {
    ProcessMetadataForStore(v1::ProcessMetadataForStoreRequest),
    GetMetadataAsync(v1::GetMetadataAsyncRequest),
    MetadataForKey(v1::MetadataForKeyRequest),
    Query(v1::QueryRequest),
    Produce(v1::ProduceRequest),
    ProduceStream(Vec<v1::ProduceRequest>),
    ReadTopic(v1::ReadTopicRequest),
    DescribeRuntime,
    AddStreamThread,
    RemoveStreamThread(v1::RemoveStreamThreadRequest),
    RedriveDeadLetters(v1::RedriveDeadLettersRequest),
    /// Bytes as the message body of method `METHODS[.0]` with token `.1`, in `.3` messages.
    Raw(usize, Option<&'static str>, Vec<u8>, usize),
    /// Bytes straight onto a fresh TCP connection (not HTTP/2 at all, or a bad preface).
    Tcp(Vec<u8>),
}

/// The token of a raw call: none, unknown, or one of each role.
fn token() -> impl Strategy<Value = Option<&'static str>> {
    prop::sample::select(vec![
        None,
        Some("nobody"),
        Some("reader-token"),
        Some("writer-token"),
        Some("admin-token"),
    ])
}

/// Names: known ones, empty, unicode, and up to ~64 KiB. Without ':' so that a name the
/// server echoes cannot look like a Rust type path.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "events",
            "counts",
            "other",
            "hostile-counts-retry",
            "hostile-counts-dlq",
            "",
        ])
        .prop_map(String::from),
        3 => "\\PC{0,40}",
        1 => (0usize..70_000, "\\PC").prop_map(|(n, c)| c.repeat(n / c.len().max(1))),
    ]
    .prop_map(|s| s.replace(':', ";").replace("prost", "pr0st"))
}

fn bytes() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        2 => Just(Bytes::new()),
        4 => prop::collection::vec(any::<u8>(), 0..48).prop_map(Bytes::from),
        1 => (0usize..70_000, any::<u8>()).prop_map(|(n, b)| Bytes::from(vec![b; n])),
    ]
}

fn key() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        4 => prop::collection::vec(any::<u8>(), 1..48).prop_map(Bytes::from),
        1 => (1usize..2048, any::<u8>()).prop_map(|(n, b)| Bytes::from(vec![b; n])),
    ]
}

fn u32s() -> impl Strategy<Value = u32> {
    prop_oneof![3 => 0u32..4, 1 => any::<u32>(), 1 => Just(u32::MAX)]
}

fn i64s() -> impl Strategy<Value = i64> {
    prop_oneof![
        3 => -2i64..20,
        1 => any::<i64>(),
        1 => prop::sample::select(vec![i64::MIN, i64::MAX, -1]),
    ]
}

/// Enum values are i32 on the wire: known ones and arbitrary.
fn enums() -> impl Strategy<Value = i32> {
    prop_oneof![3 => 0i32..4, 1 => any::<i32>()]
}

fn partitions() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(u32s(), 0..4)
}

fn offsets() -> impl Strategy<Value = HashMap<u32, i64>> {
    prop::collection::hash_map(u32s(), i64s(), 0..4)
}

/// Mostly plain records, so that many Produce calls are acknowledged and counted; some
/// hostile ones, any of which makes its whole call refused.
fn record() -> impl Strategy<Value = v1::ProducerRecord> {
    let plain = (
        prop::option::weighted(0.8, prop::collection::vec(any::<u8>(), 1..16)),
        prop::collection::vec(any::<u8>(), 0..32),
        prop::option::weighted(0.2, 0u32..2),
        i64s(),
    )
        .prop_map(|(key, value, partition, timestamp_ms)| v1::ProducerRecord {
            key: key.map(Bytes::from),
            value: Bytes::from(value),
            partition,
            timestamp_ms,
            headers: HashMap::new(),
        });
    prop_oneof![12 => plain, 1 => hostile_record()]
}

fn hostile_record() -> impl Strategy<Value = v1::ProducerRecord> {
    let header = prop_oneof![
        3 => name(),
        1 => prop::sample::select(vec!["taskstream.attempt", "__streams.x", "Taskstream.y"])
            .prop_map(String::from),
    ];
    (
        prop::option::of(key()),
        bytes(),
        prop::option::weighted(0.3, u32s()),
        i64s(),
        prop::collection::hash_map(header, bytes(), 0..3),
    )
        .prop_map(
            |(key, value, partition, timestamp_ms, headers)| v1::ProducerRecord {
                key,
                value,
                partition,
                timestamp_ms,
                headers,
            },
        )
}

fn produce() -> impl Strategy<Value = v1::ProduceRequest> {
    let topic = prop_oneof![4 => Just("events".to_string()), 1 => name()];
    (topic, prop::collection::vec(record(), 0..18))
        .prop_map(|(topic, records)| v1::ProduceRequest { topic, records })
}

fn query() -> impl Strategy<Value = v1::QueryRequest> {
    let kind = prop_oneof![
        1 => Just(None),
        2 => bytes().prop_map(|key| Some(v1::query_request::Query::Key(v1::KeyQuery { key }))),
        2 => (prop::option::of(bytes()), prop::option::of(bytes())).prop_map(|(from, to)| {
            Some(v1::query_request::Query::Range(v1::RangeQuery { from, to }))
        }),
    ];
    (name(), kind, partitions(), u32s(), bytes(), any::<bool>()).prop_map(
        |(store, query, partitions, limit, page_token, local_only)| v1::QueryRequest {
            store,
            query,
            partitions,
            limit,
            page_token,
            local_only,
        },
    )
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        1 => (name(), any::<bool>()).prop_map(|(store, in_order)| {
            Call::ProcessMetadataForStore(v1::ProcessMetadataForStoreRequest { store, in_order })
        }),
        1 => (
            name(),
            any::<bool>(),
            (enums(), offsets()),
            (enums(), offsets()),
            u32s(),
            partitions()
        )
            .prop_map(
                |(store, in_order, (start, start_offsets), (end, end_offsets), max_batch_records, partitions)| {
                    Call::GetMetadataAsync(v1::GetMetadataAsyncRequest {
                        store,
                        in_order,
                        start,
                        start_offsets,
                        end,
                        end_offsets,
                        max_batch_records,
                        partitions,
                    })
                }
            ),
        1 => (name(), bytes())
            .prop_map(|(store, key)| Call::MetadataForKey(v1::MetadataForKeyRequest { store, key })),
        1 => query().prop_map(Call::Query),
        3 => produce().prop_map(Call::Produce),
        1 => prop::collection::vec(produce(), 0..4).prop_map(Call::ProduceStream),
        1 => (name(), u32s(), i64s(), u32s()).prop_map(|(topic, partition, offset, max_records)| {
            Call::ReadTopic(v1::ReadTopicRequest {
                topic,
                partition,
                offset,
                max_records,
            })
        }),
        1 => Just(Call::DescribeRuntime),
        1 => Just(Call::AddStreamThread),
        1 => prop_oneof![
            name(),
            (0u32..6).prop_map(|i| format!("hostile-StreamThread-{i}"))
        ]
        .prop_map(|thread_name| Call::RemoveStreamThread(v1::RemoveStreamThreadRequest { thread_name })),
        1 => (name(), u32s(), prop::collection::vec(i64s(), 0..4), any::<bool>()).prop_map(
            |(pipeline, partition, offsets, all)| {
                Call::RedriveDeadLetters(v1::RedriveDeadLettersRequest {
                    pipeline,
                    partition,
                    offsets,
                    all,
                })
            }
        ),
        2 => (
            (0..METHODS.len(), token()),
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..64),
                // Field 1 as a varint where strings are: a bad wire type for most messages.
                Just(vec![0x08, 0x96, 0x01]),
                // A length-delimited field 1 cut short.
                Just(vec![0x0a, 0x10, b'a']),
                // A string that is not UTF-8.
                Just(vec![0x0a, 0x02, 0xff, 0xfe]),
                // A nested record (Produce) whose key is a varint.
                Just(vec![0x12, 0x02, 0x08, 0x01]),
            ],
            0usize..3
        )
            .prop_map(|((m, t), body, n)| Call::Raw(m, t, body, n)),
        1 => prop::collection::vec(any::<u8>(), 0..256).prop_map(Call::Tcp),
    ]
}

/// Checks one answer; `Ok(())` if it is acceptable.
fn check(what: &str, status: &Status) -> Result<(), TestCaseError> {
    let allowed = [
        Code::InvalidArgument,
        Code::NotFound,
        Code::OutOfRange,
        Code::FailedPrecondition,
        Code::ResourceExhausted,
        Code::PermissionDenied,
        Code::Unauthenticated,
        Code::Unavailable,
    ];
    let message = status.message();
    prop_assert!(
        allowed.contains(&status.code()),
        "{what}: undocumented status {:?}: {:.300}",
        status.code(),
        message
    );
    prop_assert!(
        message.len() <= MAX_MESSAGE,
        "{what}: message of {} bytes: {:.300}…",
        message.len(),
        message
    );
    prop_assert!(
        !message.contains("::") && !message.to_lowercase().contains("prost"),
        "{what}: message leaks internals: {:.300}",
        message
    );
    Ok(())
}

fn checked<T>(what: &str, result: Result<T, Status>) -> Result<Option<T>, TestCaseError> {
    match result {
        Ok(answer) => Ok(Some(answer)),
        Err(status) => check(what, &status).map(|()| None),
    }
}

/// Reads a response stream until it ends, fails or goes quiet; checks any error.
async fn drain<T>(what: &str, stream: &mut tonic::Streaming<T>) -> Result<(), TestCaseError> {
    loop {
        match tokio::time::timeout(QUIET, stream.message()).await {
            Err(_) | Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(_))) => {}
            Ok(Err(status)) => return check(what, &status),
        }
    }
}

/// Keyed records of an acknowledged Produce to `events`: what `counts` must count.
fn counted(request: &v1::ProduceRequest) -> u64 {
    if request.topic != "events" {
        return 0;
    }
    request.records.iter().filter(|r| r.key.is_some()).count() as u64
}

async fn send(
    server: &Server,
    call: Call,
    acknowledged: &AtomicU64,
    requests: &AtomicU64,
) -> Result<(), TestCaseError> {
    requests.fetch_add(1, Ordering::Relaxed);
    let channel = server.channel.clone();
    let mut streams = StreamsServiceClient::with_interceptor(channel.clone(), Bearer(Some("writer-token")))
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    let mut admin = AdminServiceClient::with_interceptor(channel, Bearer(Some("admin-token")));
    let what: String = format!("{call:?}").chars().take(300).collect();
    let what = &what;
    match call {
        Call::ProcessMetadataForStore(r) => {
            checked(what, within(streams.process_metadata_for_store(r)).await?)?;
        }
        Call::GetMetadataAsync(r) => {
            if let Some(answer) = checked(what, within(streams.get_metadata_async(r)).await?)? {
                drain(what, &mut answer.into_inner()).await?;
            }
        }
        Call::MetadataForKey(r) => {
            checked(what, within(streams.metadata_for_key(r)).await?)?;
        }
        Call::Query(r) => {
            checked(what, within(streams.query(r)).await?)?;
        }
        Call::Produce(r) => {
            let count = counted(&r);
            if let Some(answer) = checked(what, within(streams.produce(r.clone())).await?)? {
                prop_assert_eq!(answer.into_inner().record_count, r.records.len() as u64);
                acknowledged.fetch_add(count, Ordering::SeqCst);
            }
        }
        Call::ProduceStream(batches) => {
            // On the embedded log the call writes all its batches or none.
            let count: u64 = batches.iter().map(counted).sum();
            let total: usize = batches.iter().map(|b| b.records.len()).sum();
            let stream = tokio_stream::iter(batches);
            if let Some(answer) = checked(what, within(streams.produce_stream(stream)).await?)? {
                prop_assert_eq!(answer.into_inner().record_count, total as u64);
                acknowledged.fetch_add(count, Ordering::SeqCst);
            }
        }
        Call::ReadTopic(r) => {
            checked(what, within(streams.read_topic(r)).await?)?;
        }
        Call::DescribeRuntime => {
            checked(
                what,
                within(admin.describe_runtime(v1::DescribeRuntimeRequest {})).await?,
            )?;
        }
        Call::AddStreamThread => {
            checked(
                what,
                within(admin.add_stream_thread(v1::AddStreamThreadRequest {})).await?,
            )?;
        }
        Call::RemoveStreamThread(r) => {
            checked(what, within(admin.remove_stream_thread(r)).await?)?;
        }
        Call::RedriveDeadLetters(r) => {
            checked(what, within(admin.redrive_dead_letters(r)).await?)?;
        }
        Call::Raw(method, token, body, copies) => {
            let channel =
                tonic::service::interceptor::InterceptedService::new(server.channel.clone(), Bearer(token));
            let mut grpc = tonic::client::Grpc::new(channel);
            within(grpc.ready())
                .await?
                .map_err(|e| TestCaseError::fail(format!("channel not ready: {e}")))?;
            let path = METHODS[method].parse().unwrap();
            let body = Bytes::from(body);
            let messages = tokio_stream::iter(std::iter::repeat_n(body, copies));
            let answer = within(grpc.streaming(tonic::Request::new(messages), path, RawCodec)).await?;
            // A method the services do not have, with a known token: UNIMPLEMENTED, as gRPC says.
            if method == METHODS.len() - 1 && token.is_some_and(|t| t != "nobody") {
                let code = answer.as_ref().err().map(Status::code);
                prop_assert_eq!(code, Some(Code::Unimplemented));
                return Ok(());
            }
            if let Some(answer) = checked(what, answer)? {
                drain(what, &mut answer.into_inner()).await?;
            }
        }
        Call::Tcp(bytes) => {
            // Whatever the server answers (an HTTP/2 GOAWAY, nothing), it must close or
            // keep serving; the health and counting checks after the run tell which.
            let mut tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
            let _ = tcp.write_all(&bytes).await;
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(QUIET, tcp.read_to_end(&mut answer)).await;
        }
    }
    Ok(())
}

/// `f`, or a test failure if it takes longer than `CALL`.
async fn within<F: std::future::Future>(f: F) -> Result<F::Output, TestCaseError> {
    tokio::time::timeout(CALL, f)
        .await
        .map_err(|_| TestCaseError::fail(format!("no answer in {CALL:?}")))
}

fn cases() -> u32 {
    std::env::var("TASKSTREAM_HOSTILE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

#[test]
fn hostile_requests_get_documented_codes_and_the_server_keeps_counting() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt.block_on(Server::start());
    let acknowledged = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));

    let mut runner = TestRunner::new(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = prop::collection::vec(call(), 6..14);
    let result = runner.run(&strategy, |calls| {
        rt.block_on(async {
            for call in calls {
                send(&server, call, &acknowledged, &requests).await?;
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let sent = requests.load(Ordering::Relaxed);
    eprintln!(
        "hostile: {sent} requests, {} keyed records of `events` acknowledged",
        acknowledged.load(Ordering::SeqCst)
    );

    rt.block_on(async {
        // Alive: health says SERVING.
        let mut health = tonic_health::pb::health_client::HealthClient::with_interceptor(
            server.channel.clone(),
            Bearer(Some("reader-token")),
        );
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("health answers after the hostile run")
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        // And processing: K more records, each counted once.
        let k = 16u64;
        let records = (0..k)
            .map(|i| v1::ProducerRecord {
                key: Some(Bytes::from(format!("after-{i}"))),
                value: Bytes::from_static(b"v"),
                ..Default::default()
            })
            .collect();
        let answer =
            StreamsServiceClient::with_interceptor(server.channel.clone(), Bearer(Some("writer-token")))
                .produce(v1::ProduceRequest {
                    topic: "events".into(),
                    records,
                })
                .await
                .expect("a plain produce after the hostile run")
                .into_inner();
        assert_eq!(answer.record_count, k);
        acknowledged.fetch_add(k, Ordering::SeqCst);
    });

    let app = server.app.clone();
    assert!(app.wait_until_caught_up(WAIT), "processing caught up");
    let total: i64 = app
        .query_range("counts", None, None, &[], usize::MAX)
        .expect("query the count store")
        .iter()
        .flat_map(|p| p.entries.iter())
        .map(|(_, v)| std::str::from_utf8(v).unwrap().parse::<i64>().unwrap())
        .sum();
    assert_eq!(
        total as u64,
        acknowledged.load(Ordering::SeqCst),
        "the count store counts every acknowledged keyed record of `events` once"
    );
    rt.block_on(server.stop());
}
