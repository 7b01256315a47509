//! One task (pipeline × partition) as the scheduler sees it: fetch position,
//! work ready to run (ranges, or per-key lanes in `key` order), the sequencer,
//! the outcome history kept for streams that start in the past, and counters.

use super::retry::{ParkedKeys, RetryQueue};
use super::sequencer::Sequencer;
use super::stores::Restore;
use crate::config::ProcessingOrder;
use crate::log::Record;
use crate::metadata::OutcomeBatch;
use std::collections::VecDeque;
use std::sync::Arc;

/// A unit of work: records one thread processes in order, then completes at once.
pub(crate) struct WorkUnit {
    pub(crate) records: Vec<Record>,
    /// `key` order: the lane the records came from (held busy until completion).
    pub(crate) lane: Option<usize>,
}

/// `key` order: records of the keys that hash to this lane, in offset order.
/// A lane is worked by one thread at a time, so a key never runs twice at once.
#[derive(Default)]
struct Lane {
    queue: VecDeque<Record>,
    busy: bool,
}

/// Retained outcome batches of one task, oldest first, bounded by record count.
pub(crate) struct History {
    pub(crate) batches: VecDeque<Arc<OutcomeBatch>>,
    records: usize,
    limit: usize,
    /// Every completed record at or above this offset is still retained.
    pub(crate) floor: u64,
}

impl History {
    fn push(&mut self, batch: Arc<OutcomeBatch>) {
        self.records += batch.records.len();
        self.batches.push_back(batch);
        while self.records > self.limit {
            let Some(evicted) = self.batches.pop_front() else {
                break;
            };
            self.records -= evicted.records.len();
            self.floor = self.floor.max(evicted.last_offset + 1);
        }
    }
}

pub(crate) struct Task {
    pub(crate) id: Arc<str>,
    pub(crate) pipeline: usize,
    pub(crate) partition: u32,
    pub(crate) order: ProcessingOrder,
    pub(crate) threads_per_task: usize,
    /// Index of the owner thread's slot.
    pub(crate) owner: usize,
    /// Threads inside the task at this instant (never more than `threads_per_task`).
    pub(crate) active: usize,
    pub(crate) seq: Sequencer<Arc<OutcomeBatch>>,
    ready: VecDeque<WorkUnit>,
    /// Records in `ready`.
    ready_records: usize,
    lanes: Vec<Lane>,
    lane_cursor: usize,
    /// A thread is reading the log for this task right now.
    pub(crate) fetching: bool,
    /// Bumped by every append to the source partition; equal to `fetched_gen`
    /// once a fetch found nothing new, so idle tasks are not polled.
    pub(crate) append_gen: u64,
    pub(crate) fetched_gen: u64,
    pub(crate) committed: u64,
    pub(crate) records_processed: u64,
    pub(crate) records_failed: u64,
    pub(crate) records_dead_lettered: u64,
    pub(crate) history: History,
    /// The store is persistent: commits wait for a quiescent moment (below).
    pub(crate) persistent: bool,
    /// A commit of a persistent store is due: no new work starts (in `key`
    /// order, no new fetch) until the task is quiescent and its state frozen.
    pub(crate) commit_pending: bool,
    pub(crate) retry: RetryQueue,
    /// `key` order: keys with a record on the retry path.
    pub(crate) parked: Arc<ParkedKeys>,
    /// The watermark the task started from.
    pub(crate) history_start: u64,
    /// A memory store being rebuilt; the task does nothing else meanwhile.
    pub(crate) restore: Option<Restore>,
    max_batch_records: usize,
    max_in_flight_records: usize,
}

