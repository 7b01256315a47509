//! Remote processors: a user's `taskstream.v1.ProcessorService`, called over
//! gRPC from the stream threads. This module owns the channels (one HTTP/2
//! connection per endpoint, shared by every thread and pipeline using it), the
//! translation of a call's answer into per-record results (checked: a
//! malformed answer fails its records with a documented kind), and the
//! processor's outage state: an unreachable processor fails no record, the
//! caller gives its records back and later calls wait with backoff. A call
//! that fails at the transport is bisected (`bisect`: the rule and its
//! invariants), so a record that crashes the processor is found, counted and
//! dead-lettered while the processor being down counts against none.

mod bisect;
mod callers;

use super::ProcessError;
use crate::config::GrpcProcessorSpec;
use crate::log::{ProducerRecord, Record};
use bisect::{Begin, Bisect, Verdict};
use bytes::Bytes;
use callers::Callers;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use taskstream::v1 as pb;
use taskstream::v1::processor_service_client::ProcessorServiceClient;
use tonic::transport::{Channel, Endpoint};

/// Error kinds of records failed by the runtime on the processor's behalf
/// (the README's table "Remote processors" lists them).
pub mod kinds {
    /// The answer had another number of results than records, a result with
    /// neither success nor failure, or a state op with neither put nor delete.
    pub const MALFORMED_RESPONSE: &str = "MalformedResponse";
    /// A state op on a key that is not the key of one of the call's records.
    pub const UNKNOWN_STATE_KEY: &str = "UnknownStateKey";
    /// The answer was larger than `max_response_bytes`.
    pub const RESPONSE_TOO_LARGE: &str = "ResponseTooLarge";
    /// No answer within `processing_timeout_ms`.
    pub const TIMEOUT: &str = "Timeout";
    /// The service answered the call with a gRPC error (other than UNAVAILABLE).
    pub const PROCESSOR_ERROR: &str = "ProcessorError";
    /// A failure whose `kind` the processor left empty.
    pub const REMOTE_FAILURE: &str = "RemoteFailure";
    /// An output record the sink topic cannot take (a partition out of range).
    pub const INVALID_OUTPUT: &str = "InvalidOutput";
    /// A call of this record alone failed at the transport (the processor
    /// went away) `retry_max_attempts` times, each after other calls were
    /// answered: the record crashes the processor. Not retried.
    pub const PROCESSOR_CRASHED: &str = "ProcessorCrashed";
}

/// The first wait after a processor could not be reached, doubling up to the cap.
const OUTAGE_BACKOFF_FIRST: Duration = Duration::from_millis(100);
const OUTAGE_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// A thread waits at most this long for the next probe of an unreachable
/// processor before it gives its records back, so that it can commit, stop,
/// or work for other pipelines meanwhile.
const MAX_WAIT_IN_CALL: Duration = Duration::from_millis(200);

/// The processor could not be reached: no record of the call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("processor `{endpoint}` cannot be reached: {message}")]
pub struct Unreachable {
    pub endpoint: String,
    pub message: String,
}

/// What a record's success asks for: state operations (a `None` value
/// deletes the key) in order, and output records for the sink topic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Effects {
    pub state_ops: Vec<(Bytes, Option<Bytes>)>,
    pub outputs: Vec<ProducerRecord>,
}

/// One record's answer.
pub type RecordResult = Result<Effects, ProcessError>;

/// One call: records of one task, in processing order, with the state of
/// their keys when the pipeline includes it.
pub struct Call<'a> {
    pub task_id: &'a Arc<str>,
    pub partition: u32,
    pub attempt: u32,
    /// `processing_timeout_ms` from now, if there is a limit.
    pub timeout: Option<Duration>,
    pub records: &'a [&'a Record],
    /// The store's value of each distinct key (empty without `include_state`).
    pub state: Vec<(Bytes, Option<Bytes>)>,
}

/// Whether a remote processor answers, as DescribeRuntime and health show it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessorStatus {
    pub endpoint: String,
    /// Since when (ms since the Unix epoch) the processor cannot be reached;
    /// `None` while it answers.
    pub waiting_since_ms: Option<i64>,
    /// The latest error of a call that could not reach it.
    pub last_error: Option<String>,
    /// Calls that could not reach it, since the start.
    pub unreachable_calls: u64,
}

/// The tokio runtime that drives the remote processors' connections, and
/// their channels by endpoint. Stream threads are OS threads: they block on
/// their calls, which this runtime's workers carry over the network.
pub struct RemoteRuntime {
    /// `Some` until drop, which shuts it down without waiting (it may be
    /// dropped inside another runtime, where a blocking shutdown panics).
    runtime: Option<tokio::runtime::Runtime>,
    channels: Mutex<HashMap<String, Channel>>,
}

