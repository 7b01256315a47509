//! The stream-task runtime: N stream threads, tasks (pipeline × partition)
//! assigned sticky to owner threads, up to T threads per task, the sequencer
//! and watermark, commits, and `StreamsApp`, the in-process API.
//! Scheduling state sits behind one mutex taken per unit of work (a batch of
//! records), never per record; processors run outside it.

mod error;
pub mod retry;
mod sequencer;
mod stores;
mod task;
mod threads;

pub use error::RuntimeError;

use crate::config::{CommitMode, Config, ProcessingOrder, RetryPolicy, StoreKind};
use crate::log::{Log, MemoryLog, ProducerRecord, RecordPosition, Retention, partition_for_key};
use crate::metadata::*;
use crate::processor::{self, Processor};
use bytes::Bytes;
use retry::RetryBacklog;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak, mpsc};
use std::time::{Duration, Instant};
use stores::{Restore, TaskStore};
use task::Task;
use threads::ThreadSlot;
use tokio::sync::broadcast;

/// The result of one commit of one task, reported to the commit callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitReport {
    pub task_id: String,
    /// The committed watermark: the next offset a restart resumes from.
    pub offset: u64,
    pub result: Result<(), String>,
}

type CommitCallback = Arc<dyn Fn(&CommitReport) + Send + Sync>;

/// One commit to write.
#[derive(Debug, Clone)]
pub(crate) struct CommitItem {
    task: usize,
    task_id: Arc<str>,
    pipeline: usize,
    partition: u32,
    offset: u64,
    /// The retry-topic watermark committed with it.
    retry_offset: u64,
    /// Final retry offsets above `retry_offset` (persistent stores only).
    retry_done: Vec<u64>,
    /// Committed with the store's data (persistent) or to the log (memory).
    persistent: bool,
}

/// How often retention is enforced (at a commit round).
const RETENTION_INTERVAL: Duration = Duration::from_secs(1);

/// A pipeline as it runs: immutable after start.
pub(crate) struct PipelineRuntime {
    name: Arc<str>,
    topic: Arc<str>,
    partitions: u32,
    order: ProcessingOrder,
    threads_per_task: usize,
    processor: Arc<dyn Processor>,
    processor_name: String,
    store_kind: StoreKind,
    retry_policy: RetryPolicy,
    retry_topic: Arc<str>,
    dead_letter_topic: Arc<str>,
    stores: Vec<TaskStore>,
    /// Index of partition 0's task in `Sched::tasks`.
    first_task: usize,
}

/// Everything the scheduler changes, behind one mutex.
pub(crate) struct Sched {
    tasks: Vec<Task>,
    threads: Vec<ThreadSlot>,
    /// Per pipeline; `None` once shut down, which ends every subscription.
    senders: Vec<Option<broadcast::Sender<Arc<OutcomeBatch>>>>,
    next_commit_at: Instant,
    next_retention_at: Instant,
    committing: bool,
    /// Threads waiting for work (so wake-ups are skipped when nobody waits).
    idle: usize,
    stopping: bool,
    threads_started: usize,
}

impl Sched {
    /// Adds a slot for a new thread, named as Kafka Streams names them.
    fn new_thread_slot(&mut self, application_id: &str) -> usize {
        self.threads_started += 1;
        let name = format!("{application_id}-StreamThread-{}", self.threads_started);
        self.threads.push(ThreadSlot::new(name.into()));
        self.threads.len() - 1
    }

    fn live_threads(&self) -> Vec<usize> {
        (0..self.threads.len())
            .filter(|&i| self.threads[i].is_live())
            .collect()
    }

    fn owned_count(&self, thread: usize) -> usize {
        self.tasks.iter().filter(|t| t.owner == thread).count()
    }

    /// Moves tasks owned by `from` to the least-loaded live threads.
    fn reassign_tasks_of(&mut self, from: usize) {
        let live = self.live_threads();
        for t in 0..self.tasks.len() {
            if self.tasks[t].owner != from {
                continue;
            }
            if let Some(&target) = live
                .iter()
                .filter(|&&i| i != from)
                .min_by_key(|&&i| self.owned_count(i))
            {
                self.tasks[t].owner = target;
            }
        }
    }

    /// Gives a new thread its share, taken from the most-loaded threads (sticky: nothing else moves).
    fn rebalance_onto(&mut self, new_thread: usize) {
        let live = self.live_threads();
        let target = self.tasks.len() / live.len().max(1);
        while self.owned_count(new_thread) < target {
            let Some(&donor) = live
                .iter()
                .filter(|&&i| i != new_thread)
                .max_by_key(|&&i| self.owned_count(i))
            else {
                break;
            };
            if self.owned_count(donor) <= target {
                break;
            }
            let Some(task) = self.tasks.iter().rposition(|t| t.owner == donor) else {
                break;
            };
            self.tasks[task].owner = new_thread;
        }
    }

    /// Commits of memory-store tasks whose watermarks moved (persistent ones
    /// commit at a quiescent moment instead). Restoring tasks have nothing new.
    fn commit_items(&self) -> Vec<CommitItem> {
        self.tasks
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.persistent && t.restore.is_none() && t.has_uncommitted())
            .map(|(i, t)| CommitItem {
                task: i,
                task_id: t.id.clone(),
                pipeline: t.pipeline,
                partition: t.partition,
                offset: t.seq.watermark(),
                retry_offset: t.retry.seq.watermark(),
                // A memory store is rebuilt without them and they run again: once in all.
                retry_done: Vec::new(),
                persistent: false,
            })
            .collect()
    }
}

