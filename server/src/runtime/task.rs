//! One task (pipeline × partition) as the scheduler sees it: where it fetches,
//! its work waiting to run, the sequencer and its watermark, its retry queue,
//! the outcome history kept for streams that start in the past, its commit
//! state and counters. Every change goes through a method here; the scheduler
//! decides when, the task keeps its own invariants:
//!
//! - at most `threads_per_task` threads run units of the task at once;
//! - every fetched offset is queued, held by the gate, out in a unit, or
//!   completed — exactly one of them;
//! - no unit starts while a commit waits for the task to be idle, nor
//!   until that commit is frozen; one such commit is out at a time.
//!
//! Over 600 lines: the Task's one `impl`, in short groups (fetching, units,
//! retries, restore, commits, removal).

use super::attempt::KeyLocks;
use super::retry::RetryItem;
use super::retry_queue::RetryQueue;
use super::scheduler::UnitDone;
use super::sequencer::Sequencer;
use super::sink::{SinkHold, SinkQueue};
use super::stores::TaskStore;
use super::subscription::History;
use super::work::{Gating, HoldLimits, WorkQueue, WorkUnit};
use crate::config::ProcessingOrder;
use crate::log::{ProducerRecord, Record};
use crate::metadata::{Outcome, OutcomeBatch, RecordOutcome};
use crate::metrics::TaskMeters;
use bytes::Bytes;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Beyond `max_in_flight_records` of unfinished records, how far (as a
/// multiple of it) the fetch position may run ahead of the watermark where
/// outcomes are not held (`key`, `unordered`): a record waiting on its key
/// stops fetching only after this much, at one byte of sequencer per offset.
const SPAN_FACTOR: usize = 8;

/// The id of the task of `pipeline` on `partition`, as Kafka Streams writes
/// task ids: `<pipeline>_<partition>`. The one place this form is made, so
/// metadata can make it again from the numbers without the task at hand.
pub(crate) fn task_id(pipeline: &str, partition: u32) -> String {
    format!("{pipeline}_{partition}")
}

/// The first wait after a failed commit; it doubles per failure up to the cap,
/// so a failing disk is not hammered every `commit_interval_ms`.
const COMMIT_BACKOFF_FIRST: Duration = Duration::from_millis(100);
const COMMIT_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The first wait after a failed fetch; it doubles per failure up to the cap.
const FETCH_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const FETCH_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Rebuilds a task's store before it runs: offsets `[next, until)` of the
/// source (replayed into a memory store) or of the store's changelog.
pub(crate) struct Restore {
    pub(crate) next: u64,
    pub(crate) until: u64,
    pub(crate) from: RestoreFrom,
    /// A thread is restoring a chunk right now.
    busy: bool,
}

/// What a restore reads.
#[derive(Clone)]
pub(crate) enum RestoreFrom {
    /// The source partition, processed again minus the offsets still on the
    /// retry path (embedded log, memory store).
    Source { skip: Arc<HashSet<u64>> },
    /// The store's changelog partition, applied as it is (Kafka).
    Changelog,
}

impl Restore {
    /// Replays source offsets `[next, until)` minus `skip`.
    pub(crate) fn replay(next: u64, until: u64, skip: HashSet<u64>) -> Restore {
        Restore {
            next,
            until,
            from: RestoreFrom::Source { skip: Arc::new(skip) },
            busy: false,
        }
    }

    /// Applies changelog offsets `[next, until)`.
    pub(crate) fn changelog(next: u64, until: u64) -> Restore {
        Restore {
            next,
            until,
            from: RestoreFrom::Changelog,
            busy: false,
        }
    }
}

/// Counters reported in metadata.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct TaskCounters {
    pub(crate) processed: u64,
    pub(crate) failed: u64,
    pub(crate) dead_lettered: u64,
}

/// How a commit waits for the task (a persistent store's, or any under
/// exactly-once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CommitWait {
    /// Until no unit and no retry runs (untagged stores: ranges).
    Idle,
    /// Until nothing fetched is unfinished: fetching pauses meanwhile. The
    /// fallback when a tagged freeze found a key's writes out of order, and
    /// every commit under exactly-once: its transaction then holds only
    /// writes of records below the offsets it commits.
    Drained,
    /// The commit waited for is handed out and being frozen: no unit or
    /// retry starts and no other commit of the task is handed out until it
    /// is. A second one, frozen after units ran again, would take their
    /// untracked writes under its older positions.
    Freezing,
    /// Exactly-once: the commit is being written (its transaction is
    /// open): no unit, retry or fetch starts until it is.
    Writing,
}

