//! The work of one task waiting to run: fetched records cut into units that
//! threads take. With one thread per task, or in `unordered` order, units are
//! contiguous ranges; with several threads in `offset` or `key` order they are
//! cut from key lanes (records of one key share a lane, and a lane runs one
//! unit at a time), so records of one key never run at once and run in offset
//! order. The key gate lives here too: keys with a record on the retry path,
//! whose later records wait behind it — parked on the retry topic, or, in
//! `key` order, held here in memory up to a budget (see [`HoldLimits`]) and
//! run by the thread that ran the key's last retry, right after it.
//!
//! Over 600 lines (about 660 before its tests): lanes, units and the gate
//! change together — a record moves between a lane, the gate and a unit in
//! one step, under one set of invariants.

use crate::log::Record;
use bytes::Bytes;
use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// Sets and maps of record keys inside the runtime (the key gate, the keys
/// that failed in a unit, keys busy on the retry path). Looked up once or
/// twice per record while any key waits on the retry path, where std's
/// SipHash was half of the extra CPU that failures cost (bench `retry`,
/// parked-keys probe). foldhash is keyed per map with a random seed like
/// std's, but not built to resist someone studying the process to craft
/// collisions; these maps hold only keys on the retry path, a bounded few.
pub(crate) type KeySet = foldhash::HashSet<Bytes>;
pub(crate) type KeyMap<V> = foldhash::HashMap<Bytes, V>;

/// A fetch is cut into this many ranges per thread of the task, so the tail
/// of a fetch is shared by every thread instead of left to a few long ranges.
const RANGES_PER_THREAD: usize = 16;

/// Key lanes per thread of the task: many, so keys spread finely and no lane
/// is much longer than the average (a lane runs one unit at a time). `key`
/// order picks the longest free lane by a scan of every lane, so it keeps
/// this few.
const LANES_PER_THREAD: usize = 16;

/// Key lanes per thread in `offset` order. There the lane of a slow record
/// holds the watermark with the records of every other key queued behind it
/// in that lane, while the task may fetch only `max_in_flight_records` past
/// the watermark: finer lanes leave fewer records stuck at the head (bench
/// `ordering`, 1 % of records 50× slower, 500 in flight: 0.906 → 0.977 of a
/// bare loop with the same window). It takes the oldest free lane from an
/// ordered set, so more lanes cost it nothing per pick; they cost 40 bytes
/// each per task.
const OFFSET_LANES_PER_THREAD: usize = 64;

/// At most this many lanes, whatever T: beyond it, lanes cost more to scan
/// than they gain in spread.
const MAX_LANES: usize = 4096;

/// A unit takes at most 1/(this × T) of the queued records, so as the queue
/// drains units shrink and the last ones are shared by every thread.
const TAIL_SHARE: usize = 4;

/// Room a key's held records get when its first one is held (see `KeyGate::hold`).
const HELD_PER_KEY: usize = 8;

/// A pause of the held budget never lasts less than this, so a retry path
/// slowed by a moment's load (a fetch, a descheduled thread) is waited out.
const MIN_HOLD_PAUSE: Duration = Duration::from_millis(50);

/// Nor more than this: past it the retry path is slow for good (long
/// backoffs), and the records park on the retry topic instead.
const MAX_HOLD_PAUSE: Duration = Duration::from_secs(1);

/// After a pause ran out, none starts again for this many pause lengths, so
/// pauses hold up a partition for at most 1 / (1 + this) of the time.
const PAUSE_COOLDOWN: u32 = 10;

/// `key` order: how many later records of gated keys are held in memory, and
/// what happens past that many.
///
/// A record parked on the retry topic keeps its key gated until it comes back
/// round; while the budget is spent every later record of a gated key would
/// park too, which keeps more keys gated longer, so under a busy retry path
/// parking feeds itself until most records take the detour. So past the
/// budget a lane whose next record is of a gated key pauses instead (other
/// lanes run on; fetching stops once `max_in_flight_records` are unfinished),
/// until retries open keys and free the budget, or `pause` runs out. Only then
/// do records park, and no pause starts again for `PAUSE_COOLDOWN` pauses, so
/// a slow retry path never stalls the partition for long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HoldLimits {
    /// Records the gate holds in memory at most.
    pub(crate) budget: usize,
    /// The longest a pause lasts.
    pub(crate) pause: Duration,
}

impl HoldLimits {
    /// Half of the task's `max_in_flight_records` (the other half keeps
    /// records flowing), and a pause of twice the first retry's backoff: a
    /// key gated by one failure opens within about that.
    pub(crate) fn new(max_in_flight_records: usize, retry_backoff_ms: u64) -> HoldLimits {
        HoldLimits {
            budget: max_in_flight_records / 2,
            pause: Duration::from_millis(retry_backoff_ms.saturating_mul(2))
                .clamp(MIN_HOLD_PAUSE, MAX_HOLD_PAUSE),
        }
    }
}

/// Where the hold budget stands (see [`HoldLimits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HoldPause {
    /// Gated records are held while the budget lasts.
    None,
    /// The budget ran out at this instant: lanes whose next record is of a
    /// gated key wait, until the budget has room or the pause runs out.
    Since(Instant),
    /// The pause ran out at this instant: past the budget records park, and
    /// no pause starts before the cooldown ends.
    Over(Instant),
}

/// How records whose key waits behind a record on the retry path are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gating {
    /// No key waits (`unordered`, or the `blocking` retry policy).
    Off,
    /// They are parked on the retry topic, behind the failed record (`offset`
    /// order, where holding a record would hold every later outcome too).
    Park,
    /// They are held here in memory up to a budget (`key`, see [`HoldLimits`]).
    Hold,
}

/// A unit of work: records one thread processes in order, then completes at once.
#[derive(Debug, Default)]
pub(crate) struct WorkUnit {
    pub(crate) records: Vec<Record>,
    /// Indices of `records` to park on the retry topic instead of processing.
    pub(crate) park: Vec<usize>,
    /// The lane the records came from (busy until the unit comes back).
    pub(crate) lane: Option<usize>,
    /// Lane units: the murmur2 hash of each record's key (see [`Queued`]), so
    /// a unit can tell a record is not of a key that failed in it without
    /// reading the key. Empty for ranges.
    key_hashes: Vec<Option<u32>>,
    /// Keys whose held records this unit runs, taken from the gate as the
    /// key's retry finished (see [`WorkQueue::ungate_key_into`]); empty for
    /// units cut from lanes or ranges.
    pub(crate) drains: Vec<Bytes>,
}

impl WorkUnit {
    pub(crate) fn parks(&self, index: usize) -> bool {
        !self.park.is_empty() && self.park.contains(&index)
    }

