//! What a `GetMetadataAsync` subscription asks for ([`MetadataOptions`]) and
//! what each callback receives ([`MetadataBatch`]).
//!
//! One payload type serves both modes: a streamed batch becomes a
//! `MetadataBatch` with one range, a coalesced stream one with every range.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use bytes::Bytes;
use taskstream::v1;

use crate::ClientError;

/// Where a subscription starts, per partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Start {
    /// At each partition's current watermark (records not completed yet).
    #[default]
    Latest,
    /// At the oldest record outcome the server still retains.
    Earliest,
    /// At these offsets (partition → first offset); only these partitions are streamed.
    Offsets(BTreeMap<u32, i64>),
}

/// Where a subscription ends, per partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum End {
    /// Follow: the stream never completes by itself.
    #[default]
    Open,
    /// At each partition's end offset at the time of the request.
    Current,
    /// At these offsets (partition → exclusive end); only these partitions are streamed.
    Offsets(BTreeMap<u32, i64>),
}

impl End {
    /// True when the stream completes by itself (`Current` or `Offsets`).
    pub fn is_bounded(&self) -> bool {
        !matches!(self, End::Open)
    }
}

/// Options of [`StreamsClient::get_metadata_async`](crate::StreamsClient::get_metadata_async).
///
/// The default follows every partition from the latest watermark, one
/// callback per streamed batch. Fields are public; the same-named methods
/// chain: `MetadataOptions::bounded().in_order(true).coalesce(true)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataOptions {
    /// Offset order per partition; refused (IllegalState) when the store's
    /// tasks run `key` or `unordered` order with several threads per task.
    pub in_order: bool,
    pub start: Start,
    pub end: End,
    /// At most this many records per streamed batch (0 = as completed).
    pub max_batch_records: u32,
    /// Only these partitions (empty = all).
    pub partitions: Vec<u32>,
    /// Collect the whole bounded stream and call back once with every record
    /// (sorted by partition and offset when `in_order`). Needs a bounded `end`.
    pub coalesce: bool,
    /// [`get_metadata_async_all`](crate::StreamsClient::get_metadata_async_all)
    /// only: when a partition's stream ends because the partition moved (or
    /// its instance went away), look for its new owner for at most this long
    /// and resume there after the last offset delivered (default
    /// [`DEFAULT_FOLLOW`]). `None`: the first such error ends the subscription.
    pub follow_moves: Option<Duration>,
}

/// How long a fan-in looks for a moved partition's new owner by default: a
/// rebalance after a crash waits for the consumer group's session timeout
/// (45 s by default) and then for the new owner's restore.
pub const DEFAULT_FOLLOW: Duration = Duration::from_secs(120);

impl Default for MetadataOptions {
    fn default() -> Self {
        MetadataOptions {
            in_order: false,
            start: Start::default(),
            end: End::default(),
            max_batch_records: 0,
            partitions: Vec::new(),
            coalesce: false,
            follow_moves: Some(DEFAULT_FOLLOW),
        }
    }
}

impl MetadataOptions {
    /// Follow from the latest watermark (same as `Default`).
    pub fn follow() -> Self {
        Self::default()
    }

    /// Everything the server retains up to the end offsets at the time of the
    /// request: start `Earliest`, end `Current`.
    pub fn bounded() -> Self {
        Self {
            start: Start::Earliest,
            end: End::Current,
            ..Self::default()
        }
    }

    pub fn in_order(mut self, in_order: bool) -> Self {
        self.in_order = in_order;
        self
    }

    pub fn start(mut self, start: Start) -> Self {
        self.start = start;
        self
    }

    pub fn end(mut self, end: End) -> Self {
        self.end = end;
        self
    }

    pub fn max_batch_records(mut self, max: u32) -> Self {
        self.max_batch_records = max;
        self
    }

    pub fn partitions(mut self, partitions: impl IntoIterator<Item = u32>) -> Self {
        self.partitions = partitions.into_iter().collect();
        self
    }

    pub fn coalesce(mut self, coalesce: bool) -> Self {
        self.coalesce = coalesce;
        self
    }

    /// See the field `follow_moves`; `None` turns following off.
    pub fn follow_moves(mut self, deadline: Option<Duration>) -> Self {
        self.follow_moves = deadline;
        self
    }

    /// Checks what only the client can know; everything else (offsets,
    /// partitions, the store) is the server's to validate.
    pub fn validate(&self) -> Result<(), ClientError> {
        if self.coalesce && !self.end.is_bounded() {
            return Err(ClientError::illegal_argument(
                "coalesce",
                "needs a bounded end (End::Current or End::Offsets): an open stream never completes",
            ));
        }
        Ok(())
    }

