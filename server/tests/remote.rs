//! Remote processors end to end through `StreamsApp`: a Rust
//! `ProcessorService` (built on the generated server trait) served on port 0
//! counts per key through state ops; the runtime applies what it answers,
//! takes its failures down the retry path, fails malformed answers with the
//! documented kinds, and waits, failing nothing, while it cannot be reached.
//! Outputs (remote, or `ctx.emit` in Rust) land in the sink topic in the
//! pipeline's order, and a second pipeline reading that topic chains.

use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use taskstream::v1 as pb;
use taskstream::v1::processor_service_server::{ProcessorService, ProcessorServiceServer};
use taskstream_server::*;

const WAIT: Duration = Duration::from_secs(60);

/// The test's processor: counts records per key through state ops (from the
/// state the runtime sends, carried across the records of one call), and
/// emits `<key>=<count>` per record. A record's value asks for misbehaviour:
/// `fail-once` fails its first attempt (retryable), `fatal` fails for good,
/// `bad-key` writes a key it was not sent, `no-result` answers neither
/// success nor failure, `huge` answers more than the response limit, `short`
/// answers no result at all for the call.
#[derive(Clone, Default)]
struct Counter {
    /// Upper bound of a random delay per call, in microseconds.
    max_latency_us: u64,
    calls: Arc<AtomicUsize>,
    /// The most records seen in one call.
    largest_call: Arc<AtomicUsize>,
    seed: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl ProcessorService for Counter {
    async fn process(
        &self,
        request: tonic::Request<pb::ProcessRequest>,
    ) -> Result<tonic::Response<pb::ProcessResponse>, tonic::Status> {
        let request = request.into_inner();
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.largest_call
            .fetch_max(request.records.len(), Ordering::SeqCst);
        if self.max_latency_us > 0 {
            let draw = splitmix(self.seed.fetch_add(1, Ordering::Relaxed)) % (self.max_latency_us + 1);
            tokio::time::sleep(Duration::from_micros(draw)).await;
        }
        let mut counts: HashMap<Bytes, u64> = request
            .state
            .iter()
            .map(|s| {
                let n = s
                    .value
                    .as_ref()
                    .map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
                (s.key.clone(), n)
            })
            .collect();
        if request.records.iter().any(|r| r.value == "short") {
            return Ok(tonic::Response::new(pb::ProcessResponse { results: vec![] }));
        }
        let results = request
            .records
            .iter()
            .map(|record| {
                use pb::record_result::Result as Answer;
                let key = record.key.clone().unwrap_or_default();
                let fail = |kind: &str, retryable| pb::RecordResult {
                    result: Some(Answer::Failure(pb::RecordFailure {
                        kind: kind.into(),
                        message: format!("offset {} attempt {}", record.offset, request.attempt),
                        retryable,
                    })),
                };
                match &record.value[..] {
                    b"fail-once" if request.attempt == 1 => return fail("FailOnce", true),
                    b"fatal" => return fail("Fatal", false),
                    b"no-result" => return pb::RecordResult { result: None },
                    _ => {}
                }
                let count = counts.entry(key.clone()).or_default();
                *count += 1;
                let mut state_ops = vec![pb::StateOp {
                    key: key.clone(),
                    op: Some(pb::state_op::Op::Put(Bytes::from(count.to_string()))),
                }];
                if record.value == "bad-key" {
                    state_ops.push(pb::StateOp {
                        key: Bytes::from_static(b"not-sent"),
                        op: Some(pb::state_op::Op::Delete(true)),
                    });
                }
                let value = if record.value == "huge" {
                    Bytes::from(vec![b'x'; 4096])
                } else {
                    Bytes::from(format!("{}={count}", String::from_utf8_lossy(&key)))
                };
                pb::RecordResult {
                    result: Some(Answer::Success(pb::RecordSuccess {
                        state_ops,
                        outputs: vec![pb::OutputRecord {
                            key: Some(key),
                            value,
                            headers: vec![pb::Header {
                                name: "offset".into(),
                                value: Bytes::from(record.offset.to_string()),
                            }],
                            ..Default::default()
                        }],
                    })),
                }
            })
            .collect();
        Ok(tonic::Response::new(pb::ProcessResponse { results }))
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A processor service on its own runtime; stopped when dropped.
struct Served {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Served {
    /// Serves `service` on `addr` (port 0: any free port).
    fn start(service: Counter, addr: SocketAddr) -> Served {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime.block_on(tokio::net::TcpListener::bind(addr)).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(ProcessorServiceServer::new(service))
                // TCP_NODELAY: an answer must not wait for the client's delayed ACK.
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async {
                        let _ = stopped.await;
                    },
                ),
        );
        Served {
            addr,
            stop: Some(stop),
            runtime: Some(runtime),
        }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

fn config(endpoint: &str, t: usize, order: ProcessingOrder, partitions: u32) -> Config {
    let mut spec = GrpcProcessorSpec::new(endpoint);
    spec.include_state = true;
    spec.max_records_per_call = 16;
    let mut pipeline = PipelineConfig::new("p", "in", ProcessorSpec::Grpc(spec));
    pipeline.partitions = Some(partitions);
    Config {
        application_id: "app".into(),
        num_stream_threads: t.max(2),
        num_threads_per_task: t,
        processing_order: order,
        commit_interval_ms: 20,
        retry_backoff_ms: 10,
        retry_backoff_max_ms: 50,
        processing_timeout_ms: 10_000,
        pipelines: vec![pipeline],
        ..Config::default()
    }
}

fn keyed(count: usize, keys: usize) -> Vec<ProducerRecord> {
    (0..count)
        .map(|i| ProducerRecord::keyed(format!("k{}", i % keys), format!("{i}")))
        .collect()
}

fn ends(app: &StreamsApp, topic: &str) -> BTreeMap<u32, u64> {
    let partitions = app.log().partitions(topic).unwrap();
    (0..partitions)
        .map(|p| (p, app.log().end_offset(topic, p).unwrap()))
        .collect()
}

/// Every outcome of topic `in` up to its end now, in publication order.
fn outcomes(app: &StreamsApp) -> Vec<RecordOutcome> {
    let ends = ends(app, "in");
    let request = SubscribeRequest {
        start: StartAt::Offsets(ends.keys().map(|&p| (p, 0)).collect()),
        end: EndAt::Offsets(ends),
        ..SubscribeRequest::default()
    };
    let mut subscription = app.subscribe("p", request).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
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

/// Every record of a topic, by partition.
fn read_all(app: &StreamsApp, topic: &str) -> BTreeMap<u32, Vec<Record>> {
    let mut all = BTreeMap::new();
    for (partition, end) in ends(app, topic) {
        let read = app.read_topic(topic, partition, 0, end as usize + 1).unwrap();
        all.insert(partition, read.records);
    }
    all
}

fn header<'a>(record: &'a Record, name: &str) -> Option<&'a [u8]> {
    record
        .headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| &v[..])
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn counts_through_state_ops_match_in_every_order() {
    let service = Counter {
        max_latency_us: 2_000,
        ..Counter::default()
    };
    let served = Served::start(service.clone(), "127.0.0.1:0".parse().unwrap());
    // With one record per call a thread chains calls (one in flight at a
    // time): a chain must end before a key it already sent, whose state the
    // earlier call's answer has not yet changed.
    for (t, order, per_call) in [
        (1, ProcessingOrder::Offset, 16),
        (4, ProcessingOrder::Offset, 16),
        (4, ProcessingOrder::Key, 16),
        (1, ProcessingOrder::Offset, 1),
        (4, ProcessingOrder::Key, 1),
    ] {
        let mut config = config(&served.endpoint(), t, order, 3);
        if let ProcessorSpec::Grpc(spec) = &mut config.pipelines[0].processor {
            spec.max_records_per_call = per_call;
        }
        let app = StreamsApp::start(config).unwrap();
        let records = keyed(3_000, 17);
        app.produce("in", records).unwrap();
        assert!(app.wait_until_caught_up(WAIT), "T={t} {order:?}: not caught up");
        for k in 0..17 {
            let expected = (0..3_000).filter(|i| i % 17 == k).count();
            let got = app.get("p", format!("k{k}").as_bytes()).unwrap();
            assert_eq!(
                got.as_deref(),
                Some(expected.to_string().as_bytes()),
                "T={t} {order:?} {per_call} per call: key k{k}"
            );
        }
        let outcomes = outcomes(&app);
        assert_eq!(outcomes.len(), 3_000);
        assert!(
            outcomes
                .iter()
                .all(|o| o.outcome == Outcome::Processed && o.attempts == 1)
        );
        app.shutdown().unwrap();
    }
    let largest = service.largest_call.load(Ordering::SeqCst);
    assert!(
        (2..=16).contains(&largest),
        "calls carry up to max_records_per_call records: {largest}"
    );
}

/// A thread chains the calls of its unit; once the unit has run
/// `max_batch_ms` it gives the rest of its records back, but not those a
/// chain answered already: every record is sent exactly once.
#[test]
fn a_unit_out_of_time_keeps_the_answers_its_chain_has() {
    let service = Counter {
        max_latency_us: 3_000,
        ..Counter::default()
    };
    let served = Served::start(service.clone(), "127.0.0.1:0".parse().unwrap());
    let mut config = config(&served.endpoint(), 2, ProcessingOrder::Offset, 1);
    if let ProcessorSpec::Grpc(spec) = &mut config.pipelines[0].processor {
        // No state: nothing ends a chain before the unit's end or its time.
        spec.include_state = false;
        spec.max_records_per_call = 1;
    }
    // A unit runs out of time after a few calls, in the middle of a chain.
    config.max_batch_ms = 10;
    let app = StreamsApp::start(config).unwrap();
    app.produce("in", keyed(400, 400)).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    let outcomes = outcomes(&app);
    assert_eq!(outcomes.len(), 400);
    assert!(outcomes.iter().all(|o| o.outcome == Outcome::Processed));
    assert_eq!(service.calls.load(Ordering::SeqCst), 400, "one call per record");
    app.shutdown().unwrap();
}

#[test]
fn failures_retry_or_dead_letter_and_malformed_answers_fail_with_their_kind() {
    let served = Served::start(Counter::default(), "127.0.0.1:0".parse().unwrap());
    let mut config = config(&served.endpoint(), 2, ProcessingOrder::Offset, 1);
    if let ProcessorSpec::Grpc(spec) = &mut config.pipelines[0].processor {
        spec.max_response_bytes = 2048;
        // One record per call: a malformed answer fails only its record.
        spec.max_records_per_call = 1;
    }
    config.retry_max_attempts = 3;
    let app = StreamsApp::start(config).unwrap();
    let values = [
        "ok",
        "fail-once",
        "fatal",
        "bad-key",
        "no-result",
        "huge",
        "short",
        "ok",
    ];
    let records: Vec<ProducerRecord> = values
        .iter()
        .enumerate()
        .map(|(i, v)| ProducerRecord::keyed(format!("key{i}"), *v))
        .collect();
    app.produce("in", records).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    let mut finals: BTreeMap<u64, RecordOutcome> = BTreeMap::new();
    wait_for("every record final", || {
        finals = outcomes(&app)
            .into_iter()
            .filter(|o| o.outcome != Outcome::Retrying)
            .map(|o| (o.offset, o))
            .collect();
        finals.len() == values.len()
    });
    let summary: Vec<(Outcome, u32)> = finals.values().map(|o| (o.outcome, o.attempts)).collect();
    assert_eq!(
        summary,
        vec![
            (Outcome::Processed, 1),
            (Outcome::Processed, 2),
            (Outcome::DeadLettered, 1),
            (Outcome::DeadLettered, 3),
            (Outcome::DeadLettered, 3),
            (Outcome::DeadLettered, 3),
            (Outcome::DeadLettered, 3),
            (Outcome::Processed, 1),
        ]
    );
    let dead = read_all(&app, "app-p-dlq");
    let kinds: BTreeMap<u64, String> = dead
        .values()
        .flatten()
        .map(|r| {
            let offset: u64 = std::str::from_utf8(header(r, failure_headers::OFFSET).unwrap())
                .unwrap()
                .parse()
                .unwrap();
            let kind = String::from_utf8_lossy(header(r, failure_headers::EXCEPTION).unwrap()).into_owned();
            (offset, kind)
        })
        .collect();
    let expected: BTreeMap<u64, String> = [
        (2, "Fatal"),
        (3, "UnknownStateKey"),
        (4, "MalformedResponse"),
        (5, "ResponseTooLarge"),
        (6, "MalformedResponse"),
    ]
    .into_iter()
    .map(|(o, k)| (o, k.to_string()))
    .collect();
    assert_eq!(kinds, expected);
    // A failed record's state ops were not applied; the others' were.
    assert_eq!(app.get("p", b"key0").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(app.get("p", b"key1").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(
        app.get("p", b"key3").unwrap(),
        None,
        "bad-key's put was not applied"
    );
    assert_eq!(app.get("p", b"key5").unwrap(), None);
    assert_eq!(app.state(), AppState::Running);
    app.shutdown().unwrap();
}

#[test]
fn an_unreachable_processor_pauses_the_pipeline_and_nothing_is_dead_lettered() {
    let service = Counter {
        max_latency_us: 1_000,
        ..Counter::default()
    };
    let served = Served::start(service.clone(), "127.0.0.1:0".parse().unwrap());
    let addr = served.addr;
    let mut config = config(&served.endpoint(), 4, ProcessingOrder::Offset, 2);
    // Few attempts: a record failed by the outage would be dead-lettered at once.
    config.retry_max_attempts = 1;
    let app = StreamsApp::start(config).unwrap();
    app.produce("in", keyed(2_000, 13)).unwrap();
    wait_for("the processor's first calls", || {
        service.calls.load(Ordering::SeqCst) > 5
    });
    drop(served);

    let status = || app.describe().pipelines[0].remote_processor.clone().unwrap();
    wait_for("the pipeline to wait for its processor", || {
        status().waiting_since_ms.is_some()
    });
    let down = status();
    assert_eq!(down.endpoint, format!("http://{addr}"));
    assert!(
        down.last_error.is_some() && down.unreachable_calls > 0,
        "{down:?}"
    );
    app.produce("in", keyed(1_000, 13)).unwrap();
    // While it waits, its records wait too: none fails.
    std::thread::sleep(Duration::from_millis(300));
    assert!(status().waiting_since_ms.is_some());

    let served = Served::start(service.clone(), addr);
    assert!(app.wait_until_caught_up(WAIT), "resumed and caught up");
    wait_for("the pipeline to resume", || status().waiting_since_ms.is_none());
    for k in 0..13 {
        let expected =
            (0..2_000).filter(|i| i % 13 == k).count() + (0..1_000).filter(|i| i % 13 == k).count();
        assert_eq!(
            app.get("p", format!("k{k}").as_bytes()).unwrap().as_deref(),
            Some(expected.to_string().as_bytes()),
            "key k{k}"
        );
    }
    assert!(
        read_all(&app, "app-p-dlq").values().all(Vec::is_empty),
        "nothing dead-lettered"
    );
    let outcomes = outcomes(&app);
    assert_eq!(outcomes.len(), 3_000);
    assert!(
        outcomes
            .iter()
            .all(|o| o.outcome == Outcome::Processed && o.attempts == 1)
    );
    app.shutdown().unwrap();
    drop(served);
}

/// The source offset an output came from (the test processor's `offset` header).
fn source_offset(record: &Record) -> u64 {
    std::str::from_utf8(header(record, "offset").expect("offset header"))
        .unwrap()
        .parse()
        .unwrap()
}

fn with_sink(mut config: Config, sink: &str) -> Config {
    config.pipelines[0].sink_topic = Some(sink.into());
    config
}

#[test]
fn sink_topics_hold_every_output_once_in_offset_order_per_partition_and_key_order_per_key() {
    let service = Counter {
        max_latency_us: 5_000,
        ..Counter::default()
    };
    let served = Served::start(service, "127.0.0.1:0".parse().unwrap());
    for order in [ProcessingOrder::Offset, ProcessingOrder::Key] {
        let mut config = with_sink(config(&served.endpoint(), 8, order, 2), "out");
        if let ProcessorSpec::Grpc(spec) = &mut config.pipelines[0].processor {
            spec.max_records_per_call = 4;
        }
        let app = StreamsApp::start(config).unwrap();
        app.produce("in", keyed(2_000, 50)).unwrap();
        assert!(app.wait_until_caught_up(WAIT), "{order:?}: caught up");
        let total: usize = (0..2)
            .map(|p| app.log().end_offset("in", p).unwrap() as usize)
            .sum();
        wait_for("every output in the sink topic", || {
            ends(&app, "out").values().sum::<u64>() as usize == total
        });
        let sink = read_all(&app, "out");
        for (partition, records) in &sink {
            let offsets: Vec<u64> = records.iter().map(source_offset).collect();
            let end = app.log().end_offset("in", *partition).unwrap();
            if order == ProcessingOrder::Offset {
                // Keyed outputs land in the sink partition of their key, which
                // is the source partition (same partition count): all of it, in order.
                assert_eq!(
                    offsets,
                    (0..end).collect::<Vec<_>>(),
                    "{order:?} partition {partition}"
                );
            } else {
                let mut sorted = offsets.clone();
                sorted.sort_unstable();
                assert_eq!(
                    sorted,
                    (0..end).collect::<Vec<_>>(),
                    "{order:?} partition {partition}: each once"
                );
            }
        }
        // Per key: counts 1, 2, 3 … in source-offset order.
        let mut per_key: HashMap<Bytes, Vec<(u64, String)>> = HashMap::new();
        for record in sink.values().flatten() {
            per_key.entry(record.key.clone().unwrap()).or_default().push((
                source_offset(record),
                String::from_utf8_lossy(&record.value).into_owned(),
            ));
        }
        assert_eq!(per_key.len(), 50);
        for (key, outputs) in per_key {
            let key = String::from_utf8_lossy(&key).into_owned();
            for (i, (offset, value)) in outputs.iter().enumerate() {
                assert_eq!(
                    value,
                    &format!("{key}={}", i + 1),
                    "{order:?} {key} at offset {offset}"
                );
            }
            assert!(
                outputs.windows(2).all(|w| w[0].0 < w[1].0),
                "{order:?} {key}: offset order"
            );
        }
        app.shutdown().unwrap();
    }
}

#[test]
fn rust_processors_emit_to_the_sink_topic_only_when_they_succeed() {
    let processor = Arc::new(|record: &Record, ctx: &ProcessorContext<'_>| {
        if record.value == "fail-once" && ctx.attempt == 1 {
            ctx.emit(ProducerRecord::keyed("lost", "never appended"));
            return Err(ProcessError::new("FailOnce", "first attempt"));
        }
        let mut output = ProducerRecord::keyed(record.key.clone().unwrap_or_default(), record.value.clone());
        output
            .headers
            .push(("offset".into(), Bytes::from(record.offset.to_string())));
        ctx.emit(output);
        Ok(())
    });
    let mut pipeline = PipelineConfig::new("p", "in", ProcessorSpec::Custom { name: "echo".into() });
    pipeline.partitions = Some(1);
    pipeline.sink_topic = Some("out".into());
    let config = Config {
        application_id: "app".into(),
        num_stream_threads: 4,
        num_threads_per_task: 4,
        commit_interval_ms: 20,
        retry_backoff_ms: 10,
        retry_backoff_max_ms: 50,
        pipelines: vec![pipeline],
        ..Config::default()
    };
    let app = StreamsApp::builder(config)
        .processor("echo", processor)
        .start()
        .unwrap();
    let mut records = keyed(500, 7);
    records[100] = ProducerRecord::keyed("k2", "fail-once");
    app.produce("in", records).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    wait_for("500 outputs", || app.log().end_offset("out", 0).unwrap() == 500);
    let sink = &read_all(&app, "out")[&0];
    assert!(
        sink.iter().all(|r| r.key.as_deref() != Some(&b"lost"[..])),
        "a failed attempt's outputs are dropped"
    );
    let offsets: Vec<u64> = sink.iter().map(source_offset).collect();
    let mut each_once = offsets.clone();
    each_once.sort_unstable();
    assert_eq!(each_once, (0..500).collect::<Vec<_>>());
    // Offset order, except that key k2's records from the retried one on
    // wait behind it (parked on the retry path): each key keeps its order.
    let k2 = |o: &u64| *o >= 100 && o % 7 == 2;
    let others: Vec<u64> = offsets.iter().copied().filter(|o| !k2(o)).collect();
    assert!(others.windows(2).all(|w| w[0] < w[1]), "{others:?}");
    let parked: Vec<u64> = offsets.iter().copied().filter(k2).collect();
    assert!(parked.windows(2).all(|w| w[0] < w[1]), "{parked:?}");
    assert_eq!(app.describe().pipelines[0].sink_topic.as_deref(), Some("out"));
    app.shutdown().unwrap();
}

#[test]
fn a_pipeline_reading_another_pipelines_sink_topic_chains() {
    let served = Served::start(Counter::default(), "127.0.0.1:0".parse().unwrap());
    let mut config = with_sink(config(&served.endpoint(), 4, ProcessingOrder::Key, 3), "counted");
    // Stage two keeps the last output per key: `<key>=<count>` of the last record.
    config
        .pipelines
        .push(PipelineConfig::new("last", "counted", ProcessorSpec::Latest));
    let app = StreamsApp::start(config).unwrap();
    assert_eq!(
        app.log().partitions("counted").unwrap(),
        3,
        "the sink takes the source's partitions"
    );
    app.produce("in", keyed(1_200, 11)).unwrap();
    wait_for("both stages", || {
        app.wait_until_caught_up(Duration::from_millis(100))
            && ends(&app, "counted").values().sum::<u64>() == 1_200
            && app.wait_until_caught_up(WAIT)
    });
    for k in 0..11 {
        let total = (0..1_200).filter(|i| i % 11 == k).count();
        assert_eq!(
            app.get("last", format!("k{k}").as_bytes()).unwrap().as_deref(),
            Some(format!("k{k}={total}").as_bytes()),
            "key k{k}"
        );
    }
    app.shutdown().unwrap();
}
