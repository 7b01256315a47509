//! Typed, validated configuration: one `Config` read from TOML (then overridden
//! by environment and flags in the binary), checked once at start. Every
//! rejection is a `ConfigError` that names the setting and says how to fix it.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

/// How the records of one task are ordered while several threads process it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ProcessingOrder {
    /// Results delivered and committed in offset order.
    #[default]
    Offset,
    /// Records of one key one at a time, in offset order; keys in parallel.
    Key,
    /// No order.
    Unordered,
}

impl ProcessingOrder {
    pub fn as_str(self) -> &'static str {
        choice_name(self)
    }

    /// Parses the config spelling (`offset`, `key`, `unordered`).
    pub fn parse(text: &str) -> Option<Self> {
        parse_choice(text).ok()
    }
}

impl fmt::Display for ProcessingOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a commit blocks the committing thread (`sync`) or is handed to a
/// committer that applies commits in order and reports each to a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommitMode {
    #[default]
    Sync,
    Async,
}

/// What a commit guarantees on Kafka. `at_least_once`: a crash may apply
/// records again. `exactly_once_v2`: a task's changelog, retry and
/// dead-letter writes and its offsets commit in one Kafka transaction, so a
/// crash applies nothing twice (it needs `bootstrap_servers` and
/// `commit_mode = "sync"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProcessingGuarantee {
    #[default]
    AtLeastOnce,
    ExactlyOnceV2,
}

impl ProcessingGuarantee {
    pub fn as_str(self) -> &'static str {
        choice_name(self)
    }
}

/// How instances of one application share partitions on Kafka: the consumer
/// group protocol. `consumer` is KIP-848 (Apache Kafka 4): the broker assigns
/// incrementally and no member waits for a global barrier. `classic` is the
/// older protocol, with the `cooperative-sticky` assignor, for older brokers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GroupProtocol {
    #[default]
    Consumer,
    Classic,
}

impl GroupProtocol {
    pub fn as_str(self) -> &'static str {
        choice_name(self)
    }
}

/// What happens to a stream subscriber too slow for its bounded buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SlowSubscriberPolicy {
    /// Tell it in-band how many batches it missed and go on.
    #[default]
    Notify,
    /// End its stream with RESOURCE_EXHAUSTED.
    Fail,
}

/// Where a pipeline keeps its state store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// In memory; rebuilt at start by reprocessing the retained log up to the
    /// committed watermark.
    Memory,
    /// On disk (redb under `data_dir`); each commit writes the store changes
    /// and the task's watermark in one transaction.
    Persistent,
}

impl StoreKind {
    pub fn as_str(self) -> &'static str {
        choice_name(self)
    }
}

/// What happens to a record whose processor fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RetryPolicy {
    /// The record goes to the pipeline's retry topic and the task moves on;
    /// reserve threads retry it with backoff, then dead-letter it.
    #[default]
    RetryTopic,
    /// Kafka Streams' behaviour: the partition waits while the record is
    /// retried in place (with the same backoff), then dead-lettered.
    Blocking,
}

impl RetryPolicy {
    pub fn as_str(self) -> &'static str {
        choice_name(self)
    }
}

/// How the binary writes its log lines (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// For people: one readable line per event, with its spans.
    #[default]
    Pretty,
    /// For machines: one JSON object per line, with the fields of the event and of its spans.
    Json,
}

impl LogFormat {
    pub fn as_str(self) -> &'static str {
        choice_name(self)
    }
}

/// A setting whose value is one of a few names. The names are listed once,
/// here, and serve TOML, environment variables and flags alike, so an error
/// can always say which values are accepted.
trait Choice: Copy + PartialEq + 'static {
    const CHOICES: &'static [(&'static str, Self)];
}

impl Choice for ProcessingOrder {
    const CHOICES: &'static [(&'static str, Self)] = &[
        ("offset", ProcessingOrder::Offset),
        ("key", ProcessingOrder::Key),
        ("unordered", ProcessingOrder::Unordered),
    ];
}

impl Choice for ProcessingGuarantee {
    const CHOICES: &'static [(&'static str, Self)] = &[
        ("at_least_once", ProcessingGuarantee::AtLeastOnce),
        ("exactly_once_v2", ProcessingGuarantee::ExactlyOnceV2),
    ];
}

impl Choice for CommitMode {
    const CHOICES: &'static [(&'static str, Self)] =
        &[("sync", CommitMode::Sync), ("async", CommitMode::Async)];
}

impl Choice for SlowSubscriberPolicy {
    const CHOICES: &'static [(&'static str, Self)] = &[
        ("notify", SlowSubscriberPolicy::Notify),
        ("fail", SlowSubscriberPolicy::Fail),
    ];
}

impl Choice for StoreKind {
    const CHOICES: &'static [(&'static str, Self)] = &[
        ("memory", StoreKind::Memory),
        ("persistent", StoreKind::Persistent),
    ];
}

impl Choice for LogFormat {
    const CHOICES: &'static [(&'static str, Self)] =
        &[("pretty", LogFormat::Pretty), ("json", LogFormat::Json)];
}

impl Choice for GroupProtocol {
    const CHOICES: &'static [(&'static str, Self)] = &[
        ("consumer", GroupProtocol::Consumer),
        ("classic", GroupProtocol::Classic),
    ];
}

impl Choice for RetryPolicy {
    const CHOICES: &'static [(&'static str, Self)] = &[
        ("retry_topic", RetryPolicy::RetryTopic),
        ("blocking", RetryPolicy::Blocking),
    ];
}

fn choice_name<T: Choice>(value: T) -> &'static str {
    T::CHOICES
        .iter()
        .find(|(_, choice)| *choice == value)
        .map_or("?", |(name, _)| name)
}

fn parse_choice<T: Choice>(text: &str) -> Result<T, String> {
    T::CHOICES
        .iter()
        .find(|(name, _)| *name == text)
        .map(|(_, choice)| *choice)
        .ok_or_else(|| {
            let names: Vec<&str> = T::CHOICES.iter().map(|(name, _)| *name).collect();
            format!("`{text}` is not one of the accepted values: {}", names.join(", "))
        })
}

macro_rules! deserialize_choice {
    ($($ty:ty),*) => {$(
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = String::deserialize(deserializer)?;
                parse_choice(&text).map_err(serde::de::Error::custom)
            }
        }
    )*};
}

deserialize_choice!(
    ProcessingOrder,
    CommitMode,
    ProcessingGuarantee,
    SlowSubscriberPolicy,
    StoreKind,
    RetryPolicy,
    LogFormat,
    GroupProtocol
);

/// Latency of the `simulate` processor: a fixed number of milliseconds, or a
/// `[low, high]` range drawn uniformly per record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LatencySpec {
    Fixed(f64),
    Uniform([f64; 2]),
}

impl<'de> Deserialize<'de> for LatencySpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = LatencySpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("milliseconds as a number (e.g. 2) or a [low, high] range (e.g. [0, 5])")
            }
            fn visit_f64<E: serde::de::Error>(self, ms: f64) -> Result<LatencySpec, E> {
                Ok(LatencySpec::Fixed(ms))
            }
            fn visit_i64<E: serde::de::Error>(self, ms: i64) -> Result<LatencySpec, E> {
                Ok(LatencySpec::Fixed(ms as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, ms: u64) -> Result<LatencySpec, E> {
                Ok(LatencySpec::Fixed(ms as f64))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<LatencySpec, A::Error> {
                let mut bounds = Vec::with_capacity(2);
                while let Some(bound) = seq.next_element::<Millis>()? {
                    bounds.push(bound.0);
                }
                match bounds[..] {
                    [low, high] => Ok(LatencySpec::Uniform([low, high])),
                    _ => Err(serde::de::Error::invalid_length(bounds.len(), &self)),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// One bound of a latency range: any TOML number.
struct Millis(f64);

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match LatencySpec::deserialize(deserializer)? {
            LatencySpec::Fixed(ms) => Ok(Millis(ms)),
            LatencySpec::Uniform(_) => Err(serde::de::Error::custom(
                "a range bound must be a number of milliseconds, not a list",
            )),
        }
    }
}

/// Which processor a pipeline runs, with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum ProcessorSpec {
    /// Count of records per key (stored as decimal text).
    Count,
    /// Sum of values parsed as i64 per key (decimal text); a bad value fails the record.
    Sum,
    /// Last value per key.
    Latest,
    /// Synthetic work for tests and benchmarks; counts per key like `count`.
    Simulate {
        latency_ms: Option<LatencySpec>,
        /// Microseconds of hashing per record (busy CPU work).
        cpu_work_us: u64,
        /// Fraction of records (0.0–1.0, chosen by offset) whose processing fails.
        failure_rate: f64,
        /// A failing record fails this many attempts, then succeeds (0 = always fails).
        fail_attempts: u32,
        /// Seed of the per-record draws, so runs are reproducible.
        seed: u64,
    },
    /// A processor registered in code with `AppBuilder::processor(name, …)`.
    Custom { name: String },
    /// A user's `taskstream.v1.ProcessorService`, called over gRPC.
    Grpc(GrpcProcessorSpec),
}

/// `processor = { type = "grpc", endpoint = "http://127.0.0.1:7000", … }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcProcessorSpec {
    /// `http://host:port` of the service.
    pub endpoint: String,
    /// Send the store's value of each distinct key with every call.
    pub include_state: bool,
    /// Records per call (the calls of a unit of work are cut to this size).
    pub max_records_per_call: usize,
    /// Largest response accepted; a larger one fails the call's records
    /// with kind `ResponseTooLarge`.
    pub max_response_bytes: usize,
}

impl GrpcProcessorSpec {
    pub const DEFAULT_MAX_RECORDS_PER_CALL: usize = 100;
    /// tonic's own default limit on a decoded message.
    pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

    /// A spec with the defaults: no state, 100 records per call, 4 MiB responses.
    pub fn new(endpoint: impl Into<String>) -> GrpcProcessorSpec {
        GrpcProcessorSpec {
            endpoint: endpoint.into(),
            include_state: false,
            max_records_per_call: Self::DEFAULT_MAX_RECORDS_PER_CALL,
            max_response_bytes: Self::DEFAULT_MAX_RESPONSE_BYTES,
        }
    }
}

impl ProcessorSpec {
    /// The processor a bare name means: a built-in (with default parameters)
    /// or one registered in code.
    pub fn named(name: &str) -> ProcessorSpec {
        match name {
            "count" => ProcessorSpec::Count,
            "sum" => ProcessorSpec::Sum,
            "latest" => ProcessorSpec::Latest,
            "simulate" => ProcessorSpec::Simulate {
                latency_ms: None,
                cpu_work_us: 0,
                failure_rate: 0.0,
                fail_attempts: 0,
                seed: 0,
            },
            _ => ProcessorSpec::Custom {
                name: name.to_string(),
            },
        }
    }

    pub fn name(&self) -> &str {
        match self {
            ProcessorSpec::Count => "count",
            ProcessorSpec::Sum => "sum",
            ProcessorSpec::Latest => "latest",
            ProcessorSpec::Simulate { .. } => "simulate",
            ProcessorSpec::Custom { name } => name,
            ProcessorSpec::Grpc(_) => "grpc",
        }
    }
}

/// A processor is written either as a bare name (`processor = "count"`) or as
/// a table with `type` and parameters. The table is read field by field from
/// the document (not buffered), so an error points at the field it is about.
fn deserialize_processor<'de, D>(deserializer: D) -> Result<ProcessorSpec, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct Visitor;
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = ProcessorSpec;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(
                "a processor name (count, sum, latest, simulate, or one registered in code) \
                 or a table with `type` (count, sum, latest, simulate, custom, grpc) and its parameters",
            )
        }
        fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<ProcessorSpec, E> {
            Ok(ProcessorSpec::named(name))
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<ProcessorSpec, A::Error> {
            let table = ProcessorTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
            table.into_spec().map_err(serde::de::Error::custom)
        }
    }
    deserializer.deserialize_any(Visitor)
}