impl RemoteRuntime {
    pub fn new() -> std::io::Result<Arc<RemoteRuntime>> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("taskstream-remote")
            .enable_all()
            .build()?;
        Ok(Arc::new(RemoteRuntime {
            runtime: Some(runtime),
            channels: Mutex::new(HashMap::new()),
        }))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        match &self.runtime {
            Some(runtime) => runtime.handle(),
            None => unreachable!("the runtime is taken only by drop"),
        }
    }

    /// The channel of `endpoint`, created (lazily connecting) on first use.
    fn channel(&self, endpoint: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(channel) = channels.get(endpoint) {
            return Ok(channel.clone());
        }
        let _entered = self.handle().enter();
        let channel = Endpoint::from_shared(endpoint.to_string())
            .map_err(|e| format!("`{endpoint}` is not a valid endpoint: {e}"))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true)
            .connect_lazy();
        channels.insert(endpoint.to_string(), channel.clone());
        Ok(channel)
    }
}

impl Drop for RemoteRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

struct Outage {
    since_ms: i64,
    backoff: Duration,
    next_probe: Instant,
}

#[derive(Default)]
struct Reachability {
    outage: Option<Outage>,
    last_error: Option<String>,
    unreachable_calls: u64,
}

/// A pipeline's remote processor. Shared by every thread of the pipeline;
/// each thread has at most one call in flight.
pub struct RemoteProcessor {
    spec: GrpcProcessorSpec,
    pipeline: Arc<str>,
    source_topic: Arc<str>,
    runtime: Arc<RemoteRuntime>,
    /// The tasks that make the calls, one per thread calling at once.
    callers: Callers,
    /// Invariant: `outage` is `Some` exactly from a call that could not reach
    /// the processor until the next call that got an answer (of any kind).
    reachability: Mutex<Reachability>,
    /// `reachability.outage.is_some()`, written under its lock: calls read it
    /// without taking the lock, which T threads would otherwise share per call.
    in_outage: AtomicBool,
    /// Whether `outage` is `Some`, for those who follow it (gRPC health).
    waiting: tokio::sync::watch::Sender<bool>,
    /// Records that were in calls failed at the transport.
    bisect: Mutex<Bisect>,
    /// `bisect.has_suspects()`, written under its lock: calls read it
    /// without the lock, and only take it while there are suspects.
    suspecting: AtomicBool,
    /// Notified when the pipeline's suspect call ends (one at a time).
    suspect_call_ended: Condvar,
}

/// The pipeline's one suspect call in flight; ends it when dropped.
struct SuspectCall<'p>(&'p RemoteProcessor);

impl Drop for SuspectCall<'_> {
    fn drop(&mut self) {
        self.0.bisect().end();
        self.0.suspect_call_ended.notify_all();
    }
}

/// How a call ended, for the bisection.
#[derive(Clone, Copy)]
enum CallEnd {
    /// The processor answered (results or a status about the records).
    Answered,
    /// No answer within the deadline: no evidence either way.
    TimedOut,
    /// It failed at the transport.
    Transport,
    /// No connection could be made: the processor never saw the call, so it
    /// says nothing about its records (the processor is down).
    NeverSent,
}

impl RemoteProcessor {
    pub fn new(
        spec: GrpcProcessorSpec,
        pipeline: &str,
        source_topic: &str,
        runtime: Arc<RemoteRuntime>,
    ) -> Result<RemoteProcessor, String> {
        let channel = runtime.channel(&spec.endpoint)?;
        let client = ProcessorServiceClient::new(channel)
            .max_decoding_message_size(spec.max_response_bytes)
            .max_encoding_message_size(usize::MAX);
        Ok(RemoteProcessor {
            spec,
            pipeline: pipeline.into(),
            source_topic: source_topic.into(),
            runtime,
            callers: Callers::new(client),
            reachability: Mutex::new(Reachability::default()),
            in_outage: AtomicBool::new(false),
            waiting: tokio::sync::watch::Sender::new(false),
            bisect: Mutex::new(Bisect::new(1)),
            suspecting: AtomicBool::new(false),
            suspect_call_ended: Condvar::new(),
        })
    }

    /// Crashes after which a record is dead-lettered (`retry_max_attempts`).
    #[must_use]
    pub fn with_crash_attempts(self, attempts: u32) -> RemoteProcessor {
        RemoteProcessor {
            bisect: Mutex::new(Bisect::new(attempts)),
            ..self
        }
    }

