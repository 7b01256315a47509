//! Following one partition's outcomes across owners, sans I/O: what the
//! fan-in has delivered of a partition, where a new owner's stream must
//! resume, which records a resumed stream repeats, and which offsets fell
//! in a gap no owner can fill any more.
//!
//! A partition's outcomes live in the memory of the instance that processed
//! them (`outcome_retention_records`). When the partition moves, the new
//! owner re-processes from the last commit (at-least-once), so it repeats
//! outcomes the subscriber already has, and it has none for records the old
//! owner processed after that commit but the subscriber never saw.
//!
//! Invariants of [`PartitionFollow`]:
//! - every offset below `settled_below` has had its final outcome delivered
//!   or was reported missed ([`Gap`]), so a resumed stream starts there;
//! - `settled_above` holds the disjoint offset ranges at or above it whose
//!   final outcome was delivered (records completed out of order, or a
//!   record still retrying below them);
//! - once a stream resumed, a final outcome is delivered at most once per
//!   offset, and a RETRYING outcome of a settled offset is stale and dropped
//!   too (within the first stream the server sends each final outcome once,
//!   and from `Latest` in unordered order lower offsets may still come).

use std::collections::BTreeMap;

use taskstream::v1;

/// At most this many disjoint settled ranges are kept per partition. Past
/// it the lowest hole is treated as settled (its final outcome, should it
/// come, is then taken for a duplicate): a bound on memory for a partition
/// with many records retrying at once.
const MAX_SETTLED_RANGES: usize = 4096;

/// Offsets `[first, last]` of one partition whose outcomes no owner holds
/// any more: the subscriber will not see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gap {
    pub partition: u32,
    pub first: i64,
    pub last: i64,
}

/// What has been delivered of one partition.
#[derive(Debug, Clone)]
pub(crate) struct PartitionFollow {
    partition: u32,
    /// `None` until the first record (a stream from `Latest` or `Earliest`
    /// starts where the server says).
    settled_below: Option<i64>,
    /// Start → exclusive end.
    settled_above: BTreeMap<i64, i64>,
    /// Records dropped as repeats, for the log of a resumed stream.
    duplicates: u64,
    /// Set once a stream resumed. Before, offsets below `settled_below` are
    /// not repeats: from `Latest` or `Earliest` it is only the first batch's
    /// lowest offset, and in unordered order lower ones may still come.
    resumed: bool,
}

impl PartitionFollow {
    /// A partition whose stream starts at `start` (`None`: where the server says).
    pub(crate) fn new(partition: u32, start: Option<i64>) -> Self {
        PartitionFollow {
            partition,
            settled_below: start,
            settled_above: BTreeMap::new(),
            duplicates: 0,
            resumed: false,
        }
    }

    /// A new stream of this partition starts (at `resume_from`).
    pub(crate) fn resume(&mut self) {
        self.resumed = true;
    }

    /// Where a new stream of this partition must start; `None` before
    /// anything was delivered (then the subscription's own start applies).
    pub(crate) fn resume_from(&self) -> Option<i64> {
        self.settled_below
    }

    /// Records dropped as repeats so far.
    pub(crate) fn duplicates(&self) -> u64 {
        self.duplicates
    }

    /// Keeps the records of `batch` not delivered before and records them as
    /// delivered; `None` when nothing is left. A batch the server marks
    /// `reprocessed` passes whole: by contract its outcomes replace earlier
    /// ones of the same offsets.
    pub(crate) fn accept(&mut self, mut batch: v1::MetadataBatch) -> Option<v1::MetadataBatch> {
        if self.settled_below.is_none() {
            // The server starts a stream at its first offset; in unordered
            // order a batch's lowest offset is that start or above it.
            self.settled_below = batch.records.iter().map(|r| r.offset).min();
        }
        if batch.reprocessed {
            for record in &batch.records {
                if is_final(record) {
                    self.settle(record.offset);
                }
            }
            return (!batch.records.is_empty()).then_some(batch);
        }
        let before = batch.records.len();
        batch.records.retain(|record| !self.is_settled(record.offset));
        self.duplicates += (before - batch.records.len()) as u64;
        for record in &batch.records {
            if is_final(record) {
                self.settle(record.offset);
            }
        }
        let first = batch.records.iter().map(|r| r.offset).min()?;
        if before != batch.records.len() {
            batch.first_offset = first;
            batch.last_offset = batch.records.iter().map(|r| r.offset).max().unwrap_or(first);
        }
        Some(batch)
    }

