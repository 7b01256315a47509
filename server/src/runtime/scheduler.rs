//! The Scheduler: the tasks, the stream threads and what each thread does
//! next. It owns all scheduling state behind one mutex (in `Shared`), does no
//! I/O and starts no thread, so it can be driven step by step in a test: a
//! thread asks `pick`, carries the pick out outside the lock, and reports
//! back with the matching `finish_*` (or `return_*` if it died holding it).
//!
//! Invariants (checked by the tests below): at most T threads are inside a
//! task at once; every fetched offset is queued, held by its key's gate, out
//! in exactly one unit, or completed; a thread holds at most one lease; a
//! task leaves only when no thread works for it. Cost: a pick scans the task
//! list a few times (O(tasks)), once per unit of up to `max_batch_records`.
//! Over 600 lines on purpose: this is the one `impl` through which every
//! change to scheduling state goes; the values it exchanges are in `types.rs`.

use super::retry::RetryItem;
use super::subscription::{FeedEvent, Published};
use super::task::{CommitBlocker, Task, TaskInit};
use super::work::WorkUnit;
use crate::log::Record;
use crate::metadata::{OutcomeBatch, RecordOutcome, ThreadState};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::broadcast;
pub(crate) use types::{
    CommitItem, FreezeResult, Pick, PipelineNames, RetriesDone, ThreadSlot, UnitContext, UnitDone,
};
use types::{Lease, Life};

/// A thread takes due retry work, or reads new entries of a retry topic,
/// before its own after this many units, so retries drain even when no thread
/// is in reserve, and new records keep flowing. (In `key` order a key waits
/// for its retries, so a retry read left until threads are idle would hold
/// back its later records too, and fill the hold budget.)
const RETRY_SHARE: u32 = 4;

/// The longest a thread waits with nothing to do before it looks again (a
/// wake-up normally comes first: appends, completions and commits notify).
const MAX_WAIT: Duration = Duration::from_millis(100);

/// The name of the stream thread in `slot`, as Kafka Streams names them
/// (`<application_id>-StreamThread-<n>`, from 1). Slots are never reused or
/// removed, so the name follows from the slot: metadata reads copy slot numbers
/// under the lock and make the names after it.
pub(crate) fn thread_name(application_id: &str, slot: usize) -> String {
    format!("{application_id}-StreamThread-{}", slot + 1)
}

/// A task whose commit has not happened for a while (see `commit_stalls`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CommitStall {
    pub(crate) task: Arc<str>,
    /// How long its records have waited uncommitted (sampled by the watchdog).
    pub(crate) stalled: Duration,
    pub(crate) watermark: u64,
    pub(crate) committed: u64,
    pub(crate) blocker: CommitBlocker,
}

/// What `commit_stalls` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CommitStalls {
    /// The commit round in progress, if it has run past the threshold: for
    /// how long, and on which thread.
    pub(crate) round: Option<(Duration, Arc<str>)>,
    pub(crate) tasks: Vec<CommitStall>,
}

pub(crate) struct Scheduler {
    application_id: Arc<str>,
    pipelines: Vec<PipelineNames>,
    tasks: Vec<Option<Task>>,
    /// (pipeline, partition) → index in `tasks`.
    index: HashMap<(usize, u32), usize>,
    threads: Vec<ThreadSlot>,
    /// Per pipeline; `None` once shut down, which ends every subscription.
    feeds: Vec<Option<broadcast::Sender<FeedEvent>>>,
    commit_interval: Duration,
    next_commit_at: Instant,
    retention_interval: Duration,
    next_retention_at: Instant,
    /// The commit round in progress: since when, and on which thread.
    commit_round: Option<(Instant, usize)>,
    /// Threads waiting for work (so wake-ups are skipped when nobody waits).
    waiting: usize,
    stopping: bool,
}

impl Scheduler {
    pub(crate) fn new(
        application_id: &str,
        pipelines: Vec<PipelineNames>,
        subscriber_buffer: usize,
        commit_interval: Duration,
        retention_interval: Duration,
        now: Instant,
    ) -> Scheduler {
        let feeds = pipelines
            .iter()
            .map(|_| Some(broadcast::channel(subscriber_buffer.max(1)).0))
            .collect();
        Scheduler {
            application_id: application_id.into(),
            pipelines,
            tasks: Vec::new(),
            index: HashMap::new(),
            threads: Vec::new(),
            feeds,
            commit_interval,
            next_commit_at: now + commit_interval,
            retention_interval,
            next_retention_at: now + retention_interval,
            commit_round: None,
            waiting: 0,
            stopping: false,
        }
    }

