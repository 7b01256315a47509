//! The stream-task runtime: N stream threads, tasks (pipeline × partition)
//! assigned sticky to owner threads, up to T threads per task, the sequencer
//! and watermark, commits, the retry path, and `StreamsApp`, the library API.
//!
//! - `scheduler`: tasks, threads and what each thread does next; private
//!   state, no I/O, tested alone. `task` and `work` are its per-task parts
//!   (units, key lanes, the key gate), `sequencer` its watermark.
//! - `driver`: the stream-thread loop carrying out each pick; `process` runs
//!   the processor (one `attempt` with its own write buffer per record);
//!   `remote_calls` cuts a unit into calls of a remote processor.
//! - `commit`, `recovery`: commit rounds and final commits; where a task resumes.
//!   `revival`: a task whose transaction aborted, closed dirty and started again.
//! - `retry`, `retry_queue`: the retry topic's format, and each task's queue of it.
//!   `retry_done`: the final entries above a retry position, in Kafka offset metadata.
//! - `changelog`: a store's changelog on Kafka (sent at commits, restored from).
//! - `sink`: output records on their way to the pipeline's sink topic, in its order.
//! - `subscription`: outcome feeds and subscribers.
//! - `membership`: Kafka mode's consumer group turned into added and removed tasks.
//! - `cluster`: Kafka mode's metadata topic: who holds what, published and read.
//! - `watchdog`: a thread of its own that warns of commits that stall.
//! - `app`, `builder`: the library API.
//!
//! Scheduling state sits behind one mutex taken per unit of work (a batch of
//! records), never per record; processors run outside it.

mod app;
mod attempt;
mod builder;
mod changelog;
mod cluster;
mod commit;
mod describe;
mod driver;
mod error;
mod inbox;
mod membership;
mod pages;
mod process;
mod recovery;
mod redrive;
mod remote_calls;
pub mod retry;
mod retry_done;
mod retry_queue;
mod revival;
mod scheduler;
mod sequencer;
mod shared;
mod sink;
mod stores;
mod subscription;
mod task;
mod watchdog;
mod work;

pub use app::StreamsApp;
pub use builder::AppBuilder;
pub use error::{MAX_ECHO_BYTES, RuntimeError, echo, echo_up_to};
pub use pages::{RangePage, RangeResume, record_bytes};
pub use redrive::Redrive;
pub use shared::CommitReport;

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ms() -> i64 {
    process::now_ms()
}
pub use subscription::{EndAt, OutcomeSubscription, StartAt, SubscribeRequest, SubscriptionEvent};
