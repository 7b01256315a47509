//! The runtime as metadata: per task (owner and helper threads, watermark,
//! committed and end offsets, lag, in-flight records, retry backlog), per
//! instance (StreamsMetadata of the partitions hosted here), and the whole
//! description DescribeRuntime answers.
//!
//! Read in two steps: under the scheduler lock only what the scheduler holds is
//! copied, a [`TaskSnapshot`] per task, plain numbers into a vector allocated
//! before the lock; the log's offsets are read and the answer's strings (task
//! ids and thread names, which follow from pipeline, partition and thread slot)
//! built after the lock is released. These reads come from gRPC handlers on the
//! server's tokio workers, where every wait for the lock blocks a worker and a
//! worker descheduled while it holds the lock stalls the others: the lock is held
//! for a copy of numbers, no longer — no allocation (whose arena lock may itself
//! wait) and no reference count shared with the other workers (each clone a
//! cache miss while they poll too).

use super::retry_queue::RetryPosition;
use super::scheduler::{Scheduler, thread_name};
use super::shared::{PipelineRuntime, Shared};
use super::task::{Task, TaskCounters, task_id};
use crate::config::ProcessingOrder;
use crate::metadata::{
    PipelineMetadata, RuntimeDescription, StreamsMetadata, TaskMetadata, TaskState, ThreadMetadata,
    ThreadState, TopicPartition,
};
use std::time::SystemTime;

/// Records of a task's retry-topic partition without a final outcome.
pub(crate) fn retry_backlog(shared: &Shared, task: &Task) -> u64 {
    retry_backlog_of(shared, task.pipeline(), task.partition(), task.retry().position())
}

/// `retry_backlog` from a task's retry position copied earlier.
pub(crate) fn retry_backlog_of(
    shared: &Shared,
    pipeline: usize,
    partition: u32,
    retry: RetryPosition,
) -> u64 {
    let end = shared
        .log
        .end_offset(&shared.pipelines[pipeline].retry_topic, partition)
        .unwrap_or(0);
    retry.backlog(end)
}

/// What metadata needs of a task that only the scheduler knows, copied under
/// its lock; [`TaskSnapshot::metadata`] adds the rest without it.
pub(crate) struct TaskSnapshot {
    pipeline: usize,
    partition: u32,
    restoring: bool,
    /// Thread slots (see `thread_name`).
    owner_thread: Option<usize>,
    /// Empty, so not allocated, unless T > 1 and helpers are inside.
    helper_threads: Vec<usize>,
    order: ProcessingOrder,
    threads_per_task: usize,
    watermark: u64,
    committed: u64,
    in_flight: usize,
    retry: RetryPosition,
    counters: TaskCounters,
    active: usize,
    held: usize,
    last_commit: Option<SystemTime>,
}

impl TaskSnapshot {
    /// Task `index` as the scheduler has it now (call with its lock held).
    fn of(scheduler: &Scheduler, index: usize, task: &Task) -> TaskSnapshot {
        TaskSnapshot {
            pipeline: task.pipeline(),
            partition: task.partition(),
            restoring: task.is_restoring(),
            owner_thread: (task.owner() < scheduler.threads().len()).then_some(task.owner()),
            helper_threads: scheduler.helpers_of(index),
            order: task.order(),
            threads_per_task: task.threads_per_task(),
            watermark: task.watermark(),
            committed: task.committed(),
            in_flight: task.in_flight(),
            retry: task.retry().position(),
            counters: task.counters(),
            active: task.active(),
            held: task.held_completed(),
            last_commit: task.committed_at(),
        }
    }

    /// Records of the task's retry-topic partition without a final outcome.
    fn retry_backlog(&self, shared: &Shared) -> u64 {
        retry_backlog_of(shared, self.pipeline, self.partition, self.retry)
    }

    /// The task's metadata, with the log's offsets as they are now.
    fn metadata(&self, shared: &Shared) -> TaskMetadata {
        let pipeline = &shared.pipelines[self.pipeline];
        let end_offset = shared
            .log
            .end_offset(&pipeline.topic, self.partition)
            .unwrap_or(0);
        let application_id = shared.config.application_id.as_str();
        TaskMetadata {
            task_id: task_id(&pipeline.name, self.partition),
            pipeline: String::from(&*pipeline.name),
            topic: String::from(&*pipeline.topic),
            partition: self.partition,
            state: if self.restoring {
                TaskState::Restoring
            } else {
                TaskState::Running
            },
            owner_thread: self
                .owner_thread
                .map(|slot| thread_name(application_id, slot))
                .unwrap_or_default(),
            helper_threads: self
                .helper_threads
                .iter()
                .map(|&slot| thread_name(application_id, slot))
                .collect(),
            processing_order: self.order,
            threads_per_task: self.threads_per_task as u32,
            watermark: self.watermark,
            committed_offset: self.committed,
            end_offset,
            lag: end_offset.saturating_sub(self.watermark),
            in_flight: self.in_flight as u64,
            retry_backlog: self.retry_backlog(shared),
            records_processed: self.counters.processed,
            records_failed: self.counters.failed,
            records_dead_lettered: self.counters.dead_lettered,
            active_threads: self.active as u32,
            held_records: self.held as u64,
            last_commit: self.last_commit,
        }
    }
}

