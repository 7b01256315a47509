//! The runtime's side of remote processors: the records of a unit cut into
//! calls of at most `max_records_per_call` (with the store's value of their
//! keys when the pipeline includes state), made as a chain (one call in flight
//! per thread), and each call's results kept by record until the unit reaches
//! that record and applies its result through the record's own attempt (so a
//! record's state ops and outputs apply only if it succeeded, exactly as an
//! in-process processor's writes).

use super::scheduler::UnitContext;
use super::shared::Shared;
use crate::log::Record;
use crate::processor::ProcessError;
use crate::processor::remote::{Call, RecordResult, RemoteProcessor, Unreachable};
use bytes::Bytes;
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// A thread chains calls until they carry this many records, then looks at
/// their results. Each chain costs the thread one wake-up instead of one per
/// call, which matters where calls are small (at one record per call and
/// T = 64 on 2 cores, a wake-up per call was most of the stream threads'
/// time); the unit's outcomes are published at its end anyway, so a chain
/// delays none. Large calls are not chained: holding many calls' records and
/// answers at once only spreads the thread over more memory.
pub(crate) const MAX_CHAIN_RECORDS: usize = 64;

/// Results of calls made ahead of the records of a unit, by the record's
/// index in the unit. A result not taken (its record was handed back, or
/// parked behind a failure of its key) is dropped with the unit: its record
/// is sent again when it runs.
#[derive(Default)]
pub(crate) struct Prefetched {
    results: HashMap<usize, RecordResult>,
    /// The highest index a call answered.
    last: Option<usize>,
}

impl Prefetched {
    /// Whether a call answered record `index` or a later one already.
    pub(crate) fn answered_from(&self, index: usize) -> bool {
        self.last.is_some_and(|last| last >= index)
    }

    /// The result of record `index`, if a call answered it already.
    pub(crate) fn take(&mut self, index: usize) -> Option<RecordResult> {
        self.results.remove(&index)
    }

    /// Calls the processor for `batches` (each the indices into `records` of
    /// one call, in order, the first index being the record the unit is at),
    /// one call after another, starting none after `stop_after`; keeps the
    /// results of the calls that were answered and answers the first record's.
    pub(crate) fn fetch(
        &mut self,
        shared: &Shared,
        context: &UnitContext,
        remote: &RemoteProcessor,
        records: &[Record],
        batches: &[Vec<usize>],
        stop_after: Instant,
    ) -> Result<RecordResult, Unreachable> {
        let called: Vec<Vec<&Record>> = batches
            .iter()
            .map(|batch| batch.iter().map(|&i| &records[i]).collect())
            .collect();
        let mut calls = Vec::with_capacity(called.len());
        for records in &called {
            match state_for(remote, context, records) {
                Ok(state) => calls.push(Call {
                    task_id: &context.task_id,
                    partition: context.partition,
                    attempt: 1,
                    timeout: shared.processing_timeout(),
                    records,
                    state,
                }),
                Err(error) if calls.is_empty() => {
                    return Ok(Err(ProcessError::from(error)));
                }
                // Its records fail with this error when the unit reaches them.
                Err(_) => break,
            }
        }
        let ended = remote.call_chain(&calls, Some(stop_after));
        for (k, (batch, ended)) in batches.iter().zip(ended).enumerate() {
            let results = match ended {
                Ok(results) => results,
                Err(unreachable) if k == 0 => return Err(unreachable),
                // Made again when the unit reaches its records.
                Err(_) => break,
            };
            for (&index, result) in batch.iter().zip(results) {
                self.results.insert(index, result);
                self.last = self.last.max(Some(index));
            }
        }
        let first = batches.first().and_then(|batch| batch.first());
        Ok(first
            .and_then(|index| self.results.remove(index))
            .unwrap_or_else(|| {
                Err(ProcessError::new(
                    crate::processor::remote::kinds::MALFORMED_RESPONSE,
                    "no result for the record",
                ))
            }))
    }
}

/// The calls a unit at `from` chains: consecutive batches of at most `max`
/// records that will run (`skip` tells those that will not), the first
/// starting at `from`, the others while the chain has fewer than
/// `max_records`. With `include_state` the chain ends before a call holding a
/// key of an earlier call: that call's state would be read before the earlier
/// call's writes apply.
pub(crate) fn next_calls(
    records: &[Record],
    from: usize,
    max: usize,
    max_records: usize,
    include_state: bool,
    skip: impl Fn(usize, &Record) -> bool,
) -> Vec<Vec<usize>> {
    let keys_of =
        |batch: &[usize]| -> Vec<&Bytes> { batch.iter().filter_map(|&i| records[i].key.as_ref()).collect() };
    let first = next_batch(records, from, max, &skip);
    let mut seen: HashSet<&Bytes> = if include_state {
        keys_of(&first).into_iter().collect()
    } else {
        HashSet::new()
    };
    let mut records_in_chain = first.len();
    let mut calls = vec![first];
    while records_in_chain < max_records {
        let Some(&last) = calls.last().and_then(|batch| batch.last()) else {
            break;
        };
        let Some(start) = (last + 1..records.len()).find(|&i| !skip(i, &records[i])) else {
            break;
        };
        let batch = next_batch(records, start, max, &skip);
        if include_state {
            let keys = keys_of(&batch);
            if keys.iter().any(|key| seen.contains(key)) {
                break;
            }
            seen.extend(keys);
        }
        records_in_chain += batch.len();
        calls.push(batch);
    }
    calls
}

