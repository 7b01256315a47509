//! The metadata model: StreamsMetadata and per-task metadata as Kafka Streams
//! shows them, record outcomes published in batches (one per completed range,
//! or per run released in offset order), and the answers of queries and
//! topic reads. The subscriptions that stream outcomes belong to the runtime.
//! `cluster` is the view of which instance holds which partitions (Kafka mode).

pub mod cluster;

use crate::config::ProcessingOrder;
use crate::log::Record;
use bytes::Bytes;
use std::sync::Arc;

/// Where an instance can be reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostInfo {
    pub host: String,
    pub port: u16,
}

/// `host:port`, with an IPv6 host in brackets: what a client connects to.
impl std::fmt::Display for HostInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct TopicPartition {
    pub topic: String,
    pub partition: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskState {
    Restoring,
    Running,
    Suspended,
}

/// One task's live metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskMetadata {
    pub task_id: String,
    pub pipeline: String,
    pub topic: String,
    pub partition: u32,
    pub state: TaskState,
    pub owner_thread: String,
    pub helper_threads: Vec<String>,
    /// The order the task actually runs in (`offset` whenever T = 1).
    pub processing_order: ProcessingOrder,
    pub threads_per_task: u32,
    pub watermark: u64,
    pub committed_offset: u64,
    pub end_offset: u64,
    /// `end_offset - watermark`.
    pub lag: u64,
    pub in_flight: u64,
    pub retry_backlog: u64,
    pub records_processed: u64,
    pub records_failed: u64,
    pub records_dead_lettered: u64,
    /// Threads inside the task at this instant.
    pub active_threads: u32,
    /// Completed records waiting for earlier ones in the sequencer.
    pub held_records: u64,
    /// When the task's last commit succeeded (none since the start: `None`).
    pub last_commit: Option<std::time::SystemTime>,
}

/// What one instance hosts, as Kafka Streams' StreamsMetadata, plus its tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamsMetadata {
    pub host_info: HostInfo,
    pub state_store_names: Vec<String>,
    pub topic_partitions: Vec<TopicPartition>,
    pub standby_topic_partitions: Vec<TopicPartition>,
    pub tasks: Vec<TaskMetadata>,
}

/// The answer to `process_metadata_for_store`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreMetadata {
    pub instances: Vec<StreamsMetadata>,
    pub processing_order: ProcessingOrder,
    pub threads_per_task: u32,
    /// Whether results are delivered in offset order per partition.
    pub in_order: bool,
}

/// Partition and hosts of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyMetadata {
    pub store: String,
    pub topic: String,
    pub partition: u32,
    pub task_id: String,
    pub active_host: HostInfo,
    pub standby_hosts: Vec<HostInfo>,
}

/// Who answers a partition of a store: this instance, or another instance
/// of the application (Kafka mode, from the metadata topic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartitionOwner {
    Local,
    Remote(HostInfo),
}

/// One partition's answer to an interactive query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionQueryResult {
    pub partition: u32,
    /// The task's watermark when the store was read.
    pub position: u64,
    pub entries: Vec<(Bytes, Bytes)>,
    /// A persistent store answers from its last commit: when it was written
    /// (`None` for a live answer, or no commit since the start).
    pub committed_at: Option<std::time::SystemTime>,
}

/// The answer to `read_topic`: records of one partition, and the offsets that
/// say where the partition begins and ends now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicRead {
    /// From the requested offset on, in offset order (empty at or after the end).
    pub records: Vec<Record>,
    /// The oldest offset still retained.
    pub start_offset: u64,
    /// The next offset to be written.
    pub end_offset: u64,
    /// Partitions of the topic.
    pub partitions: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadState {
    /// Working on a task it owns.
    Owner,
    /// Lent to another thread's task.
    Helper,
    /// Nothing to do.
    Reserve,
    /// Finishing its range before it stops.
    Stopping,
    /// Lent to drain a retry topic.
    Retry,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadMetadata {
    pub name: String,
    pub state: ThreadState,
    pub owned_tasks: Vec<String>,
    pub current_task: Option<String>,
    pub records_processed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineMetadata {
    pub name: String,
    pub source_topic: String,
    pub partitions: u32,
    pub processor: String,
    /// The order the pipeline's tasks run in.
    pub processing_order: ProcessingOrder,
    pub threads_per_task: u32,
    pub store: String,
    pub store_kind: crate::config::StoreKind,
    pub retry_policy: crate::config::RetryPolicy,
    pub retry_topic: String,
    pub dead_letter_topic: String,
    /// Records of all partitions waiting in the retry topic for a final outcome.
    pub retry_backlog: u64,
    /// Records in the dead-letter topic.
    pub dead_lettered: u64,
    /// A remote processor's reachability (`None` for an in-process one).
    pub remote_processor: Option<crate::processor::remote::ProcessorStatus>,
    /// Where the processor's output records go, if anywhere.
    pub sink_topic: Option<String>,
}

/// The state of an instance, as Kafka Streams names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppState {
    Starting,
    Running,
    /// Running, while its consumer group moves partitions (Kafka mode).
    Rebalancing,
    /// Running, while tasks rebuild their stores (after start or a rebalance).
    Restoring,
    ShuttingDown,
    Stopped,
}

/// Everything `describe` reports about the runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeDescription {
    pub application_id: String,
    pub host_info: HostInfo,
    pub state: AppState,
    pub num_stream_threads: u32,
    pub num_reserve_threads: u32,
    /// Threads lent to retry topics at this instant.
    pub num_retry_threads: u32,
    pub threads: Vec<ThreadMetadata>,
    pub pipelines: Vec<PipelineMetadata>,
    pub tasks: Vec<TaskMetadata>,
    /// Storage that cannot be read or written right now.
    pub storage_faults: Vec<crate::health::StorageFault>,
}

