//! Responses out: runtime metadata, query results, produce positions, record
//! outcomes and topic reads as proto messages. Pure functions, no I/O; offsets
//! are `u64` in the runtime and `int64` on the wire (saturating, which no real
//! log reaches).

use crate::config::ProcessingOrder;
use crate::log::{Record, RecordPosition};
use crate::metadata::{
    AppState, HostInfo, KeyMetadata, Outcome, OutcomeBatch, PartitionQueryResult, PipelineMetadata,
    RecordOutcome, RuntimeDescription, StoreMetadata, StreamsMetadata, TaskMetadata, TaskState,
    ThreadMetadata, ThreadState, TopicPartition, TopicRead,
};
use std::collections::BTreeMap;
use taskstream::v1 as pb;

pub fn offset(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

pub fn processing_order(order: ProcessingOrder) -> pb::ProcessingOrder {
    match order {
        ProcessingOrder::Offset => pb::ProcessingOrder::Offset,
        ProcessingOrder::Key => pb::ProcessingOrder::Key,
        ProcessingOrder::Unordered => pb::ProcessingOrder::Unordered,
    }
}

pub fn host_info(host: &HostInfo) -> pb::HostInfo {
    pb::HostInfo {
        host: host.host.clone(),
        port: u32::from(host.port),
    }
}

fn topic_partition(tp: TopicPartition) -> pb::TopicPartition {
    pb::TopicPartition {
        topic: tp.topic,
        partition: tp.partition,
    }
}

fn task_state(state: TaskState) -> pb::TaskState {
    match state {
        TaskState::Restoring => pb::TaskState::Restoring,
        TaskState::Running => pb::TaskState::Running,
        TaskState::Suspended => pb::TaskState::Suspended,
    }
}

/// Takes the metadata by value: its strings move into the message (one
/// ProcessMetadataForStore answer holds several per task).
pub fn task_metadata(task: TaskMetadata) -> pb::TaskMetadata {
    pb::TaskMetadata {
        task_id: task.task_id,
        pipeline: task.pipeline,
        topic: task.topic,
        partition: task.partition,
        state: task_state(task.state) as i32,
        owner_thread: task.owner_thread,
        helper_threads: task.helper_threads,
        processing_order: processing_order(task.processing_order) as i32,
        threads_per_task: task.threads_per_task,
        watermark: offset(task.watermark),
        committed_offset: offset(task.committed_offset),
        end_offset: offset(task.end_offset),
        lag: offset(task.lag),
        in_flight: task.in_flight,
        retry_backlog: task.retry_backlog,
        records_processed: task.records_processed,
        records_failed: task.records_failed,
        records_dead_lettered: task.records_dead_lettered,
        active_threads: task.active_threads,
        held_records: task.held_records,
        last_commit_ms: task.last_commit.map_or(0, epoch_ms),
    }
}

/// Milliseconds since the Unix epoch (0 for a time before it).
fn epoch_ms(at: std::time::SystemTime) -> i64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn streams_metadata(instance: StreamsMetadata) -> pb::StreamsMetadata {
    pb::StreamsMetadata {
        host_info: Some(host_info(&instance.host_info)),
        state_store_names: instance.state_store_names,
        // Moved, not copied: this runs on every metadata call.
        topic_partitions: instance
            .topic_partitions
            .into_iter()
            .map(topic_partition)
            .collect(),
        standby_topic_partitions: instance
            .standby_topic_partitions
            .into_iter()
            .map(topic_partition)
            .collect(),
        tasks: instance.tasks.into_iter().map(task_metadata).collect(),
    }
}

pub fn store_metadata(store: StoreMetadata) -> pb::ProcessMetadataForStoreResponse {
    pb::ProcessMetadataForStoreResponse {
        metadata: store.instances.into_iter().map(streams_metadata).collect(),
        processing_order: processing_order(store.processing_order) as i32,
        threads_per_task: store.threads_per_task,
        in_order: store.in_order,
    }
}

pub fn key_metadata(key: &KeyMetadata) -> pb::MetadataForKeyResponse {
    pb::MetadataForKeyResponse {
        store: key.store.clone(),
        topic: key.topic.clone(),
        partition: key.partition,
        task_id: key.task_id.clone(),
        active_host: Some(host_info(&key.active_host)),
        standby_hosts: key.standby_hosts.iter().map(host_info).collect(),
    }
}

/// One partition's answer, naming `host`, the instance that answered it.
pub fn partition_result(result: PartitionQueryResult, host: &HostInfo) -> pb::PartitionResult {
    pb::PartitionResult {
        host: Some(host_info(host)),
        partition: result.partition,
        position: offset(result.position),
        entries: result
            .entries
            .into_iter()
            .map(|(key, value)| pb::KeyValue { key, value })
            .collect(),
        committed_at_ms: result.committed_at.map_or(0, epoch_ms),
    }
}

/// Per-partition first/last offset and count of appended records. Kept as a
/// running summary so ProduceStream needs no memory per record.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PartitionRanges {
    ranges: BTreeMap<u32, (u64, u64, u64)>,
    records: u64,
}