/// The table form of a processor, before its parameters are checked against its type.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProcessorTable {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
    latency_ms: Option<LatencySpec>,
    cpu_work_us: Option<u64>,
    failure_rate: Option<f64>,
    fail_attempts: Option<u32>,
    seed: Option<u64>,
    endpoint: Option<String>,
    include_state: Option<bool>,
    max_records_per_call: Option<usize>,
    max_response_bytes: Option<usize>,
}

impl ProcessorTable {
    fn into_spec(self) -> Result<ProcessorSpec, String> {
        let params = [
            ("latency_ms", self.latency_ms.is_some()),
            ("cpu_work_us", self.cpu_work_us.is_some()),
            ("failure_rate", self.failure_rate.is_some()),
            ("fail_attempts", self.fail_attempts.is_some()),
            ("seed", self.seed.is_some()),
            ("name", self.name.is_some()),
            ("endpoint", self.endpoint.is_some()),
            ("include_state", self.include_state.is_some()),
            ("max_records_per_call", self.max_records_per_call.is_some()),
            ("max_response_bytes", self.max_response_bytes.is_some()),
        ];
        let stray = |allowed: &[&str]| {
            params
                .iter()
                .find(|(param, given)| *given && !allowed.contains(param))
                .map(|(param, _)| format!("`{param}` does not apply to type = \"{}\"; remove it", self.kind))
        };
        match self.kind.as_str() {
            "simulate" => match stray(&[
                "latency_ms",
                "cpu_work_us",
                "failure_rate",
                "fail_attempts",
                "seed",
            ]) {
                Some(message) => Err(message),
                None => Ok(ProcessorSpec::Simulate {
                    latency_ms: self.latency_ms,
                    cpu_work_us: self.cpu_work_us.unwrap_or(0),
                    failure_rate: self.failure_rate.unwrap_or(0.0),
                    fail_attempts: self.fail_attempts.unwrap_or(0),
                    seed: self.seed.unwrap_or(0),
                }),
            },
            "custom" => match (stray(&["name"]), self.name) {
                (Some(message), _) => Err(message),
                (None, Some(name)) => Ok(ProcessorSpec::Custom { name }),
                (None, None) => Err("type = \"custom\" needs `name`, the name it was registered with".into()),
            },
            "grpc" => match (
                stray(&[
                    "endpoint",
                    "include_state",
                    "max_records_per_call",
                    "max_response_bytes",
                ]),
                self.endpoint,
            ) {
                (Some(message), _) => Err(message),
                (None, Some(endpoint)) => Ok(ProcessorSpec::Grpc(GrpcProcessorSpec {
                    endpoint,
                    include_state: self.include_state.unwrap_or(false),
                    max_records_per_call: self
                        .max_records_per_call
                        .unwrap_or(GrpcProcessorSpec::DEFAULT_MAX_RECORDS_PER_CALL),
                    max_response_bytes: self
                        .max_response_bytes
                        .unwrap_or(GrpcProcessorSpec::DEFAULT_MAX_RESPONSE_BYTES),
                })),
                (None, None) => Err(
                    "type = \"grpc\" needs `endpoint`, the processor service's URL (e.g. \"http://127.0.0.1:7000\")"
                        .into(),
                ),
            },
            "count" | "sum" | "latest" => match stray(&[]) {
                Some(message) => Err(message),
                None => Ok(ProcessorSpec::named(&self.kind)),
            },
            other => Err(format!(
                "type `{other}` is not one of the accepted values: count, sum, latest, simulate, custom, grpc"
            )),
        }
    }
}

/// A topic of the embedded log.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopicConfig {
    pub name: String,
    pub partitions: u32,
    /// Per partition: oldest records beyond this many bytes may be removed
    /// (only below every pipeline's committed watermark).
    #[serde(default)]
    pub log_retention_bytes: Option<u64>,
    /// Records older than this may be removed (only below every pipeline's
    /// committed watermark).
    #[serde(default)]
    pub log_retention_ms: Option<u64>,
}

/// One pipeline: source topic → processor → state store of the same name.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// The pipeline's name, which is also its store's name.
    pub name: String,
    pub source_topic: String,
    /// Partitions of the source topic; created with this many if it does not exist.
    #[serde(default)]
    pub partitions: Option<u32>,
    #[serde(deserialize_with = "deserialize_processor")]
    pub processor: ProcessorSpec,
    /// Overrides the application's `num_threads_per_task`.
    #[serde(default)]
    pub num_threads_per_task: Option<usize>,
    /// Overrides the application's `processing_order`.
    #[serde(default)]
    pub processing_order: Option<ProcessingOrder>,
    /// `memory` or `persistent`; default: persistent when `data_dir` is set.
    #[serde(default)]
    pub store: Option<StoreKind>,
    /// Overrides the application's `retry_policy`.
    #[serde(default)]
    pub retry_policy: Option<RetryPolicy>,
    /// Where the processor's output records go (`ProcessorContext::emit`, a
    /// remote processor's outputs); created with the source's partitions
    /// unless `[[topics]]` declares it. Another pipeline may read it.
    #[serde(default)]
    pub sink_topic: Option<String>,
}

/// The whole configuration of one instance. Names follow Kafka Streams.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub application_id: String,
    /// `host:port` this instance advertises in metadata.
    pub application_server: String,
    /// N: stream threads.
    pub num_stream_threads: usize,
    /// T: at most this many threads work on one task at once.
    pub num_threads_per_task: usize,
    pub processing_order: ProcessingOrder,
    pub commit_interval_ms: u64,
    pub commit_mode: CommitMode,
    /// at_least_once (default) or exactly_once_v2 (Kafka transactions).
    pub processing_guarantee: ProcessingGuarantee,
    /// Largest work range one thread takes at once.
    pub max_batch_records: usize,
    /// A thread completes its unit after this long even if records remain,
    /// so outcomes flow at least this often with slow records.
    pub max_batch_ms: u64,
    /// Per task: records fetched and not yet released (bounds the sequencer).
    pub max_in_flight_records: usize,
    /// Per task: record outcomes kept for streams that start in the past.
    pub outcome_retention_records: usize,
    /// Per subscriber: batches buffered before it is told it lagged.
    pub subscriber_buffer_batches: usize,
    /// What a subscriber that falls behind its buffer gets.
    pub slow_subscriber: SlowSubscriberPolicy,
    /// Directory of the persistent log and stores; `None` keeps everything in
    /// memory (lost on restart).
    pub data_dir: Option<PathBuf>,
    /// At start, delete the stores the data dir check refuses (empty, damaged, another log's,
    /// ahead of the log) and rebuild them from the log; with a missing or foreign log, all of them.
    pub reset_stores: bool,
    /// Per persistent store: bytes of committed entries kept in memory so reads of keys not
    /// written since the last commit skip the file (keys, values and each entry's overhead;
    /// 0 = no cache).
    pub store_cache_bytes: usize,
    /// What a failing record does: `retry_topic` (default) or `blocking`.
    pub retry_policy: RetryPolicy,
    /// Processing attempts of a record, the first included, before it is dead-lettered.
    pub retry_max_attempts: u32,
    /// Backoff before the first retry; doubles per attempt, with jitter.
    pub retry_backoff_ms: u64,
    /// Cap of the backoff.
    pub retry_backoff_max_ms: u64,
    /// A processor call running longer than this fails its record (0 = no limit).
    pub processing_timeout_ms: u64,
    /// How the binary writes its log: `pretty` (default) or `json`. The library ignores it.
    pub log_format: LogFormat,
    pub topics: Vec<TopicConfig>,
    pub pipelines: Vec<PipelineConfig>,
    /// Apache Kafka's `host:port[,host:port…]`: with it the topics live in
    /// Kafka (`KafkaLog`) instead of the embedded log.
    pub bootstrap_servers: Option<String>,
    /// Replication factor of the topics taskstream creates in Kafka; -1 takes
    /// the broker's `default.replication.factor` (Kafka Streams' default).
    pub replication_factor: i32,
    /// The consumer group protocol on Kafka: `consumer` (KIP-848) or `classic`.
    pub group_protocol: GroupProtocol,
    /// On Kafka, a Query about partitions another instance holds is
    /// forwarded to it (true, the default); false answers FAILED_PRECONDITION
    /// naming the owner, so the client routes itself.
    pub forward_queries: bool,
    /// Client settings passed to librdkafka as they are (`[kafka]` table:
    /// security, timeouts, …); nested TOML keys join with dots.
    #[serde(deserialize_with = "deserialize_kafka_settings")]
    pub kafka: BTreeMap<String, String>,
    /// Largest gRPC message the server reads or writes, in bytes: a bigger request is
    /// refused (RESOURCE_EXHAUSTED), a bigger response fails instead of being sent.
    pub max_message_bytes: usize,
    /// Largest key of a produced record, in bytes.
    pub max_key_bytes: usize,
    /// Largest value of a produced record, in bytes.
    pub max_value_bytes: usize,
    /// Most bytes of one produced record's headers, names and values together.
    pub max_header_bytes: usize,
    /// Most records in one Produce request (and in each message of a ProduceStream).
    pub max_records_per_produce: usize,
    /// Most bytes (keys, values and headers) one ProduceStream call may carry on the
    /// embedded log, which holds them until the stream ends and then appends them all
    /// or none; a longer stream is refused and nothing of it is written.
    pub max_produce_stream_bytes: usize,
    /// A ReadTopic answer or a range Query page stops once its records reach this many
    /// bytes (it always holds at least one); the client reads on from where it stopped.
    pub max_response_bytes: usize,
    /// Most stream threads: AddStreamThread beyond it is refused.
    pub max_stream_threads: usize,
    /// Most concurrent calls (HTTP/2 streams) on one client connection.
    pub max_concurrent_streams: u32,
    /// Most open gRPC connections; one more is accepted and closed at once.
    pub max_connections: usize,
    /// A connection that has not sent the HTTP/2 preface and its SETTINGS frame this long
    /// after it was accepted is closed (with TLS: one that has not finished its TLS
    /// handshake) (0 = no limit).
    pub handshake_timeout_ms: u64,
    /// A connection with no call open and none started for this long is closed (0 = never).
    pub idle_timeout_ms: u64,
    /// The server pings each connection this often (HTTP/2 PING; 0 = no pings).
    pub http2_keepalive_interval_ms: u64,
    /// A connection whose peer does not answer a ping within this is closed.
    pub http2_keepalive_timeout_ms: u64,
    /// Most GetMetadataAsync streams open at once, over all connections.
    pub max_subscribers: usize,
    /// Keys longer than this are kept in record outcomes (streams and their history) cut to
    /// this many bytes, the last 8 of them a hash of the whole key.
    pub outcome_key_bytes: usize,
    /// File of bearer tokens and their roles, one `TOKEN ROLE` per line; without it every
    /// caller may call everything (keep such a server on a trusted network).
    pub auth_tokens: Option<PathBuf>,
    /// The server's certificate chain (PEM): with `tls_key`, gRPC is served over TLS only.
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM): with it, every client must present a certificate they signed
    /// (mutual TLS). Needs `tls_cert` and `tls_key`.
    pub tls_client_ca: Option<PathBuf>,
    /// CA certificates (PEM) that signed the other instances' certificates: on Kafka, with
    /// `tls_cert`, queries are forwarded to them over TLS and their certificates checked
    /// against these. Needed there while `forward_queries` is on; needs `tls_cert`.
    pub tls_peer_ca: Option<PathBuf>,
    /// The metrics listener (`--metrics-listen`) serves HTTPS with `tls_cert` and `tls_key`
    /// instead of plain HTTP; with `tls_client_ca`, scrapers must present a certificate too.
    pub metrics_tls: bool,
    /// Serve gRPC server reflection (grpcurl without a .proto).
    pub reflection: bool,
}