    fn bisect(&self) -> MutexGuard<'_, Bisect> {
        self.bisect.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Follows whether the pipeline waits for its processor.
    pub fn subscribe_waiting(&self) -> tokio::sync::watch::Receiver<bool> {
        self.waiting.subscribe()
    }

    fn set_waiting(&self, waiting: bool) {
        self.waiting
            .send_if_modified(|w| std::mem::replace(w, waiting) != waiting);
        metrics::gauge!(crate::metrics::PROCESSOR_WAITING, "pipeline" => self.pipeline.to_string())
            .set(if waiting { 1.0 } else { 0.0 });
    }

    pub fn include_state(&self) -> bool {
        self.spec.include_state
    }

    pub fn max_records_per_call(&self) -> usize {
        self.spec.max_records_per_call
    }

    pub fn endpoint(&self) -> &str {
        &self.spec.endpoint
    }

    fn reachability(&self) -> MutexGuard<'_, Reachability> {
        self.reachability.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn status(&self) -> ProcessorStatus {
        let reachability = self.reachability();
        ProcessorStatus {
            endpoint: self.spec.endpoint.clone(),
            waiting_since_ms: reachability.outage.as_ref().map(|o| o.since_ms),
            last_error: reachability.last_error.clone(),
            unreachable_calls: reachability.unreachable_calls,
        }
    }

    /// Whether the processor cannot be reached right now.
    pub fn is_waiting(&self) -> bool {
        self.in_outage.load(Ordering::Acquire)
    }

    /// Calls the processor: one result per record of the call, in order, or
    /// `Unreachable` (no record failed; give them back and call again later).
    /// While the processor is unreachable, a call first waits for the next
    /// probe time, at most `MAX_WAIT_IN_CALL`.
    pub fn call(&self, call: &Call<'_>) -> Result<Vec<RecordResult>, Unreachable> {
        let mut ended = self.call_chain(std::slice::from_ref(call), None);
        match ended.pop() {
            Some(result) => result,
            None => unreachable!("a chain answers its first call"),
        }
    }