/// The indices of the records a call starting at `from` takes: the next
/// records of the unit up to `max`, skipping those that will not run (parked,
/// or of a key that already failed in this unit).
pub(crate) fn next_batch(
    records: &[Record],
    from: usize,
    max: usize,
    skip: &impl Fn(usize, &Record) -> bool,
) -> Vec<usize> {
    let mut batch = vec![from];
    batch.extend(
        (from + 1..records.len())
            .filter(|&i| !skip(i, &records[i]))
            .take(max.saturating_sub(1)),
    );
    batch
}

/// One call over `records` (one attempt number for all of them): one result
/// per record, or `Unreachable`.
pub(crate) fn call(
    shared: &Shared,
    context: &UnitContext,
    remote: &RemoteProcessor,
    records: &[&Record],
    attempt: u32,
) -> Result<Vec<RecordResult>, Unreachable> {
    let state = match state_for(remote, context, records) {
        Ok(state) => state,
        Err(error) => {
            let error = ProcessError::from(error);
            return Ok(records.iter().map(|_| Err(error.clone())).collect());
        }
    };
    remote.call(&Call {
        task_id: &context.task_id,
        partition: context.partition,
        attempt,
        timeout: shared.processing_timeout(),
        records,
        state,
    })
}

/// What a call over `records` carries of the store: nothing, or with
/// `include_state` the value of each of their keys.
fn state_for(
    remote: &RemoteProcessor,
    context: &UnitContext,
    records: &[&Record],
) -> Result<Vec<(Bytes, Option<Bytes>)>, crate::store::StoreError> {
    if remote.include_state() {
        state_of(context, records)
    } else {
        Ok(Vec::new())
    }
}

/// The store's value of each distinct key of `records`, in first-seen order.
/// A key's records never run at once in `offset` and `key` order (and the
/// config refuses `include_state` where they could), so no other thread
/// writes these keys until this call's results are applied.
fn state_of(
    context: &UnitContext,
    records: &[&Record],
) -> Result<Vec<(Bytes, Option<Bytes>)>, crate::store::StoreError> {
    let mut seen = HashSet::new();
    let mut state = Vec::new();
    for key in records.iter().filter_map(|r| r.key.as_ref()) {
        if seen.insert(key.clone()) {
            state.push((key.clone(), context.store.get(key)?));
        }
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(n: u64) -> Vec<Record> {
        keyed(&vec![None; n as usize])
    }

    fn keyed(keys: &[Option<&'static str>]) -> Vec<Record> {
        keys.iter()
            .enumerate()
            .map(|(offset, key)| Record {
                partition: 0,
                offset: offset as u64,
                timestamp_ms: 0,
                key: key.map(|k| Bytes::from_static(k.as_bytes())),
                value: Bytes::new(),
                headers: vec![],
            })
            .collect()
    }

    #[test]
    fn a_batch_starts_at_its_record_and_skips_what_will_not_run() {
        let records = records(10);
        assert_eq!(next_batch(&records, 2, 3, &|_, _| false), vec![2, 3, 4]);
        assert_eq!(next_batch(&records, 2, 3, &|i, _| i == 3), vec![2, 4, 5]);
        assert_eq!(next_batch(&records, 8, 5, &|_, _| false), vec![8, 9]);
        assert_eq!(next_batch(&records, 0, 1, &|_, _| false), vec![0]);
    }

    #[test]
    fn a_chain_covers_the_records_that_run_once_each_in_order_until_it_holds_enough() {
        let records = records(10);
        let none = |_: usize, _: &Record| false;
        assert_eq!(
            next_calls(&records, 1, 1, 4, false, none),
            vec![vec![1], vec![2], vec![3], vec![4]]
        );
        assert_eq!(
            next_calls(&records, 0, 3, 64, false, none),
            vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8], vec![9]]
        );
        // Skipped records are in no call, and a call starts at the next that runs.
        let odd = |i: usize, _: &Record| i % 2 == 1;
        assert_eq!(
            next_calls(&records, 2, 2, 64, false, odd),
            vec![vec![2, 4], vec![6, 8]]
        );
        assert_eq!(next_calls(&records, 9, 2, 64, false, none), vec![vec![9]]);
        // A call is added while the chain holds fewer records than asked.
        assert_eq!(
            next_calls(&records, 0, 3, 5, false, none),
            vec![vec![0, 1, 2], vec![3, 4, 5]]
        );
        assert_eq!(
            next_calls(&records, 0, 8, 5, false, none),
            vec![(0..8).collect::<Vec<_>>()]
        );
    }

    #[test]
    fn with_state_a_chain_ends_before_a_call_that_holds_a_key_of_an_earlier_one() {
        let records = keyed(&[Some("a"), Some("b"), None, Some("c"), Some("a"), Some("d")]);
        let none = |_: usize, _: &Record| false;
        // A key twice in one call is the processor's to order; across calls it ends the chain.
        assert_eq!(
            next_calls(&records, 0, 1, 64, true, none),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        assert_eq!(
            next_calls(&records, 0, 5, 64, true, none),
            vec![vec![0, 1, 2, 3, 4], vec![5]]
        );
        assert_eq!(
            next_calls(&records, 0, 2, 64, true, none),
            vec![vec![0, 1], vec![2, 3]]
        );
        // Without state the chain goes on.
        assert_eq!(next_calls(&records, 0, 2, 64, false, none).len(), 3);
    }
}
