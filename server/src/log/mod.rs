//! The source/sink abstraction: partitioned, append-only topics with offsets and
//! committed offsets per group, behind the `Log` trait. `MemoryLog` is the
//! embedded implementation (`RedbLog` its durable form); `KafkaLog` is the
//! same trait on Apache Kafka.
//! Keys are routed exactly as Kafka's default partitioner (`partitioner`).

#[cfg(test)]
mod contract;
mod durable;
mod kafka;
mod kafka_group;
mod memory;
pub mod partitioner;

pub use durable::{Peeked, RedbLog};
pub use kafka::KafkaLog;
pub use kafka_group::{GroupListener, GroupPartition};
pub use memory::MemoryLog;
pub use partitioner::{murmur2, partition_for_key};

use bytes::Bytes;
use std::sync::Arc;

/// A record as stored in a topic partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub partition: u32,
    pub offset: u64,
    /// Milliseconds since the Unix epoch.
    pub timestamp_ms: i64,
    pub key: Option<Bytes>,
    pub value: Bytes,
    pub headers: Vec<(String, Bytes)>,
}

/// A record to append. Without `partition`, a keyed record goes to Kafka's
/// default partition for its key and an unkeyed one is spread round-robin.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProducerRecord {
    pub key: Option<Bytes>,
    pub value: Bytes,
    pub partition: Option<u32>,
    /// Milliseconds since the Unix epoch; `None` = append time.
    pub timestamp_ms: Option<i64>,
    pub headers: Vec<(String, Bytes)>,
}

impl ProducerRecord {
    pub fn keyed(key: impl Into<Bytes>, value: impl Into<Bytes>) -> Self {
        ProducerRecord {
            key: Some(key.into()),
            value: value.into(),
            ..ProducerRecord::default()
        }
    }
}

/// Where an appended record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordPosition {
    pub partition: u32,
    pub offset: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    #[error("unknown topic `{0}`")]
    UnknownTopic(String),
    #[error("topic `{topic}` has {partitions} partitions; partition {partition} does not exist")]
    UnknownPartition {
        topic: String,
        partition: u32,
        partitions: u32,
    },
    #[error("topic `{topic}` already exists with {existing} partitions, not {requested}")]
    PartitionCountMismatch {
        topic: String,
        existing: u32,
        requested: u32,
    },
    #[error("offset {requested} of {topic}-{partition} is no longer retained (earliest is {earliest})")]
    OffsetOutOfRange {
        topic: String,
        partition: u32,
        requested: u64,
        earliest: u64,
    },
    #[error("log unavailable: {0}")]
    Unavailable(String),
    /// The log refuses a record of the append for good (Kafka: over the
    /// producer's `message.max.bytes`, or the broker's limit for the topic):
    /// no wait mends it. Refused before anything is sent, nothing of the
    /// append is written; refused by the broker, the others may be.
    #[error("`{topic}` refuses the record: {reason}")]
    Rejected { topic: String, reason: String },
    /// A transaction did not commit: everything written in it is gone
    /// (exactly_once_v2). `fenced`: its producer cannot go on (another
    /// producer of the id, or the broker, fenced it); else it has a new
    /// transaction open.
    #[error("transaction {transaction} aborted: {reason}")]
    TransactionAborted {
        transaction: String,
        reason: String,
        fenced: bool,
    },
    /// The data on disk cannot be read or written: corrupt, unreadable, full.
    #[error("data file {path}: {message}")]
    Storage { path: String, message: String },
}

/// How long a topic keeps its records. Records are removed oldest first, and
/// only below the offset every consumer still needs (`keep_from`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    /// Per partition: remove the oldest records while the partition holds more bytes than this.
    pub max_bytes: Option<u64>,
    /// Remove records whose timestamp is older than this many milliseconds.
    pub max_age_ms: Option<u64>,
}

impl Retention {
    pub fn is_unlimited(&self) -> bool {
        self.max_bytes.is_none() && self.max_age_ms.is_none()
    }
}

/// Bytes a record counts for in `Retention::max_bytes`: its payload plus a
/// fixed 16 for offset and timestamp.
pub fn record_size(key: Option<&[u8]>, value: &[u8], headers: &[(String, Bytes)]) -> u64 {
    16 + payload_bytes(key, value, headers) as u64
}