impl Task {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: Arc<str>,
        pipeline: usize,
        partition: u32,
        order: ProcessingOrder,
        threads_per_task: usize,
        owner: usize,
        start: u64,
        committed: u64,
        max_batch_records: usize,
        max_in_flight_records: usize,
        history_limit: usize,
        retry: RetryQueue,
    ) -> Task {
        let lanes = if order == ProcessingOrder::Key {
            // Many lanes per thread: keys spread finely, so no lane is much
            // longer than the average (lanes are processed one unit at a time).
            (0..(threads_per_task * 16).min(4096))
                .map(|_| Lane::default())
                .collect()
        } else {
            Vec::new()
        };
        Task {
            id,
            pipeline,
            partition,
            order,
            threads_per_task,
            owner,
            active: 0,
            seq: Sequencer::new(start),
            ready: VecDeque::new(),
            ready_records: 0,
            lanes,
            lane_cursor: 0,
            fetching: false,
            append_gen: 1,
            fetched_gen: 0,
            committed,
            records_processed: 0,
            records_failed: 0,
            records_dead_lettered: 0,
            persistent: false,
            commit_pending: false,
            retry,
            parked: Arc::new(ParkedKeys::default()),
            restore: None,
            history_start: start,
            history: History {
                batches: VecDeque::new(),
                records: 0,
                limit: history_limit,
                floor: start,
            },
            max_batch_records,
            max_in_flight_records,
        }
    }

    /// How many more records may be fetched before the sequencer is full.
    pub(crate) fn fetch_capacity(&self) -> usize {
        self.max_in_flight_records.saturating_sub(self.seq.in_flight())
    }

    pub(crate) fn can_fetch(&self) -> bool {
        !self.fetching
            && self.restore.is_none()
            && !self.commit_pending
            && self.append_gen != self.fetched_gen
            && self.fetch_capacity() > 0
    }

    /// Whether new work may start: not while restoring, nor while a commit
    /// waits for quiescence (except `key` lanes, which drain what is fetched).
    fn may_start(&self) -> bool {
        self.restore.is_none() && (!self.commit_pending || self.order == ProcessingOrder::Key)
    }

    /// No processor of the task runs, and every record its store has seen is
    /// below the watermark: the moment a persistent store's state is exactly
    /// the watermark's and may be frozen for a commit.
    pub(crate) fn quiescent(&self) -> bool {
        self.active == 0
            && self.retry.in_progress == 0
            && (self.order != ProcessingOrder::Key || self.seq.in_flight() == 0)
    }

    /// Units that could start now (ignoring the thread limit).
    pub(crate) fn startable_units(&self) -> usize {
        if !self.may_start() {
            return 0;
        }
        if self.order == ProcessingOrder::Key {
            self.lanes
                .iter()
                .filter(|l| !l.busy && !l.queue.is_empty())
                .count()
        } else {
            self.ready.len()
        }
    }

    pub(crate) fn has_room(&self) -> bool {
        self.active < self.threads_per_task
    }

    /// Takes the next unit, if the thread limit and the order allow one.
    pub(crate) fn take_unit(&mut self) -> Option<WorkUnit> {
        if !self.has_room() || !self.may_start() {
            return None;
        }
        let unit = if self.order == ProcessingOrder::Key {
            // Longest lane first: lanes are serial, so the longest decides when
            // the task finishes (LPT scheduling); ties go round the cursor.
            let n = self.lanes.len();
            let lane = (0..n)
                .map(|i| (self.lane_cursor + i) % n)
                .filter(|&i| !self.lanes[i].busy && !self.lanes[i].queue.is_empty())
                .max_by_key(|&i| {
                    (
                        self.lanes[i].queue.len(),
                        std::cmp::Reverse((i + n - self.lane_cursor) % n),
                    )
                })?;
            self.lane_cursor = (lane + 1) % n;
            // Units shrink as the queued work does, so the last ones are small
            // enough for every thread to share the tail.
            let queued: usize = self.lanes.iter().map(|l| l.queue.len()).sum();
            let cap = queued
                .div_ceil(self.threads_per_task * 4)
                .clamp(1, self.max_batch_records);
            let lane_ref = &mut self.lanes[lane];
            lane_ref.busy = true;
            let take = lane_ref.queue.len().min(cap);
            WorkUnit {
                records: lane_ref.queue.drain(..take).collect(),
                lane: Some(lane),
            }
        } else {
            let mut unit = self.ready.pop_front()?;
            // As in `key` order: the last units of a fetch shrink so the tail is shared.
            let cap = self.ready_records.div_ceil(self.threads_per_task * 4).max(1);
            if self.threads_per_task > 1 && unit.records.len() > cap {
                let rest = unit.records.split_off(cap);
                self.ready.push_front(WorkUnit {
                    records: rest,
                    lane: None,
                });
            }
            self.ready_records -= unit.records.len();
            unit
        };
        self.active += 1;
        Some(unit)
    }

    /// Puts an unfinished unit back where it came from (its thread died).
    pub(crate) fn return_unit(&mut self, unit: WorkUnit) {
        self.active -= 1;
        match unit.lane {
            Some(lane) => {
                let lane = &mut self.lanes[lane];
                for record in unit.records.into_iter().rev() {
                    lane.queue.push_front(record);
                }
                lane.busy = false;
            }
            None => {
                self.ready_records += unit.records.len();
                self.ready.push_front(unit)
            }
        }
    }

    /// Adds fetched records (consecutive, starting at `fetched_end()`) as work.
    pub(crate) fn add_fetched(&mut self, records: Vec<Record>) {
        self.seq.fetched(records.len());
        if self.order == ProcessingOrder::Key {
            let n = self.lanes.len();
            for record in records {
                // Records without a key have no order to keep: spread them.
                let lane = match record.key.as_deref() {
                    Some(k) => crate::log::murmur2(k) as u32 as usize % n,
                    None => record.offset as usize % n,
                };
                self.lanes[lane].queue.push_back(record);
            }
            return;
        }
        // Enough ranges that every thread of the task gets several (so the
        // tail of a fetch is shared, not left to a few long ranges), but not
        // so small that scheduling costs more than the records.
        let divisor = if self.threads_per_task == 1 {
            1
        } else {
            self.threads_per_task * 16
        };
        let size = records.len().div_ceil(divisor).clamp(1, self.max_batch_records);
        let mut records = records.into_iter().peekable();
        while records.peek().is_some() {
            let chunk: Vec<Record> = records.by_ref().take(size).collect();
            self.ready_records += chunk.len();
            self.ready.push_back(WorkUnit {
                records: chunk,
                lane: None,
            });
        }
    }

    /// Whether a watermark moved since the last commit.
    pub(crate) fn has_uncommitted(&self) -> bool {
        self.seq.watermark() != self.committed
            || if self.persistent {
                self.retry.has_uncommitted()
            } else {
                self.retry.seq.watermark() != self.retry.committed
            }
    }

    pub(crate) fn history_push(&mut self, batch: Arc<OutcomeBatch>) {
        self.history.push(batch);
    }

    /// Adds a batch's outcomes to the task's counters.
    pub(crate) fn count_outcomes(&mut self, batch: &OutcomeBatch) {
        use crate::metadata::Outcome;
        for record in &batch.records {
            match record.outcome {
                Outcome::Processed => self.records_processed += 1,
                Outcome::DeadLettered => self.records_dead_lettered += 1,
                Outcome::Retrying | Outcome::Failed => {}
            }
            if record.outcome != Outcome::Processed && record.attempts > 0 {
                self.records_failed += 1;
            }
        }
    }

    /// Completes a processed unit and publishes what the sequencer releases.
    pub(crate) fn complete(
        &mut self,
        lane: Option<usize>,
        batch: OutcomeBatch,
        released: &mut Vec<Arc<OutcomeBatch>>,
    ) {
        self.active -= 1;
        self.count_outcomes(&batch);
        let batch = Arc::new(batch);
        match lane {
            Some(lane) => {
                self.lanes[lane].busy = false;
                let offsets: Vec<u64> = batch.records.iter().map(|r| r.offset).collect();
                self.seq.complete_offsets(offsets, batch, released);
            }
            None => {
                let ordered = self.order == ProcessingOrder::Offset;
                self.seq.complete_range(
                    batch.first_offset,
                    batch.last_offset,
                    batch.clone(),
                    ordered,
                    released,
                );
            }
        }
        for batch in released.iter() {
            self.history.push(batch.clone());
        }
    }
}
