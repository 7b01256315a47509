//! Stream threads: the loop each OS thread runs (pick work, process it outside
//! the lock, complete it), commits, the drop guards that return a dead thread's
//! work and replace the thread, and the sticky, balanced task assignment.

use super::{CommitReport, Sched, Shared, task::WorkUnit};
use crate::metadata::{Outcome, OutcomeBatch, RecordOutcome};
use crate::processor::ProcessorContext;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

/// One stream thread's slot; slots are never removed, so indices stay valid.
pub(crate) struct ThreadSlot {
    pub(crate) name: Arc<str>,
    pub(crate) alive: bool,
    /// Asked to stop (removed): finishes its unit, takes no new one.
    pub(crate) stopping: bool,
    /// The task it is inside at this instant.
    pub(crate) current: Option<usize>,
    pub(crate) records_processed: u64,
    pub(crate) handle: Option<std::thread::JoinHandle<()>>,
    /// Fault injection: die at the next pick, holding whatever it took.
    pub(crate) crash_requested: bool,
    /// Rotates through owned tasks so none starves.
    cursor: usize,
}

impl ThreadSlot {
    pub(crate) fn new(name: Arc<str>) -> ThreadSlot {
        ThreadSlot {
            name,
            alive: true,
            stopping: false,
            current: None,
            records_processed: 0,
            handle: None,
            crash_requested: false,
            cursor: 0,
        }
    }

    pub(crate) fn is_live(&self) -> bool {
        self.alive && !self.stopping
    }
}

enum Pick {
    Unit(usize, WorkUnit),
    Fetch {
        task: usize,
        from: u64,
        max: usize,
        generation: u64,
    },
    Idle,
}

/// Returns a unit to its task if the thread unwinds while holding it.
struct UnitGuard<'a> {
    shared: &'a Shared,
    task: usize,
    unit: Option<WorkUnit>,
}

impl Drop for UnitGuard<'_> {
    fn drop(&mut self) {
        if let Some(unit) = self.unit.take() {
            let mut s = self.shared.lock();
            s.tasks[self.task].return_unit(unit);
            self.shared.wake.notify_all();
        }
    }
}

/// Marks the thread gone when its loop ends; a thread that died (panicked)
/// is replaced by a new one that takes over its tasks.
struct ThreadExit {
    shared: Arc<Shared>,
    me: usize,
}

impl Drop for ThreadExit {
    fn drop(&mut self) {
        let died = std::thread::panicking();
        let mut s = self.shared.lock();
        s.threads[self.me].alive = false;
        s.threads[self.me].current = None;
        if died && !s.stopping && !s.threads[self.me].stopping {
            let replacement = s.new_thread_slot(&self.shared.config.application_id);
            for task in s.tasks.iter_mut().filter(|t| t.owner == self.me) {
                task.owner = replacement;
            }
            tracing::warn!(
                thread = %s.threads[self.me].name,
                replacement = %s.threads[replacement].name,
                "stream thread died; its tasks move to a new thread"
            );
            spawn_thread(&self.shared, &mut s, replacement);
        }
        self.shared.wake.notify_all();
    }
}

/// Starts the OS thread of slot `index`.
pub(crate) fn spawn_thread(shared: &Arc<Shared>, s: &mut Sched, index: usize) {
    let shared_for_thread = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(s.threads[index].name.to_string())
        .spawn(move || run(shared_for_thread, index));
    match spawned {
        Ok(handle) => s.threads[index].handle = Some(handle),
        Err(e) => {
            tracing::error!(error = %e, "could not start a stream thread");
            s.threads[index].alive = false;
        }
    }
}

