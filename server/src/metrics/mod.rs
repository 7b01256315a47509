//! Prometheus metrics through the `metrics` facade: record counts by outcome
//! (per pipeline and per task), processing time, what the threads of each task
//! are doing, retry backlog, dead-lettered records, lag, commits, restores,
//! subscribers, storage errors, and gRPC calls by method and code
//! (`service::RpcTelemetryLayer`). The runtime
//! only records (a no-op without a recorder); the binary installs the
//! Prometheus recorder and serves `GET /metrics` (`serve`), over HTTPS with
//! `metrics_tls`.

use crate::service::AcceptBackoff;
use crate::service::tls::MetricsTls;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpListener;

pub const RECORDS: &str = "taskstream_records_total";
pub const RETRY_BACKLOG: &str = "taskstream_retry_backlog_records";
pub const DEAD_LETTERED: &str = "taskstream_dead_letter_records";
pub const LAG: &str = "taskstream_lag_records";
pub const THREADS: &str = "taskstream_stream_threads";
pub const COMMITS: &str = "taskstream_commits_total";
pub const STORAGE_ERRORS: &str = "taskstream_storage_errors_total";
pub const RPC_REQUESTS: &str = "taskstream_rpc_requests_total";
pub const RPC_DURATION: &str = "taskstream_rpc_duration_seconds";
pub const TASK_RECORDS: &str = "taskstream_task_records_total";
pub const PROCESS_SECONDS: &str = "taskstream_process_seconds";
pub const TASK_ACTIVE_THREADS: &str = "taskstream_task_active_threads";
pub const TASK_IN_FLIGHT: &str = "taskstream_task_in_flight_records";
pub const TASK_HELD: &str = "taskstream_task_sequencer_held_records";
pub const THREAD_BUSY: &str = "taskstream_thread_busy_microseconds_total";
pub const COMMIT_DURATION: &str = "taskstream_commit_duration_seconds";
pub const TASK_LAST_COMMIT: &str = "taskstream_task_last_commit_timestamp_seconds";
pub const RESTORE_REMAINING: &str = "taskstream_restore_remaining_records";
pub const SUBSCRIBERS: &str = "taskstream_stream_subscribers";
pub const SUBSCRIBER_LAGGED: &str = "taskstream_subscriber_lagged_batches_total";
pub const PROCESSOR_UNREACHABLE: &str = "taskstream_processor_unreachable_total";
pub const PROCESSOR_WAITING: &str = "taskstream_processor_waiting";
pub const CONNECTIONS: &str = "taskstream_grpc_connections";
pub const CONNECTIONS_CLOSED: &str = "taskstream_grpc_connections_closed_total";
pub const ACCEPT_ERRORS: &str = "taskstream_accept_errors_total";

/// Buckets of `PROCESS_SECONDS`: from a no-op record (about a microsecond) to a slow call.
const PROCESS_BUCKETS: &[f64] = &[
    0.000_001, 0.000_005, 0.000_025, 0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
];

/// Buckets of `COMMIT_DURATION`: from a position write to a large store's fsync.
const COMMIT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Buckets of `RPC_DURATION`, in seconds: from a fast unary call to a long stream.
const RPC_DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

