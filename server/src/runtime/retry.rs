//! The retry and dead-letter topics' formats: records that failed (or wait
//! behind a failed record of their key) are appended to the pipeline's retry
//! topic with their source position and failure in one compact header (a
//! [`RetryEntry`]), decoded back into `RetryItem`s, voided after a restart, and
//! scanned at start for what is still pending; dead letters carry Kafka
//! Streams' dead-letter headers (KIP-1034). The backoff between attempts is
//! defined here too; each task's queue of its retry partition is `retry_queue.rs`.

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
    /// On a record of the retry topic: its source record's position and
    /// timestamp and its failure so far, in one value (see [`RetryEntry`]).
    pub const RETRY_ENTRY: &str = "taskstream.retry.entry";
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
/// Kept to the microsecond: cut to whole milliseconds, every jittered
/// backoff of 1 ms was 0 (see [`due_ms`]).
pub(crate) fn backoff(attempts: u32, base_ms: u64, max_ms: u64, seed: u64) -> Duration {
    let exponent = attempts.saturating_sub(1).min(32);
    let raw = base_ms.saturating_mul(1u64 << exponent).min(max_ms);
    let jitter = 0.5 + 0.5 * ((splitmix64(seed) >> 11) as f64 / (1u64 << 53) as f64);
    Duration::from_micros((raw as f64 * 1000.0 * jitter) as u64)
}

/// When an attempt waiting `backoff` from `from_ms` (epoch ms) is due: due
/// times are whole milliseconds, so the backoff is rounded up, never down to
/// no wait at all.
pub(crate) fn due_ms(from_ms: i64, backoff: Duration) -> i64 {
    let millis = i64::try_from(backoff.as_micros().div_ceil(1000)).unwrap_or(i64::MAX);
    from_ms.saturating_add(millis)
}

/// What a record of the retry topic says about the record it retries: the
/// value of its `taskstream.retry.entry` header. The retry topic is internal,
/// so its records carry this one header where a dead letter carries nine
/// (KIP-1034's and ours): each failing record is written to the log, read
/// back and parsed, and the nine long names were most of its bytes and
/// allocations (bench `retry`, parked-keys probe).
///
/// The value is text, so `taskstream read` shows it: `1` (the format's
/// version), then the source partition, offset and timestamp (epoch ms), the
/// attempts made so far, the first and last failure (epoch ms), the byte
/// length of the exception, the exception, and the message, separated by
/// single spaces, e.g. `1 0 42 1700000000000 1 1700000000100 1700000000100 7
/// Timeout took longer than 30000 ms`. The length lets the exception and the
/// message hold any text, spaces included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryEntry {
    pub partition: u32,
    pub offset: u64,
    pub timestamp_ms: i64,
    /// Processing attempts made so far: 0 for a record parked behind its key.
    pub attempts: u32,
    pub first_failure_ms: i64,
    pub last_failure_ms: i64,
    /// The error's type, as a dead letter's `__streams.errors.exception`.
    pub exception: String,
    pub message: String,
}

/// The first field of a `RetryEntry`'s value.
const ENTRY_VERSION: &str = "1";

/// A [`RetryEntry`]'s fields with its texts borrowed: a failing record's
/// entry is encoded straight from the record and its failure, without
/// copying the exception and the message into an entry first.
struct EntryFields<'a> {
    partition: u32,
    offset: u64,
    timestamp_ms: i64,
    attempts: u32,
    first_failure_ms: i64,
    last_failure_ms: i64,
    exception: &'a str,
    message: &'a str,
}