/// librdkafka settings that taskstream sets itself: a `[kafka]` table may not
/// override them, because the log's guarantees depend on them.
pub const RESERVED_KAFKA_SETTINGS: &[(&str, &str)] = &[
    (
        "bootstrap.servers",
        "set bootstrap_servers (--bootstrap-servers) instead",
    ),
    ("group.id", "the group is the application_id"),
    (
        "partitioner",
        "keys go where Kafka's Java client puts them (murmur2_random)",
    ),
    ("enable.auto.commit", "the runtime commits its watermarks itself"),
    (
        "auto.offset.reset",
        "reads start where the runtime asks and report what is no longer retained",
    ),
    ("allow.auto.create.topics", "taskstream creates its topics itself"),
    ("transactional.id", "transactions are the runtime's"),
    (
        "group.protocol",
        "set group_protocol (consumer or classic) instead",
    ),
    (
        "partition.assignment.strategy",
        "the classic protocol runs cooperative-sticky, so a rebalance never stops unaffected tasks",
    ),
];

/// Flattens the `[kafka]` table into librdkafka's `name = value` strings:
/// `security.protocol = "SSL"` in TOML is a nested table, joined back here.
fn deserialize_kafka_settings<'de, D>(deserializer: D) -> Result<BTreeMap<String, String>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    fn flatten(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, String>) -> Result<(), String> {
        for (key, value) in table {
            let name = if prefix.is_empty() {
                key.clone()
            } else {
                format!("{prefix}.{key}")
            };
            let text = match value {
                toml::Value::Table(inner) => {
                    flatten(&name, inner, out)?;
                    continue;
                }
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => {
                    return Err(format!(
                        "kafka.{name} is a {}; librdkafka settings are strings, numbers or booleans",
                        other.type_str()
                    ));
                }
            };
            out.insert(name, text);
        }
        Ok(())
    }
    let table = toml::Table::deserialize(deserializer)?;
    let mut out = BTreeMap::new();
    flatten("", &table, &mut out).map_err(serde::de::Error::custom)?;
    Ok(out)
}

impl Default for Config {
    fn default() -> Self {
        Config {
            application_id: "taskstream".to_string(),
            application_server: "127.0.0.1:50051".to_string(),
            num_stream_threads: 1,
            num_threads_per_task: 1,
            processing_order: ProcessingOrder::Offset,
            commit_interval_ms: 1000,
            commit_mode: CommitMode::Sync,
            processing_guarantee: ProcessingGuarantee::AtLeastOnce,
            max_batch_records: 500,
            max_batch_ms: 250,
            max_in_flight_records: 10_000,
            outcome_retention_records: 100_000,
            subscriber_buffer_batches: 1024,
            slow_subscriber: SlowSubscriberPolicy::Notify,
            data_dir: None,
            reset_stores: false,
            store_cache_bytes: crate::store::DEFAULT_CACHE_BYTES,
            retry_policy: RetryPolicy::RetryTopic,
            retry_max_attempts: 3,
            retry_backoff_ms: 100,
            retry_backoff_max_ms: 10_000,
            processing_timeout_ms: 30_000,
            log_format: LogFormat::Pretty,
            topics: Vec::new(),
            pipelines: Vec::new(),
            bootstrap_servers: None,
            replication_factor: -1,
            group_protocol: GroupProtocol::Consumer,
            forward_queries: true,
            kafka: BTreeMap::new(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_key_bytes: 64 << 10,
            max_value_bytes: 1 << 20,
            max_header_bytes: 64 << 10,
            max_records_per_produce: 10_000,
            max_produce_stream_bytes: 64 << 20,
            max_response_bytes: 1 << 20,
            max_stream_threads: 256,
            max_concurrent_streams: 1024,
            max_connections: 10_000,
            handshake_timeout_ms: 10_000,
            idle_timeout_ms: 300_000,
            http2_keepalive_interval_ms: 30_000,
            http2_keepalive_timeout_ms: 20_000,
            max_subscribers: 4096,
            outcome_key_bytes: 1024,
            auth_tokens: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            tls_peer_ca: None,
            metrics_tls: false,
            reflection: true,
        }
    }
}

/// The smallest `store_cache_bytes` but 0.
pub const MIN_STORE_CACHE_BYTES: usize = 64 << 10;

/// gRPC's usual bound on a message (grpc-go's and tonic's default receive size).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 << 20;

/// One scalar setting of [`Config`], as the environment and flags see it. Its
/// TOML key is `name`; its environment variable, `TASKSTREAM_<NAME>`, is
/// derived from the name (see [`Setting::env_var`]), so the two cannot drift.
/// To add a setting: add the field to `Config` and one line to [`SETTINGS`]
/// (a unit test fails until every scalar field has its line).
pub struct Setting {
    /// The TOML key, which is also the field of `Config`.
    pub name: &'static str,
    /// The binary's flag (`--num-stream-threads`), if the setting has one.
    pub flag: Option<&'static str>,
    /// Placeholder of the value in `--help`.
    pub value_name: &'static str,
    /// One line for `--help`.
    pub help: &'static str,
    apply: fn(&mut Config, &str) -> Result<(), String>,
}

impl Setting {
    /// A yes/no setting, whose flag may stand alone (`--reset-stores` = `--reset-stores true`).
    pub fn is_switch(&self) -> bool {
        self.value_name == SWITCH
    }

    /// `TASKSTREAM_` and the setting's name in capitals.
    pub fn env_var(&self) -> String {
        format!("TASKSTREAM_{}", self.name.to_ascii_uppercase())
    }

    /// Sets the setting from text (an environment variable or a flag), parsed
    /// as its TOML value would be; `source` names where the text came from.
    pub fn apply(&self, config: &mut Config, text: &str, source: &str) -> Result<(), ConfigError> {
        (self.apply)(config, text)
            .map_err(|message| ConfigError::new(self.name, format!("{message} (from {source})")))
    }
}

/// A `Setting` for field `$field`, read from text by `$parse`.
macro_rules! setting {
    ($field:ident, $flag:expr, $value_name:expr, $parse:expr, $help:literal) => {
        Setting {
            name: stringify!($field),
            flag: $flag,
            value_name: $value_name,
            help: $help,
            apply: |config, text| {
                config.$field = $parse(text)?;
                Ok(())
            },
        }
    };
}

/// Every scalar setting, in the order of the README's table. `topics`,
/// `pipelines` and `kafka` are tables and come only from TOML.
pub const SETTINGS: &[Setting] = &[
    setting!(
        application_id,
        Some("application-id"),
        "ID",
        parse_text,
        "Consumer group and name prefix."
    ),
    setting!(
        application_server,
        Some("application-server"),
        "HOST:PORT",
        parse_text,
        "host:port this instance advertises in metadata (default: the bound listen address)."
    ),
    setting!(
        num_stream_threads,
        Some("num-stream-threads"),
        "N",
        parse_number,
        "N: stream threads."
    ),
    setting!(
        num_threads_per_task,
        Some("num-threads-per-task"),
        "T",
        parse_number,
        "T: at most this many threads work on one task at once."
    ),
    setting!(
        processing_order,
        Some("processing-order"),
        "ORDER",
        parse_choice,
        "offset | key | unordered."
    ),
    setting!(
        commit_interval_ms,
        Some("commit-interval-ms"),
        "MS",
        parse_number,
        "How often watermarks are committed."
    ),
    setting!(
        commit_mode,
        Some("commit-mode"),
        "MODE",
        parse_choice,
        "sync | async."
    ),
    setting!(
        processing_guarantee,
        Some("processing-guarantee"),
        "GUARANTEE",
        parse_choice,
        "at_least_once | exactly_once_v2 (Kafka transactions; needs bootstrap_servers and commit_mode = sync)."
    ),
    setting!(
        max_batch_records,
        Some("max-batch-records"),
        "N",
        parse_number,
        "Largest work range one thread takes at once."
    ),
    setting!(
        max_batch_ms,
        Some("max-batch-ms"),
        "MS",
        parse_number,
        "A thread completes its unit after this long even if records remain, so outcomes flow at least this often."
    ),
    setting!(
        max_in_flight_records,
        Some("max-in-flight-records"),
        "N",
        parse_number,
        "Per task: records fetched and not yet released."
    ),
    setting!(
        outcome_retention_records,
        None,
        "N",
        parse_number,
        "Per task: record outcomes kept for streams that start in the past."
    ),
    setting!(
        subscriber_buffer_batches,
        None,
        "N",
        parse_number,
        "Per stream subscriber: batches buffered before it lags."
    ),
    setting!(slow_subscriber, None, "POLICY", parse_choice, "notify | fail."),
    setting!(
        data_dir,
        Some("data-dir"),
        "DIR",
        parse_dir,
        "Directory of the persistent log and state stores (created if missing); the binary's embedded \
         default uses ./taskstream-data, a --config file its own `data_dir` (none: in memory)."
    ),
    setting!(
        reset_stores,
        Some("reset-stores"),
        SWITCH,
        parse_bool,
        "At start, delete the stores the data dir check refuses (empty, damaged, another log's, ahead \
         of the log; all of them when the log is missing or another dir's) and rebuild them from the log."
    ),
    setting!(
        store_cache_bytes,
        None,
        "BYTES",
        parse_number,
        "Per persistent store: committed entries kept in memory, so reads of keys not written since \
         the last commit skip the file (0 = no cache)."
    ),
    setting!(
        retry_policy,
        None,
        "POLICY",
        parse_choice,
        "retry_topic | blocking."
    ),
    setting!(
        retry_max_attempts,
        None,
        "N",
        parse_number,
        "Attempts, the first included, before the dead-letter topic."
    ),
    setting!(
        retry_backoff_ms,
        None,
        "MS",
        parse_number,
        "First backoff before a retry; doubles per attempt."
    ),
    setting!(
        retry_backoff_max_ms,
        None,
        "MS",
        parse_number,
        "Cap of the retry backoff."
    ),
    setting!(
        processing_timeout_ms,
        None,
        "MS",
        parse_number,
        "A processor call longer than this fails its record (0 = no limit)."
    ),
    setting!(
        log_format,
        Some("log-format"),
        "FORMAT",
        parse_choice,
        "pretty | json: the log on stderr as readable lines, or one JSON object per line with the \
         fields of the event and its spans; RUST_LOG chooses what is logged."
    ),
    setting!(
        bootstrap_servers,
        Some("bootstrap-servers"),
        "HOST:PORT,…",
        parse_optional_text,
        "Apache Kafka brokers: the topics live in Kafka instead of the embedded log. Client settings \
         go in the config file's [kafka] table."
    ),
    setting!(
        replication_factor,
        None,
        "N",
        parse_replication_factor,
        "Replication factor of the topics created in Kafka (-1: the broker's default)."
    ),
    setting!(
        group_protocol,
        Some("group-protocol"),
        "PROTOCOL",
        parse_choice,
        "consumer | classic: Kafka's consumer group protocol (consumer = KIP-848; classic runs \
         cooperative-sticky)."
    ),
    setting!(
        forward_queries,
        Some("forward-queries"),
        SWITCH,
        parse_bool,
        "On Kafka: forward a Query about another instance's partitions to it (true); false answers \
         FAILED_PRECONDITION with the owner's host:port, for clients that route themselves."
    ),
    setting!(
        max_message_bytes,
        Some("max-message-bytes"),
        "BYTES",
        parse_number,
        "Largest gRPC message read or written; a bigger request is refused with RESOURCE_EXHAUSTED."
    ),
    setting!(
        max_key_bytes,
        None,
        "BYTES",
        parse_number,
        "Largest key of a produced record."
    ),
    setting!(
        max_value_bytes,
        None,
        "BYTES",
        parse_number,
        "Largest value of a produced record."
    ),
    setting!(
        max_header_bytes,
        None,
        "BYTES",
        parse_number,
        "Most bytes of one produced record's headers, names and values together."
    ),
    setting!(
        max_records_per_produce,
        None,
        "N",
        parse_number,
        "Most records in one Produce request (and in each message of a ProduceStream)."
    ),
    setting!(
        max_produce_stream_bytes,
        None,
        "BYTES",
        parse_number,
        "Most bytes (keys, values, headers) of one ProduceStream call on the embedded log, which \
         appends a whole stream or nothing of it."
    ),
    setting!(
        max_response_bytes,
        None,
        "BYTES",
        parse_number,
        "A ReadTopic answer or range Query page stops once its records reach this many bytes."
    ),
    setting!(
        max_stream_threads,
        Some("max-stream-threads"),
        "N",
        parse_number,
        "Most stream threads: AddStreamThread beyond it is refused."
    ),
    setting!(
        max_concurrent_streams,
        None,
        "N",
        parse_number,
        "Most concurrent calls (HTTP/2 streams) on one client connection."
    ),
    setting!(
        max_connections,
        None,
        "N",
        parse_number,
        "Most open gRPC connections; one more is accepted and closed at once."
    ),
    setting!(
        handshake_timeout_ms,
        None,
        "MS",
        parse_number,
        "A connection that has not sent the HTTP/2 preface and SETTINGS (with TLS: finished its TLS \
         handshake) within this is closed (0 = no limit)."
    ),
    setting!(
        idle_timeout_ms,
        None,
        "MS",
        parse_number,
        "A connection with no call open and none started for this long is closed (0 = never)."
    ),
    setting!(
        http2_keepalive_interval_ms,
        None,
        "MS",
        parse_number,
        "The server pings each connection this often (0 = no pings)."
    ),
    setting!(
        http2_keepalive_timeout_ms,
        None,
        "MS",
        parse_number,
        "A connection whose peer does not answer a ping within this is closed."
    ),
    setting!(
        max_subscribers,
        None,
        "N",
        parse_number,
        "Most GetMetadataAsync streams open at once, over all connections."
    ),
    setting!(
        outcome_key_bytes,
        None,
        "BYTES",
        parse_number,
        "Keys longer than this are kept in record outcomes cut to this size, the last 8 bytes a hash of the key."
    ),
    setting!(
        auth_tokens,
        Some("auth-tokens"),
        "FILE",
        parse_dir,
        "Bearer tokens and their roles (read, write, admin), one `TOKEN ROLE` per line; without it every \
         caller may call everything."
    ),
    setting!(
        tls_cert,
        Some("tls-cert"),
        "FILE",
        parse_dir,
        "Serve gRPC over TLS with this certificate chain (PEM); needs --tls-key."
    ),
    setting!(
        tls_key,
        Some("tls-key"),
        "FILE",
        parse_dir,
        "Private key (PEM) of --tls-cert."
    ),
    setting!(
        tls_client_ca,
        Some("tls-client-ca"),
        "FILE",
        parse_dir,
        "Require client certificates signed by these CAs (PEM): mutual TLS; needs --tls-cert."
    ),
    setting!(
        tls_peer_ca,
        Some("tls-peer-ca"),
        "FILE",
        parse_dir,
        "On Kafka with --tls-cert: forward queries to the other instances over TLS, trusting the \
         certificates these CAs (PEM) signed; needed while forward_queries is on."
    ),
    setting!(
        metrics_tls,
        Some("metrics-tls"),
        SWITCH,
        parse_bool,
        "Serve --metrics-listen over HTTPS with --tls-cert and --tls-key (and, with --tls-client-ca, \
         require scrapers' client certificates)."
    ),
    setting!(
        reflection,
        Some("reflection"),
        SWITCH,
        parse_bool,
        "Serve gRPC server reflection (default true; --no-reflection turns it off)."
    ),
];

fn parse_optional_text(text: &str) -> Result<Option<String>, String> {
    Ok(Some(text.to_string()))
}

fn parse_replication_factor(text: &str) -> Result<i32, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a whole number (-1 for the broker's default)"))
}

fn parse_text(text: &str) -> Result<String, String> {
    Ok(text.to_string())
}

fn parse_number<T: std::str::FromStr>(text: &str) -> Result<T, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a whole number of 0 or more (or it is too large)"))
}

