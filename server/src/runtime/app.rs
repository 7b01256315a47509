//! `StreamsApp`, the library API of the runtime: produce and read topics,
//! metadata, key and range queries, outcome subscriptions, stream threads
//! added and removed (KIP-663), tasks added and removed while running (what
//! a consumer group's assignment and revocation need), and shutdown.
//! Longer than most files here: it is the API's one `impl`, each method a
//! short translation into scheduler calls.

use super::builder::AppBuilder;
use super::pages::check_range_order;
use super::shared::Shared;
use super::subscription::{EndAt, OutcomeSubscription, PartitionRange, StartAt, SubscribeRequest};
use super::task::{Task, TaskInit, task_id};
use super::{RuntimeError, commit, describe, driver, recovery};
use crate::config::{Config, ProcessingOrder};
use crate::log::{Log, ProducerRecord, RecordPosition, partition_for_key};
use crate::metadata::{
    AppState, HostInfo, KeyMetadata, OutcomeBatch, PartitionOwner, PartitionQueryResult, RuntimeDescription,
    StoreMetadata, StreamsMetadata, TopicPartition, TopicRead,
};
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) struct AppInner {
    pub(crate) shared: Arc<Shared>,
}

impl Drop for AppInner {
    /// The last handle gone stops the threads (drain and commit first).
    fn drop(&mut self) {
        if let Err(e) = shutdown(&self.shared) {
            tracing::error!(error = %e, "shutdown when the last handle was dropped");
        }
    }
}

/// A running application: cheap to clone; the last clone dropped shuts it down.
#[derive(Clone)]
pub struct StreamsApp {
    pub(crate) inner: Arc<AppInner>,
}

/// How long a waiting caller sleeps at most before it looks again (a
/// completion normally wakes it first).
const POLL: Duration = Duration::from_millis(50);

impl StreamsApp {
    /// Starts `config` on the embedded log.
    pub fn start(config: Config) -> Result<StreamsApp, RuntimeError> {
        AppBuilder::new(config).start()
    }

    pub fn builder(config: Config) -> AppBuilder {
        AppBuilder::new(config)
    }

    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    pub fn config(&self) -> &Config {
        &self.shared().config
    }

    /// The instance's state: its lifecycle, and while running whether its
    /// group rebalances (`Rebalancing`) or a task restores (`Restoring`).
    pub fn state(&self) -> AppState {
        let shared = self.shared();
        shared.reported_state(&shared.lock())
    }

    pub fn host_info(&self) -> HostInfo {
        self.shared().host_info.clone()
    }

    pub fn log(&self) -> Arc<dyn Log> {
        self.shared().log.clone()
    }

    /// The storage faults of the log and the stores, as they happen.
    pub fn storage_health(&self) -> Arc<crate::health::StorageHealth> {
        self.shared().health.clone()
    }

