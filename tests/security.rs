//! Bearer tokens with roles, internal topics and dead-letter redrive, end to end: a real
//! server on port 0 with an `auth_tokens` file, called through the generated clients with
//! an `authorization: Bearer …` header. Per RPC group: no token → UNAUTHENTICATED, a role
//! too low → PERMISSION_DENIED naming the role needed, the right role → served; health is
//! open. Produce into a retry topic and a forged runtime header are refused; an admin
//! redrives dead letters and they are processed again.

mod common;

use bytes::Bytes;
use common::auth::{Bearer, TOKENS};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use taskstream::v1;
use taskstream::v1::admin_service_client::AdminServiceClient;
use taskstream::v1::streams_service_client::StreamsServiceClient;
use taskstream_server::{
    Config, PipelineConfig, ProcessError, ProcessorSpec, RetryPolicy, StreamsApp, TopicConfig,
};
use tokio::sync::oneshot;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Status};

const WAIT: Duration = Duration::from_secs(60);
struct Server {
    app: StreamsApp,
    channel: Channel,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), taskstream_server::service::ServeError>>,
    /// Whether the `flaky` processor fails; and the keys it processed.
    failing: Arc<AtomicBool>,
    processed: Arc<Mutex<Vec<Bytes>>>,
    _dir: taskstream_server::scratch::TempDir,
}

