//! The not-yet-final entries of one task's retry-topic partition: waiting
//! with their due time, handed to threads in runs (keyed: one key's entries
//! one at a time, in order), and the retry-topic watermark committed with the
//! source watermark. Invariants: an entry is waiting, in progress, or final —
//! one of them; the watermark is the final prefix.
//!
//! About 430 lines of code; the rest are its tests.

use super::retry::RetryItem;
use super::sequencer::Sequencer;
use super::work::KeySet;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// The not-yet-final records of one task's retry-topic partition.
pub(crate) struct RetryQueue {
    /// Completion of retry-topic offsets; its watermark is the retry offset to commit.
    seq: Sequencer<()>,
    /// Loaded and waiting (not in progress), by retry offset.
    waiting: BTreeMap<u64, RetryItem>,
    /// `(due_ms, retry offset)` of every item in `waiting`, and nothing else:
    /// `take_due` runs under the scheduler's lock on every pick, and while the
    /// earliest item is not due (a backoff runs) it answers from here without
    /// scanning.
    due_order: BTreeSet<(i64, u64)>,
    /// Keyed: keys with an item in progress.
    busy_keys: KeySet,
    in_progress: usize,
    /// Items of one key run one at a time, in retry-offset order (`offset`
    /// and `key` order: the records parked behind a failed one wait for it).
    keyed: bool,
    /// Bumped by every append to the retry partition; equal to `fetched_gen`
    /// once a fetch read everything appended before it started, so an idle
    /// retry topic is not polled.
    append_gen: u64,
    fetched_gen: u64,
    /// The fetch under way: the generation it covers and how many it asked for.
    in_flight: Option<(u64, usize)>,
    /// New entries are read no sooner than this after the first of them was
    /// appended (see `with_fetch_delay`); 0 reads them at once.
    fetch_delay_ms: i64,
    /// When the entries appended since the last read may be read.
    fetch_at_ms: i64,
    /// The retry offset last committed.
    committed: u64,
    /// How many final offsets above `committed` the last commit recorded.
    committed_done: usize,
    /// Offsets of the source records not yet final (for bounded streams).
    pending_sources: BTreeMap<u64, u32>,
    /// Entries that reached a final outcome here and are not yet behind a
    /// commit, with their source offsets (see `commit_positions`).
    final_sources: BTreeMap<u64, u64>,
    /// Records loaded at most at once; more are read as these finish.
    window: usize,
    /// No waiting item can be due before this (0 = unknown; see `take_due`).
    not_before_ms: i64,
    /// Offsets final before a restart (from the store's checkpoint): their
    /// effects are in the store, so they complete on load without running.
    done_before: HashSet<u64>,
}

/// Entries of a retry partition without a final outcome: from the watermark
/// to the end, minus those final above the watermark.
pub(crate) fn backlog(retry_end: u64, watermark: u64, final_above: u64) -> u64 {
    retry_end.saturating_sub(watermark).saturating_sub(final_above)
}

/// What a retry queue's backlog is computed from, copied under the
/// scheduler's lock so the log's end can be asked for without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RetryPosition {
    watermark: u64,
    final_above: u64,
    /// Entries read and not final, once a read has seen everything
    /// appended: then the backlog is exactly these. Offsets past the last
    /// entry may hold no record (Kafka's transaction markers, aborted
    /// entries), so counting up to the log's end would never reach 0.
    read_and_open: Option<u64>,
}

impl RetryPosition {
    /// Entries without a final outcome, given the retry partition's end.
    pub(crate) fn backlog(self, retry_end: u64) -> u64 {
        self.read_and_open
            .unwrap_or_else(|| backlog(retry_end, self.watermark, self.final_above))
    }
}

/// The longest a read of new entries waits (see `RetryQueue::with_fetch_delay`):
/// past it, batching reads saves little, and a re-driven dead letter should
/// not wait long for its first read.
const MAX_FETCH_DELAY_MS: u64 = 50;

/// How long new entries wait before they are read: the shortest first backoff
/// (`retry::backoff` jitters within [0.5, 1] of the first step), at most
/// `MAX_FETCH_DELAY_MS`.
pub(crate) fn fetch_delay_ms(retry_backoff_ms: u64, retry_backoff_max_ms: u64) -> u64 {
    (retry_backoff_ms.min(retry_backoff_max_ms) / 2).min(MAX_FETCH_DELAY_MS)
}

/// At most this many retry items go to one thread at once: small, because
/// each may take as long as the processor's latency.
const RETRY_UNIT_MAX: usize = 16;

/// A pick looks at most this many waiting items that could run: it runs
/// under the scheduler's lock, and a long backlog is served from its front.
/// Items that cannot run in the pass (their key is busy, or they wait behind
/// an earlier item of their key) do not count: a key with more parked items
/// than this behind a long backoff must not hide every other key's due
/// items. Each costs a look-up, so a pick reads at most the loaded items
/// (`max_in_flight_records`).
const SCAN_MAX: usize = 1024;