/// Why a task's commit has not happened, for the watchdog's warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitBlocker {
    /// Its last commit failed; the next waits out a backoff.
    BackingOff { failures: u32 },
    /// The commit waits until no unit and no retry of the task runs.
    WaitingForIdle {
        active_threads: usize,
        retries_running: usize,
    },
    /// The commit waits until nothing fetched is unfinished.
    WaitingForDrain {
        active_threads: usize,
        unfinished: usize,
        queued: usize,
    },
    /// The commit was handed out to be frozen and has not come back.
    Freezing,
    /// The commit is being written (exactly-once: its transaction is open).
    Writing,
    /// No commit round has handed a commit of the task out.
    NotHandedOut,
}

impl std::fmt::Display for CommitBlocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommitBlocker::BackingOff { failures } => {
                write!(f, "backing off after {failures} failed commits")
            }
            CommitBlocker::WaitingForIdle {
                active_threads,
                retries_running,
            } => write!(
                f,
                "waiting for the task to be idle ({active_threads} threads and {retries_running} retries in it)"
            ),
            CommitBlocker::WaitingForDrain {
                active_threads,
                unfinished,
                queued,
            } => write!(
                f,
                "waiting for the task to drain ({active_threads} threads in it, {unfinished} records unfinished, {queued} queued)"
            ),
            CommitBlocker::Freezing => f.write_str("its commit was handed out and is not frozen yet"),
            CommitBlocker::Writing => f.write_str("its commit is being written"),
            CommitBlocker::NotHandedOut => f.write_str("no commit round has taken it"),
        }
    }
}

/// Everything the task is made of, from recovery (see `recovery.rs`).
pub(crate) struct TaskInit {
    pub(crate) id: Arc<str>,
    pub(crate) pipeline: usize,
    pub(crate) partition: u32,
    pub(crate) order: ProcessingOrder,
    pub(crate) threads_per_task: usize,
    pub(crate) gating: Gating,
    pub(crate) start: u64,
    pub(crate) committed: u64,
    pub(crate) retry: RetryQueue,
    pub(crate) gated_keys: Vec<Bytes>,
    pub(crate) store: Arc<TaskStore>,
    pub(crate) restore: Option<Restore>,
    /// The pipeline's sink topic, if it has one.
    pub(crate) sink_topic: Option<Arc<str>>,
    pub(crate) max_batch_records: usize,
    pub(crate) max_in_flight_records: usize,
    /// `key` order: later records of gated keys held in memory.
    pub(crate) hold: HoldLimits,
    pub(crate) outcome_retention_records: usize,
    /// The task's transactional id when commits are Kafka transactions
    /// (`exactly_once_v2`).
    pub(crate) transaction: Option<String>,
    pub(crate) meters: Arc<TaskMeters>,
    /// A task revived after its transaction aborted: records below this
    /// offset ran in the incarnation before, whose outcomes subscribers may
    /// have seen (0 for a task that is no revival).
    pub(crate) reprocessed_below: u64,
}

/// A task whose transaction aborted (exactly_once_v2): it takes no more work,
/// is closed without a last commit (what the aborted transaction held is gone,
/// and the stores go back to the last committed one) and, while the group
/// assigns its partition here, starts again from the group's committed
/// offsets (see `revival`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Corruption {
    /// The task's producer was fenced (by another producer of its
    /// transactional id, or by the broker on the transaction's timeout): it
    /// cannot go on, and the task is revived, if at all, with a new one.
    pub(crate) fenced: bool,
    /// The records the closed incarnation had fetched end here: those below
    /// run again, and their outcomes are published again, marked so.
    pub(crate) fetched_end: u64,
}

