//! Dead-letter redrive: records of a pipeline's dead-letter topic go back on its retry
//! path with fresh attempts. Each is a new delivery of the record, with its own outcomes
//! (processed, or retrying and then processed or dead-lettered again); the dead-letter
//! record itself stays where it is (topics are append-only).

use super::RuntimeError;
use super::app::hosted_partitions;
use super::retry::redriven_record;
use super::shared::Shared;
use crate::config::RetryPolicy;
use crate::log::{ProducerRecord, RecordPosition};
use crate::runtime::StreamsApp;
use bytes::Bytes;

/// Dead letters read and appended at a time, so a redrive of a whole partition holds
/// only this many in memory.
const CHUNK: usize = 500;

/// Which dead letters of a partition to redrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redrive {
    /// Every record the dead-letter partition retains.
    All,
    /// These offsets of the dead-letter partition (each must be retained).
    Offsets(Vec<u64>),
}

impl StreamsApp {
    /// Appends dead letters of `pipeline`'s `partition` to its retry topic with their
    /// attempts reset, where the partition's task retries them as it does any failed
    /// record. Answers where they went in the retry topic, in dead-letter order.
    pub fn redrive_dead_letters(
        &self,
        pipeline: &str,
        partition: u32,
        which: &Redrive,
    ) -> Result<Vec<RecordPosition>, RuntimeError> {
        let shared = self.shared();
        shared.ensure_running()?;
        let p = shared.pipeline_index(pipeline).map_err(|error| match error {
            RuntimeError::InvalidArgument { message, .. } => {
                RuntimeError::invalid_argument("pipeline", message)
            }
            other => other,
        })?;
        let runtime = &shared.pipelines[p];
        if runtime.retry_policy != RetryPolicy::RetryTopic {
            return Err(RuntimeError::invalid_argument(
                "pipeline",
                format!(
                    "`{pipeline}` runs retry_policy = \"blocking\": it has no retry topic to redrive into"
                ),
            ));
        }
        // The partition's retry queue must live here to pick the records up.
        hosted_partitions(shared, p, &[partition])?;
        let (dlq, retry) = (runtime.dead_letter_topic.clone(), runtime.retry_topic.clone());
        let mut positions = Vec::new();
        match which {
            Redrive::All => {
                let end = shared.log.end_offset(&dlq, partition)?;
                let mut next = shared.log.start_offset(&dlq, partition)?;
                while next < end {
                    let mut chunk = Vec::with_capacity(CHUNK);
                    shared.log.read(
                        &dlq,
                        partition,
                        next,
                        CHUNK.min((end - next) as usize),
                        &mut chunk,
                    )?;
                    let Some(last) = chunk.last() else { break };
                    next = last.offset + 1;
                    chunk.retain(|record| record.offset < end);
                    positions.extend(append_gated(
                        shared,
                        p,
                        partition,
                        &retry,
                        chunk.into_iter().map(redriven_record).collect(),
                    )?);
                }
            }
            Redrive::Offsets(offsets) => {
                if offsets.is_empty() {
                    return Err(RuntimeError::invalid_argument(
                        "offsets",
                        "name at least one dead-letter offset, or set `all`",
                    ));
                }
                // Every offset is checked before anything is appended: all or nothing.
                let mut records = Vec::with_capacity(offsets.len());
                for (i, &offset) in offsets.iter().enumerate() {
                    let mut found = Vec::with_capacity(1);
                    shared.log.read(&dlq, partition, offset, 1, &mut found)?;
                    match found.pop() {
                        Some(record) if record.offset == offset => records.push(redriven_record(record)),
                        _ => {
                            return Err(RuntimeError::invalid_argument(
                                format!("offsets[{i}]"),
                                format!("partition {partition} of `{dlq}` has no record at offset {offset}"),
                            ));
                        }
                    }
                }
                for chunk in records.chunks(CHUNK) {
                    positions.extend(append_gated(shared, p, partition, &retry, chunk.to_vec())?);
                }
            }
        }
        Ok(positions)
    }
}

/// Appends redriven records to the retry partition with their keys gated
/// first (see `Scheduler::gate_retry_keys`): counted before any thread can
/// read and finish them, and uncounted again if the append fails. A unit
/// already running a record of such a key when it is gated may still run
/// beside the redriven record (its updates stay atomic through the store's
/// key locks); later records of the key wait behind it.
fn append_gated(
    shared: &Shared,
    pipeline: usize,
    partition: u32,
    retry: &str,
    records: Vec<ProducerRecord>,
) -> Result<Vec<RecordPosition>, RuntimeError> {
    let keys: Vec<Bytes> = records.iter().filter_map(|r| r.key.clone()).collect();
    shared.lock().gate_retry_keys(pipeline, partition, &keys);
    shared.log.append(retry, records).map_err(|error| {
        let mut scheduler = shared.lock();
        scheduler.ungate_retry_keys(pipeline, partition, &keys);
        // Held records may have gone back to their lanes.
        shared.wake_waiters(&scheduler);
        RuntimeError::from(error)
    })
}
