//! The retry path of one task: records that failed (or wait behind a failed
//! record of their key) sit in the pipeline's retry topic; the task keeps the
//! not-yet-final ones in a `RetryQueue` with their due time, hands them to
//! reserve threads with exponential, capped, jittered backoff, and tracks the
//! retry-topic watermark that is committed with the source watermark.

use super::sequencer::Sequencer;
use crate::log::{Log, LogError, ProducerRecord, Record};
use crate::processor::splitmix64;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Header names of retry and dead-letter records. The error and source
/// headers are those of Kafka Streams' dead-letter queue (KIP-1034), so tools
/// that read Kafka Streams DLQs read ours.
pub mod headers {
    pub const EXCEPTION: &str = "__streams.errors.exception";
    pub const MESSAGE: &str = "__streams.errors.message";
    pub const TOPIC: &str = "__streams.errors.topic";
    pub const PARTITION: &str = "__streams.errors.partition";
    pub const OFFSET: &str = "__streams.errors.offset";
    /// Processing attempts made so far (0 for a record parked behind its key).
    pub const ATTEMPTS: &str = "taskstream.errors.attempts";
    pub const FIRST_FAILURE_MS: &str = "taskstream.errors.first_failure_ms";
    pub const LAST_FAILURE_MS: &str = "taskstream.errors.last_failure_ms";
    /// The original record's timestamp (the retry record carries it too).
    pub const TIMESTAMP_MS: &str = "taskstream.errors.timestamp_ms";
    /// On a marker record of the retry topic: the retry offsets (decimal,
    /// comma-separated) that are void — written by a pass a restart discarded.
    pub const VOID: &str = "taskstream.retry.void";
    /// Prefix of every header the runtime adds; removed before a retry attempt.
    pub(crate) const PREFIXES: [&str; 3] = ["__streams.errors.", "taskstream.errors.", "taskstream.retry."];
}

/// Why a record is on the retry path and what happened to it so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// Short error type, e.g. `SimulatedFailure`, `Timeout`, `Panic`.
    pub(crate) kind: String,
    pub(crate) message: String,
    pub(crate) attempts: u32,
    pub(crate) first_failure_ms: i64,
    pub(crate) last_failure_ms: i64,
}

/// A record of the retry topic, decoded: the source record as the processor
/// saw it, and its failure so far.
#[derive(Debug, Clone)]
pub(crate) struct RetryItem {
    /// Offset in the retry topic.
    pub(crate) retry_offset: u64,
    /// The source record (source partition and offset, original headers).
    pub(crate) record: Record,
    pub(crate) failure: Failure,
    /// Epoch milliseconds at which the next attempt may start.
    pub(crate) due_ms: i64,
    /// A void marker (see `headers::VOID`), not a record to retry.
    pub(crate) marker: bool,
}

/// The backoff after `attempts` failed attempts: `base · 2^(attempts−1)`,
/// capped at `max`, times a jitter in [0.5, 1.0] drawn from `seed`, so
/// records that failed together do not all come back at the same instant.
pub(crate) fn backoff(attempts: u32, base_ms: u64, max_ms: u64, seed: u64) -> Duration {
    let exponent = attempts.saturating_sub(1).min(32);
    let raw = base_ms.saturating_mul(1u64 << exponent).min(max_ms);
    let jitter = 0.5 + 0.5 * ((splitmix64(seed) >> 11) as f64 / (1u64 << 53) as f64);
    Duration::from_millis((raw as f64 * jitter) as u64)
}

/// The record to append to the retry or dead-letter topic: the raw key and
/// value unchanged, the original headers, then the error headers.
pub(crate) fn failed_record(source_topic: &str, record: &Record, failure: &Failure) -> ProducerRecord {
    let mut headers: Vec<(String, Bytes)> = record
        .headers
        .iter()
        .filter(|(name, _)| !is_runtime_header(name))
        .cloned()
        .collect();
    let text = |value: String| Bytes::from(value.into_bytes());
    headers.extend([
        (headers::EXCEPTION.to_string(), text(failure.kind.clone())),
        (headers::MESSAGE.to_string(), text(failure.message.clone())),
        (headers::TOPIC.to_string(), text(source_topic.to_string())),
        (headers::PARTITION.to_string(), text(record.partition.to_string())),
        (headers::OFFSET.to_string(), text(record.offset.to_string())),
        (headers::ATTEMPTS.to_string(), text(failure.attempts.to_string())),
        (
            headers::FIRST_FAILURE_MS.to_string(),
            text(failure.first_failure_ms.to_string()),
        ),
        (
            headers::LAST_FAILURE_MS.to_string(),
            text(failure.last_failure_ms.to_string()),
        ),
        (
            headers::TIMESTAMP_MS.to_string(),
            text(record.timestamp_ms.to_string()),
        ),
    ]);
    ProducerRecord {
        key: record.key.clone(),
        value: record.value.clone(),
        partition: Some(record.partition),
        timestamp_ms: Some(record.timestamp_ms),
        headers,
    }
}