pub(crate) struct Task {
    id: Arc<str>,
    meters: Arc<TaskMeters>,
    pipeline: usize,
    partition: u32,
    order: ProcessingOrder,
    threads_per_task: usize,
    /// Completed outcomes wait in the sequencer until every earlier record
    /// is done (`offset` order with several threads); else they are released
    /// when their unit completes.
    held_release: bool,
    owner: usize,
    /// Threads inside the task at this instant (at most `threads_per_task`).
    active: usize,
    work: WorkQueue,
    seq: Sequencer<RecordOutcome>,
    retry: RetryQueue,
    store: Arc<TaskStore>,
    locks: Arc<KeyLocks>,
    /// Released outputs on their way to the sink topic (the pipeline has one).
    sink: Option<Arc<SinkQueue>>,
    /// Outputs of records completed above the watermark (`held_release`).
    sink_hold: SinkHold,
    fetching: bool,
    /// Bumped by every append to the source partition; equal to `fetched_gen`
    /// once a fetch found nothing new, so idle tasks are not polled.
    append_gen: u64,
    fetched_gen: u64,
    fetch_failures: u32,
    fetch_after: Option<Instant>,
    committed: u64,
    /// When the last commit succeeded (for the age of what queries read).
    committed_at: Option<std::time::SystemTime>,
    commit_failures: u32,
    commit_after: Option<Instant>,
    commit_wait: Option<CommitWait>,
    /// Since when (as the watchdog sampled it) the task has records or
    /// retry positions its last commit does not cover; `None` while none.
    uncommitted_since: Option<Instant>,
    /// The store's commits freeze by write tag, so they never wait for the
    /// task (persistent stores with key lanes: records of a key run in order).
    tagged_commits: bool,
    /// Every commit waits until the task is drained and holds it until the
    /// commit's transaction is written (`exactly_once_v2`).
    exactly_once: bool,
    history: History,
    /// The watermark the task started from.
    history_start: u64,
    restore: Option<Restore>,
    removing: bool,
    corrupted: Option<Corruption>,
    reprocessed_below: u64,
    counters: TaskCounters,
    max_in_flight: usize,
    max_span: usize,
}

impl Task {
    pub(crate) fn new(init: TaskInit, owner: usize) -> Task {
        let lanes = init.threads_per_task > 1 && init.order != ProcessingOrder::Unordered;
        let held_release = lanes && init.order == ProcessingOrder::Offset;
        let persistent = init.store.persistent().is_some();
        let mut work = WorkQueue::new(
            lanes,
            held_release,
            init.gating,
            init.threads_per_task,
            init.max_batch_records,
            init.hold,
        );
        for key in &init.gated_keys {
            work.gate_key(key);
        }
        Task {
            id: init.id,
            meters: init.meters,
            pipeline: init.pipeline,
            partition: init.partition,
            order: init.order,
            threads_per_task: init.threads_per_task,
            held_release,
            owner,
            active: 0,
            work,
            seq: Sequencer::new(init.start),
            retry: init.retry,
            store: init.store,
            locks: Arc::new(KeyLocks::for_threads(init.threads_per_task)),
            sink: init
                .sink_topic
                .map(|topic| Arc::new(SinkQueue::new(topic, init.transaction.clone()))),
            sink_hold: SinkHold::default(),
            fetching: false,
            append_gen: 1,
            fetched_gen: 0,
            fetch_failures: 0,
            fetch_after: None,
            committed: init.committed,
            committed_at: None,
            commit_failures: 0,
            commit_after: None,
            commit_wait: None,
            uncommitted_since: None,
            tagged_commits: persistent && lanes && init.transaction.is_none(),
            exactly_once: init.transaction.is_some(),
            history: History::new(init.outcome_retention_records, init.start),
            history_start: init.start,
            restore: init.restore,
            removing: false,
            corrupted: None,
            reprocessed_below: init.reprocessed_below,
            counters: TaskCounters::default(),
            max_in_flight: init.max_in_flight_records.max(1),
            max_span: if held_release {
                init.max_in_flight_records.max(1)
            } else {
                init.max_in_flight_records.max(1) * SPAN_FACTOR
            },
        }
    }

    pub(crate) fn id(&self) -> &Arc<str> {
        &self.id
    }

    pub(crate) fn meters(&self) -> &Arc<TaskMeters> {
        &self.meters
    }

    pub(crate) fn pipeline(&self) -> usize {
        self.pipeline
    }

    pub(crate) fn partition(&self) -> u32 {
        self.partition
    }

    pub(crate) fn order(&self) -> ProcessingOrder {
        self.order
    }

    pub(crate) fn threads_per_task(&self) -> usize {
        self.threads_per_task
    }

    /// Outcomes are released in offset order across units (see `held_release`).
    pub(crate) fn held_release(&self) -> bool {
        self.held_release
    }

    pub(crate) fn owner(&self) -> usize {
        self.owner
    }

    pub(crate) fn set_owner(&mut self, owner: usize) {
        self.owner = owner;
    }

    /// Threads inside the task at this instant.
    pub(crate) fn active(&self) -> usize {
        self.active
    }

