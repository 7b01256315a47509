//! The runtime's side of remote processors: the records of a unit cut into
//! calls of at most `max_records_per_call` (with the store's value of their
//! keys when the pipeline includes state), and each call's results kept by
//! record until the unit reaches that record and applies its result through
//! the record's own attempt (so a record's state ops and outputs apply only
//! if it succeeded, exactly as an in-process processor's writes).

use super::scheduler::UnitContext;
use super::shared::Shared;
use crate::log::Record;
use crate::processor::ProcessError;
use crate::processor::remote::{Call, RecordResult, RemoteProcessor, Unreachable};
use bytes::Bytes;
use std::collections::{HashMap, HashSet};

/// Results of calls made ahead of the records of a unit, by the record's
/// index in the unit. A result not taken (its record was handed back, or
/// parked behind a failure of its key) is dropped with the unit: its record
/// is sent again when it runs.
#[derive(Default)]
pub(crate) struct Prefetched {
    results: HashMap<usize, RecordResult>,
}

impl Prefetched {
    /// The result of record `index`, if a call answered it already.
    pub(crate) fn take(&mut self, index: usize) -> Option<RecordResult> {
        self.results.remove(&index)
    }

    /// Calls the processor for `batch` (indices into `records`, in order,
    /// the first being the record the unit is at), keeps the other results,
    /// and answers the first one's.
    pub(crate) fn fetch(
        &mut self,
        shared: &Shared,
        context: &UnitContext,
        remote: &RemoteProcessor,
        records: &[Record],
        batch: &[usize],
    ) -> Result<RecordResult, Unreachable> {
        let called: Vec<&Record> = batch.iter().map(|&i| &records[i]).collect();
        let mut results = call(shared, context, remote, &called, 1)?.into_iter();
        let first = results.next();
        for (&index, result) in batch.iter().skip(1).zip(results) {
            self.results.insert(index, result);
        }
        Ok(first.unwrap_or_else(|| {
            Err(ProcessError::new(
                crate::processor::remote::kinds::MALFORMED_RESPONSE,
                "no result for the record",
            ))
        }))
    }
}

/// The indices of the records a call starting at `from` takes: the next
/// records of the unit up to `max`, skipping those that will not run (parked,
/// or of a key that already failed in this unit).
pub(crate) fn next_batch(
    records: &[Record],
    from: usize,
    max: usize,
    skip: impl Fn(usize, &Record) -> bool,
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
    let state = if remote.include_state() {
        match state_of(context, records) {
            Ok(state) => state,
            Err(error) => {
                let error = ProcessError::from(error);
                return Ok(records.iter().map(|_| Err(error.clone())).collect());
            }
        }
    } else {
        Vec::new()
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
        (0..n)
            .map(|offset| Record {
                partition: 0,
                offset,
                timestamp_ms: 0,
                key: None,
                value: Bytes::new(),
                headers: vec![],
            })
            .collect()
    }

    #[test]
    fn a_batch_starts_at_its_record_and_skips_what_will_not_run() {
        let records = records(10);
        assert_eq!(next_batch(&records, 2, 3, |_, _| false), vec![2, 3, 4]);
        assert_eq!(next_batch(&records, 2, 3, |i, _| i == 3), vec![2, 4, 5]);
        assert_eq!(next_batch(&records, 8, 5, |_, _| false), vec![8, 9]);
        assert_eq!(next_batch(&records, 0, 1, |_, _| false), vec![0]);
    }
}