fn describe() {
    metrics::describe_gauge!(CONNECTIONS, "Open gRPC connections (at most max_connections)");
    metrics::describe_counter!(
        CONNECTIONS_CLOSED,
        "gRPC connections the server closed by reason (over_limit, handshake_timeout, idle_timeout)"
    );
    metrics::describe_counter!(
        ACCEPT_ERRORS,
        "Failed accepts by listener (grpc, metrics), e.g. no file descriptor left; each waits before retrying"
    );
    metrics::describe_counter!(
        PROCESSOR_UNREACHABLE,
        "Calls to a pipeline's remote processor that could not reach it (nothing failed; the pipeline waited)"
    );
    metrics::describe_gauge!(
        PROCESSOR_WAITING,
        "1 while a pipeline waits for its remote processor to be reachable again, else 0"
    );
    metrics::describe_counter!(
        RECORDS,
        "Record outcomes by pipeline and outcome (processed, retrying, dead_lettered, failed)"
    );
    metrics::describe_gauge!(
        RETRY_BACKLOG,
        "Records in a pipeline's retry topic without a final outcome"
    );
    metrics::describe_gauge!(DEAD_LETTERED, "Records in a pipeline's dead-letter topic");
    metrics::describe_gauge!(
        LAG,
        "Records of a pipeline not yet completed (end offset − watermark)"
    );
    metrics::describe_gauge!(
        THREADS,
        "Stream threads by state (owner, helper, reserve, retry, stopping)"
    );
    metrics::describe_counter!(COMMITS, "Task commits by result (ok, error)");
    metrics::describe_counter!(
        RPC_REQUESTS,
        "gRPC calls by method (package.Service/Method; `unknown` for UNIMPLEMENTED) and status code"
    );
    metrics::describe_histogram!(
        RPC_DURATION,
        metrics::Unit::Seconds,
        "gRPC call duration, to the end of the response stream, by method and status code"
    );
    metrics::describe_counter!(
        TASK_RECORDS,
        "Record outcomes by task (pipeline_partition) and outcome"
    );
    metrics::describe_histogram!(
        PROCESS_SECONDS,
        metrics::Unit::Seconds,
        "Time to process one record, by task: each unit of work's time over its records"
    );
    metrics::describe_gauge!(
        TASK_ACTIVE_THREADS,
        "Threads inside a task at the last sample (commit round)"
    );
    metrics::describe_gauge!(
        TASK_LAST_COMMIT,
        metrics::Unit::Seconds,
        "When the task's last commit succeeded (Unix time, seconds): `time() - this` is the age of what its \
         persistent store's queries and the group's offsets show"
    );
    metrics::describe_gauge!(
        TASK_IN_FLIGHT,
        "Records of a task fetched and not yet below its watermark"
    );
    metrics::describe_gauge!(
        TASK_HELD,
        "Records of a task completed and waiting for earlier ones (the sequencer's depth)"
    );
    metrics::describe_counter!(
        THREAD_BUSY,
        metrics::Unit::Microseconds,
        "Time each stream thread spent working, by role (owner, helper, retry, restore)"
    );
    metrics::describe_histogram!(
        COMMIT_DURATION,
        metrics::Unit::Seconds,
        "Time to write one task's commit (store checkpoint or log positions)"
    );
    metrics::describe_gauge!(
        RESTORE_REMAINING,
        "Source records a restoring task has still to replay"
    );
    metrics::describe_gauge!(
        SUBSCRIBERS,
        "Open outcome subscriptions (GetMetadataAsync streams) by pipeline"
    );
    metrics::describe_counter!(
        SUBSCRIBER_LAGGED,
        "Outcome batches dropped for subscribers too slow for their buffer, by pipeline"
    );
    metrics::describe_counter!(
        STORAGE_ERRORS,
        "Failed storage operations by component (log, store); each heals or keeps failing"
    );
}

/// Installs the process-wide Prometheus recorder (once; later calls return the same handle).
pub fn install() -> Result<PrometheusHandle, String> {
    static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(RPC_DURATION.to_string()), RPC_DURATION_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(PROCESS_SECONDS.to_string()), PROCESS_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(COMMIT_DURATION.to_string()), COMMIT_BUCKETS)
                })
                .map_err(|e| format!("cannot set the histogram buckets: {e}"))?
                .install_recorder()
                .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
            describe();
            Ok(handle)
        })
        .clone()
}

/// Serves the metrics in Prometheus' text format to every HTTP request on
/// `listener` (any path) until the future is dropped; over HTTPS with `tls`
/// (`metrics_tls`: a connection whose TLS handshake fails or does not finish within
/// the handshake timeout, plain HTTP included, is dropped unanswered). One small
/// response per connection, so plain HTTP/1.x is all it needs. A failing accept (no
/// fd left) waits and is logged as the gRPC listener's does (`AcceptBackoff`).
pub async fn serve(listener: TcpListener, handle: PrometheusHandle, tls: Option<MetricsTls>) {
    let mut backoff = AcceptBackoff::new("metrics");
    loop {
        let (socket, peer) = backoff.accept(&listener).await;
        let handle = handle.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => respond(socket, &handle).await,
                Some(tls) => match tls.accept(socket).await {
                    Ok(stream) => respond(stream, &handle).await,
                    // A scraper with the wrong CA, or a port scan: nothing for the operator
                    // to act on at info, and a client may try as often as it likes.
                    Err(error) => tracing::debug!(%peer, %error, "metrics: TLS handshake failed"),
                },
            }
        });
    }
}

