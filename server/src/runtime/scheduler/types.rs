//! The values that pass between the Scheduler and the stream threads that
//! drive it: what a thread holds (its lease) and its slot, the picks with the
//! context a thread needs to carry them out, what comes back, and commits.

use super::super::attempt::KeyLocks;
use super::super::retry::RetryItem;
use super::super::sink::SinkQueue;
use super::super::stores::TaskStore;
use super::super::task::{RestoreFrom, Task};
use super::super::work::{Gating, WorkUnit};
use crate::log::{ProducerRecord, Record};
use crate::metadata::RecordOutcome;
use crate::metrics::{BusyMeters, BusyRole, TaskMeters};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// What one stream thread holds right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lease {
    None,
    Unit(usize),
    Fetch(usize),
    RetryFetch(usize),
    Retry(usize),
    Restore(usize),
    Commit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Life {
    Running,
    /// Asked to stop (removed): finishes what it holds, takes nothing new.
    Stopping,
    Exited,
}

/// One stream thread's slot; slots are never removed, so indices stay valid.
pub(crate) struct ThreadSlot {
    pub(super) name: Arc<str>,
    pub(super) busy: Arc<BusyMeters>,
    pub(super) life: Life,
    pub(super) lease: Lease,
    pub(super) records_processed: u64,
    /// Units since it last took retry work (see `RETRY_SHARE`).
    pub(super) units_since_retry: u32,
    /// Rotates through tasks so none of its own starves.
    pub(super) cursor: usize,
    #[cfg(any(test, feature = "fault-injection"))]
    pub(super) crash_requested: bool,
}

impl ThreadSlot {
    pub(super) fn new(name: Arc<str>) -> ThreadSlot {
        ThreadSlot {
            busy: Arc::new(BusyMeters::new(&name)),
            name,
            life: Life::Running,
            lease: Lease::None,
            records_processed: 0,
            units_since_retry: 0,
            cursor: 0,
            #[cfg(any(test, feature = "fault-injection"))]
            crash_requested: false,
        }
    }

    pub(crate) fn name(&self) -> &Arc<str> {
        &self.name
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.life != Life::Exited
    }

    pub(super) fn is_live(&self) -> bool {
        self.life == Life::Running
    }

    pub(crate) fn records_processed(&self) -> u64 {
        self.records_processed
    }

    /// The task it is inside right now, if any.
    pub(crate) fn current_task(&self) -> Option<usize> {
        match self.lease {
            Lease::Unit(t) | Lease::Retry(t) | Lease::Restore(t) => Some(t),
            Lease::None | Lease::Fetch(_) | Lease::RetryFetch(_) | Lease::Commit => None,
        }
    }

    pub(super) fn on_retry(&self) -> bool {
        matches!(self.lease, Lease::Retry(_))
    }
}

/// What a unit, fetch, retry or restore needs to know, copied out under the lock.
#[derive(Clone)]
pub(crate) struct UnitContext {
    pub(crate) task_id: Arc<str>,
    pub(crate) pipeline: usize,
    pub(crate) partition: u32,
    pub(crate) thread: Arc<str>,
    /// The thread's busy-time counters.
    pub(crate) busy: Arc<BusyMeters>,
    pub(crate) meters: Arc<TaskMeters>,
    pub(crate) store: Arc<TaskStore>,
    pub(crate) locks: Arc<KeyLocks>,
    pub(crate) gating: Gating,
    /// Writes carry their record's tag (the store freezes commits by tag).
    pub(crate) tag_writes: bool,
    /// The task's watermark at the pick: every later commit covers what is below.
    pub(crate) settled_below: u64,
    /// Outcomes name their thread (they are released in batches that gather several threads').
    pub(crate) record_threads: bool,
    /// The thread is the task's owner (else a helper, or lent to its retries).
    pub(crate) owner: bool,
    /// The task's queue of outputs for the sink topic (the pipeline has one).
    pub(crate) sink: Option<Arc<SinkQueue>>,
}

impl UnitContext {
    /// Counts `busy` of this thread's time in `role`.
    pub(crate) fn count_busy(&self, role: BusyRole, busy: std::time::Duration) {
        self.busy.count(role, busy);
    }
}

