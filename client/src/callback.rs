//! `GetMetadataAsync` as callbacks: the [`RecordCallback`] trait, the task that
//! turns a stream into callbacks, and the [`MetadataHandle`] that cancels or
//! joins it.
//!
//! Contract: one `Ok` per streamed batch (or one in all when coalescing), one
//! `Err` for the error that ends the stream, an `Err(Lagged)` per in-band notice.

use std::{
    panic,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use taskstream::v1::{
    self, get_metadata_async_response::Event, streams_service_client::StreamsServiceClient,
};
use tokio::{sync::Notify, task::JoinHandle};

use crate::{
    ClientError,
    metadata::{Coalescer, MetadataBatch, MetadataOptions},
};

/// Receives the outcome of a metadata subscription, as Kafka's producer
/// `Callback::onCompletion`.
///
/// Callbacks run one at a time, in stream order, on a tokio worker: keep them
/// short and non-blocking, and hand heavy work to a channel.
///
/// Implemented for every `FnMut(Result<MetadataBatch, ClientError>) + Send + 'static`.
pub trait RecordCallback: Send + 'static {
    fn on_complete(&mut self, result: Result<MetadataBatch, ClientError>);
}

impl<F> RecordCallback for F
where
    F: FnMut(Result<MetadataBatch, ClientError>) + Send + 'static,
{
    fn on_complete(&mut self, result: Result<MetadataBatch, ClientError>) {
        self(result)
    }
}

/// Cancellation shared by the handle and the task.
#[derive(Default)]
pub(crate) struct CancelState {
    cancelled: AtomicBool,
    /// `notify_one` stores a permit, so a cancel before the task waits is not lost.
    wake: Notify,
}

impl CancelState {
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Resolves once `cancel` was called.
    pub(crate) async fn cancelled(&self) {
        while !self.is_cancelled() {
            self.wake.notified().await;
        }
    }
}

/// The running subscription started by
/// [`StreamsClient::get_metadata_async`](crate::StreamsClient::get_metadata_async).
///
/// Dropping the handle does **not** cancel: like a Kafka producer callback,
/// the callbacks are the point and keep coming after the caller moved on
/// (fire and forget). A bounded stream ends by itself; an open one runs until
/// [`cancel`](Self::cancel), a stream error, or the runtime shuts down.
#[must_use = "dropping the handle detaches the subscription; keep it to cancel or join"]
pub struct MetadataHandle {
    cancel: Arc<CancelState>,
    task: JoinHandle<()>,
}

impl MetadataHandle {
    /// Stops the subscription and closes the stream (the server stops the work for it).
    ///
    /// Once `cancel` returns no new callback starts; one already running when
    /// it was called may still finish (`cancel` does not wait for it, so it
    /// may also be called from inside a callback). `cancel().join().await`
    /// is the hard barrier. Cancelling a finished subscription does nothing.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// A cloneable handle that cancels this subscription from elsewhere, e.g.
    /// a signal handler while another task waits in [`join`](Self::join).
    pub fn cancel_handle(&self) -> CancelHandle {
        CancelHandle {
            cancel: self.cancel.clone(),
        }
    }

    /// True once the stream ended and every callback returned.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits until the stream ended (completed, failed or cancelled) and every
    /// callback returned. A panic in a callback is resumed here.
    pub async fn join(self) {
        // A non-panic join error means the runtime is shutting down and
        // cancelled the task: there is nothing left to wait for.
        if let Err(error) = self.task.await
            && error.is_panic()
        {
            panic::resume_unwind(error.into_panic());
        }
    }
}

/// Cancels a subscription without owning its [`MetadataHandle`], as tokio's `AbortHandle`.
#[derive(Clone)]
pub struct CancelHandle {
    cancel: Arc<CancelState>,
}

impl CancelHandle {
    /// Same as [`MetadataHandle::cancel`].
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

impl std::fmt::Debug for CancelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelHandle")
            .field("cancelled", &self.cancel.is_cancelled())
            .finish()
    }
}

impl std::fmt::Debug for MetadataHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataHandle")
            .field("cancelled", &self.cancel.is_cancelled())
            .field("finished", &self.task.is_finished())
            .finish()
    }
}

/// Spawns the subscription task; see `StreamsClient::get_metadata_async`.
pub(crate) fn spawn(
    client: StreamsServiceClient<crate::client::Transport>,
    store: String,
    options: MetadataOptions,
    callback: impl RecordCallback,
) -> MetadataHandle {
    let cancel = Arc::new(CancelState::default());
    let callback = Guarded {
        callback,
        cancel: cancel.clone(),
    };
    let task = tokio::spawn(run(client, store, options, callback));
    MetadataHandle { cancel, task }
}

