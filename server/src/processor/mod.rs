//! User logic: the `Processor` trait (synchronous, may block) and the built-ins
//! `count`, `sum`, `latest` and `simulate`; `remote` calls a user's
//! `ProcessorService` over gRPC. A processor is shared by every thread of its
//! pipeline, so it is `Sync`; per-key state lives in the store.

pub mod remote;

use crate::config::{LatencySpec, ProcessorSpec};
use crate::log::{ProducerRecord, Record};
use crate::store::{KeyValueStore, StoreError};
use bytes::Bytes;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What a processor sees besides the record.
pub struct ProcessorContext<'a> {
    pub task_id: &'a str,
    pub partition: u32,
    /// 1 on the first attempt.
    pub attempt: u32,
    /// The task's state store, as this attempt sees it: reads see the
    /// attempt's own writes, and the writes reach the store only if the
    /// attempt succeeds (an error, a panic or a timeout discards them).
    pub store: &'a dyn KeyValueStore,
    /// When `processing_timeout_ms` runs out for this call. A processor past
    /// it has failed whatever it returns, so it may as well stop.
    pub deadline: Option<Instant>,
    /// The attempt's output records (see `emit`); `None` outside an attempt.
    pub(crate) outputs: Option<&'a Outputs>,
}

impl<'a> ProcessorContext<'a> {
    /// A context outside the runtime (a benchmark's processor-only loop, a unit test of a
    /// processor): first attempt, no deadline, emitted records dropped.
    pub fn standalone(task_id: &'a str, partition: u32, store: &'a dyn KeyValueStore) -> Self {
        ProcessorContext {
            task_id,
            partition,
            attempt: 1,
            store,
            deadline: None,
            outputs: None,
        }
    }

    /// Whether the deadline has passed.
    pub fn is_expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Emits an output record for the pipeline's `sink_topic`. Like the store's
    /// writes, outputs are kept with the attempt and appended only if it
    /// succeeds (in the pipeline's order); without a sink topic they are dropped.
    pub fn emit(&self, record: ProducerRecord) {
        if let Some(outputs) = self.outputs {
            outputs.push(record);
        }
    }
}

/// The output records of one attempt, in the order emitted.
#[derive(Debug, Default)]
pub struct Outputs {
    // A mutex only because the context is shared by reference: one thread uses it.
    records: Mutex<Vec<ProducerRecord>>,
}

impl Outputs {
    fn push(&self, record: ProducerRecord) {
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
    }