impl PartitionRanges {
    pub fn add(&mut self, positions: &[RecordPosition]) {
        for position in positions {
            self.records += 1;
            self.ranges
                .entry(position.partition)
                .and_modify(|(first, last, count)| {
                    *first = (*first).min(position.offset);
                    *last = (*last).max(position.offset);
                    *count += 1;
                })
                .or_insert((position.offset, position.offset, 1));
        }
    }

    pub fn record_count(&self) -> u64 {
        self.records
    }

    pub fn to_proto(&self) -> Vec<pb::PartitionRange> {
        self.ranges
            .iter()
            .map(|(&partition, &(first, last, count))| pb::PartitionRange {
                partition,
                first_offset: offset(first),
                last_offset: offset(last),
                count,
            })
            .collect()
    }
}

pub fn record_position(position: &RecordPosition) -> pb::RecordPosition {
    pb::RecordPosition {
        partition: position.partition,
        offset: offset(position.offset),
    }
}

fn topic_record(record: Record) -> pb::TopicRecord {
    pb::TopicRecord {
        partition: record.partition,
        offset: offset(record.offset),
        timestamp_ms: record.timestamp_ms,
        key: record.key,
        value: record.value,
        headers: record
            .headers
            .into_iter()
            .map(|(name, value)| pb::Header { name, value })
            .collect(),
    }
}

pub fn topic_read(topic: String, partition: u32, read: TopicRead) -> pb::ReadTopicResponse {
    pb::ReadTopicResponse {
        topic,
        partition,
        records: read.records.into_iter().map(topic_record).collect(),
        start_offset: offset(read.start_offset),
        end_offset: offset(read.end_offset),
        partitions: read.partitions,
    }
}

fn thread_state(state: ThreadState) -> pb::ThreadState {
    match state {
        ThreadState::Owner => pb::ThreadState::Owner,
        ThreadState::Helper => pb::ThreadState::Helper,
        ThreadState::Reserve => pb::ThreadState::Reserve,
        ThreadState::Stopping => pb::ThreadState::Stopping,
        ThreadState::Retry => pb::ThreadState::Retry,
    }
}

fn service_state(state: AppState) -> pb::ServiceState {
    match state {
        AppState::Starting => pb::ServiceState::Starting,
        AppState::Running => pb::ServiceState::Running,
        AppState::Rebalancing => pb::ServiceState::Rebalancing,
        AppState::Restoring => pb::ServiceState::Restoring,
        // The contract has no STOPPED: a stopped instance that still answers
        // is, for a client, one that is going away.
        AppState::ShuttingDown | AppState::Stopped => pb::ServiceState::ShuttingDown,
    }
}

fn thread_metadata(thread: &ThreadMetadata) -> pb::ThreadMetadata {
    pb::ThreadMetadata {
        name: thread.name.clone(),
        state: thread_state(thread.state) as i32,
        owned_tasks: thread.owned_tasks.clone(),
        current_task: thread.current_task.clone().unwrap_or_default(),
        records_processed: thread.records_processed,
    }
}

fn pipeline_metadata(pipeline: &PipelineMetadata) -> pb::PipelineMetadata {
    pb::PipelineMetadata {
        name: pipeline.name.clone(),
        source_topic: pipeline.source_topic.clone(),
        partitions: pipeline.partitions,
        processor: pipeline.processor.clone(),
        processing_order: processing_order(pipeline.processing_order) as i32,
        threads_per_task: pipeline.threads_per_task,
        store: pipeline.store.clone(),
        store_kind: pipeline.store_kind.as_str().to_string(),
        retry_policy: pipeline.retry_policy.as_str().to_string(),
        retry_topic: pipeline.retry_topic.clone(),
        dead_letter_topic: pipeline.dead_letter_topic.clone(),
        retry_backlog: pipeline.retry_backlog,
        dead_lettered: pipeline.dead_lettered,
        remote_processor: pipeline
            .remote_processor
            .as_ref()
            .map(|status| pb::RemoteProcessorStatus {
                endpoint: status.endpoint.clone(),
                waiting: status.waiting_since_ms.is_some(),
                waiting_since_ms: status.waiting_since_ms.unwrap_or(0),
                last_error: status.last_error.clone().unwrap_or_default(),
                unreachable_calls: status.unreachable_calls,
            }),
        sink_topic: pipeline.sink_topic.clone().unwrap_or_default(),
    }
}