    pub(crate) fn sink(&self) -> Option<&Arc<SinkQueue>> {
        self.sink.as_ref()
    }

    pub(crate) fn store(&self) -> &Arc<TaskStore> {
        &self.store
    }

    pub(crate) fn locks(&self) -> &Arc<KeyLocks> {
        &self.locks
    }

    pub(crate) fn watermark(&self) -> u64 {
        self.seq.watermark()
    }

    pub(crate) fn committed(&self) -> u64 {
        self.committed
    }

    pub(crate) fn history_start(&self) -> u64 {
        self.history_start
    }

    pub(crate) fn history(&self) -> &History {
        &self.history
    }

    /// Outcome batches that left the history, to drop outside the lock.
    pub(crate) fn take_retired(&mut self) -> Vec<Arc<OutcomeBatch>> {
        self.history.take_retired()
    }

    pub(crate) fn counters(&self) -> TaskCounters {
        self.counters
    }

    pub(crate) fn retry(&self) -> &RetryQueue {
        &self.retry
    }

    /// Fetched and not yet below the watermark.
    pub(crate) fn in_flight(&self) -> usize {
        self.seq.span()
    }

    /// Completed and waiting for earlier records (the sequencer's depth).
    pub(crate) fn held_completed(&self) -> usize {
        self.seq.span() - self.seq.pending()
    }

    /// Records (of the source or the changelog) a restoring task has still to apply.
    pub(crate) fn restore_remaining(&self) -> u64 {
        self.restore
            .as_ref()
            .map_or(0, |r| r.until.saturating_sub(r.next))
    }

    /// When the last commit succeeded, if one did since the task started.
    pub(crate) fn committed_at(&self) -> Option<std::time::SystemTime> {
        self.committed_at
    }

    pub(crate) fn is_restoring(&self) -> bool {
        self.restore.is_some()
    }

    /// The source offset the task's next read asks for: where the replay of
    /// its memory store stands while it restores from the source, else its
    /// fetch position.
    pub(crate) fn next_source_read(&self) -> u64 {
        match &self.restore {
            Some(Restore {
                next,
                from: RestoreFrom::Source { .. },
                ..
            }) => *next,
            _ => self.seq.fetched_end(),
        }
    }

    pub(crate) fn is_removing(&self) -> bool {
        self.removing
    }

    pub(crate) fn is_persistent(&self) -> bool {
        self.store.persistent().is_some()
    }

    /// Whether the store's state outlives the task — persistent, or restored
    /// from its changelog (Kafka) — rather than rebuilt from the source log:
    /// then the final retry entries above the retry position are committed
    /// too, since their writes are in that state and must not run again.
    fn state_outlives_task(&self) -> bool {
        self.is_persistent() || self.store.changelog().is_some()
    }

    /// How the task keeps a key's later records behind one on the retry path.
    pub(crate) fn gating(&self) -> Gating {
        self.work.gating()
    }

    /// Records of `keys` are about to be appended to the retry topic from
    /// outside the task's units (a dead-letter redrive): each counts on its
    /// key's gate as a failed record's entry does, so the key's later records
    /// wait behind it and its final outcome leaves the gate as it found it.
    pub(crate) fn gate_keys(&mut self, keys: &[Bytes]) {
        for key in keys {
            self.work.gate_key(key);
        }
    }

    /// Undoes `gate_keys` for records whose append failed.
    pub(crate) fn ungate_keys(&mut self, keys: &[Bytes]) {
        for key in keys {
            self.work.ungate_key(key);
        }
    }

    pub(crate) fn tagged_commits(&self) -> bool {
        self.tagged_commits
    }

    /// The watermark below which every record also has its final outcome
    /// (none of them is still on the retry path).
    pub(crate) fn final_watermark(&self) -> u64 {
        let watermark = self.seq.watermark();
        self.retry
            .lowest_pending_source()
            .map_or(watermark, |p| p.min(watermark))
    }

    // ---- fetching ----

    /// Records were appended to the source partition.
    pub(crate) fn notify_append(&mut self) {
        self.append_gen += 1;
    }

    pub(crate) fn notify_retry_append(&mut self, now_ms: i64) {
        self.retry.notify_append(now_ms);
    }

    fn fetch_capacity(&self) -> usize {
        let by_pending = self.max_in_flight.saturating_sub(self.seq.pending());
        let by_span = self.max_span.saturating_sub(self.seq.span());
        by_pending.min(by_span)
    }

