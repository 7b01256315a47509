//! The stream-thread loop: a thin driver of the Scheduler's picks. Each pick
//! is carried out outside the lock by one function here, then reported back.
//! Drop guards hand a dying thread's work back to the scheduler, and the
//! thread's exit guard asks for a replacement, which it starts.

use super::process;
use super::retry::{self, RetryItem};
use super::scheduler::{CommitItem, Pick, UnitContext};
use super::shared::Shared;
use super::task::RestoreFrom;
use super::work::WorkUnit;
use crate::log::Record;
use crate::metadata::AppState;
use crate::metrics::BusyRole;
use std::sync::Arc;
use std::time::Instant;

/// Starts the OS thread of scheduler slot `slot`.
pub(crate) fn spawn(shared: &Arc<Shared>, slot: usize, name: &str) {
    let for_thread = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || run(&for_thread, slot));
    match spawned {
        Ok(handle) => shared
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle),
        Err(e) => {
            tracing::error!(error = %e, thread = name, "could not start a stream thread");
            shared.lock().thread_not_started(slot);
        }
    }
}

/// Marks the thread gone when its loop ends; a thread that died (panicked)
/// is replaced by a new one that takes over its tasks.
struct ThreadExit<'a> {
    shared: &'a Arc<Shared>,
    me: usize,
}

impl Drop for ThreadExit<'_> {
    fn drop(&mut self) {
        let died = std::thread::panicking();
        let mut scheduler = self.shared.lock();
        if let Some(replacement) = scheduler.thread_exited(self.me, died) {
            let name = scheduler.threads()[replacement].name().clone();
            tracing::warn!(
                thread = %scheduler.threads()[self.me].name(),
                replacement = %name,
                "stream thread died; its tasks move to a new thread"
            );
            drop(scheduler);
            spawn(self.shared, replacement, &name);
        } else {
            drop(scheduler);
        }
        self.shared.wake.notify_all();
    }
}

/// What a thread holds while it works outside the lock; if it unwinds, the
/// guard gives it back so nothing is lost.
enum Holding {
    Nothing,
    Unit(usize, WorkUnit),
    Retries(usize, Vec<RetryItem>),
    /// A fetch, retry fetch or restore step: nothing to give back but the lease.
    Fetch(usize, u64),
    RetryFetch(usize, u64),
    Restore(usize),
    Commit,
}

struct WorkGuard<'a> {
    shared: &'a Shared,
    me: usize,
    holding: Holding,
}

impl WorkGuard<'_> {
    /// The work is done and reported: nothing to give back.
    fn done(mut self) {
        self.holding = Holding::Nothing;
    }
}

impl Drop for WorkGuard<'_> {
    fn drop(&mut self) {
        let holding = std::mem::replace(&mut self.holding, Holding::Nothing);
        if matches!(holding, Holding::Nothing) {
            return;
        }
        let mut scheduler = self.shared.lock();
        match holding {
            Holding::Nothing => {}
            Holding::Unit(task, unit) => scheduler.return_unit(self.me, task, unit),
            Holding::Retries(task, items) => scheduler.return_retries(self.me, task, items),
            Holding::Fetch(task, generation) => {
                scheduler.finish_fetch(self.me, task, generation, Err(()), Instant::now());
            }
            Holding::RetryFetch(task, generation) => {
                scheduler.finish_retry_fetch(self.me, task, generation, Err(()));
            }
            Holding::Restore(task) => {
                scheduler.finish_restore(self.me, task, None);
            }
            Holding::Commit => scheduler.finish_commit_round(self.me),
        }
        self.shared.wake.notify_all();
    }
}