    // ---- threads ----

    /// Adds a slot for a new thread, named as Kafka Streams names them; the
    /// caller starts the OS thread. New tasks go to the least loaded threads,
    /// and the new thread takes its share from the most loaded (sticky:
    /// nothing else moves).
    pub(crate) fn add_thread(&mut self) -> usize {
        let slot = self.new_slot();
        self.rebalance_onto(slot);
        slot
    }

    fn new_slot(&mut self) -> usize {
        let slot = self.threads.len();
        self.threads
            .push(ThreadSlot::new(thread_name(&self.application_id, slot).into()));
        slot
    }

    /// The OS thread of `slot` could not be started.
    pub(crate) fn thread_not_started(&mut self, slot: usize) {
        self.threads[slot].life = Life::Exited;
        self.reassign_tasks_of(slot);
    }

    pub(crate) fn threads(&self) -> &[ThreadSlot] {
        &self.threads
    }

    pub(crate) fn live_threads(&self) -> usize {
        self.threads.iter().filter(|t| t.is_live()).count()
    }

    /// Asks `slot` to stop after what it holds; its tasks move to the others.
    pub(crate) fn stop_thread(&mut self, slot: usize) {
        self.threads[slot].life = Life::Stopping;
        self.reassign_tasks_of(slot);
    }

    /// The live thread named `name`.
    pub(crate) fn live_thread(&self, name: &str) -> Option<usize> {
        self.threads.iter().position(|t| t.is_live() && &*t.name == name)
    }

    /// The newest live thread.
    pub(crate) fn newest_live_thread(&self) -> Option<usize> {
        self.threads.iter().rposition(ThreadSlot::is_live)
    }

    /// A thread's loop ended. One that died (not asked to stop) is replaced:
    /// answers the new slot, which takes over its tasks, for the caller to start.
    pub(crate) fn thread_exited(&mut self, slot: usize, died: bool) -> Option<usize> {
        let thread = &mut self.threads[slot];
        let replace = died && !self.stopping && thread.life == Life::Running;
        thread.life = Life::Exited;
        debug_assert_eq!(
            thread.lease,
            Lease::None,
            "work held by an exiting thread must be returned first"
        );
        thread.lease = Lease::None;
        if !replace {
            self.reassign_tasks_of(slot);
            return None;
        }
        let replacement = self.new_slot();
        for task in self.tasks.iter_mut().flatten().filter(|t| t.owner() == slot) {
            task.set_owner(replacement);
        }
        Some(replacement)
    }

    /// Stops every thread at its next pick (shutdown).
    pub(crate) fn stop_all(&mut self) {
        self.stopping = true;
    }

    fn owned_count(&self, thread: usize) -> usize {
        self.tasks
            .iter()
            .flatten()
            .filter(|t| t.owner() == thread)
            .count()
    }

    fn least_loaded_thread(&self, except: Option<usize>) -> Option<usize> {
        (0..self.threads.len())
            .filter(|&i| self.threads[i].is_live() && Some(i) != except)
            .min_by_key(|&i| self.owned_count(i))
    }

    fn reassign_tasks_of(&mut self, from: usize) {
        for t in 0..self.tasks.len() {
            if self.tasks[t].as_ref().is_none_or(|task| task.owner() != from) {
                continue;
            }
            if let Some(target) = self.least_loaded_thread(Some(from))
                && let Some(task) = self.tasks[t].as_mut()
            {
                task.set_owner(target);
            }
        }
    }

    fn rebalance_onto(&mut self, new_thread: usize) {
        let live = self.live_threads().max(1);
        let target = self.task_count() / live;
        while self.owned_count(new_thread) < target {
            let donor = (0..self.threads.len())
                .filter(|&i| i != new_thread && self.threads[i].is_live())
                .max_by_key(|&i| self.owned_count(i));
            let Some(donor) = donor.filter(|&d| self.owned_count(d) > target) else {
                break;
            };
            let Some(task) = self.tasks.iter_mut().flatten().rev().find(|t| t.owner() == donor) else {
                break;
            };
            task.set_owner(new_thread);
        }
    }