pub(crate) struct Shared {
    config: Config,
    log: Arc<dyn Log>,
    host_info: HostInfo,
    pipelines: Vec<PipelineRuntime>,
    sched: Mutex<Sched>,
    wake: Condvar,
    state: AtomicU8,
    on_commit: Option<CommitCallback>,
    async_commits: Mutex<Option<mpsc::Sender<Vec<CommitItem>>>>,
    committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    shutdown_lock: Mutex<()>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Sched> {
        self.sched.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn app_state(&self) -> AppState {
        match self.state.load(Ordering::Acquire) {
            0 => AppState::Starting,
            1 => AppState::Running,
            2 => AppState::ShuttingDown,
            _ => AppState::Stopped,
        }
    }

    fn set_state(&self, state: AppState) {
        let value = match state {
            AppState::Starting => 0,
            AppState::Running => 1,
            AppState::ShuttingDown => 2,
            AppState::Stopped => 3,
        };
        self.state.store(value, Ordering::Release);
    }

    /// Fails unless the app is running: callers get UNAVAILABLE with a retry hint.
    fn ensure_running(&self) -> Result<(), RuntimeError> {
        match self.app_state() {
            AppState::Running => Ok(()),
            AppState::Starting => Err(RuntimeError::Unavailable {
                reason: "the instance is starting (restoring its state stores)".to_string(),
                retry_after: Duration::from_millis(200),
            }),
            AppState::ShuttingDown | AppState::Stopped => Err(RuntimeError::shutting_down()),
        }
    }

    /// A task's live watermark, and where it started (the position of a
    /// store that has never committed).
    fn positions(&self, task: usize) -> (u64, u64) {
        let s = self.lock();
        let task = &s.tasks[task];
        (task.seq.watermark(), task.history_start)
    }

    fn pipeline_index(&self, store: &str) -> Result<usize, RuntimeError> {
        if store.is_empty() {
            return Err(RuntimeError::invalid_argument("store", "must not be empty"));
        }
        self.pipelines
            .iter()
            .position(|p| &*p.name == store)
            .ok_or_else(|| RuntimeError::UnknownStore(store.to_string()))
    }

    fn task_metadata(&self, s: &Sched, t: usize) -> TaskMetadata {
        let task = &s.tasks[t];
        let pipeline = &self.pipelines[task.pipeline];
        let end_offset = self.log.end_offset(&pipeline.topic, task.partition).unwrap_or(0);
        let watermark = task.seq.watermark();
        TaskMetadata {
            task_id: task.id.to_string(),
            pipeline: pipeline.name.to_string(),
            topic: pipeline.topic.to_string(),
            partition: task.partition,
            state: if task.restore.is_some() {
                TaskState::Restoring
            } else {
                TaskState::Running
            },
            owner_thread: s.threads[task.owner].name.to_string(),
            helper_threads: s
                .threads
                .iter()
                .enumerate()
                .filter(|(i, th)| th.current == Some(t) && *i != task.owner)
                .map(|(_, th)| th.name.to_string())
                .collect(),
            processing_order: task.order,
            threads_per_task: task.threads_per_task as u32,
            watermark,
            committed_offset: task.committed,
            end_offset,
            lag: end_offset.saturating_sub(watermark),
            in_flight: task.seq.in_flight() as u64,
            retry_backlog: self.retry_backlog(task),
            records_processed: task.records_processed,
            records_failed: task.records_failed,
            records_dead_lettered: task.records_dead_lettered,
        }
    }

    /// Records of a task's retry-topic partition without a final outcome.
    fn retry_backlog(&self, task: &Task) -> u64 {
        let pipeline = &self.pipelines[task.pipeline];
        let end = self
            .log
            .end_offset(&pipeline.retry_topic, task.partition)
            .unwrap_or(0);
        task.retry.backlog(end)
    }

    /// Sets the gauges of `crate::metrics` from the scheduler's state.
    fn publish_gauges(&self, s: &Sched) {
        use crate::metrics::{DEAD_LETTERED, LAG, RETRY_BACKLOG, THREADS};
        for pipeline in &self.pipelines {
            let tasks = &s.tasks[pipeline.first_task..pipeline.first_task + pipeline.partitions as usize];
            let backlog: u64 = tasks.iter().map(|t| self.retry_backlog(t)).sum();
            let lag: u64 = tasks
                .iter()
                .map(|t| {
                    let end = self.log.end_offset(&pipeline.topic, t.partition).unwrap_or(0);
                    end.saturating_sub(t.seq.watermark())
                })
                .sum();
            let dead: u64 = (0..pipeline.partitions)
                .map(|p| {
                    let end = self.log.end_offset(&pipeline.dead_letter_topic, p).unwrap_or(0);
                    end - self
                        .log
                        .start_offset(&pipeline.dead_letter_topic, p)
                        .unwrap_or(0)
                        .min(end)
                })
                .sum();
            let name = pipeline.name.to_string();
            metrics::gauge!(RETRY_BACKLOG, "pipeline" => name.clone()).set(backlog as f64);
            metrics::gauge!(LAG, "pipeline" => name.clone()).set(lag as f64);
            metrics::gauge!(DEAD_LETTERED, "pipeline" => name).set(dead as f64);
        }
        let mut by_state = [0u32; 5];
        for (i, thread) in s.threads.iter().enumerate().filter(|(_, t)| t.alive) {
            by_state[match (thread.stopping, thread.on_retry, thread.current) {
                (true, _, _) => 4,
                (false, true, _) => 3,
                (false, false, Some(task)) if s.tasks[task].owner == i => 0,
                (false, false, Some(_)) => 1,
                (false, false, None) => 2,
            }] += 1;
        }
        for (state, count) in ["owner", "helper", "reserve", "retry", "stopping"]
            .into_iter()
            .zip(by_state)
        {
            metrics::gauge!(THREADS, "state" => state).set(f64::from(count));
        }
    }

    /// Which records each topic partition must keep, for `enforce_retention`:
    /// a configured topic keeps what its slowest pipeline has not committed; a
    /// retry topic keeps only what is not final and committed.
    fn retention_plan(&self, s: &Sched) -> Vec<(Arc<str>, u32, Retention, u64)> {
        let mut plan = Vec::new();
        for topic in &self.config.topics {
            let retention = Retention {
                max_bytes: topic.log_retention_bytes,
                max_age_ms: topic.log_retention_ms,
            };
            if retention.is_unlimited() {
                continue;
            }
            for partition in 0..self.log.partitions(&topic.name).unwrap_or(0) {
                let keep_from = s
                    .tasks
                    .iter()
                    .filter(|t| t.partition == partition && *self.pipelines[t.pipeline].topic == *topic.name)
                    .map(|t| t.committed)
                    .min()
                    .unwrap_or(u64::MAX);
                plan.push((Arc::from(topic.name.as_str()), partition, retention, keep_from));
            }
        }
        for task in &s.tasks {
            let everything = Retention {
                max_bytes: Some(0),
                max_age_ms: None,
            };
            let topic = self.pipelines[task.pipeline].retry_topic.clone();
            plan.push((topic, task.partition, everything, task.retry.committed));
        }
        plan
    }

    fn enforce_retention(&self, plan: Vec<(Arc<str>, u32, Retention, u64)>) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        for (topic, partition, retention, keep_from) in plan {
            let start = self.log.start_offset(&topic, partition).unwrap_or(0);
            if keep_from <= start {
                continue;
            }
            if let Err(e) = self
                .log
                .enforce_retention(&topic, partition, retention, keep_from, now)
            {
                tracing::warn!(topic = %topic, partition, error = %e, "retention failed");
            }
        }
    }