fn run(shared: &Arc<Shared>, me: usize) {
    let _exit = ThreadExit { shared, me };
    loop {
        let pick = {
            let mut scheduler = shared.lock();
            #[cfg(any(test, feature = "fault-injection"))]
            if scheduler.take_crash_request(me) {
                let pick = scheduler.pick(me, Instant::now(), process::now_ms());
                drop(scheduler);
                crash_holding(shared, me, pick);
            }
            let pick = scheduler.pick(me, Instant::now(), process::now_ms());
            if let Pick::Wait(timeout) = pick {
                // Announced before the inbox is checked, so an append the
                // listener could not hand over is either seen here or
                // followed by a wake-up (see `AppendInbox`).
                let _waiting = shared.appends.waiting();
                if shared.appends.has_pending() {
                    continue;
                }
                scheduler.begin_wait();
                let (mut scheduler, _) = shared
                    .wake
                    .wait_timeout(scheduler, timeout)
                    .unwrap_or_else(|e| e.into_inner());
                scheduler.end_wait();
                continue;
            }
            pick
        };
        match pick {
            Pick::Exit => return,
            Pick::Wait(_) => {}
            // Each takes its context by value and drops it before reporting
            // back: a task that leaves must not find its store still held.
            Pick::Unit { task, unit, context } => run_unit(shared, me, task, unit, context),
            Pick::Fetch {
                task,
                from,
                max,
                generation,
                context,
            } => fetch(shared, me, task, Source::Records, from, max, generation, context),
            Pick::RetryFetch {
                task,
                from,
                max,
                generation,
                context,
            } => fetch(shared, me, task, Source::Retries, from, max, generation, context),
            Pick::Retry { task, items, context } => run_retries(shared, me, task, items, context),
            Pick::Restore {
                task,
                from,
                until,
                source,
                context,
            } => restore(shared, me, task, from, until, &source, context),
            Pick::Commit { items, retention } => commit_round(shared, me, items, retention),
        }
    }
}

/// Fault injection for tests: die holding whatever the pick handed out, so
/// its guard must hand it back and the thread must be replaced.
#[cfg(any(test, feature = "fault-injection"))]
fn crash_holding(shared: &Shared, me: usize, pick: Pick) -> ! {
    let holding = match pick {
        Pick::Unit { task, unit, .. } => Holding::Unit(task, unit),
        Pick::Retry { task, items, .. } => Holding::Retries(task, items),
        Pick::Fetch { task, generation, .. } => Holding::Fetch(task, generation),
        Pick::RetryFetch { task, generation, .. } => Holding::RetryFetch(task, generation),
        Pick::Restore { task, .. } => Holding::Restore(task),
        Pick::Commit { .. } => Holding::Commit,
        Pick::Wait(_) | Pick::Exit => Holding::Nothing,
    };
    let _guard = WorkGuard { shared, me, holding };
    panic!("injected crash of a stream thread");
}

fn run_unit(shared: &Shared, me: usize, task: usize, unit: WorkUnit, context: UnitContext) {
    // The guard holds the unit until it is reported: a panic outside the
    // processor (which is caught per record) hands it back whole.
    let guard = WorkGuard {
        shared,
        me,
        holding: Holding::Unit(task, unit),
    };
    let Holding::Unit(_, unit) = &guard.holding else {
        return;
    };
    let span = tracing::debug_span!(
        "unit",
        task = %context.task_id,
        thread = %context.thread,
        first = unit.records.first().map_or(0, |r| r.offset),
        last = unit.records.last().map_or(0, |r| r.offset),
        records = unit.records.len(),
    );
    let started = Instant::now();
    let done = span.in_scope(|| process::run_unit(shared, &context, unit));
    context.count_busy(
        if context.owner {
            BusyRole::Owner
        } else {
            BusyRole::Helper
        },
        started.elapsed(),
    );
    let sink = context.sink.clone();
    drop(context);
    let (commit, retired) = {
        let mut scheduler = shared.lock();
        let commit = scheduler.finish_unit(me, task, done);
        shared.wake_waiters(&scheduler);
        (commit, scheduler.take_retired(task))
    };
    drop(retired);
    guard.done();
    drain_sink(shared, sink.as_deref());
    if let Some(item) = commit {
        super::commit::run(shared, vec![item]);
    }
}

/// Appends the outputs a completion released (outside the scheduler's lock).
/// A failure leaves them queued: the next drain, or the commit that needs
/// them (which then fails), tries again.
fn drain_sink(shared: &Shared, sink: Option<&super::sink::SinkQueue>) {
    if let Some(sink) = sink
        && let Err(error) = sink.drain(shared)
    {
        tracing::error!(%error, "output records wait for the next attempt");
    }
}

/// Reads up to `max` records of a topic partition from `from`: the one
/// helper behind source and retry fetches.
fn read(shared: &Shared, topic: &str, partition: u32, from: u64, max: usize) -> Result<Vec<Record>, ()> {
    let mut records = Vec::new();
    match shared.log.read(topic, partition, from, max, &mut records) {
        Ok(()) => Ok(records),
        Err(e) => {
            tracing::error!(topic, partition, offset = from, error = %e, "fetch failed; retrying with backoff");
            Err(())
        }
    }
}

/// What a fetch read, ready for the scheduler.
enum Fetched {
    Records(Result<Vec<Record>, ()>),
    Retries(Result<Vec<RetryItem>, ()>),
}

/// Which partition of a task a fetch reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Records,
    Retries,
}