    pub(crate) fn can_fetch(&self, now: Instant) -> bool {
        !self.fetching
            && self.restore.is_none()
            && !self.removing
            && self.commit_wait.is_none()
            && self.append_gen != self.fetched_gen
            && self.fetch_after.is_none_or(|after| now >= after)
            && self.fetch_capacity() > 0
    }

    /// Starts a fetch: (from, max, generation).
    pub(crate) fn start_fetch(&mut self) -> (u64, usize, u64) {
        self.fetching = true;
        (self.seq.fetched_end(), self.fetch_capacity(), self.append_gen)
    }

    /// A fetch started at `generation` ended with `records` (consecutive from
    /// where it started), or failed: the next one waits with backoff.
    pub(crate) fn finish_fetch(&mut self, generation: u64, result: Result<Vec<Record>, ()>, now: Instant) {
        self.fetching = false;
        match result {
            Ok(records) if records.is_empty() => self.fetched_gen = generation,
            Ok(records) => {
                self.fetch_failures = 0;
                self.fetch_after = None;
                self.seq.fetched_at(records.iter().map(|r| r.offset));
                self.work.push_fetched(records);
            }
            Err(()) => {
                self.fetch_failures = self.fetch_failures.saturating_add(1);
                let backoff = FETCH_BACKOFF_FIRST
                    .saturating_mul(1 << (self.fetch_failures - 1).min(16))
                    .min(FETCH_BACKOFF_MAX);
                self.fetch_after = Some(now + backoff);
            }
        }
    }

    /// When lanes waiting for the hold budget go on regardless (`work::HoldLimits`).
    pub(crate) fn pause_ends_at(&self) -> Option<Instant> {
        self.work.pause_ends_at()
    }

    /// When a fetch held back by its backoff may run again.
    pub(crate) fn fetch_after(&self) -> Option<Instant> {
        self.fetch_after
    }

    pub(crate) fn start_retry_fetch(&mut self, now_ms: i64) -> Option<(u64, usize, u64)> {
        if self.restore.is_some() || self.removing {
            return None;
        }
        self.retry.start_fetch(now_ms)
    }

    pub(crate) fn finish_retry_fetch(&mut self, generation: u64, items: Result<Vec<RetryItem>, ()>) {
        match items {
            Ok(items) => {
                self.retry.fetch_ended(generation, Some(items.len()));
                self.retry.add_fetched(items);
            }
            // Tried again at the next pick; a failed read moves nothing.
            Err(()) => self.retry.fetch_ended(generation, None),
        }
    }

    // ---- units ----

    fn may_start_units(&self) -> bool {
        self.restore.is_none()
            && !self.removing
            && !matches!(
                self.commit_wait,
                Some(CommitWait::Idle | CommitWait::Freezing | CommitWait::Writing)
            )
    }

    /// Units that could start now (ignoring the thread limit).
    pub(crate) fn startable_units(&self, now: Instant) -> usize {
        if self.may_start_units() {
            self.work.startable_units(now)
        } else {
            0
        }
    }

    pub(crate) fn has_room(&self) -> bool {
        self.active < self.threads_per_task
    }

    /// Takes the next unit, if the thread limit and the task's state allow one.
    pub(crate) fn take_unit(&mut self, now: Instant) -> Option<WorkUnit> {
        if !self.has_room() || !self.may_start_units() {
            return None;
        }
        let unit = self.work.take_unit(now)?;
        self.active += 1;
        Some(unit)
    }

    /// A unit's thread died holding it: every record goes back, unchanged.
    pub(crate) fn return_unit(&mut self, unit: WorkUnit) {
        self.active -= 1;
        self.work.take_back(unit.lane, &unit.drains, unit.records);
    }

