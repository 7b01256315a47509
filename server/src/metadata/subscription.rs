//! Subscriptions to record outcomes: a consistent replay of retained history
//! followed by live batches, filtered to the requested partitions and offset
//! range, with lag reported in-band and bounded ranges completing by themselves.

use super::OutcomeBatch;
use crate::runtime::RuntimeError;
use std::collections::BTreeMap;
use std::sync::Arc;

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

/// A live feed of outcome batches. Drop it to unsubscribe.
pub struct OutcomeSubscription {
    _private: (),
}

impl OutcomeSubscription {
    /// The next event; `None` once a bounded range is complete. An error ends
    /// the subscription (the instance is shutting down).
    ///
    /// Cancellation safe: a cancelled call loses no event.
    pub async fn next(&mut self) -> Option<Result<SubscriptionEvent, RuntimeError>> {
        todo!()
    }
}
