//! What the stream threads and the `StreamsApp` API share: the config, the
//! log, the pipelines as they run (fixed after start), the Scheduler behind
//! its mutex with the condvar threads wait on and the inbox the log's append
//! listener leaves appends in, the app state, and the commit plumbing. A std
//! mutex: it is held for a pick or a completion — never across I/O or a
//! processor call — and threads are OS threads, not tasks.

use super::RuntimeError;
use super::commit::Committer;
use super::inbox::AppendInbox;
use super::scheduler::Scheduler;
use crate::config::{Config, ProcessingOrder, RetryPolicy, StoreKind};
use crate::log::Log;
use crate::metadata::{AppState, HostInfo};
use crate::processor::Processor;
use crate::processor::remote::RemoteProcessor;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// The result of one commit of one task, reported to the commit callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitReport {
    pub task_id: String,
    /// The committed watermark: the next offset a restart resumes from.
    pub offset: u64,
    pub result: Result<(), String>,
}

pub(crate) type CommitCallback = Arc<dyn Fn(&CommitReport) + Send + Sync>;

/// A pipeline as it runs: immutable after start.
pub(crate) struct PipelineRuntime {
    pub(crate) name: Arc<str>,
    pub(crate) topic: Arc<str>,
    /// Partitions of the source topic (all of them, hosted here or not).
    pub(crate) partitions: u32,
    pub(crate) order: ProcessingOrder,
    pub(crate) threads_per_task: usize,
    pub(crate) processor: PipelineProcessor,
    pub(crate) processor_name: String,
    pub(crate) store_kind: StoreKind,
    pub(crate) retry_policy: RetryPolicy,
    pub(crate) retry_topic: Arc<str>,
    pub(crate) dead_letter_topic: Arc<str>,
    /// On Kafka: the store's changelog topic (`None` on the embedded log,
    /// whose memory stores replay the source and whose persistent stores
    /// stay on this machine).
    pub(crate) changelog_topic: Option<Arc<str>>,
    /// Where the pipeline's output records go, if anywhere.
    pub(crate) sink: Option<SinkTopic>,
}

/// A pipeline's sink topic and its partitions (an output's explicit
/// partition must be below).
pub(crate) struct SinkTopic {
    pub(crate) topic: Arc<str>,
    pub(crate) partitions: u32,
}

/// What runs a pipeline's records: code in this process, or a user's
/// `ProcessorService` called over gRPC (whose answers the runtime applies).
pub(crate) enum PipelineProcessor {
    Local(Arc<dyn Processor>),
    Remote(Arc<RemoteProcessor>),
}

impl PipelineProcessor {
    pub(crate) fn remote(&self) -> Option<&RemoteProcessor> {
        match self {
            PipelineProcessor::Local(_) => None,
            PipelineProcessor::Remote(remote) => Some(remote),
        }
    }
}

pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) log: Arc<dyn Log>,
    pub(crate) host_info: HostInfo,
    pub(crate) pipelines: Vec<PipelineRuntime>,
    scheduler: Mutex<Scheduler>,
    /// Threads with nothing to do wait here; any change that may give them
    /// work notifies (when the scheduler says someone waits).
    pub(crate) wake: Condvar,
    /// Appends the log's listener left for the next holder of `scheduler`.
    pub(crate) appends: AppendInbox,
    state: AtomicU8,
    pub(crate) on_commit: Option<CommitCallback>,
    /// Storage faults of the log and the stores (the log's own, when it keeps one).
    pub(crate) health: Arc<crate::health::StorageHealth>,
    pub(crate) committer: Committer,
    /// Wakes the watchdog thread (a task to revive).
    pub(crate) watchdog: Arc<super::watchdog::Watchdog>,
    /// Serializes shutdown and task removals with each other.
    pub(crate) membership: Mutex<()>,
    /// Serializes writes of commits to the log, so a commit decided before a
    /// task left is checked and written atomically against its last commit.
    pub(crate) commit_lock: Mutex<()>,
    /// The stream threads started, to join at shutdown.
    pub(crate) handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Records were appended unflushed since the last flush (see `flush_log`).
    unflushed: std::sync::atomic::AtomicBool,
    /// The consumer group is moving partitions (Kafka mode): from joining
    /// until the first assignment, and during every rebalance step.
    rebalancing: std::sync::atomic::AtomicBool,
    /// Stores of tasks that left, by task id, until the last reference to
    /// them (a commit still being written) is gone and the file closed: a
    /// task added again waits for that before it opens its store (a file is
    /// opened once at a time).
    pub(crate) closing: Mutex<Vec<(Arc<str>, super::stores::OpenWatch)>>,
    /// Kafka mode with the group: the metadata topic's publisher and reader,
    /// set once at start before the group is joined.
    cluster: std::sync::OnceLock<Arc<super::cluster::Cluster>>,
}