/// Room for the snapshots of the tasks of `pipelines` (all with `None`): a task
/// per partition at most. Allocated before the lock is taken.
pub(crate) fn room_for_tasks(shared: &Shared, pipelines: Option<&[usize]>) -> Vec<TaskSnapshot> {
    let partitions = shared
        .pipelines
        .iter()
        .enumerate()
        .filter(|(index, _)| pipelines.is_none_or(|p| p.contains(index)))
        .map(|(_, p)| p.partitions as usize)
        .sum();
    Vec::with_capacity(partitions)
}

/// Adds to `tasks` (from [`room_for_tasks`]) the snapshots of the tasks of
/// `pipelines` (all with `None`), in the scheduler's order; [`in_task_order`]
/// sorts them once the lock is released. Call with the scheduler's lock held.
pub(crate) fn snapshot_tasks(
    scheduler: &Scheduler,
    pipelines: Option<&[usize]>,
    tasks: &mut Vec<TaskSnapshot>,
) {
    tasks.extend(
        scheduler
            .tasks()
            .filter(|(_, t)| pipelines.is_none_or(|p| p.contains(&t.pipeline())))
            .map(|(index, task)| TaskSnapshot::of(scheduler, index, task)),
    );
}

/// Sorts snapshots by pipeline (in configuration order), then partition.
pub(crate) fn in_task_order(tasks: &mut [TaskSnapshot]) {
    tasks.sort_unstable_by_key(|t| (t.pipeline, t.partition));
}

/// This instance as Kafka Streams' StreamsMetadata, from the snapshots of the
/// tasks it shows (`snapshot_tasks`): the source partitions it hosts and the
/// metadata of their tasks.
pub(crate) fn streams_metadata(shared: &Shared, tasks: &[TaskSnapshot]) -> StreamsMetadata {
    let mut topic_partitions: Vec<TopicPartition> = tasks
        .iter()
        .map(|task| TopicPartition {
            topic: String::from(&*shared.pipelines[task.pipeline].topic),
            partition: task.partition,
        })
        .collect();
    // Sorted, then repeats dropped (pipelines may share a source topic).
    topic_partitions.sort();
    topic_partitions.dedup();
    StreamsMetadata {
        host_info: shared.host_info.clone(),
        state_store_names: shared.pipelines.iter().map(|p| String::from(&*p.name)).collect(),
        topic_partitions,
        standby_topic_partitions: Vec::new(),
        tasks: tasks.iter().map(|task| task.metadata(shared)).collect(),
    }
}

fn pipeline_metadata(
    shared: &Shared,
    tasks: &[TaskSnapshot],
    index: usize,
    p: &PipelineRuntime,
) -> PipelineMetadata {
    PipelineMetadata {
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
        retry_backlog: tasks
            .iter()
            .filter(|t| t.pipeline == index)
            .map(|t| t.retry_backlog(shared))
            .sum(),
        dead_lettered: (0..p.partitions)
            .map(|partition| super::commit::dead_lettered(shared, &p.dead_letter_topic, partition))
            .sum(),
        remote_processor: p.processor.remote().map(|remote| remote.status()),
        sink_topic: p.sink.as_ref().map(|sink| sink.topic.to_string()),
    }
}

/// Threads, pipelines and tasks as they are at this instant (takes the scheduler's lock).
pub(crate) fn describe(shared: &Shared) -> RuntimeDescription {
    let mut tasks = room_for_tasks(shared, None);
    let (threads, state, live_threads) = {
        let scheduler = shared.lock();
        let threads: Vec<ThreadMetadata> = scheduler
            .threads()
            .iter()
            .enumerate()
            .filter(|(_, t)| t.is_alive())
            .map(|(i, t)| ThreadMetadata {
                name: t.name().to_string(),
                state: scheduler.thread_state(i),
                owned_tasks: scheduler
                    .tasks()
                    .filter(|(_, task)| task.owner() == i)
                    .map(|(_, task)| task.id().to_string())
                    .collect(),
                current_task: t
                    .current_task()
                    .and_then(|task| scheduler.task(task))
                    .map(|task| task.id().to_string()),
                records_processed: t.records_processed(),
            })
            .collect();
        snapshot_tasks(&scheduler, None, &mut tasks);
        (
            threads,
            shared.reported_state(&scheduler),
            scheduler.live_threads() as u32,
        )
    };
    in_task_order(&mut tasks);
    RuntimeDescription {
        application_id: shared.config.application_id.clone(),
        host_info: shared.host_info.clone(),
        state,
        num_stream_threads: live_threads,
        num_reserve_threads: threads.iter().filter(|t| t.state == ThreadState::Reserve).count() as u32,
        num_retry_threads: threads.iter().filter(|t| t.state == ThreadState::Retry).count() as u32,
        threads,
        pipelines: shared
            .pipelines
            .iter()
            .enumerate()
            .map(|(i, p)| pipeline_metadata(shared, &tasks, i, p))
            .collect(),
        tasks: tasks.iter().map(|t| t.metadata(shared)).collect(),
        storage_faults: shared.health.faults(),
    }
}
