//! The embedded in-memory log: topics of partitions held by the server itself,
//! one `RwLock` per partition so readers of different partitions never meet.

use super::{
    AppendListener, Log, LogError, ProducerRecord, Record, RecordPosition, Retention, partition_for_key,
    record_size,
};
use bytes::{Bytes, BytesMut};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// The keys and values of a batch for one partition, copied into one buffer
/// that its records share. The log then keeps no producer's buffer alive (a
/// request's, or a key shared by many records), and a reader meets records
/// laid out one after another whose clones and drops all count on one hot
/// header: with the producer's buffers, each record's key was a cold header
/// to count on, 12 % of a stream thread's time in bench `floor`.
fn pack(mut batch: Vec<(usize, ProducerRecord)>) -> Vec<(usize, ProducerRecord)> {
    let size: usize = batch
        .iter()
        .map(|(_, r)| r.key.as_ref().map_or(0, Bytes::len) + r.value.len())
        .sum();
    let mut buffer = BytesMut::with_capacity(size);
    for (_, record) in &batch {
        if let Some(key) = &record.key {
            buffer.extend_from_slice(key);
        }
        buffer.extend_from_slice(&record.value);
    }
    let buffer = buffer.freeze();
    let mut at = 0;
    let mut take = |len: usize| {
        let part = buffer.slice(at..at + len);
        at += len;
        part
    };
    for (_, record) in &mut batch {
        if let Some(key) = &mut record.key {
            *key = take(key.len());
        }
        record.value = take(record.value.len());
    }
    batch
}

#[derive(Default)]
struct PartitionLog {
    /// Offset of `records[0]`.
    start_offset: u64,
    records: VecDeque<Record>,
    /// `record_size` summed over `records`.
    bytes: u64,
}

impl PartitionLog {
    fn end_offset(&self) -> u64 {
        self.start_offset + self.records.len() as u64
    }
}

struct Topic {
    partitions: Vec<RwLock<PartitionLog>>,
    /// Round-robin cursor for records without key or partition.
    next_unkeyed: AtomicU32,
}

/// An in-memory `Log`. Cheap to share: clone the `Arc`.
#[derive(Default)]
pub struct MemoryLog {
    topics: RwLock<HashMap<String, Arc<Topic>>>,
    committed: Mutex<HashMap<(String, String, u32), u64>>,
    listeners: RwLock<Vec<AppendListener>>,
}

impl MemoryLog {
    pub fn new() -> Arc<MemoryLog> {
        Arc::new(MemoryLog::default())
    }

    fn topic(&self, topic: &str) -> Result<Arc<Topic>, LogError> {
        self.topics
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(topic)
            .cloned()
            .ok_or_else(|| LogError::UnknownTopic(topic.to_string()))
    }