    /// The records emitted so far, leaving none.
    pub(crate) fn take(&self) -> Vec<ProducerRecord> {
        std::mem::take(&mut *self.records.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A failed record: a short error type, a human message, and whether another
/// attempt may succeed (a permanent failure goes straight to the dead-letter topic).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct ProcessError {
    pub kind: String,
    pub message: String,
    pub retryable: bool,
    /// How many attempts this one failure stands for, when more than one: a
    /// record dead-lettered for crashing its remote processor `n` times.
    pub attempts: Option<u32>,
}

/// A store call that failed fails the record, with kind `StoreError`.
impl From<StoreError> for ProcessError {
    fn from(error: StoreError) -> Self {
        ProcessError::new("StoreError", error.to_string())
    }
}

impl ProcessError {
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        ProcessError {
            kind: kind.into(),
            message: message.into(),
            retryable: true,
            attempts: None,
        }
    }

    /// The same failure, standing for `attempts` attempts made already.
    #[must_use]
    pub fn after_attempts(mut self, attempts: u32) -> Self {
        self.attempts = Some(attempts);
        self
    }

    /// The same failure, not worth retrying: the record is dead-lettered at once.
    #[must_use]
    pub fn permanent(mut self) -> Self {
        self.retryable = false;
        self
    }
}

/// User logic applied to every record of a pipeline. It may block (remote
/// calls, sleeps); a returned error or a panic fails only this record.
pub trait Processor: Send + Sync + 'static {
    fn process(&self, record: &Record, ctx: &ProcessorContext<'_>) -> Result<(), ProcessError>;
}

impl<F> Processor for F
where
    F: Fn(&Record, &ProcessorContext<'_>) -> Result<(), ProcessError> + Send + Sync + 'static,
{
    fn process(&self, record: &Record, ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
        self(record, ctx)
    }
}

/// Builds the processor a spec names; `None` for a custom name not registered.
pub fn builtin(spec: &ProcessorSpec) -> Option<Arc<dyn Processor>> {
    Some(match spec {
        ProcessorSpec::Count => Arc::new(Count),
        ProcessorSpec::Sum => Arc::new(Sum),
        ProcessorSpec::Latest => Arc::new(Latest),
        ProcessorSpec::Simulate {
            latency_ms,
            cpu_work_us,
            failure_rate,
            fail_attempts,
            seed,
        } => Arc::new(Simulate {
            latency_ms: *latency_ms,
            cpu_work_us: *cpu_work_us,
            failure_rate: *failure_rate,
            fail_attempts: *fail_attempts,
            seed: *seed,
        }),
        ProcessorSpec::Custom { .. } | ProcessorSpec::Grpc(_) => return None,
    })
}

/// Reads a decimal i64 store value; a corrupt value counts as a failure.
fn parse_i64(value: &[u8]) -> Result<i64, ProcessError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .ok_or_else(|| {
            ProcessError::new(
                "InvalidValue",
                format!("not a decimal integer: {:?}", String::from_utf8_lossy(value)),
            )
        })
}

/// Adds `delta` to the decimal value of `key`.
fn add_to_key(store: &dyn KeyValueStore, key: &[u8], delta: i64) -> Result<(), ProcessError> {
    let mut result = Ok(());
    store.update(key, &mut |old| {
        let current = match old.map(|v| parse_i64(v)).transpose() {
            Ok(current) => current.unwrap_or(0),
            Err(e) => {
                result = Err(e);
                return old.cloned();
            }
        };
        Some(decimal(current.wrapping_add(delta)))
    })?;
    result
}

/// `n` in decimal, in a buffer of exactly its length: a `Bytes` made from a
/// `String` with spare capacity (as `to_string` leaves) allocates a shared
/// header beside it, and the store drops that header cold when the key's next
/// value replaces it (perf: a tenth of the count pipeline's stream thread).
fn decimal(n: i64) -> Bytes {
    use std::io::Write as _;
    // i64::MIN is 20 characters.
    let mut digits = [0u8; 20];
    let mut cursor = std::io::Cursor::new(&mut digits[..]);
    match write!(cursor, "{n}") {
        Ok(()) => {
            let written = cursor.position() as usize;
            Bytes::copy_from_slice(&digits[..written])
        }
        // Not reached (20 bytes hold any i64); correct all the same.
        Err(_) => Bytes::from(n.to_string()),
    }
}

/// Count of records per key. Records without a key are skipped, as in Kafka Streams.
pub struct Count;

impl Processor for Count {
    fn process(&self, record: &Record, ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
        match &record.key {
            Some(key) => add_to_key(ctx.store, key, 1),
            None => Ok(()),
        }
    }
}

/// Sum of values (decimal i64) per key.
pub struct Sum;

impl Processor for Sum {
    fn process(&self, record: &Record, ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
        let Some(key) = &record.key else { return Ok(()) };
        let delta = parse_i64(&record.value)?;
        add_to_key(ctx.store, key, delta)
    }
}

/// Last value per key.
pub struct Latest;

impl Processor for Latest {
    fn process(&self, record: &Record, ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
        if let Some(key) = &record.key {
            ctx.store.put(key.clone(), record.value.clone())?;
        }
        Ok(())
    }
}

/// Synthetic work: latency, CPU hashing and failures drawn per record from
/// (seed, partition, offset), so a run is reproducible. Counts per key.
pub struct Simulate {
    pub latency_ms: Option<LatencySpec>,
    pub cpu_work_us: u64,
    pub failure_rate: f64,
    pub fail_attempts: u32,
    pub seed: u64,
}

/// SplitMix64: a tiny, good-enough generator for reproducible per-record draws.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn unit_draw(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// Hash rounds per microsecond on this machine, measured once.
fn hash_rounds_per_us() -> u64 {
    static ROUNDS: OnceLock<u64> = OnceLock::new();
    *ROUNDS.get_or_init(|| {
        let rounds = 200_000u64;
        let start = Instant::now();
        std::hint::black_box(cpu_hash(rounds, 1));
        let us = start.elapsed().as_secs_f64() * 1e6;
        ((rounds as f64 / us.max(1.0)) as u64).max(1)
    })
}

fn cpu_hash(rounds: u64, seed: u64) -> u64 {
    let mut h = seed;
    for _ in 0..rounds {
        h = splitmix64(h);
    }
    h
}

impl Simulate {
    /// Whether this record is one of the failing ones (independent of attempt).
    pub fn is_failing_record(&self, partition: u32, offset: u64) -> bool {
        self.failure_rate > 0.0
            && unit_draw(splitmix64(self.draw_seed(partition, offset) ^ 0xfa11)) < self.failure_rate
    }

