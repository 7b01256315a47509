//! `--json` output: serde_json values built by hand from the proto types
//! (which carry no serde derives). Field names are the proto field names;
//! enums are their short lowercase names; bytes are UTF-8 strings (lossy).

use bytes::Bytes;
use serde_json::{Value, json};
use taskstream_client::{MetadataBatch, RecordMetadata, v1};

use super::{enum_name, text};

pub fn bytes(value: &Bytes) -> Value {
    Value::String(text(value))
}

pub fn opt_bytes(value: Option<&Bytes>) -> Value {
    value.map_or(Value::Null, bytes)
}

fn host(host: Option<&v1::HostInfo>) -> Value {
    host.map_or(Value::Null, |h| json!({ "host": h.host, "port": h.port }))
}

fn topic_partitions(tps: &[v1::TopicPartition]) -> Value {
    tps.iter()
        .map(|tp| json!({ "topic": tp.topic, "partition": tp.partition }))
        .collect()
}

pub fn task(task: &v1::TaskMetadata) -> Value {
    json!({
        "task_id": task.task_id,
        "pipeline": task.pipeline,
        "topic": task.topic,
        "partition": task.partition,
        "state": enum_name(task.state().as_str_name()),
        "owner_thread": task.owner_thread,
        "helper_threads": task.helper_threads,
        "processing_order": enum_name(task.processing_order().as_str_name()),
        "threads_per_task": task.threads_per_task,
        "watermark": task.watermark,
        "committed_offset": task.committed_offset,
        "end_offset": task.end_offset,
        "lag": task.lag,
        "in_flight": task.in_flight,
        "retry_backlog": task.retry_backlog,
        "records_processed": task.records_processed,
        "records_failed": task.records_failed,
        "records_dead_lettered": task.records_dead_lettered,
    })
}

pub fn store_metadata(store: &str, response: &v1::ProcessMetadataForStoreResponse) -> Value {
    let instances: Vec<Value> = response
        .metadata
        .iter()
        .map(|m| {
            json!({
                "host_info": host(m.host_info.as_ref()),
                "state_store_names": m.state_store_names,
                "topic_partitions": topic_partitions(&m.topic_partitions),
                "standby_topic_partitions": topic_partitions(&m.standby_topic_partitions),
                "tasks": m.tasks.iter().map(task).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "store": store,
        "processing_order": enum_name(response.processing_order().as_str_name()),
        "threads_per_task": response.threads_per_task,
        "in_order": response.in_order,
        "metadata": instances,
    })
}

pub fn key_metadata(key: &str, response: &v1::MetadataForKeyResponse) -> Value {
    json!({
        "store": response.store,
        "key": key,
        "topic": response.topic,
        "partition": response.partition,
        "task_id": response.task_id,
        "active_host": host(response.active_host.as_ref()),
        "standby_hosts": response.standby_hosts.iter().map(|h| host(Some(h))).collect::<Vec<_>>(),
    })
}

fn record(record: &RecordMetadata) -> Value {
    json!({
        "partition": record.partition,
        "offset": record.offset,
        "key": opt_bytes(record.key.as_ref()),
        "timestamp_ms": record.timestamp_ms,
        "outcome": enum_name(record.outcome.as_str_name()),
        "attempts": record.attempts,
        "error": record.error,
    })
}

/// One streamed batch of `watch` (per-batch mode: one range).
pub fn batch(batch: &MetadataBatch) -> Value {
    let range = batch.range();
    json!({
        "store": batch.store,
        "task_id": range.map(|r| r.task_id.as_str()),
        "topic": range.map(|r| r.topic.as_str()),
        "partition": range.map(|r| r.partition),
        "thread": range.map(|r| r.thread.as_str()),
        "first_offset": range.map(|r| r.first_offset),
        "last_offset": range.map(|r| r.last_offset),
        "count": batch.records.len(),
        "records": batch.records.iter().map(record).collect::<Vec<_>>(),
    })
}

pub fn produce(response: &v1::ProduceResponse) -> Value {
    let partitions: Vec<Value> = response
        .partitions
        .iter()
        .map(|p| {
            json!({
                "partition": p.partition,
                "first_offset": p.first_offset,
                "last_offset": p.last_offset,
                "count": p.count,
            })
        })
        .collect();
    let positions: Vec<Value> = response
        .positions
        .iter()
        .map(|p| json!({ "partition": p.partition, "offset": p.offset }))
        .collect();
    json!({
        "topic": response.topic,
        "record_count": response.record_count,
        "partitions": partitions,
        "positions": positions,
    })
}

/// The partitions read, as `{topic, partitions: [...]}` with one
/// [`topic_read`] per partition, in partition order.
pub fn topic_reads(answers: &[v1::ReadTopicResponse]) -> Value {
    json!({
        "topic": answers.first().map(|a| a.topic.as_str()),
        "partitions": answers.iter().map(topic_read).collect::<Vec<_>>(),
    })
}

/// Headers as a list of `{name, value}`: they keep their order and may repeat.
pub fn topic_read(response: &v1::ReadTopicResponse) -> Value {
    let records: Vec<Value> = response
        .records
        .iter()
        .map(|r| {
            json!({
                "partition": r.partition,
                "offset": r.offset,
                "timestamp_ms": r.timestamp_ms,
                "key": opt_bytes(r.key.as_ref()),
                "value": bytes(&r.value),
                "headers": r.headers.iter()
                    .map(|h| json!({ "name": h.name, "value": bytes(&h.value) }))
                    .collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "topic": response.topic,
        "partition": response.partition,
        "start_offset": response.start_offset,
        "end_offset": response.end_offset,
        "records": records,
    })
}

pub fn describe(response: &v1::DescribeRuntimeResponse) -> Value {
    let threads: Vec<Value> = response
        .threads
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "state": enum_name(t.state().as_str_name()),
                "owned_tasks": t.owned_tasks,
                "current_task": t.current_task,
                "records_processed": t.records_processed,
            })
        })
        .collect();
    let pipelines: Vec<Value> = response
        .pipelines
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "source_topic": p.source_topic,
                "partitions": p.partitions,
                "processor": p.processor,
                "processing_order": enum_name(p.processing_order().as_str_name()),
                "threads_per_task": p.threads_per_task,
                "store": p.store,
                "store_kind": p.store_kind,
                "retry_policy": p.retry_policy,
                "retry_topic": p.retry_topic,
                "dead_letter_topic": p.dead_letter_topic,
                "retry_backlog": p.retry_backlog,
                "dead_lettered": p.dead_lettered,
            })
        })
        .collect();
    json!({
        "application_id": response.application_id,
        "host_info": host(response.host_info.as_ref()),
        "state": enum_name(response.state().as_str_name()),
        "num_stream_threads": response.num_stream_threads,
        "num_reserve_threads": response.num_reserve_threads,
        "num_retry_threads": response.num_retry_threads,
        "threads": threads,
        "pipelines": pipelines,
        "tasks": response.tasks.iter().map(task).collect::<Vec<_>>(),
    })
}