    /// A unit came back: outcomes of the records it completed, records it
    /// did not run, one key per entry it put on the retry path, and outputs.
    /// Answers the batches released to subscribers (published by the caller).
    pub(crate) fn finish_unit(
        &mut self,
        thread: &Arc<str>,
        done: UnitDone,
        make_batch: impl Fn(&Arc<str>, Vec<RecordOutcome>) -> OutcomeBatch,
    ) -> Option<Arc<OutcomeBatch>> {
        let UnitDone {
            lane,
            drains,
            outcomes,
            returned,
            retry_keys,
            outputs,
        } = done;
        self.active -= 1;
        // Gated first: a key that failed in the unit holds its returned records.
        for key in &retry_keys {
            self.work.gate_key(key);
        }
        self.work.take_back(lane, &drains, returned);
        self.count(&outcomes);
        let released = if self.held_release {
            let mut released = Vec::new();
            for outcome in outcomes {
                let offset = outcome.offset;
                self.seq.complete(offset, Some(outcome), &mut released);
            }
            released
        } else {
            let mut none = Vec::new();
            for outcome in &outcomes {
                self.seq.complete(outcome.offset, None, &mut none);
            }
            outcomes
        };
        if let Some(sink) = &self.sink {
            // Offset order: outputs go out with their outcomes, once every
            // earlier record is done. Otherwise as the unit completes (a
            // key's units run one at a time, so its outputs keep its order).
            if self.held_release {
                for (offset, records) in outputs {
                    self.sink_hold.hold(offset, records);
                }
                self.sink_hold.release_below(self.seq.watermark(), sink);
            } else {
                sink.push(outputs.into_iter().flat_map(|(_, records)| records));
            }
        }
        self.publish(thread, released, make_batch)
    }

    fn publish(
        &mut self,
        thread: &Arc<str>,
        released: Vec<RecordOutcome>,
        make_batch: impl Fn(&Arc<str>, Vec<RecordOutcome>) -> OutcomeBatch,
    ) -> Option<Arc<OutcomeBatch>> {
        if released.is_empty() {
            return None;
        }
        let batch = Arc::new(make_batch(thread, released));
        self.history.push(batch.clone());
        Some(batch)
    }

    fn count(&mut self, outcomes: &[RecordOutcome]) {
        for record in outcomes {
            match record.outcome {
                Outcome::Processed => self.counters.processed += 1,
                Outcome::DeadLettered => self.counters.dead_lettered += 1,
                Outcome::Retrying | Outcome::Failed => {}
            }
            if record.outcome != Outcome::Processed && record.attempts > 0 {
                self.counters.failed += 1;
            }
        }
    }

    // ---- retries ----

    /// Due retry items whose source record's first outcome is out.
    pub(crate) fn take_due_retries(&mut self, now_ms: i64) -> Vec<RetryItem> {
        if self.restore.is_some() || self.removing || self.retries_paused() {
            return Vec::new();
        }
        let (held_release, seq) = (self.held_release, &self.seq);
        let published = |offset: u64| {
            if held_release {
                offset < seq.watermark()
            } else {
                seq.is_completed(offset)
            }
        };
        self.retry.take_due(now_ms, published)
    }

    pub(crate) fn next_retry_due_ms(&self) -> Option<i64> {
        if self.retries_paused() || self.removing {
            return None;
        }
        self.retry.next_due_ms()
    }

    /// Retry items came back: `finished` reached a final outcome (their keys
    /// open), `again` wait for another attempt. Answers the batch released to
    /// subscribers, and a unit of the records held behind the keys that
    /// opened, for the same thread to run next (`key` order, while the task
    /// has room for one more unit): taken in the same step, no later record of
    /// those keys can start before them.
    pub(crate) fn finish_retries(
        &mut self,
        thread: &Arc<str>,
        finished: &[(u64, u64, Option<Bytes>)],
        again: Vec<RetryItem>,
        outcomes: Vec<RecordOutcome>,
        outputs: Vec<ProducerRecord>,
        make_batch: impl Fn(&Arc<str>, Vec<RecordOutcome>) -> OutcomeBatch,
    ) -> (Option<Arc<OutcomeBatch>>, Option<WorkUnit>) {
        // A retried record is below the watermark already: its outputs go
        // out when it succeeds, after those of the records that passed it.
        if let Some(sink) = &self.sink {
            sink.push(outputs);
        }
        self.retry.complete(finished, again);
        let may_drain = self.work.gating() == Gating::Hold && self.has_room() && self.may_start_units();
        let mut drained = None;
        for (_, _, key) in finished {
            if let Some(key) = key {
                if may_drain {
                    self.work.ungate_key_into(key, &mut drained);
                } else {
                    self.work.ungate_key(key);
                }
            }
        }
        if drained.is_some() {
            self.active += 1;
        }
        self.count(&outcomes);
        (self.publish(thread, outcomes, make_batch), drained)
    }

    pub(crate) fn return_retries(&mut self, items: Vec<RetryItem>) {
        self.retry.return_items(items);
    }

    // ---- restore ----

    /// The next chunk to replay, if no thread replays one now.
    pub(crate) fn start_restore(&mut self) -> Option<(u64, u64, RestoreFrom)> {
        let restore = self.restore.as_mut().filter(|r| !r.busy)?;
        restore.busy = true;
        Some((restore.next, restore.until, restore.from.clone()))
    }

