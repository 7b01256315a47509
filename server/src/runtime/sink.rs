//! A task's output records on their way to its pipeline's sink topic. Outputs
//! of completed records are released in the pipeline's order — by source
//! offset once the watermark passes them (`offset` order with several
//! threads: `SinkHold`), else as each unit completes (a key's units run one
//! at a time, so a key's outputs keep its order) — into the task's
//! `SinkQueue`, whose records are appended by one thread at a time in queue
//! order. Every commit drains the queue first, and the log is flushed before
//! the commit is written, so a committed watermark never covers a record
//! whose outputs are not in the log: delivery is at-least-once.

use super::shared::Shared;
use crate::log::ProducerRecord;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Outputs of records completed above the watermark, held by source offset
/// until it passes them. Lives in the task, under the scheduler's lock.
#[derive(Default)]
pub(crate) struct SinkHold {
    held: BTreeMap<u64, Vec<ProducerRecord>>,
}

impl SinkHold {
    pub(crate) fn hold(&mut self, offset: u64, outputs: Vec<ProducerRecord>) {
        if !outputs.is_empty() {
            self.held.insert(offset, outputs);
        }
    }

    /// Moves the outputs of every offset below `watermark` to `queue`, in offset order.
    pub(crate) fn release_below(&mut self, watermark: u64, queue: &SinkQueue) {
        if self
            .held
            .first_key_value()
            .is_none_or(|(&first, _)| first >= watermark)
        {
            return;
        }
        let above = self.held.split_off(&watermark);
        let released = std::mem::replace(&mut self.held, above);
        queue.push(released.into_values().flatten());
    }

    #[cfg(test)]
    fn held_records(&self) -> usize {
        self.held.values().map(Vec::len).sum()
    }
}

/// Released outputs of one task, waiting to be appended to the sink topic.
pub(crate) struct SinkQueue {
    topic: Arc<str>,
    /// exactly_once_v2: the task's transactional id; outputs go into its
    /// transaction, committed with the offsets of their records.
    transaction: Option<String>,
    /// Invariant: records are in release order; whoever appends takes them
    /// from the front while holding `appending`.
    queue: Mutex<VecDeque<ProducerRecord>>,
    /// Held while appending, so two threads never append out of queue order.
    appending: Mutex<()>,
    /// The task's transaction aborted (see `revival`): what is queued, or
    /// released later by units still finishing, belongs to it and must not
    /// reach the transaction the revived task opens under the same id.
    discarded: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl SinkQueue {
    pub(crate) fn new(topic: Arc<str>, transaction: Option<String>) -> SinkQueue {
        SinkQueue {
            topic,
            transaction,
            queue: Mutex::new(VecDeque::new()),
            appending: Mutex::new(()),
            discarded: AtomicBool::new(false),
        }
    }

    pub(crate) fn push(&self, outputs: impl IntoIterator<Item = ProducerRecord>) {
        if self.discarded.load(Ordering::Acquire) {
            return;
        }
        lock(&self.queue).extend(outputs);
    }

    /// The task's transaction aborted: drops what is queued, and everything
    /// pushed from now on.
    pub(crate) fn discard(&self) {
        self.discarded.store(true, Ordering::Release);
        lock(&self.queue).clear();
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        lock(&self.queue).is_empty()
    }

    /// Appends everything queued (without an fsync: a commit flushes the log
    /// before it covers them). While the log cannot write, waits for it to
    /// heal (see `process::append_failed`); records it refuses for good go
    /// back to the front of the queue and the error is answered, so a commit
    /// that needs them fails instead of losing them.
    pub(crate) fn drain(&self, shared: &Shared) -> Result<(), String> {
        let _appending = lock(&self.appending);
        if self.discarded.load(Ordering::Acquire) {
            lock(&self.queue).clear();
            return Ok(());
        }
        let records: Vec<ProducerRecord> = lock(&self.queue).drain(..).collect();
        if records.is_empty() {
            return Ok(());
        }
        let appended = match (&self.transaction, shared.log.as_kafka()) {
            (Some(id), Some(kafka)) => kafka
                .append_in_transaction(id, &self.topic, &records)
                .map(drop)
                .map_err(|e| e.to_string()),
            _ => {
                super::process::append_with_backoff(shared, &self.topic, &records).map_err(|e| e.to_string())
            }
        };
        appended.map_err(|error| {
            let mut queue = lock(&self.queue);
            for record in records.into_iter().rev() {
                queue.push_front(record);
            }
            format!("could not append outputs to sink topic `{}`: {error}", self.topic)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(value: &str) -> ProducerRecord {
        ProducerRecord {
            value: bytes::Bytes::copy_from_slice(value.as_bytes()),
            ..ProducerRecord::default()
        }
    }

    fn values(queue: &SinkQueue) -> Vec<String> {
        lock(&queue.queue)
            .iter()
            .map(|r| String::from_utf8_lossy(&r.value).into_owned())
            .collect()
    }

    /// A task whose transaction aborted: its outputs, queued or released by
    /// units still finishing, never reach the revived task's transaction.
    #[test]
    fn a_discarded_queue_drops_what_it_holds_and_everything_pushed_after() {
        let queue = SinkQueue::new("out".into(), Some("app-task".into()));
        queue.push(vec![output("1")]);
        queue.discard();
        assert!(queue.is_empty());
        queue.push(vec![output("2")]);
        assert!(queue.is_empty(), "pushed after the discard");
    }

    #[test]
    fn held_outputs_are_released_in_offset_order_below_the_watermark() {
        let queue = SinkQueue::new("out".into(), None);
        let mut hold = SinkHold::default();
        hold.hold(7, vec![output("7a"), output("7b")]);
        hold.hold(5, vec![output("5")]);
        hold.hold(6, vec![]);
        hold.hold(9, vec![output("9")]);
        hold.release_below(5, &queue);
        assert!(queue.is_empty(), "nothing below 5");
        hold.release_below(8, &queue);
        assert_eq!(values(&queue), ["5", "7a", "7b"]);
        assert_eq!(hold.held_records(), 1);
        hold.release_below(10, &queue);
        assert_eq!(values(&queue), ["5", "7a", "7b", "9"]);
        assert_eq!(hold.held_records(), 0);
    }
}