/// `value_name` of a yes/no setting: its flag alone means `true`.
pub const SWITCH: &str = "true|false";

fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("`{text}` is not one of the accepted values: true, false")),
    }
}

fn parse_dir(text: &str) -> Result<Option<PathBuf>, String> {
    Ok(Some(PathBuf::from(text)))
}

impl Config {
    /// Applies every `TASKSTREAM_<SETTING>` that `var` finds (an empty value
    /// counts as unset). Other `TASKSTREAM_*` names are left alone: they may
    /// belong to the CLI (`TASKSTREAM_ADDR`) or the binary (`TASKSTREAM_LISTEN`).
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        for setting in SETTINGS {
            let name = setting.env_var();
            if let Some(text) = var(&name).filter(|text| !text.is_empty()) {
                setting.apply(self, &text, &name)?;
            }
        }
        Ok(())
    }
}

/// A rejected setting: which one, and what is wrong with it and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid setting `{setting}`: {message}")]
pub struct ConfigError {
    pub setting: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(setting: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            setting: setting.into(),
            message: message.into(),
        }
    }
}

impl TopicConfig {
    pub fn new(name: impl Into<String>, partitions: u32) -> TopicConfig {
        TopicConfig {
            name: name.into(),
            partitions,
            log_retention_bytes: None,
            log_retention_ms: None,
        }
    }
}

impl PipelineConfig {
    /// A pipeline with every override left to the application's settings.
    pub fn new(name: impl Into<String>, source_topic: impl Into<String>, processor: ProcessorSpec) -> Self {
        PipelineConfig {
            name: name.into(),
            source_topic: source_topic.into(),
            partitions: None,
            processor,
            num_threads_per_task: None,
            processing_order: None,
            store: None,
            retry_policy: None,
            sink_topic: None,
        }
    }
}

/// The settings a pipeline actually runs with, after applying its overrides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EffectiveOrder {
    pub threads_per_task: usize,
    /// The configured order, except that one thread per task is always `offset`.
    pub order: ProcessingOrder,
}

impl Config {
    /// The embedded default: topic `events` (8 partitions), pipeline and store
    /// `counts` counting per key, N = 4, T = 2, `offset` order.
    pub fn embedded_default() -> Config {
        Config {
            num_stream_threads: 4,
            num_threads_per_task: 2,
            topics: vec![TopicConfig::new("events", 8)],
            pipelines: vec![PipelineConfig::new("counts", "events", ProcessorSpec::Count)],
            ..Config::default()
        }
    }