    pub(crate) fn restore_pending(&self) -> bool {
        self.restore.as_ref().is_some_and(|r| !r.busy)
    }

    /// A replay step ended at `next` (or failed and is tried again); answers
    /// whether the store is now restored.
    pub(crate) fn finish_restore(&mut self, next: Option<u64>) -> bool {
        let Some(restore) = self.restore.as_mut() else {
            return true;
        };
        restore.busy = false;
        if let Some(next) = next {
            restore.next = next;
        }
        if restore.next >= restore.until {
            self.restore = None;
            return true;
        }
        false
    }

    // ---- commits ----

    /// Whether a watermark moved since the last commit.
    pub(crate) fn has_uncommitted(&self) -> bool {
        self.seq.watermark() != self.committed
            || if self.state_outlives_task() {
                self.retry.has_uncommitted()
            } else {
                self.retry.watermark() != self.retry.committed()
            }
    }

    /// Whether a commit waiting for the task keeps retries from starting:
    /// one waiting for idle, and under exactly-once any (a retry's writes
    /// must not enter a transaction that does not commit its position).
    fn retries_paused(&self) -> bool {
        match self.commit_wait {
            Some(CommitWait::Idle | CommitWait::Freezing) => true,
            Some(_) => self.exactly_once,
            None => false,
        }
    }

    /// Whether the task's commits wait for it (see `request_commit`).
    pub(crate) fn commits_wait(&self) -> bool {
        self.is_persistent() || self.exactly_once
    }

    /// A commit is due: a persistent store's freezes (tagged stores at once,
    /// others once the task is idle); under exactly-once any store's waits
    /// until the task is drained. Answers whether it can go ahead right away.
    pub(crate) fn request_commit(&mut self) -> bool {
        if self.tagged_commits && self.commit_wait.is_none() {
            return true;
        }
        if self.commit_wait.is_none() {
            self.commit_wait = Some(if self.exactly_once {
                CommitWait::Drained
            } else {
                CommitWait::Idle
            });
        }
        self.commit_ready()
    }

    /// A tagged freeze found writes out of order: commit once drained instead.
    pub(crate) fn commit_needs_drain(&mut self) {
        self.commit_wait = Some(CommitWait::Drained);
    }

    /// Whether the store's state is now exactly that of the records below
    /// the watermarks, so a commit waiting for the task may freeze it; if
    /// so, the caller hands that commit out, and the task waits for it to be
    /// frozen (`commit_frozen`). An idle task whose completed records are
    /// not a prefix (a unit handed back by a dead thread waits ahead of
    /// completed ones) cannot commit untagged writes now: its wait ends, and
    /// the next round tries again.
    pub(crate) fn commit_ready(&mut self) -> bool {
        let idle = self.active == 0 && self.retry.in_progress() == 0;
        let ready = match self.commit_wait {
            None => false,
            Some(CommitWait::Idle) if idle && self.seq.span() > self.seq.pending() => {
                self.commit_wait = None;
                false
            }
            Some(CommitWait::Idle) => idle,
            Some(CommitWait::Drained) => idle && self.seq.pending() == 0 && self.work.queued() == 0,
            Some(CommitWait::Freezing | CommitWait::Writing) => false,
        };
        if ready {
            self.commit_wait = Some(CommitWait::Freezing);
        }
        ready
    }

    /// The commit waiting for the task was frozen (`written`: and is being
    /// written now) or given up. Under exactly-once a commit being written
    /// holds the task until `commit_written`.
    pub(crate) fn commit_frozen(&mut self, written: bool) {
        self.commit_wait = (written && self.exactly_once).then_some(CommitWait::Writing);
    }

    /// The commit being written ended (either way): the task goes on.
    pub(crate) fn commit_written(&mut self) {
        if self.commit_wait == Some(CommitWait::Writing) {
            self.commit_wait = None;
        }
    }

    /// Positions to commit now: source watermark, retry watermark, and (for
    /// a store whose state outlives the task) the final retry offsets above
    /// the latter.
    pub(crate) fn commit_positions(&self) -> (u64, u64, Vec<u64>) {
        let watermark = self.seq.watermark();
        if !self.state_outlives_task() {
            // A memory store is rebuilt without the final entries above the
            // retry position, and they run again: once in all.
            return (watermark, self.retry.watermark(), Vec::new());
        }
        let (retry_offset, done) = self.retry.commit_positions(watermark);
        (watermark, retry_offset, done)
    }