    #[cfg(any(test, feature = "fault-injection"))]
    pub(crate) fn request_crash(&mut self, slot: usize) {
        self.threads[slot].crash_requested = true;
    }

    #[cfg(any(test, feature = "fault-injection"))]
    pub(crate) fn take_crash_request(&mut self, slot: usize) -> bool {
        std::mem::take(&mut self.threads[slot].crash_requested)
    }

    // ---- tasks ----

    pub(crate) fn task_count(&self) -> usize {
        self.index.len()
    }

    /// Adds a task; its owner is the least loaded live thread.
    pub(crate) fn add_task(&mut self, init: TaskInit) -> usize {
        let key = (init.pipeline, init.partition);
        debug_assert!(!self.index.contains_key(&key), "task added twice");
        let owner = self.least_loaded_thread(None).unwrap_or(0);
        let task = Task::new(init, owner);
        let slot = match self.tasks.iter().position(Option::is_none) {
            Some(free) => {
                self.tasks[free] = Some(task);
                free
            }
            None => {
                self.tasks.push(Some(task));
                self.tasks.len() - 1
            }
        };
        self.index.insert(key, slot);
        slot
    }

    pub(crate) fn task_index(&self, pipeline: usize, partition: u32) -> Option<usize> {
        self.index.get(&(pipeline, partition)).copied()
    }

    pub(crate) fn task(&self, index: usize) -> Option<&Task> {
        self.tasks.get(index).and_then(Option::as_ref)
    }

    fn task_mut(&mut self, index: usize) -> &mut Task {
        self.tasks[index]
            .as_mut()
            .unwrap_or_else(|| panic!("task {index} is gone while a thread works for it"))
    }