pub fn runtime_description(description: RuntimeDescription) -> pb::DescribeRuntimeResponse {
    pb::DescribeRuntimeResponse {
        application_id: description.application_id,
        host_info: Some(host_info(&description.host_info)),
        state: service_state(description.state) as i32,
        num_stream_threads: description.num_stream_threads,
        num_reserve_threads: description.num_reserve_threads,
        threads: description.threads.iter().map(thread_metadata).collect(),
        pipelines: description.pipelines.iter().map(pipeline_metadata).collect(),
        tasks: description.tasks.into_iter().map(task_metadata).collect(),
        num_retry_threads: description.num_retry_threads,
        storage_faults: description
            .storage_faults
            .iter()
            .map(|fault| pb::StorageFault {
                component: fault.component.as_str().to_string(),
                name: fault.name.clone(),
                since_ms: epoch_ms(fault.since),
                error: fault.error.clone(),
                errors: fault.errors,
            })
            .collect(),
    }
}

fn record_outcome(outcome: Outcome) -> pb::RecordOutcome {
    match outcome {
        Outcome::Processed => pb::RecordOutcome::Processed,
        Outcome::Failed => pb::RecordOutcome::Failed,
        Outcome::Retrying => pb::RecordOutcome::Retrying,
        Outcome::DeadLettered => pb::RecordOutcome::DeadLettered,
    }
}

fn record_metadata(record: &RecordOutcome) -> pb::RecordMetadata {
    pb::RecordMetadata {
        offset: offset(record.offset),
        key: record.key.clone(),
        timestamp_ms: record.timestamp_ms,
        outcome: record_outcome(record.outcome) as i32,
        attempts: record.attempts,
        error: record.error.as_deref().unwrap_or_default().to_string(),
        thread: record.thread.as_deref().unwrap_or_default().to_string(),
        key_truncated: record.key_truncated,
    }
}