impl Shared {
    pub(crate) fn new(
        config: Config,
        log: Arc<dyn Log>,
        host_info: HostInfo,
        pipelines: Vec<PipelineRuntime>,
        scheduler: Scheduler,
        on_commit: Option<CommitCallback>,
    ) -> Shared {
        let health = log
            .storage_health()
            .unwrap_or_else(crate::health::StorageHealth::new);
        Shared {
            health,
            config,
            log,
            host_info,
            pipelines,
            scheduler: Mutex::new(scheduler),
            wake: Condvar::new(),
            appends: AppendInbox::default(),
            state: AtomicU8::new(0),
            on_commit,
            committer: Committer::default(),
            watchdog: Arc::default(),
            membership: Mutex::new(()),
            commit_lock: Mutex::new(()),
            handles: Mutex::new(Vec::new()),
            closing: Mutex::new(Vec::new()),
            unflushed: std::sync::atomic::AtomicBool::new(false),
            rebalancing: std::sync::atomic::AtomicBool::new(false),
            cluster: std::sync::OnceLock::new(),
        }
    }

    /// The metadata topic's side of this instance, in Kafka mode with the group.
    pub(crate) fn cluster(&self) -> Option<&Arc<super::cluster::Cluster>> {
        self.cluster.get()
    }

    pub(crate) fn set_cluster(&self, cluster: Arc<super::cluster::Cluster>) {
        let _ = self.cluster.set(cluster);
    }