    /// Parses TOML; an unknown key or a bad value is an error naming the
    /// setting's path (`pipelines[0].processor.latency_ms`) and what it accepts.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let path = e.span().and_then(|span| toml_path_at(text, &span));
            let message = plain_expectation(e.message());
            match path {
                Some(path) => ConfigError::new(path, message),
                // A syntax error: no setting to name, so say where it is.
                None => ConfigError::new("config file", e.to_string().trim_end().replace('\n', " ")),
            }
        })
    }

    pub fn pipeline(&self, name: &str) -> Option<&PipelineConfig> {
        self.pipelines.iter().find(|p| p.name == name)
    }

    pub fn effective_order(&self, pipeline: &PipelineConfig) -> EffectiveOrder {
        let threads_per_task = pipeline.num_threads_per_task.unwrap_or(self.num_threads_per_task);
        let configured = pipeline.processing_order.unwrap_or(self.processing_order);
        EffectiveOrder {
            threads_per_task,
            order: if threads_per_task == 1 {
                ProcessingOrder::Offset
            } else {
                configured
            },
        }
    }

    /// The store a pipeline runs with: its own setting, else persistent when
    /// there is a data dir, else memory.
    pub fn store_kind(&self, pipeline: &PipelineConfig) -> StoreKind {
        pipeline.store.unwrap_or(if self.data_dir.is_some() {
            StoreKind::Persistent
        } else {
            StoreKind::Memory
        })
    }

    pub fn retry_policy(&self, pipeline: &PipelineConfig) -> RetryPolicy {
        pipeline.retry_policy.unwrap_or(self.retry_policy)
    }

    /// The retry topic of a pipeline: `<application_id>-<pipeline>-retry`.
    pub fn retry_topic(&self, pipeline: &str) -> String {
        format!("{}-{pipeline}-retry", self.application_id)
    }

    /// The compacted topic where the instances of the application publish
    /// who holds which partitions (Kafka mode): `<application_id>-metadata`.
    pub fn metadata_topic(&self) -> String {
        format!("{}-metadata", self.application_id)
    }

    /// The dead-letter topic of a pipeline: `<application_id>-<pipeline>-dlq`.
    pub fn dead_letter_topic(&self, pipeline: &str) -> String {
        format!("{}-{pipeline}-dlq", self.application_id)
    }

    /// The changelog topic of a pipeline's store on Kafka (Kafka Streams'
    /// layout; the store is named after its pipeline):
    /// `<application_id>-<store>-changelog`.
    pub fn changelog_topic(&self, store: &str) -> String {
        format!("{}-{store}-changelog", self.application_id)
    }

    /// The largest T of any pipeline: N must be at least this.
    pub fn max_threads_per_task(&self) -> usize {
        self.pipelines
            .iter()
            .map(|p| p.num_threads_per_task.unwrap_or(self.num_threads_per_task))
            .chain(std::iter::once(self.num_threads_per_task))
            .max()
            .unwrap_or(1)
    }

    /// The partitions of every topic: declared topics, then pipeline sources,
    /// then sink topics (which take their pipeline's source partitions; a
    /// pipeline reading another's sink topic takes them from there).
    pub fn topic_partitions(&self) -> Result<BTreeMap<String, u32>, ConfigError> {
        let mut topics = BTreeMap::new();
        for (i, topic) in self.topics.iter().enumerate() {
            if topics.insert(topic.name.clone(), topic.partitions).is_some() {
                return Err(ConfigError::new(
                    format!("topics[{i}].name"),
                    format!("topic `{}` is declared twice", topic.name),
                ));
            }
        }
        for (i, pipeline) in self.pipelines.iter().enumerate() {
            match (topics.get(&pipeline.source_topic), pipeline.partitions) {
                (Some(&declared), Some(wanted)) if declared != wanted => {
                    return Err(ConfigError::new(
                        format!("pipelines[{i}].partitions"),
                        format!(
                            "topic `{}` has {declared} partitions but the pipeline says {wanted}; \
                             remove one of the two or make them equal",
                            pipeline.source_topic
                        ),
                    ));
                }
                (Some(_), _) => {}
                (None, Some(wanted)) => {
                    topics.insert(pipeline.source_topic.clone(), wanted);
                }
                // Another pipeline's sink topic: it takes that pipeline's source partitions.
                (None, None) if self.is_sink_topic(&pipeline.source_topic) => {}
                (None, None) => {
                    topics.insert(pipeline.source_topic.clone(), 1);
                }
            }
        }
        // Sink topics follow their sources, which may be sinks themselves
        // (a chain): one pass per pipeline settles the longest chain.
        for _ in 0..=self.pipelines.len() {
            for pipeline in &self.pipelines {
                if let Some(sink) = &pipeline.sink_topic
                    && !topics.contains_key(sink)
                    && let Some(&partitions) = topics.get(&pipeline.source_topic)
                {
                    topics.insert(sink.clone(), partitions);
                }
            }
        }
        // Left over only by a cycle of pipelines (each reading the next's sink).
        for pipeline in &self.pipelines {
            topics.entry(pipeline.source_topic.clone()).or_insert(1);
            if let Some(sink) = &pipeline.sink_topic {
                let partitions = topics[&pipeline.source_topic];
                topics.entry(sink.clone()).or_insert(partitions);
            }
        }
        Ok(topics)
    }

    /// The bounds on what clients control: each at least 1, and a record or a page of a
    /// response must fit in half a message (the rest is room for the message's framing).
    fn validate_limits(&self) -> Result<(), ConfigError> {
        let positive = [
            ("max_key_bytes", self.max_key_bytes),
            ("max_value_bytes", self.max_value_bytes),
            ("max_header_bytes", self.max_header_bytes),
            ("max_records_per_produce", self.max_records_per_produce),
            ("max_produce_stream_bytes", self.max_produce_stream_bytes),
            ("max_response_bytes", self.max_response_bytes),
            ("max_concurrent_streams", self.max_concurrent_streams as usize),
            ("max_subscribers", self.max_subscribers),
            ("max_connections", self.max_connections),
        ];
        for (setting, value) in positive {
            if value == 0 {
                return Err(ConfigError::new(setting, "must be at least 1"));
            }
        }
        let half = self.max_message_bytes / 2;
        let record = self
            .max_key_bytes
            .saturating_add(self.max_value_bytes)
            .saturating_add(self.max_header_bytes);
        if record > half {
            return Err(ConfigError::new(
                "max_value_bytes",
                format!(
                    "max_key_bytes + max_value_bytes + max_header_bytes is {record}, more than half of \
                     max_message_bytes ({}): a record could not be read back in one message; lower them \
                     or raise max_message_bytes",
                    self.max_message_bytes
                ),
            ));
        }
        if self.max_response_bytes > half {
            return Err(ConfigError::new(
                "max_response_bytes",
                format!(
                    "is {} but must be at most half of max_message_bytes ({half}), which leaves room \
                     for the framing of a page",
                    self.max_response_bytes
                ),
            ));
        }
        if self.max_stream_threads < self.num_stream_threads || self.max_stream_threads > 4096 {
            return Err(ConfigError::new(
                "max_stream_threads",
                format!(
                    "is {} but must be at least num_stream_threads ({}) and at most 4096",
                    self.max_stream_threads, self.num_stream_threads
                ),
            ));
        }
        // Without a bound on the answer a ping would wait for ever, which is no keepalive.
        if self.http2_keepalive_interval_ms > 0 && self.http2_keepalive_timeout_ms == 0 {
            return Err(ConfigError::new(
                "http2_keepalive_timeout_ms",
                "must be at least 1 while http2_keepalive_interval_ms pings (set that to 0 for no pings)",
            ));
        }
        if self.outcome_key_bytes < 16 {
            return Err(ConfigError::new(
                "outcome_key_bytes",
                "must be at least 16 (8 bytes of the key and its 8-byte hash)",
            ));
        }
        Ok(())
    }

    fn is_sink_topic(&self, topic: &str) -> bool {
        self.pipelines
            .iter()
            .any(|p| p.sink_topic.as_deref() == Some(topic))
    }

    /// The TLS settings go together: a certificate and its key, and a client CA, a peer CA
    /// or HTTPS metrics only with both. On Kafka, an instance that serves TLS and forwards
    /// queries needs `tls_peer_ca`: its peers serve TLS too (the instances of an application
    /// share their settings), and forwarding must not trust whatever answers. Whether the
    /// files can be used is checked where they are read (`service::tls`), as reading is not
    /// this function's business.
    fn validate_tls(&self) -> Result<(), ConfigError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => Err(ConfigError::new(
                "tls_cert",
                "is set but tls_key is not: TLS needs both the certificate (tls_cert) and its private \
                 key (tls_key)",
            )),
            (None, Some(_)) => Err(ConfigError::new(
                "tls_key",
                "is set but tls_cert is not: TLS needs both the certificate (tls_cert) and its private \
                 key (tls_key)",
            )),
            (None, None) if self.tls_client_ca.is_some() => Err(ConfigError::new(
                "tls_client_ca",
                "is set but tls_cert is not: client certificates are checked only over TLS; set \
                 tls_cert and tls_key too",
            )),
            (None, None) if self.tls_peer_ca.is_some() => Err(ConfigError::new(
                "tls_peer_ca",
                "is set but tls_cert is not: queries go to the other instances over TLS only when \
                 this one serves TLS; set tls_cert and tls_key too",
            )),
            (None, None) if self.metrics_tls => Err(ConfigError::new(
                "metrics_tls",
                "is true but tls_cert and tls_key are not set: the metrics listener serves HTTPS \
                 with the gRPC certificate; set tls_cert and tls_key too",
            )),
            (Some(_), Some(_))
                if self.bootstrap_servers.is_some() && self.forward_queries && self.tls_peer_ca.is_none() =>
            {
                Err(ConfigError::new(
                    "tls_peer_ca",
                    "is not set, but this instance serves TLS (tls_cert) on Kafka and forwards \
                     queries to the other instances (forward_queries = true), which serve TLS too: \
                     set tls_peer_ca to the CA that signed the instances' certificates, or set \
                     forward_queries = false",
                ))
            }
            _ => Ok(()),
        }
    }

    /// Checks every setting; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_name("application_id", &self.application_id)?;
        parse_host_port(&self.application_server).map_err(|m| {
            ConfigError::new(
                "application_server",
                format!("{m}; write it as host:port, e.g. 127.0.0.1:50051"),
            )
        })?;
        if self.num_stream_threads == 0 {
            return Err(ConfigError::new("num_stream_threads", "must be at least 1"));
        }
        if self.num_stream_threads > 1024 {
            return Err(ConfigError::new("num_stream_threads", "must be at most 1024"));
        }
        check_threads_per_task("num_threads_per_task", self.num_threads_per_task)?;
        let positive = [
            ("commit_interval_ms", self.commit_interval_ms as usize),
            ("max_batch_records", self.max_batch_records),
            ("max_batch_ms", self.max_batch_ms as usize),
            ("max_in_flight_records", self.max_in_flight_records),
            ("outcome_retention_records", self.outcome_retention_records),
            ("subscriber_buffer_batches", self.subscriber_buffer_batches),
        ];
        for (setting, value) in positive {
            if value == 0 {
                return Err(ConfigError::new(setting, "must be at least 1"));
            }
        }
        if self.max_message_bytes < 1024 {
            return Err(ConfigError::new(
                "max_message_bytes",
                format!(
                    "is {} but must be at least 1024 (the default is {DEFAULT_MAX_MESSAGE_BYTES})",
                    self.max_message_bytes
                ),
            ));
        }
        if self.store_cache_bytes != 0 && self.store_cache_bytes < MIN_STORE_CACHE_BYTES {
            return Err(ConfigError::new(
                "store_cache_bytes",
                format!(
                    "is {} but must be 0 (no cache) or at least {MIN_STORE_CACHE_BYTES} (64 KiB): a \
                     store splits it over 16 shards, and less would hold too few entries to help",
                    self.store_cache_bytes
                ),
            ));
        }
        self.validate_limits()?;
        self.validate_tls()?;
        if self.retry_max_attempts == 0 {
            return Err(ConfigError::new(
                "retry_max_attempts",
                "must be at least 1 (1 = no retry: a failing record is dead-lettered at once)",
            ));
        }
        if self.retry_backoff_max_ms < self.retry_backoff_ms {
            return Err(ConfigError::new(
                "retry_backoff_max_ms",
                format!(
                    "is {} but must be at least retry_backoff_ms ({}); raise it or lower retry_backoff_ms",
                    self.retry_backoff_max_ms, self.retry_backoff_ms
                ),
            ));
        }
        if let Some(dir) = &self.data_dir
            && dir.as_os_str().is_empty()
        {
            return Err(ConfigError::new(
                "data_dir",
                "must not be empty; give a directory path or leave it unset to keep everything in memory",
            ));
        }
        if self.max_in_flight_records < self.max_batch_records {
            return Err(ConfigError::new(
                "max_in_flight_records",
                format!(
                    "is {} but must be at least max_batch_records ({}); raise it or lower max_batch_records",
                    self.max_in_flight_records, self.max_batch_records
                ),
            ));
        }
        for (i, topic) in self.topics.iter().enumerate() {
            check_name(&format!("topics[{i}].name"), &topic.name)?;
            check_partitions(&format!("topics[{i}].partitions"), topic.partitions)?;
            if topic.log_retention_bytes == Some(0) || topic.log_retention_ms == Some(0) {
                return Err(ConfigError::new(
                    format!("topics[{i}].log_retention_*"),
                    "must be at least 1; leave it unset to keep every record",
                ));
            }
        }
        if self.pipelines.is_empty() {
            return Err(ConfigError::new(
                "pipelines",
                "no pipeline is configured; add a [[pipelines]] table with name, source_topic and processor",
            ));
        }
        for (i, pipeline) in self.pipelines.iter().enumerate() {
            check_name(&format!("pipelines[{i}].name"), &pipeline.name)?;
            check_name(&format!("pipelines[{i}].source_topic"), &pipeline.source_topic)?;
            if self.pipelines[..i].iter().any(|p| p.name == pipeline.name) {
                return Err(ConfigError::new(
                    format!("pipelines[{i}].name"),
                    format!(
                        "pipeline `{}` is declared twice; pipeline names must be unique",
                        pipeline.name
                    ),
                ));
            }
            if let Some(partitions) = pipeline.partitions {
                check_partitions(&format!("pipelines[{i}].partitions"), partitions)?;
            }
            if let Some(t) = pipeline.num_threads_per_task {
                check_threads_per_task(&format!("pipelines[{i}].num_threads_per_task"), t)?;
            }
            check_processor(&format!("pipelines[{i}].processor"), &pipeline.processor)?;
            if let ProcessorSpec::Grpc(grpc) = &pipeline.processor
                && grpc.include_state
            {
                let effective = self.effective_order(pipeline);
                if effective.order == ProcessingOrder::Unordered {
                    let order_setting = if pipeline.processing_order.is_some() {
                        format!("pipelines[{i}].processing_order")
                    } else {
                        "processing_order".to_string()
                    };
                    return Err(ConfigError::new(
                        format!("pipelines[{i}].processor.include_state"),
                        format!(
                            "include_state = true cannot be used with {order_setting} = \"unordered\" and {} \
                             threads per task: two calls could read the same key's state at once and the later \
                             write would lose the earlier one. Use processing_order = \"key\" or \"offset\", \
                             or set include_state = false",
                            effective.threads_per_task
                        ),
                    ));
                }
            }
            if let Some(sink) = &pipeline.sink_topic {
                let setting = format!("pipelines[{i}].sink_topic");
                check_name(&setting, sink)?;
                if *sink == pipeline.source_topic {
                    return Err(ConfigError::new(
                        setting,
                        format!(
                            "`{sink}` is the pipeline's own source topic: it would read its own outputs \
                             forever; name another topic"
                        ),
                    ));
                }
                let internal = self.pipelines.iter().find(|p| {
                    [
                        self.retry_topic(&p.name),
                        self.dead_letter_topic(&p.name),
                        self.changelog_topic(&p.name),
                    ]
                    .contains(sink)
                });
                if let Some(owner) = internal {
                    return Err(ConfigError::new(
                        setting,
                        format!(
                            "`{sink}` is pipeline `{}`'s retry, dead-letter or changelog topic, which belongs to the runtime; \
                             name another topic",
                            owner.name
                        ),
                    ));
                }
            }
            if pipeline.store == Some(StoreKind::Persistent) && self.data_dir.is_none() {
                return Err(ConfigError::new(
                    format!("pipelines[{i}].store"),
                    "a persistent store needs a data dir; set data_dir (--data-dir) or use store = \"memory\"",
                ));
            }
        }
        self.topic_partitions()?;
        self.validate_kafka()?;
        if self.data_dir.is_some() {
            // A memory store is rebuilt by replaying its source from the start:
            // retention there would silently restore a fraction of the state.
            for (i, topic) in self.topics.iter().enumerate() {
                let limited = topic.log_retention_bytes.is_some() || topic.log_retention_ms.is_some();
                let memory_reader = self
                    .pipelines
                    .iter()
                    .find(|p| p.source_topic == topic.name && self.store_kind(p) == StoreKind::Memory);
                if let (true, Some(pipeline)) = (limited, memory_reader) {
                    return Err(ConfigError::new(
                        format!("topics[{i}].log_retention_*"),
                        format!(
                            "topic `{}` feeds pipeline `{}`, whose memory store is rebuilt at start by replaying \
                             the whole topic; retention would lose its state. Use store = \"persistent\" for \
                             that pipeline, or drop the retention setting",
                            topic.name, pipeline.name
                        ),
                    ));
                }
            }
        }
        let max_t = self.max_threads_per_task();
        if self.num_stream_threads < max_t {
            let which = if max_t == self.num_threads_per_task {
                "num_threads_per_task".to_string()
            } else {
                let i = self
                    .pipelines
                    .iter()
                    .position(|p| p.num_threads_per_task == Some(max_t))
                    .unwrap_or(0);
                format!("pipelines[{i}].num_threads_per_task")
            };
            return Err(ConfigError::new(
                "num_stream_threads",
                format!(
                    "num_stream_threads ({}) is less than {which} ({max_t}): a task could never get \
                     its threads; raise num_stream_threads to at least {max_t} or lower {which}",
                    self.num_stream_threads
                ),
            ));
        }
        Ok(())
    }
}