/// Keyed, a unit finishes the runs of the keys it started (a failed record
/// and the records parked behind it, which need no backoff), up to this.
const RETRY_UNIT_MAX_KEYED: usize = 256;

impl RetryQueue {
    pub(crate) fn new(start: u64, keyed: bool, window: usize, done_before: Vec<u64>) -> RetryQueue {
        RetryQueue {
            seq: Sequencer::new(start),
            waiting: BTreeMap::new(),
            due_order: BTreeSet::new(),
            busy_keys: KeySet::default(),
            in_progress: 0,
            keyed,
            append_gen: 1,
            fetched_gen: 0,
            in_flight: None,
            fetch_delay_ms: 0,
            fetch_at_ms: 0,
            committed: start,
            committed_done: 0,
            pending_sources: BTreeMap::new(),
            final_sources: BTreeMap::new(),
            window,
            done_before: done_before.into_iter().collect(),
            not_before_ms: 0,
        }
    }

    /// Reads new entries only `delay_ms` after the first of them was
    /// appended, and all of them in one read. A first failure is due after
    /// at least half the first backoff (its jitter's floor), so reading it
    /// sooner gains nothing, while a read per append (one per unit with a
    /// failure) cost a log transaction and a scheduler round each (bench
    /// `retry`, parked-keys probe). Records parked behind a failed one wait
    /// for it anyway; only an entry due at once (a re-driven dead letter)
    /// waits up to `delay_ms` longer.
    pub(crate) fn with_fetch_delay(mut self, delay_ms: u64) -> RetryQueue {
        self.fetch_delay_ms = i64::try_from(delay_ms).unwrap_or(i64::MAX);
        self
    }

    /// The retry offset below which every entry is final.
    pub(crate) fn watermark(&self) -> u64 {
        self.seq.watermark()
    }

    pub(crate) fn committed(&self) -> u64 {
        self.committed
    }

    /// How many final offsets above `committed()` the last commit recorded.
    pub(crate) fn committed_done(&self) -> usize {
        self.committed_done
    }

    /// Items attempted by threads right now.
    pub(crate) fn in_progress(&self) -> usize {
        self.in_progress
    }

    /// A commit of `offset` with `done` final offsets above it succeeded.
    pub(crate) fn mark_committed(&mut self, offset: u64, done: usize) {
        if offset >= self.committed {
            self.committed = offset;
            self.committed_done = done;
            self.final_sources = self.final_sources.split_off(&offset);
        }
    }

    /// The retry position and the final entries above it that a commit at
    /// `source_watermark` may record. An entry retrying a record at or above
    /// the source watermark is not behind that commit even when final: a
    /// restart resumes at the watermark and runs the record again from the
    /// source (its entry is then voided), so the retry position stops before
    /// it and the final entries exclude it. Entries final before a restart
    /// (`done_before`) and void markers carry no source and always count.
    pub(crate) fn commit_positions(&self, source_watermark: u64) -> (u64, Vec<u64>) {
        let watermark = self.seq.watermark();
        let held_back = |entry: &u64| {
            self.final_sources
                .get(entry)
                .is_some_and(|&s| s >= source_watermark)
        };
        let position = self
            .final_sources
            .iter()
            .find(|(_, source)| **source >= source_watermark)
            .map_or(watermark, |(&entry, _)| entry.min(watermark));
        let mut done: Vec<u64> = (position..watermark)
            .chain(self.seq.completed_above())
            .filter(|entry| !held_back(entry))
            .collect();
        done.extend(self.done_before.iter().copied());
        done.sort_unstable();
        (position, done)
    }