    /// For each pipeline with a remote processor: its name and whether it
    /// waits for the processor (unreachable), as it changes.
    pub fn processor_waiting(&self) -> Vec<(String, tokio::sync::watch::Receiver<bool>)> {
        self.shared()
            .pipelines
            .iter()
            .filter_map(|p| Some((p.name.to_string(), p.processor.remote()?.subscribe_waiting())))
            .collect()
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

    /// Whether one `produce` writes all of its records or none (the embedded
    /// log), or may fail part way (Kafka).
    pub fn produce_is_atomic(&self) -> bool {
        self.shared().log.append_is_atomic()
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
        // A page without a byte limit: one place checks the arguments and
        // reads the partition's bounds.
        self.read_topic_page(topic, partition, offset, max, usize::MAX)
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
        check_in_order(shared, p, in_order)?;
        let pipeline = &shared.pipelines[p];
        // Copied under the scheduler's lock, built after it (see `describe`).
        let mut tasks = describe::room_for_tasks(shared, Some(&[p]));
        describe::snapshot_tasks(&shared.lock(), Some(&[p]), &mut tasks);
        describe::in_task_order(&mut tasks);
        let local = describe::streams_metadata(shared, &tasks);
        let instances = match shared.cluster() {
            None => vec![local],
            Some(cluster) => cluster_metadata(shared, cluster, p, local)?,
        };
        Ok(StoreMetadata {
            instances,
            processing_order: pipeline.order,
            threads_per_task: pipeline.threads_per_task as u32,
            in_order: pipeline.order == ProcessingOrder::Offset,
        })
    }

    /// The partition of `key` in `store`: Kafka's default partitioner.
    pub fn key_partition(&self, store: &str, key: &[u8]) -> Result<u32, RuntimeError> {
        let shared = self.shared();
        let p = shared.pipeline_index(store)?;
        key_partition(shared, p, key)
    }

    /// Who answers each of `partitions` of `store` (sorted, without
    /// repeats): this instance when it hosts the task, else, in Kafka mode,
    /// the instance the metadata topic names. Empty `partitions` means every
    /// partition of the store in Kafka mode, every one hosted here otherwise.
    /// A partition nobody else holds is `Unavailable` (the group is moving
    /// it); outside Kafka mode a partition not hosted here is `NotHosted`.
    pub fn route(&self, store: &str, partitions: &[u32]) -> Result<Vec<(u32, PartitionOwner)>, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let p = shared.pipeline_index(store)?;
        let Some(cluster) = shared.cluster() else {
            return Ok(hosted_partitions(shared, p, partitions)?
                .into_iter()
                .map(|partition| (partition, PartitionOwner::Local))
                .collect());
        };
        check_partitions(shared, p, partitions)?;
        let pipeline = &shared.pipelines[p];
        let mut wanted: Vec<u32> = match partitions {
            [] => (0..pipeline.partitions).collect(),
            some => some.to_vec(),
        };
        wanted.sort_unstable();
        wanted.dedup();
        let scheduler = shared.lock();
        let view = cluster.view();
        let mut routes = Vec::with_capacity(wanted.len());
        let mut moving = Vec::new();
        for partition in wanted {
            if scheduler.task_index(p, partition).is_some() {
                routes.push((partition, PartitionOwner::Local));
                continue;
            }
            match view.owner(&pipeline.name, partition) {
                Some(owner) if owner.key() != cluster.me() => {
                    routes.push((partition, PartitionOwner::Remote(owner.host_info())));
                }
                // Nobody, or this instance's own record from before the
                // partition left: it is on the move.
                _ => moving.push(partition),
            }
        }
        if moving.is_empty() {
            Ok(routes)
        } else {
            Err(RuntimeError::partitions_moving(&pipeline.name, &moving))
        }
    }

