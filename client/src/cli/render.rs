//! Human output: aligned tables and one-line summaries for people at a
//! terminal. Scripts should use `--json`; this format may change.

use std::fmt::Write as _;

use taskstream_client::{MetadataBatch, v1};

use super::{enum_name, text};

/// A table with left-aligned columns separated by two spaces.
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&'static str]) -> Self {
        Table {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.len()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let header: Vec<String> = self.headers.iter().map(|h| (*h).to_owned()).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
                if i + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    let _ = write!(line, "{cell:<width$}  ");
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// "1 record", "2 records".
fn records(n: u64) -> String {
    if n == 1 {
        "1 record".to_owned()
    } else {
        format!("{n} records")
    }
}

fn dash_if_empty(value: String) -> String {
    if value.is_empty() { "-".to_owned() } else { value }
}

fn host(host: Option<&v1::HostInfo>) -> String {
    host.map_or_else(|| "-".to_owned(), |h| format!("{}:{}", h.host, h.port))
}

/// "events-0..3, other-1": partitions grouped per topic, consecutive ones as ranges.
fn topic_partitions(tps: &[v1::TopicPartition]) -> String {
    let mut by_topic: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
    for tp in tps {
        by_topic.entry(tp.topic.as_str()).or_default().push(tp.partition);
    }
    let mut parts = Vec::new();
    for (topic, mut partitions) in by_topic {
        partitions.sort_unstable();
        partitions.dedup();
        let mut i = 0;
        while i < partitions.len() {
            let start = partitions[i];
            let mut end = start;
            while i + 1 < partitions.len() && partitions[i + 1] == end + 1 {
                i += 1;
                end = partitions[i];
            }
            parts.push(if start == end {
                format!("{topic}-{start}")
            } else {
                format!("{topic}-{start}..{end}")
            });
            i += 1;
        }
    }
    dash_if_empty(parts.join(", "))
}

pub fn task_table<'a>(tasks: impl IntoIterator<Item = &'a v1::TaskMetadata>) -> String {
    let mut table = Table::new(&[
        "TASK",
        "STATE",
        "OWNER",
        "HELPERS",
        "ORDER",
        "T",
        "WATERMARK",
        "COMMITTED",
        "END",
        "LAG",
        "IN-FLIGHT",
        "RETRY",
        "PROCESSED",
        "FAILED",
    ]);
    for task in tasks {
        table.row(vec![
            task.task_id.clone(),
            enum_name(task.state().as_str_name()),
            dash_if_empty(task.owner_thread.clone()),
            dash_if_empty(task.helper_threads.join(",")),
            enum_name(task.processing_order().as_str_name()),
            task.threads_per_task.to_string(),
            task.watermark.to_string(),
            task.committed_offset.to_string(),
            task.end_offset.to_string(),
            task.lag.to_string(),
            task.in_flight.to_string(),
            task.retry_backlog.to_string(),
            task.records_processed.to_string(),
            task.records_failed.to_string(),
        ]);
    }
    table.render()
}

pub fn store_metadata(store: &str, response: &v1::ProcessMetadataForStoreResponse) -> String {
    let mut out = format!(
        "store {store}: {} order, {} threads per task, results in offset order: {}\n",
        enum_name(response.processing_order().as_str_name()),
        response.threads_per_task,
        if response.in_order { "yes" } else { "no" },
    );
    for instance in &response.metadata {
        let _ = writeln!(
            out,
            "\ninstance {}  stores: {}  partitions: {}  standby: {}",
            host(instance.host_info.as_ref()),
            dash_if_empty(instance.state_store_names.join(",")),
            topic_partitions(&instance.topic_partitions),
            topic_partitions(&instance.standby_topic_partitions),
        );
        // Another instance of a Kafka application: its tasks are its own to describe.
        if instance.tasks.is_empty() && !instance.topic_partitions.is_empty() {
            out.push_str("(its tasks: ask that instance)\n");
            continue;
        }
        let mut tasks: Vec<&v1::TaskMetadata> = instance.tasks.iter().collect();
        tasks.sort_by_key(|t| (t.pipeline.clone(), t.partition));
        out.push_str(&task_table(tasks));
    }
    if response.metadata.is_empty() {
        out.push_str("no instance hosts this store right now\n");
    }
    out
}

pub fn key_metadata(key: &str, response: &v1::MetadataForKeyResponse) -> String {
    let standby: Vec<String> = response.standby_hosts.iter().map(|h| host(Some(h))).collect();
    format!(
        "key {key} of store {}: topic {} partition {} (task {}), active host {}, standby {}\n",
        response.store,
        response.topic,
        response.partition,
        response.task_id,
        host(response.active_host.as_ref()),
        dash_if_empty(standby.join(",")),
    )
}

/// One line per streamed batch: task, thread, offsets, count (failures when any).
pub fn batch(batch: &MetadataBatch) -> String {
    let failed = batch.records.iter().filter(|r| r.is_failed()).count();
    let failed = if failed > 0 {
        format!("  {failed} failed")
    } else {
        String::new()
    };
    match batch.range() {
        Some(range) => format!(
            "{}  {}  offsets {}..={}  {}{failed}",
            range.task_id,
            range.thread,
            range.first_offset,
            range.last_offset,
            records(batch.records.len() as u64)
        ),
        None => format!("{}  {}{failed}", batch.store, records(batch.records.len() as u64)),
    }
}