    /// A commit of these positions succeeded; answers whether commits of
    /// this task had been failing until now.
    pub(crate) fn mark_committed(&mut self, offset: u64, retry_offset: u64, retry_done: usize) -> bool {
        self.committed = self.committed.max(offset);
        self.committed_at = Some(std::time::SystemTime::now());
        self.uncommitted_since = None;
        self.retry.mark_committed(retry_offset, retry_done);
        let was_failing = self.commit_failures > 0;
        self.commit_failures = 0;
        self.commit_after = None;
        was_failing
    }

    /// A commit failed: the next waits with backoff.
    pub(crate) fn commit_failed(&mut self, now: Instant) {
        self.commit_failures = self.commit_failures.saturating_add(1);
        let backoff = COMMIT_BACKOFF_FIRST
            .saturating_mul(1 << (self.commit_failures - 1).min(16))
            .min(COMMIT_BACKOFF_MAX);
        self.commit_after = Some(now + backoff);
    }

    /// Whether a commit may be tried now (not while backing off a failure).
    pub(crate) fn may_commit(&self, now: Instant) -> bool {
        self.commit_after.is_none_or(|after| now >= after)
    }

    /// The watchdog's sample: answers since when the task has had something
    /// uncommitted (its first sample since the last commit that found it),
    /// `None` while its last commit covers everything.
    pub(crate) fn sample_uncommitted(&mut self, now: Instant) -> Option<Instant> {
        if self.has_uncommitted() && !self.is_restoring() && !self.removing {
            Some(*self.uncommitted_since.get_or_insert(now))
        } else {
            self.uncommitted_since = None;
            None
        }
    }

    /// Why the task's uncommitted records are not committed yet, as far as
    /// the task can tell (a commit round that never ends is the scheduler's).
    pub(crate) fn commit_blocker(&self, now: Instant) -> CommitBlocker {
        if !self.may_commit(now) {
            return CommitBlocker::BackingOff {
                failures: self.commit_failures,
            };
        }
        match self.commit_wait {
            Some(CommitWait::Idle) => CommitBlocker::WaitingForIdle {
                active_threads: self.active,
                retries_running: self.retry.in_progress(),
            },
            Some(CommitWait::Drained) => CommitBlocker::WaitingForDrain {
                active_threads: self.active,
                unfinished: self.seq.pending(),
                queued: self.work.queued(),
            },
            Some(CommitWait::Freezing) => CommitBlocker::Freezing,
            Some(CommitWait::Writing) => CommitBlocker::Writing,
            None => CommitBlocker::NotHandedOut,
        }
    }

    // ---- removal ----

    /// Stops handing out work; what is queued is dropped now (records not
    /// run are fetched again by whoever resumes at the watermark). Answers
    /// how many records were dropped.
    pub(crate) fn begin_removal(&mut self) -> usize {
        self.removing = true;
        self.commit_wait = None;
        self.work.clear()
    }

    /// Its transaction aborted: stops handing out work, as a removal does,
    /// and marks it to be closed without a last commit (see `Corruption`).
    /// Answers how many queued records were dropped.
    pub(crate) fn corrupt(&mut self, fenced: bool) -> usize {
        let fetched_end = self.seq.fetched_end();
        let corruption = self.corrupted.get_or_insert(Corruption { fenced, fetched_end });
        corruption.fenced |= fenced;
        if let Some(sink) = &self.sink {
            sink.discard();
        }
        self.begin_removal()
    }

    pub(crate) fn corruption(&self) -> Option<Corruption> {
        self.corrupted
    }

    /// Records below this ran in an incarnation of the task whose
    /// transaction aborted (see `Corruption`).
    pub(crate) fn reprocessed_below(&self) -> u64 {
        self.reprocessed_below
    }

    /// No thread works for the task any more: it may be taken out.
    pub(crate) fn is_idle(&self) -> bool {
        self.active == 0
            && !self.fetching
            && self.retry.in_progress() == 0
            && !self.retry_fetching()
            && self.restore.as_ref().is_none_or(|r| !r.busy)
    }

    fn retry_fetching(&self) -> bool {
        self.retry.is_fetching()
    }

    /// Forgets the fetched records that will not complete here (the task is
    /// idle and leaving), so its watermark is final.
    pub(crate) fn forget_unfinished(&mut self) {
        self.seq.truncate_to_watermark();
    }

    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.work.queued()
    }

    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.work.held()
    }

    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.seq.pending()
    }
}