fn run(shared: Arc<Shared>, me: usize) {
    let _exit = ThreadExit {
        shared: shared.clone(),
        me,
    };
    let mut s = shared.lock();
    loop {
        if s.threads[me].crash_requested {
            s.threads[me].crash_requested = false;
            let picked = pick(&mut s, me);
            drop(s);
            // Die holding the unit, if any: its guard must hand it back.
            let _guard = match picked {
                Pick::Unit(task, unit) => Some(UnitGuard {
                    shared: &shared,
                    task,
                    unit: Some(unit),
                }),
                _ => None,
            };
            panic!("injected crash of a stream thread");
        }
        if s.stopping || s.threads[me].stopping {
            return;
        }
        if !s.committing && Instant::now() >= s.next_commit_at {
            s = shared.commit_round(s);
            continue;
        }
        match pick(&mut s, me) {
            Pick::Unit(task, unit) => {
                s.threads[me].current = Some(task);
                let lane = unit.lane;
                let unit_context = UnitContext {
                    task_id: s.tasks[task].id.clone(),
                    pipeline: s.tasks[task].pipeline,
                    partition: s.tasks[task].partition,
                    thread: s.threads[me].name.clone(),
                };
                drop(s);
                let mut guard = UnitGuard {
                    shared: &shared,
                    task,
                    unit: Some(unit),
                };
                let batch = process_unit(
                    &shared,
                    unit_context,
                    guard.unit.as_ref().map_or(&[][..], |u| &u.records),
                );
                guard.unit = None;
                drop(guard);
                s = shared.lock();
                s.threads[me].current = None;
                s.threads[me].records_processed += batch.records.len() as u64;
                let pipeline = s.tasks[task].pipeline;
                let mut released = Vec::new();
                s.tasks[task].complete(lane, batch, &mut released);
                if let Some(sender) = &s.senders[pipeline] {
                    for batch in released {
                        // No receiver is fine: outcomes are retained in history.
                        let _ = sender.send(batch);
                    }
                }
                if s.idle > 0 {
                    shared.wake.notify_all();
                }
            }
            Pick::Fetch {
                task,
                from,
                max,
                generation,
            } => {
                s.tasks[task].fetching = true;
                let pipeline = &shared.pipelines[s.tasks[task].pipeline];
                let partition = s.tasks[task].partition;
                drop(s);
                let mut records = Vec::new();
                let result = shared
                    .log
                    .read(&pipeline.topic, partition, from, max, &mut records);
                s = shared.lock();
                let t = &mut s.tasks[task];
                t.fetching = false;
                match result {
                    Ok(()) if records.is_empty() => t.fetched_gen = generation,
                    Ok(()) => {
                        t.add_fetched(records);
                        if s.idle > 0 {
                            shared.wake.notify_all();
                        }
                    }
                    Err(e) => {
                        t.fetched_gen = generation;
                        tracing::error!(task = %t.id, error = %e, "fetch failed");
                    }
                }
            }
            Pick::Idle => {
                let until_commit = s.next_commit_at.saturating_duration_since(Instant::now());
                let timeout = until_commit.clamp(Duration::from_millis(1), Duration::from_millis(100));
                s.idle += 1;
                let (guard, _) = shared
                    .wake
                    .wait_timeout(s, timeout)
                    .unwrap_or_else(|e| e.into_inner());
                s = guard;
                s.idle -= 1;
            }
        }
    }
}

/// Chooses what thread `me` does next: its own tasks first (fetch when they
/// run low, else take a unit), then helping the task with the most startable
/// work that still has room for another thread.
fn pick(s: &mut Sched, me: usize) -> Pick {
    let n = s.tasks.len();
    if n == 0 {
        return Pick::Idle;
    }
    let start = s.threads[me].cursor % n;
    for i in 0..n {
        let t = (start + i) % n;
        if s.tasks[t].owner != me {
            continue;
        }
        if let Some(pick) = try_task(s, t) {
            s.threads[me].cursor = t + 1;
            return pick;
        }
    }
    // Help: the task whose startable work most exceeds its threads.
    let best = (0..n)
        .filter(|&t| s.tasks[t].has_room() && s.tasks[t].startable_units() > 0)
        .max_by_key(|&t| s.tasks[t].startable_units());
    if let Some(t) = best
        && let Some(unit) = s.tasks[t].take_unit()
    {
        return Pick::Unit(t, unit);
    }
    // Fetch for a task whose owner is busy elsewhere.
    if let Some(t) = (0..n).find(|&t| s.tasks[t].can_fetch()) {
        return fetch(s, t);
    }
    Pick::Idle
}