    fn streams_metadata(&self, s: &Sched, tasks: impl Iterator<Item = usize>) -> StreamsMetadata {
        let mut topic_partitions: Vec<TopicPartition> = Vec::new();
        for pipeline in &self.pipelines {
            for partition in 0..pipeline.partitions {
                let tp = TopicPartition {
                    topic: pipeline.topic.to_string(),
                    partition,
                };
                if !topic_partitions.contains(&tp) {
                    topic_partitions.push(tp);
                }
            }
        }
        topic_partitions.sort();
        StreamsMetadata {
            host_info: self.host_info.clone(),
            state_store_names: self.pipelines.iter().map(|p| p.name.to_string()).collect(),
            topic_partitions,
            standby_topic_partitions: Vec::new(),
            tasks: tasks.map(|t| self.task_metadata(s, t)).collect(),
        }
    }

    /// Registers interest in appends to the pipelines' source partitions.
    fn on_append(&self, topic: &str, partition: u32) {
        let mut s = self.lock();
        let mut any = false;
        for pipeline in &self.pipelines {
            if partition >= pipeline.partitions {
                continue;
            }
            let task = &mut s.tasks[pipeline.first_task + partition as usize];
            if *pipeline.topic == *topic {
                task.append_gen += 1;
                any = true;
            } else if *pipeline.retry_topic == *topic {
                task.retry.append_gen += 1;
                any = true;
            }
        }
        if any && s.idle > 0 {
            self.wake.notify_all();
        }
    }

    /// Drains, commits and stops. Idempotent; blocks until threads are joined.
    fn shutdown(&self) {
        let _once = self.shutdown_lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.app_state() == AppState::Stopped {
            return;
        }
        self.set_state(AppState::ShuttingDown);
        // Threads finish the unit in hand and leave; a thread that dies now is not replaced.
        loop {
            let handles: Vec<_> = {
                let mut s = self.lock();
                s.stopping = true;
                s.threads.iter_mut().filter_map(|t| t.handle.take()).collect()
            };
            self.wake.notify_all();
            if handles.is_empty() {
                break;
            }
            for handle in handles {
                let _ = handle.join();
            }
        }
        // Commits handed to the committer go first, so commits stay in order.
        self.async_commits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(committer) = self.committer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = committer.join();
        }
        let items = {
            let mut s = self.lock();
            let mut items = s.commit_items();
            for t in 0..s.tasks.len() {
                if s.tasks[t].persistent && s.tasks[t].restore.is_none() && s.tasks[t].has_uncommitted() {
                    // Every thread is gone: each task is quiescent.
                    s.tasks[t].commit_pending = true;
                    items.extend(self.freeze_if_quiescent(&mut s, t));
                }
            }
            items
        };
        self.apply_commits(&items);
        for sender in self.lock().senders.iter_mut() {
            sender.take();
        }
        self.set_state(AppState::Stopped);
    }
}