    /// The new owner retains outcomes from `available` on only: every
    /// offset in `[resume_from, available)` not delivered yet is missed.
    /// Answers those as gaps (in offset order) and counts them settled.
    pub(crate) fn missed_until(&mut self, available: i64) -> Vec<Gap> {
        let Some(from) = self.settled_below else {
            self.settled_below = Some(available);
            return Vec::new();
        };
        let mut gaps = Vec::new();
        let mut cursor = from;
        for (&start, &end) in self.settled_above.range(..available) {
            if start > cursor {
                gaps.push(self.gap(cursor, start.min(available) - 1));
            }
            cursor = cursor.max(end);
        }
        if cursor < available {
            gaps.push(self.gap(cursor, available - 1));
        }
        if available > from {
            self.settle_range(from, available);
        }
        gaps
    }

    fn gap(&self, first: i64, last: i64) -> Gap {
        Gap {
            partition: self.partition,
            first,
            last,
        }
    }

    fn is_settled(&self, offset: i64) -> bool {
        if self.resumed && self.settled_below.is_some_and(|below| offset < below) {
            return true;
        }
        self.settled_above
            .range(..=offset)
            .next_back()
            .is_some_and(|(_, &end)| offset < end)
    }

    fn settle(&mut self, offset: i64) {
        self.settle_range(offset, offset + 1);
    }