fn try_task(s: &mut Sched, t: usize) -> Option<Pick> {
    let task = &mut s.tasks[t];
    if task.can_fetch() && task.startable_units() < task.threads_per_task {
        return Some(fetch(s, t));
    }
    task.take_unit().map(|unit| Pick::Unit(t, unit))
}

fn fetch(s: &mut Sched, t: usize) -> Pick {
    let task = &s.tasks[t];
    Pick::Fetch {
        task: t,
        from: task.seq.fetched_end(),
        max: task.fetch_capacity(),
        generation: task.append_gen,
    }
}

/// What processing a unit needs to know, copied out while the lock is held.
struct UnitContext {
    task_id: Arc<str>,
    pipeline: usize,
    partition: u32,
    thread: Arc<str>,
}

/// Runs the processor over a unit's records, outside any lock. A failure or
/// panic fails only its record.
fn process_unit(shared: &Shared, unit: UnitContext, records: &[crate::log::Record]) -> OutcomeBatch {
    let UnitContext {
        task_id,
        pipeline: pipeline_index,
        partition,
        thread,
    } = unit;
    let pipeline = &shared.pipelines[pipeline_index];
    let store = &pipeline.stores[partition as usize];
    let mut outcomes = Vec::with_capacity(records.len());
    for record in records {
        let ctx = ProcessorContext {
            task_id: &task_id,
            partition,
            attempt: 1,
            store: store.as_ref(),
        };
        let result = catch_unwind(AssertUnwindSafe(|| pipeline.processor.process(record, &ctx)));
        let (outcome, error) = match result {
            Ok(Ok(())) => (Outcome::Processed, None),
            Ok(Err(e)) => (Outcome::Failed, Some(Arc::from(e.to_string()))),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_string());
                (Outcome::Failed, Some(Arc::from(format!("Panic: {message}"))))
            }
        };
        outcomes.push(RecordOutcome {
            offset: record.offset,
            key: record.key.clone(),
            timestamp_ms: record.timestamp_ms,
            outcome,
            attempts: 1,
            error,
        });
    }
    OutcomeBatch {
        task_id,
        pipeline: pipeline.name.clone(),
        topic: pipeline.topic.clone(),
        partition,
        thread,
        first_offset: records.first().map_or(0, |r| r.offset),
        last_offset: records.last().map_or(0, |r| r.offset),
        records: outcomes,
    }
}

impl Shared {
    /// Commits every task whose watermark moved: inline (`sync`) or handed to
    /// the committer (`async`). Called with the lock; returns it re-taken.
    pub(crate) fn commit_round<'a>(&'a self, mut s: MutexGuard<'a, Sched>) -> MutexGuard<'a, Sched> {
        s.committing = true;
        s.next_commit_at = Instant::now() + Duration::from_millis(self.config.commit_interval_ms);
        let items = s.commit_items();
        drop(s);
        if !items.is_empty() {
            let handed_off = match self
                .async_commits
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
            {
                Some(sender) => sender.send(items.clone()).is_ok(),
                None => false,
            };
            if !handed_off {
                self.apply_commits(&items);
            }
        }
        let mut s = self.lock();
        s.committing = false;
        s
    }

    /// Writes commits in order, records them, and reports each to the callback.
    pub(crate) fn apply_commits(&self, items: &[super::CommitItem]) {
        for item in items {
            let pipeline = &self.pipelines[item.pipeline];
            let result = self
                .log
                .commit(
                    &self.config.application_id,
                    &pipeline.topic,
                    item.partition,
                    item.offset,
                )
                .map_err(|e| e.to_string());
            if result.is_ok() {
                let mut s = self.lock();
                let task = &mut s.tasks[item.task];
                task.committed = task.committed.max(item.offset);
            } else if let Err(e) = &result {
                tracing::error!(task = %item.task_id, offset = item.offset, error = %e, "commit failed");
            }
            if let Some(callback) = &self.on_commit {
                callback(&CommitReport {
                    task_id: item.task_id.to_string(),
                    offset: item.offset,
                    result,
                });
            }
        }
    }
}