/// The path (`pipelines[1].processor.latency_ms`) of the innermost key or
/// value of the document that contains `span`, the span of a TOML error.
fn toml_path_at(text: &str, span: &std::ops::Range<usize>) -> Option<String> {
    let document = toml::de::DeTable::parse(text).ok()?;
    path_in_table(document.get_ref(), span)
}

/// Children first: the span of an array of tables (`[[pipelines]]`) covers
/// only its header, so a container's span says nothing about its contents.
fn path_in_table(table: &toml::de::DeTable<'_>, span: &std::ops::Range<usize>) -> Option<String> {
    table.iter().find_map(|(key, value)| {
        let name = key.get_ref();
        if let Some(inner) = path_in_value(value.get_ref(), span) {
            let separator = if inner.starts_with('[') { "" } else { "." };
            return Some(format!("{name}{separator}{inner}"));
        }
        (contains(key.span(), span) || contains(value.span(), span)).then(|| name.to_string())
    })
}

fn path_in_value(value: &toml::de::DeValue<'_>, span: &std::ops::Range<usize>) -> Option<String> {
    match value {
        toml::de::DeValue::Table(table) => path_in_table(table, span),
        toml::de::DeValue::Array(items) => {
            items
                .iter()
                .enumerate()
                .find_map(|(i, item)| match path_in_value(item.get_ref(), span) {
                    Some(inner) if inner.starts_with('[') => Some(format!("[{i}]{inner}")),
                    Some(inner) => Some(format!("[{i}].{inner}")),
                    None => contains(item.span(), span).then(|| format!("[{i}]")),
                })
        }
        _ => None,
    }
}

fn contains(outer: std::ops::Range<usize>, inner: &std::ops::Range<usize>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

/// serde names the Rust type it wanted (`expected u64`); a user wants the kind of value.
fn plain_expectation(message: &str) -> String {
    const PLAIN: [(&str, &str); 7] = [
        ("expected usize", "expected a whole number of 0 or more"),
        ("expected u64", "expected a whole number of 0 or more"),
        ("expected u32", "expected a whole number of 0 or more"),
        ("expected u16", "expected a whole number of 0 or more"),
        ("expected i64", "expected a whole number"),
        ("expected f64", "expected a number"),
        ("expected path string", "expected a path"),
    ];
    let message = PLAIN.iter().fold(message.to_string(), |message, (rust, plain)| {
        message.replace(rust, plain)
    });
    // `expected struct PipelineConfig`: the type's name means nothing in a config file.
    match message.find("expected struct ") {
        Some(at) => format!("{}expected a table", &message[..at]),
        None => message,
    }
}

impl Config {
    /// `bootstrap_servers`, `replication_factor` and the `[kafka]` table.
    fn validate_kafka(&self) -> Result<(), ConfigError> {
        if !(self.replication_factor == -1 || (1..=i32::from(i16::MAX)).contains(&self.replication_factor)) {
            return Err(ConfigError::new(
                "replication_factor",
                format!(
                    "is {}; use -1 for the broker's default.replication.factor or a count from 1 to 32767",
                    self.replication_factor
                ),
            ));
        }
        if self.processing_guarantee == ProcessingGuarantee::ExactlyOnceV2 {
            if self.bootstrap_servers.is_none() {
                return Err(ConfigError::new(
                    "processing_guarantee",
                    "exactly_once_v2 uses Kafka transactions and needs bootstrap_servers \
                     (--bootstrap-servers); use at_least_once with the embedded log",
                ));
            }
            if self.commit_mode == CommitMode::Async {
                return Err(ConfigError::new(
                    "processing_guarantee",
                    "exactly_once_v2 commits in a Kafka transaction, which needs commit_mode = \"sync\"; \
                     set commit_mode = \"sync\" or processing_guarantee = \"at_least_once\"",
                ));
            }
        }
        let Some(servers) = &self.bootstrap_servers else {
            if let Some(name) = self.kafka.keys().next() {
                return Err(ConfigError::new(
                    format!("kafka.{name}"),
                    "the [kafka] table applies only with bootstrap_servers; set bootstrap_servers \
                     (--bootstrap-servers) or remove the table",
                ));
            }
            return Ok(());
        };
        if servers.trim().is_empty() {
            return Err(ConfigError::new(
                "bootstrap_servers",
                "must not be empty; give host:port[,host:port…] of Kafka brokers, or leave it unset for the embedded log",
            ));
        }
        for server in servers.split(',') {
            let server = server.trim();
            let address = server
                .strip_prefix("PLAINTEXT://")
                .or_else(|| server.strip_prefix("SSL://"))
                .or_else(|| server.strip_prefix("SASL_SSL://"))
                .or_else(|| server.strip_prefix("SASL_PLAINTEXT://"))
                .unwrap_or(server);
            parse_host_port(address).map_err(|m| {
                ConfigError::new(
                    "bootstrap_servers",
                    format!("{m}; write host:port[,host:port…], e.g. 127.0.0.1:9092"),
                )
            })?;
        }
        for name in self.kafka.keys() {
            if let Some((_, why)) = RESERVED_KAFKA_SETTINGS
                .iter()
                .find(|(reserved, _)| reserved == name)
            {
                return Err(ConfigError::new(
                    format!("kafka.{name}"),
                    format!("is set by taskstream ({why}); remove it from the [kafka] table"),
                ));
            }
        }
        // Kafka's own retention (the topic's retention.ms / retention.bytes)
        // applies there; silently ignoring these would surprise.
        for (i, topic) in self.topics.iter().enumerate() {
            if topic.log_retention_bytes.is_some() || topic.log_retention_ms.is_some() {
                return Err(ConfigError::new(
                    format!("topics[{i}].log_retention_*"),
                    "applies to the embedded log only; on Kafka, set retention.ms or retention.bytes \
                     on the topic itself (kafka-configs --alter)",
                ));
            }
        }
        Ok(())
    }
}

fn check_threads_per_task(setting: &str, value: usize) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(ConfigError::new(setting, "must be at least 1"));
    }
    if value > 1024 {
        return Err(ConfigError::new(setting, "must be at most 1024"));
    }
    Ok(())
}

fn check_partitions(setting: &str, value: u32) -> Result<(), ConfigError> {
    if value == 0 || value > 10_000 {
        return Err(ConfigError::new(setting, "must be between 1 and 10000"));
    }
    Ok(())
}

/// Names end up in task ids and topic names: keep them to what Kafka allows.
fn check_name(setting: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Err(ConfigError::new(setting, "must not be empty"));
    }
    if name.len() > 200
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(ConfigError::new(
            setting,
            format!("`{name}` may only use letters, digits, `.`, `_` and `-` (at most 200)"),
        ));
    }
    Ok(())
}

fn check_processor(setting: &str, spec: &ProcessorSpec) -> Result<(), ConfigError> {
    if let ProcessorSpec::Simulate {
        latency_ms,
        failure_rate,
        cpu_work_us,
        ..
    } = spec
    {
        if !(0.0..=1.0).contains(failure_rate) {
            return Err(ConfigError::new(
                format!("{setting}.failure_rate"),
                "must be between 0.0 and 1.0",
            ));
        }
        if *cpu_work_us > 60_000_000 {
            return Err(ConfigError::new(
                format!("{setting}.cpu_work_us"),
                "must be at most 60000000 (one minute)",
            ));
        }
        match latency_ms {
            Some(LatencySpec::Fixed(ms)) if !(0.0..=3_600_000.0).contains(ms) => {
                return Err(ConfigError::new(
                    format!("{setting}.latency_ms"),
                    "must be between 0 and 3600000",
                ));
            }
            Some(LatencySpec::Uniform([low, high]))
                if !(0.0..=3_600_000.0).contains(low) || !(*low..=3_600_000.0).contains(high) =>
            {
                return Err(ConfigError::new(
                    format!("{setting}.latency_ms"),
                    "a range must be [low, high] with 0 <= low <= high <= 3600000",
                ));
            }
            _ => {}
        }
    }
    if let ProcessorSpec::Custom { name } = spec
        && name.is_empty()
    {
        return Err(ConfigError::new(setting, "must name a processor"));
    }
    if let ProcessorSpec::Grpc(grpc) = spec {
        check_endpoint(&format!("{setting}.endpoint"), &grpc.endpoint)?;
        if !(1..=10_000).contains(&grpc.max_records_per_call) {
            return Err(ConfigError::new(
                format!("{setting}.max_records_per_call"),
                "must be between 1 and 10000",
            ));
        }
        if !(1024..=1024 * 1024 * 1024).contains(&grpc.max_response_bytes) {
            return Err(ConfigError::new(
                format!("{setting}.max_response_bytes"),
                "must be between 1024 and 1073741824 (1 GiB)",
            ));
        }
    }
    Ok(())
}

/// A processor service's URL: `http://host:port` (TLS to processors is not built in).
fn check_endpoint(setting: &str, endpoint: &str) -> Result<(), ConfigError> {
    let uri: tonic::transport::Uri = endpoint.parse().map_err(|e| {
        ConfigError::new(
            setting,
            format!("`{endpoint}` is not a URL ({e}); write it as http://host:port"),
        )
    })?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(ConfigError::new(
                setting,
                format!("`{endpoint}`: TLS to processor services is not supported; use an http:// endpoint"),
            ));
        }
        _ => {
            return Err(ConfigError::new(
                setting,
                format!("`{endpoint}` must start with http://, e.g. http://127.0.0.1:7000"),
            ));
        }
    }
    if uri.port_u16().is_none() || uri.host().is_none_or(str::is_empty) {
        return Err(ConfigError::new(
            setting,
            format!("`{endpoint}` needs a host and a port, e.g. http://127.0.0.1:7000"),
        ));
    }
    Ok(())
}

