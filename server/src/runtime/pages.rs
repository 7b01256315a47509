//! Answers bounded in bytes: a topic read and a range query stop once what they hold reaches
//! a byte budget, so no answer (and no buffer behind it) grows with the data. Invariant: a
//! page always holds at least one record or entry when any is left, so paging makes progress
//! even when a single one is over the budget (its size is bounded by the produce limits).

use super::RuntimeError;
use super::app::{hosted_partitions, read_partition};
use crate::log::Record;
use crate::metadata::{PartitionQueryResult, TopicRead};
use crate::runtime::StreamsApp;
use bytes::Bytes;

/// Records or entries read from storage at a time while filling a page: what a page may
/// read past its budget is at most this many.
const CHUNK: usize = 32;

/// Where a range page resumes: `partition` (partitions ascending), from `key` on (inclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeResume {
    pub partition: u32,
    pub key: Bytes,
}

/// One page of a range query, and where the next starts (`None`: this was the last).
#[derive(Debug, Clone, PartialEq)]
pub struct RangePage {
    pub results: Vec<PartitionQueryResult>,
    pub next: Option<RangeResume>,
}

/// What a record weighs against a page's budget: its key, value and headers.
pub fn record_bytes(record: &Record) -> usize {
    crate::log::payload_bytes(record.key.as_deref(), &record.value, &record.headers)
}

impl StreamsApp {
    /// As [`StreamsApp::read_topic`], stopping also once the records reach `max_bytes`
    /// (at least one record when the partition has one there). Read on from the last
    /// record's offset + 1.
    pub fn read_topic_page(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<TopicRead, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        if topic.is_empty() {
            return Err(RuntimeError::invalid_argument("topic", "must not be empty"));
        }
        let mut records: Vec<Record> = Vec::new();
        let mut bytes = 0usize;
        let mut next = offset;
        'page: while records.len() < max_records {
            // Without a byte limit nothing read can be too much: one read.
            let left = max_records - records.len();
            let want = if max_bytes == usize::MAX {
                left
            } else {
                left.min(CHUNK)
            };
            let mut chunk = Vec::with_capacity(want);
            shared.log.read(topic, partition, next, want, &mut chunk)?;
            let short = chunk.len() < want;
            for record in chunk {
                let size = record_bytes(&record);
                if !records.is_empty() && bytes.saturating_add(size) > max_bytes {
                    break 'page;
                }
                bytes += size;
                next = record.offset + 1;
                records.push(record);
            }
            if short {
                break;
            }
        }
        // Asked after the read, so the end is past every record returned even
        // while producers append, and the start is what is retained now.
        Ok(TopicRead {
            records,
            start_offset: shared.log.start_offset(topic, partition)?,
            end_offset: shared.log.end_offset(topic, partition)?,
            partitions: shared.log.partitions(topic)?,
        })
    }

    /// As [`StreamsApp::query_range`], one page at a time: partitions in ascending order,
    /// keys ascending in each, stopping once the entries reach `max_bytes` (at least one
    /// entry when any is left). `limit` (0 = none) bounds the entries of each partition in
    /// this page. Each partition's `position` is that of its first read in the page.
    #[allow(clippy::too_many_arguments)]
    pub fn query_range_page(
        &self,
        store: &str,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        partitions: &[u32],
        limit: usize,
        max_bytes: usize,
        resume: Option<&RangeResume>,
    ) -> Result<RangePage, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let p = shared.pipeline_index(store)?;
        check_range_order(from, to)?;
        let mut results = Vec::new();
        let mut bytes = 0usize;
        let mut taken_any = false;
        for partition in hosted_partitions(shared, p, partitions)? {
            let mut start: Option<Bytes> = from.map(Bytes::copy_from_slice);
            if let Some(resume) = resume {
                if partition < resume.partition {
                    continue;
                }
                if partition == resume.partition {
                    start = Some(resume.key.clone());
                }
            }
            let mut result: Option<PartitionQueryResult> = None;
            loop {
                let taken = result.as_ref().map_or(0, |r| r.entries.len());
                let want = match limit {
                    0 => CHUNK,
                    limit => (limit - taken).min(CHUNK),
                };
                // Past `to` (the key after `to`, or a resume beyond it): nothing is left, and
                // a store's range must not start after its end.
                let past_end = matches!((&start, to), (Some(s), Some(t)) if s.as_ref() > t);
                if want == 0 || past_end {
                    break;
                }
                let chunk = read_partition(shared, p, partition, start.as_deref(), to, want)?;
                let short = chunk.entries.len() < want;
                let result = result.get_or_insert_with(|| PartitionQueryResult {
                    partition,
                    position: chunk.position,
                    entries: Vec::new(),
                    committed_at: chunk.committed_at,
                });
                for (key, value) in chunk.entries {
                    let size = key.len() + value.len();
                    if taken_any && bytes.saturating_add(size) > max_bytes {
                        let next = RangeResume { partition, key };
                        results.push(std::mem::replace(result, empty(partition)));
                        return Ok(RangePage {
                            results,
                            next: Some(next),
                        });
                    }
                    bytes += size;
                    taken_any = true;
                    // The next chunk starts just after this key: its successor in byte order.
                    let mut after = Vec::with_capacity(key.len() + 1);
                    after.extend_from_slice(&key);
                    after.push(0);
                    start = Some(Bytes::from(after));
                    result.entries.push((key, value));
                }
                if short {
                    break;
                }
            }
            results.extend(result);
        }
        Ok(RangePage { results, next: None })
    }
}

fn empty(partition: u32) -> PartitionQueryResult {
    PartitionQueryResult {
        partition,
        position: 0,
        entries: Vec::new(),
        committed_at: None,
    }
}

/// A range whose `from` is above its `to` is a malformed request, not an empty answer.
pub(super) fn check_range_order(from: Option<&[u8]>, to: Option<&[u8]>) -> Result<(), RuntimeError> {
    match (from, to) {
        (Some(f), Some(t)) if f > t => Err(RuntimeError::invalid_argument(
            "range",
            "`from` is greater than `to`",
        )),
        _ => Ok(()),
    }
}