fn is_runtime_header(name: &str) -> bool {
    headers::PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

fn header<T: std::str::FromStr>(record: &Record, name: &str) -> Option<T> {
    let (_, value) = record.headers.iter().rev().find(|(n, _)| n == name)?;
    std::str::from_utf8(value).ok()?.parse().ok()
}

fn header_text(record: &Record, name: &str) -> String {
    header::<String>(record, name).unwrap_or_default()
}

/// Decodes a retry-topic record. A record missing runtime headers (written by
/// hand) is retried as a first failure of its own offset.
pub(crate) fn decode(retry: Record, backoff_of: impl Fn(u32, u64) -> Duration) -> RetryItem {
    let marker = retry.headers.iter().any(|(name, _)| name == headers::VOID);
    let attempts = header(&retry, headers::ATTEMPTS).unwrap_or(1);
    let last_failure_ms = header(&retry, headers::LAST_FAILURE_MS).unwrap_or(retry.timestamp_ms);
    let failure = Failure {
        kind: header_text(&retry, headers::EXCEPTION),
        message: header_text(&retry, headers::MESSAGE),
        attempts,
        first_failure_ms: header(&retry, headers::FIRST_FAILURE_MS).unwrap_or(last_failure_ms),
        last_failure_ms,
    };
    let retry_offset = retry.offset;
    // A parked record (0 attempts) is due as soon as its key is free.
    let due_ms = if attempts == 0 {
        0
    } else {
        last_failure_ms.saturating_add(backoff_of(attempts, retry_offset).as_millis() as i64)
    };
    let record = Record {
        partition: header(&retry, headers::PARTITION).unwrap_or(retry.partition),
        offset: header(&retry, headers::OFFSET).unwrap_or(retry.offset),
        timestamp_ms: header(&retry, headers::TIMESTAMP_MS).unwrap_or(retry.timestamp_ms),
        headers: retry
            .headers
            .into_iter()
            .filter(|(name, _)| !is_runtime_header(name))
            .collect(),
        key: retry.key,
        value: retry.value,
    };
    RetryItem {
        retry_offset,
        record,
        failure,
        due_ms,
        marker,
    }
}

/// A marker record saying the retry entries at `offsets` are void.
pub(crate) fn void_marker(partition: u32, offsets: &[u64]) -> ProducerRecord {
    let list: Vec<String> = offsets.iter().map(u64::to_string).collect();
    ProducerRecord {
        partition: Some(partition),
        headers: vec![(headers::VOID.to_string(), Bytes::from(list.join(",")))],
        ..ProducerRecord::default()
    }
}

/// The offsets a void marker voids; `None` for any other record.
pub(crate) fn voided_offsets(record: &Record) -> Option<Vec<u64>> {
    let (_, value) = record.headers.iter().find(|(name, _)| name == headers::VOID)?;
    let text = std::str::from_utf8(value).ok()?;
    Some(text.split(',').filter_map(|o| o.trim().parse().ok()).collect())
}

/// What a task finds on its retry path at start.
pub(crate) struct RetryBacklog {
    /// Retry offsets that must not run: final before the restart (from the
    /// store's checkpoint), void (see below), and the void markers themselves.
    pub(crate) final_offsets: Vec<u64>,
    /// Source offsets whose entries are genuinely pending: a replay of the
    /// source (memory-store restore) leaves them to the retry path.
    pub(crate) pending_sources: HashSet<u64>,
    /// `key` order: the keys of the pending entries, one per entry, to park.
    pub(crate) pending_keys: Vec<Bytes>,
}

impl RetryBacklog {
    /// Reads the retry-topic partition over `range` (from the committed retry
    /// position to the end). An entry for a source offset at or after
    /// `source_start` was written by a pass the restart discards: the source
    /// pass will run that record again, in its place among its key's records,
    /// so the old entry is void. A void marker appended to the retry topic
    /// makes that durable, so no later restart, with a later watermark, takes
    /// the entry for a pending one.
    pub(crate) fn scan(
        log: &dyn Log,
        topic: &str,
        partition: u32,
        range: std::ops::Range<u64>,
        final_before: Vec<u64>,
        source_start: u64,
    ) -> Result<RetryBacklog, LogError> {
        let mut final_offsets: HashSet<u64> = final_before.into_iter().collect();
        let mut entries = Vec::new();
        let mut from = range.start;
        while from < range.end {
            let mut records = Vec::new();
            log.read(topic, partition, from, 10_000, &mut records)?;
            let Some(last) = records.last() else { break };
            from = last.offset + 1;
            for record in records {
                if let Some(voided) = voided_offsets(&record) {
                    final_offsets.extend(voided);
                    final_offsets.insert(record.offset);
                } else {
                    entries.push(decode(record, |_, _| Duration::ZERO));
                }
            }
        }
        let mut backlog = RetryBacklog {
            final_offsets: Vec::new(),
            pending_sources: HashSet::new(),
            pending_keys: Vec::new(),
        };
        let mut void = Vec::new();
        for entry in entries
            .iter()
            .filter(|e| !final_offsets.contains(&e.retry_offset))
        {
            if entry.record.offset >= source_start {
                void.push(entry.retry_offset);
            } else {
                backlog.pending_sources.insert(entry.record.offset);
                backlog.pending_keys.extend(entry.record.key.clone());
            }
        }
        if !void.is_empty() {
            let positions = log.append(topic, vec![void_marker(partition, &void)])?;
            final_offsets.extend(void);
            final_offsets.extend(positions.iter().map(|p| p.offset));
        }
        let mut final_offsets: Vec<u64> = final_offsets.into_iter().filter(|&o| o >= range.start).collect();
        final_offsets.sort_unstable();
        backlog.final_offsets = final_offsets;
        Ok(backlog)
    }
}

/// `key` order: keys with records on the retry path. Later records of such a
/// key are parked behind them. Shared outside the scheduler lock because the
/// thread working a key lane checks it per record.
#[derive(Default)]
pub(crate) struct ParkedKeys {
    keys: Mutex<HashMap<Bytes, u32>>,
    /// Fast path: no lock while no key is parked.
    len: AtomicUsize,
}

impl ParkedKeys {
    /// Adds one record of `key` to the retry path if the key already has one
    /// there (`only_if_parked`) or unconditionally; answers whether it did.
    pub(crate) fn add(&self, key: &Bytes, only_if_parked: bool) -> bool {
        if only_if_parked && self.len.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        match keys.get_mut(key) {
            Some(count) => *count += 1,
            None if only_if_parked => return false,
            None => {
                keys.insert(key.clone(), 1);
                self.len.store(keys.len(), Ordering::Release);
            }
        }
        true
    }

    /// One record of `key` reached its final outcome.
    pub(crate) fn remove(&self, key: &[u8]) {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = keys.get_mut(key) {
            *count -= 1;
            if *count == 0 {
                keys.remove(key);
                self.len.store(keys.len(), Ordering::Release);
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }
}

/// The not-yet-final records of one task's retry-topic partition.
pub(crate) struct RetryQueue {
    /// Completion of retry-topic offsets; its watermark is the retry offset to commit.
    pub(crate) seq: Sequencer<()>,
    /// Loaded and waiting (not in progress), by retry offset.
    waiting: BTreeMap<u64, RetryItem>,
    /// `key` order: keys with an item in progress.
    busy_keys: HashSet<Bytes>,
    pub(crate) in_progress: usize,
    keyed: bool,
    pub(crate) fetching: bool,
    pub(crate) append_gen: u64,
    pub(crate) fetched_gen: u64,
    /// The retry offset last committed.
    pub(crate) committed: u64,
    /// How many final offsets above `committed` the last commit recorded.
    pub(crate) committed_done: usize,
    /// Offsets of the source records not yet final (for bounded streams).
    pending_sources: BTreeMap<u64, u32>,
    /// Records loaded at most at once; more are read as these finish.
    window: usize,
    /// No waiting item can be due before this (0 = unknown; see `take_due`).
    not_before_ms: i64,
    /// Offsets final before a restart (from the store's checkpoint): their
    /// effects are in the store, so they complete on load without running.
    done_before: HashSet<u64>,
}

/// At most this many retry items go to one thread at once: small, because
/// each may take as long as the processor's latency.
const RETRY_UNIT_MAX: usize = 16;

/// In `key` order a unit may hold runs of parked records, which take no time
/// beyond the processor's: more of them per unit.
const RETRY_UNIT_MAX_KEYED: usize = 256;

impl RetryQueue {
    pub(crate) fn new(start: u64, keyed: bool, window: usize, done_before: Vec<u64>) -> RetryQueue {
        RetryQueue {
            seq: Sequencer::new(start),
            waiting: BTreeMap::new(),
            busy_keys: HashSet::new(),
            in_progress: 0,
            keyed,
            fetching: false,
            append_gen: 1,
            fetched_gen: 0,
            committed: start,
            committed_done: 0,
            pending_sources: BTreeMap::new(),
            window,
            done_before: done_before.into_iter().collect(),
            not_before_ms: 0,
        }
    }

    /// Whether the position or the final offsets above it moved since the last commit.
    pub(crate) fn has_uncommitted(&self) -> bool {
        self.seq.watermark() != self.committed
            || self.seq.completed_above().len() + self.done_before.len() != self.committed_done
    }

    /// Final offsets above the watermark, to commit with it: those completed
    /// since the start, and those final before it that are not loaded yet
    /// (dropping them from a checkpoint would let a later restart rerun them).
    pub(crate) fn done_above_watermark(&self) -> Vec<u64> {
        let mut done = self.seq.completed_above();
        done.extend(self.done_before.iter().copied());
        done.sort_unstable();
        done
    }

    /// Records in the retry topic without a final outcome (loaded or not).
    pub(crate) fn backlog(&self, retry_end: u64) -> u64 {
        let final_above = (self.seq.completed_above().len() + self.done_before.len()) as u64;
        retry_end
            .saturating_sub(self.seq.watermark())
            .saturating_sub(final_above)
    }

    pub(crate) fn can_fetch(&self) -> bool {
        !self.fetching && self.append_gen != self.fetched_gen && self.seq.in_flight() < self.window
    }

    pub(crate) fn fetch_capacity(&self) -> usize {
        self.window.saturating_sub(self.seq.in_flight())
    }

    /// Adds records read from the retry topic, consecutive from `seq.fetched_end()`.
    pub(crate) fn add_fetched(&mut self, items: Vec<RetryItem>) {
        self.not_before_ms = 0;
        self.seq.fetched(items.len());
        for item in items {
            if self.done_before.remove(&item.retry_offset) || item.marker {
                let mut released = Vec::new();
                self.seq.complete_offsets([item.retry_offset], (), &mut released);
                continue;
            }
            *self.pending_sources.entry(item.record.offset).or_default() += 1;
            self.waiting.insert(item.retry_offset, item);
        }
    }

    /// The lowest source offset still without a final outcome, if any.
    pub(crate) fn lowest_pending_source(&self) -> Option<u64> {
        self.pending_sources.keys().next().copied()
    }

    /// The earliest due time among waiting items that could start (ignoring time).
    pub(crate) fn next_due_ms(&self) -> Option<i64> {
        if self.waiting.is_empty() {
            return None;
        }
        if self.not_before_ms > 0 {
            return Some(self.not_before_ms).filter(|&t| t < i64::MAX);
        }
        let mut seen_keys: HashSet<&Bytes> = HashSet::new();
        let mut next: Option<i64> = None;
        for item in self.waiting.values().take(1024) {
            if let Some(key) = item.record.key.as_ref().filter(|_| self.keyed)
                && (self.busy_keys.contains(key) || !seen_keys.insert(key))
            {
                continue;
            }
            next = Some(next.map_or(item.due_ms, |n| n.min(item.due_ms)));
        }
        next
    }

    /// Takes up to a unit's worth of items due at `now_ms`. In `key` order only
    /// the earliest items of a key may run, in order, and never two units of
    /// one key at once: a unit takes a key's run of due items (a failed record
    /// and the records parked behind it), so a parked run drains in one pass.
    pub(crate) fn take_due(&mut self, now_ms: i64) -> Vec<RetryItem> {
        // Called under the scheduler lock on every pick: skip the scan while
        // nothing can be due (the cache is dropped whenever the queue changes).
        if self.waiting.is_empty() || now_ms < self.not_before_ms {
            return Vec::new();
        }
        let limit = if self.keyed {
            RETRY_UNIT_MAX_KEYED
        } else {
            RETRY_UNIT_MAX
        };
        let mut taken = Vec::new();
        // Keys whose run this unit takes, and keys it must not take any more of.
        let mut running: HashSet<Bytes> = HashSet::new();
        let mut stopped: HashSet<Bytes> = HashSet::new();
        let mut next_due = i64::MAX;
        for (&offset, item) in self.waiting.iter().take(1024) {
            let due = item.due_ms <= now_ms;
            if self.keyed
                && let Some(key) = &item.record.key
            {
                if self.busy_keys.contains(key) || stopped.contains(key) {
                    continue;
                }
                if !due {
                    // Later items of the key wait behind this one.
                    stopped.insert(key.clone());
                    if !running.contains(key) {
                        next_due = next_due.min(item.due_ms);
                    }
                    continue;
                }
                running.insert(key.clone());
            } else if !due {
                next_due = next_due.min(item.due_ms);
                continue;
            }
            taken.push(offset);
            if taken.len() == limit {
                break;
            }
        }
        if taken.is_empty() {
            self.not_before_ms = next_due;
        }
        let items: Vec<RetryItem> = taken
            .into_iter()
            .filter_map(|offset| self.waiting.remove(&offset))
            .collect();
        for item in &items {
            if self.keyed
                && let Some(key) = &item.record.key
            {
                self.busy_keys.insert(key.clone());
            }
        }
        self.in_progress += items.len();
        items
    }

    /// Items back from a thread: `finished` reached a final outcome, `again`
    /// failed once more and wait for their next attempt.
    pub(crate) fn complete(&mut self, finished: &[(u64, u64, Option<Bytes>)], again: Vec<RetryItem>) {
        self.not_before_ms = 0;
        self.in_progress -= finished.len() + again.len();
        for (retry_offset, source_offset, key) in finished {
            if let Some(key) = key {
                self.busy_keys.remove(key);
            }
            if let Some(count) = self.pending_sources.get_mut(source_offset) {
                *count -= 1;
                if *count == 0 {
                    self.pending_sources.remove(source_offset);
                }
            }
            let mut released = Vec::new();
            self.seq.complete_offsets([*retry_offset], (), &mut released);
        }
        for item in again {
            if let Some(key) = &item.record.key {
                self.busy_keys.remove(key);
            }
            self.waiting.insert(item.retry_offset, item);
        }
    }

    /// Items of a thread that died: back to waiting, unchanged.
    pub(crate) fn return_items(&mut self, items: Vec<RetryItem>) {
        self.complete(&[], items);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, offset: u64) -> Record {
        Record {
            partition: 3,
            offset,
            timestamp_ms: 1_000,
            key: Some(Bytes::copy_from_slice(key.as_bytes())),
            value: Bytes::from_static(b"v"),
            headers: vec![("app".into(), Bytes::from_static(b"h"))],
        }
    }

    fn failure(attempts: u32) -> Failure {
        Failure {
            kind: "Boom".into(),
            message: "it broke".into(),
            attempts,
            first_failure_ms: 5_000,
            last_failure_ms: 6_000,
        }
    }

    #[test]
    fn backoff_doubles_is_capped_and_jittered_within_half() {
        for seed in 0..100 {
            let first = backoff(1, 100, 1_000, seed).as_millis();
            assert!((50..=100).contains(&first), "{first}");
            let third = backoff(3, 100, 1_000, seed).as_millis();
            assert!((200..=400).contains(&third), "{third}");
            let capped = backoff(20, 100, 1_000, seed).as_millis();
            assert!((500..=1_000).contains(&capped), "{capped}");
        }
    }

    #[test]
    fn a_failed_record_round_trips_through_the_retry_topic_format() {
        let source = record("k", 42);
        let produced = failed_record("events", &source, &failure(2));
        assert_eq!(produced.key, source.key);
        assert_eq!(produced.value, source.value);
        assert_eq!(produced.partition, Some(3));
        let stored = Record {
            partition: 3,
            offset: 7,
            timestamp_ms: produced.timestamp_ms.unwrap_or(0),
            key: produced.key,
            value: produced.value,
            headers: produced.headers,
        };
        let item = decode(stored, |_, _| Duration::from_millis(250));
        assert_eq!(item.retry_offset, 7);
        assert_eq!(
            item.record, source,
            "the processor sees the source record unchanged"
        );
        assert_eq!(item.failure, failure(2));
        assert_eq!(item.due_ms, 6_250);
    }

    fn item(key: &str, retry_offset: u64, due_ms: i64) -> RetryItem {
        RetryItem {
            retry_offset,
            record: record(key, 100 + retry_offset),
            failure: failure(1),
            due_ms,
            marker: false,
        }
    }

    #[test]
    fn key_order_runs_only_the_earliest_item_of_a_key() {
        let mut queue = RetryQueue::new(0, true, 100, vec![]);
        queue.add_fetched(vec![item("a", 0, 50), item("a", 1, 0), item("b", 2, 0)]);
        // `a`@1 is due but waits behind `a`@0, which is not due yet.
        let taken = queue.take_due(10);
        assert_eq!(taken.iter().map(|i| i.retry_offset).collect::<Vec<_>>(), vec![2]);
        assert_eq!(queue.next_due_ms(), Some(50));
        // Once `a`@0 is due, the unit takes `a`'s whole due run, in order.
        let taken = queue.take_due(60);
        assert_eq!(
            taken.iter().map(|i| i.retry_offset).collect::<Vec<_>>(),
            vec![0, 1]
        );
        assert!(queue.take_due(60).is_empty(), "a is busy");
        // `a`@0 failed again: `a`@1 comes back untouched, still behind it.
        let mut again = taken[0].clone();
        again.due_ms = 80;
        queue.complete(&[], vec![again, taken[1].clone()]);
        assert!(queue.take_due(70).is_empty(), "a@1 waits behind a@0");
        let taken = queue.take_due(80);
        assert_eq!(
            taken.iter().map(|i| i.retry_offset).collect::<Vec<_>>(),
            vec![0, 1]
        );
        let a = Some(Bytes::from_static(b"a"));
        queue.complete(&[(0, 100, a.clone()), (1, 101, a)], vec![]);
        assert_eq!(queue.seq.watermark(), 2, "offset 2 is still in progress");
    }

    #[test]
    fn unordered_items_run_when_due_and_the_watermark_is_the_final_prefix() {
        let mut queue = RetryQueue::new(10, false, 100, vec![]);
        queue.add_fetched(vec![item("a", 10, 0), item("a", 11, 0)]);
        let taken = queue.take_due(0);
        assert_eq!(taken.len(), 2);
        assert_eq!(queue.lowest_pending_source(), Some(110));
        let mut again = taken[0].clone();
        again.due_ms = 99;
        queue.complete(&[(11, 111, None)], vec![again]);
        assert_eq!(queue.seq.watermark(), 10);
        assert_eq!(queue.backlog(12), 1, "11 is final, 10 is not");
        let taken = queue.take_due(100);
        queue.complete(&[(taken[0].retry_offset, 110, None)], vec![]);
        assert_eq!(queue.seq.watermark(), 12);
        assert_eq!(queue.lowest_pending_source(), None);
        assert_eq!(queue.in_progress, 0);
    }

    #[test]
    fn offsets_final_before_a_restart_complete_on_load_without_running() {
        let mut queue = RetryQueue::new(5, false, 100, vec![6]);
        queue.add_fetched(vec![item("a", 5, 0), item("b", 6, 0), item("c", 7, 0)]);
        let taken: Vec<u64> = queue.take_due(0).iter().map(|i| i.retry_offset).collect();
        assert_eq!(taken, vec![5, 7], "6 was final before the restart");
        queue.complete(&[(7, 107, None)], vec![]);
        assert_eq!(queue.done_above_watermark(), vec![6, 7]);
        queue.complete(&[(5, 105, None)], vec![]);
        assert_eq!(queue.seq.watermark(), 8);
        assert!(queue.done_above_watermark().is_empty());
    }

    #[test]
    fn parked_keys_count_records_per_key() {
        let parked = ParkedKeys::default();
        let key = Bytes::from_static(b"k");
        assert!(!parked.add(&key, true), "not parked yet");
        assert!(parked.add(&key, false));
        assert!(parked.add(&key, true));
        parked.remove(b"k");
        assert_eq!(parked.len(), 1);
        parked.remove(b"k");
        assert_eq!(parked.len(), 0);
        assert!(!parked.add(&key, true));
    }
}