impl EntryFields<'_> {
    /// The header value (see [`RetryEntry`]). The numbers are written by
    /// hand: through `core::fmt` they were most of what encoding cost, and
    /// every failing record is encoded (bench `retry`, parked-keys probe).
    /// The buffer is sized exactly: `Bytes` takes a full `Vec` as it is, but
    /// one with room to spare costs it an allocation of its own.
    fn encode(&self) -> Bytes {
        let numbers = [
            Number::unsigned(u64::from(self.partition)),
            Number::unsigned(self.offset),
            Number::signed(self.timestamp_ms),
            Number::unsigned(u64::from(self.attempts)),
            Number::signed(self.first_failure_ms),
            Number::signed(self.last_failure_ms),
            Number::unsigned(self.exception.len() as u64),
        ];
        let len = ENTRY_VERSION.len()
            + numbers.iter().map(Number::len).sum::<usize>()
            + 1
            + self.exception.len()
            + 1
            + self.message.len();
        let mut text = Vec::with_capacity(len);
        text.extend_from_slice(ENTRY_VERSION.as_bytes());
        for number in numbers {
            number.push(&mut text);
        }
        text.push(b' ');
        text.extend_from_slice(self.exception.as_bytes());
        text.push(b' ');
        text.extend_from_slice(self.message.as_bytes());
        debug_assert_eq!(text.len(), len, "the entry's length is computed exactly");
        Bytes::from(text)
    }
}

/// One number of an entry, written in decimal after a space, `-` first when negative.
struct Number {
    negative: bool,
    magnitude: u64,
}

impl Number {
    fn unsigned(value: u64) -> Number {
        Number {
            negative: false,
            magnitude: value,
        }
    }

    fn signed(value: i64) -> Number {
        Number {
            negative: value < 0,
            magnitude: value.unsigned_abs(),
        }
    }

    /// The bytes `push` appends.
    fn len(&self) -> usize {
        1 + usize::from(self.negative) + self.magnitude.checked_ilog10().map_or(1, |log| log as usize + 1)
    }

    fn push(&self, text: &mut Vec<u8>) {
        text.push(b' ');
        if self.negative {
            text.push(b'-');
        }
        push_digits(text, self.magnitude);
    }
}

fn push_digits(text: &mut Vec<u8>, value: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut rest = value;
    loop {
        at -= 1;
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    text.extend_from_slice(&digits[at..]);
}

/// The field before the next space of `rest`, which moves past that space.
fn next_field<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let at = rest.iter().position(|&b| b == b' ')?;
    let field = &rest[..at];
    *rest = &rest[at + 1..];
    Some(field)
}

