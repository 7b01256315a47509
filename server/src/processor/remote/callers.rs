//! Callers: long-lived tasks of the remote runtime that make the calls of the
//! stream threads, so that a chain of calls costs the thread one hand-off and
//! one wake-up, and nothing per call is allocated on one thread to be freed on
//! another.
//!
//! A stream thread takes an idle caller from the processor's pool, hands it
//! a chain of requests, and parks until the answers are in the caller's slot;
//! then it puts the caller back. A caller makes the chain's calls one after
//! another, so a thread has at most one call in flight, and the thread wakes
//! once per chain rather than once per call: with 2 ms calls and T = 64 on 2
//! cores, a wake-up per call was most of the stream threads' time. Spawning a
//! task per call instead (what this replaced) allocated the call's future
//! (several KiB) on the stream thread for a worker to free, and went through
//! the runtime's task list and a `JoinHandle` each time; on 2 cores with
//! T = 64 that was a tenth of the stream threads' time.

use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::Thread;
use std::time::{Duration, Instant};
use taskstream::v1 as pb;
use taskstream::v1::processor_service_client::ProcessorServiceClient;
use tonic::transport::Channel;

/// The end of a call: the processor's answer or status, or `None` when the
/// deadline passed on this side before any answer.
pub(super) type Answer = Option<Result<pb::ProcessResponse, tonic::Status>>;

/// What a caller leaves in its slot for the waiting thread.
enum Ended {
    /// The answers of the chain's first calls, in order: at least one.
    Answered(Vec<Answer>),
    /// The caller's task is gone (the runtime shuts down, or the task
    /// panicked) and took the call with it: nothing says the processor saw
    /// the records.
    Lost,
}

type Slot = Arc<Mutex<Option<Ended>>>;

/// A request whose names are still shared: the caller task writes them into
/// the message (and its deadline, when the call starts). A `String` made on
/// the stream thread is freed on the worker that encodes it, and with glibc's
/// per-thread caches such crossed allocations cost several times a local one
/// (they showed as a tenth of the stream threads' time at T = 64).
pub(super) struct Request {
    /// Complete but for its `pipeline`, `task` and `source_topic`.
    pub(super) message: pb::ProcessRequest,
    pub(super) pipeline: Arc<str>,
    pub(super) task: Arc<str>,
    pub(super) source_topic: Arc<str>,
}

impl Request {
    fn into_message(self, timeout: Option<Duration>) -> pb::ProcessRequest {
        pb::ProcessRequest {
            pipeline: self.pipeline.to_string(),
            task: self.task.to_string(),
            source_topic: self.source_topic.to_string(),
            deadline_ms: timeout.map_or(0, |t| crate::runtime::now_ms() + t.as_millis() as i64),
            ..self.message
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The waiting thread's side of one call, carried by the job: it is answered
/// exactly once, by `answer`, or as `Lost` when the job is dropped unanswered
/// (with the task, or still in the channel), so the thread never waits for a
/// call nobody makes.
struct Reply {
    slot: Slot,
    waiter: Thread,
    answered: bool,
}

impl Reply {
    fn answer(mut self, answers: Vec<Answer>) {
        self.put(Ended::Answered(answers));
    }

    fn put(&mut self, ended: Ended) {
        self.answered = true;
        *lock(&self.slot) = Some(ended);
        // After the slot is written: the thread may look at it before this
        // unpark (then it finds the answer) or after (then this wakes it).
        self.waiter.unpark();
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.answered {
            self.put(Ended::Lost);
        }
    }
}

/// Calls to make one after another. The chain ends early at the first call
/// that is not answered (a timeout, a status: the thread decides what that
/// means for the rest), or once `stop_after` has passed.
struct Job {
    requests: Vec<Request>,
    /// Each call's own limit, from its start.
    timeout: Option<Duration>,
    stop_after: Option<Instant>,
    reply: Reply,
}

/// One caller task's handles: where to send its jobs and where it answers.
struct Caller {
    jobs: tokio::sync::mpsc::UnboundedSender<Job>,
    slot: Slot,
}

/// A processor's callers. Idle ones wait in the pool; there are never more
/// than threads that called at once. Dropping the pool ends the tasks (their
/// channels close).
pub(super) struct Callers {
    idle: Mutex<Vec<Caller>>,
    client: ProcessorServiceClient<Channel>,
}

impl Callers {
    pub(super) fn new(client: ProcessorServiceClient<Channel>) -> Callers {
        Callers {
            idle: Mutex::new(Vec::new()),
            client,
        }
    }

    /// Makes the calls of `requests` one after another on `runtime` and
    /// blocks this thread until the chain ends: the answers of its first
    /// calls, at least one (see [`Job`] for where it stops).
    pub(super) fn call(
        &self,
        runtime: &tokio::runtime::Handle,
        requests: Vec<Request>,
        timeout: Option<Duration>,
        stop_after: Option<Instant>,
    ) -> Vec<Answer> {
        let popped = lock(&self.idle).pop();
        let caller = popped.unwrap_or_else(|| self.start(runtime));
        let job = Job {
            requests,
            timeout,
            stop_after,
            reply: Reply {
                slot: caller.slot.clone(),
                waiter: std::thread::current(),
                answered: false,
            },
        };
        // A send to a task that is gone gives the job back, whose drop
        // answers `Lost`: the wait below ends either way.
        drop(caller.jobs.send(job));
        let ended = loop {
            if let Some(ended) = lock(&caller.slot).take() {
                break ended;
            }
            // Wakes spuriously at times (a token left by another unpark of
            // this thread): the loop looks at the slot again.
            std::thread::park();
        };
        match ended {
            Ended::Answered(answers) => {
                lock(&self.idle).push(caller);
                answers
            }
            // The caller is not put back: its task is gone.
            Ended::Lost => vec![Some(Err(tonic::Status::unavailable(
                "the call did not complete: the remote runtime dropped it",
            )))],
        }
    }

    fn start(&self, runtime: &tokio::runtime::Handle) -> Caller {
        let (jobs, mut pending) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let mut client = self.client.clone();
        runtime.spawn(async move {
            while let Some(job) = pending.recv().await {
                let mut answers = Vec::with_capacity(job.requests.len());
                for request in job.requests {
                    if !answers.is_empty() && job.stop_after.is_some_and(|stop| Instant::now() >= stop) {
                        break;
                    }
                    let mut request = tonic::Request::new(request.into_message(job.timeout));
                    let answer = match job.timeout {
                        Some(limit) => {
                            request.set_timeout(limit);
                            tokio::time::timeout(limit, client.process(request)).await.ok()
                        }
                        None => Some(client.process(request).await),
                    };
                    // The response's metadata was allocated here: it is freed
                    // here too, not on the stream thread.
                    let answer = answer.map(|answer| answer.map(tonic::Response::into_inner));
                    let answered = matches!(answer, Some(Ok(_)));
                    answers.push(answer);
                    if !answered {
                        break;
                    }
                }
                job.reply.answer(answers);
            }
        });
        Caller {
            jobs,
            slot: Slot::default(),
        }
    }
}