/// Reads what arrived of the request (it does not matter), answers the metrics, closes.
async fn respond<S: AsyncRead + AsyncWrite + Unpin>(mut socket: S, handle: &PrometheusHandle) {
    let mut request = [0u8; 2048];
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), socket.read(&mut request)).await;
    let body = handle.render();
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = socket.write_all(response.as_bytes()).await;
    let _ = socket.shutdown().await;
}

/// The outcomes `RECORDS` and `TASK_RECORDS` count, in `TaskMeters::records`' order.
const OUTCOMES: [&str; 4] = ["processed", "retrying", "dead_lettered", "failed"];

/// A task's outcome counters and processing-time histogram, registered once
/// when the task is added. Naming a labelled metric at each use builds its
/// key (the label strings) and looks it up in the recorder's registry: once
/// per unit of work, that was a cost of its own (bench `retry`, parked-keys
/// probe, where failures cut units short).
pub(crate) struct TaskMeters {
    /// By outcome (`OUTCOMES`): the pipeline's `RECORDS` and the task's `TASK_RECORDS`.
    records: [(metrics::Counter, metrics::Counter); 4],
    process_seconds: metrics::Histogram,
}

impl TaskMeters {
    pub(crate) fn new(pipeline: &str, task: &str) -> TaskMeters {
        TaskMeters {
            records: OUTCOMES.map(|outcome| {
                (
                    metrics::counter!(RECORDS, "pipeline" => pipeline.to_string(), "outcome" => outcome),
                    metrics::counter!(TASK_RECORDS, "task" => task.to_string(), "outcome" => outcome),
                )
            }),
            process_seconds: metrics::histogram!(PROCESS_SECONDS, "task" => task.to_string()),
        }
    }

    /// Counts a batch's outcomes for the pipeline and the task.
    pub(crate) fn record_outcomes(&self, records: &[crate::metadata::RecordOutcome]) {
        use crate::metadata::Outcome;
        let mut counts = [0u64; 4];
        for record in records {
            counts[match record.outcome {
                Outcome::Processed => 0,
                Outcome::Retrying => 1,
                Outcome::DeadLettered => 2,
                Outcome::Failed => 3,
            }] += 1;
        }
        for ((pipeline, task), count) in self.records.iter().zip(counts) {
            if count > 0 {
                pipeline.increment(count);
                task.increment(count);
            }
        }
    }

    /// Records the seconds a unit took per record (`PROCESS_SECONDS`).
    pub(crate) fn record_process_seconds(&self, per_record: f64) {
        self.process_seconds.record(per_record);
    }
}

/// What a stream thread counts its busy time as (`THREAD_BUSY`'s `role`,
/// named in `BUSY_ROLES` in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BusyRole {
    /// Units of a task it owns.
    Owner,
    /// Units of another thread's task.
    Helper,
    Retry,
    Restore,
}

const BUSY_ROLES: [&str; 4] = ["owner", "helper", "retry", "restore"];

/// A stream thread's `THREAD_BUSY` counters, one per role, registered once
/// per thread (see `TaskMeters` for why).
pub(crate) struct BusyMeters([metrics::Counter; 4]);

impl BusyMeters {
    pub(crate) fn new(thread: &str) -> BusyMeters {
        BusyMeters(
            BUSY_ROLES
                .map(|role| metrics::counter!(THREAD_BUSY, "thread" => thread.to_string(), "role" => role)),
        )
    }

    /// Counts `busy` of the thread's time in `role`.
    pub(crate) fn count(&self, role: BusyRole, busy: std::time::Duration) {
        self.0[role as usize].increment(busy.as_micros() as u64);
    }
}