/// Builds a `StreamsApp`: config plus what code provides (log, custom
/// processors, commit callback).
pub struct AppBuilder {
    config: Config,
    log: Option<Arc<dyn Log>>,
    processors: HashMap<String, Arc<dyn Processor>>,
    on_commit: Option<CommitCallback>,
}

impl AppBuilder {
    pub fn new(config: Config) -> Self {
        AppBuilder {
            config,
            log: None,
            processors: HashMap::new(),
            on_commit: None,
        }
    }

    /// The log to consume and produce (default: a new embedded `MemoryLog`).
    pub fn log(mut self, log: Arc<dyn Log>) -> Self {
        self.log = Some(log);
        self
    }

    /// Registers a processor that pipelines name with `processor = "<name>"`.
    pub fn processor(mut self, name: &str, processor: Arc<dyn Processor>) -> Self {
        self.processors.insert(name.to_string(), processor);
        self
    }

    /// Called after every commit of a task with its result (in order).
    pub fn on_commit(mut self, callback: impl Fn(&CommitReport) + Send + Sync + 'static) -> Self {
        self.on_commit = Some(Arc::new(callback));
        self
    }

    /// Validates the config, creates topics and tasks, and starts the threads.
    pub fn start(self) -> Result<StreamsApp, RuntimeError> {
        let config = self.config;
        config.validate()?;
        let (host, port) = crate::config::parse_host_port(&config.application_server)
            .map_err(|m| crate::config::ConfigError::new("application_server", m))?;
        let log: Arc<dyn Log> = match (self.log, &config.data_dir) {
            (Some(log), _) => log,
            (None, Some(_)) => crate::datadir::open(&config)?,
            (None, None) => MemoryLog::new(),
        };
        for (topic, partitions) in config.topic_partitions()? {
            log.ensure_topic(&topic, partitions).map_err(|e| match e {
                crate::log::LogError::PartitionCountMismatch { .. } => crate::config::ConfigError::new(
                    "topics",
                    format!("{e}; the log already holds this topic"),
                )
                .into(),
                other => RuntimeError::from(other),
            })?;
        }

        let mut pipelines = Vec::new();
        let mut tasks = Vec::new();
        let n = config.num_stream_threads;
        let group = config.application_id.as_str();
        for (index, pipeline) in config.pipelines.iter().enumerate() {
            // A processor registered in code wins over a built-in of the same name.
            let registered = self.processors.get(pipeline.processor.name()).cloned();
            let processor = match registered.or_else(|| processor::builtin(&pipeline.processor)) {
                Some(p) => p,
                None => {
                    return Err(crate::config::ConfigError::new(
                        format!("pipelines[{index}].processor"),
                        format!(
                            "`{}` is neither a built-in (count, sum, latest, simulate) nor registered with \
                             AppBuilder::processor",
                            pipeline.processor.name()
                        ),
                    )
                    .into());
                }
            };
            let partitions = log.partitions(&pipeline.source_topic)?;
            let retry_topic = config.retry_topic(&pipeline.name);
            let dead_letter_topic = config.dead_letter_topic(&pipeline.name);
            for internal in [&retry_topic, &dead_letter_topic] {
                log.ensure_topic(internal, partitions)?;
            }
            let effective = config.effective_order(pipeline);
            let store_kind = config.store_kind(pipeline);
            let first_task = tasks.len();
            let mut stores = Vec::new();
            for partition in 0..partitions {
                let id: Arc<str> = format!("{}_{}", pipeline.name, partition).into();
                let store = match (store_kind, &config.data_dir) {
                    (StoreKind::Persistent, Some(dir)) => TaskStore::open_persistent(dir, group, &id)
                        .map_err(|e| RuntimeError::Storage {
                            path: e.path,
                            message: e.message,
                        })?,
                    _ => TaskStore::memory(),
                };
                let earliest = log.start_offset(&pipeline.source_topic, partition)?;
                let retry_earliest = log.start_offset(&retry_topic, partition)?;
                let retry_end = log.end_offset(&retry_topic, partition)?;
                // Where to resume: a persistent store's own checkpoint (committed
                // with its data); else the log's committed offsets.
                let (committed, retry_committed, retry_done) = match store.persistent() {
                    Some(_) => match store.checkpoint() {
                        Some(c) => (Some(c.watermark), Some(c.retry_offset), c.retry_done),
                        None => (None, None, Vec::new()),
                    },
                    None => (
                        log.committed(group, &pipeline.source_topic, partition)?,
                        log.committed(group, &retry_topic, partition)?,
                        Vec::new(),
                    ),
                };
                let start = committed.unwrap_or(earliest).max(earliest);
                let retry_start = retry_committed.unwrap_or(retry_earliest).max(retry_earliest);
                let keyed = effective.order == ProcessingOrder::Key;
                let backlog = RetryBacklog::scan(
                    log.as_ref(),
                    &retry_topic,
                    partition,
                    retry_start..retry_end,
                    retry_done,
                    start,
                )?;
                let mut task = Task::new(
                    id,
                    index,
                    partition,
                    effective.order,
                    effective.threads_per_task,
                    (first_task + partition as usize) % n,
                    start,
                    committed.unwrap_or(0),
                    config.max_batch_records,
                    config.max_in_flight_records,
                    config.outcome_retention_records,
                    retry::RetryQueue::new(
                        retry_start,
                        keyed,
                        config.max_in_flight_records,
                        backlog.final_offsets,
                    ),
                );
                task.persistent = store.persistent().is_some();
                task.retry.committed = retry_committed.unwrap_or(retry_start);
                if keyed {
                    for key in &backlog.pending_keys {
                        task.parked.add(key, false);
                    }
                }
                let pending_sources = backlog.pending_sources;
                // A memory store is rebuilt from what the log retains, up to the
                // committed watermark, before the task runs.
                if !task.persistent && start > earliest {
                    task.restore = Some(Restore {
                        next: earliest,
                        until: start,
                        skip: pending_sources,
                        busy: false,
                    });
                }
                tasks.push(task);
                stores.push(store);
            }
            pipelines.push(PipelineRuntime {
                name: pipeline.name.as_str().into(),
                topic: pipeline.source_topic.as_str().into(),
                partitions,
                order: effective.order,
                threads_per_task: effective.threads_per_task,
                processor,
                processor_name: pipeline.processor.name().to_string(),
                store_kind,
                retry_policy: config.retry_policy(pipeline),
                retry_topic: retry_topic.into(),
                dead_letter_topic: dead_letter_topic.into(),
                stores,
                first_task,
            });
        }
        let restoring = tasks.iter().any(|t| t.restore.is_some());

        let senders = pipelines
            .iter()
            .map(|_| Some(broadcast::channel(config.subscriber_buffer_batches).0))
            .collect();
        let shared = Arc::new(Shared {
            host_info: HostInfo { host, port },
            log: log.clone(),
            pipelines,
            sched: Mutex::new(Sched {
                tasks,
                threads: Vec::new(),
                senders,
                next_commit_at: Instant::now() + Duration::from_millis(config.commit_interval_ms),
                next_retention_at: Instant::now() + RETENTION_INTERVAL,
                committing: false,
                idle: 0,
                stopping: false,
                threads_started: 0,
            }),
            wake: Condvar::new(),
            state: AtomicU8::new(0),
            on_commit: self.on_commit,
            async_commits: Mutex::new(None),
            committer: Mutex::new(None),
            shutdown_lock: Mutex::new(()),
            config,
        });

        if shared.config.commit_mode == CommitMode::Async {
            let (sender, receiver) = mpsc::channel::<Vec<CommitItem>>();
            let weak = Arc::downgrade(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("{}-committer", shared.config.application_id))
                .spawn(move || {
                    for items in receiver {
                        let Some(shared) = weak.upgrade() else { break };
                        shared.apply_commits(&items);
                    }
                })
                .map_err(|e| RuntimeError::Internal(format!("could not start the committer: {e}")))?;
            *shared.async_commits.lock().unwrap_or_else(|e| e.into_inner()) = Some(sender);
            *shared.committer.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        }

        let weak: Weak<Shared> = Arc::downgrade(&shared);
        log.add_append_listener(Arc::new(move |topic, partition| {
            if let Some(shared) = weak.upgrade() {
                shared.on_append(topic, partition);
            }
        }));

        {
            let mut s = shared.lock();
            for _ in 0..n {
                let slot = s.new_thread_slot(&shared.config.application_id);
                threads::spawn_thread(&shared, &mut s, slot);
            }
            // Restoring: calls answer UNAVAILABLE until the last store is rebuilt.
            if !restoring || s.tasks.iter().all(|t| t.restore.is_none()) {
                shared.set_state(AppState::Running);
            }
        }
        Ok(StreamsApp {
            inner: Arc::new(AppInner { shared }),
        })
    }
}