    /// The request these options stand for.
    pub fn to_request(&self, store: &str) -> v1::GetMetadataAsyncRequest {
        let (start, start_offsets) = match &self.start {
            Start::Latest => (v1::StartPosition::Latest, HashMap::new()),
            Start::Earliest => (v1::StartPosition::Earliest, HashMap::new()),
            Start::Offsets(offsets) => (v1::StartPosition::Offsets, offsets.clone().into_iter().collect()),
        };
        let (end, end_offsets) = match &self.end {
            End::Open => (v1::EndPosition::Open, HashMap::new()),
            End::Current => (v1::EndPosition::Current, HashMap::new()),
            End::Offsets(offsets) => (v1::EndPosition::Offsets, offsets.clone().into_iter().collect()),
        };
        v1::GetMetadataAsyncRequest {
            store: store.to_owned(),
            in_order: self.in_order,
            start: start as i32,
            start_offsets,
            end: end as i32,
            end_offsets,
            max_batch_records: self.max_batch_records,
            partitions: self.partitions.clone(),
        }
    }
}

/// The outcome of one record, with the partition it belongs to (the proto
/// `RecordMetadata` leaves the partition to its enclosing batch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordMetadata {
    pub partition: u32,
    pub offset: i64,
    /// Absent for records produced without a key. A key longer than the server's
    /// `outcome_key_bytes` arrives cut to that size, its last 8 bytes a hash of the
    /// whole key (`key_truncated`).
    pub key: Option<Bytes>,
    pub key_truncated: bool,
    /// Milliseconds since the Unix epoch.
    pub timestamp_ms: i64,
    pub outcome: v1::RecordOutcome,
    /// Processing attempts so far (1 on first success).
    pub attempts: u32,
    /// The failure, for FAILED, RETRYING and DEAD_LETTERED; empty otherwise.
    pub error: String,
    /// The stream thread that processed the record, when it is not its
    /// range's (`CompletedRange::thread`): in `offset` order with several
    /// threads per task, one range gathers the records several threads processed.
    pub thread: Option<String>,
}

impl RecordMetadata {
    fn from_proto(partition: u32, record: v1::RecordMetadata) -> Self {
        // `outcome()` maps an unknown enum value to UNSPECIFIED instead of failing.
        let outcome = record.outcome();
        RecordMetadata {
            partition,
            offset: record.offset,
            key: record.key,
            key_truncated: record.key_truncated,
            timestamp_ms: record.timestamp_ms,
            outcome,
            attempts: record.attempts,
            error: record.error,
            thread: (!record.thread.is_empty()).then_some(record.thread),
        }
    }

    /// True for a final failure: FAILED or DEAD_LETTERED.
    pub fn is_failed(&self) -> bool {
        matches!(
            self.outcome,
            v1::RecordOutcome::Failed | v1::RecordOutcome::DeadLettered
        )
    }
}

/// One completed range as the server streamed it (the header of a proto `MetadataBatch`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedRange {
    /// `<pipeline>_<partition>`.
    pub task_id: String,
    pub topic: String,
    pub partition: u32,
    /// The stream thread that processed the range.
    pub thread: String,
    pub first_offset: i64,
    pub last_offset: i64,
    /// How many records of the callback's `records` came from this range.
    pub record_count: usize,
    /// The range was processed again after its task was revived from its last
    /// commit (an aborted transaction under `exactly_once_v2`): the outcomes of
    /// its records were reported before, and their earlier effects never became
    /// visible.
    pub reprocessed: bool,
}

/// What one successful callback receives.
///
/// Per-batch mode: exactly one range (the streamed batch) and its records.
/// Coalesced mode: every range of the stream and all their records; sorted by
/// (partition, offset) when `in_order`, otherwise in arrival order. A record
/// reported twice (an intermediate RETRYING outcome, then the final one)
/// appears twice, in the order the server sent the outcomes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetadataBatch {
    pub store: String,
    pub ranges: Vec<CompletedRange>,
    pub records: Vec<RecordMetadata>,
}

impl MetadataBatch {
    /// The number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The range of a per-batch callback (the first one of a coalesced callback).
    pub fn range(&self) -> Option<&CompletedRange> {
        self.ranges.first()
    }

    /// The records of one partition, in the order of `records`.
    pub fn partition_records(&self, partition: u32) -> impl Iterator<Item = &RecordMetadata> {
        self.records.iter().filter(move |r| r.partition == partition)
    }
}