/// The outcome of one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Processed,
    /// The processor failed and the record could not be sent to the retry
    /// path (the log refused it); final, so nothing waits for it.
    Failed,
    Retrying,
    DeadLettered,
}

impl Outcome {
    /// A final outcome ends a record's life; `Retrying` does not.
    pub fn is_final(self) -> bool {
        !matches!(self, Outcome::Retrying)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordOutcome {
    /// The stream thread that processed the record, when it is not the
    /// batch's (a batch released in offset order gathers several threads' records).
    pub thread: Option<Arc<str>>,
    pub offset: u64,
    /// The record's key, or its cut form (see [`outcome_key`]) when `key_truncated`.
    pub key: Option<Bytes>,
    pub key_truncated: bool,
    pub timestamp_ms: i64,
    pub outcome: Outcome,
    pub attempts: u32,
    /// At most [`MAX_OUTCOME_ERROR_BYTES`].
    pub error: Option<Arc<str>>,
}

/// Longest error text a record outcome keeps (a processor's message is cut, with `…`).
pub const MAX_OUTCOME_ERROR_BYTES: usize = 1024;

/// A key as record outcomes keep it: itself when at most `max` bytes (`false`), else its
/// first `max - 8` bytes followed by the FNV-1a 64-bit hash of the whole key, big-endian
/// (`true`), so distinct long keys stay apart while history stays bounded.
pub fn outcome_key(key: &Bytes, max: usize) -> (Bytes, bool) {
    if key.len() <= max {
        return (key.clone(), false);
    }
    let keep = max.saturating_sub(8);
    let hash = key.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let mut cut = Vec::with_capacity(keep + 8);
    cut.extend_from_slice(&key[..keep]);
    cut.extend_from_slice(&hash.to_be_bytes());
    (Bytes::from(cut), true)
}

/// The records of one completed unit, or of one run released in offset
/// order, as published to subscribers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeBatch {
    pub task_id: Arc<str>,
    pub pipeline: Arc<str>,
    pub topic: Arc<str>,
    pub partition: u32,
    pub thread: Arc<str>,
    /// The lowest offset among `records` (subscribers judge a batch by it and
    /// `last_offset` alone).
    pub first_offset: u64,
    /// The highest offset among `records`.
    pub last_offset: u64,
    pub records: Vec<RecordOutcome>,
    /// The records ran before, in an incarnation of the task whose
    /// transaction aborted (exactly_once_v2): these outcomes replace the
    /// ones published then, whose effects are gone.
    pub reprocessed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_keys_are_cut_with_a_hash_of_the_whole_key() {
        let short = Bytes::from_static(b"alice");
        assert_eq!(outcome_key(&short, 16), (short.clone(), false));
        let a = Bytes::from(vec![b'a'; 4 << 20]);
        let mut b = a.to_vec();
        b[(4 << 20) - 1] = b'b';
        let b = Bytes::from(b);
        let (cut_a, truncated) = outcome_key(&a, 1024);
        assert!(truncated);
        assert_eq!(cut_a.len(), 1024);
        assert_eq!(&cut_a[..1016], &a[..1016]);
        let (cut_b, _) = outcome_key(&b, 1024);
        // Same first bytes, different keys: the hash keeps them apart.
        assert_ne!(cut_a, cut_b);
        // FNV-1a 64 of "a" is af63dc4c8601ec8c.
        let (one, _) = outcome_key(&Bytes::from_static(b"aa"), 9);
        assert_eq!(&one[..1], b"a");
        let (hash_of_a, _) = outcome_key(&Bytes::from_static(b"a"), 0);
        assert_eq!(hash_of_a.as_ref(), 0xaf63_dc4c_8601_ec8c_u64.to_be_bytes());
    }
}