/// What a record carries: key, value, header names and values. The measure of
/// the limits on answers and on a staged ProduceStream.
pub fn payload_bytes(key: Option<&[u8]>, value: &[u8], headers: &[(String, Bytes)]) -> usize {
    key.map_or(0, <[u8]>::len)
        + value.len()
        + headers
            .iter()
            .map(|(name, v)| name.len() + v.len())
            .sum::<usize>()
}

/// Called with (topic, partition) after records are appended, so waiting
/// stream threads wake without polling.
pub type AppendListener = Arc<dyn Fn(&str, u32) + Send + Sync>;

/// A partitioned log. Implementations are shared by all stream threads.
pub trait Log: Send + Sync + 'static {
    /// Creates `topic` with `partitions`, or checks that it has that many.
    fn ensure_topic(&self, topic: &str, partitions: u32) -> Result<(), LogError>;

    /// Partition count of `topic`.
    fn partitions(&self, topic: &str) -> Result<u32, LogError>;

    /// Appends records; answers each record's position, in order.
    fn append(&self, topic: &str, records: Vec<ProducerRecord>) -> Result<Vec<RecordPosition>, LogError>;

    /// Whether one `append` writes all of its records or none of them, whatever
    /// fails. ProduceStream stages a whole stream into one append where this
    /// holds; Kafka without a transaction can fail part way, so it answers false.
    fn append_is_atomic(&self) -> bool {
        true
    }

    /// Appends like `append`, but the records may be lost in a crash until `flush`
    /// returns (or another durable write of the log): they are readable at once.
    /// The runtime appends failed records this way and flushes before the commit
    /// that covers them, so a record never counts as done while its retry entry
    /// could still vanish. The records are borrowed: a caller that must append
    /// them again after an error keeps them without a copy. Default: `append`.
    fn append_unflushed(&self, topic: &str, records: &[ProducerRecord]) -> Result<(), LogError> {
        self.append(topic, records.to_vec()).map(drop)
    }

    /// Whether `topic` would refuse `record` for good (`LogError::Rejected`:
    /// too large for the log), told before anything is appended: a
    /// processor's output the sink topic would refuse, or a store write its
    /// changelog would, fails its record instead of every later append of
    /// the sink or changelog (and so every commit). Default: any record fits.
    fn check_record(&self, _topic: &str, _record: &ProducerRecord) -> Result<(), LogError> {
        Ok(())
    }

    /// Makes every record appended so far durable. Default: nothing to do.
    fn flush(&self) -> Result<(), LogError> {
        Ok(())
    }

    /// Up to `max` records of one partition starting at `offset`, appended to `out`.
    /// An offset at or past the end yields nothing.
    fn read(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
        out: &mut Vec<Record>,
    ) -> Result<(), LogError>;

    /// The next offset that will be written.
    fn end_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError>;

    /// The oldest offset still retained.
    fn start_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError>;

    /// Records `offset` (the next offset to process) as committed for `group`.
    fn commit(&self, group: &str, topic: &str, partition: u32, offset: u64) -> Result<(), LogError>;

    /// The committed offset of `group`, if it ever committed.
    fn committed(&self, group: &str, topic: &str, partition: u32) -> Result<Option<u64>, LogError>;

    /// Registers a listener called after every append.
    fn add_append_listener(&self, listener: AppendListener);

    /// The log as Apache Kafka, for what only Kafka has (consumer groups,
    /// changelogs, transactions); `None` for the embedded logs.
    fn as_kafka(&self) -> Option<&KafkaLog> {
        None
    }

    /// What says whether the storage under the log is failing, for a log kept on storage that
    /// can fail (`RedbLog`); `None` for one that cannot.
    fn storage_health(&self) -> Option<Arc<crate::health::StorageHealth>> {
        None
    }

    /// Removes the oldest records of a partition that `retention` no longer
    /// keeps, never one at or after `keep_from`; answers the new start offset.
    fn enforce_retention(
        &self,
        topic: &str,
        partition: u32,
        retention: Retention,
        keep_from: u64,
        now_ms: i64,
    ) -> Result<u64, LogError>;
}