struct AppInner {
    shared: Arc<Shared>,
}

impl Drop for AppInner {
    /// The last handle gone stops the threads (drain and commit first).
    fn drop(&mut self) {
        self.shared.shutdown();
    }
}

/// A running application: cheap to clone; the last clone dropped shuts it down.
#[derive(Clone)]
pub struct StreamsApp {
    inner: Arc<AppInner>,
}

impl StreamsApp {
    /// Starts `config` on a new embedded log.
    pub fn start(config: Config) -> Result<StreamsApp, RuntimeError> {
        AppBuilder::new(config).start()
    }

    pub fn builder(config: Config) -> AppBuilder {
        AppBuilder::new(config)
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    pub fn config(&self) -> &Config {
        &self.shared().config
    }

    pub fn state(&self) -> AppState {
        self.shared().app_state()
    }

    pub fn host_info(&self) -> HostInfo {
        self.shared().host_info.clone()
    }

    pub fn log(&self) -> Arc<dyn Log> {
        self.shared().log.clone()
    }

    /// Appends records to a topic of the log.
    pub fn produce(
        &self,
        topic: &str,
        records: Vec<ProducerRecord>,
    ) -> Result<Vec<RecordPosition>, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        if topic.is_empty() {
            return Err(RuntimeError::invalid_argument("topic", "must not be empty"));
        }
        Ok(shared.log.append(topic, records)?)
    }

