//! Subscriptions to record outcomes: each pipeline's feed (a bounded
//! broadcast the scheduler publishes to), and a subscriber's view of it — a
//! consistent replay of retained history followed by live batches, filtered
//! to the requested partitions and offset range, with lag reported in-band
//! and bounded ranges completing by themselves.

use super::RuntimeError;
use crate::metadata::OutcomeBatch;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;

/// Where a subscription starts, per partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StartAt {
    /// At each partition's watermark when subscribing.
    #[default]
    Latest,
    /// At the oldest retained outcome.
    Earliest,
    /// At these offsets; only these partitions are streamed.
    Offsets(BTreeMap<u32, u64>),
}

/// Where a subscription ends (exclusive), per partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum EndAt {
    /// Follow forever.
    #[default]
    Open,
    /// At each partition's end offset when subscribing.
    Current,
    /// At these offsets; only these partitions are streamed.
    Offsets(BTreeMap<u32, u64>),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubscribeRequest {
    /// Require offset order per partition (refused when the store cannot give it).
    pub in_order: bool,
    pub start: StartAt,
    pub end: EndAt,
    /// Only these partitions (empty = all).
    pub partitions: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubscriptionEvent {
    Batch(Arc<OutcomeBatch>),
    /// The subscriber was too slow; this many batches were dropped for it.
    Lagged {
        missed_batches: u64,
    },
}

/// Evicted batches a history keeps for `History::take_retired` at most;
/// past this it drops the oldest itself.
const MAX_RETIRED: usize = 64;

/// Retained outcome batches of one task, oldest first, bounded by record count.
pub(crate) struct History {
    batches: VecDeque<Arc<OutcomeBatch>>,
    records: usize,
    limit: usize,
    /// Every completed record at or above this offset is still retained.
    floor: u64,
    /// Evicted batches not dropped yet. The history is kept under the
    /// scheduler's lock and usually holds a batch's last reference: dropping
    /// it frees every outcome's key, work no thread waiting for that lock
    /// should wait for. Whoever publishes takes them and drops them after
    /// the lock (`take_retired`).
    retired: Vec<Arc<OutcomeBatch>>,
}

impl History {
    pub(crate) fn new(limit: usize, floor: u64) -> History {
        History {
            batches: VecDeque::new(),
            records: 0,
            limit,
            floor,
            retired: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, batch: Arc<OutcomeBatch>) {
        self.records += batch.records.len();
        self.batches.push_back(batch);
        while self.records > self.limit {
            let Some(evicted) = self.batches.pop_front() else {
                break;
            };
            self.records -= evicted.records.len();
            self.floor = self.floor.max(evicted.last_offset + 1);
            if self.retired.len() == MAX_RETIRED {
                // Nobody took them: a bound on what waits, not the usual path.
                self.retired.remove(0);
            }
            self.retired.push(evicted);
        }
    }

    /// The batches evicted since the last call, for the caller to drop.
    pub(crate) fn take_retired(&mut self) -> Vec<Arc<OutcomeBatch>> {
        std::mem::take(&mut self.retired)
    }

    pub(crate) fn floor(&self) -> u64 {
        self.floor
    }

    pub(crate) fn batches(&self) -> impl Iterator<Item = &Arc<OutcomeBatch>> {
        self.batches.iter()
    }
}

/// What a pipeline's feed carries.
#[derive(Debug, Clone)]
pub(crate) enum FeedEvent {
    Batch(Published),
    /// The partition's task left this instance: its outcomes continue elsewhere.
    Removed(u32),
}

/// A batch as published, with what every subscriber would otherwise count
/// itself: with a thousand subscribers, a pass over each batch's records per
/// subscriber was a third of the instance's CPU.
#[derive(Debug, Clone)]
pub(crate) struct Published {
    batch: Arc<OutcomeBatch>,
    /// Records of `batch` with a final outcome.
    finals: u64,
}

impl Published {
    pub(crate) fn new(batch: Arc<OutcomeBatch>) -> Published {
        let finals = final_records(&batch.records);
        Published { batch, finals }
    }

    #[cfg(test)]
    pub(crate) fn batch(&self) -> &Arc<OutcomeBatch> {
        &self.batch
    }
}

fn final_records(records: &[crate::metadata::RecordOutcome]) -> u64 {
    records.iter().filter(|r| r.outcome.is_final()).count() as u64
}

/// The offsets `[start, end)` streamed from one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartitionRange {
    pub(crate) partition: u32,
    pub(crate) start: u64,
    pub(crate) end: Option<u64>,
}

struct Tracked {
    range: PartitionRange,
    /// Bounded: records in range still without a final outcome delivered.
    remaining: u64,
}

type WatermarkProbe = Box<dyn Fn(u32) -> Option<u64> + Send + Sync>;

/// A live feed of outcome batches. Drop it to unsubscribe.
pub struct OutcomeSubscription {
    tracked: Vec<Tracked>,
    replay: VecDeque<Published>,
    receiver: broadcast::Receiver<FeedEvent>,
    bounded: bool,
    /// After a lag, counts can no longer reach zero: completion falls back to watermarks.
    lagged: bool,
    finished: bool,
    watermark_of: WatermarkProbe,
    /// The pipeline, for the subscriber gauge and the lag counter.
    pipeline: Arc<str>,
}

impl Drop for OutcomeSubscription {
    fn drop(&mut self) {
        metrics::gauge!(crate::metrics::SUBSCRIBERS, "pipeline" => self.pipeline.to_string()).decrement(1.0);
    }
}

impl OutcomeSubscription {
    pub(crate) fn new(
        ranges: Vec<PartitionRange>,
        history: Vec<Arc<OutcomeBatch>>,
        receiver: broadcast::Receiver<FeedEvent>,
        watermark_of: WatermarkProbe,
        pipeline: Arc<str>,
    ) -> Self {
        metrics::gauge!(crate::metrics::SUBSCRIBERS, "pipeline" => pipeline.to_string()).increment(1.0);
        let bounded = !ranges.is_empty() && ranges.iter().all(|r| r.end.is_some());
        let mut subscription = OutcomeSubscription {
            tracked: ranges
                .into_iter()
                .map(|range| Tracked {
                    range,
                    remaining: range.end.map_or(u64::MAX, |end| end.saturating_sub(range.start)),
                })
                .collect(),
            replay: VecDeque::new(),
            receiver,
            bounded,
            lagged: false,
            finished: false,
            watermark_of,
            pipeline,
        };
        subscription.replay = history
            .into_iter()
            .filter_map(|b| subscription.filter(Published::new(b)))
            .collect();
        subscription
    }

    /// The partitions this subscription streams.
    pub fn partitions(&self) -> Vec<u32> {
        self.tracked.iter().map(|t| t.range.partition).collect()
    }

    /// The next event; `None` once a bounded range is complete. An error ends
    /// the subscription (the instance is shutting down).
    ///
    /// Cancellation safe: a cancelled call loses no event.
    pub async fn next(&mut self) -> Option<Result<SubscriptionEvent, RuntimeError>> {
        loop {
            if self.finished || self.is_complete() {
                self.finished = true;
                return None;
            }
            if let Some(published) = self.replay.pop_front() {
                return Some(Ok(self.deliver(published)));
            }
            let received = if self.lagged && self.bounded {
                // Missed batches never arrive: re-check the watermarks now and then.
                match tokio::time::timeout(Duration::from_millis(100), self.receiver.recv()).await {
                    Ok(received) => received,
                    Err(_) => continue,
                }
            } else {
                self.receiver.recv().await
            };
            match received {
                Ok(FeedEvent::Batch(published)) => {
                    if let Some(published) = self.filter(published) {
                        return Some(Ok(self.deliver(published)));
                    }
                }
                Ok(FeedEvent::Removed(partition)) => {
                    if self.tracked.iter().any(|t| t.range.partition == partition) {
                        self.finished = true;
                        return Some(Err(RuntimeError::Unavailable {
                            reason: format!(
                                "partition {partition} moved away from this instance; \
                                 ask the instances that metadata lists now"
                            ),
                            retry_after: Duration::from_millis(500),
                        }));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    metrics::counter!(crate::metrics::SUBSCRIBER_LAGGED, "pipeline" => self.pipeline.to_string())
                        .increment(missed);
                    self.lagged = true;
                    return Some(Ok(SubscriptionEvent::Lagged {
                        missed_batches: missed,
                    }));
                }
                Err(broadcast::error::RecvError::Closed) => {
                    self.finished = true;
                    return Some(Err(RuntimeError::shutting_down()));
                }
            }
        }
    }

    fn is_complete(&self) -> bool {
        if !self.bounded {
            return false;
        }
        if self.tracked.iter().all(|t| t.remaining == 0) {
            return true;
        }
        self.lagged
            && self.tracked.iter().all(|t| {
                let end = t.range.end.unwrap_or(u64::MAX);
                t.remaining == 0 || (self.watermark_of)(t.range.partition).is_some_and(|w| w >= end)
            })
    }

    /// Keeps the records of a batch inside this subscription's ranges. A batch
    /// wholly inside (nearly all of them) passes as it is, judged by its lowest
    /// and highest offsets alone: this runs once per batch and subscriber.
    fn filter(&self, published: Published) -> Option<Published> {
        let batch = &published.batch;
        let tracked = self
            .tracked
            .iter()
            .find(|t| t.range.partition == batch.partition)?;
        let range = tracked.range;
        let inside = |offset: u64| offset >= range.start && range.end.is_none_or(|end| offset < end);
        if batch.records.is_empty() {
            return None;
        }
        if inside(batch.first_offset) && inside(batch.last_offset) {
            return Some(published);
        }
        let records: Vec<_> = batch
            .records
            .iter()
            .filter(|r| inside(r.offset))
            .cloned()
            .collect();
        let first_offset = records.iter().map(|r| r.offset).min()?;
        let last_offset = records.iter().map(|r| r.offset).max().unwrap_or(first_offset);
        Some(Published::new(Arc::new(OutcomeBatch {
            first_offset,
            last_offset,
            records,
            ..(**batch).clone()
        })))
    }

    /// Counts the batch's final outcomes against its range and hands it out.
    fn deliver(&mut self, published: Published) -> SubscriptionEvent {
        if let Some(tracked) = self
            .tracked
            .iter_mut()
            .find(|t| t.range.partition == published.batch.partition)
        {
            tracked.remaining = tracked.remaining.saturating_sub(published.finals);
        }
        SubscriptionEvent::Batch(published.batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{Outcome, RecordOutcome};

    fn batch(partition: u32, offsets: &[u64], outcome: Outcome) -> Arc<OutcomeBatch> {
        Arc::new(OutcomeBatch {
            task_id: Arc::from("p_0"),
            pipeline: Arc::from("p"),
            topic: Arc::from("t"),
            partition,
            thread: Arc::from("stream-thread-0"),
            first_offset: offsets.iter().copied().min().unwrap_or(0),
            last_offset: offsets.iter().copied().max().unwrap_or(0),
            records: offsets
                .iter()
                .map(|&offset| RecordOutcome {
                    thread: None,
                    offset,
                    key: None,
                    key_truncated: false,
                    timestamp_ms: 0,
                    outcome,
                    attempts: 1,
                    error: None,
                })
                .collect(),
            reprocessed: false,
        })
    }

    fn offsets(event: &SubscriptionEvent) -> Vec<u64> {
        match event {
            SubscriptionEvent::Batch(batch) => batch.records.iter().map(|r| r.offset).collect(),
            SubscriptionEvent::Lagged { .. } => panic!("lagged"),
        }
    }

    fn subscription(
        start: u64,
        end: u64,
        history: Vec<Arc<OutcomeBatch>>,
    ) -> (OutcomeSubscription, broadcast::Sender<FeedEvent>) {
        let (feed, receiver) = broadcast::channel(16);
        let range = PartitionRange {
            partition: 0,
            start,
            end: Some(end),
        };
        let subscription =
            OutcomeSubscription::new(vec![range], history, receiver, Box::new(|_| None), Arc::from("p"));
        (subscription, feed)
    }

    #[test]
    fn evicted_batches_wait_to_be_dropped_by_whoever_takes_them_and_their_wait_is_bounded() {
        let mut history = History::new(4, 0);
        let first = batch(0, &[0, 1], Outcome::Processed);
        let second = batch(0, &[2, 3], Outcome::Processed);
        history.push(first.clone());
        history.push(second.clone());
        assert!(
            history.take_retired().is_empty(),
            "within the limit nothing leaves"
        );
        history.push(batch(0, &[4], Outcome::Processed));
        assert_eq!(history.floor(), 2);
        // Taken, the evicted batch is the caller's to drop: the history holds it no more.
        let retired = history.take_retired();
        assert_eq!(retired.len(), 1);
        assert!(Arc::ptr_eq(&retired[0], &first));
        drop(retired);
        assert_eq!(Arc::strong_count(&first), 1);
        assert!(history.take_retired().is_empty());
        assert_eq!(
            history
                .batches()
                .flat_map(|b| b.records.iter().map(|r| r.offset))
                .collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
        // Nobody taking them: the oldest are dropped in place past the bound.
        for offset in 5..5 + MAX_RETIRED as u64 + 10 {
            history.push(batch(0, &[offset, offset], Outcome::Processed));
        }
        let retired = history.take_retired();
        assert_eq!(retired.len(), MAX_RETIRED);
        assert_eq!(
            retired.last().map(|b| b.first_offset),
            Some(5 + MAX_RETIRED as u64 + 10 - 3)
        );
        assert_eq!(Arc::strong_count(&second), 1, "dropped in place past the bound");
    }

    #[tokio::test]
    async fn a_bounded_range_gets_only_its_offsets_and_ends_at_its_last_final_outcome() {
        // History straddles the start; the live feed straddles the end, with its
        // records out of order as in a batch of `unordered` order.
        let (mut subscription, feed) = subscription(5, 12, vec![batch(0, &[3, 4, 5, 6], Outcome::Processed)]);
        let publish = |b| feed.send(FeedEvent::Batch(Published::new(b))).map(drop);
        publish(batch(1, &[7, 8], Outcome::Processed)).unwrap();
        publish(batch(0, &[8, 7, 9], Outcome::Processed)).unwrap();
        // A retrying outcome is not final: offset 10 still counts as remaining.
        publish(batch(0, &[10], Outcome::Retrying)).unwrap();
        publish(batch(0, &[], Outcome::Processed)).unwrap();
        publish(batch(0, &[13, 10, 11, 12], Outcome::Failed)).unwrap();
        let mut seen = Vec::new();
        while let Some(event) = subscription.next().await {
            seen.push(offsets(&event.unwrap()));
        }
        assert_eq!(seen, vec![vec![5, 6], vec![8, 7, 9], vec![10], vec![10, 11]]);
    }

    #[tokio::test]
    async fn a_batch_wholly_inside_the_range_is_handed_out_as_published() {
        let (mut subscription, feed) = subscription(0, 100, Vec::new());
        let published = batch(0, &[2, 1, 3], Outcome::Processed);
        feed.send(FeedEvent::Batch(Published::new(published.clone())))
            .unwrap();
        let Some(Ok(SubscriptionEvent::Batch(got))) = subscription.next().await else {
            panic!("no batch")
        };
        assert!(Arc::ptr_eq(&got, &published));
    }
}
