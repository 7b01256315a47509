//! Typed, validated configuration: one `Config` read from TOML (then overridden
//! by environment and flags in the binary), checked once at start. Every
//! rejection is a `ConfigError` that names the setting and says how to fix it.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

/// How the records of one task are ordered while several threads process it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
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
        match self {
            ProcessingOrder::Offset => "offset",
            ProcessingOrder::Key => "key",
            ProcessingOrder::Unordered => "unordered",
        }
    }

    /// Parses the config spelling (`offset`, `key`, `unordered`).
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "offset" => Some(ProcessingOrder::Offset),
            "key" => Some(ProcessingOrder::Key),
            "unordered" => Some(ProcessingOrder::Unordered),
            _ => None,
        }
    }
}

impl fmt::Display for ProcessingOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a commit blocks the committing thread (`sync`) or is handed to a
/// committer that applies commits in order and reports each to a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CommitMode {
    #[default]
    Sync,
    Async,
}

/// What happens to a stream subscriber too slow for its bounded buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SlowSubscriberPolicy {
    /// Tell it in-band how many batches it missed and go on.
    #[default]
    Notify,
    /// End its stream with RESOURCE_EXHAUSTED.
    Fail,
}

/// Where a pipeline keeps its state store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
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
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Persistent => "persistent",
        }
    }
}

/// What happens to a record whose processor fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
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
        match self {
            RetryPolicy::RetryTopic => "retry_topic",
            RetryPolicy::Blocking => "blocking",
        }
    }
}

/// Latency of the `simulate` processor: a fixed number of milliseconds, or a
/// `[low, high]` range drawn uniformly per record.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum LatencySpec {
    Fixed(f64),
    Uniform([f64; 2]),
}

/// Which processor a pipeline runs, with its parameters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ProcessorSpec {
    /// Count of records per key (stored as decimal text).
    Count,
    /// Sum of values parsed as i64 per key (decimal text); a bad value fails the record.
    Sum,
    /// Last value per key.
    Latest,
    /// Synthetic work for tests and benchmarks; counts per key like `count`.
    Simulate {
        #[serde(default)]
        latency_ms: Option<LatencySpec>,
        /// Microseconds of hashing per record (busy CPU work).
        #[serde(default)]
        cpu_work_us: u64,
        /// Fraction of records (0.0–1.0, chosen by offset) whose processing fails.
        #[serde(default)]
        failure_rate: f64,
        /// A failing record fails this many attempts, then succeeds (0 = always fails).
        #[serde(default)]
        fail_attempts: u32,
        /// Seed of the per-record draws, so runs are reproducible.
        #[serde(default)]
        seed: u64,
    },
    /// A processor registered in code with `AppBuilder::processor(name, …)`.
    Custom { name: String },
}

impl ProcessorSpec {
    pub fn name(&self) -> &str {
        match self {
            ProcessorSpec::Count => "count",
            ProcessorSpec::Sum => "sum",
            ProcessorSpec::Latest => "latest",
            ProcessorSpec::Simulate { .. } => "simulate",
            ProcessorSpec::Custom { name } => name,
        }
    }
}

/// A processor is written either as a bare name (`processor = "count"`) or as
/// a table with `type` and parameters.
fn deserialize_processor<'de, D>(deserializer: D) -> Result<ProcessorSpec, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Field {
        Name(String),
        Table(toml::Table),
    }
    match Field::deserialize(deserializer)? {
        Field::Name(name) => match name.as_str() {
            "count" => Ok(ProcessorSpec::Count),
            "sum" => Ok(ProcessorSpec::Sum),
            "latest" => Ok(ProcessorSpec::Latest),
            "simulate" => Ok(ProcessorSpec::Simulate {
                latency_ms: None,
                cpu_work_us: 0,
                failure_rate: 0.0,
                fail_attempts: 0,
                seed: 0,
            }),
            _ => Ok(ProcessorSpec::Custom { name }),
        },
        Field::Table(table) => ProcessorSpec::deserialize(table).map_err(serde::de::Error::custom),
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
    /// Largest work range one thread takes at once.
    pub max_batch_records: usize,
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
    pub topics: Vec<TopicConfig>,
    pub pipelines: Vec<PipelineConfig>,
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
            max_batch_records: 500,
            max_in_flight_records: 10_000,
            outcome_retention_records: 100_000,
            subscriber_buffer_batches: 1024,
            slow_subscriber: SlowSubscriberPolicy::Notify,
            data_dir: None,
            retry_policy: RetryPolicy::RetryTopic,
            retry_max_attempts: 3,
            retry_backoff_ms: 100,
            retry_backoff_max_ms: 10_000,
            processing_timeout_ms: 30_000,
            topics: Vec::new(),
            pipelines: Vec::new(),
        }
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

    /// Parses TOML; unknown keys and wrong types are errors naming the key.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let message = e.message().to_string();
            let setting = e
                .span()
                .and_then(|span| text.get(span))
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty() && s.len() < 80)
                .unwrap_or_else(|| "config file".to_string());
            ConfigError::new(setting, message)
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

    /// The dead-letter topic of a pipeline: `<application_id>-<pipeline>-dlq`.
    pub fn dead_letter_topic(&self, pipeline: &str) -> String {
        format!("{}-{pipeline}-dlq", self.application_id)
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

    /// The partitions of every topic: declared topics, then pipeline sources.
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
                (None, None) => {
                    topics.insert(pipeline.source_topic.clone(), 1);
                }
            }
        }
        Ok(topics)
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
            ("max_in_flight_records", self.max_in_flight_records),
            ("outcome_retention_records", self.outcome_retention_records),
            ("subscriber_buffer_batches", self.subscriber_buffer_batches),
        ];
        for (setting, value) in positive {
            if value == 0 {
                return Err(ConfigError::new(setting, "must be at least 1"));
            }
        }
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
            if pipeline.store == Some(StoreKind::Persistent) && self.data_dir.is_none() {
                return Err(ConfigError::new(
                    format!("pipelines[{i}].store"),
                    "a persistent store needs a data dir; set data_dir (--data-dir) or use store = \"memory\"",
                ));
            }
        }
        self.topic_partitions()?;
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

    #[test]
    fn bad_values_name_their_setting() {
        let err = Config::from_toml_str("processing_order = \"sideways\"").unwrap_err();
        assert!(err.message.contains("unknown variant"), "{err}");
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
    }
}