/// Splits `host:port` (IPv6 hosts in brackets).
pub fn parse_host_port(text: &str) -> Result<(String, u16), String> {
    let (host, port) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("`{text}` has no port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("`{text}` has no host"));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("`{port}` is not a port number"))?;
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_is_valid() {
        Config::embedded_default().validate().unwrap();
    }

    #[test]
    fn fewer_threads_than_threads_per_task_names_both_settings_and_the_fix() {
        let config = Config {
            num_stream_threads: 2,
            num_threads_per_task: 4,
            ..Config::embedded_default()
        };
        let err = config.validate().unwrap_err();
        assert_eq!(err.setting, "num_stream_threads");
        assert!(err.message.contains("num_threads_per_task (4)"), "{err}");
        assert!(err.message.contains("num_stream_threads (2)"), "{err}");
        assert!(
            err.message.contains("raise num_stream_threads to at least 4"),
            "{err}"
        );
    }

    #[test]
    fn pipeline_override_of_threads_per_task_is_checked_against_n() {
        let mut config = Config::embedded_default();
        config.pipelines[0].num_threads_per_task = Some(8);
        let err = config.validate().unwrap_err();
        assert!(
            err.message.contains("pipelines[0].num_threads_per_task (8)"),
            "{err}"
        );
    }

    #[test]
    fn toml_with_processor_table_and_overrides() {
        let config = Config::from_toml_str(
            r#"
            application_id = "app"
            num_stream_threads = 8
            num_threads_per_task = 4
            processing_order = "key"
            [[pipelines]]
            name = "slow"
            source_topic = "in"
            partitions = 3
            processor = { type = "simulate", latency_ms = [0, 5], failure_rate = 0.01 }
            [[pipelines]]
            name = "totals"
            source_topic = "in"
            processor = "sum"
            processing_order = "unordered"
            "#,
        )
        .unwrap();
        config.validate().unwrap();
        assert_eq!(config.topic_partitions().unwrap()["in"], 3);
        assert!(matches!(
            config.pipelines[0].processor,
            ProcessorSpec::Simulate {
                latency_ms: Some(LatencySpec::Uniform([0.0, 5.0])),
                ..
            }
        ));
        let totals = config.effective_order(&config.pipelines[1]);
        assert_eq!(totals.order, ProcessingOrder::Unordered);
    }

    #[test]
    fn one_thread_per_task_is_always_offset_order() {
        let mut config = Config::embedded_default();
        config.num_threads_per_task = 1;
        config.processing_order = ProcessingOrder::Unordered;
        let effective = config.effective_order(&config.pipelines[0]);
        assert_eq!(effective.order, ProcessingOrder::Offset);
    }

    /// Field names of a struct, as serde's derive lists them.
    fn serde_fields<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
        struct Capture(&'static [&'static str]);
        impl<'de> serde::Deserializer<'de> for &mut Capture {
            type Error = serde::de::value::Error;
            fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
                Err(serde::de::Error::custom("not a struct"))
            }
            fn deserialize_struct<V: serde::de::Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Self::Error> {
                self.0 = fields;
                Err(serde::de::Error::custom("captured"))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
                option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
            }
        }
        let mut capture = Capture(&[]);
        let _ = T::deserialize(&mut capture);
        capture.0
    }

    #[test]
    fn every_scalar_setting_has_one_table_entry_and_env_variable() {
        let fields = serde_fields::<Config>();
        assert!(fields.contains(&"retry_max_attempts"), "{fields:?}");
        let scalar: Vec<&str> = fields
            .iter()
            .copied()
            .filter(|f| !matches!(*f, "topics" | "pipelines" | "kafka"))
            .collect();
        let table: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
        assert_eq!(
            table, scalar,
            "SETTINGS must list every scalar field of Config, in order"
        );
        for setting in SETTINGS {
            assert_eq!(
                setting.env_var(),
                format!("TASKSTREAM_{}", setting.name.to_uppercase())
            );
            if let Some(flag) = setting.flag {
                assert_eq!(flag, setting.name.replace('_', "-"));
            }
        }
    }

    /// The same text through TOML and through the environment gives the same config.
    #[test]
    fn env_values_parse_as_their_toml_values() {
        let cases = [
            ("retry_max_attempts", "7", "7"),
            ("slow_subscriber", "fail", "\"fail\""),
            ("retry_policy", "blocking", "\"blocking\""),
            ("processing_timeout_ms", "0", "0"),
            ("data_dir", "/tmp/x", "\"/tmp/x\""),
            ("reset_stores", "true", "true"),
            ("store_cache_bytes", "1048576", "1048576"),
            ("log_format", "json", "\"json\""),
            ("application_id", "app", "\"app\""),
        ];
        for (name, env_text, toml_text) in cases {
            let from_toml = Config::from_toml_str(&format!("{name} = {toml_text}")).unwrap();
            let mut from_env = Config::default();
            let var = format!("TASKSTREAM_{}", name.to_uppercase());
            from_env
                .apply_env(|asked| (asked == var).then(|| env_text.to_string()))
                .unwrap();
            assert_eq!(from_env, from_toml, "{name}");
            assert_ne!(from_env, Config::default(), "{name} must change something");
        }
    }

    #[test]
    fn env_errors_name_the_setting_and_the_variable() {
        let mut config = Config::default();
        let err = config
            .apply_env(|var| (var == "TASKSTREAM_SLOW_SUBSCRIBER").then(|| "bogus".to_string()))
            .unwrap_err();
        assert_eq!(err.setting, "slow_subscriber");
        assert!(err.message.contains("notify, fail"), "{err}");
        assert!(err.message.contains("TASKSTREAM_SLOW_SUBSCRIBER"), "{err}");

        let err = config
            .apply_env(|var| (var == "TASKSTREAM_RETRY_BACKOFF_MS").then(|| "-5".to_string()))
            .unwrap_err();
        assert_eq!(err.setting, "retry_backoff_ms");

        // Validation sees what the environment set, as it sees the file.
        let mut config = Config::embedded_default();
        config
            .apply_env(|var| (var == "TASKSTREAM_RETRY_MAX_ATTEMPTS").then(|| "0".to_string()))
            .unwrap();
        assert_eq!(config.validate().unwrap_err().setting, "retry_max_attempts");

        // Unknown TASKSTREAM_* names (the CLI's TASKSTREAM_ADDR) are not this table's business.
        let mut config = Config::default();
        config
            .apply_env(|var| (var == "TASKSTREAM_ADDR").then(|| "http://x".to_string()))
            .unwrap();
        assert_eq!(config, Config::default());
    }

    /// What a user sees for a bad value: the setting's path and what it takes,
    /// never a Rust type.
    #[test]
    fn toml_errors_name_the_path_and_accepted_values() {
        const PIPELINE: &str = "[[pipelines]]\nname = \"p\"\nsource_topic = \"t\"\n";
        let cases: [(String, &str, &[&str]); 10] = [
            (
                "slow_subscriber = \"bogus\"".into(),
                "slow_subscriber",
                &["`bogus`", "notify, fail"],
            ),
            (
                "processing_order = \"sideways\"".into(),
                "processing_order",
                &["`sideways`", "offset, key, unordered"],
            ),
            (
                "num_stream_threads = \"x\"".into(),
                "num_stream_threads",
                &["whole number"],
            ),
            (
                "retry_max_attempts = -1".into(),
                "retry_max_attempts",
                &["whole number"],
            ),
            (
                "num_stream_thread = 3".into(),
                "num_stream_thread",
                &["unknown field"],
            ),
            (
                format!("{PIPELINE}processor = {{ type = \"simulate\", latency_ms = \"x\" }}"),
                "pipelines[0].processor.latency_ms",
                &["[low, high]"],
            ),
            (
                format!("{PIPELINE}processor = \"count\"\nstore = \"disk\""),
                "pipelines[0].store",
                &["memory, persistent"],
            ),
            (
                format!("{PIPELINE}processor = {{ type = \"magic\" }}"),
                "pipelines[0].processor",
                &["`magic`", "count, sum, latest, simulate, custom"],
            ),
            (
                format!("{PIPELINE}processor = {{ type = \"count\", seed = 3 }}"),
                "pipelines[0].processor",
                &["`seed`"],
            ),
            (
                "[[pipelines]]\nname = \"p\"\nprocessor = \"count\"".into(),
                "pipelines[0]",
                &["missing field `source_topic`"],
            ),
        ];
        for (text, setting, needles) in cases {
            let err = Config::from_toml_str(&text).unwrap_err();
            assert_eq!(err.setting, setting, "{text}: {err}");
            for needle in needles {
                assert!(err.message.contains(needle), "{text}: {err} lacks {needle}");
            }
            for rust in [
                "LatencySpec",
                "ProcessorSpec",
                "usize",
                "u64",
                "u32",
                "f64",
                "variant",
                "struct",
            ] {
                assert!(!err.message.contains(rust), "{text}: {err} leaks `{rust}`");
            }
        }
        let err = Config::from_toml_str("num_stream_threads = ").unwrap_err();
        assert_eq!(err.setting, "config file");
        assert!(err.message.contains("line 1"), "{err}");
    }

    #[test]
    fn processor_tables_still_parse() {
        let config = Config::from_toml_str(
            "[[pipelines]]\nname = \"p\"\nsource_topic = \"t\"\n\
             processor = { type = \"simulate\", latency_ms = 2, cpu_work_us = 5, failure_rate = 0.5, fail_attempts = 1, seed = 9 }\n\
             [[pipelines]]\nname = \"q\"\nsource_topic = \"t\"\nprocessor = { type = \"custom\", name = \"mine\" }\n\
             [[pipelines]]\nname = \"r\"\nsource_topic = \"t\"\nprocessor = { type = \"latest\" }\n",
        )
        .unwrap();
        assert_eq!(
            config.pipelines[0].processor,
            ProcessorSpec::Simulate {
                latency_ms: Some(LatencySpec::Fixed(2.0)),
                cpu_work_us: 5,
                failure_rate: 0.5,
                fail_attempts: 1,
                seed: 9
            }
        );
        assert_eq!(
            config.pipelines[1].processor,
            ProcessorSpec::Custom { name: "mine".into() }
        );
        assert_eq!(config.pipelines[2].processor, ProcessorSpec::Latest);
    }

    #[test]
    fn grpc_processors_parse_and_validate() {
        let text = |table: &str, order: &str| {
            format!(
                "num_stream_threads = 4\nnum_threads_per_task = 4\nprocessing_order = \"{order}\"\n\
                 [[pipelines]]\nname = \"p\"\nsource_topic = \"t\"\nprocessor = {table}\n"
            )
        };
        let config = Config::from_toml_str(&text(
            "{ type = \"grpc\", endpoint = \"http://127.0.0.1:7000\", include_state = true, max_records_per_call = 50 }",
            "key",
        ))
        .unwrap();
        config.validate().unwrap();
        assert_eq!(
            config.pipelines[0].processor,
            ProcessorSpec::Grpc(GrpcProcessorSpec {
                endpoint: "http://127.0.0.1:7000".into(),
                include_state: true,
                max_records_per_call: 50,
                max_response_bytes: GrpcProcessorSpec::DEFAULT_MAX_RESPONSE_BYTES,
            })
        );

        // include_state with unordered and T > 1: both settings named.
        let config = Config::from_toml_str(&text(
            "{ type = \"grpc\", endpoint = \"http://127.0.0.1:7000\", include_state = true }",
            "unordered",
        ))
        .unwrap();
        let err = config.validate().unwrap_err();
        assert_eq!(err.setting, "pipelines[0].processor.include_state");
        assert!(err.message.contains("processing_order"), "{err}");
        // Without state, or with one thread per task, unordered is fine.
        let mut fine = config.clone();
        fine.num_threads_per_task = 1;
        fine.validate().unwrap();
        let config = Config::from_toml_str(&text(
            "{ type = \"grpc\", endpoint = \"http://127.0.0.1:7000\" }",
            "unordered",
        ))
        .unwrap();
        config.validate().unwrap();

        for (table, setting) in [
            (
                "{ type = \"grpc\", endpoint = \"127.0.0.1:7000\" }",
                "pipelines[0].processor.endpoint",
            ),
            (
                "{ type = \"grpc\", endpoint = \"https://h:1\" }",
                "pipelines[0].processor.endpoint",
            ),
            (
                "{ type = \"grpc\", endpoint = \"http://h\" }",
                "pipelines[0].processor.endpoint",
            ),
            (
                "{ type = \"grpc\", endpoint = \"http://h:1\", max_records_per_call = 0 }",
                "pipelines[0].processor.max_records_per_call",
            ),
            (
                "{ type = \"grpc\", endpoint = \"http://h:1\", max_response_bytes = 10 }",
                "pipelines[0].processor.max_response_bytes",
            ),
        ] {
            let config = Config::from_toml_str(&text(table, "offset")).unwrap();
            assert_eq!(config.validate().unwrap_err().setting, setting, "{table}");
        }
        for (table, needle) in [
            ("{ type = \"grpc\" }", "needs `endpoint`"),
            (
                "{ type = \"grpc\", endpoint = \"http://h:1\", seed = 1 }",
                "`seed` does not apply",
            ),
            (
                "{ type = \"count\", endpoint = \"http://h:1\" }",
                "`endpoint` does not apply",
            ),
        ] {
            let err = Config::from_toml_str(&text(table, "offset")).unwrap_err();
            assert_eq!(err.setting, "pipelines[0].processor", "{table}: {err}");
            assert!(err.message.contains(needle), "{table}: {err}");
        }
    }

    #[test]
    fn sink_topics_take_their_source_partitions_along_a_chain() {
        let config = Config::from_toml_str(
            "[[topics]]\nname = \"in\"\npartitions = 3\n\
             [[pipelines]]\nname = \"b\"\nsource_topic = \"a-out\"\nprocessor = \"count\"\nsink_topic = \"b-out\"\n\
             [[pipelines]]\nname = \"a\"\nsource_topic = \"in\"\nprocessor = \"count\"\nsink_topic = \"a-out\"\n",
        )
        .unwrap();
        config.validate().unwrap();
        let topics = config.topic_partitions().unwrap();
        assert_eq!((topics["in"], topics["a-out"], topics["b-out"]), (3, 3, 3));

        let mut config = Config::embedded_default();
        config.pipelines[0].sink_topic = Some("events".into());
        let err = config.validate().unwrap_err();
        assert_eq!(err.setting, "pipelines[0].sink_topic");
        assert!(err.message.contains("own source topic"), "{err}");
        config.pipelines[0].sink_topic = Some("taskstream-counts-dlq".into());
        assert!(config.validate().unwrap_err().message.contains("dead-letter"));
        config.pipelines[0].sink_topic = Some("taskstream-counts-changelog".into());
        assert!(config.validate().unwrap_err().message.contains("changelog"));
        config.pipelines[0].sink_topic = Some("bad name".into());
        assert_eq!(config.validate().unwrap_err().setting, "pipelines[0].sink_topic");
    }

    #[test]
    fn bad_values_name_their_setting() {
        let err = Config::from_toml_str("processing_order = \"sideways\"").unwrap_err();
        assert!(err.message.contains("accepted values"), "{err}");
        let err = Config::from_toml_str("num_stream_thread = 3").unwrap_err();
        assert!(err.to_string().contains("num_stream_thread"), "{err}");

        let mut config = Config::embedded_default();
        config.max_batch_records = 0;
        assert_eq!(config.validate().unwrap_err().setting, "max_batch_records");
        let mut config = Config::embedded_default();
        config.application_server = "nowhere".into();
        assert_eq!(config.validate().unwrap_err().setting, "application_server");
        let mut config = Config::embedded_default();
        config.pipelines[0].partitions = Some(3);
        assert_eq!(config.validate().unwrap_err().setting, "pipelines[0].partitions");
        let mut config = Config::embedded_default();
        config.store_cache_bytes = 1000;
        let err = config.validate().unwrap_err();
        assert_eq!(err.setting, "store_cache_bytes");
        assert!(err.message.contains("0 (no cache) or at least 65536"), "{err}");
        config.store_cache_bytes = 0;
        config.validate().unwrap();
        config.store_cache_bytes = MIN_STORE_CACHE_BYTES;
        config.validate().unwrap();
    }

    #[test]
    fn exactly_once_v2_needs_kafka_and_sync_commits_and_says_so() {
        let text = |extra: &str| {
            format!(
                r#"
                processing_guarantee = "exactly_once_v2"
                {extra}
                [[pipelines]]
                name = "counts"
                source_topic = "events"
                processor = "count"
                "#
            )
        };
        let config = Config::from_toml_str(&text("bootstrap_servers = \"127.0.0.1:9092\"")).unwrap();
        assert_eq!(config.processing_guarantee, ProcessingGuarantee::ExactlyOnceV2);
        config.validate().unwrap();

        let config = Config::from_toml_str(&text(
            "bootstrap_servers = \"127.0.0.1:9092\"\ncommit_mode = \"async\"",
        ))
        .unwrap();
        let err = config.validate().unwrap_err();
        assert_eq!(err.setting, "processing_guarantee");
        assert!(err.message.contains("commit_mode = \"sync\""), "{err}");
        assert!(err.message.contains("exactly_once_v2"), "{err}");

        let err = Config::from_toml_str(&text("")).unwrap().validate().unwrap_err();
        assert_eq!(err.setting, "processing_guarantee");
        assert!(err.message.contains("bootstrap_servers"), "{err}");

        let err = Config::from_toml_str("processing_guarantee = \"exactly_once\"").unwrap_err();
        assert!(err.to_string().contains("exactly_once_v2"), "{err}");
    }

    #[test]
    fn kafka_table_flattens_dotted_keys_and_rejects_what_taskstream_owns() {
        let config = Config::from_toml_str(
            r#"
            bootstrap_servers = "127.0.0.1:9092,SSL://broker:9093"
            replication_factor = 3
            [kafka]
            security.protocol = "SSL"
            "session.timeout.ms" = 6000
            socket.keepalive.enable = true
            [[pipelines]]
            name = "counts"
            source_topic = "events"
            processor = "count"
            "#,
        )
        .unwrap();
        config.validate().unwrap();
        assert_eq!(config.kafka["security.protocol"], "SSL");
        assert_eq!(config.kafka["session.timeout.ms"], "6000");
        assert_eq!(config.kafka["socket.keepalive.enable"], "true");
        assert_eq!(config.replication_factor, 3);

        let mut owned = config.clone();
        owned
            .kafka
            .insert("partitioner".into(), "consistent_random".into());
        let err = owned.validate().unwrap_err();
        assert_eq!(err.setting, "kafka.partitioner");
        assert!(err.message.contains("murmur2_random"), "{err}");

        let mut without_kafka = config.clone();
        without_kafka.bootstrap_servers = None;
        assert_eq!(
            without_kafka.validate().unwrap_err().setting,
            "kafka.security.protocol"
        );

        for bad in ["", "nohost", "127.0.0.1:notaport"] {
            let mut bad_servers = config.clone();
            bad_servers.bootstrap_servers = Some(bad.into());
            assert_eq!(
                bad_servers.validate().unwrap_err().setting,
                "bootstrap_servers",
                "{bad:?}"
            );
        }
        for bad in [0, -2, 40_000] {
            let mut bad_factor = config.clone();
            bad_factor.replication_factor = bad;
            assert_eq!(
                bad_factor.validate().unwrap_err().setting,
                "replication_factor",
                "{bad}"
            );
        }

        let mut retention = config.clone();
        retention.topics.push(TopicConfig {
            log_retention_ms: Some(1000),
            ..TopicConfig::new("events", 8)
        });
        let err = retention.validate().unwrap_err();
        assert_eq!(err.setting, "topics[0].log_retention_*");
        assert!(err.message.contains("retention.ms"), "{err}");

        let err = Config::from_toml_str("[kafka]\nssl.keystore = [1, 2]\n").unwrap_err();
        assert!(err.message.contains("kafka.ssl.keystore"), "{err}");
    }

    /// A certificate without its key (or the other way round), or a client CA without TLS,
    /// is refused naming both settings; TOML and the environment set the paths alike.
    #[test]
    fn tls_settings_go_together() {
        let base = Config::embedded_default();
        base.validate().unwrap();
        let with = |cert: bool, key: bool, ca: bool| Config {
            tls_cert: cert.then(|| PathBuf::from("server.pem")),
            tls_key: key.then(|| PathBuf::from("server.key")),
            tls_client_ca: ca.then(|| PathBuf::from("ca.pem")),
            ..base.clone()
        };
        with(true, true, false).validate().unwrap();
        with(true, true, true).validate().unwrap();
        for (cert, key, ca, setting, other) in [
            (true, false, false, "tls_cert", "tls_key"),
            (true, false, true, "tls_cert", "tls_key"),
            (false, true, false, "tls_key", "tls_cert"),
            (false, false, true, "tls_client_ca", "tls_cert"),
        ] {
            let err = with(cert, key, ca).validate().unwrap_err();
            assert_eq!(err.setting, setting, "{err}");
            assert!(err.message.contains(other), "{err}");
        }

        let mut config = base.clone();
        config
            .apply_env(|var| match var {
                "TASKSTREAM_TLS_CERT" => Some("/etc/ts/cert.pem".into()),
                "TASKSTREAM_TLS_KEY" => Some("/etc/ts/key.pem".into()),
                "TASKSTREAM_TLS_CLIENT_CA" => Some("/etc/ts/ca.pem".into()),
                _ => None,
            })
            .unwrap();
        assert_eq!(config.tls_cert, Some(PathBuf::from("/etc/ts/cert.pem")));
        assert_eq!(config.tls_key, Some(PathBuf::from("/etc/ts/key.pem")));
        assert_eq!(config.tls_client_ca, Some(PathBuf::from("/etc/ts/ca.pem")));
        let toml = Config::from_toml_str("tls_cert = \"c.pem\"\ntls_key = \"k.pem\"\n").unwrap();
        assert_eq!(toml.tls_cert, Some(PathBuf::from("c.pem")));
        assert_eq!(toml.tls_key, Some(PathBuf::from("k.pem")));
    }

    /// HTTPS metrics and a peer CA need the certificate; on Kafka a TLS instance that
    /// forwards queries needs the peer CA, and one that forwards nothing does not.
    #[test]
    fn metrics_tls_and_the_peer_ca_need_the_certificate() {
        let base = Config::embedded_default();
        let tls = Config {
            tls_cert: Some(PathBuf::from("server.pem")),
            tls_key: Some(PathBuf::from("server.key")),
            ..base.clone()
        };
        let err = Config {
            metrics_tls: true,
            ..base.clone()
        }
        .validate()
        .unwrap_err();
        assert_eq!(err.setting, "metrics_tls", "{err}");
        assert!(
            err.message.contains("tls_cert") && err.message.contains("tls_key"),
            "{err}"
        );
        Config {
            metrics_tls: true,
            ..tls.clone()
        }
        .validate()
        .unwrap();

        let err = Config {
            tls_peer_ca: Some(PathBuf::from("ca.pem")),
            ..base.clone()
        }
        .validate()
        .unwrap_err();
        assert_eq!(err.setting, "tls_peer_ca", "{err}");
        assert!(err.message.contains("tls_cert"), "{err}");

        let kafka = Config {
            bootstrap_servers: Some("127.0.0.1:9092".into()),
            ..tls.clone()
        };
        let err = kafka.validate().unwrap_err();
        assert_eq!(err.setting, "tls_peer_ca", "{err}");
        assert!(err.message.contains("forward_queries = false"), "{err}");
        Config {
            tls_peer_ca: Some(PathBuf::from("ca.pem")),
            ..kafka.clone()
        }
        .validate()
        .unwrap();
        Config {
            forward_queries: false,
            ..kafka.clone()
        }
        .validate()
        .unwrap();
        // Off Kafka nothing is forwarded: TLS alone is enough.
        tls.validate().unwrap();

        let mut config = base.clone();
        config
            .apply_env(|var| match var {
                "TASKSTREAM_METRICS_TLS" => Some("true".into()),
                "TASKSTREAM_TLS_PEER_CA" => Some("/etc/ts/peers.pem".into()),
                _ => None,
            })
            .unwrap();
        assert!(config.metrics_tls);
        assert_eq!(config.tls_peer_ca, Some(PathBuf::from("/etc/ts/peers.pem")));
    }
}