    /// Marks `[start, end)` settled, merging with neighbours and moving
    /// `settled_below` up while the ranges above touch it.
    fn settle_range(&mut self, mut start: i64, mut end: i64) {
        let below = self.settled_below.unwrap_or(start);
        if end <= below {
            return;
        }
        start = start.max(below);
        // Merge every range that overlaps or touches [start, end).
        let touching: Vec<(i64, i64)> = self
            .settled_above
            .range(..=end)
            .rev()
            .take_while(|&(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in touching {
            self.settled_above.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        if start <= below {
            self.settled_below = Some(end);
        } else {
            self.settled_above.insert(start, end);
        }
        if self.settled_above.len() > MAX_SETTLED_RANGES
            && let Some((_, end)) = self.settled_above.pop_first()
        {
            self.settled_below = Some(end);
        }
        // A settled_below that moved may now touch the lowest range.
        while let Some((&s, &e)) = self.settled_above.first_key_value() {
            if Some(s) > self.settled_below {
                break;
            }
            self.settled_above.pop_first();
            self.settled_below = self.settled_below.max(Some(e));
        }
    }
}

/// RETRYING (and an unknown outcome) is not final: the final one follows.
fn is_final(record: &v1::RecordMetadata) -> bool {
    !matches!(
        record.outcome(),
        v1::RecordOutcome::Retrying | v1::RecordOutcome::Unspecified
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(offset: i64, outcome: v1::RecordOutcome) -> v1::RecordMetadata {
        v1::RecordMetadata {
            offset,
            outcome: outcome as i32,
            attempts: 1,
            ..Default::default()
        }
    }

    fn batch(offsets: impl IntoIterator<Item = i64>) -> v1::MetadataBatch {
        with(offsets, v1::RecordOutcome::Processed)
    }

    fn with(offsets: impl IntoIterator<Item = i64>, outcome: v1::RecordOutcome) -> v1::MetadataBatch {
        let records: Vec<_> = offsets.into_iter().map(|o| record(o, outcome)).collect();
        v1::MetadataBatch {
            partition: 3,
            first_offset: records.iter().map(|r| r.offset).min().unwrap_or(0),
            last_offset: records.iter().map(|r| r.offset).max().unwrap_or(0),
            records,
            ..Default::default()
        }
    }

    fn offsets(batch: Option<v1::MetadataBatch>) -> Vec<i64> {
        batch
            .map(|b| b.records.iter().map(|r| r.offset).collect())
            .unwrap_or_default()
    }

    #[test]
    fn in_order_delivery_resumes_after_the_last_offset_and_drops_the_repeats() {
        let mut follow = PartitionFollow::new(3, None);
        assert_eq!(
            follow.resume_from(),
            None,
            "nothing delivered: the subscription's start"
        );
        assert_eq!(
            offsets(follow.accept(batch(10..20))),
            (10..20).collect::<Vec<_>>()
        );
        assert_eq!(follow.resume_from(), Some(20));
        follow.resume();
        // The new owner re-processes from its last commit, 15: 15..20 repeat.
        let resumed = follow.accept(batch(15..25)).expect("new records");
        assert_eq!((resumed.first_offset, resumed.last_offset), (20, 24));
        assert_eq!(resumed.records.len(), 5);
        assert_eq!(follow.duplicates(), 5);
        assert_eq!(follow.accept(batch(18..25)), None, "all repeats");
        assert_eq!(follow.resume_from(), Some(25));
    }

    #[test]
    fn a_new_owner_retaining_less_than_wanted_names_the_missed_offsets() {
        let mut follow = PartitionFollow::new(3, Some(0));
        follow.accept(batch(0..10));
        assert_eq!(
            follow.missed_until(14),
            vec![Gap {
                partition: 3,
                first: 10,
                last: 13
            }]
        );
        assert_eq!(follow.resume_from(), Some(14));
        assert_eq!(follow.missed_until(14), vec![], "nothing more is missing");
        assert_eq!(follow.missed_until(5), vec![], "below what was delivered");
        follow.resume();
        assert_eq!(
            offsets(follow.accept(batch(12..16))),
            vec![14, 15],
            "the gap is settled"
        );
    }

    #[test]
    fn out_of_order_and_retrying_records_hold_the_resume_point_back_and_the_gap_skips_what_was_delivered() {
        let mut follow = PartitionFollow::new(3, Some(0));
        // 2 is retrying; 0, 1, 3..6 are final; 8 came before 7 (unordered).
        follow.accept(batch([0, 1]));
        follow.accept(with([2], v1::RecordOutcome::Retrying));
        follow.accept(batch([3, 4, 5, 8]));
        assert_eq!(follow.resume_from(), Some(2), "2 has no final outcome yet");
        // A repeat of the retrying outcome after a move is not final: it passes.
        assert_eq!(
            offsets(follow.accept(with([2], v1::RecordOutcome::Retrying))),
            vec![2]
        );
        // The new owner has outcomes from 10 on: 2, 6, 7 and 9 are missed.
        assert_eq!(
            follow.missed_until(10),
            vec![
                Gap {
                    partition: 3,
                    first: 2,
                    last: 2
                },
                Gap {
                    partition: 3,
                    first: 6,
                    last: 7
                },
                Gap {
                    partition: 3,
                    first: 9,
                    last: 9
                },
            ]
        );
        assert_eq!(follow.resume_from(), Some(10));
        follow.resume();
        // A late final outcome of a missed offset counts as a repeat: the
        // subscriber was told it would not come.
        assert_eq!(follow.accept(batch([2, 7])), None);
    }

    #[test]
    fn a_final_outcome_is_kept_once_and_a_stale_retrying_one_after_it_is_dropped() {
        let mut follow = PartitionFollow::new(3, Some(0));
        follow.accept(with([0], v1::RecordOutcome::Retrying));
        assert_eq!(
            offsets(follow.accept(with([0], v1::RecordOutcome::DeadLettered))),
            vec![0]
        );
        // After a move the new owner repeats both.
        follow.resume();
        assert_eq!(follow.accept(with([0], v1::RecordOutcome::Retrying)), None);
        assert_eq!(follow.accept(batch([0])), None);
        assert_eq!(follow.resume_from(), Some(1));
    }

    #[test]
    fn before_a_resume_lower_offsets_of_an_unordered_stream_from_latest_still_pass() {
        let mut follow = PartitionFollow::new(3, None);
        assert_eq!(offsets(follow.accept(batch([12, 14]))), vec![12, 14]);
        assert_eq!(offsets(follow.accept(batch([10, 11, 13]))), vec![10, 11, 13]);
        assert_eq!(follow.resume_from(), Some(15));
    }

    #[test]
    fn reprocessed_batches_replace_and_pass_whole() {
        let mut follow = PartitionFollow::new(3, Some(0));
        follow.accept(batch(0..5));
        let mut again = batch(2..7);
        again.reprocessed = true;
        assert_eq!(offsets(follow.accept(again)), (2..7).collect::<Vec<_>>());
        assert_eq!(follow.resume_from(), Some(7));
    }

    #[test]
    fn the_settled_ranges_are_bounded() {
        let mut follow = PartitionFollow::new(3, Some(0));
        // Every other offset: a hole before each.
        for offset in (1..).step_by(2).take(MAX_SETTLED_RANGES + 10) {
            follow.accept(batch([offset]));
        }
        assert!(follow.settled_above.len() <= MAX_SETTLED_RANGES);
        assert!(follow.resume_from() > Some(0), "the lowest holes were given up");
    }
}
