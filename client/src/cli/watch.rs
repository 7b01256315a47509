//! `taskstream watch`: a subscription over every instance of the application
//! (`get_metadata_async_all`, one instance on the embedded log) whose
//! callback prints each batch as it comes. A partition that moves is followed
//! to its new owner (the client's fan-in): printed offsets do not repeat, and
//! offsets no owner holds outcomes of any more are printed as a `lagged` line
//! in their place. It ends when a bounded stream completes, on a stream error
//! (or a partition not back within `--follow-timeout`), on Ctrl-C, or when
//! stdout closes (`| head`).

use std::{
    io,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use taskstream_client::{ClientError, End, MetadataBatch, MetadataOptions, Start, StreamsClient};
use tokio::sync::Notify;

use super::{json, out, out_json, render};

pub struct WatchInput {
    pub store: String,
    pub in_order: bool,
    pub until_end: bool,
    pub from_earliest: bool,
    pub partitions: Vec<u32>,
    pub max_batch_records: u32,
    /// See `MetadataOptions::follow_moves`.
    pub follow_timeout: Option<Duration>,
    pub json: bool,
}

/// How a watch that did not fail ended.
#[derive(Debug, PartialEq, Eq)]
pub enum WatchEnd {
    /// The bounded stream completed, or stdout was closed by its reader.
    Completed,
    /// Ctrl-C.
    Interrupted,
}

/// What the callback reports to the command.
#[derive(Default)]
struct Shared {
    error: Mutex<Option<ClientError>>,
    lagged: AtomicBool,
    missed_batches: AtomicU64,
    /// The last range a moved partition lost, for the exit status.
    last_gap: Mutex<Option<ClientError>>,
    output_error: Mutex<Option<io::Error>>,
    /// Wakes the command when the callback can't write any more.
    stop: Notify,
}

pub async fn run(client: &StreamsClient, input: WatchInput) -> anyhow::Result<WatchEnd> {
    let options = MetadataOptions::default()
        .in_order(input.in_order)
        .start(if input.from_earliest {
            Start::Earliest
        } else {
            Start::Latest
        })
        .end(if input.until_end { End::Current } else { End::Open })
        .partitions(input.partitions)
        .max_batch_records(input.max_batch_records)
        .follow_moves(input.follow_timeout);
    let shared = Arc::new(Shared::default());
    let reported = shared.clone();
    let as_json = input.json;
    let callback = move |result: Result<MetadataBatch, ClientError>| match result {
        Ok(batch) => {
            let written = if as_json {
                out_json(&json::batch(&batch))
            } else {
                out(&(render::batch(&batch) + "\n"))
            };
            if let Err(error) = written {
                *lock(&reported.output_error) = Some(error);
                reported.stop.notify_one();
            }
        }
        Err(ClientError::Lagged { missed_batches }) => {
            reported.lagged.store(true, Ordering::SeqCst);
            reported
                .missed_batches
                .fetch_add(missed_batches, Ordering::SeqCst);
            eprintln!("warning: watch fell behind; the server dropped {missed_batches} batches for it");
        }
        Err(ClientError::LaggedOffsets {
            partition,
            first_offset,
            last_offset,
        }) => {
            reported.lagged.store(true, Ordering::SeqCst);
            *lock(&reported.last_gap) = Some(ClientError::LaggedOffsets {
                partition,
                first_offset,
                last_offset,
            });
            // In the output, where the missing records would have been.
            let written = if as_json {
                out_json(&serde_json::json!({
                    "lagged": {
                        "partition": partition,
                        "first_offset": first_offset,
                        "last_offset": last_offset,
                    }
                }))
            } else {
                out(&format!(
                    "lagged partition={partition} offsets={first_offset}..={last_offset} \
                     (moved; the new owner no longer holds these outcomes)\n"
                ))
            };
            if let Err(error) = written {
                *lock(&reported.output_error) = Some(error);
                reported.stop.notify_one();
            }
        }
        Err(error) => *lock(&reported.error) = Some(error),
    };

    let handle = client.get_metadata_async_all(&input.store, options, callback);
    let cancel = handle.cancel_handle();
    let join = handle.join();
    tokio::pin!(join);
    let interrupted = tokio::select! {
        () = &mut join => false,
        () = ctrl_c() => {
            cancel.cancel();
            join.await;
            true
        }
        () = shared.stop.notified() => {
            cancel.cancel();
            join.await;
            false
        }
    };

    if let Some(error) = lock(&shared.output_error).take() {
        // The reader of a pipe went away (`| head`): that is how it says "enough".
        if error.kind() == io::ErrorKind::BrokenPipe {
            return Ok(WatchEnd::Completed);
        }
        return Err(anyhow::Error::new(error).context("writing to stdout"));
    }
    if let Some(error) = lock(&shared.error).take() {
        return Err(error.into());
    }
    if interrupted {
        return Ok(WatchEnd::Interrupted);
    }
    if shared.lagged.load(Ordering::SeqCst) {
        // The output is incomplete: say so in the exit code.
        let missed_batches = shared.missed_batches.load(Ordering::SeqCst);
        if missed_batches == 0
            && let Some(gap) = lock(&shared.last_gap).take()
        {
            return Err(gap.into());
        }
        return Err(ClientError::Lagged { missed_batches }.into());
    }
    Ok(WatchEnd::Completed)
}

/// Resolves on Ctrl-C; never, if the handler can't be installed.
async fn ctrl_c() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A poisoned lock only means a callback panicked; the value is still usable.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
