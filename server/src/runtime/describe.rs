//! The runtime as metadata: per task (owner and helper threads, watermark,
//! committed and end offsets, lag, in-flight records, retry backlog), per
//! instance (StreamsMetadata of the partitions hosted here), and the whole
//! description DescribeRuntime answers. Read under the scheduler lock.

use super::scheduler::Scheduler;
use super::shared::{PipelineRuntime, Shared};
use super::task::Task;
use crate::metadata::{
    PipelineMetadata, RuntimeDescription, StreamsMetadata, TaskMetadata, TaskState, ThreadMetadata,
    ThreadState, TopicPartition,
};

/// The tasks by pipeline (in configuration order), then partition.
fn in_order(scheduler: &Scheduler) -> Vec<(usize, &Task)> {
    let mut tasks: Vec<(usize, &Task)> = scheduler.tasks().collect();
    tasks.sort_by_key(|(_, t)| (t.pipeline(), t.partition()));
    tasks
}

/// Records of a task's retry-topic partition without a final outcome.
pub(crate) fn retry_backlog(shared: &Shared, task: &Task) -> u64 {
    let pipeline = &shared.pipelines[task.pipeline()];
    let end = shared
        .log
        .end_offset(&pipeline.retry_topic, task.partition())
        .unwrap_or(0);
    task.retry().backlog(end)
}

pub(crate) fn task_metadata(
    shared: &Shared,
    scheduler: &Scheduler,
    index: usize,
    task: &Task,
) -> TaskMetadata {
    let pipeline = &shared.pipelines[task.pipeline()];
    let end_offset = shared
        .log
        .end_offset(&pipeline.topic, task.partition())
        .unwrap_or(0);
    let watermark = task.watermark();
    let counters = task.counters();
    TaskMetadata {
        task_id: task.id().to_string(),
        pipeline: pipeline.name.to_string(),
        topic: pipeline.topic.to_string(),
        partition: task.partition(),
        state: if task.is_restoring() {
            TaskState::Restoring
        } else {
            TaskState::Running
        },
        owner_thread: scheduler
            .threads()
            .get(task.owner())
            .map(|t| t.name().to_string())
            .unwrap_or_default(),
        helper_threads: scheduler
            .helpers_of(index)
            .into_iter()
            .map(|name| name.to_string())
            .collect(),
        processing_order: task.order(),
        threads_per_task: task.threads_per_task() as u32,
        watermark,
        committed_offset: task.committed(),
        end_offset,
        lag: end_offset.saturating_sub(watermark),
        in_flight: task.in_flight() as u64,
        retry_backlog: retry_backlog(shared, task),
        records_processed: counters.processed,
        records_failed: counters.failed,
        records_dead_lettered: counters.dead_lettered,
        active_threads: task.active() as u32,
        held_records: task.held_completed() as u64,
        last_commit: task.committed_at(),
    }
}

/// This instance as Kafka Streams' StreamsMetadata for `pipelines`: the
/// source partitions it hosts and the metadata of their tasks.
pub(crate) fn streams_metadata(
    shared: &Shared,
    scheduler: &Scheduler,
    pipelines: &[usize],
) -> StreamsMetadata {
    let mut topic_partitions: Vec<TopicPartition> = Vec::new();
    let mut tasks = Vec::new();
    for (index, task) in in_order(scheduler) {
        if !pipelines.contains(&task.pipeline()) {
            continue;
        }
        topic_partitions.push(TopicPartition {
            topic: shared.pipelines[task.pipeline()].topic.to_string(),
            partition: task.partition(),
        });
        tasks.push(task_metadata(shared, scheduler, index, task));
    }
    // Sorted, then repeats dropped (pipelines may share a source topic): a
    // linear `contains` per task made this quadratic in the tasks, all of it
    // under the scheduler lock that every stream thread needs.
    topic_partitions.sort();
    topic_partitions.dedup();
    StreamsMetadata {
        host_info: shared.host_info.clone(),
        state_store_names: shared.pipelines.iter().map(|p| p.name.to_string()).collect(),
        topic_partitions,
        standby_topic_partitions: Vec::new(),
        tasks,
    }
}

fn pipeline_metadata(
    shared: &Shared,
    scheduler: &Scheduler,
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
        retry_backlog: scheduler
            .tasks()
            .filter(|(_, t)| t.pipeline() == index)
            .map(|(_, t)| retry_backlog(shared, t))
            .sum(),
        dead_lettered: (0..p.partitions)
            .map(|partition| super::commit::dead_lettered(shared, &p.dead_letter_topic, partition))
            .sum(),
        remote_processor: p.processor.remote().map(|remote| remote.status()),
        sink_topic: p.sink.as_ref().map(|sink| sink.topic.to_string()),
    }
}

/// Threads, pipelines and tasks as they are at this instant.
pub(crate) fn describe(shared: &Shared, scheduler: &Scheduler) -> RuntimeDescription {
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
    let tasks: Vec<TaskMetadata> = in_order(scheduler)
        .into_iter()
        .map(|(i, t)| task_metadata(shared, scheduler, i, t))
        .collect();
    RuntimeDescription {
        application_id: shared.config.application_id.clone(),
        host_info: shared.host_info.clone(),
        state: shared.reported_state(scheduler),
        num_stream_threads: scheduler.live_threads() as u32,
        num_reserve_threads: threads.iter().filter(|t| t.state == ThreadState::Reserve).count() as u32,
        num_retry_threads: threads.iter().filter(|t| t.state == ThreadState::Retry).count() as u32,
        threads,
        pipelines: shared
            .pipelines
            .iter()
            .enumerate()
            .map(|(i, p)| pipeline_metadata(shared, scheduler, i, p))
            .collect(),
        tasks,
        storage_faults: shared.health.faults(),
    }
}