    /// Pipeline → partitions of the tasks hosted here now.
    pub(crate) fn hosted(&self) -> std::collections::BTreeMap<String, std::collections::BTreeSet<u32>> {
        let scheduler = self.lock();
        let mut hosted: std::collections::BTreeMap<String, std::collections::BTreeSet<u32>> = self
            .pipelines
            .iter()
            .map(|p| (p.name.to_string(), std::collections::BTreeSet::new()))
            .collect();
        for (_, task) in scheduler.tasks() {
            if let Some(partitions) = hosted.get_mut(&*self.pipelines[task.pipeline()].name) {
                partitions.insert(task.partition());
            }
        }
        hosted
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Scheduler> {
        // A panicking processor never holds this lock, and every scheduler
        // change completes before the lock is released: poison carries no news.
        let mut scheduler = self.scheduler.lock().unwrap_or_else(|e| e.into_inner());
        self.apply_appends(&mut scheduler);
        scheduler
    }

    /// Tells the scheduler of new records in a pipeline's source (or retry)
    /// partition, from the log's append listener. Waits for the lock only
    /// when a thread may be asleep for want of them; otherwise, the lock
    /// being taken, the appends wait in the inbox for its next holder.
    pub(crate) fn notify_append(&self, appended: &[super::inbox::Appended]) {
        let scheduler = match self.scheduler.try_lock() {
            Ok(scheduler) => Some(scheduler),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let Some(mut scheduler) = scheduler else {
            if self.appends.post(appended.iter().copied()) {
                // Taking the lock applies the inbox, these included, and wakes.
                drop(self.lock());
            }
            return;
        };
        // What waited in the inbox first: it was appended before these.
        let waiting = self.appends.take();
        self.hand_over(
            &mut scheduler,
            waiting.into_iter().chain(appended.iter().copied()),
        );
    }

    /// Hands the scheduler what the append listener left in the inbox.
    fn apply_appends(&self, scheduler: &mut Scheduler) {
        let appended = self.appends.take();
        if !appended.is_empty() {
            self.hand_over(scheduler, appended);
        }
    }

    /// Tells the tasks of `appended` (those hosted here) of their new
    /// records, and wakes waiting threads if any task was told.
    fn hand_over(
        &self,
        scheduler: &mut Scheduler,
        appended: impl IntoIterator<Item = super::inbox::Appended>,
    ) {
        let now_ms = super::process::now_ms();
        let mut any = false;
        for (pipeline, partition, source) in appended {
            if let Some(task) = scheduler.task_index(pipeline, partition) {
                scheduler.notify_append(task, source, now_ms);
                any = true;
            }
        }
        if any {
            self.wake_waiters(scheduler);
        }
    }

    /// Wakes waiting threads if any wait.
    pub(crate) fn wake_waiters(&self, scheduler: &Scheduler) {
        if scheduler.has_waiters() {
            self.wake.notify_all();
        }
    }

    /// Whether commits are Kafka transactions (`exactly_once_v2`).
    pub(crate) fn exactly_once(&self) -> bool {
        self.config.processing_guarantee == crate::config::ProcessingGuarantee::ExactlyOnceV2
            && self.log.as_kafka().is_some()
    }

    /// The transactional id of a task under exactly_once_v2:
    /// `<application_id>-<task_id>`, the same on every instance, so a new
    /// owner fences the old one.
    pub(crate) fn transactional_id(&self, task_id: &str) -> String {
        format!("{}-{task_id}", self.config.application_id)
    }

    /// Failed records were appended without a flush.
    pub(crate) fn note_unflushed(&self) {
        self.unflushed.store(true, Ordering::Release);
    }

    /// Makes the failed records appended so far durable, before a commit
    /// covers them. On failure the commit must not be written.
    pub(crate) fn flush_log(&self) -> Result<(), String> {
        if !self.unflushed.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        self.log.flush().map_err(|e| {
            self.unflushed.store(true, Ordering::Release);
            format!("could not flush the log before committing: {e}")
        })
    }

    pub(crate) fn app_state(&self) -> AppState {
        match self.state.load(Ordering::Acquire) {
            0 => AppState::Starting,
            1 => AppState::Running,
            2 => AppState::ShuttingDown,
            _ => AppState::Stopped,
        }
    }

    /// Sets the lifecycle state. `Rebalancing` and `Restoring` are not
    /// lifecycle states (an instance doing either is running): see
    /// `reported_state`.
    pub(crate) fn set_state(&self, state: AppState) {
        let value = match state {
            AppState::Starting => 0,
            AppState::Running | AppState::Rebalancing | AppState::Restoring => 1,
            AppState::ShuttingDown => 2,
            AppState::Stopped => 3,
        };
        self.state.store(value, Ordering::Release);
    }

    pub(crate) fn set_rebalancing(&self, rebalancing: bool) {
        self.rebalancing.store(rebalancing, Ordering::Release);
    }

    pub(crate) fn is_rebalancing(&self) -> bool {
        self.rebalancing.load(Ordering::Acquire)
    }

    /// The state an observer sees: a running instance is `Rebalancing` while
    /// its group moves partitions, else `Restoring` while a task rebuilds its
    /// store.
    pub(crate) fn reported_state(&self, scheduler: &Scheduler) -> AppState {
        match self.app_state() {
            AppState::Running if self.is_rebalancing() => AppState::Rebalancing,
            AppState::Running if !scheduler.all_restored() => AppState::Restoring,
            state => state,
        }
    }

    /// Fails unless the app is running: callers get UNAVAILABLE with a retry hint.
    pub(crate) fn ensure_running(&self) -> Result<(), RuntimeError> {
        match self.app_state() {
            AppState::Running | AppState::Rebalancing | AppState::Restoring => Ok(()),
            AppState::Starting => Err(RuntimeError::Unavailable {
                reason: "the instance is starting (restoring its state stores)".to_string(),
                retry_after: Duration::from_millis(200),
            }),
            AppState::ShuttingDown | AppState::Stopped => Err(RuntimeError::shutting_down()),
        }
    }

    pub(crate) fn pipeline_index(&self, store: &str) -> Result<usize, RuntimeError> {
        if store.is_empty() {
            return Err(RuntimeError::invalid_argument("store", "must not be empty"));
        }
        self.pipelines
            .iter()
            .position(|p| &*p.name == store)
            .ok_or_else(|| RuntimeError::UnknownStore(store.to_string()))
    }

    /// Backoff before attempt `attempts + 1`, jittered by `seed`.
    pub(crate) fn backoff(&self, attempts: u32, seed: u64) -> Duration {
        super::retry::backoff(
            attempts,
            self.config.retry_backoff_ms,
            self.config.retry_backoff_max_ms,
            seed ^ u64::from(attempts).rotate_left(32),
        )
    }

    pub(crate) fn processing_timeout(&self) -> Option<Duration> {
        (self.config.processing_timeout_ms > 0)
            .then(|| Duration::from_millis(self.config.processing_timeout_ms))
    }
}