    /// The hash of record `index`'s key, if the unit knows it (`Some(None)`:
    /// the record has no key).
    pub(crate) fn key_hash(&self, index: usize) -> Option<Option<u32>> {
        self.key_hashes.get(index).copied()
    }
}

/// `key` order: records of the keys that hash to this lane, in offset order.
#[derive(Default)]
struct Lane {
    queue: VecDeque<Queued>,
    busy: bool,
}

/// A record waiting in a lane, with the murmur2 hash of its key. The hash is
/// taken once, when the record is fetched and its key is still in cache: it
/// picks the lane, and later tells the gate that the key is not gated without
/// reading the key again. Records are taken under the scheduler's lock, and
/// there a cold read of each record's key, while any key was gated, was the
/// largest cost failures added (bench `retry`, parked-keys probe).
struct Queued {
    record: Record,
    key_hash: Option<u32>,
}

impl Queued {
    fn new(record: Record) -> Queued {
        let key_hash = record.key.as_deref().map(key_hash);
        Queued { record, key_hash }
    }
}

impl Lane {
    /// Its key in `Units::Lanes::ready`: the offset of its first record,
    /// while it is free and has records.
    fn ready_at(&self) -> Option<u64> {
        if self.busy {
            None
        } else {
            self.queue.front().map(|q| q.record.offset)
        }
    }
}

/// The lanes that could give a unit (free, with records), by the offset of
/// their first record: the oldest is the first, and counting or finding them
/// does not scan every lane (16 per thread: 1,024 at T = 64, scanned under the
/// scheduler's lock on every pick otherwise). Each change of a lane's
/// `ready_at` goes through `unready` before and `reready` after it.
type Ready = BTreeSet<(u64, usize)>;

fn unready(ready: &mut Ready, lanes: &[Lane], lane: usize) {
    if let Some(offset) = lanes[lane].ready_at() {
        ready.remove(&(offset, lane));
    }
}

fn reready(ready: &mut Ready, lanes: &[Lane], lane: usize) {
    if let Some(offset) = lanes[lane].ready_at() {
        ready.insert((offset, lane));
    }
}

enum Units {
    Ranges(VecDeque<Vec<Record>>),
    Lanes {
        lanes: Vec<Lane>,
        cursor: usize,
        ready: Ready,
    },
}

/// Keys with records on the retry path, and (`Hold`) their later records kept here.
#[derive(Default)]
struct KeyGate {
    keys: KeyMap<GateEntry>,
    /// The murmur2 hashes of the keys in `keys`: a record whose hash it rules
    /// out is not gated.
    hashes: HashCounts,
    held_records: usize,
}

/// The slot of a key's murmur2 hash in a hash filter of `2^bits` slots: its
/// top bits. The low bits pick the key's lane, so every record of a lane
/// unit shares them and they would tell its keys apart poorly.
fn filter_slot(hash: u32, bits: u32) -> usize {
    (hash >> (32 - bits)) as usize
}

/// A counting filter over the hashes of a set of keys, answering "not in
/// the set" with one load where a hash-set look-up took tens of
/// instructions: asked for every record a lane gives while any key is
/// gated, under the scheduler's lock (bench `retry`, parked-keys probe). A
/// "maybe" (for about `gated keys / 1,024` of the other keys, while few are
/// gated) is settled by the key itself. 4 KiB, taken when the task gates its
/// first key.
#[derive(Default)]
struct HashCounts {
    /// How many hashes of the set fall in each slot; empty until the first insert.
    counts: Vec<u32>,
}

impl HashCounts {
    const BITS: u32 = 10;

    fn insert(&mut self, hash: u32) {
        if self.counts.is_empty() {
            self.counts = vec![0; 1 << Self::BITS];
        }
        self.counts[filter_slot(hash, Self::BITS)] += 1;
    }

    /// Takes back one `insert` of `hash`.
    fn remove(&mut self, hash: u32) {
        if let Some(count) = self.counts.get_mut(filter_slot(hash, Self::BITS)) {
            debug_assert!(*count > 0, "a hash removed more often than inserted");
            *count = count.saturating_sub(1);
        }
    }

    /// False if no inserted hash (not removed since) is `hash`.
    fn may_contain(&self, hash: u32) -> bool {
        self.counts
            .get(filter_slot(hash, Self::BITS))
            .is_some_and(|&count| count > 0)
    }
}

/// The hashes of the keys that failed in one unit, as 64 bits: whether a
/// later record of the unit may be of such a key, without a look-up (see
/// [`HashCounts`]). A unit's failed keys are few; with many, the answer is
/// "maybe" more often and the key settles it.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct HashMask(u64);

impl HashMask {
    pub(crate) fn insert(&mut self, hash: u32) {
        self.0 |= 1 << filter_slot(hash, 6);
    }

    /// False if no inserted hash is `hash`.
    pub(crate) fn may_contain(self, hash: u32) -> bool {
        self.0 & (1 << filter_slot(hash, 6)) != 0
    }
}

#[derive(Default)]
struct GateEntry {
    /// Entries of the key in the retry topic without a final outcome.
    on_retry_path: u32,
    /// Later records of the key, in offset order, not yet run.
    held: VecDeque<Record>,
    /// Its held records run in a unit of their own (`ungate_key_into`): the
    /// key stays gated until that unit is back, so its later records wait
    /// behind them (held whatever the budget: parking one would let its retry
    /// run beside the unit).
    draining: bool,
}

impl GateEntry {
    /// Holds `record`, of this entry's key, behind the key's earlier ones.
    fn hold(&mut self, record: Record) {
        if self.held.capacity() == 0 {
            // A failed key holds about five records (bench `retry`,
            // parked-keys probe): room for them at once, not by doubling.
            self.held.reserve_exact(HELD_PER_KEY);
        }
        self.held.push_back(record);
    }
}

pub(crate) struct WorkQueue {
    units: Units,
    /// Records in ranges or lanes (not held, not taken).
    queued: usize,
    gate: KeyGate,
    gating: Gating,
    hold: HoldLimits,
    pause: HoldPause,
    threads_per_task: usize,
    max_batch_records: usize,
    /// Lanes: take the lane whose first record is oldest (outcomes are released
    /// in offset order), rather than the longest one.
    oldest_first: bool,
}

impl WorkQueue {
    /// Work cut into ranges (`lanes == false`) or key lanes.
    pub(crate) fn new(
        lanes: bool,
        oldest_first: bool,
        gating: Gating,
        threads_per_task: usize,
        max_batch_records: usize,
        hold: HoldLimits,
    ) -> WorkQueue {
        let units = if lanes {
            let count = lane_count(oldest_first, threads_per_task);
            Units::Lanes {
                lanes: (0..count).map(|_| Lane::default()).collect(),
                cursor: 0,
                ready: Ready::new(),
            }
        } else {
            Units::Ranges(VecDeque::new())
        };
        WorkQueue {
            units,
            queued: 0,
            gate: KeyGate::default(),
            gating,
            hold,
            pause: HoldPause::None,
            threads_per_task,
            max_batch_records: max_batch_records.max(1),
            oldest_first,
        }
    }