    fn partition<'t>(
        topic_name: &str,
        topic: &'t Topic,
        partition: u32,
    ) -> Result<&'t RwLock<PartitionLog>, LogError> {
        topic
            .partitions
            .get(partition as usize)
            .ok_or_else(|| LogError::UnknownPartition {
                topic: topic_name.to_string(),
                partition,
                partitions: topic.partitions.len() as u32,
            })
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Log for MemoryLog {
    fn ensure_topic(&self, topic: &str, partitions: u32) -> Result<(), LogError> {
        let mut topics = self.topics.write().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = topics.get(topic) {
            let existing = existing.partitions.len() as u32;
            if existing != partitions {
                return Err(LogError::PartitionCountMismatch {
                    topic: topic.to_string(),
                    existing,
                    requested: partitions,
                });
            }
            return Ok(());
        }
        topics.insert(
            topic.to_string(),
            Arc::new(Topic {
                partitions: (0..partitions).map(|_| RwLock::default()).collect(),
                next_unkeyed: AtomicU32::new(0),
            }),
        );
        Ok(())
    }

    fn partitions(&self, topic: &str) -> Result<u32, LogError> {
        Ok(self.topic(topic)?.partitions.len() as u32)
    }

    fn append(
        &self,
        topic_name: &str,
        records: Vec<ProducerRecord>,
    ) -> Result<Vec<RecordPosition>, LogError> {
        let topic = self.topic(topic_name)?;
        let count = topic.partitions.len() as u32;
        // Route first so a bad partition rejects the whole batch before anything is written.
        let mut routed = Vec::with_capacity(records.len());
        for record in &records {
            let partition = match (record.partition, &record.key) {
                (Some(p), _) => {
                    Self::partition(topic_name, &topic, p)?;
                    p
                }
                (None, Some(key)) => partition_for_key(key, count),
                (None, None) => topic.next_unkeyed.fetch_add(1, Ordering::Relaxed) % count,
            };
            routed.push(partition);
        }
        let now = now_ms();
        let mut positions = vec![
            RecordPosition {
                partition: 0,
                offset: 0
            };
            records.len()
        ];
        // Group by partition so each partition lock is taken once per batch.
        let mut by_partition: Vec<Vec<(usize, ProducerRecord)>> = (0..count).map(|_| Vec::new()).collect();
        for (index, (record, partition)) in records.into_iter().zip(routed).enumerate() {
            by_partition[partition as usize].push((index, record));
        }
        let mut touched = Vec::new();
        for (partition, batch) in by_partition.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            let partition = partition as u32;
            let batch = pack(batch);
            let mut log = topic.partitions[partition as usize]
                .write()
                .unwrap_or_else(|e| e.into_inner());
            for (index, record) in batch {
                let offset = log.end_offset();
                log.bytes += record_size(record.key.as_deref(), &record.value, &record.headers);
                log.records.push_back(Record {
                    partition,
                    offset,
                    timestamp_ms: record.timestamp_ms.unwrap_or(now),
                    key: record.key,
                    value: record.value,
                    headers: record.headers,
                });
                positions[index] = RecordPosition { partition, offset };
            }
            touched.push(partition);
        }
        let listeners = self.listeners.read().unwrap_or_else(|e| e.into_inner());
        for partition in touched {
            for listener in listeners.iter() {
                listener(topic_name, partition);
            }
        }
        Ok(positions)
    }

    fn read(
        &self,
        topic_name: &str,
        partition: u32,
        offset: u64,
        max: usize,
        out: &mut Vec<Record>,
    ) -> Result<(), LogError> {
        let topic = self.topic(topic_name)?;
        let log = Self::partition(topic_name, &topic, partition)?
            .read()
            .unwrap_or_else(|e| e.into_inner());
        if offset < log.start_offset {
            return Err(LogError::OffsetOutOfRange {
                topic: topic_name.to_string(),
                partition,
                requested: offset,
                earliest: log.start_offset,
            });
        }
        let first = (offset - log.start_offset) as usize;
        if first >= log.records.len() {
            return Ok(());
        }
        let last = log.records.len().min(first.saturating_add(max));
        out.extend(log.records.range(first..last).cloned());
        Ok(())
    }

    fn end_offset(&self, topic_name: &str, partition: u32) -> Result<u64, LogError> {
        // Under the map's read lock rather than with a clone of the topic's `Arc`:
        // metadata asks this for every task on every call, from every worker at
        // once, and each count on that shared `Arc` would be a cache miss.
        let topics = self.topics.read().unwrap_or_else(|e| e.into_inner());
        let topic = topics
            .get(topic_name)
            .ok_or_else(|| LogError::UnknownTopic(topic_name.to_string()))?;
        let log = Self::partition(topic_name, topic, partition)?
            .read()
            .unwrap_or_else(|e| e.into_inner());
        Ok(log.end_offset())
    }

    fn start_offset(&self, topic_name: &str, partition: u32) -> Result<u64, LogError> {
        let topic = self.topic(topic_name)?;
        let log = Self::partition(topic_name, &topic, partition)?
            .read()
            .unwrap_or_else(|e| e.into_inner());
        Ok(log.start_offset)
    }

    fn commit(&self, group: &str, topic: &str, partition: u32, offset: u64) -> Result<(), LogError> {
        let topic_ref = self.topic(topic)?;
        Self::partition(topic, &topic_ref, partition)?;
        self.committed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((group.to_string(), topic.to_string(), partition), offset);
        Ok(())
    }

    fn committed(&self, group: &str, topic: &str, partition: u32) -> Result<Option<u64>, LogError> {
        let topic_ref = self.topic(topic)?;
        Self::partition(topic, &topic_ref, partition)?;
        Ok(self
            .committed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(group.to_string(), topic.to_string(), partition))
            .copied())
    }

    fn add_append_listener(&self, listener: AppendListener) {
        self.listeners
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(listener);
    }

    fn enforce_retention(
        &self,
        topic_name: &str,
        partition: u32,
        retention: Retention,
        keep_from: u64,
        now_ms: i64,
    ) -> Result<u64, LogError> {
        let topic = self.topic(topic_name)?;
        let mut log = Self::partition(topic_name, &topic, partition)?
            .write()
            .unwrap_or_else(|e| e.into_inner());
        let oldest_kept = retention
            .max_age_ms
            .map(|age| now_ms.saturating_sub(age.min(i64::MAX as u64) as i64));
        while let Some(first) = log.records.front() {
            let too_big = retention.max_bytes.is_some_and(|max| log.bytes > max);
            let too_old = oldest_kept.is_some_and(|oldest| first.timestamp_ms < oldest);
            if first.offset >= keep_from || !(too_big || too_old) {
                break;
            }
            log.bytes -= record_size(first.key.as_deref(), &first.value, &first.headers);
            log.records.pop_front();
            log.start_offset += 1;
        }
        Ok(log.start_offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_kept_in_one_buffer_of_the_log_and_reads_back_unchanged() {
        let log = MemoryLog::new();
        log.ensure_topic("t", 1).unwrap();
        let shared_key = Bytes::from_static(b"shared-key");
        let produced: Vec<ProducerRecord> = (0..5)
            .map(|i| ProducerRecord {
                key: (i != 2).then(|| {
                    if i % 2 == 0 {
                        shared_key.clone()
                    } else {
                        Bytes::from(format!("k{i}"))
                    }
                }),
                value: Bytes::from("v".repeat(i + 1)),
                headers: vec![("h".into(), Bytes::from_static(b"x"))],
                ..ProducerRecord::default()
            })
            .collect();
        log.append("t", produced.clone()).unwrap();
        let mut read = Vec::new();
        log.read("t", 0, 0, 10, &mut read).unwrap();
        assert_eq!(read.len(), produced.len());
        for (record, produced) in read.iter().zip(&produced) {
            assert_eq!(record.key, produced.key);
            assert_eq!(record.value, produced.value);
            assert_eq!(record.headers, produced.headers);
        }
        // Copied: no record points into the producer's buffers.
        assert_ne!(
            read[0].key.as_ref().map(|k| k.as_ptr()),
            Some(shared_key.as_ptr())
        );
        // One after another: each record's key starts where the last one's bytes end.
        let ends: Vec<usize> = read
            .iter()
            .map(|r| r.value.as_ptr() as usize + r.value.len())
            .collect();
        for (record, end) in read[1..].iter().zip(&ends) {
            let start = record.key.as_ref().unwrap_or(&record.value).as_ptr() as usize;
            assert_eq!(start, *end);
        }
    }

    #[test]
    fn keyed_records_follow_kafkas_partitioner_and_offsets_grow_per_partition() {
        super::super::contract::keyed_records_follow_kafkas_partitioner(MemoryLog::new().as_ref());
    }

    #[test]
    fn unkeyed_records_are_spread_and_bad_partitions_reject_the_whole_batch() {
        super::super::contract::unkeyed_records_are_spread_and_bad_batches_rejected_whole(
            MemoryLog::new().as_ref(),
        );
    }

    #[test]
    fn retention_removes_oldest_records_but_never_from_keep_from_on() {
        let log = MemoryLog::new();
        log.ensure_topic("t", 1).unwrap();
        let records = (0..10)
            .map(|i| ProducerRecord {
                value: vec![b'x'; 84].into(),
                partition: Some(0),
                timestamp_ms: Some(1_000 + i),
                ..Default::default()
            })
            .collect();
        log.append("t", records).unwrap();
        // Each record counts 100 bytes: keep 300 bytes, but offset 5 on is still needed.
        let by_size = Retention {
            max_bytes: Some(300),
            max_age_ms: None,
        };
        assert_eq!(log.enforce_retention("t", 0, by_size, 5, 0).unwrap(), 5);
        assert_eq!(log.enforce_retention("t", 0, by_size, 100, 0).unwrap(), 7);
        let mut out = Vec::new();
        assert!(matches!(
            log.read("t", 0, 6, 10, &mut out),
            Err(LogError::OffsetOutOfRange { earliest: 7, .. })
        ));
        // By age: at now = 1_009 with 1 ms, timestamps below 1_008 go.
        let by_age = Retention {
            max_bytes: None,
            max_age_ms: Some(1),
        };
        assert_eq!(log.enforce_retention("t", 0, by_age, 100, 1_009).unwrap(), 8);
        assert_eq!(log.end_offset("t", 0).unwrap(), 10);
    }

    #[test]
    fn commits_are_per_group_and_partition() {
        super::super::contract::commits_are_per_group_and_partition(MemoryLog::new().as_ref());
    }
}