    pub(crate) fn is_fetching(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Records were appended to the retry partition at `now_ms`.
    pub(crate) fn notify_append(&mut self, now_ms: i64) {
        let covered = self
            .in_flight
            .map_or(self.fetched_gen, |(generation, _)| generation);
        if self.append_gen == covered {
            // The first append no read will see yet: the wait starts now.
            self.fetch_at_ms = now_ms.saturating_add(self.fetch_delay_ms);
        }
        self.append_gen += 1;
    }

    /// A read of the retry partition from `fetched_end()`, or None if none is due at `now_ms`.
    pub(crate) fn start_fetch(&mut self, now_ms: i64) -> Option<(u64, usize, u64)> {
        if !self.can_fetch() || now_ms < self.fetch_at_ms {
            return None;
        }
        let max = self.fetch_capacity();
        self.in_flight = Some((self.append_gen, max));
        Some((self.seq.fetched_end(), max, self.append_gen))
    }

    /// The read under way (started at `generation`) ended with `read` records (None: it failed, and
    /// is tried again at the next pick). A read that got fewer than it asked
    /// for saw everything appended before it started.
    pub(crate) fn fetch_ended(&mut self, generation: u64, read: Option<usize>) {
        debug_assert_eq!(
            self.in_flight.map(|(g, _)| g),
            Some(generation),
            "the read that ends is the one under way"
        );
        if let (Some((generation, max)), Some(read)) = (self.in_flight.take(), read)
            && read < max
        {
            self.fetched_gen = self.fetched_gen.max(generation);
        }
    }

    /// When a read of new entries may start, if one waits only for its time.
    fn fetch_wanted_at_ms(&self) -> Option<i64> {
        self.can_fetch().then_some(self.fetch_at_ms)
    }

    /// Whether the position or the final offsets above it moved since the last commit.
    pub(crate) fn has_uncommitted(&self) -> bool {
        self.seq.watermark() != self.committed
            || self.seq.completed_above().len() + self.done_before.len() != self.committed_done
    }

    /// What the backlog is computed from (see [`RetryPosition`]).
    pub(crate) fn position(&self) -> RetryPosition {
        let read_everything = self.in_flight.is_none() && self.fetched_gen == self.append_gen;
        RetryPosition {
            watermark: self.seq.watermark(),
            final_above: self.final_above(),
            read_and_open: read_everything.then(|| self.seq.pending() as u64),
        }
    }

    /// Entries above the watermark that are final already.
    pub(crate) fn final_above(&self) -> u64 {
        (self.seq.completed_above().len() + self.done_before.len()) as u64
    }

    fn can_fetch(&self) -> bool {
        self.in_flight.is_none() && self.append_gen != self.fetched_gen && self.seq.span() < self.window
    }

    fn fetch_capacity(&self) -> usize {
        self.window.saturating_sub(self.seq.span())
    }

    /// Adds records read from the retry topic, from `seq.fetched_end()` on;
    /// offsets without a record between them (Kafka's transaction markers,
    /// under exactly-once) are gaps the watermark passes.
    pub(crate) fn add_fetched(&mut self, items: Vec<RetryItem>) {
        self.not_before_ms = 0;
        self.seq.fetched_at(items.iter().map(|item| item.retry_offset));
        for item in items {
            if self.done_before.remove(&item.retry_offset) || item.marker {
                self.seq.complete(item.retry_offset, None, &mut Vec::new());
                continue;
            }
            *self.pending_sources.entry(item.record.offset).or_default() += 1;
            self.insert_waiting(item);
        }
    }

    fn insert_waiting(&mut self, item: RetryItem) {
        let due = (item.due_ms, item.retry_offset);
        if let Some(replaced) = self.waiting.insert(item.retry_offset, item) {
            self.due_order.remove(&(replaced.due_ms, replaced.retry_offset));
        }
        self.due_order.insert(due);
    }

    fn remove_waiting(&mut self, retry_offset: u64) -> Option<RetryItem> {
        let item = self.waiting.remove(&retry_offset)?;
        self.due_order.remove(&(item.due_ms, retry_offset));
        Some(item)
    }

    /// The lowest source offset still without a final outcome, if any.
    pub(crate) fn lowest_pending_source(&self) -> Option<u64> {
        self.pending_sources.keys().next().copied()
    }

    /// The earliest time a waiting item could start, or new entries may be
    /// read (ignoring time).
    pub(crate) fn next_due_ms(&self) -> Option<i64> {
        let fetch_at = self.fetch_wanted_at_ms();
        let waiting_due = self.next_waiting_due_ms();
        match (fetch_at, waiting_due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn next_waiting_due_ms(&self) -> Option<i64> {
        if self.waiting.is_empty() {
            return None;
        }
        if self.not_before_ms > 0 {
            return Some(self.not_before_ms).filter(|&t| t < i64::MAX);
        }
        let mut seen_keys: foldhash::HashSet<&Bytes> = Default::default();
        let mut next: Option<i64> = None;
        let mut considered = 0;
        for item in self.waiting.values() {
            if let Some(key) = item.record.key.as_ref().filter(|_| self.keyed)
                && (self.busy_keys.contains(key) || !seen_keys.insert(key))
            {
                continue;
            }
            if considered == SCAN_MAX {
                break;
            }
            considered += 1;
            next = Some(next.map_or(item.due_ms, |n| n.min(item.due_ms)));
        }
        next
    }

    /// Takes up to a unit's worth of items due at `now_ms` whose source record
    /// `may_run` (its first outcome is published: a record's outcomes reach
    /// subscribers in the order they happened). Keyed, only the earliest items
    /// of a key may run, in order, and never two units of one key at once: a
    /// unit takes a key's run of due items (a failed record and the records
    /// parked behind it), so a parked run drains in one pass.
    pub(crate) fn take_due(&mut self, now_ms: i64, may_run: impl Fn(u64) -> bool) -> Vec<RetryItem> {
        // Called under the scheduler lock on every pick: skip the scan while
        // nothing can be due (the cache is dropped whenever the queue changes).
        debug_assert_eq!(self.due_order.len(), self.waiting.len());
        if now_ms < self.not_before_ms || self.due_order.first().is_none_or(|&(due, _)| due > now_ms) {
            return Vec::new();
        }
        /// Where a key stands in this pass.
        enum KeyRun {
            /// Its due items so far are run `.0`.
            Taking(usize),
            /// It takes no more items in this pass.
            Stopped,
        }
        // Keyed: each key's run of due items, in the order the runs start.
        // Unkeyed (or keyless): every due item is a run of its own. One list
        // of (run, offset) and the runs' lengths, not a list per run: this
        // runs under the scheduler's lock.
        let mut picked: Vec<(usize, u64)> = Vec::new();
        let mut run_lengths: Vec<usize> = Vec::new();
        // Only items up to the last due one can run or hold one back (a key's
        // items run in retry-offset order): the scan ends there, not at the
        // end of the queue, where items appended since wait out their backoff.
        let (due_count, last_due) = self
            .due_order
            .range(..=(now_ms, u64::MAX))
            .fold((0, 0), |(count, last), &(_, offset)| {
                (count + 1, last.max(offset))
            });
        // Sized for the scan at once (about the due items): grown from empty
        // it rehashed on every pick that found an item due.
        let mut keys: foldhash::HashMap<&Bytes, KeyRun> =
            foldhash::HashMap::with_capacity_and_hasher(due_count.min(SCAN_MAX), Default::default());
        // What the scan leaves out is not due yet: the earliest of it bounds
        // when anything can run, as the scanned items do.
        let mut next_due = self
            .due_order
            .range((now_ms.saturating_add(1), 0)..)
            .next()
            .map_or(i64::MAX, |&(due, _)| due);
        let mut held_back = false;
        let mut considered = 0;
        for (&offset, item) in self.waiting.range(..=last_due) {
            let key = item.record.key.as_ref().filter(|_| self.keyed);
            // Items that cannot run in this pass do not count (see `SCAN_MAX`).
            let run = match key {
                Some(key) if self.busy_keys.contains(key) => continue,
                Some(key) => match keys.get(key) {
                    Some(KeyRun::Stopped) => continue,
                    Some(&KeyRun::Taking(run)) => Some(run),
                    None => None,
                },
                None => None,
            };
            if considered == SCAN_MAX {
                break;
            }
            considered += 1;
            let released = may_run(item.record.offset);
            held_back |= !released;
            let due = item.due_ms <= now_ms && released;
            if let Some(key) = key {
                match run {
                    // Later items of the key wait behind this one.
                    Some(_) if !due => {
                        keys.insert(key, KeyRun::Stopped);
                    }
                    None if !due => {
                        keys.insert(key, KeyRun::Stopped);
                        next_due = next_due.min(item.due_ms);
                    }
                    Some(run) if run_lengths[run] < RETRY_UNIT_MAX_KEYED => {
                        run_lengths[run] += 1;
                        picked.push((run, offset));
                    }
                    Some(_) => {
                        keys.insert(key, KeyRun::Stopped);
                    }
                    None => {
                        keys.insert(key, KeyRun::Taking(run_lengths.len()));
                        picked.push((run_lengths.len(), offset));
                        run_lengths.push(1);
                    }
                }
            } else if due {
                picked.push((run_lengths.len(), offset));
                run_lengths.push(1);
            } else {
                next_due = next_due.min(item.due_ms);
            }
        }
        // Whole runs until the unit is full: many short runs share a unit,
        // while a long one fills a unit of its own and other threads take
        // the other keys' runs in parallel.
        let mut runs_taken = 0;
        let mut taken_count = 0;
        while runs_taken < run_lengths.len() && taken_count < RETRY_UNIT_MAX {
            taken_count += run_lengths[runs_taken];
            runs_taken += 1;
        }
        picked.retain(|&(run, _)| run < runs_taken);
        // Each run's items together, the runs in the order they started.
        picked.sort_by_key(|&(run, _)| run);
        // An item waiting for its first outcome is not due at a known time:
        // the cache would hide it once released.
        if picked.is_empty() && !held_back {
            self.not_before_ms = next_due;
        }
        let items: Vec<RetryItem> = picked
            .into_iter()
            .filter_map(|(_, offset)| self.remove_waiting(offset))
            .collect();
        for item in &items {
            if self.keyed
                && let Some(key) = &item.record.key
            {
                self.busy_keys.insert(key.clone());
            }
        }
        self.in_progress += items.len();
        items
    }

    /// Items back from a thread: `finished` reached a final outcome, `again`
    /// failed once more and wait for their next attempt.
    pub(crate) fn complete(&mut self, finished: &[(u64, u64, Option<Bytes>)], again: Vec<RetryItem>) {
        self.not_before_ms = 0;
        self.in_progress -= finished.len() + again.len();
        for (retry_offset, source_offset, key) in finished {
            if let Some(key) = key {
                self.busy_keys.remove(key);
            }
            if let Some(count) = self.pending_sources.get_mut(source_offset) {
                *count -= 1;
                if *count == 0 {
                    self.pending_sources.remove(source_offset);
                }
            }
            self.seq.complete(*retry_offset, None, &mut Vec::new());
            self.final_sources.insert(*retry_offset, *source_offset);
        }
        for item in again {
            if let Some(key) = &item.record.key {
                self.busy_keys.remove(key);
            }
            self.insert_waiting(item);
        }
    }

    /// Items of a thread that died: back to waiting, unchanged.
    pub(crate) fn return_items(&mut self, items: Vec<RetryItem>) {
        self.complete(&[], items);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::retry::tests::{failure, record};

    fn item(key: &str, retry_offset: u64, due_ms: i64) -> RetryItem {
        RetryItem {
            retry_offset,
            record: record(key, 100 + retry_offset),
            failure: failure(1),
            due_ms,
            marker: false,
        }
    }

    /// Under exactly-once every transaction leaves a marker in the retry
    /// partition: an offset no read returns. The entries past it must still
    /// complete, the watermark pass it, and the next read start after them.
    #[test]
    fn offsets_between_entries_are_passed_not_waited_for() {
        let mut queue = RetryQueue::new(0, true, 100, vec![]);
        let (from, _, generation) = queue.start_fetch(0).expect("a new queue reads its partition");
        assert_eq!(from, 0);
        queue.fetch_ended(generation, Some(1));
        queue.add_fetched(vec![item("a", 0, 0)]);
        queue.notify_append(0);
        let (from, _, generation) = queue.start_fetch(0).expect("appended since");
        assert_eq!(from, 1);
        queue.fetch_ended(generation, Some(2));
        // A marker at 1 and at 3; entries at 2 and 4.
        queue.add_fetched(vec![item("b", 2, 0), item("c", 4, 0)]);
        let taken = queue.take_due(10, |_| true);
        assert_eq!(
            taken.iter().map(|i| i.retry_offset).collect::<Vec<_>>(),
            vec![0, 2, 4]
        );
        let finished: Vec<_> = taken
            .iter()
            .map(|i| (i.retry_offset, i.record.offset, i.record.key.clone()))
            .collect();
        queue.complete(&finished, vec![]);
        assert_eq!(queue.watermark(), 5, "past both markers");
        queue.notify_append(0);
        let (from, _, _) = queue.start_fetch(0).expect("appended since");
        assert_eq!(from, 5, "no entry is read twice");
    }

    /// A transaction's marker after the last entry, or entries of an aborted
    /// transaction, are offsets no read returns: once a read has seen all
    /// that was appended, they are not backlog (else it never reaches 0).
    #[test]
    fn offsets_past_the_last_entry_are_not_backlog_once_everything_is_read() {
        let mut queue = RetryQueue::new(0, true, 100, vec![]);
        let (_, _, generation) = queue.start_fetch(0).expect("a new queue reads its partition");
        assert_eq!(
            queue.position().backlog(3),
            3,
            "a read under way knows nothing yet"
        );
        queue.fetch_ended(generation, Some(1));
        queue.add_fetched(vec![item("a", 0, 0)]);
        // Entry 0, then a commit marker at 1 and an aborted entry at 2.
        assert_eq!(queue.position().backlog(3), 1, "entry 0 waits");
        let taken = queue.take_due(10, |_| true);
        let finished: Vec<_> = taken
            .iter()
            .map(|i| (i.retry_offset, i.record.offset, i.record.key.clone()))
            .collect();
        queue.complete(&finished, vec![]);
        assert_eq!(queue.position().backlog(3), 0);
        queue.notify_append(0);
        assert_eq!(
            queue.position().backlog(4),
            3,
            "appended since: counted to the end"
        );
    }

    #[test]
    fn key_order_runs_only_the_earliest_item_of_a_key() {
        let mut queue = RetryQueue::new(0, true, 100, vec![]);
        let (from, _, generation) = queue.start_fetch(0).expect("a new queue reads its partition");
        assert_eq!(from, 0);
        queue.fetch_ended(generation, Some(3));
        queue.add_fetched(vec![item("a", 0, 50), item("a", 1, 0), item("b", 2, 0)]);
        // `a`@1 is due but waits behind `a`@0, which is not due yet.
        let taken = queue.take_due(10, |_| true);
        assert_eq!(taken.iter().map(|i| i.retry_offset).collect::<Vec<_>>(), vec![2]);
        assert_eq!(queue.next_due_ms(), Some(50));
        // Once `a`@0 is due, the unit takes `a`'s whole due run, in order.
        let taken = queue.take_due(60, |_| true);
        assert_eq!(
            taken.iter().map(|i| i.retry_offset).collect::<Vec<_>>(),
            vec![0, 1]
        );
        assert!(queue.take_due(60, |_| true).is_empty(), "a is busy");
        // `a`@0 failed again: `a`@1 comes back untouched, still behind it.
        let mut again = taken[0].clone();
        again.due_ms = 80;
        queue.complete(&[], vec![again, taken[1].clone()]);
        assert!(queue.take_due(70, |_| true).is_empty(), "a@1 waits behind a@0");
        let taken = queue.take_due(80, |_| true);
        assert_eq!(
            taken.iter().map(|i| i.retry_offset).collect::<Vec<_>>(),
            vec![0, 1]
        );
        let a = Some(Bytes::from_static(b"a"));
        queue.complete(&[(0, 100, a.clone()), (1, 101, a)], vec![]);
        assert_eq!(queue.watermark(), 2, "offset 2 is still in progress");
    }

    /// A key whose first item waits out a long backoff, with more items
    /// parked behind it than a pick looks at, must not hide other keys' due
    /// items: they run, and the queue knows when the blocked key is due.
    #[test]
    fn a_key_with_a_long_parked_run_does_not_hide_other_keys_due_items() {
        let parked = SCAN_MAX as u64 * 2;
        let mut queue = RetryQueue::new(0, true, 10_000, vec![]);
        let (_, _, generation) = queue.start_fetch(0).expect("a new queue reads its partition");
        queue.fetch_ended(generation, Some(parked as usize + 2));
        let mut items = vec![item("hot", 0, 1_000)];
        items.extend((1..=parked).map(|o| item("hot", o, 0)));
        items.push(item("cold", parked + 1, 5));
        queue.add_fetched(items);
        assert_eq!(queue.next_due_ms(), Some(5), "cold is due first");
        let taken = queue.take_due(5, |_| true);
        assert_eq!(
            taken.iter().map(|i| i.retry_offset).collect::<Vec<_>>(),
            vec![parked + 1]
        );
        let cold = Some(Bytes::from_static(b"cold"));
        queue.complete(&[(parked + 1, 100 + parked + 1, cold)], vec![]);
        assert_eq!(queue.next_due_ms(), Some(1_000), "then hot's first item");
        assert!(queue.take_due(999, |_| true).is_empty());
        let taken = queue.take_due(1_000, |_| true);
        assert_eq!(taken.first().map(|i| i.retry_offset), Some(0));
        assert_eq!(
            taken.len(),
            RETRY_UNIT_MAX_KEYED,
            "hot's run, in order, up to a unit"
        );
        assert!(
            taken
                .windows(2)
                .all(|w| w[0].retry_offset + 1 == w[1].retry_offset)
        );
    }

    #[test]
    fn a_unit_takes_whole_runs_in_the_order_they_start_until_it_is_full() {
        let mut queue = RetryQueue::new(0, true, 1000, vec![]);
        let (_, _, generation) = queue.start_fetch(0).expect("a new queue reads its partition");
        queue.fetch_ended(generation, Some(22));
        // `k0` has three due items spread among 19 other keys' one each.
        let mut items: Vec<RetryItem> = (0..20).map(|k| item(&format!("k{k}"), k, 5)).collect();
        items.push(item("k0", 20, 5));
        items.push(item("k0", 21, 5));
        queue.add_fetched(items);
        assert!(queue.take_due(4, |_| true).is_empty(), "nothing is due before 5");
        let first: Vec<u64> = queue
            .take_due(5, |_| true)
            .iter()
            .map(|i| i.retry_offset)
            .collect();
        let mut expected = vec![0, 20, 21];
        expected.extend(1..14);
        assert_eq!(
            first, expected,
            "k0's run first and whole, then runs until 16 items"
        );
        let rest: Vec<u64> = queue
            .take_due(5, |_| true)
            .iter()
            .map(|i| i.retry_offset)
            .collect();
        assert_eq!(rest, (14..20).collect::<Vec<_>>());
        assert!(queue.take_due(5, |_| true).is_empty());
    }

    #[test]
    fn new_entries_are_read_together_once_the_first_could_be_due() {
        let mut queue = RetryQueue::new(0, true, 100, vec![]).with_fetch_delay(5);
        let (_, max, generation) = queue.start_fetch(0).expect("a new queue reads at once");
        queue.fetch_ended(generation, Some(0));
        assert_eq!(queue.start_fetch(1), None, "nothing appended since");
        assert_eq!(queue.next_due_ms(), None);

        // Three appends: the first starts the wait, the others join it.
        queue.notify_append(100);
        queue.notify_append(102);
        queue.notify_append(104);
        assert_eq!(queue.next_due_ms(), Some(105));
        assert_eq!(queue.start_fetch(104), None, "not before the first could be due");
        let (_, _, generation) = queue.start_fetch(105).expect("one read for all three");
        // An append during the read is not covered by it: its own wait starts.
        queue.notify_append(106);
        queue.fetch_ended(generation, Some(3));
        assert_eq!(queue.start_fetch(110), None);
        assert_eq!(queue.next_due_ms(), Some(111));
        let (_, _, generation) = queue.start_fetch(111).expect("the later append");
        // A read that filled its capacity may have left more: read again at once.
        queue.fetch_ended(generation, Some(max));
        assert!(queue.start_fetch(111).is_some());
    }

    #[test]
    fn the_fetch_delay_is_half_the_shortest_first_backoff_and_bounded() {
        assert_eq!(fetch_delay_ms(10, 1_000), 5);
        assert_eq!(fetch_delay_ms(10, 4), 2);
        assert_eq!(fetch_delay_ms(0, 1_000), 0);
        assert_eq!(fetch_delay_ms(60_000, 600_000), MAX_FETCH_DELAY_MS);
    }

    #[test]
    fn unordered_items_run_when_due_and_the_watermark_is_the_final_prefix() {
        let mut queue = RetryQueue::new(10, false, 100, vec![]);
        queue.add_fetched(vec![item("a", 10, 0), item("a", 11, 0)]);
        let taken = queue.take_due(0, |_| true);
        assert_eq!(taken.len(), 2);
        assert_eq!(queue.lowest_pending_source(), Some(110));
        let mut again = taken[0].clone();
        again.due_ms = 99;
        queue.complete(&[(11, 111, None)], vec![again]);
        assert_eq!(queue.watermark(), 10);
        assert_eq!(
            backlog(12, queue.watermark(), queue.final_above()),
            1,
            "11 is final, 10 is not"
        );
        let taken = queue.take_due(100, |_| true);
        queue.complete(&[(taken[0].retry_offset, 110, None)], vec![]);
        assert_eq!(queue.watermark(), 12);
        assert_eq!(queue.lowest_pending_source(), None);
        assert_eq!(queue.in_progress, 0);
    }

    #[test]
    fn offsets_final_before_a_restart_complete_on_load_without_running() {
        let mut queue = RetryQueue::new(5, false, 100, vec![6]);
        queue.add_fetched(vec![item("a", 5, 0), item("b", 6, 0), item("c", 7, 0)]);
        let taken: Vec<u64> = queue
            .take_due(0, |_| true)
            .iter()
            .map(|i| i.retry_offset)
            .collect();
        assert_eq!(taken, vec![5, 7], "6 was final before the restart");
        queue.complete(&[(7, 107, None)], vec![]);
        assert_eq!(queue.commit_positions(u64::MAX), (5, vec![6, 7]));
        queue.complete(&[(5, 105, None)], vec![]);
        assert_eq!(queue.watermark(), 8);
        assert_eq!(queue.commit_positions(u64::MAX), (8, vec![]));
    }

    #[test]
    fn a_final_retry_of_a_record_above_the_source_watermark_is_not_committed() {
        let mut queue = RetryQueue::new(0, false, 100, vec![]);
        // Entries 0..3 retry source offsets 100, 101, 500, 102.
        let items: Vec<RetryItem> = [100, 101, 500, 102]
            .iter()
            .enumerate()
            .map(|(i, &source)| {
                let mut item = item("k", i as u64, 0);
                item.record.offset = source;
                item
            })
            .collect();
        queue.add_fetched(items);
        let taken = queue.take_due(0, |_| true);
        let finished: Vec<_> = taken
            .iter()
            .map(|i| (i.retry_offset, i.record.offset, None))
            .collect();
        queue.complete(&finished, vec![]);
        assert_eq!(queue.watermark(), 4);
        // The source watermark is 400: entry 2 (source 500) stays behind.
        assert_eq!(queue.commit_positions(400), (2, vec![3]));
        assert_eq!(queue.commit_positions(501), (4, vec![]));
        queue.mark_committed(2, 1);
        assert_eq!(queue.commit_positions(400), (2, vec![3]));
    }

    // ---- the model-based property test of `take_due` ----

    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum QueueOp {
        /// Entries of these (key, backoff ms) are read from the retry topic.
        Read(Vec<(u8, i64)>),
        /// Time moves on this many ms.
        Wait(i64),
        Take,
        /// A unit in progress comes back; `true`: its first item fails again.
        Finish(usize, bool),
    }

    fn queue_op() -> impl Strategy<Value = QueueOp> {
        prop_oneof![
            2 => proptest::collection::vec((0u8..3, 0i64..20), 1..5).prop_map(QueueOp::Read),
            2 => (0i64..15).prop_map(QueueOp::Wait),
            4 => Just(QueueOp::Take),
            3 => (0usize..3, proptest::bool::weighted(0.3)).prop_map(|(u, f)| QueueOp::Finish(u, f)),
        ]
    }

    proptest! {
        /// Keyed: an item is taken only when due, at the head of its key's
        /// items and with no unit of its key in progress; and whenever some
        /// item is all of that, a take finds work (the not-due cache never
        /// hides it). Every entry reaches its final outcome exactly once.
        #[test]
        fn take_due_takes_exactly_the_items_that_may_run(ops in proptest::collection::vec(queue_op(), 1..80)) {
            let mut queue = RetryQueue::new(0, true, 1_000, vec![]);
            let mut now = 0i64;
            let mut read = 0u64;
            let mut units: Vec<Vec<RetryItem>> = Vec::new();
            let mut finished: Vec<u64> = Vec::new();
            // The model: retry offset -> (key, due) of every entry waiting.
            let mut waiting: BTreeMap<u64, (Bytes, i64)> = BTreeMap::new();
            let runnable = |waiting: &BTreeMap<u64, (Bytes, i64)>, units: &[Vec<RetryItem>], now: i64| {
                waiting.iter().any(|(&offset, (key, due))| {
                    *due <= now
                        && !waiting.range(..offset).any(|(_, (k, _))| k == key)
                        && !units.iter().flatten().any(|i| i.record.key.as_ref() == Some(key))
                })
            };
            for op in ops.into_iter().chain(std::iter::repeat_n(QueueOp::Wait(10), 3)) {
                match op {
                    QueueOp::Read(entries) => {
                        let items: Vec<RetryItem> = entries
                            .iter()
                            .enumerate()
                            .map(|(i, &(k, backoff))| item(&format!("k{k}"), read + i as u64, now + backoff))
                            .collect();
                        read += items.len() as u64;
                        for i in &items {
                            waiting.insert(i.retry_offset, (i.record.key.clone().expect("keyed"), i.due_ms));
                        }
                        queue.add_fetched(items);
                    }
                    QueueOp::Wait(ms) => now += ms,
                    QueueOp::Take => {
                        let expect_work = runnable(&waiting, &units, now);
                        let taken = queue.take_due(now, |_| true);
                        prop_assert_eq!(!taken.is_empty(), expect_work, "at {}", now);
                        for i in &taken {
                            let key = i.record.key.clone().expect("keyed");
                            prop_assert!(i.due_ms <= now);
                            prop_assert!(
                                !waiting.range(..i.retry_offset).any(|(&o, (k, _))| *k == key && !taken.iter().any(|t| t.retry_offset == o)),
                                "{} taken before an earlier item of its key", i.retry_offset
                            );
                            prop_assert!(!units.iter().flatten().any(|u| u.record.key.as_ref() == Some(&key)));
                        }
                        for i in &taken {
                            waiting.remove(&i.retry_offset);
                        }
                        if !taken.is_empty() {
                            units.push(taken);
                        }
                    }
                    QueueOp::Finish(u, fail) => {
                        if units.is_empty() {
                            continue;
                        }
                        let mut unit = units.remove(u % units.len());
                        let mut again = Vec::new();
                        if fail {
                            // Failed again: it and the rest of its key's run wait again.
                            let mut first = unit.remove(0);
                            first.due_ms = now + 5;
                            again.push(first);
                            again.append(&mut unit);
                        }
                        for i in &again {
                            waiting.insert(i.retry_offset, (i.record.key.clone().expect("keyed"), i.due_ms));
                        }
                        let done: Vec<(u64, u64, Option<Bytes>)> = unit
                            .iter()
                            .map(|i| (i.retry_offset, i.record.offset, i.record.key.clone()))
                            .collect();
                        finished.extend(done.iter().map(|d| d.0));
                        queue.complete(&done, again);
                    }
                }
            }
            // Everything settles.
            loop {
                now += 100;
                for unit in std::mem::take(&mut units) {
                    let done: Vec<_> = unit.iter().map(|i| (i.retry_offset, i.record.offset, i.record.key.clone())).collect();
                    finished.extend(done.iter().map(|d| d.0));
                    queue.complete(&done, Vec::new());
                }
                let taken = queue.take_due(now, |_| true);
                if taken.is_empty() {
                    break;
                }
                units.push(taken);
            }
            finished.sort_unstable();
            prop_assert_eq!(finished, (0..read).collect::<Vec<_>>());
            prop_assert_eq!(queue.watermark(), read);
        }
    }
}