impl Server {
    async fn start() -> Server {
        let dir = taskstream_server::scratch::scratch_dir("security-tokens").unwrap();
        let tokens = dir.path().join("tokens");
        std::fs::write(&tokens, TOKENS).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let config = Config {
            application_id: "sec".into(),
            application_server: addr.to_string(),
            num_stream_threads: 2,
            commit_interval_ms: 50,
            retry_max_attempts: 1,
            retry_policy: RetryPolicy::RetryTopic,
            topics: vec![TopicConfig::new("events", 2)],
            pipelines: vec![PipelineConfig::new(
                "flaky",
                "events",
                ProcessorSpec::Custom { name: "flaky".into() },
            )],
            auth_tokens: Some(tokens),
            ..Config::default()
        };
        let failing = Arc::new(AtomicBool::new(true));
        let processed = Arc::new(Mutex::new(Vec::new()));
        let (fail, seen) = (failing.clone(), processed.clone());
        let flaky = move |record: &taskstream_server::Record, _: &taskstream_server::ProcessorContext<'_>| {
            if fail.load(Ordering::SeqCst) {
                return Err(ProcessError::new("Flaky", "failing on purpose"));
            }
            seen.lock().unwrap().push(record.key.clone().unwrap_or_default());
            Ok(())
        };
        let app = StreamsApp::builder(config)
            .processor("flaky", Arc::new(flaky))
            .start()
            .unwrap();
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
            channel,
            stop: Some(stop),
            task,
            failing,
            processed,
            _dir: dir,
        }
    }

    fn streams(
        &self,
        token: Option<&'static str>,
    ) -> StreamsServiceClient<InterceptedService<Channel, Bearer>> {
        StreamsServiceClient::with_interceptor(self.channel.clone(), Bearer(token))
    }

    fn admin(&self, token: Option<&'static str>) -> AdminServiceClient<InterceptedService<Channel, Bearer>> {
        AdminServiceClient::with_interceptor(self.channel.clone(), Bearer(token))
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

    /// Polls the end offset of `topic`'s `partition` until it is at least `end`.
    async fn wait_for_end(&self, topic: &str, partition: u32, end: u64) {
        let deadline = Instant::now() + WAIT;
        loop {
            let now = self.app.read_topic(topic, partition, 0, 1).unwrap().end_offset;
            if now >= end {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{topic}/{partition} stayed at {now}, below {end}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The code of a call's status, and its message.
fn refused<T: std::fmt::Debug>(result: Result<T, Status>) -> (Code, String) {
    let status = result.expect_err("the call should be refused");
    (status.code(), status.message().to_string())
}

fn produce(topic: &str, records: Vec<v1::ProducerRecord>) -> v1::ProduceRequest {
    v1::ProduceRequest {
        topic: topic.into(),
        records,
    }
}

fn keyed(key: &str, partition: u32) -> v1::ProducerRecord {
    v1::ProducerRecord {
        key: Some(Bytes::from(key.to_string())),
        value: Bytes::from_static(b"1"),
        partition: Some(partition),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_group_needs_its_role_and_health_is_open() {
    let server = Server::start().await;
    let query = || v1::ProcessMetadataForStoreRequest {
        store: "flaky".into(),
        in_order: false,
    };

    // No token, or one the server does not know: UNAUTHENTICATED, whatever the RPC.
    for token in [None, Some("not-a-token")] {
        let (code, _) = refused(server.streams(token).process_metadata_for_store(query()).await);
        assert_eq!(code, Code::Unauthenticated, "{token:?}");
        let (code, _) = refused(
            server
                .streams(token)
                .produce(produce("events", vec![keyed("a", 0)]))
                .await,
        );
        assert_eq!(code, Code::Unauthenticated);
        let (code, _) = refused(
            server
                .admin(token)
                .add_stream_thread(v1::AddStreamThreadRequest {})
                .await,
        );
        assert_eq!(code, Code::Unauthenticated);
    }
    // Health is open.
    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel.clone());
    let answer = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // Read: every role.
    for token in ["reader-token", "writer-token", "admin-token"] {
        server
            .streams(Some(token))
            .process_metadata_for_store(query())
            .await
            .unwrap();
        server
            .admin(Some(token))
            .describe_runtime(v1::DescribeRuntimeRequest {})
            .await
            .unwrap();
    }
    // Write: not the reader, named in the answer.
    let (code, message) = refused(
        server
            .streams(Some("reader-token"))
            .produce(produce("events", vec![keyed("a", 0)]))
            .await,
    );
    assert_eq!(code, Code::PermissionDenied);
    assert!(message.contains("`write`"), "{message}");
    for token in ["writer-token", "admin-token"] {
        server
            .streams(Some(token))
            .produce(produce("events", vec![keyed("a", 0)]))
            .await
            .unwrap();
    }
    // Admin: only the admin.
    for token in ["reader-token", "writer-token"] {
        let (code, message) = refused(
            server
                .admin(Some(token))
                .add_stream_thread(v1::AddStreamThreadRequest {})
                .await,
        );
        assert_eq!(code, Code::PermissionDenied);
        assert!(message.contains("`admin`"), "{message}");
    }
    server
        .admin(Some("admin-token"))
        .add_stream_thread(v1::AddStreamThreadRequest {})
        .await
        .unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_topics_are_the_runtimes_and_dead_letters_are_redriven() {
    let server = Server::start().await;
    let writer = server.streams(Some("writer-token"));
    let admin_streams = server.streams(Some("admin-token"));

    // Three records of partition 0 fail once (retry_max_attempts = 1): dead-lettered.
    let keys = ["k0", "k1", "k2"];
    writer
        .clone()
        .produce(produce("events", keys.iter().map(|k| keyed(k, 0)).collect()))
        .await
        .unwrap();
    server.wait_for_end("sec-flaky-dlq", 0, 3).await;

    // The retry and dead-letter topics are the runtime's.
    for topic in ["sec-flaky-retry", "sec-flaky-dlq", "sec-flaky-changelog"] {
        let (code, message) = refused(writer.clone().produce(produce(topic, vec![keyed("x", 0)])).await);
        assert_eq!(code, Code::PermissionDenied, "{topic}");
        assert!(message.contains("`admin`"), "{message}");
    }
    let read = |topic: &str| v1::ReadTopicRequest {
        topic: topic.into(),
        partition: 0,
        offset: 0,
        max_records: 0,
    };
    let (code, _) = refused(
        server
            .streams(Some("reader-token"))
            .read_topic(read("sec-flaky-dlq"))
            .await,
    );
    assert_eq!(code, Code::PermissionDenied);
    let dead = admin_streams
        .clone()
        .read_topic(read("sec-flaky-dlq"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dead.records.len(), 3);
    // A header of the runtime's namespaces is refused in any client record, even an admin's.
    let mut forged = keyed("x", 0);
    forged
        .headers
        .insert("taskstream.retry.void".into(), Bytes::from_static(b"0,1,2"));
    for (client, topic) in [
        (writer.clone(), "events"),
        (admin_streams.clone(), "sec-flaky-retry"),
    ] {
        let (code, message) = refused(client.clone().produce(produce(topic, vec![forged.clone()])).await);
        assert_eq!(code, Code::InvalidArgument, "{topic}: {message}");
        assert!(message.contains("taskstream.retry.void"), "{message}");
    }
    let mut forged = keyed("x", 0);
    forged
        .headers
        .insert("__streams.errors.offset".into(), Bytes::from_static(b"7"));
    let (code, _) = refused(writer.clone().produce(produce("events", vec![forged])).await);
    assert_eq!(code, Code::InvalidArgument);

    // Redrive is an admin RPC.
    let redrive = |offsets: Vec<i64>, all: bool| v1::RedriveDeadLettersRequest {
        pipeline: "flaky".into(),
        partition: 0,
        offsets,
        all,
    };
    let (code, _) = refused(
        server
            .admin(Some("writer-token"))
            .redrive_dead_letters(redrive(vec![0], false))
            .await,
    );
    assert_eq!(code, Code::PermissionDenied);
    // An offset the dead-letter partition does not hold: nothing is redriven.
    let (code, message) = refused(
        server
            .admin(Some("admin-token"))
            .redrive_dead_letters(redrive(vec![0, 9], false))
            .await,
    );
    assert_eq!(code, Code::InvalidArgument, "{message}");

    // Redriven while the processor still fails: a new delivery, dead-lettered again.
    let answer = server
        .admin(Some("admin-token"))
        .redrive_dead_letters(redrive(vec![1], false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.redriven, 1);
    server.wait_for_end("sec-flaky-dlq", 0, 4).await;

    // Healthy again: the redriven records are processed, with fresh attempts.
    server.failing.store(false, Ordering::SeqCst);
    let answer = server
        .admin(Some("admin-token"))
        .redrive_dead_letters(redrive(vec![0, 2], false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.redriven, 2);
    assert_eq!(answer.retry_positions.len(), 2);
    let deadline = Instant::now() + WAIT;
    while server.processed.lock().unwrap().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the redriven records were not processed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut processed: Vec<Bytes> = server.processed.lock().unwrap().clone();
    processed.sort();
    assert_eq!(
        processed,
        vec![Bytes::from_static(b"k0"), Bytes::from_static(b"k2")]
    );
    let description = server.app.describe();
    assert!(description.num_stream_threads >= 2);
    server.stop().await;
}