impl From<v1::MetadataBatch> for MetadataBatch {
    fn from(batch: v1::MetadataBatch) -> Self {
        let mut out = MetadataBatch {
            store: batch.store.clone(),
            ..Default::default()
        };
        out.push(batch);
        out
    }
}

impl MetadataBatch {
    fn push(&mut self, batch: v1::MetadataBatch) {
        let partition = batch.partition;
        self.ranges.push(CompletedRange {
            task_id: batch.task_id,
            topic: batch.topic,
            partition,
            thread: batch.thread,
            first_offset: batch.first_offset,
            last_offset: batch.last_offset,
            record_count: batch.records.len(),
            reprocessed: batch.reprocessed,
        });
        self.records.extend(
            batch
                .records
                .into_iter()
                .map(|r| RecordMetadata::from_proto(partition, r)),
        );
    }
}

/// Collects the batches of a bounded stream for the single coalesced callback.
#[derive(Debug)]
pub(crate) struct Coalescer {
    in_order: bool,
    batch: MetadataBatch,
}

impl Coalescer {
    pub(crate) fn new(store: &str, in_order: bool) -> Self {
        Coalescer {
            in_order,
            batch: MetadataBatch {
                store: store.to_owned(),
                ..Default::default()
            },
        }
    }

    pub(crate) fn push(&mut self, batch: v1::MetadataBatch) {
        self.batch.push(batch);
    }

