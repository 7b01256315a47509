//! Commits: carrying out a commit round (freeze persistent stores, write the
//! positions — inline for `commit_mode = "sync"`, in order on the committer
//! thread for `async`), the final commit of a task that leaves or of the
//! whole app at shutdown, and what rides along with a round: retention of the
//! log and the gauges of `crate::metrics`.

use super::retry_queue::RetryPosition;
use super::scheduler::{CommitItem, FreezeResult};
use super::shared::{CommitReport, Shared};
use crate::health::StorageComponent;
use crate::log::Retention;
use crate::store::{Checkpoint, FreezeError};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, mpsc};

/// The async committer: a thread that writes handed-off commits in order.
#[derive(Default)]
pub(crate) struct Committer {
    sender: Mutex<Option<mpsc::Sender<Vec<CommitItem>>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Committer {
    /// Starts the committer thread (`commit_mode = "async"`).
    pub(crate) fn start(shared: &Arc<Shared>) -> std::io::Result<()> {
        let (sender, receiver) = mpsc::channel::<Vec<CommitItem>>();
        let weak = Arc::downgrade(shared);
        let handle = std::thread::Builder::new()
            .name(format!("{}-committer", shared.config.application_id))
            .spawn(move || {
                for items in receiver {
                    let Some(shared) = weak.upgrade() else { break };
                    write_all(&shared, &items);
                }
            })?;
        *lock(&shared.committer.sender) = Some(sender);
        *lock(&shared.committer.thread) = Some(handle);
        Ok(())
    }

    /// Hands commits to the committer; answers them back if there is none.
    fn hand_off(&self, items: Vec<CommitItem>) -> Option<Vec<CommitItem>> {
        match lock(&self.sender).as_ref() {
            Some(sender) => sender.send(items).err().map(|e| e.0),
            None => Some(items),
        }
    }

    /// Lets the committer write what it was handed, then stops it.
    pub(crate) fn stop(&self) {
        lock(&self.sender).take();
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn checkpoint(item: &CommitItem) -> Checkpoint {
    Checkpoint {
        watermark: item.offset,
        retry_offset: item.retry_offset,
        retry_done: item.retry_done.clone(),
        // Set when the commit is written, after its changelog records.
        changelog_offset: None,
    }
}

/// Freezes a persistent store's commit (what its checkpoint covers); `last`
/// for the final commit of a task that leaves or of the app. A previous
/// commit still pending (being written, or failed to be) is written first,
/// so one failure does not stop every later commit.
/// Err: the earlier commit still cannot be written (a storage fault).
///
/// A commit round decides its commits under the scheduler's lock and
/// freezes them after it, so its task may leave in between: once the task's
/// final commit has begun, the round's (older) commit is `Stale` and dropped.
/// Written after the final one, its checkpoint would send the task's next
/// incarnation back over records whose writes the store already holds.
fn freeze(shared: &Shared, item: &CommitItem, last: bool) -> Result<FreezeResult, String> {
    let Some(task_store) = item.store.as_ref() else {
        return Ok(FreezeResult::Frozen);
    };
    let Some(store) = task_store.persistent() else {
        return Ok(FreezeResult::Frozen);
    };
    let checkpoint = checkpoint(item);
    let begin = || {
        let begun = if last {
            store.begin_last_commit(&checkpoint)
        } else {
            store.begin_commit(&checkpoint)
        };
        match begun {
            Ok(true) => FreezeResult::Frozen,
            Ok(false) if !last && store.last_commit_begun() => FreezeResult::Stale,
            Ok(false) => FreezeResult::Busy,
            Err(FreezeError) => FreezeResult::OutOfOrder,
        }
    };
    match begin() {
        FreezeResult::Busy => {}
        result => return Ok(result),
    }
    task_store
        .finish_commit(shared.log.as_ref(), &|checkpoint| seal(shared, item, checkpoint))
        .map_err(|e| e.to_string())?;
    Ok(begin())
}

/// Appends the outputs released so far by the task of `item`: with the
/// log's flush after it, no commit covers a record whose outputs are not
/// durably in the sink topic (at-least-once).
fn drain_sink(shared: &Shared, item: &CommitItem) -> Result<(), String> {
    item.sink.as_deref().map_or(Ok(()), |sink| sink.drain(shared))
}

/// Carries out commits due now: freezes first (a task waiting idle for its
/// freeze resumes as soon as it is done), then writes them inline or hands
/// them to the committer.
pub(crate) fn run(shared: &Shared, items: Vec<CommitItem>) {
    if items.is_empty() {
        return;
    }
    // A task whose outputs cannot be appended (its transaction aborted, say)
    // fails its own commit only; the others go on. The flush is the log's,
    // so it fails them all.
    let mut ready_to_freeze = Vec::with_capacity(items.len());
    let mut unready: Vec<(CommitItem, String)> = Vec::new();
    for item in items {
        match drain_sink(shared, &item) {
            Ok(()) => ready_to_freeze.push(item),
            Err(error) => unready.push((item, error)),
        }
    }
    let mut items = ready_to_freeze;
    if let Err(error) = shared.flush_log() {
        unready.extend(items.drain(..).map(|item| (item, error.clone())));
    }
    if !unready.is_empty() {
        // Nothing frozen yet: a task waiting idle for its freeze resumes, and
        // its commit is tried again at the next round.
        let mut scheduler = shared.lock();
        for (item, _) in &unready {
            scheduler.frozen(item, FreezeResult::Busy);
        }
        shared.wake_waiters(&scheduler);
        drop(scheduler);
        for (item, error) in &unready {
            failed(shared, item, error, FailedAt::Drain);
        }
    }
    if items.is_empty() {
        return;
    }
    let mut ready = Vec::with_capacity(items.len());
    let mut results = Vec::with_capacity(items.len());
    let mut faults = Vec::new();
    for item in items {
        let result = match freeze(shared, &item, false) {
            Ok(result) => result,
            Err(error) => {
                faults.push((item.clone(), error));
                FreezeResult::Busy
            }
        };
        results.push((item.clone(), result));
        if result == FreezeResult::Frozen {
            ready.push(item);
        }
    }
    {
        let mut scheduler = shared.lock();
        for (item, result) in &results {
            scheduler.frozen(item, *result);
        }
        shared.wake_waiters(&scheduler);
    }
    for (item, error) in faults {
        failed(shared, &item, &error, FailedAt::Write);
    }
    if ready.is_empty() {
        return;
    }
    let ready = if shared.config.commit_mode == crate::config::CommitMode::Async {
        shared.committer.hand_off(ready)
    } else {
        Some(ready)
    };
    if let Some(items) = ready {
        write_all(shared, &items);
    }
}

/// Writes frozen commits in order, records them, and reports each.
fn write_all(shared: &Shared, items: &[CommitItem]) {
    for item in items {
        // A task that left (or is leaving) commits its last position itself;
        // a commit decided before must not overwrite it. Checked and written
        // under the commit lock the leaving task's last commit takes too. A
        // persistent store's was frozen before that last commit began (see
        // `freeze`), which then wrote it first: `write` finds nothing left.
        let _serial = shared.commit_lock.lock().unwrap_or_else(|e| e.into_inner());
        if item.store.is_none() && shared.lock().is_stale(item) {
            continue;
        }
        let _ = write_and_report(shared, item);
    }
}

/// Writes a frozen commit, records it, reports it (what was written: another
/// thread may have written this store's frozen commit already, then there is
/// nothing to report here).
fn write_and_report(shared: &Shared, item: &CommitItem) -> Result<(), String> {
    let started = std::time::Instant::now();
    let written = write(shared, item);
    metrics::histogram!(crate::metrics::COMMIT_DURATION).record(started.elapsed().as_secs_f64());
    match written {
        Ok(Some(written)) => {
            let healed = shared
                .lock()
                .commit_applied(&written, true, std::time::Instant::now());
            metrics::gauge!(crate::metrics::TASK_LAST_COMMIT, "task" => written.task_id.to_string())
                .set(super::now_ms() as f64 / 1_000.0);
            if healed && written.store.is_some() {
                shared.health.recovered(StorageComponent::Store, &written.task_id);
            }
            report(shared, &written, Ok(()));
            Ok(())
        }
        Ok(None) => {
            // Written by another thread, which reports it; this task goes on.
            shared.lock().commit_done_elsewhere(item);
            Ok(())
        }
        Err(e) => {
            failed(shared, item, &e, FailedAt::Write);
            Err(e)
        }
    }
}

/// When a commit failed: before its task was frozen for it (`Drain`: nothing
/// of it was written), or after (`Write`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum FailedAt {
    Drain,
    Write,
}

/// A commit that could not be written: reported, backed off, and (for a
/// store) a storage fault until a later commit of the task succeeds.
///
/// Under exactly-once a failure after the freeze corrupts the task: its
/// transaction holds that commit's changelog records, and outputs of the
/// records the task would go on to process would join them, so a later
/// commit of that transaction at the frozen positions would carry outputs
/// of records above them, which run again after any later abort. The
/// transaction is aborted and the task revived from its last commit instead.
fn failed(shared: &Shared, item: &CommitItem, error: &str, at: FailedAt) {
    // An append of the task's transaction failed (on its way to this commit
    // or before): the transaction cannot commit, whatever failed here.
    let doomed = shared
        .log
        .as_kafka()
        .filter(|_| shared.exactly_once())
        .and_then(|kafka| kafka.transaction_doomed(&shared.transactional_id(&item.task_id)));
    let corrupt = doomed.or((shared.exactly_once() && at == FailedAt::Write).then_some(false));
    let corrupted = {
        let mut scheduler = shared.lock();
        scheduler.commit_applied(item, false, std::time::Instant::now());
        if let Some(fenced) = corrupt
            && scheduler.corrupt(item, fenced)
        {
            shared.watchdog.wake();
        }
        scheduler.is_corrupted(item)
    };
    // An aborted transaction is no storage fault: the task starts again.
    if item.store.is_some() && !corrupted {
        shared
            .health
            .failed(StorageComponent::Store, &item.task_id, &error);
    }
    report(shared, item, Err(error.to_string()));
}

fn report(shared: &Shared, item: &CommitItem, result: Result<(), String>) {
    let label = if result.is_ok() { "ok" } else { "error" };
    metrics::counter!(crate::metrics::COMMITS, "result" => label).increment(1);
    if let Err(e) = &result {
        tracing::error!(task = %item.task_id, offset = item.offset, error = %e, "commit failed");
    }
    if let Some(callback) = &shared.on_commit {
        callback(&CommitReport {
            task_id: item.task_id.to_string(),
            offset: item.offset,
            result,
        });
    }
}

/// Writes one frozen commit: the store's data with its checkpoint (persistent),
/// or the positions to the log's committed offsets (memory). Answers what
/// was written, None if another thread wrote the store's frozen commit.
fn write(shared: &Shared, item: &CommitItem) -> Result<Option<CommitItem>, String> {
    if let Some(store) = &item.store {
        if store.persistent().is_none() {
            return Err("the store is not persistent".to_string());
        }
        return match store.finish_commit(shared.log.as_ref(), &|checkpoint| seal(shared, item, checkpoint)) {
            Ok(Some(checkpoint)) => {
                let written = CommitItem {
                    offset: checkpoint.watermark,
                    retry_offset: checkpoint.retry_offset,
                    retry_done: checkpoint.retry_done,
                    ..item.clone()
                };
                // On Kafka another instance may resume the task: the group's
                // offsets follow the checkpoint (written after it, so they
                // are never ahead of a store's own checkpoint). Under
                // exactly-once they went with the transaction, before it.
                if shared.log.as_kafka().is_some() && !shared.exactly_once() {
                    commit_positions(shared, &written)?;
                }
                Ok(Some(written))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(e.to_string()),
        };
    }
    // What a memory store wrote reaches its changelog before the positions
    // that cover it (on Kafka; elsewhere there is none).
    if let Some(store) = &item.memory {
        let positions = checkpoint(item);
        store
            .send_written(shared.log.as_ref(), &|| seal(shared, item, &positions))
            .map_err(|e| e.to_string())?;
        if shared.exactly_once() {
            return Ok(Some(item.clone()));
        }
    }
    commit_positions(shared, item)?;
    Ok(Some(item.clone()))
}

/// Between a commit's changelog records and its checkpoint: under
/// exactly_once_v2 the task's transaction commits there, with the
/// checkpoint's positions as the group's offsets (so a checkpoint is never
/// written for a transaction that did not commit); else nothing.
fn seal(shared: &Shared, item: &CommitItem, checkpoint: &Checkpoint) -> Result<(), String> {
    if !shared.exactly_once() {
        return Ok(());
    }
    let Some(kafka) = shared.log.as_kafka() else {
        return Err("exactly_once_v2 needs Kafka".to_string());
    };
    let pipeline = &shared.pipelines[item.pipeline];
    let retry_done = retry_done_metadata(item, checkpoint.retry_offset, &checkpoint.retry_done);
    let committed = kafka.commit_transaction(
        &shared.transactional_id(&item.task_id),
        &[
            (&pipeline.topic, item.partition, checkpoint.watermark, ""),
            (
                &pipeline.retry_topic,
                item.partition,
                checkpoint.retry_offset,
                &retry_done,
            ),
        ],
    );
    if let Err(crate::log::LogError::TransactionAborted { fenced, .. }) = &committed {
        // What the transaction held is gone: the task must not go on from
        // its state, nor commit it; it is closed and revived from its last
        // commit (see `revival`).
        if shared.lock().corrupt(item, *fenced) {
            shared.watchdog.wake();
        }
    }
    committed.map_err(|e| e.to_string())
}

/// The final retry entries above `position`, as the metadata of its offset
/// commit on Kafka (see `retry_done`); warns about any left off, at most once
/// a minute (a commit may come every few milliseconds).
fn retry_done_metadata(item: &CommitItem, position: u64, done: &[u64]) -> String {
    static LAST_WARNING_MS: AtomicI64 = AtomicI64::new(i64::MIN);
    let (metadata, left_off) = super::retry_done::encode(position, done);
    if left_off > 0 {
        let now = super::now_ms();
        let last = LAST_WARNING_MS.load(Ordering::Relaxed);
        let due = now.saturating_sub(last) >= 60_000
            && LAST_WARNING_MS
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
        if due {
            tracing::warn!(
                task = %item.task_id, position, left_off,
                "final retry entries too far past the retry position for the offset commit's metadata: \
                 an instance that takes the partition over runs them again"
            );
        }
    }
    metadata
}

/// Writes a task's positions (source and retry) to the log's committed
/// offsets of the application's group, those that moved.
fn commit_positions(shared: &Shared, item: &CommitItem) -> Result<(), String> {
    let pipeline = &shared.pipelines[item.pipeline];
    let group = &shared.config.application_id;
    // Each commit may cost an fsync: write only the positions that moved.
    if item.offset != item.committed_offset {
        shared
            .log
            .commit(group, &pipeline.topic, item.partition, item.offset)
            .map_err(|e| e.to_string())?;
    }
    if item.retry_offset != item.committed_retry_offset || item.retry_done.len() != item.committed_retry_done
    {
        match shared.log.as_kafka() {
            // Whichever instance resumes the task reads the final entries
            // above the position from here (the local checkpoint is this
            // instance's alone).
            Some(kafka) => kafka.commit_with_metadata(
                group,
                &pipeline.retry_topic,
                item.partition,
                item.retry_offset,
                &retry_done_metadata(item, item.retry_offset, &item.retry_done),
            ),
            None => shared
                .log
                .commit(group, &pipeline.retry_topic, item.partition, item.retry_offset),
        }
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The last commit of a task that leaves, or of every task at shutdown,
/// written inline: freezes what is covered (no thread works for the task,
/// so an untagged store's whole state is) and writes it. Reports to the
/// callback; answers the error, if any.
pub(crate) fn final_commit(shared: &Shared, item: &CommitItem) -> Result<(), String> {
    let _serial = shared.commit_lock.lock().unwrap_or_else(|e| e.into_inner());
    if let Err(error) = drain_sink(shared, item).and_then(|()| shared.flush_log()) {
        failed(shared, item, &error, FailedAt::Drain);
        return Err(error);
    }
    let error = match freeze(shared, item, true) {
        Ok(FreezeResult::Frozen) => return write_and_report(shared, item),
        Ok(FreezeResult::Busy) => "the store's previous commit could not be written".to_string(),
        Ok(FreezeResult::OutOfOrder) => FreezeError.to_string(),
        // Only a commit that is not the last one is stale.
        Ok(FreezeResult::Stale) => "the store's last commit was taken already".to_string(),
        Err(error) => error,
    };
    failed(shared, item, &error, FailedAt::Write);
    Err(error)
}

/// Which records each topic partition must keep, and enforcement: a
/// configured topic keeps what its slowest pipeline has not committed; a
/// retry topic keeps only what is not final and committed.
pub(crate) fn enforce_retention(shared: &Shared) {
    let plan: Vec<(Arc<str>, u32, Retention, u64)> = {
        let scheduler = shared.lock();
        let mut plan = Vec::new();
        for topic in &shared.config.topics {
            let retention = Retention {
                max_bytes: topic.log_retention_bytes,
                max_age_ms: topic.log_retention_ms,
            };
            if retention.is_unlimited() {
                continue;
            }
            for partition in 0..shared.log.partitions(&topic.name).unwrap_or(0) {
                let keep_from = scheduler
                    .tasks()
                    .filter(|(_, t)| {
                        t.partition() == partition && *shared.pipelines[t.pipeline()].topic == *topic.name
                    })
                    .map(|(_, t)| t.committed())
                    .min()
                    // No task here reads it: nothing is known to be safe to drop.
                    .unwrap_or(0);
                plan.push((Arc::from(topic.name.as_str()), partition, retention, keep_from));
            }
        }
        for (_, task) in scheduler.tasks() {
            let everything = Retention {
                max_bytes: Some(0),
                max_age_ms: None,
            };
            let topic = shared.pipelines[task.pipeline()].retry_topic.clone();
            plan.push((topic, task.partition(), everything, task.retry().committed()));
        }
        plan
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    for (topic, partition, retention, keep_from) in plan {
        let start = shared.log.start_offset(&topic, partition).unwrap_or(0);
        if keep_from <= start {
            continue;
        }
        if let Err(e) = shared
            .log
            .enforce_retention(&topic, partition, retention, keep_from, now)
        {
            tracing::warn!(topic = %topic, partition, error = %e, "retention failed");
        }
    }
}

/// Sets the gauges of `crate::metrics` from the scheduler's state and the log.
pub(crate) fn publish_gauges(shared: &Shared) {
    use crate::metadata::ThreadState;
    use crate::metrics::{
        DEAD_LETTERED, LAG, RESTORE_REMAINING, RETRY_BACKLOG, TASK_ACTIVE_THREADS, TASK_HELD, TASK_IN_FLIGHT,
        THREADS,
    };
    /// A task's figures, copied under the scheduler's lock: the gauges are set
    /// after it (a recorder's registry has a lock of its own, and a handler
    /// reading metadata waits for this one).
    struct Figures {
        task: Arc<str>,
        pipeline: usize,
        partition: u32,
        active: usize,
        in_flight: usize,
        held: usize,
        restore_remaining: u64,
        watermark: u64,
        retry: RetryPosition,
    }
    let (tasks, by_state) = {
        let scheduler = shared.lock();
        let tasks: Vec<Figures> = scheduler
            .tasks()
            .map(|(_, t)| Figures {
                task: t.id().clone(),
                pipeline: t.pipeline(),
                partition: t.partition(),
                active: t.active(),
                in_flight: t.in_flight(),
                held: t.held_completed(),
                restore_remaining: t.restore_remaining(),
                watermark: t.watermark(),
                retry: t.retry().position(),
            })
            .collect();
        let mut by_state = [0u32; 5];
        for (i, thread) in scheduler.threads().iter().enumerate() {
            if !thread.is_alive() {
                continue;
            }
            by_state[match scheduler.thread_state(i) {
                ThreadState::Owner => 0,
                ThreadState::Helper => 1,
                ThreadState::Reserve => 2,
                ThreadState::Retry => 3,
                ThreadState::Stopping => 4,
            }] += 1;
        }
        (tasks, by_state)
    };
    for t in &tasks {
        let task = t.task.to_string();
        metrics::gauge!(TASK_ACTIVE_THREADS, "task" => task.clone()).set(t.active as f64);
        metrics::gauge!(TASK_IN_FLIGHT, "task" => task.clone()).set(t.in_flight as f64);
        metrics::gauge!(TASK_HELD, "task" => task.clone()).set(t.held as f64);
        metrics::gauge!(RESTORE_REMAINING, "task" => task).set(t.restore_remaining as f64);
    }
    for (p, pipeline) in shared.pipelines.iter().enumerate() {
        let mut backlog = 0;
        let mut lag = 0;
        for t in tasks.iter().filter(|t| t.pipeline == p) {
            let end = shared.log.end_offset(&pipeline.topic, t.partition).unwrap_or(0);
            lag += end.saturating_sub(t.watermark);
            backlog += super::describe::retry_backlog_of(shared, p, t.partition, t.retry);
        }
        let dead: u64 = (0..pipeline.partitions)
            .map(|partition| dead_lettered(shared, &pipeline.dead_letter_topic, partition))
            .sum();
        let name = pipeline.name.to_string();
        metrics::gauge!(RETRY_BACKLOG, "pipeline" => name.clone()).set(backlog as f64);
        metrics::gauge!(LAG, "pipeline" => name.clone()).set(lag as f64);
        metrics::gauge!(DEAD_LETTERED, "pipeline" => name).set(dead as f64);
    }
    for (state, count) in ["owner", "helper", "reserve", "retry", "stopping"]
        .into_iter()
        .zip(by_state)
    {
        metrics::gauge!(THREADS, "state" => state).set(f64::from(count));
    }
}

/// Records retained in a dead-letter partition.
pub(crate) fn dead_lettered(shared: &Shared, topic: &str, partition: u32) -> u64 {
    let end = shared.log.end_offset(topic, partition).unwrap_or(0);
    end - shared.log.start_offset(topic, partition).unwrap_or(0).min(end)
}

#[cfg(test)]
mod tests;