    pub(crate) fn gating(&self) -> Gating {
        self.gating
    }

    /// Records waiting in ranges or lanes.
    pub(crate) fn queued(&self) -> usize {
        self.queued
    }

    /// Records the gate holds in memory.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.gate.held_records
    }

    /// Adds fetched records (consecutive, in offset order) as work.
    pub(crate) fn push_fetched(&mut self, records: Vec<Record>) {
        self.queued += records.len();
        match &mut self.units {
            Units::Ranges(ranges) => {
                let divisor = if self.threads_per_task == 1 {
                    1
                } else {
                    self.threads_per_task * RANGES_PER_THREAD
                };
                let size = records.len().div_ceil(divisor).clamp(1, self.max_batch_records);
                let mut records = records.into_iter().peekable();
                while records.peek().is_some() {
                    ranges.push_back(records.by_ref().take(size).collect());
                }
            }
            Units::Lanes { lanes, ready, .. } => {
                let n = lanes.len();
                for record in records {
                    let queued = Queued::new(record);
                    let lane = lane_of(queued.key_hash, queued.record.offset, n);
                    // Only a lane's first record is its key in `ready`.
                    let first = lanes[lane].queue.is_empty();
                    lanes[lane].queue.push_back(queued);
                    if first {
                        reready(ready, lanes, lane);
                    }
                }
            }
        }
    }

    /// Units that could start now (ignoring the task's thread limit).
    pub(crate) fn startable_units(&self, now: Instant) -> usize {
        match &self.units {
            Units::Ranges(ranges) => ranges.len(),
            Units::Lanes { lanes, ready, .. } => {
                if self.pausing(now) {
                    ready
                        .iter()
                        .filter(|&&(_, lane)| {
                            lanes[lane]
                                .queue
                                .front()
                                .is_some_and(|q| !self.gate.gates_queued(q))
                        })
                        .count()
                } else {
                    ready.len()
                }
            }
        }
    }

    /// Whether lanes whose next record is of a gated key wait: the budget is
    /// spent and the pause has not run out.
    fn pausing(&self, now: Instant) -> bool {
        match self.pause {
            HoldPause::Since(since) => {
                now < since + self.hold.pause && self.gate.held_records >= self.hold.budget
            }
            HoldPause::None | HoldPause::Over(_) => false,
        }
    }

    /// When the current pause runs out, if lanes wait on it.
    pub(crate) fn pause_ends_at(&self) -> Option<Instant> {
        match self.pause {
            HoldPause::Since(since) if self.gate.held_records >= self.hold.budget => {
                Some(since + self.hold.pause)
            }
            _ => None,
        }
    }

    /// Moves the pause on: over when it ran out, gone when the budget has
    /// room again or the cooldown ended.
    fn refresh_pause(&mut self, now: Instant) {
        self.pause = match self.pause {
            HoldPause::Since(_) if self.gate.held_records < self.hold.budget => HoldPause::None,
            HoldPause::Since(since) if now >= since + self.hold.pause => {
                HoldPause::Over(since + self.hold.pause)
            }
            HoldPause::Over(ended) if now >= ended + self.hold.pause * PAUSE_COOLDOWN => HoldPause::None,
            pause => pause,
        };
    }

    /// Cuts the next unit. Records of gated keys are marked for parking or,
    /// in `key` order, moved to the gate while its budget lasts; past it their
    /// lane pauses, then they park (see [`HoldLimits`]).
    pub(crate) fn take_unit(&mut self, now: Instant) -> Option<WorkUnit> {
        if self.gating == Gating::Hold {
            self.refresh_pause(now);
        }
        // As the queue drains units shrink, so the tail is shared by every thread.
        let cap = self
            .queued
            .div_ceil(self.threads_per_task * TAIL_SHARE)
            .clamp(1, self.max_batch_records);
        let mut unit = match &mut self.units {
            Units::Ranges(ranges) => {
                let mut records = ranges.pop_front()?;
                if self.threads_per_task > 1 && records.len() > cap {
                    let rest = records.split_off(cap);
                    ranges.push_front(rest);
                }
                self.queued -= records.len();
                WorkUnit {
                    records,
                    lane: None,
                    ..WorkUnit::default()
                }
            }
            Units::Lanes { lanes, cursor, ready } => {
                debug_assert!(
                    ready.iter().copied().eq((0..lanes.len())
                        .filter_map(|i| Some((lanes[i].ready_at()?, i)))
                        .collect::<Ready>()),
                    "the ready lanes are those free with records"
                );
                let n = lanes.len();
                let pausing = matches!(self.pause, HoldPause::Since(_));
                let gate = &self.gate;
                let startable = |i: usize| {
                    lanes[i]
                        .queue
                        .front()
                        .is_some_and(|q| !(pausing && gate.gates_queued(q)))
                };
                let lane = if self.oldest_first {
                    ready.iter().map(|&(_, i)| i).find(|&i| startable(i))?
                } else {
                    // Longest first: lanes are serial, so the longest decides
                    // when the task finishes (LPT); ties go round the cursor.
                    (0..n)
                        .map(|i| (*cursor + i) % n)
                        .filter(|&i| !lanes[i].busy && startable(i))
                        .max_by_key(|&i| (lanes[i].queue.len(), std::cmp::Reverse((i + n - *cursor) % n)))?
                };
                *cursor = (lane + 1) % n;
                unready(ready, lanes, lane);
                let queue = &mut lanes[lane].queue;
                let mut records = Vec::with_capacity(cap.min(queue.len()));
                let mut key_hashes = Vec::with_capacity(records.capacity());
                let mut park = Vec::new();
                while records.len() < cap {
                    let Some(queued) = queue.pop_front() else { break };
                    self.queued -= 1;
                    let within_budget = self.gate.held_records < self.hold.budget;
                    let entry = match self.gating {
                        Gating::Off => None,
                        Gating::Park | Gating::Hold => self.gate.entry_of(&queued),
                    };
                    let Some(entry) = entry else {
                        records.push(queued.record);
                        key_hashes.push(queued.key_hash);
                        continue;
                    };
                    if self.gating == Gating::Hold && (within_budget || entry.draining) {
                        entry.hold(queued.record);
                        self.gate.held_records += 1;
                        continue;
                    }
                    let record = queued.record;
                    let key = record.key.clone().unwrap_or_default();
                    if self.gating == Gating::Hold {
                        if self.pause == HoldPause::None {
                            self.pause = HoldPause::Since(now);
                        }
                        if matches!(self.pause, HoldPause::Since(_)) {
                            // The lane waits here; what the unit has so far runs.
                            queue.push_front(Queued {
                                record,
                                key_hash: queued.key_hash,
                            });
                            self.queued += 1;
                            break;
                        }
                    }
                    // Parked on the retry topic, behind whatever the gate held of
                    // the key, so the key's records stay in offset order there.
                    for held in self.gate.take_held(&key) {
                        park.push(records.len());
                        records.push(held);
                        key_hashes.push(queued.key_hash);
                    }
                    park.push(records.len());
                    records.push(record);
                    key_hashes.push(queued.key_hash);
                }
                if records.is_empty() {
                    // Everything was held, or the lane pauses: it stays free
                    // for what comes next, and another lane may have work.
                    reready(ready, lanes, lane);
                    return self.take_unit(now);
                }
                lanes[lane].busy = true;
                debug_assert_eq!(records.len(), key_hashes.len());
                WorkUnit {
                    records,
                    park,
                    lane: Some(lane),
                    key_hashes,
                    drains: Vec::new(),
                }
            }
        };
        if self.gating != Gating::Off && unit.lane.is_none() && !self.gate.keys.is_empty() {
            unit.park = (0..unit.records.len())
                .filter(|&i| {
                    unit.records[i]
                        .key
                        .as_ref()
                        .is_some_and(|k| self.gate.keys.contains_key(k))
                })
                .collect();
        }
        Some(unit)
    }

    /// Takes back what a unit did not run (all of it if its thread died): to
    /// the gate if the unit ran held records (`drains`, see `finish_drained`),
    /// else to its lane or ranges (`give_back`).
    pub(crate) fn take_back(&mut self, lane: Option<usize>, drains: &[Bytes], returned: Vec<Record>) {
        if drains.is_empty() {
            self.give_back(lane, returned);
        } else {
            self.finish_drained(drains, returned);
        }
    }

    /// Takes a unit back: its thread died (`returned` is the whole unit) or
    /// stopped early (`returned` is what it did not run). The records go back
    /// to the front, so they still run before anything fetched after them;
    /// in `key` order those of a gated key (one that failed in the unit, gated
    /// just before) go straight to the gate instead, to run when it opens,
    /// rather than through their lane to be cut and held there.
    pub(crate) fn give_back(&mut self, lane: Option<usize>, mut returned: Vec<Record>) {
        if self.gating == Gating::Hold && lane.is_some() && !self.gate.keys.is_empty() && !returned.is_empty()
        {
            // Most go to the gate (in `key` order a unit gives back little
            // but records of keys that failed in it): no buffer sized for all.
            let mut to_lane = Vec::new();
            for record in returned {
                let entry = record.key.as_ref().and_then(|k| self.gate.keys.get_mut(k));
                if let Some(entry) = entry {
                    entry.hold(record);
                    self.gate.held_records += 1;
                } else {
                    to_lane.push(record);
                }
            }
            returned = to_lane;
        }
        self.queued += returned.len();
        match (&mut self.units, lane) {
            (Units::Lanes { lanes, ready, .. }, Some(i)) => {
                let lane = &mut lanes[i];
                lane.busy = false;
                for record in returned.into_iter().rev() {
                    lane.queue.push_front(Queued::new(record));
                }
                reready(ready, lanes, i);
            }
            (Units::Ranges(ranges), _) => {
                if !returned.is_empty() {
                    ranges.push_front(returned);
                }
            }
            (Units::Lanes { .. }, None) => debug_assert!(returned.is_empty(), "a lane unit without its lane"),
        }
    }

    /// `key` now has one more entry on the retry path.
    pub(crate) fn gate_key(&mut self, key: &Bytes) {
        if self.gating != Gating::Off {
            let entry = self.gate.keys.entry(key.clone()).or_insert_with(|| {
                self.gate.hashes.insert(key_hash(key));
                GateEntry::default()
            });
            entry.on_retry_path += 1;
        }
    }

    /// One entry of `key` on the retry path reached its final outcome. When
    /// it was the last, the key opens and its held records go back to the
    /// front of its lane, ahead of any later record of the key.
    pub(crate) fn ungate_key(&mut self, key: &[u8]) {
        if self.leave_retry_path(key) {
            self.open_key(key);
        }
    }

    /// As `ungate_key`, but when the key opens with records held (`key`
    /// order), they go into `unit` (made if need be; up to `max_batch_records`)
    /// for the thread that ran the retry to run next, instead of back to
    /// their lane to wait for a unit cut there: they hold the watermark, and
    /// lanes are taken longest first. The key stays gated until
    /// `finish_drained` takes the unit back.
    pub(crate) fn ungate_key_into(&mut self, key: &Bytes, unit: &mut Option<WorkUnit>) {
        if !self.leave_retry_path(key) {
            return;
        }
        let room = self.max_batch_records - unit.as_ref().map_or(0, |u| u.records.len());
        let lanes = matches!(self.units, Units::Lanes { .. });
        let Some(entry) = self
            .gate
            .keys
            .get_mut(key)
            .filter(|e| lanes && room > 0 && !e.held.is_empty())
        else {
            self.open_key(key);
            return;
        };
        // What does not fit stays held, and goes to the lane when the key opens.
        entry.draining = true;
        let taken = entry.held.len().min(room);
        self.gate.held_records -= taken;
        let unit = unit.get_or_insert_with(WorkUnit::default);
        let hash = Some(key_hash(key));
        unit.key_hashes.extend(std::iter::repeat_n(hash, taken));
        if unit.records.is_empty() && taken == entry.held.len() {
            // The usual case: the held records' buffer becomes the unit's, uncopied.
            unit.records = Vec::from(std::mem::take(&mut entry.held));
        } else {
            unit.records.extend(entry.held.drain(..taken));
        }
        unit.drains.push(key.clone());
    }

    /// A unit made by `ungate_key_into` came back: what it did not run (its
    /// thread died, its time ran out, or a key failed again in it) waits again
    /// at the front of its key's held records, and each key opens unless the
    /// unit put it back on the retry path.
    pub(crate) fn finish_drained(&mut self, keys: &[Bytes], returned: Vec<Record>) {
        for record in returned.into_iter().rev() {
            let entry = record.key.as_ref().and_then(|k| self.gate.keys.get_mut(k));
            debug_assert!(
                entry.is_some(),
                "a drained unit holds only its gated keys' records"
            );
            if let Some(entry) = entry {
                entry.held.push_front(record);
                self.gate.held_records += 1;
            }
        }
        for key in keys {
            let Some(entry) = self.gate.keys.get_mut(key) else {
                continue;
            };
            entry.draining = false;
            if entry.on_retry_path == 0 {
                self.open_key(key);
            }
        }
    }

    /// Counts off one entry of `key` on the retry path: whether it was the
    /// last (and the key is not draining), so the key may open.
    fn leave_retry_path(&mut self, key: &[u8]) -> bool {
        let Some(entry) = self.gate.keys.get_mut(key) else {
            return false;
        };
        entry.on_retry_path = entry.on_retry_path.saturating_sub(1);
        entry.on_retry_path == 0 && !entry.draining
    }

    /// `key` has no entry on the retry path left: it opens, and its held
    /// records go back to the front of its lane, ahead of any later record.
    fn open_key(&mut self, key: &[u8]) {
        let Some(entry) = self.gate.keys.remove(key) else {
            return;
        };
        let hash = key_hash(key);
        self.gate.hashes.remove(hash);
        self.gate.held_records -= entry.held.len();
        if let Units::Lanes { lanes, ready, .. } = &mut self.units
            && !entry.held.is_empty()
        {
            self.queued += entry.held.len();
            // Held records are all of this key, so all of one lane.
            let lane = lane_of(Some(hash), 0, lanes.len());
            unready(ready, lanes, lane);
            for record in entry.held.into_iter().rev() {
                lanes[lane].queue.push_front(Queued {
                    record,
                    key_hash: Some(hash),
                });
            }
            reready(ready, lanes, lane);
        }
    }

    /// Drops every record not taken (the task is being removed: they will be
    /// fetched again by whoever resumes at the watermark). Answers how many.
    pub(crate) fn clear(&mut self) -> usize {
        let dropped = self.queued + self.gate.held_records;
        match &mut self.units {
            Units::Ranges(ranges) => ranges.clear(),
            Units::Lanes { lanes, ready, .. } => {
                lanes.iter_mut().for_each(|l| l.queue.clear());
                ready.clear();
            }
        }
        for entry in self.gate.keys.values_mut() {
            entry.held.clear();
        }
        self.gate.held_records = 0;
        self.queued = 0;
        dropped
    }
}