/// One completed range as stream messages: one message, or with
/// `max_records > 0` several of at most that many records. The chunks tile the
/// batch's range: the first starts at the batch's first offset, the last ends
/// at its last offset, and each one between spans exactly its own records.
pub fn metadata_batches(batch: &OutcomeBatch, max_records: usize) -> Vec<pb::MetadataBatch> {
    let message = |first_offset: u64, last_offset: u64, records: &[RecordOutcome]| pb::MetadataBatch {
        task_id: batch.task_id.to_string(),
        // A pipeline's store has the pipeline's name.
        store: batch.pipeline.to_string(),
        topic: batch.topic.to_string(),
        partition: batch.partition,
        thread: batch.thread.to_string(),
        first_offset: offset(first_offset),
        last_offset: offset(last_offset),
        records: records.iter().map(record_metadata).collect(),
        reprocessed: batch.reprocessed,
    };
    if max_records == 0 || batch.records.len() <= max_records {
        return vec![message(batch.first_offset, batch.last_offset, &batch.records)];
    }
    let chunks: Vec<&[RecordOutcome]> = batch.records.chunks(max_records).collect();
    let last_chunk = chunks.len() - 1;
    chunks
        .iter()
        .enumerate()
        .map(|(i, chunk)| {
            let lowest = chunk.iter().map(|r| r.offset).min().unwrap_or(batch.first_offset);
            let highest = chunk.iter().map(|r| r.offset).max().unwrap_or(batch.last_offset);
            let first = if i == 0 {
                batch.first_offset.min(lowest)
            } else {
                lowest
            };
            let last = if i == last_chunk {
                batch.last_offset.max(highest)
            } else {
                highest
            };
            message(first, last, chunk)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::sync::Arc;

    fn batch(first: u64, last: u64) -> OutcomeBatch {
        OutcomeBatch {
            task_id: Arc::from("counts_2"),
            pipeline: Arc::from("counts"),
            topic: Arc::from("events"),
            partition: 2,
            thread: Arc::from("stream-thread-1"),
            first_offset: first,
            last_offset: last,
            records: (first..=last)
                .map(|offset| RecordOutcome {
                    thread: None,
                    offset,
                    key: (offset % 2 == 0).then(|| Bytes::from(format!("k{offset}"))),
                    key_truncated: false,
                    timestamp_ms: 1_000 + offset as i64,
                    outcome: if offset == first + 1 {
                        Outcome::DeadLettered
                    } else {
                        Outcome::Processed
                    },
                    attempts: 1,
                    error: (offset == first + 1).then(|| Arc::from("boom")),
                })
                .collect(),
            reprocessed: false,
        }
    }

    #[test]
    fn a_batch_is_one_message_when_small_enough_or_unlimited() {
        let source = batch(10, 14);
        for max in [0, 5, 100] {
            let messages = metadata_batches(&source, max);
            assert_eq!(messages.len(), 1, "max = {max}");
            let message = &messages[0];
            assert_eq!(
                (message.first_offset, message.last_offset, message.records.len()),
                (10, 14, 5)
            );
            assert_eq!(message.task_id, "counts_2");
            assert_eq!(message.store, "counts");
            assert_eq!(message.topic, "events");
            assert_eq!(message.partition, 2);
            assert_eq!(message.thread, "stream-thread-1");
        }
    }

    #[test]
    fn a_large_batch_splits_into_chunks_with_their_own_offsets() {
        let messages = metadata_batches(&batch(10, 19), 4);
        let ranges: Vec<_> = messages
            .iter()
            .map(|m| (m.first_offset, m.last_offset, m.records.len()))
            .collect();
        assert_eq!(ranges, vec![(10, 13, 4), (14, 17, 4), (18, 19, 2)]);
        let offsets: Vec<i64> = messages
            .iter()
            .flat_map(|m| m.records.iter().map(|r| r.offset))
            .collect();
        assert_eq!(offsets, (10..=19).collect::<Vec<i64>>());
        assert!(
            messages
                .iter()
                .all(|m| m.task_id == "counts_2" && m.thread == "stream-thread-1")
        );
    }

    #[test]
    fn record_fields_survive() {
        let message = &metadata_batches(&batch(10, 11), 0)[0];
        let ok = &message.records[0];
        assert_eq!(ok.key.as_deref(), Some(&b"k10"[..]));
        assert_eq!(ok.outcome, pb::RecordOutcome::Processed as i32);
        assert_eq!((ok.timestamp_ms, ok.attempts, ok.error.as_str()), (1_010, 1, ""));
        let dead = &message.records[1];
        assert_eq!(dead.key, None);
        assert_eq!(dead.outcome, pb::RecordOutcome::DeadLettered as i32);
        assert_eq!(dead.error, "boom");
    }

    #[test]
    fn partition_ranges_summarise_positions() {
        let mut ranges = PartitionRanges::default();
        let at = |partition, offset| RecordPosition { partition, offset };
        ranges.add(&[at(1, 5), at(0, 0), at(1, 6)]);
        ranges.add(&[at(1, 7), at(0, 1)]);
        assert_eq!(ranges.record_count(), 5);
        assert_eq!(
            ranges.to_proto(),
            vec![
                pb::PartitionRange {
                    partition: 0,
                    first_offset: 0,
                    last_offset: 1,
                    count: 2
                },
                pb::PartitionRange {
                    partition: 1,
                    first_offset: 5,
                    last_offset: 7,
                    count: 3
                },
            ]
        );
    }

    #[test]
    fn topic_reads_keep_every_field_and_header_order() {
        let record = |offset: u64, key: Option<&'static [u8]>| Record {
            partition: 2,
            offset,
            timestamp_ms: 1_000 + offset as i64,
            key: key.map(Bytes::from_static),
            value: Bytes::from(format!("v{offset}")),
            headers: vec![
                ("b".to_string(), Bytes::from_static(b"2")),
                ("a".to_string(), Bytes::from_static(b"1")),
                ("b".to_string(), Bytes::from_static(b"3")),
            ],
        };
        let response = topic_read(
            "app-p-dlq".into(),
            2,
            TopicRead {
                records: vec![record(5, Some(b"k")), record(6, None)],
                start_offset: 3,
                end_offset: 9,
                partitions: 4,
            },
        );
        assert_eq!((response.topic.as_str(), response.partition), ("app-p-dlq", 2));
        assert_eq!((response.start_offset, response.end_offset), (3, 9));
        assert_eq!(response.partitions, 4);
        let first = &response.records[0];
        assert_eq!((first.partition, first.offset, first.timestamp_ms), (2, 5, 1_005));
        assert_eq!(first.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(first.value, Bytes::from_static(b"v5"));
        let headers: Vec<(&str, &[u8])> = first
            .headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.as_ref()))
            .collect();
        assert_eq!(headers, vec![("b", &b"2"[..]), ("a", b"1"), ("b", b"3")]);
        assert_eq!(response.records[1].key, None);
    }

    #[test]
    fn offsets_saturate_instead_of_wrapping() {
        assert_eq!(offset(7), 7);
        assert_eq!(offset(u64::MAX), i64::MAX);
    }
}