    /// Up to `max` records of one partition of any topic of the log (a source,
    /// retry or dead-letter topic) from `offset` on, with the partition's start
    /// and end offsets. An offset below the oldest retained is `OffsetOutOfRange`;
    /// one at or after the end reads nothing.
    pub fn read_topic(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
    ) -> Result<TopicRead, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        if topic.is_empty() {
            return Err(RuntimeError::invalid_argument("topic", "must not be empty"));
        }
        // An unknown topic or partition comes back from the log as UnknownTopic,
        // or as InvalidArgument on `partition` naming the partition count.
        let mut records = Vec::new();
        shared.log.read(topic, partition, offset, max, &mut records)?;
        // Asked after the read, so the end is past every record returned even
        // while producers append, and the start is what is retained now.
        Ok(TopicRead {
            records,
            start_offset: shared.log.start_offset(topic, partition)?,
            end_offset: shared.log.end_offset(topic, partition)?,
            partitions: shared.log.partitions(topic)?,
        })
    }

    /// StreamsMetadata of the instances hosting `store`. `in_order` is refused
    /// (`OrderNotGuaranteed`) when the store's tasks run `key` or `unordered` with T > 1.
    pub fn process_metadata_for_store(
        &self,
        store: &str,
        in_order: bool,
    ) -> Result<StoreMetadata, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let p = shared.pipeline_index(store)?;
        let pipeline = &shared.pipelines[p];
        check_in_order(pipeline, in_order)?;
        let s = shared.lock();
        let tasks = pipeline.first_task..pipeline.first_task + pipeline.partitions as usize;
        Ok(StoreMetadata {
            instances: vec![shared.streams_metadata(&s, tasks)],
            processing_order: pipeline.order,
            threads_per_task: pipeline.threads_per_task as u32,
            in_order: pipeline.order == ProcessingOrder::Offset,
        })
    }

    /// The partition of `key` and the hosts serving it.
    pub fn metadata_for_key(&self, store: &str, key: &[u8]) -> Result<KeyMetadata, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let pipeline = &shared.pipelines[shared.pipeline_index(store)?];
        let partition = key_partition(pipeline, key)?;
        Ok(KeyMetadata {
            store: store.to_string(),
            topic: pipeline.topic.to_string(),
            partition,
            task_id: format!("{}_{}", pipeline.name, partition),
            active_host: shared.host_info.clone(),
            standby_hosts: Vec::new(),
        })
    }

    /// The value of `key` in `store`.
    pub fn get(&self, store: &str, key: &[u8]) -> Result<Option<Bytes>, RuntimeError> {
        Ok(self
            .query_key(store, key)?
            .entries
            .into_iter()
            .next()
            .map(|(_, v)| v))
    }

    /// A key query, answered by the key's partition with its position.
    pub fn query_key(&self, store: &str, key: &[u8]) -> Result<PartitionQueryResult, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let pipeline = &shared.pipelines[shared.pipeline_index(store)?];
        let partition = key_partition(pipeline, key)?;
        let (live, start) = shared.positions(pipeline.first_task + partition as usize);
        let read = pipeline.stores[partition as usize]
            .read(Some(key), Some(key), 1, live, start)
            .map_err(storage_error)?;
        Ok(PartitionQueryResult {
            partition,
            position: read.position,
            entries: read.entries,
        })
    }

    /// A range query (`from..=to`, open where absent) over `partitions` (empty = all).
    pub fn query_range(
        &self,
        store: &str,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        partitions: &[u32],
        limit: usize,
    ) -> Result<Vec<PartitionQueryResult>, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let pipeline = &shared.pipelines[shared.pipeline_index(store)?];
        if let (Some(f), Some(t)) = (from, to)
            && f > t
        {
            return Err(RuntimeError::invalid_argument(
                "range",
                "`from` is greater than `to`",
            ));
        }
        let partitions = check_partitions(pipeline, partitions)?;
        partitions
            .into_iter()
            .map(|partition| {
                let (live, start) = shared.positions(pipeline.first_task + partition as usize);
                let read = pipeline.stores[partition as usize]
                    .read(from, to, limit, live, start)
                    .map_err(storage_error)?;
                Ok(PartitionQueryResult {
                    partition,
                    position: read.position,
                    entries: read.entries,
                })
            })
            .collect()
    }

    /// Subscribes to the record outcomes of `store`: retained history from the
    /// start position, then live batches, up to the end position.
    pub fn subscribe(
        &self,
        store: &str,
        request: SubscribeRequest,
    ) -> Result<OutcomeSubscription, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let p = shared.pipeline_index(store)?;
        let pipeline = &shared.pipelines[p];
        check_in_order(pipeline, request.in_order)?;
        let mut partitions = check_partitions(pipeline, &request.partitions)?;
        if let StartAt::Offsets(offsets) = &request.start {
            check_partitions(pipeline, &offsets.keys().copied().collect::<Vec<_>>())?;
            partitions.retain(|p| offsets.contains_key(p));
        }
        if let EndAt::Offsets(offsets) = &request.end {
            check_partitions(pipeline, &offsets.keys().copied().collect::<Vec<_>>())?;
            partitions.retain(|p| offsets.contains_key(p));
        }
        // Outcomes exist only for what the log still retains.
        let log_starts: Vec<u64> = partitions
            .iter()
            .map(|&p| shared.log.start_offset(&pipeline.topic, p))
            .collect::<Result<_, _>>()?;
        let s = shared.lock();
        let mut ranges = Vec::new();
        for (&partition, &log_start) in partitions.iter().zip(&log_starts) {
            let task = &s.tasks[pipeline.first_task + partition as usize];
            let floor = task.history.floor.max(log_start);
            let start = match &request.start {
                StartAt::Latest => task.seq.watermark(),
                StartAt::Earliest => floor,
                StartAt::Offsets(offsets) => {
                    let start = offsets[&partition];
                    if start < floor {
                        return Err(RuntimeError::OffsetOutOfRange {
                            partition,
                            requested: start,
                            earliest: floor,
                        });
                    }
                    start
                }
            };
            let end = match &request.end {
                EndAt::Open => None,
                EndAt::Current => Some(shared.log.end_offset(&pipeline.topic, partition)?.max(start)),
                EndAt::Offsets(offsets) => {
                    let end = offsets[&partition];
                    if end < start {
                        return Err(RuntimeError::invalid_argument(
                            "end_offsets",
                            format!("end {end} of partition {partition} is before its start {start}"),
                        ));
                    }
                    Some(end)
                }
            };
            // Whatever the end (current, open, explicit; an explicit end before
            // the start is malformed first): a start past the partition's end
            // would be an empty stream or one waiting for nothing.
            if let StartAt::Offsets(_) = &request.start {
                let log_end = shared.log.end_offset(&pipeline.topic, partition)?;
                if start > log_end {
                    return Err(RuntimeError::OffsetPastEnd {
                        partition,
                        requested: start,
                        end: log_end,
                    });
                }
            }
            ranges.push(crate::metadata::PartitionRange {
                partition,
                start,
                end,
            });
        }
        let receiver = s.senders[p]
            .as_ref()
            .ok_or_else(RuntimeError::shutting_down)?
            .subscribe();
        let history: Vec<Arc<OutcomeBatch>> = partitions
            .iter()
            .flat_map(|&partition| {
                s.tasks[pipeline.first_task + partition as usize]
                    .history
                    .batches
                    .iter()
            })
            .cloned()
            .collect();
        drop(s);
        let weak = Arc::downgrade(&self.inner.shared);
        let first_task = pipeline.first_task;
        // Below this, every record has its final outcome (retries included).
        let watermark_of = move |partition: u32| -> Option<u64> {
            let shared = weak.upgrade()?;
            let s = shared.lock();
            let task = &s.tasks[first_task + partition as usize];
            let watermark = task.seq.watermark();
            Some(
                task.retry
                    .lowest_pending_source()
                    .map_or(watermark, |p| p.min(watermark)),
            )
        };
        Ok(OutcomeSubscription::new(
            ranges,
            history,
            receiver,
            Box::new(watermark_of),
        ))
    }

    /// Threads, pipelines and tasks as they are at this instant.
    pub fn describe(&self) -> RuntimeDescription {
        let shared = self.shared();
        let s = shared.lock();
        let threads: Vec<ThreadMetadata> = s
            .threads
            .iter()
            .enumerate()
            .filter(|(_, t)| t.alive)
            .map(|(i, t)| ThreadMetadata {
                name: t.name.to_string(),
                state: if t.stopping {
                    ThreadState::Stopping
                } else if t.on_retry {
                    ThreadState::Retry
                } else {
                    match t.current {
                        Some(task) if s.tasks[task].owner == i => ThreadState::Owner,
                        Some(_) => ThreadState::Helper,
                        None => ThreadState::Reserve,
                    }
                },
                owned_tasks: s
                    .tasks
                    .iter()
                    .filter(|task| task.owner == i)
                    .map(|task| task.id.to_string())
                    .collect(),
                current_task: t.current.map(|task| s.tasks[task].id.to_string()),
                records_processed: t.records_processed,
            })
            .collect();
        RuntimeDescription {
            application_id: shared.config.application_id.clone(),
            host_info: shared.host_info.clone(),
            state: shared.app_state(),
            num_stream_threads: s.live_threads().len() as u32,
            num_reserve_threads: threads.iter().filter(|t| t.state == ThreadState::Reserve).count() as u32,
            num_retry_threads: threads.iter().filter(|t| t.state == ThreadState::Retry).count() as u32,
            threads,
            pipelines: shared
                .pipelines
                .iter()
                .map(|p| PipelineMetadata {
                    name: p.name.to_string(),
                    source_topic: p.topic.to_string(),
                    partitions: p.partitions,
                    processor: p.processor_name.clone(),
                    processing_order: p.order,
                    threads_per_task: p.threads_per_task as u32,
                    store: p.name.to_string(),
                    store_kind: p.store_kind,
                    retry_policy: p.retry_policy,
                    retry_topic: p.retry_topic.to_string(),
                    dead_letter_topic: p.dead_letter_topic.to_string(),
                    retry_backlog: (p.first_task..p.first_task + p.partitions as usize)
                        .map(|t| shared.retry_backlog(&s.tasks[t]))
                        .sum(),
                    dead_lettered: (0..p.partitions)
                        .map(|partition| {
                            let end = shared
                                .log
                                .end_offset(&p.dead_letter_topic, partition)
                                .unwrap_or(0);
                            let start = shared
                                .log
                                .start_offset(&p.dead_letter_topic, partition)
                                .unwrap_or(0);
                            end - start.min(end)
                        })
                        .sum(),
                })
                .collect(),
            tasks: (0..s.tasks.len()).map(|t| shared.task_metadata(&s, t)).collect(),
        }
    }

    /// Starts one more stream thread and moves its share of tasks onto it.
    pub fn add_stream_thread(&self) -> Result<String, RuntimeError> {
        let shared = &self.inner.shared;
        shared.ensure_running()?;
        let mut s = shared.lock();
        let slot = s.new_thread_slot(&shared.config.application_id);
        s.rebalance_onto(slot);
        threads::spawn_thread(shared, &mut s, slot);
        shared.wake.notify_all();
        Ok(s.threads[slot].name.to_string())
    }

    /// Stops a stream thread (the named one, or the newest) after its unit in
    /// hand; its tasks move to the others. Refused if fewer than T would remain.
    pub fn remove_stream_thread(&self, name: Option<&str>) -> Result<String, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let mut s = shared.lock();
        let live = s.live_threads();
        let max_t = shared
            .pipelines
            .iter()
            .map(|p| p.threads_per_task)
            .max()
            .unwrap_or(1);
        if live.len() <= max_t {
            return Err(RuntimeError::InvalidArgument {
                field: "num_stream_threads".to_string(),
                message: format!(
                    "removing a stream thread would leave {} threads, fewer than num_threads_per_task ({max_t}); \
                     add a thread first or run with fewer threads per task",
                    live.len() - 1
                ),
            });
        }
        let victim = match name {
            Some(name) if !name.is_empty() => *live
                .iter()
                .find(|&&i| &*s.threads[i].name == name)
                .ok_or_else(|| {
                    RuntimeError::invalid_argument("thread_name", format!("no live stream thread `{name}`"))
                })?,
            _ => *live
                .last()
                .ok_or_else(|| RuntimeError::Internal("no live thread".into()))?,
        };
        s.threads[victim].stopping = true;
        s.reassign_tasks_of(victim);
        shared.wake.notify_all();
        Ok(s.threads[victim].name.to_string())
    }

    /// Fault injection for tests and drills: the named thread dies (panics)
    /// at its next step, holding its work; the runtime must replace it.
    pub fn inject_thread_crash(&self, name: &str) -> Result<(), RuntimeError> {
        let shared = self.shared();
        let mut s = shared.lock();
        let slot = s
            .threads
            .iter_mut()
            .find(|t| t.is_live() && &*t.name == name)
            .ok_or_else(|| {
                RuntimeError::invalid_argument("thread_name", format!("no live stream thread `{name}`"))
            })?;
        slot.crash_requested = true;
        shared.wake.notify_all();
        Ok(())
    }

    /// Marks the app shutting down: new calls answer UNAVAILABLE. Non-blocking.
    pub fn begin_shutdown(&self) {
        let shared = self.shared();
        if shared.app_state() == AppState::Running || shared.app_state() == AppState::Starting {
            shared.set_state(AppState::ShuttingDown);
        }
    }

    /// Drains (threads finish the units in hand), commits every watermark and
    /// joins the threads. Blocking and idempotent; open subscriptions end.
    pub fn shutdown(&self) -> Result<(), RuntimeError> {
        self.shared().shutdown();
        Ok(())
    }

    /// Blocks until every store is restored, every task's watermark reaches its
    /// partition's end offset, every retry has its final outcome and every
    /// persistent store has committed it (so queries see it), or `timeout`
    /// passes; returns whether it did. For tests and tools.
    pub fn wait_until_caught_up(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let caught_up = {
                let shared = self.shared();
                let s = shared.lock();
                s.tasks.iter().all(|t| {
                    let topic = &shared.pipelines[t.pipeline].topic;
                    t.restore.is_none()
                        && shared.log.end_offset(topic, t.partition).unwrap_or(0) <= t.seq.watermark()
                        && shared.retry_backlog(t) == 0
                        // Queries read a persistent store's last commit: wait for it too.
                        && !(t.persistent && t.has_uncommitted())
                })
            };
            if caught_up {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

fn storage_error(e: crate::store::StoreError) -> RuntimeError {
    RuntimeError::Storage {
        path: e.path,
        message: e.message,
    }
}

fn check_in_order(pipeline: &PipelineRuntime, in_order: bool) -> Result<(), RuntimeError> {
    if in_order && pipeline.order != ProcessingOrder::Offset {
        return Err(RuntimeError::OrderNotGuaranteed {
            store: pipeline.name.to_string(),
            processing_order: pipeline.order,
            threads_per_task: pipeline.threads_per_task as u32,
        });
    }
    Ok(())
}

/// The empty key is a key like any other, as in Kafka: Produce accepts it,
/// processors see it, and it has a partition (murmur2 of no bytes) and a store entry.
fn key_partition(pipeline: &PipelineRuntime, key: &[u8]) -> Result<u32, RuntimeError> {
    Ok(partition_for_key(key, pipeline.partitions))
}

/// Validates requested partitions; empty means all.
fn check_partitions(pipeline: &PipelineRuntime, partitions: &[u32]) -> Result<Vec<u32>, RuntimeError> {
    if partitions.is_empty() {
        return Ok((0..pipeline.partitions).collect());
    }
    let mut out = Vec::with_capacity(partitions.len());
    for &p in partitions {
        if p >= pipeline.partitions {
            return Err(RuntimeError::invalid_argument(
                "partitions",
                format!(
                    "store `{}` has {} partitions; {p} does not exist",
                    pipeline.name, pipeline.partitions
                ),
            ));
        }
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out.sort_unstable();
    Ok(out)
}