/// A decimal without sign (what `Number::push` writes of an unsigned number), or `None`.
fn parse_unsigned(field: &[u8]) -> Option<u64> {
    if field.is_empty() {
        return None;
    }
    field.iter().try_fold(0u64, |value, &b| {
        let digit = b.checked_sub(b'0').filter(|d| *d < 10)?;
        value.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// A decimal with an optional `-` (what `Number::push` writes of a signed one), or `None`.
fn parse_signed(field: &[u8]) -> Option<i64> {
    match field.split_first() {
        Some((b'-', digits)) => 0i64.checked_sub_unsigned(parse_unsigned(digits)?),
        _ => i64::try_from(parse_unsigned(field)?).ok(),
    }
}

impl RetryEntry {
    /// The header value (see the type's documentation).
    pub fn encode(&self) -> Bytes {
        EntryFields {
            partition: self.partition,
            offset: self.offset,
            timestamp_ms: self.timestamp_ms,
            attempts: self.attempts,
            first_failure_ms: self.first_failure_ms,
            last_failure_ms: self.last_failure_ms,
            exception: &self.exception,
            message: &self.message,
        }
        .encode()
    }

    /// Parses a header value; `None` if it is not one this version wrote.
    pub fn parse(value: &[u8]) -> Option<RetryEntry> {
        let mut rest = value;
        if next_field(&mut rest)? != ENTRY_VERSION.as_bytes() {
            return None;
        }
        let partition = u32::try_from(parse_unsigned(next_field(&mut rest)?)?).ok()?;
        let offset = parse_unsigned(next_field(&mut rest)?)?;
        let timestamp_ms = parse_signed(next_field(&mut rest)?)?;
        let attempts = u32::try_from(parse_unsigned(next_field(&mut rest)?)?).ok()?;
        let first_failure_ms = parse_signed(next_field(&mut rest)?)?;
        let last_failure_ms = parse_signed(next_field(&mut rest)?)?;
        let exception_len = usize::try_from(parse_unsigned(next_field(&mut rest)?)?).ok()?;
        let exception = rest.get(..exception_len)?;
        let message = rest.get(exception_len..)?.strip_prefix(b" ")?;
        Some(RetryEntry {
            partition,
            offset,
            timestamp_ms,
            attempts,
            first_failure_ms,
            last_failure_ms,
            exception: std::str::from_utf8(exception).ok()?.to_string(),
            message: std::str::from_utf8(message).ok()?.to_string(),
        })
    }

    /// The entry of a retry-topic record, if it carries one (a record written
    /// by hand or by an earlier version carries KIP-1034 headers instead).
    pub fn of(record: &Record) -> Option<RetryEntry> {
        let (_, value) = record
            .headers
            .iter()
            .rev()
            .find(|(n, _)| n == headers::RETRY_ENTRY)?;
        RetryEntry::parse(value)
    }
}

/// The original headers of `record`, without any the runtime added, with room for `more`.
fn own_headers(record: &Record, more: usize) -> Vec<(String, Bytes)> {
    let mut headers = Vec::with_capacity(record.headers.len() + more);
    headers.extend(
        record
            .headers
            .iter()
            .filter(|(name, _)| !is_runtime_header(name))
            .cloned(),
    );
    headers
}

/// The record to append to the retry topic: the raw key and value unchanged,
/// the original headers, then its [`RetryEntry`].
pub(crate) fn retry_record(record: &Record, failure: &Failure) -> ProducerRecord {
    let mut headers = own_headers(record, 1);
    let entry = EntryFields {
        partition: record.partition,
        offset: record.offset,
        timestamp_ms: record.timestamp_ms,
        attempts: failure.attempts,
        first_failure_ms: failure.first_failure_ms,
        last_failure_ms: failure.last_failure_ms,
        exception: &failure.kind,
        message: &failure.message,
    };
    headers.push((headers::RETRY_ENTRY.to_string(), entry.encode()));
    ProducerRecord {
        key: record.key.clone(),
        value: record.value.clone(),
        partition: Some(record.partition),
        timestamp_ms: Some(record.timestamp_ms),
        headers,
    }
}

/// A dead letter as a retry record with no attempt made yet (a redrive): due
/// at once, then retried with backoff like any failed record. Its source
/// position, error and original headers come from its dead-letter headers.
pub(crate) fn redriven_record(dead: Record) -> ProducerRecord {
    let entry = entry_from_error_headers(&dead);
    let failure = Failure {
        kind: entry.exception,
        message: entry.message,
        attempts: 0,
        first_failure_ms: entry.first_failure_ms,
        last_failure_ms: entry.last_failure_ms,
    };
    let source = Record {
        partition: entry.partition,
        offset: entry.offset,
        timestamp_ms: entry.timestamp_ms,
        ..dead
    };
    retry_record(&source, &failure)
}

/// The record to append to the dead-letter topic: the raw key and value
/// unchanged, the original headers, then the error headers.
pub(crate) fn dead_letter_record(source_topic: &str, record: &Record, failure: &Failure) -> ProducerRecord {
    let mut headers = own_headers(record, 9);
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

/// Decodes a retry-topic record at `now_ms`: its [`RetryEntry`], or else the
/// dead-letter headers (a record written by hand or by an earlier version,
/// or a dead letter copied there by one). A record with neither is retried as a first failure
/// of its own offset. A last failure later than now (a hand-set timestamp or
/// header) counts as now: its entry would otherwise never fall due and the
/// retry backlog never drain.
pub(crate) fn decode(retry: Record, now_ms: i64, backoff_of: impl Fn(u32, u64) -> Duration) -> RetryItem {
    let marker = retry.headers.iter().any(|(name, _)| name == headers::VOID);
    let entry = RetryEntry::of(&retry).unwrap_or_else(|| entry_from_error_headers(&retry));
    let last_failure_ms = entry.last_failure_ms.min(now_ms);
    let failure = Failure {
        kind: entry.exception,
        message: entry.message,
        attempts: entry.attempts,
        first_failure_ms: entry.first_failure_ms.min(last_failure_ms),
        last_failure_ms,
    };
    let attempts = entry.attempts;
    let retry_offset = retry.offset;
    // A parked record (0 attempts) is due as soon as its key is free.
    let due_ms = if attempts == 0 {
        0
    } else {
        due_ms(last_failure_ms, backoff_of(attempts, retry_offset))
    };
    let record = Record {
        partition: entry.partition,
        offset: entry.offset,
        timestamp_ms: entry.timestamp_ms,
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

/// A retry record without a [`RetryEntry`], read from the dead-letter headers
/// it has; each missing one defaults to the record's own position, timestamp
/// and a first failure at that timestamp.
fn entry_from_error_headers(retry: &Record) -> RetryEntry {
    let last_failure_ms = header(retry, headers::LAST_FAILURE_MS).unwrap_or(retry.timestamp_ms);
    RetryEntry {
        partition: header(retry, headers::PARTITION).unwrap_or(retry.partition),
        offset: header(retry, headers::OFFSET).unwrap_or(retry.offset),
        timestamp_ms: header(retry, headers::TIMESTAMP_MS).unwrap_or(retry.timestamp_ms),
        attempts: header(retry, headers::ATTEMPTS).unwrap_or(1),
        first_failure_ms: header(retry, headers::FIRST_FAILURE_MS).unwrap_or(last_failure_ms),
        last_failure_ms,
        exception: header_text(retry, headers::EXCEPTION),
        message: header_text(retry, headers::MESSAGE),
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
    fn a_backoff_of_one_ms_waits_half_to_one_ms_and_falls_due_a_ms_later() {
        let mut lengths = std::collections::BTreeSet::new();
        for seed in 0..100 {
            let wait = backoff(1, 1, 1_000, seed);
            assert!(
                (Duration::from_micros(500)..=Duration::from_millis(1)).contains(&wait),
                "{wait:?}"
            );
            lengths.insert(wait);
            assert_eq!(
                due_ms(5_000, wait),
                5_001,
                "rounded up to whole ms, not down to none"
            );
        }
        assert!(lengths.len() > 50, "jittered, not one length: {lengths:?}");
        assert_eq!(due_ms(5_000, Duration::ZERO), 5_000);
        assert_eq!(due_ms(5_000, Duration::from_millis(7)), 5_007);
    }

    /// `produced` as the log would store it at `offset`.
    fn stored(produced: ProducerRecord, offset: u64) -> Record {
        Record {
            partition: produced.partition.unwrap_or(0),
            offset,
            timestamp_ms: produced.timestamp_ms.unwrap_or(0),
            key: produced.key,
            value: produced.value,
            headers: produced.headers,
        }
    }

    #[test]
    fn a_failed_record_round_trips_through_the_retry_topic_format() {
        let source = record("k", 42);
        let produced = retry_record(&source, &failure(2));
        assert_eq!(produced.key, source.key);
        assert_eq!(produced.value, source.value);
        assert_eq!(produced.partition, Some(3));
        assert_eq!(
            produced
                .headers
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>(),
            ["app", headers::RETRY_ENTRY],
            "its own headers, then one entry"
        );
        let item = decode(stored(produced, 7), 10_000, |_, _| Duration::from_millis(250));
        assert_eq!(item.retry_offset, 7);
        assert_eq!(
            item.record, source,
            "the processor sees the source record unchanged"
        );
        assert_eq!(item.failure, failure(2));
        assert_eq!(item.due_ms, 6_250);
    }

    #[test]
    fn a_dead_letter_carries_kip_1034_headers_and_decodes_as_a_retry_record() {
        let source = record("k", 42);
        let dead = dead_letter_record("events", &source, &failure(3));
        let header = |name: &str| {
            dead.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        assert_eq!(header(headers::EXCEPTION).as_deref(), Some("Boom"));
        assert_eq!(header(headers::TOPIC).as_deref(), Some("events"));
        assert_eq!(header(headers::OFFSET).as_deref(), Some("42"));
        assert_eq!(header(headers::ATTEMPTS).as_deref(), Some("3"));
        assert_eq!(header(headers::RETRY_ENTRY), None);
        // An earlier version redrove dead letters to the retry topic with these headers.
        let item = decode(stored(dead, 9), 10_000, |_, _| Duration::from_millis(250));
        assert_eq!(item.record, source);
        assert_eq!(item.failure, failure(3));
    }

    #[test]
    fn a_redriven_dead_letter_is_a_retry_record_of_its_source_with_no_attempt_made() {
        let source = record("k", 42);
        let dead = stored(dead_letter_record("events", &source, &failure(3)), 11);
        let redriven = redriven_record(dead);
        let entry = redriven
            .headers
            .iter()
            .find(|(n, _)| n == headers::RETRY_ENTRY)
            .and_then(|(_, v)| RetryEntry::parse(v))
            .expect("a redriven record carries its entry");
        assert_eq!((entry.partition, entry.offset, entry.attempts), (3, 42, 0));
        let item = decode(stored(redriven, 7), 10_000, |_, _| Duration::from_millis(250));
        assert_eq!(item.record, source, "the source record, its own headers kept");
        assert_eq!(item.due_ms, 0, "due at once");
        assert_eq!((item.failure.kind.as_str(), item.failure.attempts), ("Boom", 0));
    }

    #[test]
    fn an_entry_that_does_not_parse_falls_back_to_the_error_headers() {
        let source = record("k", 42);
        let mut produced = retry_record(&source, &failure(2));
        for bad in [
            "2 3 42 1000 2 5000 6000 4 Boom it broke",
            "1 3 42 1000 2 5000 6000 40 Boom",
            "1 3 x",
        ] {
            if let Some((_, value)) = produced
                .headers
                .iter_mut()
                .find(|(n, _)| n == headers::RETRY_ENTRY)
            {
                *value = Bytes::from(bad);
            }
            assert_eq!(RetryEntry::parse(bad.as_bytes()), None, "{bad}");
            let item = decode(stored(produced.clone(), 7), 10_000, |_, _| {
                Duration::from_millis(250)
            });
            assert_eq!(item.record.offset, 7, "a record written by hand: its own offset");
            assert_eq!(item.failure.attempts, 1);
        }
    }

    #[test]
    fn an_entry_is_written_as_its_documented_text() {
        let entry = RetryEntry {
            partition: 0,
            offset: 42,
            timestamp_ms: 1_700_000_000_000,
            attempts: 1,
            first_failure_ms: -5,
            last_failure_ms: i64::MIN,
            exception: "Timeout".into(),
            message: "took longer than 30000 ms".into(),
        };
        let text = "1 0 42 1700000000000 1 -5 -9223372036854775808 7 Timeout took longer than 30000 ms";
        assert_eq!(entry.encode(), Bytes::from(text));
        assert_eq!(RetryEntry::parse(text.as_bytes()), Some(entry));
        for bad in [
            "1 0 +42 1 1 1 1 0  m",
            "1 0 42 1 1 1 1 0 ",
            "1 4294967296 42 1 1 1 1 0  m",
            "1 0 18446744073709551616 1 1 1 1 0  m",
            "1 0 42 - 1 1 1 0  m",
        ] {
            assert_eq!(RetryEntry::parse(bad.as_bytes()), None, "{bad}");
        }
    }

    proptest::proptest! {
        #[test]
        fn entries_round_trip_with_any_text(
            partition: u32,
            offset: u64,
            timestamp_ms: i64,
            attempts: u32,
            first_failure_ms: i64,
            last_failure_ms: i64,
            exception in ".*",
            message in ".*",
        ) {
            let entry = RetryEntry {
                partition,
                offset,
                timestamp_ms,
                attempts,
                first_failure_ms,
                last_failure_ms,
                exception,
                message,
            };
            proptest::prop_assert_eq!(RetryEntry::parse(&entry.encode()), Some(entry));
        }
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