    /// Every task, with its index.
    pub(crate) fn tasks(&self) -> impl Iterator<Item = (usize, &Task)> {
        self.tasks
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.as_ref().map(|t| (i, t)))
    }

    /// Stops handing out work for a task: queued records are dropped, units
    /// out complete. Answers how many records were dropped.
    pub(crate) fn begin_removal(&mut self, index: usize) -> usize {
        self.task_mut(index).begin_removal()
    }

    /// Takes out a task being removed once no thread works for it; its
    /// subscribers are told the partition left, unless it is closed to be
    /// revived here (see `Corruption`): their streams then go on with the
    /// revived task's outcomes.
    pub(crate) fn detach_if_idle(&mut self, index: usize) -> Option<Task> {
        let task = self.tasks.get(index)?.as_ref()?;
        if !task.is_removing() || !task.is_idle() {
            return None;
        }
        let mut task = self.tasks[index].take()?;
        self.index.remove(&(task.pipeline(), task.partition()));
        task.forget_unfinished();
        let revived_here = task.corruption().is_some_and(|c| !c.fenced);
        if !revived_here && let Some(feed) = &self.feeds[task.pipeline()] {
            let _ = feed.send(FeedEvent::Removed(task.partition()));
        }
        Some(task)
    }

    /// The transaction of a commit's task aborted: the task takes no more
    /// work and waits to be closed without a last commit (`Task::corrupt`).
    /// Answers whether the task was still here.
    pub(crate) fn corrupt(&mut self, item: &CommitItem, fenced: bool) -> bool {
        match self.live_task_of(item) {
            Some(task) => {
                task.corrupt(fenced);
                true
            }
            None => false,
        }
    }

    /// `corrupt` for the task a unit ran for (`task_id` at `pipeline`'s
    /// `partition`), from a failed append of its transaction; false if that
    /// task has left.
    pub(crate) fn corrupt_task(
        &mut self,
        task_id: &Arc<str>,
        pipeline: usize,
        partition: u32,
        fenced: bool,
    ) -> bool {
        let Some(t) = self.task_index(pipeline, partition) else {
            return false;
        };
        let task = self.task_mut(t);
        if !Arc::ptr_eq(task.id(), task_id) {
            return false;
        }
        task.corrupt(fenced);
        true
    }

    /// Whether a commit's task is marked corrupted (its transaction aborted).
    pub(crate) fn is_corrupted(&mut self, item: &CommitItem) -> bool {
        self.live_task_of(item)
            .is_some_and(|task| task.corruption().is_some())
    }

    /// Tasks marked corrupted, by index.
    pub(crate) fn corrupted(&self) -> Vec<usize> {
        self.tasks()
            .filter(|(_, t)| t.corruption().is_some())
            .map(|(i, _)| i)
            .collect()
    }

    /// Records of `keys` are about to be appended to the retry partition of
    /// `pipeline`'s `partition` from outside its units (see `Task::gate_keys`);
    /// nothing if the task is not here (its next owner gates them at start).
    pub(crate) fn gate_retry_keys(&mut self, pipeline: usize, partition: u32, keys: &[Bytes]) {
        if let Some(t) = self.task_index(pipeline, partition) {
            self.task_mut(t).gate_keys(keys);
        }
    }

    /// Their append failed: undoes `gate_retry_keys`.
    pub(crate) fn ungate_retry_keys(&mut self, pipeline: usize, partition: u32, keys: &[Bytes]) {
        if let Some(t) = self.task_index(pipeline, partition) {
            self.task_mut(t).ungate_keys(keys);
        }
    }

    /// Records were appended to task `t`'s source partition (or its retry partition).
    pub(crate) fn notify_append(&mut self, t: usize, source: bool, now_ms: i64) {
        let task = self.task_mut(t);
        if source {
            task.notify_append();
        } else {
            task.notify_retry_append(now_ms);
        }
    }

    /// Whether every task's store is restored.
    pub(crate) fn all_restored(&self) -> bool {
        self.tasks().all(|(_, t)| !t.is_restoring())
    }

    // ---- outcomes ----

    /// The feed of a pipeline, to subscribe to (None once shut down).
    pub(crate) fn feed(&self, pipeline: usize) -> Option<&broadcast::Sender<FeedEvent>> {
        self.feeds[pipeline].as_ref()
    }

    /// Ends every subscription.
    pub(crate) fn close_feeds(&mut self) {
        for feed in &mut self.feeds {
            feed.take();
        }
    }

    fn make_batch(&self, task: usize) -> impl Fn(&Arc<str>, Vec<RecordOutcome>) -> OutcomeBatch + use<> {
        let Some(t) = self.task(task) else {
            unreachable!("a batch of a task that is gone")
        };
        let names = &self.pipelines[t.pipeline()];
        let (task_id, pipeline, topic, partition, reprocessed_below) = (
            t.id().clone(),
            names.name.clone(),
            names.topic.clone(),
            t.partition(),
            t.reprocessed_below(),
        );
        move |thread: &Arc<str>, mut records: Vec<RecordOutcome>| {
            // A record names its thread only where it differs from the batch's.
            for record in &mut records {
                if record.thread.as_ref().is_some_and(|t| Arc::ptr_eq(t, thread)) {
                    record.thread = None;
                }
            }
            let first_offset = records.iter().map(|r| r.offset).min().unwrap_or(0);
            OutcomeBatch {
                task_id: task_id.clone(),
                pipeline: pipeline.clone(),
                topic: topic.clone(),
                partition,
                thread: thread.clone(),
                first_offset,
                last_offset: records.iter().map(|r| r.offset).max().unwrap_or(0),
                records,
                reprocessed: first_offset < reprocessed_below,
            }
        }
    }

    fn publish(&self, pipeline: usize, batch: Option<Arc<OutcomeBatch>>) {
        if let (Some(batch), Some(feed)) = (batch, &self.feeds[pipeline]) {
            // No receiver is fine: outcomes are retained in history.
            let _ = feed.send(FeedEvent::Batch(Published::new(batch)));
        }
    }

    // ---- picks ----

    fn context(&self, task: usize, thread: usize) -> UnitContext {
        let Some(t) = self.task(task) else {
            unreachable!("context of a task that is gone")
        };
        UnitContext {
            task_id: t.id().clone(),
            pipeline: t.pipeline(),
            partition: t.partition(),
            thread: self.threads[thread].name.clone(),
            busy: self.threads[thread].busy.clone(),
            meters: t.meters().clone(),
            store: t.store().clone(),
            locks: t.locks().clone(),
            gating: t.gating(),
            tag_writes: t.tagged_commits(),
            settled_below: t.watermark(),
            record_threads: t.held_release(),
            owner: t.owner() == thread,
            sink: t.sink().cloned(),
        }
    }

    /// Chooses what thread `me` does next: a commit round when due; restores;
    /// due retries when the thread has done its share of other work; then its
    /// own tasks (fetch when they run low, else take a unit); then helping the
    /// task with the most startable work that has room; then fetching for
    /// others; then retries (a thread in reserve is lent to them); else wait.
    pub(crate) fn pick(&mut self, me: usize, now: Instant, now_ms: i64) -> Pick {
        let pick = self.choose(me, now, now_ms);
        self.threads[me].lease = match &pick {
            Pick::Unit { task, .. } => Lease::Unit(*task),
            Pick::Fetch { task, .. } => Lease::Fetch(*task),
            Pick::RetryFetch { task, .. } => Lease::RetryFetch(*task),
            Pick::Retry { task, .. } => Lease::Retry(*task),
            Pick::Restore { task, .. } => Lease::Restore(*task),
            Pick::Commit { .. } => Lease::Commit,
            Pick::Wait(_) | Pick::Exit => Lease::None,
        };
        pick
    }

    fn choose(&mut self, me: usize, now: Instant, now_ms: i64) -> Pick {
        debug_assert_eq!(
            self.threads[me].lease,
            Lease::None,
            "a thread picks with work in hand"
        );
        if self.stopping || !self.threads[me].is_live() {
            return Pick::Exit;
        }
        if self.commit_round.is_none() && now >= self.next_commit_at {
            return self.commit_round(me, now);
        }
        let n = self.tasks.len();
        if let Some(t) = (0..n).find(|&t| self.task(t).is_some_and(Task::restore_pending)) {
            let context = self.context(t, me);
            if let Some((from, until, source)) = self.task_mut(t).start_restore() {
                return Pick::Restore {
                    task: t,
                    from,
                    until,
                    source,
                    context,
                };
            }
        }
        if self.threads[me].units_since_retry >= RETRY_SHARE {
            if let Some(pick) = self.pick_retry(me, now, now_ms) {
                return pick;
            }
            if let Some(pick) = self.retry_fetch(me, now_ms) {
                return pick;
            }
        }
        let start = if n == 0 { 0 } else { self.threads[me].cursor % n };
        for i in 0..n {
            let t = (start + i) % n;
            if self.task(t).is_none_or(|task| task.owner() != me) {
                continue;
            }
            if let Some(pick) = self.try_own_task(me, t, now) {
                self.threads[me].cursor = t + 1;
                return pick;
            }
        }
        // Help: the task whose startable work most exceeds its threads.
        let best = self
            .tasks()
            .filter(|(_, t)| t.has_room())
            .map(|(i, t)| (i, t.startable_units(now)))
            .filter(|&(_, units)| units > 0)
            .max_by_key(|&(_, units)| units)
            .map(|(i, _)| i);
        if let Some(t) = best
            && let Some(pick) = self.take_unit(me, t, now)
        {
            return pick;
        }
        // Fetch for a task whose owner is busy elsewhere.
        let fetchable = self.tasks().find(|(_, t)| t.can_fetch(now)).map(|(i, _)| i);
        if let Some(t) = fetchable {
            return self.fetch(me, t);
        }
        if let Some(pick) = self.retry_fetch(me, now_ms) {
            return pick;
        }
        if let Some(pick) = self.pick_retry(me, now, now_ms) {
            return pick;
        }
        Pick::Wait(self.wait_time(now, now_ms))
    }

    /// A read of some task's retry partition, where new entries wait there.
    fn retry_fetch(&mut self, me: usize, now_ms: i64) -> Option<Pick> {
        let (t, (from, max, generation)) = (0..self.tasks.len()).find_map(|t| {
            let task = self.tasks[t].as_mut()?;
            task.start_retry_fetch(now_ms).map(|fetch| (t, fetch))
        })?;
        Some(Pick::RetryFetch {
            task: t,
            from,
            max,
            generation,
            context: self.context(t, me),
        })
    }

    /// How long a thread with nothing to do may wait: until the next commit,
    /// the next retry due, the next fetch allowed after a failure, or the end
    /// of a pause of held records (`work::HoldLimits`).
    fn wait_time(&self, now: Instant, now_ms: i64) -> Duration {
        let until_commit = self.next_commit_at.saturating_duration_since(now);
        let until_retry = self
            .tasks()
            .filter_map(|(_, t)| t.next_retry_due_ms())
            .min()
            .map_or(Duration::MAX, |due| {
                Duration::from_millis(u64::try_from(due.saturating_sub(now_ms)).unwrap_or(0))
            });
        let until_fetch = self
            .tasks()
            .filter_map(|(_, t)| t.fetch_after())
            .min()
            .map_or(Duration::MAX, |at| at.saturating_duration_since(now));
        let until_unpaused = self
            .tasks()
            .filter_map(|(_, t)| t.pause_ends_at())
            .min()
            .map_or(Duration::MAX, |at| at.saturating_duration_since(now));
        until_commit
            .min(until_retry)
            .min(until_fetch)
            .min(until_unpaused)
            .clamp(Duration::from_millis(1), MAX_WAIT)
    }

    fn try_own_task(&mut self, me: usize, t: usize, now: Instant) -> Option<Pick> {
        let task = self.task(t)?;
        if task.can_fetch(now) && task.startable_units(now) < task.threads_per_task() {
            return Some(self.fetch(me, t));
        }
        self.take_unit(me, t, now)
    }

    fn take_unit(&mut self, me: usize, t: usize, now: Instant) -> Option<Pick> {
        let context = self.context(t, me);
        let unit = self.task_mut(t).take_unit(now)?;
        self.threads[me].units_since_retry += 1;
        Some(Pick::Unit {
            task: t,
            unit,
            context,
        })
    }

    fn fetch(&mut self, me: usize, t: usize) -> Pick {
        let context = self.context(t, me);
        let (from, max, generation) = self.task_mut(t).start_fetch();
        Pick::Fetch {
            task: t,
            from,
            max,
            generation,
            context,
        }
    }

    /// Due retry items of some task, starting after the thread's cursor. While
    /// new records wait, at most half the threads are on retries, so slow or
    /// hanging retries can never take every thread from the partitions.
    fn pick_retry(&mut self, me: usize, now: Instant, now_ms: i64) -> Option<Pick> {
        let on_retry = self
            .threads
            .iter()
            .filter(|t| t.is_alive() && t.on_retry())
            .count();
        if on_retry > 0 {
            let source_work = self
                .tasks()
                .any(|(_, t)| t.startable_units(now) > 0 || t.can_fetch(now));
            if source_work && on_retry >= (self.live_threads() / 2).max(1) {
                return None;
            }
        }
        let n = self.tasks.len();
        let start = if n == 0 { 0 } else { self.threads[me].cursor % n };
        for i in 0..n {
            let t = (start + i) % n;
            let Some(task) = self.tasks[t].as_mut() else {
                continue;
            };
            let items = task.take_due_retries(now_ms);
            if !items.is_empty() {
                self.threads[me].units_since_retry = 0;
                return Some(Pick::Retry {
                    task: t,
                    items,
                    context: self.context(t, me),
                });
            }
        }
        None
    }

    /// A thread with nothing to do starts waiting / stops waiting.
    pub(crate) fn begin_wait(&mut self) {
        self.waiting += 1;
    }

    pub(crate) fn end_wait(&mut self) {
        self.waiting -= 1;
    }

    /// Whether some thread waits for work (so a change is worth a wake-up).
    pub(crate) fn has_waiters(&self) -> bool {
        self.waiting > 0
    }

    // ---- completions ----

    fn release_lease(&mut self, me: usize, expected: Lease) {
        debug_assert_eq!(self.threads[me].lease, expected);
        self.threads[me].lease = Lease::None;
    }

    /// A unit came back. Answers a commit that was waiting for the task to be
    /// idle and now may freeze.
    pub(crate) fn finish_unit(&mut self, me: usize, t: usize, done: UnitDone) -> Option<CommitItem> {
        self.release_lease(me, Lease::Unit(t));
        let processed = done.outcomes.len() as u64;
        self.threads[me].records_processed += processed;
        let thread = self.threads[me].name.clone();
        let make_batch = self.make_batch(t);
        let task = self.task_mut(t);
        let pipeline = task.pipeline();
        let batch = task.finish_unit(&thread, done, make_batch);
        self.publish(pipeline, batch);
        self.commit_if_ready(t)
    }

    /// Outcome batches task `t`'s history let go since the last call: the
    /// caller drops them once it has let go of the lock (see `History`).
    pub(crate) fn take_retired(&mut self, t: usize) -> Vec<Arc<OutcomeBatch>> {
        self.tasks
            .get_mut(t)
            .and_then(Option::as_mut)
            .map(Task::take_retired)
            .unwrap_or_default()
    }

    /// The thread holding a unit died: the unit goes back whole.
    pub(crate) fn return_unit(&mut self, me: usize, t: usize, unit: WorkUnit) {
        self.release_lease(me, Lease::Unit(t));
        self.task_mut(t).return_unit(unit);
    }

    /// A fetch ended (Err: it failed and is retried with backoff).
    pub(crate) fn finish_fetch(
        &mut self,
        me: usize,
        t: usize,
        generation: u64,
        result: Result<Vec<Record>, ()>,
        now: Instant,
    ) {
        self.release_lease(me, Lease::Fetch(t));
        self.task_mut(t).finish_fetch(generation, result, now);
    }

    pub(crate) fn finish_retry_fetch(
        &mut self,
        me: usize,
        t: usize,
        generation: u64,
        result: Result<Vec<RetryItem>, ()>,
    ) {
        self.release_lease(me, Lease::RetryFetch(t));
        self.task_mut(t).finish_retry_fetch(generation, result);
    }

    /// Retry items came back. Answers a commit that was waiting for the task
    /// to be idle, and the unit of held records this thread runs next, if
    /// the keys that opened had any (see `Task::finish_retries`).
    pub(crate) fn finish_retries(
        &mut self,
        me: usize,
        t: usize,
        done: RetriesDone,
    ) -> (Option<CommitItem>, Option<(WorkUnit, UnitContext)>) {
        self.release_lease(me, Lease::Retry(t));
        let thread = self.threads[me].name.clone();
        let make_batch = self.make_batch(t);
        let task = self.task_mut(t);
        let pipeline = task.pipeline();
        let (batch, drained) = task.finish_retries(
            &thread,
            &done.finished,
            done.again,
            done.outcomes,
            done.outputs,
            make_batch,
        );
        self.publish(pipeline, batch);
        let next = drained.map(|unit| {
            self.threads[me].lease = Lease::Unit(t);
            (unit, self.context(t, me))
        });
        (self.commit_if_ready(t), next)
    }

    pub(crate) fn return_retries(&mut self, me: usize, t: usize, items: Vec<RetryItem>) {
        self.release_lease(me, Lease::Retry(t));
        self.task_mut(t).return_retries(items);
    }

    /// A replay step ended at `next` (None: it failed and is tried again).
    /// Answers whether every task is now restored.
    pub(crate) fn finish_restore(&mut self, me: usize, t: usize, next: Option<u64>) -> bool {
        self.release_lease(me, Lease::Restore(t));
        if self.task_mut(t).finish_restore(next) {
            tracing::info!(task = %self.task_mut(t).id(), "store restored");
        }
        self.all_restored()
    }

    // ---- commits ----

    /// Every commit due now: memory stores and tagged persistent stores at
    /// once; untagged persistent stores when their task is idle (their item
    /// comes from `finish_unit` / `finish_retries` then).
    fn commit_round(&mut self, me: usize, now: Instant) -> Pick {
        self.commit_round = Some((now, me));
        self.next_commit_at = now + self.commit_interval;
        let mut items = Vec::new();
        for t in 0..self.tasks.len() {
            let Some(task) = self.tasks[t].as_mut() else {
                continue;
            };
            if task.is_restoring() || task.is_removing() || !task.has_uncommitted() || !task.may_commit(now) {
                continue;
            }
            if !task.commits_wait() || task.request_commit() {
                let item = self.commit_item(t);
                if let Some(store) = item.store.as_ref().and_then(|s| s.persistent()) {
                    // Decided under the lock: a unit picked from now on may know a higher
                    // watermark, and must not drop versions this commit still needs.
                    store.announce_commit(item.offset);
                }
                items.push(item);
            }
        }
        let retention = now >= self.next_retention_at;
        if retention {
            self.next_retention_at = now + self.retention_interval;
        }
        Pick::Commit { items, retention }
    }

    /// A commit that waited for task `t` (idle, or drained) and may freeze now.
    fn commit_if_ready(&mut self, t: usize) -> Option<CommitItem> {
        self.tasks
            .get_mut(t)?
            .as_mut()?
            .commit_ready()
            .then(|| self.commit_item(t))
    }

    /// The commit of task `t` as it stands (for a persistent store, what
    /// freezing will take).
    pub(crate) fn commit_item(&self, t: usize) -> CommitItem {
        let Some(task) = self.task(t) else {
            unreachable!("commit of a task that is gone")
        };
        CommitItem::of(t, task)
    }

    /// What freezing a commit's store came to. An untagged task waited idle
    /// for it and resumes now.
    pub(crate) fn frozen(&mut self, item: &CommitItem, result: FreezeResult) {
        let Some(task) = self.live_task_of(item) else {
            return;
        };
        match result {
            FreezeResult::Frozen => task.commit_frozen(true),
            FreezeResult::Busy | FreezeResult::Stale => task.commit_frozen(false),
            FreezeResult::OutOfOrder => task.commit_needs_drain(),
        }
    }

    /// A commit frozen for the task was written by another thread: a task
    /// held for it (exactly-once) goes on.
    pub(crate) fn commit_done_elsewhere(&mut self, item: &CommitItem) {
        if let Some(task) = self.live_task_of(item) {
            task.commit_written();
        }
    }

    /// A commit's positions were written (or not, then the task's next
    /// commit backs off). Answers whether this success ends a run of failures.
    pub(crate) fn commit_applied(&mut self, item: &CommitItem, ok: bool, now: Instant) -> bool {
        let Some(task) = self.live_task_of(item) else {
            return false;
        };
        task.commit_written();
        if ok {
            task.mark_committed(item.offset, item.retry_offset, item.retry_done.len())
        } else {
            task.commit_failed(now);
            false
        }
    }

    /// The task a commit was made for, if it is still here (the same
    /// incarnation: a task removed and added again has a new id).
    fn live_task_of(&mut self, item: &CommitItem) -> Option<&mut Task> {
        self.tasks
            .get_mut(item.task)?
            .as_mut()
            .filter(|task| Arc::ptr_eq(task.id(), &item.task_id))
    }

    /// Whether a commit was made for a task that has left since: its last
    /// commit covered this one, which must not be written after it.
    pub(crate) fn is_stale(&mut self, item: &CommitItem) -> bool {
        self.live_task_of(item).is_none_or(|task| task.is_removing())
    }

    /// The commit round a thread carried out is over.
    pub(crate) fn finish_commit_round(&mut self, me: usize) {
        self.release_lease(me, Lease::Commit);
        self.commit_round = None;
    }

    /// The watchdog's look at commits: every task whose records have waited
    /// uncommitted for at least `threshold`, with what holds its commit
    /// back, and the commit round in progress if it has run that long.
    pub(crate) fn commit_stalls(&mut self, now: Instant, threshold: Duration) -> CommitStalls {
        let round = self
            .commit_round
            .filter(|(since, _)| now.saturating_duration_since(*since) >= threshold)
            .map(|(since, thread)| {
                (
                    now.saturating_duration_since(since),
                    self.threads[thread].name().clone(),
                )
            });
        let mut tasks = Vec::new();
        for task in self.tasks.iter_mut().flatten() {
            let Some(since) = task.sample_uncommitted(now) else {
                continue;
            };
            let stalled = now.saturating_duration_since(since);
            if stalled >= threshold {
                tasks.push(CommitStall {
                    task: task.id().clone(),
                    stalled,
                    watermark: task.watermark(),
                    committed: task.committed(),
                    blocker: task.commit_blocker(now),
                });
            }
        }
        CommitStalls { round, tasks }
    }

    // ---- description ----

    /// The role of thread `slot` right now.
    pub(crate) fn thread_state(&self, slot: usize) -> ThreadState {
        let thread = &self.threads[slot];
        if thread.life == Life::Stopping {
            return ThreadState::Stopping;
        }
        match thread.lease {
            Lease::Retry(_) => ThreadState::Retry,
            Lease::Unit(t) | Lease::Restore(t) => match self.task(t) {
                Some(task) if task.owner() == slot => ThreadState::Owner,
                _ => ThreadState::Helper,
            },
            _ => ThreadState::Reserve,
        }
    }

    /// The slots of the threads other than the owner inside task `t` right
    /// now (see [`thread_name`]).
    pub(crate) fn helpers_of(&self, t: usize) -> Vec<usize> {
        let owner = self.task(t).map(Task::owner);
        self.threads
            .iter()
            .enumerate()
            .filter(|(i, th)| th.current_task() == Some(t) && Some(*i) != owner)
            .map(|(i, _)| i)
            .collect()
    }
}

#[cfg(test)]
mod tests;
mod types;