impl KeyGate {
    /// Whether `queued` waits behind a record of its key on the retry path.
    /// Reads the record's key only when its hash is among the gated keys'.
    fn gates_queued(&self, queued: &Queued) -> bool {
        !self.keys.is_empty()
            && queued.key_hash.is_some_and(|hash| self.hashes.may_contain(hash))
            && queued
                .record
                .key
                .as_ref()
                .is_some_and(|k| self.keys.contains_key(k))
    }

    /// The entry of `queued`'s key if the key is gated: one look-up, made
    /// only when the key's hash may be a gated key's. The caller that holds
    /// the record in it counts it in `held_records`.
    fn entry_of(&mut self, queued: &Queued) -> Option<&mut GateEntry> {
        if self.keys.is_empty() || !queued.key_hash.is_some_and(|hash| self.hashes.may_contain(hash)) {
            return None;
        }
        self.keys.get_mut(queued.record.key.as_ref()?)
    }

    fn take_held(&mut self, key: &Bytes) -> VecDeque<Record> {
        let held = self
            .keys
            .get_mut(key)
            .map(|entry| std::mem::take(&mut entry.held))
            .unwrap_or_default();
        self.held_records -= held.len();
        held
    }
}

/// How many key lanes a task of `threads_per_task` threads has.
fn lane_count(oldest_first: bool, threads_per_task: usize) -> usize {
    let per_thread = if oldest_first {
        OFFSET_LANES_PER_THREAD
    } else {
        LANES_PER_THREAD
    };
    (threads_per_task * per_thread).min(MAX_LANES)
}

