//! The stream-task runtime: N stream threads, tasks (pipeline × partition)
//! assigned sticky to owner threads, up to T threads per task, the sequencer
//! and watermark, commits, and `StreamsApp`, the in-process API.

mod error;

pub use error::RuntimeError;

use crate::config::Config;
use crate::log::{Log, ProducerRecord, RecordPosition};
use crate::metadata::*;
use crate::processor::Processor;
use bytes::Bytes;
use std::sync::Arc;

/// The result of one commit of one task, reported to the commit callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitReport {
    pub task_id: String,
    pub offset: u64,
    pub result: Result<(), String>,
}

pub struct AppBuilder {}

impl AppBuilder {
    pub fn new(config: Config) -> Self {
        todo!()
    }
    pub fn log(self, log: Arc<dyn Log>) -> Self {
        todo!()
    }
    pub fn processor(self, name: &str, processor: Arc<dyn Processor>) -> Self {
        todo!()
    }
    pub fn on_commit(self, callback: impl Fn(&CommitReport) + Send + Sync + 'static) -> Self {
        todo!()
    }
    pub fn start(self) -> Result<StreamsApp, RuntimeError> {
        todo!()
    }
}

#[derive(Clone)]
pub struct StreamsApp {}

impl StreamsApp {
    pub fn start(config: Config) -> Result<StreamsApp, RuntimeError> {
        todo!()
    }
    pub fn config(&self) -> &Config {
        todo!()
    }
    pub fn state(&self) -> AppState {
        todo!()
    }
    pub fn host_info(&self) -> HostInfo {
        todo!()
    }
    pub fn log(&self) -> Arc<dyn Log> {
        todo!()
    }
    pub fn produce(
        &self,
        topic: &str,
        records: Vec<ProducerRecord>,
    ) -> Result<Vec<RecordPosition>, RuntimeError> {
        todo!()
    }
    pub fn process_metadata_for_store(
        &self,
        store: &str,
        in_order: bool,
    ) -> Result<StoreMetadata, RuntimeError> {
        todo!()
    }
    pub fn metadata_for_key(&self, store: &str, key: &[u8]) -> Result<KeyMetadata, RuntimeError> {
        todo!()
    }
    pub fn get(&self, store: &str, key: &[u8]) -> Result<Option<Bytes>, RuntimeError> {
        todo!()
    }
    pub fn query_key(&self, store: &str, key: &[u8]) -> Result<PartitionQueryResult, RuntimeError> {
        todo!()
    }
    pub fn query_range(
        &self,
        store: &str,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        partitions: &[u32],
        limit: usize,
    ) -> Result<Vec<PartitionQueryResult>, RuntimeError> {
        todo!()
    }
    pub fn subscribe(
        &self,
        store: &str,
        request: SubscribeRequest,
    ) -> Result<OutcomeSubscription, RuntimeError> {
        todo!()
    }
    pub fn describe(&self) -> RuntimeDescription {
        todo!()
    }
    pub fn add_stream_thread(&self) -> Result<String, RuntimeError> {
        todo!()
    }
    pub fn remove_stream_thread(&self, name: Option<&str>) -> Result<String, RuntimeError> {
        todo!()
    }
    pub fn begin_shutdown(&self) {
        todo!()
    }
    pub fn shutdown(&self) -> Result<(), RuntimeError> {
        todo!()
    }
}