/// Spawns the merged subscription to every instance; see
/// `StreamsClient::get_metadata_async_all`.
pub(crate) fn spawn_all(
    client: crate::StreamsClient,
    store: String,
    options: MetadataOptions,
    callback: impl RecordCallback,
) -> MetadataHandle {
    let cancel = Arc::new(CancelState::default());
    let callback = Guarded {
        callback,
        cancel: cancel.clone(),
    };
    let task = tokio::spawn(crate::fan_in::run(client, store, options, callback));
    MetadataHandle { cancel, task }
}

/// The user's callback behind the cancel check.
pub(crate) struct Guarded<C> {
    callback: C,
    pub(crate) cancel: Arc<CancelState>,
}

impl<C: RecordCallback> Guarded<C> {
    pub(crate) fn call(&mut self, result: Result<MetadataBatch, ClientError>) {
        if !self.cancel.is_cancelled() {
            self.callback.on_complete(result);
        }
    }
}

async fn run<C: RecordCallback>(
    mut client: StreamsServiceClient<crate::client::Transport>,
    store: String,
    options: MetadataOptions,
    mut callback: Guarded<C>,
) {
    if let Err(error) = options.validate() {
        callback.call(Err(error));
        return;
    }
    // Its own reference: the callback need not be `Sync` to be awaited beside.
    let cancel = callback.cancel.clone();
    let request = options.to_request(&store);
    let opened = tokio::select! {
        biased;
        () = cancel.cancelled() => return,
        opened = client.get_metadata_async(request) => opened,
    };
    let mut stream = match opened {
        Ok(response) => response.into_inner(),
        Err(status) => {
            callback.call(Err(ClientError::from_status(&status)));
            return;
        }
    };
    let mut coalescer = options.coalesce.then(|| Coalescer::new(&store, options.in_order));
    loop {
        // Returning drops `stream`, which resets the HTTP/2 stream: that is how
        // the server learns the subscriber is gone.
        let message = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            message = stream.message() => message,
        };
        match message {
            Ok(Some(v1::GetMetadataAsyncResponse {
                event: Some(Event::Batch(batch)),
            })) => match &mut coalescer {
                Some(coalescer) => coalescer.push(batch),
                None => callback.call(Ok(MetadataBatch::from(batch))),
            },
            Ok(Some(v1::GetMetadataAsyncResponse {
                event: Some(Event::Lagged(lagged)),
            })) => {
                callback.call(Err(ClientError::Lagged {
                    missed_batches: lagged.missed_batches,
                }));
                // A coalesced result promises every record; with batches
                // missing it can't be delivered, so the error is the one callback.
                if coalescer.is_some() {
                    return;
                }
            }
            // An event this client does not know (a newer server): skip it.
            Ok(Some(v1::GetMetadataAsyncResponse { event: None })) => {}
            Ok(None) => {
                if let Some(coalescer) = coalescer {
                    callback.call(Ok(coalescer.finish()));
                }
                return;
            }
            Err(status) => {
                callback.call(Err(ClientError::from_status(&status)));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::atomic::AtomicUsize, time::Duration};

    use tokio::sync::mpsc;
    use tonic::{Code, Status};
    use tonic_types::{ErrorDetails, StatusExt};

    use super::*;
    use crate::{
        End, Start,
        test_server::{Fake, batch, lagged, serve},
    };

    type Outcome = Result<MetadataBatch, ClientError>;

    /// A callback that forwards every outcome to a channel the test reads.
    fn recorder() -> (impl RecordCallback, mpsc::UnboundedReceiver<Outcome>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (move |result: Outcome| drop(tx.send(result)), rx)
    }

    fn drain(rx: &mut mpsc::UnboundedReceiver<Outcome>) -> Vec<Outcome> {
        let mut out = Vec::new();
        while let Ok(outcome) = rx.try_recv() {
            out.push(outcome);
        }
        out
    }

    #[tokio::test]
    async fn one_callback_per_batch_and_lag_goes_on() {
        let fake = Fake {
            stream: vec![batch(0, 0..=2), lagged(3), batch(1, 0..=0)],
            ..Default::default()
        };
        let (client, fake, _) = serve(fake).await;
        let (callback, mut rx) = recorder();
        let options = MetadataOptions::bounded()
            .in_order(true)
            .max_batch_records(10)
            .partitions([0, 1]);
        let handle = client.get_metadata_async("counts", options, callback);
        handle.join().await;
        let outcomes = drain(&mut rx);
        assert_eq!(outcomes.len(), 3, "{outcomes:?}");
        let first = outcomes[0].as_ref().expect("first batch");
        assert_eq!(first.len(), 3);
        assert_eq!(first.ranges.len(), 1);
        assert_eq!(outcomes[1], Err(ClientError::Lagged { missed_batches: 3 }));
        assert_eq!(outcomes[2].as_ref().expect("last batch").records[0].partition, 1);

        let request = fake.last_request.lock().expect("lock").clone().expect("request");
        assert_eq!(request.store, "counts");
        assert!(request.in_order);
        assert_eq!(request.start(), v1::StartPosition::Earliest);
        assert_eq!(request.end(), v1::EndPosition::Current);
        assert_eq!(request.max_batch_records, 10);
        assert_eq!(request.partitions, vec![0, 1]);
    }

    #[tokio::test]
    async fn stream_error_is_one_final_callback() {
        let fake = Fake {
            stream: vec![
                batch(0, 0..=1),
                Err(Status::out_of_range("offset 0 no longer retained")),
                batch(0, 2..=3),
            ],
            ..Default::default()
        };
        let (client, _, _) = serve(fake).await;
        let (callback, mut rx) = recorder();
        client
            .get_metadata_async("counts", MetadataOptions::bounded(), callback)
            .join()
            .await;
        let outcomes = drain(&mut rx);
        assert_eq!(outcomes.len(), 2, "{outcomes:?}");
        assert!(outcomes[0].is_ok());
        assert!(
            matches!(outcomes[1], Err(ClientError::OutOfRange { .. })),
            "{outcomes:?}"
        );
    }

    #[tokio::test]
    async fn refused_open_carries_details_over_the_wire() {
        let status = Status::with_error_details(
            Code::FailedPrecondition,
            "store counts runs key order with 2 threads per task",
            ErrorDetails::with_precondition_failure_violation(
                "PROCESSING_ORDER",
                "counts",
                "in_order refused",
            ),
        );
        let fake = Fake {
            open_error: Some(status),
            ..Default::default()
        };
        let (client, _, _) = serve(fake).await;
        let (callback, mut rx) = recorder();
        client
            .get_metadata_async("counts", MetadataOptions::follow().in_order(true), callback)
            .join()
            .await;
        let outcomes = drain(&mut rx);
        assert_eq!(outcomes.len(), 1);
        let Err(ClientError::IllegalState { violations, .. }) = &outcomes[0] else {
            panic!("expected IllegalState, got {outcomes:?}");
        };
        assert_eq!(violations[0].subject, "counts");
        assert_eq!(violations[0].kind, "PROCESSING_ORDER");
    }

    #[tokio::test]
    async fn completed_stream_needs_no_callback() {
        let (client, _, _) = serve(Fake::default()).await;
        let (callback, mut rx) = recorder();
        client
            .get_metadata_async("counts", MetadataOptions::bounded(), callback)
            .join()
            .await;
        assert!(drain(&mut rx).is_empty());
    }

    #[tokio::test]
    async fn coalesced_is_one_sorted_callback() {
        let fake = Fake {
            stream: vec![batch(1, 5..=9), batch(0, 0..=4), batch(1, 0..=4), batch(0, 5..=5)],
            ..Default::default()
        };
        let (client, _, _) = serve(fake).await;
        let (callback, mut rx) = recorder();
        let options = MetadataOptions::bounded().in_order(true).coalesce(true);
        client
            .get_metadata_async("counts", options, callback)
            .join()
            .await;
        let outcomes = drain(&mut rx);
        assert_eq!(outcomes.len(), 1);
        let all = outcomes[0].as_ref().expect("coalesced batch");
        assert_eq!(all.ranges.len(), 4);
        let keys: Vec<(u32, i64)> = all.records.iter().map(|r| (r.partition, r.offset)).collect();
        let expected: Vec<(u32, i64)> = (0..6).map(|o| (0, o)).chain((0..10).map(|o| (1, o))).collect();
        assert_eq!(keys, expected);
    }

    #[tokio::test]
    async fn coalesced_empty_stream_still_calls_back_once() {
        let (client, _, _) = serve(Fake::default()).await;
        let (callback, mut rx) = recorder();
        let options = MetadataOptions::bounded().coalesce(true);
        client
            .get_metadata_async("counts", options, callback)
            .join()
            .await;
        let outcomes = drain(&mut rx);
        assert_eq!(outcomes.len(), 1);
        assert!(outcomes[0].as_ref().expect("ok").is_empty());
    }

    #[tokio::test]
    async fn coalesced_lag_or_error_is_the_one_callback() {
        for stream in [
            vec![batch(0, 0..=1), lagged(2), batch(0, 2..=3)],
            vec![batch(0, 0..=1), Err(Status::unavailable("shutting down"))],
        ] {
            let (client, _, _) = serve(Fake {
                stream,
                ..Default::default()
            })
            .await;
            let (callback, mut rx) = recorder();
            let options = MetadataOptions::bounded().coalesce(true);
            client
                .get_metadata_async("counts", options, callback)
                .join()
                .await;
            let outcomes = drain(&mut rx);
            assert_eq!(outcomes.len(), 1, "{outcomes:?}");
            assert!(
                matches!(
                    outcomes[0],
                    Err(ClientError::Lagged { missed_batches: 2 } | ClientError::NotAvailable { .. })
                ),
                "{outcomes:?}"
            );
        }
    }

    #[tokio::test]
    async fn coalesce_on_open_stream_fails_without_calling_the_server() {
        let (client, fake, _) = serve(Fake::default()).await;
        let (callback, mut rx) = recorder();
        let options = MetadataOptions::follow().coalesce(true);
        client
            .get_metadata_async("counts", options, callback)
            .join()
            .await;
        let outcomes = drain(&mut rx);
        assert_eq!(outcomes.len(), 1);
        assert!(
            matches!(outcomes[0], Err(ClientError::IllegalArgument { .. })),
            "{outcomes:?}"
        );
        assert_eq!(fake.metadata_calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn cancel_stops_callbacks_and_closes_the_stream() {
        let fake = Fake {
            stream: vec![batch(0, 0..=1), batch(0, 2..=3)],
            hold_open: true,
            ..Default::default()
        };
        let (client, fake, _) = serve(fake).await;
        let (callback, mut rx) = recorder();
        let handle = client.get_metadata_async("counts", MetadataOptions::follow(), callback);
        for _ in 0..2 {
            let outcome = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("batch in time");
            assert!(outcome.expect("open channel").is_ok());
        }
        assert!(!handle.is_finished(), "an open stream runs until cancelled");
        handle.cancel();
        handle.cancel_handle().cancel(); // idempotent, and from a clone too
        handle.join().await;
        assert!(fake.gone.wait().await, "the server saw the stream closed");
        assert!(drain(&mut rx).is_empty());
    }

    #[tokio::test]
    async fn cancel_handle_ends_a_join_in_progress() {
        let fake = Fake {
            hold_open: true,
            ..Default::default()
        };
        let (client, fake, _) = serve(fake).await;
        let handle = client.get_metadata_async("counts", MetadataOptions::follow(), |_: Outcome| {});
        let canceller = handle.cancel_handle();
        let joined = tokio::spawn(handle.join());
        // Cancel only once the server holds the stream, so it can see it closed.
        while fake.metadata_calls.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!joined.is_finished());
        canceller.cancel();
        tokio::time::timeout(Duration::from_secs(5), joined)
            .await
            .expect("join returns after cancel")
            .expect("no panic");
        assert!(fake.gone.wait().await);
    }

    #[tokio::test]
    async fn cancel_before_anything_arrives_means_no_callback() {
        let fake = Fake {
            stream: vec![batch(0, 0..=1)],
            hold_open: true,
            ..Default::default()
        };
        let (client, _, _) = serve(fake).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let handle = client.get_metadata_async("counts", MetadataOptions::follow(), move |_: Outcome| {
            seen.fetch_add(1, Ordering::SeqCst);
        });
        handle.cancel();
        handle.join().await;
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn dropping_the_handle_does_not_cancel() {
        let fake = Fake {
            stream: vec![batch(0, 0..=1), batch(0, 2..=3)],
            ..Default::default()
        };
        let (client, _, _) = serve(fake).await;
        let (callback, mut rx) = recorder();
        drop(client.get_metadata_async("counts", MetadataOptions::bounded(), callback));
        for _ in 0..2 {
            let outcome = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("batch in time");
            assert!(outcome.expect("open channel").is_ok());
        }
    }

    #[tokio::test]
    async fn callback_panic_resumes_in_join() {
        let (client, _, _) = serve(Fake {
            stream: vec![batch(0, 0..=0)],
            ..Default::default()
        })
        .await;
        let handle = client.get_metadata_async("counts", MetadataOptions::bounded(), |_: Outcome| {
            panic!("assertion in callback");
        });
        let joined = tokio::spawn(handle.join()).await;
        assert!(joined.expect_err("panic propagates").is_panic());
    }

    #[tokio::test]
    async fn offsets_reach_the_request() {
        let (client, fake, _) = serve(Fake::default()).await;
        let options = MetadataOptions::default()
            .start(Start::Offsets([(2, 10)].into()))
            .end(End::Offsets([(2, 20)].into()));
        client
            .get_metadata_async("counts", options, |_: Outcome| {})
            .join()
            .await;
        let request = fake.last_request.lock().expect("lock").clone().expect("request");
        assert_eq!(request.start(), v1::StartPosition::Offsets);
        assert_eq!(request.start_offsets.get(&2), Some(&10));
        assert_eq!(request.end_offsets.get(&2), Some(&20));
    }
}
