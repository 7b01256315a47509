//! taskstream-server: a multi-threaded stream-task runtime in the style of Kafka
//! Streams, where one task may be processed by several threads at once, plus
//! the gRPC service that exposes it.
//!
//! Layout (one folder per concern):
//! - `config`: the typed, validated configuration.
//! - `datadir`: the data dir's identity, checked at start (which log, which stores).
//! - `health`: which storage components are failing, since when (feeds gRPC health).
//! - `log`: the source/sink abstraction (`Log`), the embedded logs (`MemoryLog`,
//!   `RedbLog` on disk), Kafka's partitioner.
//! - `processor`: the `Processor` trait, the built-ins, and remote processors
//!   (a user's `ProcessorService` over gRPC).
//! - `store`: the `KeyValueStore` trait and backends.
//! - `metadata`: StreamsMetadata, record outcomes, query and topic-read answers.
//! - `metrics`: Prometheus metrics (recorded by the runtime, served by the binary).
//! - `runtime`: threads, tasks, scheduling, sequencer/watermark, commits, the
//!   retry path (retry and dead-letter topics), store restore, outcome
//!   subscriptions; `StreamsApp`.
//! - `service`: gRPC handlers, a thin translation, and the one place errors become `Status`.
//! - `scratch`: temporary directories for tests and the benchmark harness.
//!
//! The runtime knows nothing of gRPC and is usable as a library:
//! build a [`Config`], start a [`StreamsApp`], produce, query, subscribe, shut down.

pub mod config;
pub mod datadir;
#[cfg(test)]
mod fault_injection;
pub mod health;
pub mod log;
pub mod metadata;
pub mod metrics;
pub mod processor;
pub mod runtime;
pub mod scratch;
pub mod service;
pub mod store;

pub use config::{
    CommitMode, Config, ConfigError, GroupProtocol, GrpcProcessorSpec, PipelineConfig, ProcessingGuarantee,
    ProcessingOrder, ProcessorSpec, RetryPolicy, StoreKind, TopicConfig,
};
pub use log::{Log, LogError, MemoryLog, ProducerRecord, Record, RecordPosition, RedbLog, Retention};
pub use metadata::{
    AppState, HostInfo, KeyMetadata, Outcome, OutcomeBatch, PartitionOwner, PartitionQueryResult,
    RecordOutcome, RuntimeDescription, StoreMetadata, StreamsMetadata, TaskMetadata, ThreadMetadata,
    ThreadState, TopicRead,
};
pub use processor::remote::{ProcessorStatus, RemoteRuntime};
pub use processor::{Outputs, ProcessError, Processor, ProcessorContext};
pub use runtime::retry::{RetryEntry, headers as failure_headers};
pub use runtime::{
    AppBuilder, CommitReport, EndAt, OutcomeSubscription, RuntimeError, StartAt, StreamsApp,
    SubscribeRequest, SubscriptionEvent,
};
pub use store::{Checkpoint, KeyValueStore, MemoryStore, PersistentStore, StoreError};
