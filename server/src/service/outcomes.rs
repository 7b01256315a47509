//! The GetMetadataAsync pump: one spawned task per stream moves events from the
//! runtime's subscription (a bounded broadcast) into a bounded channel that
//! feeds the response. It only ever waits on that channel, so a slow client
//! costs at most the two bounded buffers and never slows processing.

use super::convert;
use super::status::{ServiceError, to_status};
use crate::config::SlowSubscriberPolicy;
use crate::runtime::{OutcomeSubscription, SubscriptionEvent};
use taskstream::v1 as pb;
use taskstream::v1::get_metadata_async_response::Event;
use tokio::sync::mpsc;
use tonic::Status;

/// Messages buffered between the pump and the connection. Small on purpose:
/// the subscription's own buffer (`subscriber_buffer_batches`) is where a slow
/// subscriber is detected; this one only smooths the hand-off.
pub const STREAM_CHANNEL_CAPACITY: usize = 64;

pub type StreamItem = Result<pb::GetMetadataAsyncResponse, Status>;

/// How the pump shapes one stream.
#[derive(Debug, Clone)]
pub struct PumpSettings {
    pub store: String,
    /// At most this many records per message (0 = one message per batch).
    pub max_batch_records: usize,
    pub slow_subscriber: SlowSubscriberPolicy,
    /// Reported to a subscriber dropped under `SlowSubscriberPolicy::Fail`.
    pub subscriber_buffer_batches: usize,
}

/// Runs until the subscription ends (bounded range complete: the stream ends
/// with OK when `tx` drops), fails (the error is the stream's last message), or
/// the client goes away (the subscription is dropped, which unsubscribes).
pub async fn pump(
    mut subscription: OutcomeSubscription,
    tx: mpsc::Sender<StreamItem>,
    settings: PumpSettings,
) {
    let store = settings.store.as_str();
    loop {
        // Without watching `closed()`, a client that disconnects from an idle
        // stream would keep its subscription until the next batch arrives.
        let event = tokio::select! {
            biased;
            () = tx.closed() => {
                tracing::debug!(store, "subscriber disconnected; stream closed");
                return;
            }
            event = subscription.next() => event,
        };
        let messages = match event {
            None => {
                tracing::debug!(store, "bounded stream complete");
                return;
            }
            Some(Err(error)) => {
                tracing::debug!(store, %error, "subscription ended");
                // Best effort: if the client already left there is no one to tell.
                let _ = tx.send(Err(to_status(error))).await;
                return;
            }
            Some(Ok(SubscriptionEvent::Batch(batch))) => {
                convert::metadata_batches(&batch, settings.max_batch_records)
                    .into_iter()
                    .map(|batch| response(Event::Batch(batch)))
                    .collect()
            }
            Some(Ok(SubscriptionEvent::Lagged { missed_batches })) => match settings.slow_subscriber {
                SlowSubscriberPolicy::Notify => {
                    tracing::debug!(store, missed_batches, "subscriber lagged; told in-band");
                    vec![response(Event::Lagged(pb::Lagged { missed_batches }))]
                }
                SlowSubscriberPolicy::Fail => {
                    tracing::info!(store, missed_batches, "subscriber lagged; stream ended");
                    let error = ServiceError::SubscriberLagged {
                        missed_batches,
                        buffer_batches: settings.subscriber_buffer_batches,
                    };
                    let _ = tx.send(Err(to_status(error))).await;
                    return;
                }
            },
        };
        for message in messages {
            if tx.send(Ok(message)).await.is_err() {
                tracing::debug!(store, "subscriber disconnected; stream closed");
                return;
            }
        }
    }
}

fn response(event: Event) -> pb::GetMetadataAsyncResponse {
    pb::GetMetadataAsyncResponse { event: Some(event) }
}
