//! Running the processor, outside any lock: one attempt (with its own write
//! buffer over the store), a unit of source records (failures go to the retry
//! topic and the unit moves on; `blocking` retries in place), a unit of retry
//! items, and a step of a memory store's replay at start.
//!
//! Over 600 lines: `run_unit` and `run_retries` each decide, in one pass
//! over their records, every record's outcome (processed, retried,
//! dead-lettered, parked, given back); split up, those rules would live in
//! two places.

use super::attempt::AttemptStore;
use super::remote_calls::{self, Prefetched};
use super::retry::{self, Failure, RetryItem};
use super::scheduler::{RetriesDone, UnitContext, UnitDone};
use super::shared::PipelineProcessor;
use super::shared::Shared;
use super::work::{Gating, HashMask, KeySet, WorkUnit};
use crate::config::RetryPolicy;
use crate::log::{LogError, ProducerRecord, Record};
use crate::metadata::{MAX_OUTCOME_ERROR_BYTES, Outcome, RecordOutcome, outcome_key};
use crate::processor::remote::{RecordResult, Unreachable};
use crate::processor::{Outputs, ProcessError, ProcessorContext};
use crate::runtime::echo_up_to;
use crate::store::{Write, WriteTag};
use std::collections::HashSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Source records replayed per restore step (the lock is released between steps).
const RESTORE_CHUNK: usize = 5_000;

/// Records between two looks at the clock while records are fast: reading it
/// costs about as much as a no-op record. Slow records look every time.
const CLOCK_EVERY: usize = 64;

/// A record slower than this makes the unit look at the clock after every record.
const SLOW_RECORD: Duration = Duration::from_micros(20);

/// How many records ahead of the one running a unit asks for the next key.
/// A record's key is first read by its processor (a store update), and the
/// records of a fetch are cut into units long after their bytes were last
/// touched, so that read was a trip to memory per record: with a no-op
/// processor, about a tenth of a record's time (bench `floor`). Two records
/// ahead is more than that trip takes.
const PREFETCH_AHEAD: usize = 2;