    pub(crate) fn finish(self) -> MetadataBatch {
        let mut batch = self.batch;
        if self.in_order {
            // Stable sorts: equal keys (a RETRYING outcome and the final one of
            // the same offset) keep the order the server sent them in.
            batch.ranges.sort_by_key(|r| (r.partition, r.first_offset));
            batch.records.sort_by_key(|r| (r.partition, r.offset));
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(offset: i64, outcome: v1::RecordOutcome) -> v1::RecordMetadata {
        v1::RecordMetadata {
            offset,
            key: Some(Bytes::from(format!("k{offset}"))),
            timestamp_ms: 1_700_000_000_000 + offset,
            outcome: outcome as i32,
            attempts: 1,
            error: String::new(),
            thread: String::new(),
            key_truncated: false,
        }
    }

    fn batch(partition: u32, thread: &str, offsets: std::ops::RangeInclusive<i64>) -> v1::MetadataBatch {
        v1::MetadataBatch {
            task_id: format!("counts_{partition}"),
            store: "counts".into(),
            topic: "events".into(),
            partition,
            thread: thread.into(),
            first_offset: *offsets.start(),
            last_offset: *offsets.end(),
            reprocessed: false,
            records: offsets.map(|o| record(o, v1::RecordOutcome::Processed)).collect(),
        }
    }

    #[test]
    fn default_follows_latest() {
        let request = MetadataOptions::default().to_request("counts");
        assert_eq!(request.store, "counts");
        assert!(!request.in_order);
        assert_eq!(request.start(), v1::StartPosition::Latest);
        assert_eq!(request.end(), v1::EndPosition::Open);
        assert!(request.start_offsets.is_empty() && request.end_offsets.is_empty());
        assert_eq!(MetadataOptions::follow(), MetadataOptions::default());
    }

    #[test]
    fn builder_and_offsets_reach_the_request() {
        let options = MetadataOptions::default()
            .in_order(true)
            .start(Start::Offsets(BTreeMap::from([(0, 5), (3, 7)])))
            .end(End::Offsets(BTreeMap::from([(0, 10), (3, 9)])))
            .max_batch_records(100)
            .partitions([0, 3])
            .coalesce(true);
        assert!(options.validate().is_ok());
        let request = options.to_request("counts");
        assert!(request.in_order);
        assert_eq!(request.start(), v1::StartPosition::Offsets);
        assert_eq!(request.start_offsets, HashMap::from([(0, 5), (3, 7)]));
        assert_eq!(request.end(), v1::EndPosition::Offsets);
        assert_eq!(request.end_offsets, HashMap::from([(0, 10), (3, 9)]));
        assert_eq!(request.max_batch_records, 100);
        assert_eq!(request.partitions, vec![0, 3]);
    }

    #[test]
    fn bounded_is_earliest_to_current() {
        let request = MetadataOptions::bounded().to_request("s");
        assert_eq!(request.start(), v1::StartPosition::Earliest);
        assert_eq!(request.end(), v1::EndPosition::Current);
    }

    #[test]
    fn coalesce_needs_a_bounded_end() {
        let error = MetadataOptions::follow().coalesce(true).validate().unwrap_err();
        let ClientError::IllegalArgument { field_violations, .. } = &error else {
            panic!("expected IllegalArgument, got {error:?}");
        };
        assert_eq!(field_violations[0].field, "coalesce");
        assert!(MetadataOptions::bounded().coalesce(true).validate().is_ok());
        assert!(
            MetadataOptions::follow()
                .end(End::Offsets(BTreeMap::new()))
                .coalesce(true)
                .validate()
                .is_ok()
        );
        assert!(MetadataOptions::follow().validate().is_ok());
    }

    #[test]
    fn one_streamed_batch_is_one_range() {
        let out = MetadataBatch::from(batch(2, "stream-thread-1", 10..=12));
        assert_eq!(out.store, "counts");
        assert_eq!(out.len(), 3);
        let range = out.range().expect("one range");
        assert_eq!(
            (range.partition, range.first_offset, range.last_offset),
            (2, 10, 12)
        );
        assert_eq!(range.record_count, 3);
        assert_eq!(range.thread, "stream-thread-1");
        assert!(out.records.iter().all(|r| r.partition == 2));
        assert_eq!(out.records[0].key.as_deref(), Some(&b"k10"[..]));
        assert_eq!(out.records[0].outcome, v1::RecordOutcome::Processed);
    }

    #[test]
    fn coalesced_in_order_sorts_by_partition_and_offset() {
        let mut coalescer = Coalescer::new("counts", true);
        // Batches of several partitions interleaved, as several threads complete them.
        coalescer.push(batch(1, "t2", 5..=9));
        coalescer.push(batch(0, "t1", 3..=4));
        coalescer.push(batch(1, "t1", 0..=4));
        coalescer.push(batch(0, "t2", 0..=2));
        let out = coalescer.finish();
        assert_eq!(out.store, "counts");
        assert_eq!(out.ranges.len(), 4);
        let keys: Vec<(u32, i64)> = out.records.iter().map(|r| (r.partition, r.offset)).collect();
        let expected: Vec<(u32, i64)> = (0..5).map(|o| (0, o)).chain((0..10).map(|o| (1, o))).collect();
        assert_eq!(keys, expected);
        let ranges: Vec<(u32, i64)> = out.ranges.iter().map(|r| (r.partition, r.first_offset)).collect();
        assert_eq!(ranges, vec![(0, 0), (0, 3), (1, 0), (1, 5)]);
    }

    #[test]
    fn coalesced_unordered_keeps_arrival_order() {
        let mut coalescer = Coalescer::new("counts", false);
        coalescer.push(batch(1, "t2", 5..=6));
        coalescer.push(batch(0, "t1", 0..=0));
        let out = coalescer.finish();
        let keys: Vec<(u32, i64)> = out.records.iter().map(|r| (r.partition, r.offset)).collect();
        assert_eq!(keys, vec![(1, 5), (1, 6), (0, 0)]);
    }

    #[test]
    fn coalesced_sort_is_stable_for_repeated_outcomes() {
        let mut coalescer = Coalescer::new("counts", true);
        let mut retrying = batch(0, "t1", 1..=1);
        retrying.records[0].outcome = v1::RecordOutcome::Retrying as i32;
        let mut dead = batch(0, "t1", 1..=1);
        dead.records[0].outcome = v1::RecordOutcome::DeadLettered as i32;
        coalescer.push(retrying);
        coalescer.push(batch(0, "t2", 0..=0));
        coalescer.push(dead);
        let out = coalescer.finish();
        let outcomes: Vec<(i64, v1::RecordOutcome)> =
            out.records.iter().map(|r| (r.offset, r.outcome)).collect();
        assert_eq!(
            outcomes,
            vec![
                (0, v1::RecordOutcome::Processed),
                (1, v1::RecordOutcome::Retrying),
                (1, v1::RecordOutcome::DeadLettered)
            ]
        );
        assert!(out.records[2].is_failed());
    }

    #[test]
    fn empty_coalesced_stream_is_an_empty_batch() {
        let out = Coalescer::new("counts", true).finish();
        assert!(out.is_empty());
        assert!(out.ranges.is_empty());
        assert_eq!(out.store, "counts");
    }

    #[test]
    fn unknown_outcome_value_does_not_fail() {
        let mut b = batch(0, "t", 0..=0);
        b.records[0].outcome = 99;
        let out = MetadataBatch::from(b);
        assert_eq!(out.records[0].outcome, v1::RecordOutcome::Unspecified);
    }
}