    /// The partition of `key` and the hosts serving it.
    pub fn metadata_for_key(&self, store: &str, key: &[u8]) -> Result<KeyMetadata, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let p = shared.pipeline_index(store)?;
        let pipeline = &shared.pipelines[p];
        let partition = key_partition(shared, p, key)?;
        let active_host = match self.route(store, &[partition])?.pop() {
            Some((_, PartitionOwner::Remote(owner))) => owner,
            _ => shared.host_info.clone(),
        };
        Ok(KeyMetadata {
            store: store.to_string(),
            topic: pipeline.topic.to_string(),
            partition,
            task_id: task_id(&pipeline.name, partition),
            active_host,
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
        let p = shared.pipeline_index(store)?;
        let partition = key_partition(shared, p, key)?;
        read_partition(shared, p, partition, Some(key), Some(key), 1)
    }

    /// A range query (`from..=to`, open where absent) over `partitions` (empty = all hosted here).
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
        let p = shared.pipeline_index(store)?;
        check_range_order(from, to)?;
        hosted_partitions(shared, p, partitions)?
            .into_iter()
            .map(|partition| read_partition(shared, p, partition, from, to, limit))
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
        check_in_order(shared, p, request.in_order)?;
        let pipeline = &shared.pipelines[p];
        let mut partitions = hosted_partitions(shared, p, &request.partitions)?;
        let start_offsets = match &request.start {
            StartAt::Offsets(offsets) => Some(offsets),
            _ => None,
        };
        let end_offsets = match &request.end {
            EndAt::Offsets(offsets) => Some(offsets),
            _ => None,
        };
        for offsets in [start_offsets, end_offsets].into_iter().flatten() {
            hosted_partitions(shared, p, &offsets.keys().copied().collect::<Vec<_>>())?;
            partitions.retain(|p| offsets.contains_key(p));
        }
        // Outcomes exist only for what the log still retains.
        let log_starts: Vec<u64> = partitions
            .iter()
            .map(|&p| shared.log.start_offset(&pipeline.topic, p))
            .collect::<Result<_, _>>()?;
        let scheduler = shared.lock();
        let mut ranges = Vec::new();
        let mut history: Vec<Arc<OutcomeBatch>> = Vec::new();
        for (&partition, &log_start) in partitions.iter().zip(&log_starts) {
            let task = scheduler
                .task_index(p, partition)
                .and_then(|t| scheduler.task(t))
                .ok_or_else(|| not_hosted(shared, p, partition))?;
            let floor = task.history().floor().max(log_start);
            let start = match &request.start {
                StartAt::Latest => task.watermark(),
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
            ranges.push(PartitionRange {
                partition,
                start,
                end,
            });
            history.extend(task.history().batches().cloned());
        }
        let receiver = scheduler
            .feed(p)
            .ok_or_else(RuntimeError::shutting_down)?
            .subscribe();
        drop(scheduler);
        let weak = Arc::downgrade(self.shared());
        // Below this, every record has its final outcome (retries included).
        let watermark_of = move |partition: u32| -> Option<u64> {
            let shared = weak.upgrade()?;
            let scheduler = shared.lock();
            let task = scheduler.task(scheduler.task_index(p, partition)?)?;
            Some(task.final_watermark())
        };
        Ok(OutcomeSubscription::new(
            ranges,
            history,
            receiver,
            Box::new(watermark_of),
            pipeline.name.clone(),
        ))
    }

    /// Threads, pipelines and tasks as they are at this instant.
    pub fn describe(&self) -> RuntimeDescription {
        let shared = self.shared();
        describe::describe(shared)
    }

    /// The partitions of `store`'s pipeline this instance holds tasks for.
    pub fn hosted_partitions(&self, store: &str) -> Result<Vec<u32>, RuntimeError> {
        let shared = self.shared();
        let p = shared.pipeline_index(store)?;
        hosted_partitions(shared, p, &[])
    }

    /// Adds tasks for `partitions` of `store`'s pipeline while running: each
    /// restores its store as at start (meanwhile its queries answer
    /// UNAVAILABLE) and begins at its committed offset — or at `start[p]`,
    /// for a task without a checkpoint of its own (a persistent store that
    /// has committed resumes at its checkpoint, which its data is as of).
    /// The tasks are planned side by side; if one cannot be, the others are
    /// added all the same and the first failure is answered.
    pub fn add_tasks(
        &self,
        store: &str,
        partitions: &[u32],
        start: &BTreeMap<u32, u64>,
    ) -> Result<(), RuntimeError> {
        add_tasks(self.shared(), store, partitions, start)
    }

    /// Removes the tasks of `partitions` of `store`'s pipeline while running:
    /// no new work starts for them, units in flight complete, what remains
    /// is released, each watermark is committed (a persistent store freezes
    /// and writes its state with it), the stores are closed. Blocks until
    /// done; answers `CommitFailed` naming the tasks whose last commit failed.
    pub fn remove_tasks(&self, store: &str, partitions: &[u32]) -> Result<(), RuntimeError> {
        remove_tasks(self.shared(), store, partitions)
    }

    /// Starts one more stream thread and moves its share of tasks onto it.
    pub fn add_stream_thread(&self) -> Result<String, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let (slot, name) = {
            let mut scheduler = shared.lock();
            // Checked under the lock, so concurrent calls cannot pass it together.
            let max = shared.config.max_stream_threads;
            if scheduler.live_threads() >= max {
                return Err(RuntimeError::limit_exceeded(
                    "max_stream_threads",
                    max as u64,
                    format!(
                        "the runtime already runs {} stream threads",
                        scheduler.live_threads()
                    ),
                ));
            }
            let slot = scheduler.add_thread();
            (slot, scheduler.threads()[slot].name().clone())
        };
        driver::spawn(shared, slot, &name);
        shared.wake.notify_all();
        Ok(name.to_string())
    }