/// One commit to carry out: positions of a task, and the store to freeze and
/// write with them (persistent), or to write to the log (memory).
#[derive(Clone)]
pub(crate) struct CommitItem {
    pub(crate) task: usize,
    pub(crate) task_id: Arc<str>,
    pub(crate) pipeline: usize,
    pub(crate) partition: u32,
    pub(crate) offset: u64,
    /// The retry-topic watermark committed with it.
    pub(crate) retry_offset: u64,
    /// Final retry offsets above `retry_offset` (stores whose state outlives
    /// the task: persistent, or restored from a changelog).
    pub(crate) retry_done: Vec<u64>,
    pub(crate) store: Option<Arc<TaskStore>>,
    /// A memory store with a changelog: the keys it wrote are sent there
    /// before the positions are committed.
    pub(crate) memory: Option<Arc<TaskStore>>,
    /// The task's released outputs, appended before the commit is written.
    pub(crate) sink: Option<Arc<SinkQueue>>,
    /// The positions committed before, so a log commit writes only what moved.
    pub(crate) committed_offset: u64,
    pub(crate) committed_retry_offset: u64,
    /// How many final retry offsets the last commit recorded.
    pub(crate) committed_retry_done: usize,
}

pub(crate) enum Pick {
    Unit {
        task: usize,
        unit: WorkUnit,
        context: UnitContext,
    },
    Fetch {
        task: usize,
        from: u64,
        max: usize,
        generation: u64,
        context: UnitContext,
    },
    /// Read more of the task's retry-topic partition.
    RetryFetch {
        task: usize,
        from: u64,
        max: usize,
        generation: u64,
        context: UnitContext,
    },
    /// Retry items that are due.
    Retry {
        task: usize,
        items: Vec<RetryItem>,
        context: UnitContext,
    },
    /// Replay source offsets `[from, until)` into the task's memory store.
    Restore {
        task: usize,
        from: u64,
        until: u64,
        source: RestoreFrom,
        context: UnitContext,
    },
    /// A commit round: the commits due, and whether retention is due too.
    Commit {
        items: Vec<CommitItem>,
        retention: bool,
    },
    Wait(Duration),
    Exit,
}

/// A unit as it came back from its thread.
pub(crate) struct UnitDone {
    pub(crate) lane: Option<usize>,
    /// The unit's `drains`: keys whose held records it ran.
    pub(crate) drains: Vec<Bytes>,
    /// The records it completed, in processing order.
    pub(crate) outcomes: Vec<RecordOutcome>,
    /// Records it did not run (time limit, or a key that failed before them in `key` order).
    pub(crate) returned: Vec<Record>,
    /// One key per entry it put on the retry path.
    pub(crate) retry_keys: Vec<Bytes>,
    /// Output records of the records it processed, by source offset, in processing order.
    pub(crate) outputs: Vec<(u64, Vec<ProducerRecord>)>,
}

/// Retry items as they came back from their thread.
pub(crate) struct RetriesDone {
    /// Items that reached a final outcome: (retry offset, source offset, key).
    pub(crate) finished: Vec<(u64, u64, Option<Bytes>)>,
    pub(crate) again: Vec<RetryItem>,
    pub(crate) outcomes: Vec<RecordOutcome>,
    /// Output records of the items processed, in processing order.
    pub(crate) outputs: Vec<ProducerRecord>,
}

/// What freezing a persistent store's commit came to (see `commit.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FreezeResult {
    Frozen,
    /// The previous commit of the store is still being written: next round.
    Busy,
    /// A key's writes were out of offset order: commit once the task is drained.
    OutOfOrder,
    /// Decided before the task left, and its final commit (which covers this
    /// one) has begun since: dropped, never written.
    Stale,
}

/// Per pipeline: the names `make_batch` needs.
pub(crate) struct PipelineNames {
    pub(crate) name: Arc<str>,
    pub(crate) topic: Arc<str>,
}

impl CommitItem {
    /// The commit of `task` (scheduler index `t`) as it stands now.
    pub(crate) fn of(t: usize, task: &Task) -> CommitItem {
        let (offset, retry_offset, retry_done) = task.commit_positions();
        CommitItem {
            task: t,
            task_id: task.id().clone(),
            pipeline: task.pipeline(),
            partition: task.partition(),
            offset,
            retry_offset,
            retry_done,
            store: task.is_persistent().then(|| task.store().clone()),
            memory: (!task.is_persistent() && task.store().changelog().is_some())
                .then(|| task.store().clone()),
            sink: task.sink().cloned(),
            committed_offset: task.committed(),
            committed_retry_offset: task.retry().committed(),
            committed_retry_done: task.retry().committed_done(),
        }
    }
}
