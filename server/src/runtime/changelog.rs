//! A store's changelog on Kafka: the compacted topic
//! `<application_id>-<store>-changelog`, whose partition p belongs to task p.
//! What a commit covers reaches it before the commit is written (a persistent
//! store sends its frozen commit; a memory store the current value of every
//! key it wrote since its last send), and a task added on an instance restores
//! its store from it. Its partitions are read by manual assignment, never
//! through the group.

use super::shared::Shared;
use super::stores::TaskStore;
use crate::log::{KafkaLog, LogError};
use crate::store::Write;
use bytes::Bytes;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// Changelog records restored per step (the task's lease is released between steps).
const RESTORE_CHUNK: usize = 2_000;

/// The changelog partition of one task's store.
pub(crate) struct Changelog {
    topic: Arc<str>,
    partition: u32,
    /// Keys a memory store wrote since their values were last sent. Sent in
    /// key order; a persistent store leaves it empty (it sends its frozen
    /// commit instead).
    written: Mutex<BTreeSet<Bytes>>,
}

impl Changelog {
    pub(crate) fn new(topic: Arc<str>, partition: u32) -> Changelog {
        Changelog {
            topic,
            partition,
            written: Mutex::new(BTreeSet::new()),
        }
    }

    pub(crate) fn topic(&self) -> &Arc<str> {
        &self.topic
    }

    pub(crate) fn partition(&self) -> u32 {
        self.partition
    }

    /// Remembers the keys of writes a memory store applied, to send at the next commit.
    pub(crate) fn note_written(&self, writes: &[Write]) {
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        written.extend(writes.iter().map(|(key, _)| key.clone()));
    }

    /// Sends the current value (or a tombstone) of every key noted since the
    /// last send, waits until they are durable, then calls `seal`. The
    /// caller serialises sends (the commit lock), so a later value of a key
    /// never lands before an earlier one. If the send or `seal` fails, the
    /// keys stay noted for the next commit.
    pub(crate) fn send_written(
        &self,
        kafka: &KafkaLog,
        current: impl Fn(&[u8]) -> Option<Bytes>,
        seal: &dyn Fn() -> Result<(), String>,
    ) -> Result<(), String> {
        let keys = std::mem::take(&mut *self.written.lock().unwrap_or_else(|e| e.into_inner()));
        let writes: Vec<Write> = keys.iter().map(|key| (key.clone(), current(key))).collect();
        let sent = kafka
            .append_changelog(&self.topic, self.partition, &writes)
            .map_err(|e| format!("cannot write the changelog: {e}"))
            .and_then(|_| seal());
        if sent.is_err() {
            self.written
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(keys);
        }
        sent
    }

    /// Sends `writes` (a persistent store's frozen commit) and waits until
    /// they are durable; answers the offset after them (`None`: nothing sent).
    pub(crate) fn send(&self, kafka: &KafkaLog, writes: &[Write]) -> Result<Option<u64>, LogError> {
        kafka.append_changelog(&self.topic, self.partition, writes)
    }
}

/// One restore step of a task's store from its changelog: the records in
/// `[from, until)` (at most a chunk) applied to the store. Answers the offset
/// to go on from; at `until` the partition is released from the reader.
pub(crate) fn restore_chunk(
    shared: &Shared,
    store: &TaskStore,
    from: u64,
    until: u64,
) -> Result<u64, String> {
    let (Some(kafka), Some(changelog)) = (shared.log.as_kafka(), store.changelog()) else {
        return Err("a changelog restore without a changelog on Kafka".to_string());
    };
    let max = ((until - from) as usize).min(RESTORE_CHUNK);
    let mut records = Vec::with_capacity(max);
    kafka
        .read_changelog(changelog.topic(), changelog.partition(), from, max, &mut records)
        .map_err(|e| e.to_string())?;
    let mut writes = Vec::with_capacity(records.len());
    let mut next = from;
    for (offset, write) in records {
        if offset >= until {
            break;
        }
        next = offset + 1;
        writes.push(write);
    }
    // An empty read below `until` means the records there are gone
    // (compacted or deleted meanwhile): nothing more to restore.
    if writes.is_empty() {
        next = until;
    }
    store.restore(&writes, next).map_err(|e| e.to_string())?;
    if next >= until {
        kafka.release(&[(changelog.topic().to_string(), changelog.partition())]);
    }
    Ok(next)
}