fn key_hash(key: &[u8]) -> u32 {
    crate::log::murmur2(key) as u32
}

/// The lane of a record, from its key's hash: one key always shares one lane;
/// records without a key have no order to keep and are spread by offset.
fn lane_of(key_hash: Option<u32>, offset: u64, lanes: usize) -> usize {
    match key_hash {
        Some(hash) => hash as usize % lanes,
        None => offset as usize % lanes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest! {
        /// Against a model (a multiset of hashes): a hash inserted more often
        /// than removed is never ruled out, and once every insert is taken
        /// back, nothing is let through.
        #[test]
        fn hash_counts_never_rule_out_a_hash_in_the_set(
            steps in proptest::collection::vec((any::<bool>(), 0usize..24), 0..300),
            hashes in proptest::collection::vec(any::<u32>(), 24),
        ) {
            let mut filter = HashCounts::default();
            let mut model: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
            for (insert, at) in steps {
                let hash = hashes[at];
                if insert {
                    filter.insert(hash);
                    *model.entry(hash).or_default() += 1;
                } else if let Some(count) = model.get_mut(&hash).filter(|c| **c > 0) {
                    filter.remove(hash);
                    *count -= 1;
                }
                for (&hash, &count) in &model {
                    if count > 0 {
                        prop_assert!(filter.may_contain(hash));
                    }
                }
            }
            for (hash, count) in model {
                for _ in 0..count {
                    filter.remove(hash);
                }
            }
            for hash in hashes {
                prop_assert!(!filter.may_contain(hash));
            }
        }

        /// A unit's mask never rules out a failed key's hash, and rules out a
        /// hash whose slot no failed key's hash shares.
        #[test]
        fn hash_mask_rules_out_only_hashes_outside_the_set(
            inserted in proptest::collection::vec(any::<u32>(), 0..8),
            asked in proptest::collection::vec(any::<u32>(), 0..64),
        ) {
            let mut mask = HashMask::default();
            for &hash in &inserted {
                mask.insert(hash);
            }
            for &hash in &inserted {
                prop_assert!(mask.may_contain(hash));
            }
            for hash in asked {
                let shares_a_slot = inserted.iter().any(|&h| filter_slot(h, 6) == filter_slot(hash, 6));
                prop_assert_eq!(mask.may_contain(hash), shares_a_slot);
            }
        }
    }

    #[test]
    fn filter_slots_come_from_the_top_bits_not_the_lane_bits() {
        // Hashes that differ only in their low bits share a lane of a
        // power-of-two lane count, and a filter slot of their top bits.
        assert_eq!(filter_slot(0xABC0_0001, 10), filter_slot(0xABC0_FFFF, 10));
        assert_ne!(filter_slot(0x0000_0007, 10), filter_slot(0xFFC0_0007, 10));
        assert_eq!(filter_slot(u32::MAX, 6), 63);
        assert_eq!(filter_slot(u32::MAX, 10), 1023);
    }

    fn record(key: &str, offset: u64) -> Record {
        Record {
            partition: 0,
            offset,
            timestamp_ms: 0,
            key: Some(Bytes::copy_from_slice(key.as_bytes())),
            value: Bytes::new(),
            headers: vec![],
        }
    }

    /// A pause long enough that tests step past it on purpose.
    const PAUSE: Duration = Duration::from_millis(100);

    fn limits(budget: usize) -> HoldLimits {
        HoldLimits { budget, pause: PAUSE }
    }

    fn offsets(unit: &WorkUnit) -> Vec<u64> {
        unit.records.iter().map(|r| r.offset).collect()
    }

    #[test]
    fn one_thread_takes_whole_fetches_as_ranges_in_order() {
        let now = Instant::now();
        let mut work = WorkQueue::new(false, false, Gating::Park, 1, 500, limits(0));
        work.push_fetched((0..10).map(|o| record("k", o)).collect());
        work.push_fetched((10..12).map(|o| record("k", o)).collect());
        let first = work.take_unit(now).unwrap();
        assert_eq!(offsets(&first), (0..10).collect::<Vec<_>>());
        // It stopped after three records: the rest comes back first.
        work.give_back(None, first.records[3..].to_vec());
        assert_eq!(
            offsets(&work.take_unit(now).unwrap()),
            (3..10).collect::<Vec<_>>()
        );
        assert_eq!(offsets(&work.take_unit(now).unwrap()), vec![10, 11]);
        assert!(work.take_unit(now).is_none());
    }

    #[test]
    fn a_lane_runs_one_unit_at_a_time_and_a_key_never_leaves_its_lane() {
        let now = Instant::now();
        let mut work = WorkQueue::new(true, false, Gating::Hold, 2, 500, limits(100));
        work.push_fetched(
            (0..64)
                .map(|o| record(if o % 2 == 0 { "a" } else { "b" }, o))
                .collect(),
        );
        let mut taken = Vec::new();
        while let Some(unit) = work.take_unit(now) {
            let keys: std::collections::HashSet<_> = unit.records.iter().map(|r| r.key.clone()).collect();
            assert_eq!(keys.len(), 1, "one key per lane here");
            taken.push(unit);
        }
        assert!(taken.len() <= 2, "each lane is busy while its unit runs");
        for unit in taken {
            let lane = unit.lane;
            work.give_back(lane, Vec::new());
        }
        assert!(work.take_unit(now).is_some(), "lanes are free again");
    }

    #[test]
    fn offset_order_takes_the_free_lane_with_the_oldest_record_first() {
        let now = Instant::now();
        let lanes = lane_count(true, 2);
        let mut work = WorkQueue::new(true, true, Gating::Park, 2, 500, limits(0));
        let keys: Vec<String> = (0..8).map(|k| format!("key-{k}")).collect();
        let all: Vec<Record> = (0..64).map(|o| record(&keys[o as usize % 8], o)).collect();
        let lane = |offset: u64| {
            let record = &all[offset as usize];
            lane_of(record.key.as_deref().map(key_hash), offset, lanes)
        };
        work.push_fetched(all.clone());
        let used: std::collections::HashSet<usize> = (0..64).map(lane).collect();
        assert_eq!(work.startable_units(now), used.len());
        // Each unit starts at the oldest record of a lane no running unit holds.
        let first = work.take_unit(now).unwrap();
        assert_eq!(first.records[0].offset, 0);
        let second = work.take_unit(now).unwrap();
        let oldest_free =
            |done: &[u64], busy: &[usize]| (0..64).find(|&o| !done.contains(&o) && !busy.contains(&lane(o)));
        let taken: Vec<u64> = first.records.iter().map(|r| r.offset).collect();
        assert_eq!(Some(second.records[0].offset), oldest_free(&taken, &[]));
        assert_eq!(work.startable_units(now), used.len() - 2);
        // The first unit ran one record and gave the rest back: its lane is
        // free again, with the rest first.
        work.give_back(first.lane, first.records[1..].to_vec());
        let third = work.take_unit(now).unwrap();
        let busy = [lane(second.records[0].offset)];
        assert_eq!(Some(third.records[0].offset), oldest_free(&[0], &busy));
        work.give_back(second.lane, Vec::new());
        work.give_back(third.lane, Vec::new());
        // Units that ran to their end free their lanes for the rest.
        while let Some(unit) = work.take_unit(now) {
            assert!(!unit.records.is_empty());
            work.give_back(unit.lane, Vec::new());
        }
        assert_eq!(work.startable_units(now), 0);
        assert_eq!(work.clear(), 0, "every record was taken");
    }

    #[test]
    fn key_order_holds_a_gated_keys_records_and_releases_them_first() {
        let now = Instant::now();
        let mut work = WorkQueue::new(true, false, Gating::Hold, 2, 500, limits(100));
        work.gate_key(&Bytes::from_static(b"a"));
        work.push_fetched(vec![record("a", 0), record("a", 1)]);
        assert!(work.take_unit(now).is_none(), "both held");
        assert_eq!((work.held(), work.queued()), (2, 0));
        work.push_fetched(vec![record("a", 5)]);
        work.ungate_key(b"a");
        assert_eq!(work.held(), 0);
        let (taken, parked) = drain(&mut work, Instant::now());
        assert_eq!(taken, vec![0, 1, 5]);
        assert!(parked.is_empty());
    }

    #[test]
    fn an_opening_keys_held_records_go_into_a_unit_and_the_key_stays_gated_until_it_is_back() {
        let now = Instant::now();
        let (a, b) = (Bytes::from_static(b"a"), Bytes::from_static(b"b"));
        // A budget of one: past it a gated key's lane would pause.
        let mut work = WorkQueue::new(true, false, Gating::Hold, 2, 3, limits(1));
        work.gate_key(&a);
        work.gate_key(&b);
        work.push_fetched(vec![
            record("a", 0),
            record("a", 1),
            record("a", 2),
            record("b", 3),
        ]);
        // The first record is held, the budget is spent: the lane pauses.
        assert_eq!(drain(&mut work, now), (vec![], vec![]));
        assert_eq!(work.held(), 1);
        work.ungate_key(&b);
        let mut unit = None;
        work.ungate_key_into(&a, &mut unit);
        let unit = unit.expect("a's held record");
        assert_eq!((offsets(&unit), unit.drains.clone()), (vec![0], vec![a.clone()]));
        assert_eq!(unit.key_hash(0), Some(Some(key_hash(b"a"))));
        // While it runs, a's later records are held whatever the budget:
        // parking one would let its retry run beside the unit.
        let (taken, parked) = drain(&mut work, now + PAUSE * 2);
        assert!(
            taken.contains(&3) && !taken.contains(&1) && parked.is_empty(),
            "{taken:?}"
        );
        assert_eq!(work.held(), 2);
        // Back done: a opens and its records go to its lane, in order.
        work.finish_drained(&unit.drains, Vec::new());
        assert_eq!(work.held(), 0);
        assert_eq!(drain(&mut work, now + PAUSE * 2), (vec![1, 2], vec![]));
    }

    #[test]
    fn a_drained_unit_is_bounded_and_what_it_did_not_run_goes_back_in_front() {
        let now = Instant::now();
        let a = Bytes::from_static(b"a");
        let mut work = WorkQueue::new(true, false, Gating::Hold, 2, 2, limits(100));
        work.gate_key(&a);
        work.push_fetched((0..5).map(|o| record("a", o)).collect());
        assert_eq!(drain(&mut work, now), (vec![], vec![]));
        let mut unit = None;
        work.ungate_key_into(&a, &mut unit);
        let unit = unit.expect("a's held records");
        assert_eq!(offsets(&unit), vec![0, 1], "max_batch_records at most");
        assert_eq!(work.held(), 3);
        // Record 0 failed again: a is back on the retry path, 1 waits in
        // front of what the gate still holds.
        work.gate_key(&a);
        work.finish_drained(&unit.drains, unit.records[1..].to_vec());
        assert_eq!((work.held(), work.queued()), (4, 0));
        work.ungate_key(&a);
        assert_eq!(drain(&mut work, now), (vec![1, 2, 3, 4], vec![]));
    }

    #[test]
    fn with_ranges_an_opening_key_makes_no_unit() {
        let a = Bytes::from_static(b"a");
        let mut work = WorkQueue::new(false, false, Gating::Hold, 1, 10, limits(100));
        work.gate_key(&a);
        let mut unit = None;
        work.ungate_key_into(&a, &mut unit);
        assert!(unit.is_none());
        // Open: a's next record runs rather than parks.
        work.push_fetched(vec![record("a", 0)]);
        assert_eq!(drain(&mut work, Instant::now()), (vec![0], vec![]));
    }

    #[test]
    fn a_lane_units_records_of_a_key_gated_as_it_came_back_wait_at_the_gate() {
        let now = Instant::now();
        let a = Bytes::from_static(b"a");
        let other = key_in_another_lane("a", lane_count(false, 2));
        let mut work = WorkQueue::new(true, false, Gating::Hold, 2, 500, limits(100));
        // 16 queued: a unit takes 16 / (T × 4) = 2 of them.
        work.push_fetched((0..16).map(|o| record("a", o)).collect());
        let unit = work.take_unit(now).expect("a unit");
        assert_eq!(offsets(&unit), vec![0, 1]);
        // Record 0 failed: a is gated and 1 comes back with another key's record.
        work.gate_key(&a);
        work.give_back(unit.lane, vec![unit.records[1].clone(), record(&other, 99)]);
        assert_eq!((work.held(), work.queued()), (1, 15));
        let mut drained = None;
        work.ungate_key_into(&a, &mut drained);
        assert_eq!(offsets(&drained.expect("the held record")), vec![1]);
    }

    /// Takes every unit (giving each back done): offsets in order taken, and those to park.
    fn drain(work: &mut WorkQueue, now: Instant) -> (Vec<u64>, Vec<u64>) {
        let (mut taken, mut parked) = (Vec::new(), Vec::new());
        while let Some(unit) = work.take_unit(now) {
            taken.extend(offsets(&unit));
            parked.extend(unit.park.iter().map(|&i| unit.records[i].offset));
            work.give_back(unit.lane, Vec::new());
        }
        (taken, parked)
    }

    /// A key whose records share no lane with `key`'s (of `lanes` lanes).
    fn key_in_another_lane(key: &str, lanes: usize) -> String {
        let lane = |k: &str| lane_of(Some(key_hash(k.as_bytes())), 0, lanes);
        (0..)
            .map(|i| format!("other-{i}"))
            .find(|k| lane(k) != lane(key))
            .expect("some key hashes elsewhere")
    }

    #[test]
    fn past_the_budget_a_gated_keys_lane_pauses_while_other_lanes_run() {
        let t0 = Instant::now();
        let mut work = WorkQueue::new(true, false, Gating::Hold, 2, 500, limits(1));
        let other = key_in_another_lane("a", lane_count(false, 2));
        work.gate_key(&Bytes::from_static(b"a"));
        work.push_fetched(vec![record("a", 0), record("a", 1), record(&other, 2)]);
        let (taken, parked) = drain(&mut work, t0);
        assert_eq!(
            (taken, parked),
            (vec![2], vec![]),
            "a0 held, a1 waits, the other key runs"
        );
        assert_eq!((work.held(), work.queued()), (1, 1));
        assert_eq!(work.startable_units(t0), 0, "the paused lane offers nothing");
        assert_eq!(work.pause_ends_at(), Some(t0 + PAUSE));
        // The retry path opens the key before the pause runs out: nothing parks.
        work.ungate_key(b"a");
        assert_eq!(work.pause_ends_at(), None);
        let (taken, parked) = drain(&mut work, t0 + PAUSE / 2);
        assert_eq!((taken, parked), (vec![0, 1], vec![]));
    }

    #[test]
    fn a_pause_runs_out_into_parking_and_none_starts_again_until_the_cooldown_ends() {
        let t0 = Instant::now();
        let mut work = WorkQueue::new(true, false, Gating::Hold, 2, 500, limits(1));
        work.gate_key(&Bytes::from_static(b"a"));
        work.push_fetched(vec![record("a", 0), record("a", 1), record("a", 2)]);
        assert_eq!(drain(&mut work, t0), (vec![], vec![]), "a0 held, a1 waits");
        // The pause ran out: the key parks, what it held first, in order. The
        // budget is free again and holds the next record.
        let t1 = t0 + PAUSE;
        assert_eq!(drain(&mut work, t1), (vec![0, 1], vec![0, 1]));
        assert_eq!((work.held(), work.queued()), (1, 0));
        // Within the cooldown a spent budget parks at once.
        work.push_fetched(vec![record("a", 3)]);
        assert_eq!(drain(&mut work, t1 + PAUSE), (vec![2, 3], vec![2, 3]));
        // After it, a spent budget pauses again.
        let t2 = t1 + PAUSE * PAUSE_COOLDOWN;
        work.push_fetched(vec![record("a", 4), record("a", 5)]);
        assert_eq!(drain(&mut work, t2), (vec![], vec![]));
        assert_eq!(work.pause_ends_at(), Some(t2 + PAUSE));
    }

    #[test]
    fn offset_order_marks_gated_records_for_parking() {
        let now = Instant::now();
        for lanes in [false, true] {
            let mut work = WorkQueue::new(
                lanes,
                true,
                Gating::Park,
                if lanes { 2 } else { 1 },
                500,
                limits(0),
            );
            work.gate_key(&Bytes::from_static(b"a"));
            work.push_fetched(vec![record("a", 0)]);
            work.push_fetched(vec![record("b", 1)]);
            let mut parked = Vec::new();
            while let Some(unit) = work.take_unit(now) {
                parked.extend(unit.park.iter().map(|&i| unit.records[i].offset));
                let lane = unit.lane;
                work.give_back(lane, Vec::new());
            }
            assert_eq!(parked, vec![0], "lanes: {lanes}");
        }
    }

    // ---- the model-based property test of the key gate (`key` order) ----

    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone)]
    enum GateOp {
        /// Records of these keys (of three) arrive.
        Fetch(Vec<u8>),
        Take,
        /// A running unit completes; `true`: its first record of a key fails.
        Finish(usize, bool),
        /// The earliest entry of one key on the retry path reaches its final
        /// outcome; `true`: its key's held records may go into a unit.
        Retry(usize, bool),
    }

    fn gate_op() -> impl Strategy<Value = GateOp> {
        prop_oneof![
            3 => proptest::collection::vec(0u8..3, 1..6).prop_map(GateOp::Fetch),
            4 => Just(GateOp::Take),
            4 => (0usize..4, proptest::bool::weighted(0.3)).prop_map(|(u, f)| GateOp::Finish(u, f)),
            3 => (0usize..3, any::<bool>()).prop_map(|(k, d)| GateOp::Retry(k, d)),
        ]
    }

    /// The runtime's side of the gate: units running, entries on the retry
    /// path, and the order each key's records ran in.
    struct GateModel {
        work: WorkQueue,
        next_offset: u64,
        running: Vec<WorkUnit>,
        /// Per key, its records on the retry path (failed or parked), in order.
        retry_path: BTreeMap<Bytes, VecDeque<u64>>,
        ran: BTreeMap<Bytes, Vec<u64>>,
    }

    impl GateModel {
        fn key_of(k: u8) -> Bytes {
            Bytes::from(format!("key-{k}"))
        }

        /// Keys of the records running units run (not those they park).
        fn running_keys(&self) -> KeySet {
            self.running
                .iter()
                .flat_map(|u| {
                    u.records
                        .iter()
                        .enumerate()
                        .filter(|&(i, _)| !u.parks(i))
                        .filter_map(|(_, r)| r.key.clone())
                })
                .collect()
        }

        fn start(&mut self, unit: WorkUnit) {
            let busy = self.running_keys();
            for (i, record) in unit.records.iter().enumerate() {
                let key = record.key.as_ref().expect("keyed");
                assert!(
                    unit.parks(i) || !busy.contains(key),
                    "two units of one key at once"
                );
                assert!(
                    unit.parks(i) || self.retry_path.get(key).is_none_or(VecDeque::is_empty),
                    "a record of a key with a record on the retry path runs"
                );
            }
            self.running.push(unit);
        }

        fn ran(&mut self, key: &Bytes, offset: u64) {
            let ran = self.ran.entry(key.clone()).or_default();
            assert!(
                ran.last().is_none_or(|&last| last < offset),
                "{key:?}: {offset} after {ran:?}"
            );
            ran.push(offset);
        }

        /// As `process::run_unit` does in `key` order: parked records and a
        /// failed record go on the retry path, the failed key's later records
        /// come back, the rest run.
        fn finish(&mut self, index: usize, fail: bool) {
            let unit = self.running.remove(index);
            let mut failed: Option<Bytes> = None;
            let mut returned = Vec::new();
            let mut newly_on_path = Vec::new();
            for (i, record) in unit.records.iter().enumerate() {
                let key = record.key.clone().expect("keyed");
                if failed.as_ref() == Some(&key) {
                    returned.push(record.clone());
                } else if unit.parks(i) || (fail && failed.is_none()) {
                    failed = failed.or_else(|| (!unit.parks(i)).then(|| key.clone()));
                    newly_on_path.push((key, record.offset));
                } else {
                    self.ran(&key, record.offset);
                }
            }
            for (key, offset) in newly_on_path {
                self.work.gate_key(&key);
                self.retry_path.entry(key).or_default().push_back(offset);
            }
            self.work.take_back(unit.lane, &unit.drains, returned);
        }

        fn retry(&mut self, k: u8, drain: bool) {
            let key = Self::key_of(k);
            let Some(offset) = self.retry_path.get_mut(&key).and_then(VecDeque::pop_front) else {
                return;
            };
            assert!(
                !self.running_keys().contains(&key),
                "a retry of {key:?} runs beside a unit of its records"
            );
            self.ran(&key, offset);
            if drain {
                let mut unit = None;
                self.work.ungate_key_into(&key, &mut unit);
                if let Some(unit) = unit {
                    assert_eq!(unit.drains, vec![key.clone()]);
                    self.start(unit);
                }
            } else {
                self.work.ungate_key(&key);
            }
        }
    }

    proptest! {
        /// Whatever the interleaving: every record runs exactly once, a key's
        /// records run in offset order and never two at once, and none runs
        /// while a record of its key is on the retry path.
        #[test]
        fn the_gate_keeps_each_keys_records_in_order_and_loses_none(
            ops in proptest::collection::vec(gate_op(), 1..120),
            budget in 0usize..6,
        ) {
            let now = Instant::now();
            let mut model = GateModel {
                work: WorkQueue::new(true, false, Gating::Hold, 2, 4, limits(budget)),
                next_offset: 0,
                running: Vec::new(),
                retry_path: BTreeMap::new(),
                ran: BTreeMap::new(),
            };
            let mut clock = now;
            for op in ops {
                // Time moves, so pauses run out into parking as well.
                clock += PAUSE / 4;
                match op {
                    GateOp::Fetch(keys) => {
                        let records = keys
                            .iter()
                            .map(|&k| {
                                model.next_offset += 1;
                                record(&format!("key-{k}"), model.next_offset - 1)
                            })
                            .collect();
                        model.work.push_fetched(records);
                    }
                    GateOp::Take => {
                        if model.running.len() < 2 && let Some(unit) = model.work.take_unit(clock) {
                            model.start(unit);
                        }
                    }
                    GateOp::Finish(i, fail) => {
                        if !model.running.is_empty() {
                            model.finish(i % model.running.len(), fail);
                        }
                    }
                    GateOp::Retry(k, drain) => model.retry(k as u8, drain),
                }
            }
            // Everything settles: units finish, retries succeed, the rest runs.
            loop {
                if let Some(i) = (!model.running.is_empty()).then_some(0) {
                    model.finish(i, false);
                } else if let Some(k) = (0..3).find(|&k| {
                    model.retry_path.get(&GateModel::key_of(k)).is_some_and(|q| !q.is_empty())
                }) {
                    model.retry(k, true);
                } else if let Some(unit) = model.work.take_unit(clock) {
                    model.start(unit);
                } else {
                    break;
                }
                clock += PAUSE;
            }
            prop_assert_eq!(model.work.held(), 0);
            prop_assert_eq!(model.work.queued(), 0);
            let mut all: Vec<u64> = model.ran.values().flatten().copied().collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..model.next_offset).collect::<Vec<_>>());
        }
    }
}