/// Asks the CPU to bring the first bytes of `record`'s key into its cache,
/// without waiting for them. Nothing else happens: no fault, no read.
fn prefetch_key(record: &Record) {
    #[cfg(target_arch = "x86_64")]
    if let Some(key) = &record.key {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch is a hint; it reads nothing the program sees and
        // cannot fault, whatever the address (this one is the key's, in bounds).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(key.as_ptr().cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = record;
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn outcome(
    shared: &Shared,
    context: &UnitContext,
    record: &Record,
    outcome: Outcome,
    attempts: u32,
    error: Option<&Failure>,
) -> RecordOutcome {
    // Outcomes are kept in history for streams that start in the past: what a record
    // keeps there is bounded, whatever its key or its processor's message.
    let (key, key_truncated) = match &record.key {
        Some(key) => {
            let (key, truncated) = outcome_key(key, shared.config.outcome_key_bytes);
            (Some(key), truncated)
        }
        None => (None, false),
    };
    RecordOutcome {
        thread: context.record_threads.then(|| context.thread.clone()),
        offset: record.offset,
        key,
        key_truncated,
        timestamp_ms: record.timestamp_ms,
        outcome,
        attempts,
        error: error.map(outcome_error),
    }
}

/// Error texts up to this many bytes are put together on the stack.
const OUTCOME_ERROR_ON_STACK: usize = 256;

/// A failure as an outcome's error text, `kind: message`, cut to
/// `MAX_OUTCOME_ERROR_BYTES`. Every failed attempt and parked record makes
/// one, so a short text is put together on the stack and copied once, into
/// its `Arc`, instead of into a `String` first (bench `retry`, parked-keys
/// probe: one allocation less per failure).
fn outcome_error(failure: &Failure) -> Arc<str> {
    const SEPARATOR: &str = ": ";
    let parts = [failure.kind.as_str(), SEPARATOR, failure.message.as_str()];
    let len: usize = parts.iter().map(|part| part.len()).sum();
    if len <= OUTCOME_ERROR_ON_STACK.min(MAX_OUTCOME_ERROR_BYTES) {
        let mut text = [0u8; OUTCOME_ERROR_ON_STACK];
        let mut at = 0;
        for part in parts {
            text[at..at + part.len()].copy_from_slice(part.as_bytes());
            at += part.len();
        }
        // Whole `str`s end to end: always UTF-8.
        if let Ok(text) = std::str::from_utf8(&text[..len]) {
            return Arc::from(text);
        }
    }
    Arc::from(echo_up_to(&parts.concat(), MAX_OUTCOME_ERROR_BYTES).as_ref())
}

/// What an attempt runs: the pipeline's in-process processor, or the answer
/// a remote processor gave for the record (applied like a processor's writes).
pub(crate) enum Run {
    Local,
    Remote(RecordResult),
}

/// Which attempt of a record runs: its number (1 for the first), the tag of
/// its writes, and the instant it counts from.
struct Which {
    number: u32,
    tag: WriteTag,
    started: Instant,
}

/// Runs the processor once over `record` with a fresh write buffer, applied
/// to the store (tagged `tag`) only on success. An error, a panic, or a call
/// that outlives `processing_timeout_ms` is a failure. On success, answers the
/// record's output records (emitted during the attempt).
///
/// The attempt counts from `started`; it answers when it ended too, if it
/// read the clock (to check the timeout): a unit of fast records starts the
/// next attempt there, one clock read per record instead of two (a read
/// costs about a tenth of a no-op record).
fn attempt(
    shared: &Shared,
    context: &UnitContext,
    record: &Record,
    which: Which,
    buffer: &mut Vec<Write>,
    run: Run,
) -> (Result<Vec<ProducerRecord>, ProcessError>, Option<Instant>) {
    let Which { number, tag, started } = which;
    let pipeline = &shared.pipelines[context.pipeline];
    let timeout = shared.processing_timeout();
    let mut ended = None;
    let deadline = timeout.map(|t| started + t);
    let store = AttemptStore::new(
        &context.store,
        &context.locks,
        deadline,
        record.key.as_ref(),
        std::mem::take(buffer),
    );
    let outputs = Outputs::default();
    let ctx = ProcessorContext {
        task_id: &context.task_id,
        partition: context.partition,
        attempt: number,
        store: &store,
        deadline,
        outputs: Some(&outputs),
    };
    let result = match (run, &pipeline.processor) {
        (Run::Remote(result), _) => apply_remote(result, &ctx),
        (Run::Local, PipelineProcessor::Local(processor)) => {
            match catch_unwind(AssertUnwindSafe(|| processor.process(record, &ctx))) {
                Ok(Ok(())) => match timeout {
                    Some(limit) => {
                        let now = Instant::now();
                        ended = Some(now);
                        let took = now.saturating_duration_since(started);
                        if took > limit {
                            Err(ProcessError::new(
                                "Timeout",
                                format!(
                                    "processing took {} ms, more than processing_timeout_ms ({})",
                                    took.as_millis(),
                                    limit.as_millis()
                                ),
                            ))
                        } else {
                            Ok(())
                        }
                    }
                    None => Ok(()),
                },
                Ok(Err(e)) => Err(e),
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".to_string());
                    Err(ProcessError::new("Panic", message))
                }
            }
        }
        (Run::Local, PipelineProcessor::Remote(_)) => Err(ProcessError::new(
            "Internal",
            "a remote pipeline's record was run without its processor's answer",
        )),
    };
    let result = result.and_then(|()| admitted(shared, pipeline, &store, outputs.take()));
    *buffer = match result {
        Ok(_) => store.succeed(|writes| context.store.apply(tag, writes, context.settled_below)),
        Err(_) => store.discard(),
    };
    (result, ended)
}

/// Applies a remote processor's answer for one record inside its attempt.
fn apply_remote(result: RecordResult, ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
    let effects = result?;
    for (key, value) in effects.state_ops {
        match value {
            Some(value) => ctx.store.put(key, value)?,
            None => {
                ctx.store.delete(&key)?;
            }
        }
    }
    for output in effects.outputs {
        ctx.emit(output);
    }
    Ok(())
}

/// A succeeded attempt's outputs, once its outputs and writes are checked
/// against where they go, before anything applies: an output naming a
/// partition the sink topic does not have fails its record; so does one the
/// sink topic would refuse for good (too large for the log), or a write the
/// store's changelog would — not retryable: refused again on every attempt,
/// it would otherwise fail every later append of the sink, and so every
/// commit of the task. Without a sink topic, outputs have nowhere to go.
fn admitted(
    shared: &Shared,
    pipeline: &super::shared::PipelineRuntime,
    store: &AttemptStore<'_>,
    outputs: Vec<ProducerRecord>,
) -> Result<Vec<ProducerRecord>, ProcessError> {
    let outputs = match &pipeline.sink {
        Some(sink) => {
            if let Some(partition) = outputs
                .iter()
                .find_map(|o| o.partition.filter(|&p| p >= sink.partitions))
            {
                return Err(ProcessError::new(
                    crate::processor::remote::kinds::INVALID_OUTPUT,
                    format!(
                        "an output names partition {partition} of sink topic `{}`, which has {}",
                        sink.topic, sink.partitions
                    ),
                ));
            }
            if let Some(error) = outputs
                .iter()
                .find_map(|o| shared.log.check_record(&sink.topic, o).err())
            {
                return Err(ProcessError::new(
                    crate::processor::remote::kinds::INVALID_OUTPUT,
                    format!("an output cannot be appended: {error}"),
                )
                .permanent());
            }
            outputs
        }
        None => Vec::new(),
    };
    if let Some(changelog) = &pipeline.changelog_topic {
        let refused = store.find_write(|(key, value)| {
            let record = ProducerRecord {
                key: Some(key.clone()),
                value: value.clone().unwrap_or_default(),
                ..ProducerRecord::default()
            };
            shared.log.check_record(changelog, &record).err()
        });
        if let Some(error) = refused {
            return Err(ProcessError::new(
                "StoreError",
                format!("a write cannot go to the store's changelog: {error}"),
            )
            .permanent());
        }
    }
    Ok(outputs)
}

/// One attempt of one record, called alone when the pipeline is remote (a
/// retry, a blocking retry, a restore step). `Err(Unreachable)`: nothing ran.
fn attempt_alone(
    shared: &Shared,
    context: &UnitContext,
    record: &Record,
    number: u32,
    tag: WriteTag,
    buffer: &mut Vec<Write>,
) -> Result<Result<Vec<ProducerRecord>, ProcessError>, Unreachable> {
    let run = match shared.pipelines[context.pipeline].processor.remote() {
        None => Run::Local,
        Some(remote) => {
            let mut results = remote_calls::call(shared, context, remote, &[record], number)?;
            Run::Remote(results.pop().unwrap_or_else(|| {
                Err(ProcessError::new(
                    crate::processor::remote::kinds::MALFORMED_RESPONSE,
                    "no result for the record",
                ))
            }))
        }
    };
    let which = Which {
        number,
        tag,
        started: Instant::now(),
    };
    Ok(attempt(shared, context, record, which, buffer, run).0)
}

/// The first wait after a failed append of failed records, doubling up to the cap.
const APPEND_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const APPEND_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Appends failed records to the retry or dead-letter topic, or outputs to a
/// sink topic. The append is not flushed here: a commit flushes the log before
/// it covers these records (see `commit.rs`), so they count as completed only
/// once they are durably on their path, and a unit does not wait for an fsync. While the log cannot
/// write (a full disk) the thread waits for it to heal, with backoff, rather
/// than lose the records' retries; it gives up only on an error no wait can
/// mend (an unknown topic, a record the log refuses) or when the app shuts down.
pub(crate) fn append_with_backoff(
    shared: &Shared,
    topic: &str,
    records: &[ProducerRecord],
) -> Result<(), LogError> {
    if records.is_empty() {
        return Ok(());
    }
    let mut backoff = APPEND_BACKOFF_FIRST;
    loop {
        let error = match shared.log.append_unflushed(topic, records) {
            Ok(()) => {
                shared.note_unflushed();
                return Ok(());
            }
            Err(error) => error,
        };
        let healable = matches!(error, LogError::Unavailable(_) | LogError::Storage { .. });
        if !healable || shared.app_state() != crate::metadata::AppState::Running {
            tracing::error!(topic, %error, "could not append failed records");
            return Err(error);
        }
        tracing::warn!(topic, %error, wait = ?backoff, "cannot append failed records yet; waiting for the log");
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(APPEND_BACKOFF_MAX);
    }
}

/// An append of the unit's task's transaction failed, so the transaction
/// cannot commit: the task is marked corrupted (see `revival`).
fn corrupted_by_append(shared: &Shared, context: &UnitContext, topic: &str, fenced: bool) {
    let marked = shared
        .lock()
        .corrupt_task(&context.task_id, context.pipeline, context.partition, fenced);
    if marked {
        tracing::warn!(
            task = %context.task_id, topic, fenced,
            "an append of the task's transaction failed: it cannot commit; the task is revived from its last commit"
        );
        shared.watchdog.wake();
    }
}

/// `append_with_backoff` for a unit's failed records: all at once; when the
/// log refuses one of them for good (`LogError::Rejected`: a record too
/// large for it), one at a time, so only the refused records fail. A record
/// over the producer's limit is refused before anything of the append is
/// written; one the broker refuses may leave others of the batch written,
/// which are then appended again (duplicates, as when any append is resent).
fn append_each_if_rejected(shared: &Shared, topic: &str, records: &[ProducerRecord]) -> Appended {
    match append_with_backoff(shared, topic, records) {
        Ok(()) => Appended::All,
        Err(LogError::Rejected { .. }) if records.len() > 1 => Appended::Each(
            records
                .iter()
                .map(|record| append_with_backoff(shared, topic, std::slice::from_ref(record)))
                .collect(),
        ),
        Err(error) => Appended::None(error),
    }
}

/// What `append_each_if_rejected` made of each record.
enum Appended {
    All,
    Each(Vec<Result<(), LogError>>),
    None(LogError),
}

impl Appended {
    /// The result of the append's record `index`.
    fn of(&self, index: usize) -> Result<(), LogError> {
        match self {
            Appended::All => Ok(()),
            Appended::Each(each) => each.get(index).cloned().unwrap_or(Ok(())),
            Appended::None(error) => Err(error.clone()),
        }
    }
}

fn failure(error: ProcessError) -> Failure {
    let now = now_ms();
    Failure {
        kind: error.kind,
        message: error.message,
        attempts: error.attempts.unwrap_or(1),
        first_failure_ms: now,
        last_failure_ms: now,
    }
}

/// Runs the processor over a unit's records, until they are done or
/// `max_batch_ms` has passed (the rest goes back). A failing record goes to
/// the retry topic (or, `blocking`, is retried in place) and the unit moves
/// on; a record whose key waits behind one on the retry path is parked there
/// behind it, or (`key` order, a key that failed in this very unit) handed
/// back to wait in memory.
pub(crate) fn run_unit(shared: &Shared, context: &UnitContext, unit: &WorkUnit) -> UnitDone {
    let pipeline = &shared.pipelines[context.pipeline];
    let max_attempts = shared.config.retry_max_attempts;
    let batch_limit = Duration::from_millis(shared.config.max_batch_ms);
    let started = Instant::now();
    let mut clock_every = CLOCK_EVERY;
    let mut outcomes = Vec::with_capacity(unit.records.len());
    let mut returned = Vec::new();
    let mut to_retry = Appends::default();
    let mut to_dead_letter = Appends::default();
    let mut failed_keys = KeySet::default();
    // The hashes of `failed_keys`, where the unit knows its records' hashes:
    // most records are not of a failed key, and this tells so without a read
    // of their keys, which are cold until the processor reads them.
    let mut failed_hashes = HashMask::default();
    let mut buffer: Vec<Write> = Vec::new();
    let remote = pipeline.processor.remote();
    let mut prefetched = Prefetched::default();
    // Output records of the processed records, by source offset.
    let mut emitted: Vec<(u64, Vec<ProducerRecord>)> = Vec::new();
    let mut give_back = false;
    // When the last attempt ended, if it read the clock (only a local
    // processor's does) and no blocking retry waited since: the next one
    // starts there.
    let mut last_ended: Option<Instant> = None;
    let mut records = unit.records.iter().enumerate();
    while let Some((i, record)) = records.next() {
        if let Some(ahead) = unit.records.get(i + PREFETCH_AHEAD) {
            prefetch_key(ahead);
        }
        // After the first record, to learn how slow records are; then every
        // `clock_every` records.
        if i == 1 || (i > 0 && i % clock_every == 0) {
            let elapsed = started.elapsed();
            // Records up to the last one a chain of calls answered run
            // first: giving them back would throw the answers away.
            if elapsed >= batch_limit && !prefetched.answered_from(i) {
                returned.push(record.clone());
                returned.extend(records.map(|(_, r)| r.clone()));
                break;
            }
            if elapsed / i as u32 > SLOW_RECORD {
                clock_every = 1;
            }
        }
        let key_failed = context.gating != Gating::Off
            && !failed_keys.is_empty()
            && match unit.key_hash(i) {
                Some(None) => false,
                Some(Some(hash)) => failed_hashes.may_contain(hash),
                None => true,
            }
            && record.key.as_ref().is_some_and(|k| failed_keys.contains(k));
        if key_failed && context.gating == Gating::Hold {
            returned.push(record.clone());
            continue;
        }
        if unit.parks(i) || key_failed {
            let now = now_ms();
            let parked = Failure {
                kind: "Parked".to_string(),
                message: "waits behind an earlier record of its key on the retry path".to_string(),
                attempts: 0,
                first_failure_ms: now,
                last_failure_ms: now,
            };
            to_retry.push(outcomes.len(), retry::retry_record(record, &parked));
            outcomes.push(outcome(
                shared,
                context,
                record,
                Outcome::Retrying,
                0,
                Some(&parked),
            ));
            continue;
        }
        let tag = if context.tag_writes {
            WriteTag::Source(record.offset)
        } else {
            WriteTag::Untracked
        };
        let run = match remote {
            None => Ok(Run::Local),
            Some(remote) => match prefetched.take(i) {
                Some(result) => Ok(Run::Remote(result)),
                None => {
                    let calls = remote_calls::next_calls(
                        &unit.records,
                        i,
                        remote.max_records_per_call(),
                        remote_calls::MAX_CHAIN_RECORDS,
                        remote.include_state(),
                        |j, r| {
                            unit.parks(j)
                                || (context.gating != Gating::Off
                                    && r.key.as_ref().is_some_and(|k| failed_keys.contains(k)))
                        },
                    );
                    prefetched
                        .fetch(
                            shared,
                            context,
                            remote,
                            &unit.records,
                            &calls,
                            started + batch_limit,
                        )
                        .map(Run::Remote)
                }
            },
        };
        // The processor cannot be reached: this record and the rest go back
        // untouched, to run once it answers again (the call waited already).
        let Ok(run) = run else {
            returned.push(record.clone());
            returned.extend(records.map(|(_, r)| r.clone()));
            break;
        };
        let started = last_ended.take().unwrap_or_else(Instant::now);
        let which = Which {
            number: 1,
            tag,
            started,
        };
        let (result, ended) = attempt(shared, context, record, which, &mut buffer, run);
        last_ended = ended;
        let error = match result {
            Ok(outputs) => {
                // Most processors emit nothing: no entry, no allocation per record.
                if !outputs.is_empty() {
                    emitted.push((record.offset, outputs));
                }
                outcomes.push(outcome(shared, context, record, Outcome::Processed, 1, None));
                continue;
            }
            Err(error) => error,
        };
        let retryable = error.retryable;
        let mut failure = failure(error);
        if pipeline.retry_policy == RetryPolicy::Blocking {
            last_ended = None;
            // Kafka Streams' way: the partition waits while the record is retried here.
            let mut final_outcome = Outcome::DeadLettered;
            let mut retryable = retryable;
            while retryable && failure.attempts < max_attempts {
                std::thread::sleep(shared.backoff(failure.attempts, record.offset));
                match attempt_alone(shared, context, record, failure.attempts + 1, tag, &mut buffer) {
                    Err(Unreachable { .. }) => {
                        give_back = true;
                        break;
                    }
                    Ok(Ok(outputs)) => {
                        emitted.push((record.offset, outputs));
                        final_outcome = Outcome::Processed;
                        break;
                    }
                    Ok(Err(error)) => {
                        failure.attempts += 1;
                        retryable = error.retryable;
                        failure.kind = error.kind;
                        failure.message = error.message;
                        failure.last_failure_ms = now_ms();
                    }
                }
            }
            if give_back {
                returned.push(record.clone());
                returned.extend(records.map(|(_, r)| r.clone()));
                break;
            }
            if final_outcome == Outcome::Processed {
                outcomes.push(outcome(
                    shared,
                    context,
                    record,
                    Outcome::Processed,
                    failure.attempts + 1,
                    None,
                ));
                continue;
            }
        }
        // Blocking retries used up, a single attempt allowed, or a failure not worth retrying.
        if pipeline.retry_policy == RetryPolicy::Blocking || max_attempts <= 1 || !retryable {
            let dead = retry::dead_letter_record(&pipeline.topic, record, &failure);
            to_dead_letter.push(outcomes.len(), dead);
            outcomes.push(outcome(
                shared,
                context,
                record,
                Outcome::DeadLettered,
                failure.attempts,
                Some(&failure),
            ));
            continue;
        }
        if context.gating != Gating::Off
            && let Some(key) = &record.key
        {
            // A unit without hashes (ranges) looks its keys up directly.
            if let Some(Some(hash)) = unit.key_hash(i) {
                failed_hashes.insert(hash);
            }
            failed_keys.insert(key.clone());
        }
        to_retry.push(outcomes.len(), retry::retry_record(record, &failure));
        outcomes.push(outcome(
            shared,
            context,
            record,
            Outcome::Retrying,
            1,
            Some(&failure),
        ));
    }
    let mut retry_keys = Vec::new();
    // Outcomes of records whose append failed as the app shuts down.
    let mut given_back: Vec<usize> = Vec::new();
    for (topic, appends) in [
        (&pipeline.retry_topic, to_retry),
        (&pipeline.dead_letter_topic, to_dead_letter),
    ] {
        if appends.records.is_empty() {
            continue;
        }
        let on_retry_path = Arc::ptr_eq(topic, &pipeline.retry_topic);
        let results = append_each_if_rejected(shared, topic, &appends.records);
        for (j, &i) in appends.outcomes.iter().enumerate() {
            match results.of(j) {
                // The gate holds the records' own keys: an outcome's may be
                // cut short (`outcome_key_bytes`), and a key gated as such
                // would never hold back the key's later records nor open again.
                Ok(()) => {
                    if on_retry_path
                        && context.gating != Gating::Off
                        && let Some(key) = &appends.records[j].key
                    {
                        retry_keys.push(key.clone());
                    }
                }
                // The app shuts down while the log cannot take them (a wait
                // for it to heal ends there): the records go back undone, so
                // the final commit stops before them and they run again from
                // the source after a restart, not lost as failed.
                Err(error)
                    if !matches!(error, LogError::Rejected { .. })
                        && shared.app_state() != crate::metadata::AppState::Running =>
                {
                    given_back.push(i);
                }
                // The task's transaction cannot commit: the task is revived
                // from its last commit, and these records run again there.
                Err(LogError::TransactionAborted { fenced, .. }) => {
                    corrupted_by_append(shared, context, topic, fenced);
                    given_back.push(i);
                }
                // An error no wait mends: not on its path, the record's
                // outcome is final.
                Err(error) => failed_to_append(&mut outcomes[i], topic, &error),
            }
        }
    }
    if !given_back.is_empty() {
        return_undone(&unit.records, &mut outcomes, &mut returned, &given_back);
    }
    context.meters.record_outcomes(&outcomes);
    if !outcomes.is_empty() {
        let per_record = started.elapsed().as_secs_f64() / outcomes.len() as f64;
        context.meters.record_process_seconds(per_record);
    }
    UnitDone {
        lane: unit.lane,
        drains: unit.drains.clone(),
        outcomes,
        returned,
        retry_keys,
        outputs: emitted,
    }
}

/// Makes `outcome` final: failed, for its record could not go to `topic`.
fn failed_to_append(outcome: &mut RecordOutcome, topic: &str, error: &LogError) {
    outcome.outcome = Outcome::Failed;
    outcome.error = Some(Arc::from(format!("could not append to `{topic}`: {error}")));
}

/// Moves the records of `outcomes[indices]` back among `returned` (in offset
/// order, as a unit gives records back) and drops those outcomes: the
/// records are not done.
fn return_undone(
    records: &[Record],
    outcomes: &mut Vec<RecordOutcome>,
    returned: &mut Vec<Record>,
    indices: &[usize],
) {
    let offsets: HashSet<u64> = indices.iter().map(|&i| outcomes[i].offset).collect();
    returned.extend(records.iter().filter(|r| offsets.contains(&r.offset)).cloned());
    returned.sort_by_key(|r| r.offset);
    let mut index = 0;
    outcomes.retain(|_| {
        index += 1;
        !indices.contains(&(index - 1))
    });
}

/// Records a unit appends to the retry or dead-letter topic, and the index of
/// each one's outcome (marked failed should the append fail). Two lists, not
/// one of pairs: the records go to the log as they are, without a copy.
#[derive(Default)]
struct Appends {
    outcomes: Vec<usize>,
    records: Vec<ProducerRecord>,
}

impl Appends {
    fn push(&mut self, outcome: usize, record: ProducerRecord) {
        self.outcomes.push(outcome);
        self.records.push(record);
    }
}

/// Attempts retry items: success is final; a failure waits for its next
/// attempt with backoff, or after the last one is dead-lettered.
///
/// The items stay in `items` (the caller's guard, which gives them back
/// should the thread die) until the end, where they are moved into the
/// answer: a copy for the guard cost each item several allocations.
pub(crate) fn run_retries(shared: &Shared, context: &UnitContext, items: &mut Vec<RetryItem>) -> RetriesDone {
    /// Where an item stands after its attempt.
    enum Next {
        Processed,
        Again,
        DeadLetter,
        /// Its dead letter was refused for good (too large for the topic).
        Refused(LogError),
        /// Keyed: an earlier item of its key failed again in this unit, so
        /// it did not run and waits behind that one.
        Untouched,
    }
    let pipeline = &shared.pipelines[context.pipeline];
    let max_attempts = shared.config.retry_max_attempts;
    let keyed = context.gating != Gating::Off;
    let mut buffer: Vec<Write> = Vec::new();
    let mut attempted: Vec<Next> = Vec::with_capacity(items.len());
    let mut blocked_keys = KeySet::default();
    // The remote processor could not be reached: the items left wait untouched.
    let mut unreachable = false;
    // Output records of the processed items, by source offset.
    let mut emitted: Vec<ProducerRecord> = Vec::new();
    for item in items.iter_mut() {
        let blocked = keyed
            && item
                .record
                .key
                .as_ref()
                .is_some_and(|key| blocked_keys.contains(key));
        if unreachable || blocked {
            attempted.push(Next::Untouched);
            continue;
        }
        // A hand-written retry record may claim any count of attempts.
        let number = item.failure.attempts.saturating_add(1);
        let tag = if context.tag_writes {
            WriteTag::Retry {
                entry: item.retry_offset,
                source: item.record.offset,
            }
        } else {
            WriteTag::Untracked
        };
        let Ok(result) = attempt_alone(shared, context, &item.record, number, tag, &mut buffer) else {
            unreachable = true;
            attempted.push(Next::Untouched);
            continue;
        };
        let next = match result {
            Ok(outputs) => {
                emitted.extend(outputs);
                Next::Processed
            }
            Err(error) => {
                let now = now_ms();
                // A record that crashed the processor stands for its crashes.
                item.failure.attempts = error.attempts.map_or(number, |n| n.max(number));
                item.failure.kind = error.kind;
                item.failure.message = error.message;
                item.failure.last_failure_ms = now;
                if item.failure.first_failure_ms == 0 {
                    item.failure.first_failure_ms = now;
                }
                // Later items of its key wait: it is not final until its
                // dead letter is appended, which may yet fail.
                if keyed && let Some(key) = &item.record.key {
                    blocked_keys.insert(key.clone());
                }
                if number >= max_attempts || !error.retryable {
                    Next::DeadLetter
                } else {
                    item.due_ms = retry::due_ms(now, shared.backoff(number, item.retry_offset));
                    Next::Again
                }
            }
        };
        attempted.push(next);
    }
    let dead: Vec<ProducerRecord> = items
        .iter()
        .zip(&attempted)
        .filter(|(_, next)| matches!(next, Next::DeadLetter))
        .map(|(item, _)| retry::dead_letter_record(&pipeline.topic, &item.record, &item.failure))
        .collect();
    let dead_letter_topic = &pipeline.dead_letter_topic;
    let dead_results = append_each_if_rejected(shared, dead_letter_topic, &dead);
    // The dead letters' results, in the order of `dead`.
    let mut dead_lettered = (0..dead.len()).map(|d| dead_results.of(d));
    let mut finished = Vec::new();
    let mut again = Vec::new();
    let mut outcomes = Vec::with_capacity(attempted.len());
    for (mut item, next) in items.drain(..).zip(attempted) {
        let attempts = item.failure.attempts;
        let next = match next {
            Next::DeadLetter => match dead_lettered.next().unwrap_or(Ok(())) {
                Ok(()) => Next::DeadLetter,
                Err(error @ LogError::Rejected { .. }) => Next::Refused(error),
                // Refused by the dead-letter topic for now (or the task's
                // transaction cannot commit, and it is revived): the record
                // stays on the retry path.
                Err(error) => {
                    if let LogError::TransactionAborted { fenced, .. } = error {
                        corrupted_by_append(shared, context, dead_letter_topic, fenced);
                    }
                    item.due_ms = retry::due_ms(now_ms(), shared.backoff(attempts, item.retry_offset));
                    Next::Again
                }
            },
            next => next,
        };
        let final_outcome = match next {
            Next::Untouched => false,
            Next::Processed => {
                outcomes.push(outcome(
                    shared,
                    context,
                    &item.record,
                    Outcome::Processed,
                    attempts.saturating_add(1),
                    None,
                ));
                true
            }
            Next::DeadLetter => {
                outcomes.push(outcome(
                    shared,
                    context,
                    &item.record,
                    Outcome::DeadLettered,
                    attempts,
                    Some(&item.failure),
                ));
                true
            }
            // No wait mends a refusal, and its key's later records must not
            // wait behind it forever: its outcome is final.
            Next::Refused(error) => {
                let mut failed = outcome(
                    shared,
                    context,
                    &item.record,
                    Outcome::Failed,
                    attempts,
                    Some(&item.failure),
                );
                failed_to_append(&mut failed, dead_letter_topic, &error);
                outcomes.push(failed);
                true
            }
            Next::Again => {
                outcomes.push(outcome(
                    shared,
                    context,
                    &item.record,
                    Outcome::Retrying,
                    attempts,
                    Some(&item.failure),
                ));
                false
            }
        };
        if final_outcome {
            finished.push((item.retry_offset, item.record.offset, item.record.key.clone()));
        } else {
            again.push(item);
        }
    }
    context.meters.record_outcomes(&outcomes);
    RetriesDone {
        finished,
        again,
        outcomes,
        outputs: emitted,
    }
}

/// Replays source offsets `[from, until)` (at most a chunk) into a memory
/// store, without publishing outcomes. Records still on the retry path
/// (`skip`) are left to it; a record that fails is tried as often as
/// `retry_max_attempts` allows, as it was the first time. Answers the next offset.
pub(crate) fn restore_chunk(
    shared: &Shared,
    context: &UnitContext,
    from: u64,
    until: u64,
    skip: &HashSet<u64>,
) -> Result<u64, crate::log::LogError> {
    let pipeline = &shared.pipelines[context.pipeline];
    let max = ((until - from) as usize).min(RESTORE_CHUNK);
    let mut records = Vec::with_capacity(max);
    shared
        .log
        .read(&pipeline.topic, context.partition, from, max, &mut records)?;
    let mut buffer = Vec::new();
    let mut next = from;
    for record in &records {
        next = record.offset + 1;
        if next > until {
            break;
        }
        if skip.contains(&record.offset) {
            continue;
        }
        for number in 1..=shared.config.retry_max_attempts {
            // Outputs were written when the record first ran: a replay only rebuilds state.
            match attempt_alone(shared, context, record, number, WriteTag::Untracked, &mut buffer) {
                Ok(Ok(_)) => break,
                Ok(Err(error)) if !error.retryable => break,
                Ok(Err(_)) => {}
                // The remote processor cannot be reached: resume here later.
                Err(Unreachable { .. }) => return Ok(record.offset),
            }
        }
    }
    // An empty read below `until` means the log lost records: do not spin.
    Ok(if records.is_empty() {
        until
    } else {
        next.min(until)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(kind: &str, message: &str) -> Failure {
        Failure {
            kind: kind.to_string(),
            message: message.to_string(),
            attempts: 1,
            first_failure_ms: 0,
            last_failure_ms: 0,
        }
    }

    #[test]
    fn an_outcome_error_is_kind_and_message_cut_to_the_limit_at_a_char_boundary() {
        assert_eq!(
            &*outcome_error(&failure("Timeout", "took 31 s")),
            "Timeout: took 31 s"
        );
        assert_eq!(&*outcome_error(&failure("", "")), ": ");
        // Either side of the stack buffer's size, and of the limit, whole.
        for len in [
            OUTCOME_ERROR_ON_STACK - 3,
            OUTCOME_ERROR_ON_STACK - 2,
            MAX_OUTCOME_ERROR_BYTES - 4,
        ] {
            let message = "é".repeat(len / 2) + &"m".repeat(len % 2);
            let text = outcome_error(&failure("K", &message));
            assert_eq!(&*text, format!("K: {message}"), "{len}");
        }
        for len in [MAX_OUTCOME_ERROR_BYTES - 2, 10 * MAX_OUTCOME_ERROR_BYTES] {
            let message = "é".repeat(len / 2) + &"m".repeat(len % 2);
            let text = outcome_error(&failure("K", &message));
            assert!(
                text.len() <= MAX_OUTCOME_ERROR_BYTES,
                "{len}: {} bytes",
                text.len()
            );
            assert!(text.ends_with('…'), "{len}");
            assert!(
                format!("K: {message}").starts_with(text.trim_end_matches('…')),
                "{len}"
            );
        }
    }
}