    /// Stops a stream thread (the named one, or the newest) after its unit in
    /// hand; its tasks move to the others. Refused if fewer than T would remain.
    pub fn remove_stream_thread(&self, name: Option<&str>) -> Result<String, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let mut scheduler = shared.lock();
        let live = scheduler.live_threads();
        let max_t = shared
            .pipelines
            .iter()
            .map(|p| p.threads_per_task)
            .max()
            .unwrap_or(1);
        if live <= max_t {
            return Err(RuntimeError::InvalidArgument {
                field: "num_stream_threads".to_string(),
                message: format!(
                    "removing a stream thread would leave {} threads, fewer than num_threads_per_task ({max_t}); \
                     add a thread first or run with fewer threads per task",
                    live - 1
                ),
            });
        }
        let victim = match name {
            Some(name) if !name.is_empty() => scheduler.live_thread(name).ok_or_else(|| {
                RuntimeError::invalid_argument("thread_name", format!("no live stream thread `{name}`"))
            })?,
            _ => scheduler
                .newest_live_thread()
                .ok_or_else(|| RuntimeError::Internal("no live thread".into()))?,
        };
        scheduler.stop_thread(victim);
        shared.wake.notify_all();
        Ok(scheduler.threads()[victim].name().to_string())
    }

    /// Fault injection for tests (exactly_once_v2 on Kafka): the next commit
    /// of task `task_id` aborts its transaction, as a transaction timeout or
    /// a rebalance in its way would; the runtime must revive the task.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn inject_transaction_abort(&self, task_id: &str) -> Result<(), RuntimeError> {
        let shared = self.shared();
        let kafka = shared
            .log
            .as_kafka()
            .filter(|_| shared.exactly_once())
            .ok_or_else(|| RuntimeError::Internal("transactions need exactly_once_v2 on Kafka".into()))?;
        kafka.inject_abort(&shared.transactional_id(task_id));
        Ok(())
    }

    /// Fault injection for tests: the named thread dies (panics) at its next
    /// pick, holding what it picked; the runtime must replace it.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn inject_thread_crash(&self, name: &str) -> Result<(), RuntimeError> {
        let shared = self.shared();
        let mut scheduler = shared.lock();
        let slot = scheduler.live_thread(name).ok_or_else(|| {
            RuntimeError::invalid_argument("thread_name", format!("no live stream thread `{name}`"))
        })?;
        scheduler.request_crash(slot);
        shared.wake.notify_all();
        Ok(())
    }

    /// Marks the app shutting down: new calls answer UNAVAILABLE. Non-blocking.
    pub fn begin_shutdown(&self) {
        let shared = self.shared();
        if matches!(shared.app_state(), AppState::Running | AppState::Starting) {
            shared.set_state(AppState::ShuttingDown);
        }
    }

    /// Drains (threads finish the units in hand), commits every watermark and
    /// joins the threads. Blocking and idempotent; open subscriptions end.
    /// Answers `CommitFailed` naming every task whose last commit failed.
    pub fn shutdown(&self) -> Result<(), RuntimeError> {
        shutdown(self.shared())
    }

    /// Blocks until every store is restored, every task's watermark reaches its
    /// partition's end offset, every retry has its final outcome and every
    /// persistent store has committed it (so queries see it), or `timeout`
    /// passes; returns whether it did. For tests and tools.
    pub fn wait_until_caught_up(&self, timeout: Duration) -> bool {
        let shared = self.shared();
        let deadline = Instant::now() + timeout;
        loop {
            let caught_up = {
                let scheduler = shared.lock();
                scheduler.tasks().all(|(_, t)| {
                    let topic = &shared.pipelines[t.pipeline()].topic;
                    !t.is_restoring()
                        && shared.log.end_offset(topic, t.partition()).unwrap_or(0) <= t.watermark()
                        && describe::retry_backlog(shared, t) == 0
                        // Queries read a persistent store's last commit: wait for it too.
                        && !(t.is_persistent() && t.has_uncommitted())
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

/// How many tasks `add_tasks` plans at once. Planning a task mostly waits
/// for the log (on Kafka a round trip each for its offsets, its committed
/// positions and its changelog's end), and a group's assignment adds every
/// task it brings before any of their partitions is fetched: one after
/// another, those waits add up with the partitions.
const PLANNERS: usize = 16;

/// `StreamsApp::add_tasks`, for the app and its group membership: the tasks
/// are planned side by side (`PLANNERS`) and added in the order asked.
pub(crate) fn add_tasks(
    shared: &Shared,
    store: &str,
    partitions: &[u32],
    start: &BTreeMap<u32, u64>,
) -> Result<(), RuntimeError> {
    let _membership = shared.membership.lock().unwrap_or_else(|e| e.into_inner());
    check_live(shared)?;
    let p = shared.pipeline_index(store)?;
    check_partitions(shared, p, partitions)?;
    for &partition in partitions {
        if shared.lock().task_index(p, partition).is_some() {
            return Err(RuntimeError::invalid_argument(
                "partitions",
                format!("partition {partition} of `{store}` is hosted here already"),
            ));
        }
    }
    // Once each: two plans of one task would open its store twice.
    let mut unique = Vec::with_capacity(partitions.len());
    for &partition in partitions {
        if !unique.contains(&partition) {
            unique.push(partition);
        }
    }
    // Planned without the scheduler's lock: the running tasks go on meanwhile.
    let plans = plan_tasks(shared, p, &unique, start);
    let mut failed = None;
    let mut scheduler = shared.lock();
    for plan in plans {
        match plan {
            Ok(init) => {
                scheduler.add_task(init);
            }
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    drop(scheduler);
    shared.wake.notify_all();
    failed.map_or(Ok(()), Err)
}

/// Plans the tasks of `partitions` of pipeline `p`, up to `PLANNERS` at
/// once; the plans in the order of `partitions`.
fn plan_tasks(
    shared: &Shared,
    p: usize,
    partitions: &[u32],
    start: &BTreeMap<u32, u64>,
) -> Vec<Result<TaskInit, RuntimeError>> {
    let plan = |partition: u32| recovery::plan(shared, p, partition, start.get(&partition).copied(), None);
    if partitions.len() < 2 {
        return partitions.iter().map(|&partition| plan(partition)).collect();
    }
    let next = AtomicUsize::new(0);
    let plans: Vec<Mutex<Option<Result<TaskInit, RuntimeError>>>> =
        partitions.iter().map(|_| Mutex::new(None)).collect();
    // Each planner takes the next partition until none is left.
    let work = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&partition) = partitions.get(i) else {
                break;
            };
            let planned = plan(partition);
            *plans[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(planned);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..PLANNERS.min(partitions.len()) {
            let spawned = std::thread::Builder::new()
                .name("task-planner".into())
                .spawn_scoped(scope, work);
            if let Err(e) = spawned {
                // The threads there are (this one at least) plan the rest.
                tracing::warn!(error = %e, "cannot start a thread to plan tasks; planning fewer at once");
                break;
            }
        }
        work();
    });
    plans
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| Err(RuntimeError::Internal("a task was left unplanned".into())))
        })
        .collect()
}

/// `StreamsApp::remove_tasks`, for the app and its group membership.
pub(crate) fn remove_tasks(shared: &Shared, store: &str, partitions: &[u32]) -> Result<(), RuntimeError> {
    let _membership = shared.membership.lock().unwrap_or_else(|e| e.into_inner());
    let p = shared.pipeline_index(store)?;
    let mut removing = Vec::new();
    {
        let mut scheduler = shared.lock();
        for &partition in partitions {
            let index = scheduler
                .task_index(p, partition)
                .ok_or_else(|| not_hosted(shared, p, partition))?;
            if !removing.contains(&index) {
                removing.push(index);
            }
        }
        for &index in &removing {
            scheduler.begin_removal(index);
        }
    }
    let mut failures = Vec::new();
    close_when_idle(shared, removing, |task| {
        // A task whose transaction aborted closes without a last commit:
        // what it holds since its last commit is gone (see `revival`).
        if task.corruption().is_some() {
            return;
        }
        let item = super::scheduler::CommitItem::of(task.index, &task.task);
        if let Err(e) = commit::final_commit(shared, &item) {
            failures.push(format!("{}: {e}", task.task.id()));
        }
    });
    if failures.is_empty() {
        Ok(())
    } else {
        Err(RuntimeError::CommitFailed(failures))
    }
}

/// A task taken out of the scheduler, with the index it had there.
pub(crate) struct Detached {
    pub(crate) index: usize,
    pub(crate) task: Task,
}

impl std::ops::Deref for Detached {
    type Target = Task;
    fn deref(&self) -> &Task {
        &self.task
    }
}

/// Waits until each task of `removing` (begun removal) is idle, takes it
/// out and hands it to `close` as soon as it is; after `close`, the task is
/// dropped, which closes its store once nothing else holds it (a task added
/// again waits for that: `closing`).
pub(crate) fn close_when_idle(shared: &Shared, mut removing: Vec<usize>, mut close: impl FnMut(&Detached)) {
    let mut scheduler = shared.lock();
    while !removing.is_empty() {
        let mut detached = Vec::new();
        removing.retain(|&index| match scheduler.detach_if_idle(index) {
            Some(task) => {
                detached.push(Detached { index, task });
                false
            }
            None => true,
        });
        if !detached.is_empty() {
            drop(scheduler);
            for task in detached {
                close(&task);
                let mut closing = shared.closing.lock().unwrap_or_else(|e| e.into_inner());
                closing.retain(|(_, store)| store.is_open());
                closing.push((task.id().clone(), task.store().open_watch()));
            }
            scheduler = shared.lock();
            continue;
        }
        scheduler.begin_wait();
        let (guard, _) = shared
            .wake
            .wait_timeout(scheduler, POLL)
            .unwrap_or_else(|e| e.into_inner());
        scheduler = guard;
        scheduler.end_wait();
    }
}

/// Drains, commits and stops. Idempotent; blocks until threads are joined.
/// A member of a Kafka consumer group leaves it first: the group revokes
/// every partition, so each task is drained and committed before another
/// instance takes it.
fn shutdown(shared: &Shared) -> Result<(), RuntimeError> {
    if let Some(kafka) = shared.log.as_kafka() {
        kafka.leave_group();
    }
    // After the group: its revocation published the emptied assignment;
    // the tombstone says this instance is gone.
    if let Some(cluster) = shared.cluster() {
        cluster.leave();
    }
    let _membership = shared.membership.lock().unwrap_or_else(|e| e.into_inner());
    if shared.app_state() == AppState::Stopped {
        return Ok(());
    }
    shared.set_state(AppState::ShuttingDown);
    // Threads finish the work in hand and leave; a thread that dies now is not replaced.
    shared.lock().stop_all();
    loop {
        shared.wake.notify_all();
        let handles: Vec<_> = std::mem::take(&mut *shared.handles.lock().unwrap_or_else(|e| e.into_inner()));
        if handles.is_empty() {
            break;
        }
        for handle in handles {
            let _ = handle.join();
        }
    }
    // Commits handed to the committer go first, so commits stay in order.
    shared.committer.stop();
    let items: Vec<_> = {
        let scheduler = shared.lock();
        scheduler
            .tasks()
            .filter(|(_, t)| !t.is_restoring() && t.has_uncommitted())
            .map(|(i, t)| super::scheduler::CommitItem::of(i, t))
            .collect()
    };
    let failures: Vec<String> = items
        .iter()
        .filter_map(|item| {
            commit::final_commit(shared, item)
                .err()
                .map(|e| format!("{}: {e}", item.task_id))
        })
        .collect();
    shared.lock().close_feeds();
    shared.set_state(AppState::Stopped);
    if failures.is_empty() {
        Ok(())
    } else {
        Err(RuntimeError::CommitFailed(failures))
    }
}

/// Adding tasks needs a live app (starting is fine: restores run then too).
fn check_live(shared: &Shared) -> Result<(), RuntimeError> {
    match shared.app_state() {
        AppState::Running | AppState::Rebalancing | AppState::Restoring | AppState::Starting => Ok(()),
        AppState::ShuttingDown | AppState::Stopped => Err(RuntimeError::shutting_down()),
    }
}

/// A partition not hosted here, naming its owner when the metadata topic does.
fn not_hosted(shared: &Shared, pipeline: usize, partition: u32) -> RuntimeError {
    let name = &shared.pipelines[pipeline].name;
    let owner = shared.cluster().and_then(|cluster| {
        let view = cluster.view();
        view.owner(name, partition)
            .filter(|owner| owner.key() != cluster.me())
            .map(|owner| owner.host_info())
    });
    RuntimeError::NotHosted {
        store: name.to_string(),
        partition,
        owner,
    }
}

/// Kafka mode: this instance's metadata (its tasks) and, from the metadata
/// topic, every other instance holding partitions of pipeline `p` (their
/// partitions; their tasks are theirs to describe). Partitions are disjoint;
/// when they do not cover the store, the group is moving some: `Unavailable`.
fn cluster_metadata(
    shared: &Shared,
    cluster: &super::cluster::Cluster,
    p: usize,
    local: StreamsMetadata,
) -> Result<Vec<StreamsMetadata>, RuntimeError> {
    let pipeline = &shared.pipelines[p];
    let mut covered: BTreeSet<u32> = local.topic_partitions.iter().map(|tp| tp.partition).collect();
    let mut instances = Vec::new();
    if !covered.is_empty() {
        instances.push(local);
    }
    let view = cluster.view();
    for (record, partitions) in view.holders(&pipeline.name) {
        // This instance answers for itself from its tasks, not its record.
        if record.key() == cluster.me() {
            continue;
        }
        let partitions: Vec<u32> = partitions.into_iter().filter(|x| !covered.contains(x)).collect();
        if partitions.is_empty() {
            continue;
        }
        covered.extend(&partitions);
        instances.push(StreamsMetadata {
            host_info: record.host_info(),
            state_store_names: record.partitions.keys().cloned().collect(),
            topic_partitions: partitions
                .into_iter()
                .map(|partition| TopicPartition {
                    topic: pipeline.topic.to_string(),
                    partition,
                })
                .collect(),
            standby_topic_partitions: Vec::new(),
            tasks: Vec::new(),
        });
    }
    let missing: Vec<u32> = (0..pipeline.partitions)
        .filter(|x| !covered.contains(x))
        .collect();
    if missing.is_empty() {
        Ok(instances)
    } else {
        Err(RuntimeError::partitions_moving(&pipeline.name, &missing))
    }
}

fn check_in_order(shared: &Shared, pipeline: usize, in_order: bool) -> Result<(), RuntimeError> {
    let pipeline = &shared.pipelines[pipeline];
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
fn key_partition(shared: &Shared, pipeline: usize, key: &[u8]) -> Result<u32, RuntimeError> {
    Ok(partition_for_key(key, shared.pipelines[pipeline].partitions))
}

/// Checks that every partition exists in the pipeline's source topic.
fn check_partitions(shared: &Shared, pipeline: usize, partitions: &[u32]) -> Result<(), RuntimeError> {
    let pipeline = &shared.pipelines[pipeline];
    match partitions.iter().find(|&&p| p >= pipeline.partitions) {
        Some(p) => Err(RuntimeError::invalid_argument(
            "partitions",
            format!(
                "store `{}` has {} partitions; {p} does not exist",
                pipeline.name, pipeline.partitions
            ),
        )),
        None => Ok(()),
    }
}

/// The requested partitions, checked to exist and to be hosted here, sorted
/// and without repeats; empty means every partition hosted here.
pub(super) fn hosted_partitions(
    shared: &Shared,
    pipeline: usize,
    partitions: &[u32],
) -> Result<Vec<u32>, RuntimeError> {
    check_partitions(shared, pipeline, partitions)?;
    let scheduler = shared.lock();
    if partitions.is_empty() {
        let mut hosted: Vec<u32> = scheduler
            .tasks()
            .filter(|(_, t)| t.pipeline() == pipeline)
            .map(|(_, t)| t.partition())
            .collect();
        hosted.sort_unstable();
        return Ok(hosted);
    }
    let mut out: Vec<u32> = Vec::with_capacity(partitions.len());
    for &partition in partitions {
        if scheduler.task_index(pipeline, partition).is_none() {
            return Err(not_hosted(shared, pipeline, partition));
        }
        if !out.contains(&partition) {
            out.push(partition);
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// A key or range read of one hosted partition's store, with its position.
pub(super) fn read_partition(
    shared: &Shared,
    pipeline: usize,
    partition: u32,
    from: Option<&[u8]>,
    to: Option<&[u8]>,
    limit: usize,
) -> Result<PartitionQueryResult, RuntimeError> {
    let (store, live, start, committed_at) = {
        let scheduler = shared.lock();
        let task = scheduler
            .task_index(pipeline, partition)
            .and_then(|t| scheduler.task(t))
            .ok_or_else(|| not_hosted(shared, pipeline, partition))?;
        if task.is_restoring() {
            return Err(RuntimeError::Unavailable {
                reason: format!("task {} is restoring its state store", task.id()),
                retry_after: Duration::from_millis(200),
            });
        }
        let committed_at = task.is_persistent().then(|| task.committed_at()).flatten();
        (
            task.store().clone(),
            task.watermark(),
            task.history_start(),
            committed_at,
        )
    };
    let read = store
        .read(from, to, limit, live, start)
        .map_err(|e| RuntimeError::Storage {
            path: e.path,
            message: e.message,
        })?;
    Ok(PartitionQueryResult {
        partition,
        position: read.position,
        entries: read.entries,
        committed_at,
    })
}