/// Reads the task's source (or retry) partition and hands what it read to
/// the scheduler; a failed read is retried with backoff.
#[allow(clippy::too_many_arguments)]
fn fetch(
    shared: &Shared,
    me: usize,
    task: usize,
    source: Source,
    from: u64,
    max: usize,
    generation: u64,
    context: UnitContext,
) {
    let guard = WorkGuard {
        shared,
        me,
        holding: match source {
            Source::Records => Holding::Fetch(task, generation),
            Source::Retries => Holding::RetryFetch(task, generation),
        },
    };
    let pipeline = &shared.pipelines[context.pipeline];
    let topic = match source {
        Source::Records => &pipeline.topic,
        Source::Retries => &pipeline.retry_topic,
    };
    let records = read(shared, topic, context.partition, from, max);
    drop(context);
    // Decoded before the lock is taken: every other thread waits while it is held.
    let fetched = match source {
        Source::Records => Fetched::Records(records),
        Source::Retries => {
            let now_ms = process::now_ms();
            Fetched::Retries(records.map(|records| {
                records
                    .into_iter()
                    .map(|r| retry::decode(r, now_ms, |attempts, seed| shared.backoff(attempts, seed)))
                    .collect()
            }))
        }
    };
    let mut scheduler = shared.lock();
    match fetched {
        Fetched::Records(records) => scheduler.finish_fetch(me, task, generation, records, Instant::now()),
        Fetched::Retries(items) => scheduler.finish_retry_fetch(me, task, generation, items),
    }
    shared.wake_waiters(&scheduler);
    drop(scheduler);
    guard.done();
}

fn run_retries(shared: &Shared, me: usize, task: usize, items: Vec<RetryItem>, context: UnitContext) {
    let mut guard = WorkGuard {
        shared,
        me,
        holding: Holding::Retries(task, items),
    };
    let Holding::Retries(_, items) = &mut guard.holding else {
        return;
    };
    let span = tracing::debug_span!("retries", task = %context.task_id, thread = %context.thread, items = items.len());
    let started = Instant::now();
    // Takes the items out of the guard only once they are all attempted.
    let done = span.in_scope(|| process::run_retries(shared, &context, items));
    context.count_busy(BusyRole::Retry, started.elapsed());
    let sink = context.sink.clone();
    drop(context);
    let ((commit, next), retired) = {
        let mut scheduler = shared.lock();
        let finished = scheduler.finish_retries(me, task, done);
        // Finished retries open keys and may free held records: wake
        // helpers, if any wait (a wake-up costs a system call even then).
        shared.wake_waiters(&scheduler);
        (finished, scheduler.take_retired(task))
    };
    drop(retired);
    guard.done();
    // The records held behind the keys that opened run here and now, first:
    // until `run_unit` guards them, nothing else would give them back.
    if let Some((unit, context)) = next {
        run_unit(shared, me, task, unit, context);
    }
    drain_sink(shared, sink.as_deref());
    if let Some(item) = commit {
        super::commit::run(shared, vec![item]);
    }
}

fn restore(
    shared: &Shared,
    me: usize,
    task: usize,
    from: u64,
    until: u64,
    source: &RestoreFrom,
    context: UnitContext,
) {
    let guard = WorkGuard {
        shared,
        me,
        holding: Holding::Restore(task),
    };
    let started = Instant::now();
    let replayed = match source {
        RestoreFrom::Source { skip } => {
            process::restore_chunk(shared, &context, from, until, skip).map_err(|e| e.to_string())
        }
        RestoreFrom::Changelog => super::changelog::restore_chunk(shared, &context.store, from, until),
    };
    context.count_busy(BusyRole::Restore, started.elapsed());
    let next = match replayed {
        Ok(next) => Some(next),
        Err(e) => {
            tracing::error!(task = %context.task_id, error = %e, "restore read failed; retrying");
            None
        }
    };
    drop(context);
    let mut scheduler = shared.lock();
    let all_restored = scheduler.finish_restore(me, task, next);
    if all_restored && shared.app_state() == AppState::Starting {
        shared.set_state(AppState::Running);
    }
    shared.wake.notify_all();
    drop(scheduler);
    guard.done();
}

fn commit_round(shared: &Shared, me: usize, items: Vec<CommitItem>, retention: bool) {
    let guard = WorkGuard {
        shared,
        me,
        holding: Holding::Commit,
    };
    super::commit::run(shared, items);
    if retention {
        super::commit::enforce_retention(shared);
    }
    super::commit::publish_gauges(shared);
    shared.lock().finish_commit_round(me);
    guard.done();
}
