//! Stream threads: the loop each OS thread runs (pick work, process it outside
//! the lock, complete it), commits, the drop guards that return a dead thread's
//! work and replace the thread, and the sticky, balanced task assignment.

use super::retry::{self, Failure, RetryItem};
use super::{CommitItem, CommitReport, PipelineRuntime, Sched, Shared, task::WorkUnit};
use crate::config::{ProcessingOrder, RetryPolicy};
use crate::log::{ProducerRecord, Record};
use crate::metadata::{AppState, Outcome, OutcomeBatch, RecordOutcome};
use crate::processor::ProcessorContext;
use crate::store::Checkpoint;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
    /// Lent to a retry topic (`current` is the task whose retries it runs).
    pub(crate) on_retry: bool,
    /// Units since it last took retry work (see `RETRY_SHARE`).
    units_since_retry: u32,
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
            on_retry: false,
            units_since_retry: 0,
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
    /// Read more of the task's retry-topic partition.
    RetryFetch {
        task: usize,
        from: u64,
        max: usize,
        generation: u64,
    },
    /// Retry items that are due.
    Retry(usize, Vec<RetryItem>),
    /// Replay source offsets `[from, until)` into the task's memory store.
    Restore {
        task: usize,
        from: u64,
        until: u64,
    },
    Idle(Duration),
}

/// A thread takes due retry work before its own after this many units, so
/// retries drain even when no thread is in reserve, and new records keep flowing.
const RETRY_SHARE: u32 = 4;

/// Source records replayed per restore step (the lock is released between steps).
const RESTORE_CHUNK: usize = 5_000;

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

/// Returns retry items to their queue if the thread unwinds while holding them.
struct RetryGuard<'a> {
    shared: &'a Shared,
    task: usize,
    items: Option<Vec<RetryItem>>,
}

impl Drop for RetryGuard<'_> {
    fn drop(&mut self) {
        if let Some(items) = self.items.take() {
            let mut s = self.shared.lock();
            s.tasks[self.task].retry.return_items(items);
            self.shared.wake.notify_all();
        }
    }
}

/// Marks a restore step free again if the thread unwinds during it.
struct RestoreGuard<'a> {
    shared: &'a Shared,
    task: usize,
    armed: bool,
}