pub fn produce(response: &v1::ProduceResponse) -> String {
    let mut out = format!(
        "produced {} to {}\n",
        records(response.record_count),
        response.topic
    );
    let mut partitions = response.partitions.clone();
    partitions.sort_by_key(|p| p.partition);
    for p in partitions {
        let _ = writeln!(
            out,
            "  partition {}: offsets {}..={} ({})",
            p.partition,
            p.first_offset,
            p.last_offset,
            records(p.count)
        );
    }
    out
}

/// One line per record, `partition/offset  key  value` (`-` for no key), its
/// headers indented below it, then where the partition starts and ends.
pub fn topic_read(response: &v1::ReadTopicResponse) -> String {
    let mut out = String::new();
    for record in &response.records {
        let key = record.key.as_ref().map_or_else(|| "-".to_owned(), text);
        let _ = writeln!(
            out,
            "{}/{}  {key}  {}",
            record.partition,
            record.offset,
            text(&record.value)
        );
        for header in &record.headers {
            let _ = writeln!(out, "  {}: {}", header.name, text(&header.value));
        }
    }
    let _ = write!(
        out,
        "{}-{}: {}; start offset {}, end offset {}",
        response.topic,
        response.partition,
        records(response.records.len() as u64),
        response.start_offset,
        response.end_offset
    );
    // A page: say where the next one starts.
    if let Some(last) = response.records.last()
        && last.offset + 1 < response.end_offset
    {
        let _ = write!(out, "; more from offset {}", last.offset + 1);
    }
    out.push('\n');
    out
}

pub fn describe(response: &v1::DescribeRuntimeResponse) -> String {
    let mut out = format!(
        "application {}  host {}  state {}  stream threads {} ({} in reserve, {} on retries)\n\n",
        response.application_id,
        host(response.host_info.as_ref()),
        enum_name(response.state().as_str_name()),
        response.num_stream_threads,
        response.num_reserve_threads,
        response.num_retry_threads,
    );
    let mut threads = Table::new(&["THREAD", "STATE", "CURRENT TASK", "OWNED TASKS", "PROCESSED"]);
    for thread in &response.threads {
        threads.row(vec![
            thread.name.clone(),
            enum_name(thread.state().as_str_name()),
            dash_if_empty(thread.current_task.clone()),
            dash_if_empty(thread.owned_tasks.join(",")),
            thread.records_processed.to_string(),
        ]);
    }
    out.push_str(&threads.render());
    out.push('\n');
    let mut pipelines = Table::new(&[
        "PIPELINE",
        "SOURCE",
        "PARTITIONS",
        "PROCESSOR",
        "ORDER",
        "T",
        "STORE",
        "RETRY POLICY",
        "RETRY BACKLOG",
        "DEAD-LETTERED",
    ]);
    for p in &response.pipelines {
        pipelines.row(vec![
            p.name.clone(),
            p.source_topic.clone(),
            p.partitions.to_string(),
            p.processor.clone(),
            enum_name(p.processing_order().as_str_name()),
            p.threads_per_task.to_string(),
            format!("{} ({})", p.store, p.store_kind),
            p.retry_policy.clone(),
            p.retry_backlog.to_string(),
            p.dead_lettered.to_string(),
        ]);
    }
    out.push_str(&pipelines.render());
    out.push('\n');
    out.push_str(&task_table(&response.tasks));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let mut table = Table::new(&["A", "LONGER"]);
        table.row(vec!["wide-cell".into(), "x".into()]);
        assert_eq!(table.render(), "A          LONGER\nwide-cell  x\n");
    }

    #[test]
    fn topic_read_lists_records_with_headers_then_the_offsets() {
        let header = |name: &str, value: &'static [u8]| v1::Header {
            name: name.into(),
            value: value.into(),
        };
        let mut response = v1::ReadTopicResponse {
            topic: "app-counts-dlq".into(),
            partition: 2,
            records: vec![
                v1::TopicRecord {
                    partition: 2,
                    offset: 4,
                    key: Some("alice".into()),
                    value: "1".into(),
                    headers: vec![
                        header("__streams.errors.exception", b"Boom"),
                        header("h", b"\xff"),
                    ],
                    ..Default::default()
                },
                v1::TopicRecord {
                    partition: 2,
                    offset: 5,
                    value: "x".into(),
                    ..Default::default()
                },
            ],
            start_offset: 3,
            end_offset: 6,
            partitions: 4,
        };
        assert_eq!(
            topic_read(&response),
            "2/4  alice  1\n  __streams.errors.exception: Boom\n  h: \u{fffd}\n2/5  -  x\n\
             app-counts-dlq-2: 2 records; start offset 3, end offset 6\n"
        );
        response.end_offset = 9;
        assert!(topic_read(&response).ends_with("end offset 9; more from offset 6\n"));
        response.records.clear();
        assert_eq!(
            topic_read(&response),
            "app-counts-dlq-2: 0 records; start offset 3, end offset 9\n"
        );
    }

    #[test]
    fn partitions_as_ranges() {
        let tps: Vec<v1::TopicPartition> = [0, 1, 2, 5, 7, 6]
            .into_iter()
            .map(|partition| v1::TopicPartition {
                topic: "events".into(),
                partition,
            })
            .collect();
        assert_eq!(topic_partitions(&tps), "events-0..2, events-5..7");
        assert_eq!(topic_partitions(&[]), "-");
    }
}
