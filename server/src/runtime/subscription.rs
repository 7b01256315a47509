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

/// Retained outcome batches of one task, oldest first, bounded by record count.
pub(crate) struct History {
    batches: VecDeque<Arc<OutcomeBatch>>,
    records: usize,
    limit: usize,
    /// Every completed record at or above this offset is still retained.
    floor: u64,
}

impl History {
    pub(crate) fn new(limit: usize, floor: u64) -> History {
        History {
            batches: VecDeque::new(),
            records: 0,
            limit,
            floor,
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
        }
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
    Batch(Arc<OutcomeBatch>),
    /// The partition's task left this instance: its outcomes continue elsewhere.
    Removed(u32),
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
    replay: VecDeque<Arc<OutcomeBatch>>,
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
            .filter_map(|b| subscription.filter(b))
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
            if let Some(batch) = self.replay.pop_front() {
                self.account(&batch);
                return Some(Ok(SubscriptionEvent::Batch(batch)));
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
                Ok(FeedEvent::Batch(batch)) => {
                    if let Some(batch) = self.filter(batch) {
                        self.account(&batch);
                        return Some(Ok(SubscriptionEvent::Batch(batch)));
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

    /// Keeps the records of `batch` inside this subscription's ranges.
    fn filter(&self, batch: Arc<OutcomeBatch>) -> Option<Arc<OutcomeBatch>> {
        let tracked = self
            .tracked
            .iter()
            .find(|t| t.range.partition == batch.partition)?;
        let range = tracked.range;
        let inside = |offset: u64| offset >= range.start && range.end.is_none_or(|end| offset < end);
        if batch.records.iter().all(|r| inside(r.offset)) {
            return (!batch.records.is_empty()).then_some(batch);
        }
        let records: Vec<_> = batch
            .records
            .iter()
            .filter(|r| inside(r.offset))
            .cloned()
            .collect();
        let first_offset = records.iter().map(|r| r.offset).min()?;
        let last_offset = records.iter().map(|r| r.offset).max().unwrap_or(first_offset);
        Some(Arc::new(OutcomeBatch {
            first_offset,
            last_offset,
            records,
            ..(*batch).clone()
        }))
    }

    fn account(&mut self, batch: &OutcomeBatch) {
        if let Some(tracked) = self
            .tracked
            .iter_mut()
            .find(|t| t.range.partition == batch.partition)
        {
            let finals = batch.records.iter().filter(|r| r.outcome.is_final()).count() as u64;
            tracked.remaining = tracked.remaining.saturating_sub(finals);
        }
    }
}