impl Drop for RestoreGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut s = self.shared.lock();
            if let Some(restore) = s.tasks[self.task].restore.as_mut() {
                restore.busy = false;
            }
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
            // Die holding the work, if any: its guard must hand it back.
            let (_unit, _retry) = match picked {
                Pick::Unit(task, unit) => (
                    Some(UnitGuard {
                        shared: &shared,
                        task,
                        unit: Some(unit),
                    }),
                    None,
                ),
                Pick::Retry(task, items) => (
                    None,
                    Some(RetryGuard {
                        shared: &shared,
                        task,
                        items: Some(items),
                    }),
                ),
                _ => (None, None),
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
                s.threads[me].units_since_retry += 1;
                let lane = unit.lane;
                let context = UnitContext::new(&s, task, me);
                drop(s);
                let mut guard = UnitGuard {
                    shared: &shared,
                    task,
                    unit: Some(unit),
                };
                let batch = process_unit(
                    &shared,
                    &context,
                    guard.unit.as_ref().map_or(&[][..], |u| &u.records),
                );
                guard.unit = None;
                drop(guard);
                s = shared.lock();
                s.threads[me].current = None;
                s.threads[me].records_processed += batch.records.len() as u64;
                let mut released = Vec::new();
                s.tasks[task].complete(lane, batch, &mut released);
                publish(&s, context.pipeline, released);
                s = shared.commit_if_quiescent(s, task);
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
            Pick::RetryFetch {
                task,
                from,
                max,
                generation,
            } => {
                s.tasks[task].retry.fetching = true;
                let pipeline = &shared.pipelines[s.tasks[task].pipeline];
                let partition = s.tasks[task].partition;
                drop(s);
                let mut records = Vec::new();
                let result = shared
                    .log
                    .read(&pipeline.retry_topic, partition, from, max, &mut records);
                let items: Vec<RetryItem> = records
                    .into_iter()
                    .map(|r| retry::decode(r, |attempts, seed| shared.backoff(attempts, seed)))
                    .collect();
                s = shared.lock();
                let queue = &mut s.tasks[task].retry;
                queue.fetching = false;
                match result {
                    Ok(()) if items.is_empty() => queue.fetched_gen = generation,
                    Ok(()) => {
                        queue.add_fetched(items);
                        if s.idle > 0 {
                            shared.wake.notify_all();
                        }
                    }
                    Err(e) => {
                        queue.fetched_gen = generation;
                        tracing::error!(task = %s.tasks[task].id, error = %e, "retry fetch failed");
                    }
                }
            }
            Pick::Retry(task, items) => {
                s.threads[me].current = Some(task);
                s.threads[me].on_retry = true;
                s.threads[me].units_since_retry = 0;
                let context = UnitContext::new(&s, task, me);
                drop(s);
                let mut guard = RetryGuard {
                    shared: &shared,
                    task,
                    items: Some(items),
                };
                let done = process_retries(&shared, &context, guard.items.take().unwrap_or_default());
                drop(guard);
                s = shared.lock();
                s.threads[me].current = None;
                s.threads[me].on_retry = false;
                let t = &mut s.tasks[task];
                t.retry.complete(&done.finished, done.again);
                t.count_outcomes(&done.batch);
                let batch = Arc::new(done.batch);
                t.history_push(batch.clone());
                publish(&s, context.pipeline, vec![batch]);
                s = shared.commit_if_quiescent(s, task);
                shared.wake.notify_all();
            }
            Pick::Restore { task, from, until } => {
                s.threads[me].current = Some(task);
                let context = UnitContext::new(&s, task, me);
                let skip = s.tasks[task]
                    .restore
                    .as_ref()
                    .map(|r| r.skip.clone())
                    .unwrap_or_default();
                drop(s);
                let mut guard = RestoreGuard {
                    shared: &shared,
                    task,
                    armed: true,
                };
                let next = restore_chunk(&shared, &context, from, until, &skip);
                guard.armed = false;
                s = shared.lock();
                s.threads[me].current = None;
                let t = &mut s.tasks[task];
                match next {
                    Ok(next) if next >= until => {
                        tracing::info!(task = %t.id, records = until, "store restored");
                        t.restore = None;
                    }
                    Ok(next) => {
                        if let Some(restore) = t.restore.as_mut() {
                            restore.next = next;
                            restore.busy = false;
                        }
                    }
                    Err(e) => {
                        tracing::error!(task = %t.id, error = %e, "restore read failed; retrying");
                        if let Some(restore) = t.restore.as_mut() {
                            restore.busy = false;
                        }
                    }
                }
                if s.tasks.iter().all(|t| t.restore.is_none()) && shared.app_state() == AppState::Starting {
                    shared.set_state(AppState::Running);
                }
                shared.wake.notify_all();
            }
            Pick::Idle(timeout) => {
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

/// Sends released batches to the pipeline's subscribers.
fn publish(s: &Sched, pipeline: usize, batches: Vec<Arc<OutcomeBatch>>) {
    if let Some(sender) = &s.senders[pipeline] {
        for batch in batches {
            // No receiver is fine: outcomes are retained in history.
            let _ = sender.send(batch);
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Chooses what thread `me` does next: restores first; due retries when the
/// thread has done its share of other work; then its own tasks (fetch when
/// they run low, else take a unit); then helping the task with the most
/// startable work that has room; then fetching for others; then retries
/// (a thread in reserve is lent to them); else idle until the next due time.
fn pick(s: &mut Sched, me: usize) -> Pick {
    let n = s.tasks.len();
    if n == 0 {
        return Pick::Idle(Duration::from_millis(100));
    }
    if let Some(t) = (0..n).find(|&t| s.tasks[t].restore.as_ref().is_some_and(|r| !r.busy)) {
        let restore = s.tasks[t].restore.as_mut().map(|r| {
            r.busy = true;
            (r.next, r.until)
        });
        if let Some((from, until)) = restore {
            return Pick::Restore { task: t, from, until };
        }
    }
    let now = now_ms();
    if s.threads[me].units_since_retry >= RETRY_SHARE
        && let Some(pick) = pick_retry(s, me, now)
    {
        return pick;
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
    if let Some(t) = (0..n).find(|&t| s.tasks[t].retry.can_fetch()) {
        let queue = &s.tasks[t].retry;
        return Pick::RetryFetch {
            task: t,
            from: queue.seq.fetched_end(),
            max: queue.fetch_capacity(),
            generation: queue.append_gen,
        };
    }
    if let Some(pick) = pick_retry(s, me, now) {
        return pick;
    }
    let until_commit = s.next_commit_at.saturating_duration_since(Instant::now());
    let until_retry = s
        .tasks
        .iter()
        .filter(|t| !t.commit_pending)
        .filter_map(|t| t.retry.next_due_ms())
        .min()
        .map_or(Duration::MAX, |due| {
            Duration::from_millis(due.saturating_sub(now).max(0) as u64)
        });
    Pick::Idle(
        until_commit
            .min(until_retry)
            .clamp(Duration::from_millis(1), Duration::from_millis(100)),
    )
}

/// Due retry items of some task, starting after the thread's cursor. While
/// new records wait, at most half the threads are on retries, so slow or
/// hanging retries can never take every thread from the partitions.
fn pick_retry(s: &mut Sched, me: usize, now_ms: i64) -> Option<Pick> {
    let n = s.tasks.len();
    let on_retry = s.threads.iter().filter(|t| t.alive && t.on_retry).count();
    if on_retry > 0 {
        let live = s.threads.iter().filter(|t| t.is_live()).count();
        let source_work = s.tasks.iter().any(|t| t.startable_units() > 0 || t.can_fetch());
        if source_work && on_retry >= (live / 2).max(1) {
            return None;
        }
    }
    let start = s.threads[me].cursor % n;
    for i in 0..n {
        let t = (start + i) % n;
        let task = &mut s.tasks[t];
        if task.commit_pending || task.restore.is_some() {
            continue;
        }
        let items = task.retry.take_due(now_ms);
        if !items.is_empty() {
            return Some(Pick::Retry(t, items));
        }
    }
    None
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

/// What processing a task's records needs to know, copied out while the lock is held.
struct UnitContext {
    task_id: Arc<str>,
    pipeline: usize,
    partition: u32,
    thread: Arc<str>,
    parked: Arc<retry::ParkedKeys>,
    keyed: bool,
}

impl UnitContext {
    fn new(s: &Sched, task: usize, thread: usize) -> UnitContext {
        let t = &s.tasks[task];
        UnitContext {
            task_id: t.id.clone(),
            pipeline: t.pipeline,
            partition: t.partition,
            thread: s.threads[thread].name.clone(),
            parked: t.parked.clone(),
            keyed: t.order == ProcessingOrder::Key,
        }
    }

    fn batch(&self, pipeline: &PipelineRuntime, records: Vec<RecordOutcome>) -> OutcomeBatch {
        crate::metrics::record_outcomes(&pipeline.name, &records);
        OutcomeBatch {
            task_id: self.task_id.clone(),
            pipeline: pipeline.name.clone(),
            topic: pipeline.topic.clone(),
            partition: self.partition,
            thread: self.thread.clone(),
            first_offset: records.iter().map(|r| r.offset).min().unwrap_or(0),
            last_offset: records.iter().map(|r| r.offset).max().unwrap_or(0),
            records,
        }
    }
}

fn outcome(record: &Record, outcome: Outcome, attempts: u32, error: Option<&Failure>) -> RecordOutcome {
    RecordOutcome {
        offset: record.offset,
        key: record.key.clone(),
        timestamp_ms: record.timestamp_ms,
        outcome,
        attempts,
        error: error.map(|f| Arc::from(format!("{}: {}", f.kind, f.message))),
    }
}

/// Runs the processor once over `record`. An error, a panic, or a call that
/// outlives `processing_timeout_ms` is a failure (kind, message).
fn attempt(
    shared: &Shared,
    context: &UnitContext,
    record: &Record,
    attempt: u32,
) -> Result<(), (String, String)> {
    let pipeline = &shared.pipelines[context.pipeline];
    let timeout = shared.processing_timeout();
    let started = Instant::now();
    let ctx = ProcessorContext {
        task_id: &context.task_id,
        partition: context.partition,
        attempt,
        store: pipeline.stores[context.partition as usize].kv(),
        deadline: timeout.map(|t| started + t),
    };
    let result = catch_unwind(AssertUnwindSafe(|| pipeline.processor.process(record, &ctx)));
    match result {
        Ok(Ok(())) => match timeout {
            Some(limit) if started.elapsed() > limit => Err((
                "Timeout".to_string(),
                format!(
                    "processing took {} ms, more than processing_timeout_ms ({})",
                    started.elapsed().as_millis(),
                    limit.as_millis()
                ),
            )),
            _ => Ok(()),
        },
        Ok(Err(e)) => Err((e.kind, e.message)),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(("Panic".to_string(), message))
        }
    }
}

/// Appends failed records to a topic durably, trying a few times: the records
/// must not count as completed before they are safely on their path.
fn append_failed(shared: &Shared, topic: &str, records: Vec<ProducerRecord>) -> Result<(), String> {
    if records.is_empty() {
        return Ok(());
    }
    let mut last_error = String::new();
    for pause_ms in [0, 10, 100, 1_000] {
        std::thread::sleep(Duration::from_millis(pause_ms));
        match shared.log.append(topic, records.clone()) {
            Ok(_) => return Ok(()),
            Err(e) => last_error = e.to_string(),
        }
    }
    tracing::error!(topic, error = %last_error, "could not append failed records");
    Err(last_error)
}

/// Runs the processor over a unit's records, outside any lock. A failing
/// record goes to the retry topic (or, `blocking`, is retried in place) and
/// the unit moves on; in `key` order a record whose key has an earlier record
/// on the retry path is parked behind it there.
fn process_unit(shared: &Shared, context: &UnitContext, records: &[Record]) -> OutcomeBatch {
    let pipeline = &shared.pipelines[context.pipeline];
    let max_attempts = shared.config.retry_max_attempts;
    let mut outcomes = Vec::with_capacity(records.len());
    let mut to_retry: Vec<(usize, ProducerRecord)> = Vec::new();
    let mut to_dead_letter: Vec<(usize, ProducerRecord)> = Vec::new();
    let parks = pipeline.retry_policy == RetryPolicy::RetryTopic && context.keyed;
    for record in records {
        if parks
            && let Some(key) = &record.key
            && context.parked.add(key, true)
        {
            let now = now_ms();
            let failure = Failure {
                kind: "Parked".to_string(),
                message: "waits behind an earlier record of its key on the retry path".to_string(),
                attempts: 0,
                first_failure_ms: now,
                last_failure_ms: now,
            };
            to_retry.push((
                outcomes.len(),
                retry::failed_record(&pipeline.topic, record, &failure),
            ));
            outcomes.push(outcome(record, Outcome::Retrying, 0, Some(&failure)));
            continue;
        }
        let Err((kind, message)) = attempt(shared, context, record, 1) else {
            outcomes.push(outcome(record, Outcome::Processed, 1, None));
            continue;
        };
        let now = now_ms();
        let mut failure = Failure {
            kind,
            message,
            attempts: 1,
            first_failure_ms: now,
            last_failure_ms: now,
        };
        if pipeline.retry_policy == RetryPolicy::Blocking {
            // Kafka Streams' way: the partition waits while the record is retried here.
            let mut succeeded = false;
            while failure.attempts < max_attempts {
                std::thread::sleep(shared.backoff(failure.attempts, record.offset));
                match attempt(shared, context, record, failure.attempts + 1) {
                    Ok(()) => {
                        succeeded = true;
                        outcomes.push(outcome(record, Outcome::Processed, failure.attempts + 1, None));
                        break;
                    }
                    Err((kind, message)) => {
                        failure.attempts += 1;
                        failure.kind = kind;
                        failure.message = message;
                        failure.last_failure_ms = now_ms();
                    }
                }
            }
            if !succeeded {
                let dead = retry::failed_record(&pipeline.topic, record, &failure);
                to_dead_letter.push((outcomes.len(), dead));
                outcomes.push(outcome(
                    record,
                    Outcome::DeadLettered,
                    failure.attempts,
                    Some(&failure),
                ));
            }
            continue;
        }
        if max_attempts <= 1 {
            let dead = retry::failed_record(&pipeline.topic, record, &failure);
            to_dead_letter.push((outcomes.len(), dead));
            outcomes.push(outcome(record, Outcome::DeadLettered, 1, Some(&failure)));
            continue;
        }
        if parks && let Some(key) = &record.key {
            context.parked.add(key, false);
        }
        to_retry.push((
            outcomes.len(),
            retry::failed_record(&pipeline.topic, record, &failure),
        ));
        outcomes.push(outcome(record, Outcome::Retrying, 1, Some(&failure)));
    }
    for (topic, entries) in [
        (&pipeline.retry_topic, to_retry),
        (&pipeline.dead_letter_topic, to_dead_letter),
    ] {
        let (indices, produced): (Vec<usize>, Vec<ProducerRecord>) = entries.into_iter().unzip();
        if let Err(error) = append_failed(shared, topic, produced) {
            // Not on its path: the record's outcome is final, and its key no longer parked.
            for i in indices {
                let record = &mut outcomes[i];
                if record.outcome == Outcome::Retrying
                    && parks
                    && let Some(key) = &record.key
                {
                    context.parked.remove(key);
                }
                record.outcome = Outcome::Failed;
                record.error = Some(Arc::from(format!("could not append to `{topic}`: {error}")));
            }
        }
    }
    context.batch(pipeline, outcomes)
}

/// What a retry unit did: items that reached a final outcome (retry offset,
/// source offset, key), items to try again later, and the outcomes to publish.
struct RetryDone {
    finished: Vec<(u64, u64, Option<bytes::Bytes>)>,
    again: Vec<RetryItem>,
    batch: OutcomeBatch,
}

/// Attempts retry items, outside any lock: success is final; a failure waits
/// for its next attempt with backoff, or after the last one is dead-lettered.
fn process_retries(shared: &Shared, context: &UnitContext, items: Vec<RetryItem>) -> RetryDone {
    /// Where an item stands after its attempt.
    enum Next {
        Processed,
        Again,
        DeadLetter,
        /// `key` order: an earlier item of its key failed again in this unit,
        /// so it did not run and waits behind that one.
        Untouched,
    }
    let pipeline = &shared.pipelines[context.pipeline];
    let max_attempts = shared.config.retry_max_attempts;
    let mut attempted = Vec::with_capacity(items.len());
    let mut blocked_keys: std::collections::HashSet<bytes::Bytes> = std::collections::HashSet::new();
    for mut item in items {
        if context.keyed
            && let Some(key) = &item.record.key
            && blocked_keys.contains(key)
        {
            attempted.push((item, Next::Untouched));
            continue;
        }
        let number = item.failure.attempts + 1;
        let next = match attempt(shared, context, &item.record, number) {
            Ok(()) => Next::Processed,
            Err((kind, message)) => {
                let now = now_ms();
                item.failure.attempts = number;
                item.failure.kind = kind;
                item.failure.message = message;
                item.failure.last_failure_ms = now;
                if item.failure.first_failure_ms == 0 {
                    item.failure.first_failure_ms = now;
                }
                if number >= max_attempts {
                    Next::DeadLetter
                } else {
                    item.due_ms = now + shared.backoff(number, item.retry_offset).as_millis() as i64;
                    if context.keyed
                        && let Some(key) = &item.record.key
                    {
                        blocked_keys.insert(key.clone());
                    }
                    Next::Again
                }
            }
        };
        attempted.push((item, next));
    }
    let dead: Vec<ProducerRecord> = attempted
        .iter()
        .filter(|(_, next)| matches!(next, Next::DeadLetter))
        .map(|(item, _)| retry::failed_record(&pipeline.topic, &item.record, &item.failure))
        .collect();
    // Refused by the dead-letter topic: the record stays on the retry path.
    let dead_lettered = append_failed(shared, &pipeline.dead_letter_topic, dead).is_ok();
    let mut finished = Vec::new();
    let mut again = Vec::new();
    let mut outcomes = Vec::with_capacity(attempted.len());
    for (mut item, next) in attempted {
        let attempts = item.failure.attempts;
        let final_outcome = match next {
            Next::Untouched => false,
            Next::Processed => {
                outcomes.push(outcome(&item.record, Outcome::Processed, attempts + 1, None));
                true
            }
            Next::DeadLetter if dead_lettered => {
                outcomes.push(outcome(
                    &item.record,
                    Outcome::DeadLettered,
                    attempts,
                    Some(&item.failure),
                ));
                true
            }
            Next::DeadLetter | Next::Again => {
                if matches!(next, Next::DeadLetter) {
                    item.due_ms = now_ms() + shared.backoff(attempts, item.retry_offset).as_millis() as i64;
                }
                outcomes.push(outcome(
                    &item.record,
                    Outcome::Retrying,
                    attempts,
                    Some(&item.failure),
                ));
                false
            }
        };
        if final_outcome {
            if context.keyed
                && let Some(key) = &item.record.key
            {
                context.parked.remove(key);
            }
            finished.push((item.retry_offset, item.record.offset, item.record.key.clone()));
        } else {
            again.push(item);
        }
    }
    RetryDone {
        finished,
        again,
        batch: context.batch(pipeline, outcomes),
    }
}

/// Replays source offsets `[from, until)` (at most a chunk) into a memory
/// store, without publishing outcomes. Records still on the retry path
/// (`skip`) are left to it; a record that fails is tried as often as
/// `retry_max_attempts` allows, as it was the first time. Answers the next offset.
fn restore_chunk(
    shared: &Shared,
    context: &UnitContext,
    from: u64,
    until: u64,
    skip: &std::collections::HashSet<u64>,
) -> Result<u64, crate::log::LogError> {
    let pipeline = &shared.pipelines[context.pipeline];
    let max = ((until - from) as usize).min(RESTORE_CHUNK);
    let mut records = Vec::with_capacity(max);
    shared
        .log
        .read(&pipeline.topic, context.partition, from, max, &mut records)?;
    let mut next = from;
    for record in &records {
        next = record.offset + 1;
        if skip.contains(&record.offset) {
            continue;
        }
        for number in 1..=shared.config.retry_max_attempts {
            if attempt(shared, context, record, number).is_ok() {
                break;
            }
        }
    }
    // An empty read below `until` means the log lost records: do not spin.
    Ok(if records.is_empty() { until } else { next })
}

impl Shared {
    /// Backoff before attempt `attempts + 1`, jittered by `seed`.
    pub(crate) fn backoff(&self, attempts: u32, seed: u64) -> Duration {
        retry::backoff(
            attempts,
            self.config.retry_backoff_ms,
            self.config.retry_backoff_max_ms,
            seed ^ u64::from(attempts).rotate_left(32),
        )
    }

    fn processing_timeout(&self) -> Option<Duration> {
        (self.config.processing_timeout_ms > 0)
            .then(|| Duration::from_millis(self.config.processing_timeout_ms))
    }

    /// Commits every task whose watermark moved: memory stores through the
    /// log at once; persistent stores once quiescent (see `commit_if_quiescent`).
    /// Inline (`sync`) or handed to the committer (`async`). Called with the
    /// lock; returns it re-taken.
    pub(crate) fn commit_round<'a>(&'a self, mut s: MutexGuard<'a, Sched>) -> MutexGuard<'a, Sched> {
        s.committing = true;
        s.next_commit_at = Instant::now() + Duration::from_millis(self.config.commit_interval_ms);
        let mut items = s.commit_items();
        for t in 0..s.tasks.len() {
            let task = &mut s.tasks[t];
            if task.persistent && task.restore.is_none() && task.has_uncommitted() {
                task.commit_pending = true;
                if let Some(item) = self.freeze_if_quiescent(&mut s, t) {
                    items.push(item);
                }
            }
        }
        let retention_due = Instant::now() >= s.next_retention_at;
        if retention_due {
            s.next_retention_at = Instant::now() + super::RETENTION_INTERVAL;
        }
        let retention = retention_due.then(|| self.retention_plan(&s));
        self.publish_gauges(&s);
        drop(s);
        self.dispatch_commits(items);
        if let Some(plan) = retention {
            self.enforce_retention(plan);
        }
        let mut s = self.lock();
        s.committing = false;
        s
    }

    /// A task waiting to commit its persistent store that has become
    /// quiescent: freeze its state now and commit it outside the lock.
    pub(crate) fn commit_if_quiescent<'a>(
        &'a self,
        mut s: MutexGuard<'a, Sched>,
        task: usize,
    ) -> MutexGuard<'a, Sched> {
        if !s.tasks[task].commit_pending {
            return s;
        }
        let Some(item) = self.freeze_if_quiescent(&mut s, task) else {
            return s;
        };
        drop(s);
        self.dispatch_commits(vec![item]);
        self.lock()
    }

    /// Freezes a quiescent task's store: the frozen writes are exactly those of
    /// the records below its watermarks, which are committed with them.
    pub(crate) fn freeze_if_quiescent(&self, s: &mut Sched, t: usize) -> Option<CommitItem> {
        let task = &mut s.tasks[t];
        if !task.quiescent() {
            return None;
        }
        task.commit_pending = false;
        let pipeline = &self.pipelines[task.pipeline];
        let store = pipeline.stores[task.partition as usize].persistent()?;
        // False while the previous commit is still being written: next round.
        if !store.begin_commit() {
            return None;
        }
        self.wake.notify_all();
        Some(CommitItem {
            task: t,
            task_id: task.id.clone(),
            pipeline: task.pipeline,
            partition: task.partition,
            offset: task.seq.watermark(),
            retry_offset: task.retry.seq.watermark(),
            retry_done: task.retry.done_above_watermark(),
            persistent: true,
        })
    }

    fn dispatch_commits(&self, items: Vec<CommitItem>) {
        if items.is_empty() {
            return;
        }
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

    /// Writes commits in order, records them, and reports each to the callback.
    pub(crate) fn apply_commits(&self, items: &[CommitItem]) {
        for item in items {
            let pipeline = &self.pipelines[item.pipeline];
            let group = &self.config.application_id;
            let result = if item.persistent {
                match pipeline.stores[item.partition as usize].persistent() {
                    Some(store) => store
                        .finish_commit(Checkpoint {
                            watermark: item.offset,
                            retry_offset: item.retry_offset,
                            retry_done: item.retry_done.clone(),
                        })
                        .map_err(|e| e.to_string()),
                    None => Err("the store is not persistent".to_string()),
                }
            } else {
                // Each commit may cost an fsync: write only the positions that moved.
                let (source_moved, retry_moved) = {
                    let s = self.lock();
                    let task = &s.tasks[item.task];
                    (
                        item.offset != task.committed,
                        item.retry_offset != task.retry.committed,
                    )
                };
                let source = match source_moved {
                    true => self
                        .log
                        .commit(group, &pipeline.topic, item.partition, item.offset),
                    false => Ok(()),
                };
                source
                    .and_then(|()| match retry_moved {
                        true => {
                            self.log
                                .commit(group, &pipeline.retry_topic, item.partition, item.retry_offset)
                        }
                        false => Ok(()),
                    })
                    .map_err(|e| e.to_string())
            };
            let label = if result.is_ok() { "ok" } else { "error" };
            metrics::counter!(crate::metrics::COMMITS, "result" => label).increment(1);
            if result.is_ok() {
                let mut s = self.lock();
                let task = &mut s.tasks[item.task];
                task.committed = task.committed.max(item.offset);
                if item.retry_offset >= task.retry.committed {
                    task.retry.committed = item.retry_offset;
                    task.retry.committed_done = item.retry_done.len();
                }
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