    /// Makes `calls` one after another (one in flight at a time) and answers
    /// the first ones, at least one: the chain ends at the first call that
    /// fails as a whole (unreachable, timed out, a status), and starts no call
    /// after `stop_after`. A thread that knows its next calls waits once for
    /// all of them instead of once per call. The calls share one timeout (each
    /// from its own start).
    pub fn call_chain(
        &self,
        calls: &[Call<'_>],
        stop_after: Option<Instant>,
    ) -> Vec<Result<Vec<RecordResult>, Unreachable>> {
        if let Err(unreachable) = self.wait_for_probe() {
            return vec![Err(unreachable)];
        }
        let Some(timeout) = calls.first().map(|call| call.timeout) else {
            return Vec::new();
        };
        // Only while some records are suspect: the common path takes no lock.
        let fitted;
        let (calls, ticket, _suspect_call) = if self.suspecting.load(Ordering::Acquire) {
            match self.fit(calls) {
                Ok((fit, ticket, suspect_call)) => {
                    fitted = fit;
                    (&fitted[..], ticket, suspect_call)
                }
                Err(unreachable) => return vec![Err(unreachable)],
            }
        } else {
            // No suspect now: an answer is evidence for none that appears meanwhile.
            (calls, 0, None)
        };
        let requests = calls.iter().map(|call| self.request(call)).collect();
        // The calls run on the runtime, whose workers drive the connection
        // anyway, and this thread waits for the chain's end only: blocking on
        // a call itself would wake this thread for each part of the answer
        // (headers, message, trailers), a context switch each.
        let answers = self
            .callers
            .call(self.runtime.handle(), requests, timeout, stop_after);
        answers
            .into_iter()
            .zip(calls)
            .map(|(answer, call)| {
                let end = match &answer {
                    None => CallEnd::TimedOut,
                    Some(Ok(_)) => CallEnd::Answered,
                    Some(Err(status)) if classify(status, timeout).is_some() => CallEnd::Answered,
                    Some(Err(status)) if never_connected(status) => CallEnd::NeverSent,
                    Some(Err(_)) => CallEnd::Transport,
                };
                let result = self.result_of(call, answer);
                self.bisect_after(call, ticket, end, result)
            })
            .collect()
    }

    /// Fits a chain to the suspects: the first call cut to its half (or to
    /// the records before the first suspect), a suspect call alone and only
    /// one at a time (waiting up to `MAX_WAIT_IN_CALL` for another to end),
    /// after an empty probe call when nothing was answered since its records
    /// failed. Answers the calls, the chain's ticket and the suspect call.
    fn fit<'a>(
        &self,
        calls: &[Call<'a>],
    ) -> Result<(Vec<Call<'a>>, u64, Option<SuspectCall<'_>>), Unreachable> {
        let deadline = Instant::now() + MAX_WAIT_IN_CALL;
        let mut bisect = self.bisect();
        let (fitted, ticket, probe, suspect) = loop {
            let ticket = bisect.ticket();
            let mut fitted = Vec::with_capacity(calls.len());
            let mut begin = Begin::Plain;
            for (k, call) in calls.iter().enumerate() {
                let offsets: Vec<u64> = call.records.iter().map(|r| r.offset).collect();
                let n = bisect.cut(call.partition, &offsets).min(offsets.len());
                if k == 0 {
                    begin = bisect.begin(call.partition, &offsets[..n]);
                } else if n < offsets.len()
                    || offsets
                        .first()
                        .is_some_and(|&o| bisect.is_suspect(call.partition, o))
                {
                    // A later call holding suspects waits for its turn.
                    break;
                }
                fitted.push(Call {
                    task_id: call.task_id,
                    partition: call.partition,
                    attempt: call.attempt,
                    timeout: call.timeout,
                    records: &call.records[..n],
                    state: state_of_records(&call.state, &call.records[..n]),
                });
                if begin != Begin::Plain {
                    break;
                }
            }
            match begin {
                Begin::Plain => break (fitted, ticket, false, false),
                Begin::Suspect { probe } => break (fitted, ticket, probe, true),
                Begin::Wait => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Unreachable {
                            endpoint: self.spec.endpoint.clone(),
                            message: "waits while another call tries records that failed at the transport"
                                .to_string(),
                        });
                    }
                    bisect = self
                        .suspect_call_ended
                        .wait_timeout(bisect, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        };
        drop(bisect);
        // From here on the suspect call ends whatever happens (a failed probe too).
        // Lazily: a guard made and dropped here would end another's suspect call.
        let suspect_call = suspect.then(|| SuspectCall(self));
        if probe && let Some(first) = fitted.first() {
            self.probe(first, ticket)?;
        }
        Ok((fitted, ticket, suspect_call))
    }

    /// An empty call, to learn whether the processor is up before a suspect
    /// call could count against its records.
    fn probe(&self, like: &Call<'_>, ticket: u64) -> Result<(), Unreachable> {
        tracing::debug!(
            pipeline = %self.pipeline,
            partition = like.partition,
            "probing the processor with an empty call before sending records that failed at the transport"
        );
        let request = self.request(&Call {
            task_id: like.task_id,
            partition: like.partition,
            attempt: like.attempt,
            timeout: like.timeout,
            records: &[],
            state: Vec::new(),
        });
        let answer = self
            .callers
            .call(self.runtime.handle(), vec![request], like.timeout, None)
            .pop()
            .flatten();
        match answer {
            Some(Ok(_)) => {}
            Some(Err(status)) if classify(&status, like.timeout).is_some() => {}
            Some(Err(status)) => return Err(self.unreachable(&status)),
            None => {
                return Err(self.unreachable(&tonic::Status::unavailable(
                    "the probe was not answered within processing_timeout_ms",
                )));
            }
        }
        self.reached();
        self.bisect().answered(ticket, like.partition, &[]);
        Ok(())
    }

    /// The bisection's part in a call's end: an answer clears its records
    /// (and is evidence that the processor is up), a transport failure is
    /// judged (`bisect::Verdict`), logged, and for a record that crashed the
    /// processor too often becomes its failure, `ProcessorCrashed`.
    fn bisect_after(
        &self,
        call: &Call<'_>,
        ticket: u64,
        end: CallEnd,
        result: Result<Vec<RecordResult>, Unreachable>,
    ) -> Result<Vec<RecordResult>, Unreachable> {
        let offsets = || call.records.iter().map(|r| r.offset).collect::<Vec<u64>>();
        let error = match (end, &result) {
            (CallEnd::Transport, Err(unreachable)) => unreachable.message.clone(),
            (CallEnd::Answered | CallEnd::TimedOut, _) => {
                if self.suspecting.load(Ordering::Acquire) {
                    let ticket = if matches!(end, CallEnd::Answered) {
                        ticket
                    } else {
                        0
                    };
                    let mut bisect = self.bisect();
                    let cleared = bisect.answered(ticket, call.partition, &offsets());
                    self.suspecting.store(bisect.has_suspects(), Ordering::Release);
                    drop(bisect);
                    if cleared > 0 {
                        tracing::info!(
                            pipeline = %self.pipeline,
                            partition = call.partition,
                            first_offset = call.records.first().map(|r| r.offset),
                            records = cleared,
                            "records that failed at the transport were answered when sent again; they are cleared"
                        );
                    }
                }
                return result;
            }
            (CallEnd::NeverSent, _) => {
                tracing::debug!(
                    pipeline = %self.pipeline,
                    partition = call.partition,
                    "a call could not connect to the processor: it says nothing about its records; the pipeline waits"
                );
                return result;
            }
            (CallEnd::Transport, Ok(_)) => return result,
        };
        let offsets = offsets();
        let (Some(&first), Some(&last)) = (offsets.first(), offsets.last()) else {
            return result;
        };
        let mut bisect = self.bisect();
        let verdict = bisect.failed(call.partition, &offsets);
        self.suspecting.store(bisect.has_suspects(), Ordering::Release);
        drop(bisect);
        let (pipeline, partition, n) = (&self.pipeline, call.partition, offsets.len());
        match verdict {
            Verdict::Split { first: a, second: b } => tracing::warn!(
                %pipeline,
                "processor call of {n} records ({partition}/{first}..={last}) failed at the transport ({error}); splitting into halves of {a} and {b}"
            ),
            Verdict::Suspect => tracing::warn!(
                %pipeline,
                "processor call of record {partition}/{first} failed at the transport ({error}); sent again alone, it counts as a crash if it fails after other calls succeed"
            ),
            Verdict::Crashed { crashes } => tracing::warn!(
                %pipeline,
                "record {partition}/{first} crashed the processor {crashes} times while other calls succeeded ({error}); it waits and is sent again, dead-lettered after {}",
                self.bisect().max_attempts()
            ),
            Verdict::DeadLetter { crashes } => {
                tracing::error!(
                    %pipeline,
                    "record {partition}/{first} crashed the processor {crashes} times while other calls succeeded ({error}); dead-lettering as {}",
                    kinds::PROCESSOR_CRASHED
                );
                let failure = ProcessError::new(
                    kinds::PROCESSOR_CRASHED,
                    format!(
                        "a call of this record alone failed at the transport {crashes} times, each after other calls succeeded: {error}"
                    ),
                )
                .permanent()
                .after_attempts(crashes);
                return Ok(vec![Err(failure)]);
            }
            Verdict::Down => tracing::warn!(
                %pipeline,
                "processor call of {n} records ({partition}/{first}..={last}) failed at the transport ({error}) with no call answered since they last failed: the processor is down; nothing counts, the pipeline waits"
            ),
            Verdict::Untracked => tracing::warn!(
                %pipeline,
                "processor call of {n} records ({partition}/{first}..={last}) failed at the transport ({error}); too many records are suspect already to split it: the pipeline waits"
            ),
        }
        result
    }

    fn result_of(&self, call: &Call<'_>, answer: callers::Answer) -> Result<Vec<RecordResult>, Unreachable> {
        let timeout = call.timeout;
        match answer {
            None => {
                let error = timed_out(timeout);
                Ok(call.records.iter().map(|_| Err(error.clone())).collect())
            }
            Some(Ok(response)) => {
                self.reached();
                Ok(results(call.records, response))
            }
            Some(Err(status)) => match classify(&status, timeout) {
                Some(failure) => {
                    self.reached();
                    Ok(call.records.iter().map(|_| Err(failure.clone())).collect())
                }
                None => Err(self.unreachable(&status)),
            },
        }
    }

    fn wait_for_probe(&self) -> Result<(), Unreachable> {
        if !self.in_outage.load(Ordering::Acquire) {
            return Ok(());
        }
        let next_probe = match &self.reachability().outage {
            Some(outage) => outage.next_probe,
            None => return Ok(()),
        };
        let wait = next_probe.saturating_duration_since(Instant::now());
        if wait > MAX_WAIT_IN_CALL {
            std::thread::sleep(MAX_WAIT_IN_CALL);
            let reachability = self.reachability();
            return Err(Unreachable {
                endpoint: self.spec.endpoint.clone(),
                message: reachability
                    .last_error
                    .clone()
                    .unwrap_or_else(|| "waiting for the next probe".to_string()),
            });
        }
        std::thread::sleep(wait);
        Ok(())
    }

    fn reached(&self) {
        if !self.in_outage.load(Ordering::Acquire) {
            return;
        }
        let mut reachability = self.reachability();
        if let Some(outage) = reachability.outage.take() {
            self.in_outage.store(false, Ordering::Release);
            drop(reachability);
            self.set_waiting(false);
            tracing::info!(
                pipeline = %self.pipeline,
                endpoint = %self.spec.endpoint,
                waited_ms = crate::runtime::now_ms() - outage.since_ms,
                "processor reachable again; the pipeline resumes"
            );
        }
    }

    fn unreachable(&self, status: &tonic::Status) -> Unreachable {
        let message = describe_status(status);
        let mut reachability = self.reachability();
        reachability.unreachable_calls += 1;
        reachability.last_error = Some(message.clone());
        let now = Instant::now();
        let newly = match &mut reachability.outage {
            Some(outage) => {
                // Calls of several threads fail together: one doubling per probe time.
                if now >= outage.next_probe {
                    outage.backoff = (outage.backoff * 2).min(OUTAGE_BACKOFF_MAX);
                    outage.next_probe = now + outage.backoff;
                }
                false
            }
            None => {
                tracing::warn!(
                    pipeline = %self.pipeline,
                    endpoint = %self.spec.endpoint,
                    error = %message,
                    "processor cannot be reached; the pipeline waits for it"
                );
                reachability.outage = Some(Outage {
                    since_ms: crate::runtime::now_ms(),
                    backoff: OUTAGE_BACKOFF_FIRST,
                    next_probe: now + OUTAGE_BACKOFF_FIRST,
                });
                self.in_outage.store(true, Ordering::Release);
                true
            }
        };
        drop(reachability);
        if newly {
            self.set_waiting(true);
        }
        metrics::counter!(crate::metrics::PROCESSOR_UNREACHABLE, "pipeline" => self.pipeline.to_string())
            .increment(1);
        Unreachable {
            endpoint: self.spec.endpoint.clone(),
            message,
        }
    }

    fn request(&self, call: &Call<'_>) -> callers::Request {
        let message = pb::ProcessRequest {
            // Written by the caller task (see `callers::Request`).
            pipeline: String::new(),
            task: String::new(),
            source_topic: String::new(),
            deadline_ms: 0,
            partition: call.partition,
            attempt: call.attempt,
            records: call
                .records
                .iter()
                .map(|r| pb::ProcessRecord {
                    offset: r.offset as i64,
                    timestamp_ms: r.timestamp_ms,
                    key: r.key.clone(),
                    value: r.value.clone(),
                    headers: r
                        .headers
                        .iter()
                        .map(|(name, value)| pb::Header {
                            name: name.clone(),
                            value: value.clone(),
                        })
                        .collect(),
                })
                .collect(),
            state: call
                .state
                .iter()
                .map(|(key, value)| pb::KeyState {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
        };
        callers::Request {
            message,
            pipeline: self.pipeline.clone(),
            task: call.task_id.clone(),
            source_topic: self.source_topic.clone(),
        }
    }
}

/// The entries of `state` for the keys of `records` (a call cut shorter
/// carries only its own records' state).
fn state_of_records(state: &[(Bytes, Option<Bytes>)], records: &[&Record]) -> Vec<(Bytes, Option<Bytes>)> {
    state
        .iter()
        .filter(|(key, _)| records.iter().any(|r| r.key.as_ref() == Some(key)))
        .cloned()
        .collect()
}

fn timed_out(timeout: Option<Duration>) -> ProcessError {
    ProcessError::new(
        kinds::TIMEOUT,
        format!(
            "no answer within processing_timeout_ms ({} ms)",
            timeout.map_or(0, |t| t.as_millis())
        ),
    )
}

/// A status that is an answer about the call's records (they fail), or
/// `None` when it says the processor could not be reached.
fn classify(status: &tonic::Status, timeout: Option<Duration>) -> Option<ProcessError> {
    use tonic::Code;
    match status.code() {
        Code::DeadlineExceeded => Some(timed_out(timeout)),
        Code::Unavailable => None,
        // tonic's own limit on a decoded message; the processor never sends this code for it.
        Code::OutOfRange if status.message().contains("message length too large") => Some(ProcessError::new(
            kinds::RESPONSE_TOO_LARGE,
            format!("the processor's answer was too large: {}", status.message()),
        )),
        // A status made on this side from a transport error (a connection
        // reset, a broken HTTP/2 stream) carries its cause; one the processor
        // sent does not.
        Code::Unknown | Code::Internal | Code::Cancelled if std::error::Error::source(status).is_some() => {
            None
        }
        code => Some(ProcessError::new(
            kinds::PROCESSOR_ERROR,
            format!("the processor answered {code:?}: {}", status.message()),
        )),
    }
}

/// Whether a call failed because no connection could be made (refused):
/// then no byte of it reached the processor. tonic's connector names it so
/// (`tcp connect error`); its cause is not always an `io::Error` to match.
fn never_connected(status: &tonic::Status) -> bool {
    // A call cut by a crash ends `Unknown`; a refused connect `Unavailable`.
    if status.code() != tonic::Code::Unavailable {
        return false;
    }
    let mut source = std::error::Error::source(status);
    while let Some(cause) = source {
        if cause.to_string().contains("tcp connect error") {
            return true;
        }
        source = cause.source();
    }
    false
}

fn describe_status(status: &tonic::Status) -> String {
    let mut message = format!("{:?}: {}", status.code(), status.message());
    let mut source = std::error::Error::source(status);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

/// The per-record results of an answer, checked against the call.
fn results(records: &[&Record], response: pb::ProcessResponse) -> Vec<RecordResult> {
    if response.results.len() != records.len() {
        let error = ProcessError::new(
            kinds::MALFORMED_RESPONSE,
            format!(
                "the processor answered {} results for {} records",
                response.results.len(),
                records.len()
            ),
        );
        return records.iter().map(|_| Err(error.clone())).collect();
    }
    let mut keys = CallKeys { records, set: None };
    response
        .results
        .into_iter()
        .zip(records)
        .map(|(result, record)| record_result(result, record, &mut keys))
        .collect()
}

/// The keys of a call's records, hashed at the first state op only: most
/// answers have none, and hashing every key of every call showed in the cost
/// of a record.
struct CallKeys<'a> {
    records: &'a [&'a Record],
    set: Option<HashSet<&'a [u8]>>,
}

impl CallKeys<'_> {
    fn contains(&mut self, key: &[u8]) -> bool {
        let records = self.records;
        self.set
            .get_or_insert_with(|| records.iter().filter_map(|r| r.key.as_deref()).collect())
            .contains(key)
    }
}

fn record_result(result: pb::RecordResult, record: &Record, keys: &mut CallKeys<'_>) -> RecordResult {
    use pb::record_result::Result as Answer;
    use pb::state_op::Op;
    match result.result {
        None => Err(ProcessError::new(
            kinds::MALFORMED_RESPONSE,
            format!(
                "the result of offset {} has neither success nor failure",
                record.offset
            ),
        )),
        Some(Answer::Failure(failure)) => {
            let kind = if failure.kind.is_empty() {
                kinds::REMOTE_FAILURE.to_string()
            } else {
                failure.kind
            };
            let error = ProcessError::new(kind, failure.message);
            Err(if failure.retryable {
                error
            } else {
                error.permanent()
            })
        }
        Some(Answer::Success(success)) => {
            let mut state_ops = Vec::with_capacity(success.state_ops.len());
            for op in success.state_ops {
                if !keys.contains(op.key.as_ref()) {
                    return Err(ProcessError::new(
                        kinds::UNKNOWN_STATE_KEY,
                        format!(
                            "the result of offset {} writes key {:?}, which is not the key of a record of the call",
                            record.offset,
                            String::from_utf8_lossy(&op.key[..op.key.len().min(64)])
                        ),
                    ));
                }
                match op.op {
                    Some(Op::Put(value)) => state_ops.push((op.key, Some(value))),
                    Some(Op::Delete(_)) => state_ops.push((op.key, None)),
                    None => {
                        return Err(ProcessError::new(
                            kinds::MALFORMED_RESPONSE,
                            format!(
                                "a state op of offset {} has neither put nor delete",
                                record.offset
                            ),
                        ));
                    }
                }
            }
            let outputs = success
                .outputs
                .into_iter()
                .map(|output| ProducerRecord {
                    key: output.key,
                    value: output.value,
                    partition: output.partition,
                    timestamp_ms: Some(if output.timestamp_ms == 0 {
                        record.timestamp_ms
                    } else {
                        output.timestamp_ms
                    }),
                    headers: output.headers.into_iter().map(|h| (h.name, h.value)).collect(),
                })
                .collect();
            Ok(Effects { state_ops, outputs })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::record_result::Result as Answer;

    fn record(offset: u64, key: &str) -> Record {
        Record {
            partition: 0,
            offset,
            timestamp_ms: 1_000 + offset as i64,
            key: Some(Bytes::copy_from_slice(key.as_bytes())),
            value: Bytes::from_static(b"v"),
            headers: vec![],
        }
    }

    fn success(ops: Vec<pb::StateOp>, outputs: Vec<pb::OutputRecord>) -> pb::RecordResult {
        pb::RecordResult {
            result: Some(Answer::Success(pb::RecordSuccess {
                state_ops: ops,
                outputs,
            })),
        }
    }

    fn put(key: &str, value: &str) -> pb::StateOp {
        pb::StateOp {
            key: Bytes::copy_from_slice(key.as_bytes()),
            op: Some(pb::state_op::Op::Put(Bytes::copy_from_slice(value.as_bytes()))),
        }
    }

    #[test]
    fn answers_map_to_records_and_malformed_ones_fail_with_their_kind() {
        let (a, b) = (record(0, "a"), record(1, "b"));
        let records = [&a, &b];
        let answer = pb::ProcessResponse {
            results: vec![
                success(
                    vec![
                        put("a", "1"),
                        pb::StateOp {
                            key: Bytes::from_static(b"b"),
                            op: Some(pb::state_op::Op::Delete(true)),
                        },
                    ],
                    vec![pb::OutputRecord {
                        key: Some(Bytes::from_static(b"a")),
                        value: Bytes::from_static(b"out"),
                        ..Default::default()
                    }],
                ),
                pb::RecordResult {
                    result: Some(Answer::Failure(pb::RecordFailure {
                        kind: "Bad".into(),
                        message: "no".into(),
                        retryable: false,
                    })),
                },
            ],
        };
        let results = results(&records, answer);
        let effects = results[0].as_ref().unwrap();
        assert_eq!(
            effects.state_ops,
            vec![
                (Bytes::from_static(b"a"), Some(Bytes::from_static(b"1"))),
                (Bytes::from_static(b"b"), None)
            ]
        );
        assert_eq!(
            effects.outputs[0].timestamp_ms,
            Some(1_000),
            "the source record's timestamp"
        );
        let failure = results[1].as_ref().unwrap_err();
        assert_eq!((failure.kind.as_str(), failure.retryable), ("Bad", false));

        let short = results_of(&records, vec![success(vec![], vec![])]);
        assert!(
            short
                .iter()
                .all(|r| r.as_ref().unwrap_err().kind == kinds::MALFORMED_RESPONSE)
        );

        let stray = results_of(
            &records,
            vec![success(vec![put("zz", "1")], vec![]), success(vec![], vec![])],
        );
        assert_eq!(stray[0].as_ref().unwrap_err().kind, kinds::UNKNOWN_STATE_KEY);
        assert!(stray[1].is_ok(), "only the record with the bad op fails");

        let empty = results_of(
            &records,
            vec![
                pb::RecordResult { result: None },
                success(
                    vec![pb::StateOp {
                        key: Bytes::from_static(b"b"),
                        op: None,
                    }],
                    vec![],
                ),
            ],
        );
        assert!(
            empty
                .iter()
                .all(|r| r.as_ref().unwrap_err().kind == kinds::MALFORMED_RESPONSE)
        );
    }

    fn results_of(records: &[&Record], results: Vec<pb::RecordResult>) -> Vec<RecordResult> {
        super::results(records, pb::ProcessResponse { results })
    }

    #[test]
    fn statuses_split_into_record_failures_and_outages() {
        let timeout = Some(Duration::from_millis(10));
        assert_eq!(classify(&tonic::Status::unavailable("down"), timeout), None);
        assert_eq!(
            classify(&tonic::Status::deadline_exceeded("late"), timeout)
                .unwrap()
                .kind,
            kinds::TIMEOUT
        );
        let internal = classify(&tonic::Status::internal("bug"), timeout).unwrap();
        assert_eq!(internal.kind, kinds::PROCESSOR_ERROR);
        assert!(internal.retryable);
        let transport = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        )));
        assert_eq!(classify(&transport, timeout), None, "{transport:?}");
    }

    #[test]
    fn an_unreachable_processor_waits_with_backoff_and_recovers() {
        let runtime = RemoteRuntime::new().unwrap();
        // Port 1 on loopback: nothing listens, the connection is refused.
        let processor =
            RemoteProcessor::new(GrpcProcessorSpec::new("http://127.0.0.1:1"), "p", "t", runtime).unwrap();
        let a = record(0, "a");
        let call = Call {
            task_id: &Arc::from("p_0"),
            partition: 0,
            attempt: 1,
            timeout: Some(Duration::from_secs(5)),
            records: &[&a],
            state: vec![],
        };
        let waiting = processor.subscribe_waiting();
        let error = processor.call(&call).unwrap_err();
        assert!(processor.is_waiting());
        assert!(*waiting.borrow());
        let status = processor.status();
        assert_eq!(status.unreachable_calls, 1);
        assert!(status.waiting_since_ms.is_some());
        assert_eq!(status.last_error.as_deref(), Some(error.message.as_str()));
        processor.reached();
        assert!(!processor.is_waiting());
        assert!(!*waiting.borrow());
        assert!(
            processor.status().last_error.is_some(),
            "the last error stays for diagnosis"
        );
    }
}
