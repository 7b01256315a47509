//! The retry topic's format: records that failed (or wait behind a failed
//! record of their key) are appended to the pipeline's retry topic with their
//! failure in headers (Kafka Streams' dead-letter headers, KIP-1034), decoded
//! back into `RetryItem`s, voided after a restart, and scanned at start for
//! what is still pending. The backoff between attempts is defined here too;
//! each task's queue of its retry partition is `retry_queue.rs`.

use crate::log::{Log, LogError, ProducerRecord, Record};
use crate::processor::splitmix64;
use bytes::Bytes;
use std::collections::HashSet;
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
    /// Header namespaces that belong to the runtime: client records may not carry them
    /// (a forged `taskstream.retry.void` could void pending retries).
    pub const RESERVED_PREFIXES: [&str; 2] = ["taskstream.", "__streams."];
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

/// Decodes a retry-topic record at `now_ms`. A record missing runtime headers
/// (written by hand) is retried as a first failure of its own offset. A last
/// failure later than now (a hand-set timestamp or header) counts as now: its
/// entry would otherwise never fall due and the retry backlog never drain.
pub(crate) fn decode(retry: Record, now_ms: i64, backoff_of: impl Fn(u32, u64) -> Duration) -> RetryItem {
    let marker = retry.headers.iter().any(|(name, _)| name == headers::VOID);
    let attempts = header(&retry, headers::ATTEMPTS).unwrap_or(1);
    let last_failure_ms = header(&retry, headers::LAST_FAILURE_MS)
        .unwrap_or(retry.timestamp_ms)
        .min(now_ms);
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
                    entries.push(decode(record, i64::MAX, |_, _| Duration::ZERO));
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn record(key: &str, offset: u64) -> Record {
        Record {
            partition: 3,
            offset,
            timestamp_ms: 1_000,
            key: Some(Bytes::copy_from_slice(key.as_bytes())),
            value: Bytes::from_static(b"v"),
            headers: vec![("app".into(), Bytes::from_static(b"h"))],
        }
    }

    pub(crate) fn failure(attempts: u32) -> Failure {
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
        let item = decode(stored, 10_000, |_, _| Duration::from_millis(250));
        assert_eq!(item.retry_offset, 7);
        assert_eq!(
            item.record, source,
            "the processor sees the source record unchanged"
        );
        assert_eq!(item.failure, failure(2));
        assert_eq!(item.due_ms, 6_250);
    }

    #[test]
    fn a_hand_written_retry_record_from_the_future_falls_due_after_one_backoff() {
        let mut forged = record("k", 9);
        forged.timestamp_ms = i64::MAX;
        let item = decode(forged.clone(), 10_000, |_, _| Duration::from_millis(250));
        assert_eq!(item.failure.attempts, 1, "a first failure of its own offset");
        assert_eq!(item.due_ms, 10_250);

        forged.timestamp_ms = 2_000;
        forged
            .headers
            .push((headers::LAST_FAILURE_MS.into(), Bytes::from(i64::MAX.to_string())));
        let item = decode(forged, 10_000, |_, _| Duration::from_millis(250));
        assert_eq!(item.due_ms, 10_250);
    }
}