    /// The latency this record sleeps, in ms: what a benchmark's bare loop sleeps too.
    pub fn latency_ms_of(&self, partition: u32, offset: u64) -> f64 {
        let draw = self.draw_seed(partition, offset);
        match self.latency_ms {
            None => 0.0,
            Some(LatencySpec::Fixed(ms)) => ms,
            Some(LatencySpec::Uniform([low, high])) => low + (high - low) * unit_draw(draw),
        }
    }

    fn draw_seed(&self, partition: u32, offset: u64) -> u64 {
        splitmix64(self.seed ^ ((partition as u64) << 40) ^ offset)
    }
}

impl Processor for Simulate {
    fn process(&self, record: &Record, ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
        let draw = self.draw_seed(record.partition, record.offset);
        let latency_ms = self.latency_ms_of(record.partition, record.offset);
        if latency_ms > 0.0 {
            let latency = Duration::from_secs_f64(latency_ms / 1000.0);
            // A call that would outlive its deadline stops there.
            if let Some(deadline) = ctx.deadline
                && Instant::now() + latency > deadline
            {
                std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
                return Err(ProcessError::new(
                    "Timeout",
                    format!(
                        "offset {} needed {latency_ms} ms, past its deadline",
                        record.offset
                    ),
                ));
            }
            std::thread::sleep(latency);
        }
        if self.cpu_work_us > 0 {
            std::hint::black_box(cpu_hash(self.cpu_work_us * hash_rounds_per_us(), draw));
        }
        if self.is_failing_record(record.partition, record.offset)
            && (self.fail_attempts == 0 || ctx.attempt <= self.fail_attempts)
        {
            return Err(ProcessError::new(
                "SimulatedFailure",
                format!(
                    "simulated failure of offset {} (attempt {})",
                    record.offset, ctx.attempt
                ),
            ));
        }
        match &record.key {
            Some(key) => add_to_key(ctx.store, key, 1),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_writes_every_i64_as_to_string_does() {
        for n in [0, 1, -1, 9, 10, 12_345, -987_654_321, i64::MAX, i64::MIN] {
            assert_eq!(decimal(n), n.to_string().as_bytes());
        }
    }

    use crate::store::MemoryStore;

    fn record(key: &str, value: &str, offset: u64) -> Record {
        Record {
            partition: 0,
            offset,
            timestamp_ms: 0,
            key: Some(Bytes::copy_from_slice(key.as_bytes())),
            value: Bytes::copy_from_slice(value.as_bytes()),
            headers: vec![],
        }
    }

    fn ctx(store: &MemoryStore) -> ProcessorContext<'_> {
        ProcessorContext {
            task_id: "p_0",
            partition: 0,
            attempt: 1,
            store,
            deadline: None,
            outputs: None,
        }
    }

    #[test]
    fn count_sum_latest() {
        let store = MemoryStore::new();
        Count.process(&record("a", "x", 0), &ctx(&store)).unwrap();
        Count.process(&record("a", "y", 1), &ctx(&store)).unwrap();
        assert_eq!(store.get(b"a").unwrap().unwrap(), "2");

        let store = MemoryStore::new();
        Sum.process(&record("a", "40", 0), &ctx(&store)).unwrap();
        Sum.process(&record("a", "-2", 1), &ctx(&store)).unwrap();
        let err = Sum.process(&record("a", "forty", 2), &ctx(&store)).unwrap_err();
        assert_eq!(err.kind, "InvalidValue");
        assert_eq!(store.get(b"a").unwrap().unwrap(), "38");

        let store = MemoryStore::new();
        Latest.process(&record("a", "1", 0), &ctx(&store)).unwrap();
        Latest.process(&record("a", "2", 1), &ctx(&store)).unwrap();
        assert_eq!(store.get(b"a").unwrap().unwrap(), "2");
    }

    #[test]
    fn simulate_fails_the_drawn_fraction_for_the_given_attempts() {
        let sim = Simulate {
            latency_ms: None,
            cpu_work_us: 0,
            failure_rate: 0.1,
            fail_attempts: 2,
            seed: 7,
        };
        let store = MemoryStore::new();
        let failing: Vec<u64> = (0..10_000).filter(|&o| sim.is_failing_record(0, o)).collect();
        assert!((800..1200).contains(&failing.len()), "{} of 10000", failing.len());
        let offset = failing[0];
        for attempt in 1..=3 {
            let ctx = ProcessorContext {
                task_id: "p_0",
                partition: 0,
                attempt,
                store: &store,
                deadline: None,
                outputs: None,
            };
            let result = sim.process(&record("k", "v", offset), &ctx);
            assert_eq!(result.is_ok(), attempt == 3, "attempt {attempt}");
        }
    }
}
