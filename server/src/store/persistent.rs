//! `PersistentStore`: a redb-backed key-value store whose data and task checkpoint commit in one
//! durable transaction. Writes land in a sharded in-memory dirty overlay; `begin_commit` freezes
//! it, `finish_commit` writes the frozen layer while processing continues and then moves its
//! entries into the shard's clean cache, a bounded in-memory copy of committed entries. Reads go
//! dirty → frozen → clean cache → committed redb data, and skip redb on a miss while the cache
//! knows every committed key (see `Clean`); snapshots (interactive queries) see only the last
//! commit, read from redb.
//!
//! The in-memory layers are hash tables, and an access hashes its key once (one keyed hash picks
//! the shard and finds the key in each layer); `finish_commit` sorts a commit's writes into
//! key order for redb once, rather than every write paying for an ordered map.

use super::{KeyValueStore, SHARDS, StoreError, Write};
use bytes::Bytes;
use redb::{
    Database, ReadOnlyTable, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};
use std::any::Any;
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::ops::{Bound, RangeBounds};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Positions committed atomically with the store's data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// Next source offset to process.
    pub watermark: u64,
    /// Next retry-topic offset to process.
    pub retry_offset: u64,
    /// Retry-topic offsets at or above `retry_offset` already final: their
    /// effects are in the data, so a restart must not apply them again.
    pub retry_done: Vec<u64>,
    /// On Kafka: the offset of the store's changelog partition below which
    /// every changelog record is in the data, where restoring this copy
    /// resumes. `None`: unknown (a store never restored nor committed on
    /// Kafka), so only a full restore makes it current.
    pub changelog_offset: Option<u64>,
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown panic")
}

/// Runs a redb call, turning its errors and its panics into a `StoreError` naming the file.
/// redb trusts the pages it reads and panics on some damaged ones ("unreachable code", "invalid
/// page type"); a full integrity check on every open would read the whole file instead.
fn guarded<T>(path: &Path, f: impl FnOnce() -> Result<T, redb::Error>) -> Result<T, StoreError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(|e| StoreError::new(path, e)),
        Err(payload) => Err(StoreError::new(
            path,
            format_args!("corrupt: redb panicked: {}", panic_message(&*payload)),
        )),
    }
}

const DATA: TableDefinition<&[u8], &[u8]> = TableDefinition::new("data");
/// One row, `checkpoint` → (watermark, retry_offset); absent until the first commit.
const META: TableDefinition<&str, (u64, u64)> = TableDefinition::new("meta");
const CHECKPOINT_KEY: &str = "checkpoint";
/// One row, `retry_done` → the checkpoint's `retry_done` as little-endian u64s.
const RETRY_DONE: TableDefinition<&str, &[u8]> = TableDefinition::new("retry_done");
const RETRY_DONE_KEY: &str = "retry_done";
/// One row, `changelog_offset` → the checkpoint's `changelog_offset`; absent when it has none.
const CHANGELOG: TableDefinition<&str, u64> = TableDefinition::new("changelog");
const CHANGELOG_KEY: &str = "changelog_offset";
/// One row, `log_id` → the id of the log this store was created for (`crate::datadir`);
/// absent in stores from before ids.
const IDENTITY: TableDefinition<&str, &str> = TableDefinition::new("identity");
const LOG_ID_KEY: &str = "log_id";

/// What a store file says about itself, as `PersistentStore::inspect` read it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreFacts {
    /// The log it was created for; `None` in a store from before ids.
    pub log_id: Option<String>,
    pub checkpoint: Option<Checkpoint>,
    /// Whether reading it took an open for writing with redb's integrity check (a file that
    /// needed crash recovery), so `verify` has nothing left to do.
    pub verified: bool,
}

/// redb's default page cache is 1 GiB per database, and a server holds one store per task. Hot
/// keys live in the dirty overlay anyway, so the cache only serves cold reads.
const CACHE_BYTES: usize = 64 * 1024 * 1024;

/// Uncommitted writes in key order, as `range` merges them over redb's: `None` is a tombstone
/// hiding the key in the layers below.
type Layer = BTreeMap<Bytes, Option<Bytes>>;

/// A key of a shard's dirty layer with its uncommitted versions, and the key's hash under the
/// store's hasher: the tables grow without hashing keys again, and the layers below are probed
/// with the same hash.
struct DirtyEntry {
    hash: u64,
    key: Bytes,
    versions: Versions,
}

/// A key of a frozen commit and its value (`None`: deleted), with its hash as in `DirtyEntry`.
struct FrozenEntry {
    hash: u64,
    key: Bytes,
    value: Option<Bytes>,
}

/// A shard's part of a frozen commit. A hash table like the dirty layer, not in key order: a
/// read finds its key in one probe, and only the commit's write sorts the keys, once
/// (`finish_commit_via`). An ordered map cost a key comparison per tree level on every access
/// (a quarter of the stream thread with a million keys, perf).
type FrozenLayer = hashbrown::HashTable<FrozenEntry>;

/// Which record a write belongs to, so that a commit takes exactly the writes of the records its
/// checkpoint covers (see `begin_commit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteTag {
    /// Covered by the next commit, whatever it covers: writes made through the `KeyValueStore`
    /// methods, and writes of a task that commits only when no record of it is in flight.
    Untracked,
    /// The write of the record at this source offset.
    Source(u64),
    /// The write of the retry-topic entry at offset `entry`, a retry of the record at source
    /// offset `source`. Covered only with both: a restart resumes at the source watermark and
    /// runs the records above it again, retried ones included.
    Retry { entry: u64, source: u64 },
}

impl WriteTag {
    fn covered_by(self, checkpoint: &Checkpoint) -> bool {
        match self {
            WriteTag::Untracked => true,
            WriteTag::Source(offset) => offset < checkpoint.watermark,
            WriteTag::Retry { entry, source } => {
                source < checkpoint.watermark
                    && (entry < checkpoint.retry_offset
                        || checkpoint.retry_done.binary_search(&entry).is_ok())
            }
        }
    }
}

/// The uncommitted values of one key, oldest first; the last is the current value. More than
/// one only while the key has writes that the next commit may have to leave out.
///
/// Invariant (kept by the runtime's per-key order, checked by `begin_commit`): the versions a
/// checkpoint covers are a prefix of the chain, since records of one key run in offset order.
#[derive(Debug)]
enum Versions {
    One(WriteTag, Option<Bytes>),
    Chain(Vec<(WriteTag, Option<Bytes>)>),
}

impl Versions {
    fn current(&self) -> &Option<Bytes> {
        match self {
            Versions::One(_, value) => value,
            Versions::Chain(chain) => chain.last().map_or(&None, |(_, value)| value),
        }
    }

    fn tags(&self) -> impl Iterator<Item = WriteTag> + '_ {
        let (one, chain) = match self {
            Versions::One(tag, _) => (Some(*tag), &[][..]),
            Versions::Chain(chain) => (None, &chain[..]),
        };
        one.into_iter().chain(chain.iter().map(|(tag, _)| *tag))
    }

    /// Adds a newer value. A version is dropped once the one after it is `settled` (covered by
    /// every future commit), so a key written by many records holds only the unsettled ones.
    fn push(&mut self, tag: WriteTag, value: Option<Bytes>, settled: impl Fn(WriteTag) -> bool) {
        let chain = match self {
            Versions::One(..) if settled(tag) => {
                *self = Versions::One(tag, value);
                return;
            }
            Versions::One(old_tag, old_value) => {
                let old = (*old_tag, old_value.take());
                *self = Versions::Chain(vec![old, (tag, value)]);
                return;
            }
            Versions::Chain(chain) => chain,
        };
        chain.push((tag, value));
        let settled_prefix = chain.iter().skip(1).take_while(|(tag, _)| settled(*tag)).count();
        chain.drain(..settled_prefix);
        if chain.len() == 1
            && let Some((tag, value)) = chain.pop()
        {
            *self = Versions::One(tag, value);
        }
    }

    /// Splits off what `checkpoint` covers: the value as of the covered prefix (if any) goes to
    /// the commit, the rest stays. `Err` if a covered version follows an uncovered one.
    fn split(&mut self, checkpoint: &Checkpoint) -> Result<Split, ()> {
        let covered = self.tags().take_while(|tag| tag.covered_by(checkpoint)).count();
        if self.tags().skip(covered).any(|tag| tag.covered_by(checkpoint)) {
            return Err(());
        }
        Ok(match self {
            Versions::One(_, value) if covered == 1 => Split::All(value.take()),
            Versions::Chain(chain) if covered == chain.len() => {
                Split::All(chain.pop().and_then(|(_, value)| value))
            }
            Versions::Chain(chain) if covered > 0 => {
                let value = chain[covered - 1].1.take();
                chain.drain(..covered);
                Split::Part(value)
            }
            _ => Split::None,
        })
    }
}

enum Split {
    /// Every version is covered: the key leaves the dirty layer with this value.
    All(Option<Bytes>),
    /// The covered prefix ends with this value; later versions stay.
    Part(Option<Bytes>),
    None,
}

/// A commit could not be frozen: some key's covered writes follow uncovered ones, which happens
/// only when records of one key ran out of offset order (a processor writing keys other than
/// its record's). The runtime then commits at a moment when none of the task's records is in
/// flight, where every write is covered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("writes to one key are not in offset order; commit when the task is quiescent")]
pub struct FreezeError;

/// The clean cache's default budget per store, in bytes (`store_cache_bytes`).
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

/// What a clean cache entry costs beyond its key and value bytes, so the budget bounds memory
/// rather than payload: its 24-byte slot and control byte, in a table between 7/16 and 7/8 full
/// as it grows by doubling.
const SLOT_COST: usize = 48;

/// A value length meaning: the key is absent from the commit.
const TOMBSTONE: u32 = u32::MAX;

/// Where one entry of a `Generation` is: its key's hash (so the table grows without hashing
/// again or reading the arena) and its key and value, one after the other in the arena.
struct Slot {
    hash: u64,
    at: u32,
    key_len: u32,
    /// `TOMBSTONE` for a key absent from the commit.
    value_len: u32,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 24);

impl Slot {
    fn key<'a>(&self, arena: &'a [u8]) -> &'a [u8] {
        let at = self.at as usize;
        &arena[at..at + self.key_len as usize]
    }

    fn value(&self, arena: &[u8]) -> Option<Bytes> {
        (self.value_len != TOMBSTONE).then(|| {
            let at = self.at as usize + self.key_len as usize;
            Bytes::copy_from_slice(&arena[at..at + self.value_len as usize])
        })
    }
}

/// One generation of a shard's clean cache: the entries' bytes appended to one arena and found
/// through a table of slots. A commit adds its entries without allocating each, a lookup
/// touches a slot and the key's bytes, and dropping the generation frees two blocks.
#[derive(Default)]
struct Generation {
    slots: hashbrown::HashTable<Slot>,
    arena: Vec<u8>,
    /// The arena's length and `SLOT_COST` per slot added. A replaced or removed entry's bytes
    /// stay in the arena, and charged, until the generation is dropped. (The arena's spare
    /// capacity is not charged: past a few pages it is address space the process has not
    /// touched.)
    charged: usize,
}

impl Generation {
    fn find(&self, hash: u64, key: &[u8]) -> Option<&Slot> {
        self.slots.find(hash, |slot| slot.key(&self.arena) == key)
    }

    fn remove(&mut self, hash: u64, key: &[u8]) {
        if let Ok(found) = self.slots.find_entry(hash, |slot| slot.key(&self.arena) == key) {
            found.remove();
        }
    }

    /// Adds or replaces the entry of `key`. The caller keeps `charged` within `u32::MAX`, so
    /// every offset and length fits a `Slot`.
    fn put(&mut self, hash: u64, key: &[u8], value: Option<&[u8]>) {
        let tail = value.unwrap_or_default();
        let slot = Slot {
            hash,
            at: self.arena.len() as u32,
            key_len: key.len() as u32,
            value_len: value.map_or(TOMBSTONE, |v| v.len() as u32),
        };
        let arena = &self.arena;
        match self.slots.find_mut(hash, |slot| slot.key(arena) == key) {
            Some(existing) => *existing = slot,
            None => {
                self.slots.insert_unique(hash, slot, |slot| slot.hash);
                self.charged += SLOT_COST;
            }
        }
        self.arena.extend_from_slice(key);
        self.arena.extend_from_slice(tail);
        self.charged += key.len() + tail.len();
    }
}

/// The clean cache of one shard: committed values (and tombstones) kept in memory so that a
/// read of a key not written since the last commit needs no redb lookup, bounded by bytes.
///
/// Eviction is by two generations, O(1) amortised per entry: new entries go to `young`; when
/// `young` would outgrow half the budget, `old` is dropped whole and `young` becomes `old`.
/// So the cache holds at most the budget, and at least half of it once full, favouring keys
/// committed recently. A hit in `old` is not promoted: it would take the shard's write lock
/// on the read path, and a key that is read is mostly written too (a read-modify-write), which
/// brings it back into `young` with its next commit. For the same reason a value read from
/// redb is not cached.
///
/// Invariants:
/// - `young` and `old` hold no key twice (an insert removes the key from `old`).
/// - An entry holds its key's value as of the last commit below the shard's frozen layer (the
///   last durable commit once `frozen` is None): commits and restores insert every key they
///   write, or evict it; nothing else writes the file.
/// - `complete`: every key present in that commit has an entry, so a miss means absent. True
///   only from an empty table (a new store, an empty file at open, a reset) and until an
///   entry is dropped unwritten (the eviction of a non-empty `old`, an entry over half the
///   budget, a failed restore); never with a budget of 0. While complete, tombstones are not
///   kept: a missing key is absent anyway.
/// - `young.charged` is at most `half_budget`, itself at most `u32::MAX`.
///
/// Keys are found by their hash under the store's hasher (`PersistentStore::hasher`), which the
/// caller passes in.
struct Clean {
    young: Generation,
    old: Generation,
    /// Half this shard's share of the store's budget; 0: the cache is off.
    half_budget: usize,
    complete: bool,
}

impl Clean {
    fn new(half_budget: usize, empty: bool) -> Clean {
        Clean {
            young: Generation::default(),
            old: Generation::default(),
            half_budget: half_budget.min(u32::MAX as usize),
            complete: empty && half_budget > 0,
        }
    }

    /// The committed value of `key` as the cache knows it: `Some(None)` for a key known to be
    /// absent (a tombstone, or any miss while complete), `None` when only redb can tell.
    fn lookup(&self, hash: u64, key: &[u8]) -> Option<Option<Bytes>> {
        if self.half_budget == 0 {
            return None;
        }
        if let Some(slot) = self.young.find(hash, key) {
            return Some(slot.value(&self.young.arena));
        }
        if let Some(slot) = self.old.find(hash, key) {
            return Some(slot.value(&self.old.arena));
        }
        self.complete.then_some(None)
    }

    /// Records `value` (None: deleted) as the committed value of `key`.
    fn insert(&mut self, hash: u64, key: &[u8], value: Option<&[u8]>) {
        if self.half_budget == 0 {
            return;
        }
        self.old.remove(hash, key);
        if value.is_none() && self.complete {
            self.young.remove(hash, key);
            return;
        }
        let cost = key.len() + value.map_or(0, <[u8]>::len) + SLOT_COST;
        if cost > self.half_budget {
            // Not kept, so the cache no longer knows every key.
            self.young.remove(hash, key);
            self.complete = false;
            return;
        }
        if self.young.charged + cost > self.half_budget {
            // The key's entry leaves with the rest of `young`, into `old`, where it is stale.
            self.young.remove(hash, key);
            if !self.old.slots.is_empty() {
                self.complete = false;
            }
            self.old = std::mem::take(&mut self.young);
        }
        self.young.put(hash, key, value);
    }

    /// Forgets every entry; `empty`: the committed table is empty, so the cache is complete.
    fn clear(&mut self, empty: bool) {
        *self = Clean::new(self.half_budget, empty);
    }
}

struct ShardState {
    /// Writes since the last `begin_commit`, found by key hash (see `DirtyEntry`).
    dirty: hashbrown::HashTable<DirtyEntry>,
    /// The highest source offset and the retry tags in `dirty`: when the checkpoint covers them
    /// all, a commit takes the whole layer without looking at each key.
    highest_source: Option<u64>,
    retry_tags: Vec<WriteTag>,
    /// This shard's part of the frozen commit until `finish_commit` has made it durable.
    frozen: Option<Arc<FrozenLayer>>,
    /// Committed entries below `frozen`; see `Clean`.
    clean: Clean,
}

impl ShardState {
    fn new(clean: Clean) -> ShardState {
        ShardState {
            dirty: hashbrown::HashTable::new(),
            highest_source: None,
            retry_tags: Vec::new(),
            frozen: None,
            clean,
        }
    }

    fn note_tag(&mut self, tag: WriteTag) {
        match tag {
            WriteTag::Untracked => {}
            WriteTag::Source(offset) => {
                self.highest_source = Some(self.highest_source.map_or(offset, |h| h.max(offset)));
            }
            retry @ WriteTag::Retry { .. } => self.retry_tags.push(retry),
        }
    }

    fn all_covered_by(&self, checkpoint: &Checkpoint) -> bool {
        self.highest_source.is_none_or(|h| h < checkpoint.watermark)
            && self.retry_tags.iter().all(|tag| tag.covered_by(checkpoint))
    }

    /// The uncommitted versions of `key`, whose hash is `hash`.
    fn dirty(&self, hash: u64, key: &[u8]) -> Option<&Versions> {
        self.dirty
            .find(hash, |entry| entry.key == key)
            .map(|entry| &entry.versions)
    }

    /// The value of `key` as of the last commit, if the frozen layer or the clean cache knows it:
    /// `Some(None)` for a key known to be absent, `None` when only redb can tell.
    fn below_dirty(&self, hash: u64, key: &[u8]) -> Option<Option<Bytes>> {
        if let Some(frozen) = &self.frozen
            && let Some(entry) = frozen.find(hash, |entry| entry.key == key)
        {
            return Some(entry.value.clone());
        }
        self.clean.lookup(hash, key)
    }

    /// Adds a version of `key`, whose hash is `hash`. `owned` makes the key's `Bytes` only
    /// when it has no entry yet: a key written again costs no allocation.
    fn write(
        &mut self,
        hash: u64,
        key: &[u8],
        owned: impl FnOnce() -> Bytes,
        tag: WriteTag,
        value: Option<Bytes>,
        settled_below: u64,
    ) {
        self.note_tag(tag);
        let settled = |tag: WriteTag| match tag {
            WriteTag::Untracked => true,
            WriteTag::Source(offset) => offset < settled_below,
            WriteTag::Retry { .. } => false,
        };
        match self.dirty.find_mut(hash, |entry| entry.key == key) {
            Some(entry) => entry.versions.push(tag, value, settled),
            None => {
                let entry = DirtyEntry {
                    hash,
                    key: owned(),
                    versions: Versions::One(tag, value),
                };
                self.dirty.insert_unique(hash, entry, |entry| entry.hash);
            }
        }
    }

    /// Moves what `checkpoint` covers into a new frozen layer.
    fn freeze(&mut self, checkpoint: &Checkpoint) -> Arc<FrozenLayer> {
        let mut layer = FrozenLayer::with_capacity(self.dirty.len());
        if self.all_covered_by(checkpoint) {
            // The next interval likely writes about as many keys: room for them up front, so
            // the table does not grow again by doubling.
            let capacity = self.dirty.len();
            let dirty = std::mem::replace(&mut self.dirty, hashbrown::HashTable::with_capacity(capacity));
            for entry in dirty {
                let value = match entry.versions {
                    Versions::One(_, value) => value,
                    Versions::Chain(mut chain) => chain.pop().and_then(|(_, value)| value),
                };
                let frozen = FrozenEntry {
                    hash: entry.hash,
                    key: entry.key,
                    value,
                };
                layer.insert_unique(frozen.hash, frozen, |entry| entry.hash);
            }
        } else {
            self.dirty.retain(|entry| {
                // `begin_commit` checked every chain first, so a split cannot fail here.
                let (value, stays) = match entry.versions.split(checkpoint) {
                    Ok(Split::All(value)) => (value, false),
                    Ok(Split::Part(value)) => (value, true),
                    Ok(Split::None) | Err(()) => return true,
                };
                let frozen = FrozenEntry {
                    hash: entry.hash,
                    key: entry.key.clone(),
                    value,
                };
                layer.insert_unique(frozen.hash, frozen, |entry| entry.hash);
                stays
            });
            layer.shrink_to_fit(|entry| entry.hash);
        }
        self.highest_source = None;
        self.retry_tags.clear();
        let tags: Vec<WriteTag> = self
            .dirty
            .iter()
            .flat_map(|entry| entry.versions.tags())
            .collect();
        for tag in tags {
            self.note_tag(tag);
        }
        let layer = Arc::new(layer);
        self.frozen = Some(layer.clone());
        layer
    }

    /// Whether every key's covered versions form a prefix of its chain.
    fn can_freeze(&self, checkpoint: &Checkpoint) -> bool {
        self.all_covered_by(checkpoint)
            || self.dirty.iter().all(|entry| {
                let covered = entry
                    .versions
                    .tags()
                    .take_while(|tag| tag.covered_by(checkpoint))
                    .count();
                !entry
                    .versions
                    .tags()
                    .skip(covered)
                    .any(|tag| tag.covered_by(checkpoint))
            })
    }
}

/// A frozen commit not yet durable: one layer per shard, and the checkpoint it is as of.
#[derive(Clone)]
struct Pending {
    layers: Arc<[Arc<FrozenLayer>]>,
    checkpoint: Checkpoint,
}

/// Keeps each shard's lock on its own cache lines, so threads on different shards do not
/// contend through false sharing.
#[repr(align(128))]
struct Shard(RwLock<ShardState>);

/// The last commit, as one redb read transaction. The `ReadOnlyTable` holds the transaction
/// alive by itself, so this is cached and shared instead of beginning a transaction per read.
struct Committed {
    data: ReadOnlyTable<&'static [u8], &'static [u8]>,
    checkpoint: Option<Checkpoint>,
}

impl Committed {
    fn load(db: &Database) -> Result<Committed, redb::Error> {
        let txn = db.begin_read()?;
        let data = txn.open_table(DATA)?;
        let meta = txn.open_table(META)?;
        let retry_done = match txn.open_table(RETRY_DONE) {
            Ok(table) => table
                .get(RETRY_DONE_KEY)?
                .map(|guard| {
                    guard
                        .value()
                        .chunks_exact(8)
                        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                        .collect()
                })
                .unwrap_or_default(),
            // Written by the first commit that had any; older files have none.
            Err(redb::TableError::TableDoesNotExist(_)) => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        let changelog_offset = match txn.open_table(CHANGELOG) {
            Ok(table) => table.get(CHANGELOG_KEY)?.map(|guard| guard.value()),
            // Written by the first commit on Kafka; other files have none.
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(e.into()),
        };
        let checkpoint = meta.get(CHECKPOINT_KEY)?.map(|guard| {
            let (watermark, retry_offset) = guard.value();
            Checkpoint {
                watermark,
                retry_offset,
                retry_done,
                changelog_offset,
            }
        });
        Ok(Committed { data, checkpoint })
    }

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>, redb::Error> {
        Ok(self
            .data
            .get(key)?
            .map(|guard| Bytes::copy_from_slice(guard.value())))
    }

    fn contains(&self, key: &[u8]) -> Result<bool, redb::Error> {
        Ok(self.data.get(key)?.is_some())
    }

    /// Entries in `[from, to]`, with `overlay` (sorted, tombstones included) applied on top.
    fn merged_range(
        &self,
        overlay: Layer,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Bytes, Bytes)>, redb::Error> {
        let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (
            from.map_or(Bound::Unbounded, Bound::Included),
            to.map_or(Bound::Unbounded, Bound::Included),
        );
        let mut base = self.data.range::<&[u8]>(bounds)?;
        let mut next_base = base.next().transpose()?;
        let mut overlay = overlay.into_iter().peekable();
        let mut entries = Vec::new();
        while limit == 0 || entries.len() < limit {
            let order = match (overlay.peek(), &next_base) {
                (None, None) => break,
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (Some((over, _)), Some((key, _))) => over.as_ref().cmp(key.value()),
            };
            match order {
                Ordering::Less => {
                    if let Some((key, Some(value))) = overlay.next() {
                        entries.push((key, value));
                    }
                }
                Ordering::Equal => {
                    if let Some((key, Some(value))) = overlay.next() {
                        entries.push((key, value));
                    }
                    next_base = base.next().transpose()?;
                }
                Ordering::Greater => {
                    if let Some((key, value)) = &next_base {
                        entries.push((
                            Bytes::copy_from_slice(key.value()),
                            Bytes::copy_from_slice(value.value()),
                        ));
                    }
                    next_base = base.next().transpose()?;
                }
            }
        }
        Ok(entries)
    }
}

/// A redb-backed store of one task. See the module doc for the layers.
///
/// The runtime writes through `apply`, tagging each write with its record so that a commit
/// takes exactly the writes its checkpoint covers; the `KeyValueStore` methods write untracked.
/// A failed (or panicking) read of the redb file is a `StoreError` naming the file. Like
/// MemoryStore's, `update`'s closure must not call back into the store.
pub struct PersistentStore {
    /// The standard library's keyed hasher, as `MemoryStore`'s: keys come from producers. One
    /// for the whole store: a key's hash picks its shard and finds it in every layer of it, so
    /// an access hashes the key once.
    hasher: std::hash::RandomState,
    shards: Box<[Shard]>,
    /// Reads that reached the redb table, so tests can tell what the clean cache answered.
    #[cfg(test)]
    redb_reads: std::sync::atomic::AtomicU64,
    committed: RwLock<Arc<Committed>>,
    /// The frozen layers (one per shard) from `begin_commit` until `finish_commit` succeeds.
    pending: Mutex<Option<Pending>>,
    /// Serialises `finish_commit`s without making `begin_commit` wait for one.
    writer: Mutex<()>,
    /// The watermark of a commit announced and not yet frozen (`u64::MAX`: none): no write
    /// it covers may be dropped as settled before it freezes (see `apply`).
    announced: std::sync::atomic::AtomicU64,
    /// The store's last commit was begun (`begin_last_commit`): no other commit freezes after
    /// it. Set and read under `pending`'s lock, so a freeze is either before it or refused.
    last_begun: std::sync::atomic::AtomicBool,
    /// Only `finish_commit` uses it (reads go through `committed`). After an I/O error redb
    /// fails every later operation until the file is reopened, which `finish_commit` does at
    /// once (`reopen`); `None` while that failed. Declared after `committed`: the cached read
    /// transaction is dropped before the database.
    db: Mutex<Option<Database>>,
    /// Opens the file again; a parameter so tests can put a failing disk under the store.
    reopen: Reopen,
    path: PathBuf,
}

/// How `PersistentStore` opens its file again after a storage error.
type Reopen = Box<dyn Fn() -> Result<Database, redb::DatabaseError> + Send + Sync>;

/// A frozen write as a commit sorts them: the key's `sort_prefix`, the key, the value.
type SortedWrite<'a> = (u128, &'a Bytes, &'a Option<Bytes>);

/// The first 16 bytes of `key`, big-endian and zero-padded. Keys whose prefixes differ are in
/// the order of their prefixes (a shorter key padded with zeros sorts before any longer key
/// that continues it, as in byte order), so a sort compares these integers, kept in its
/// vector, and follows the keys' pointers only on a tie.
fn sort_prefix(key: &[u8]) -> u128 {
    let mut bytes = [0u8; 16];
    let n = key.len().min(16);
    bytes[..n].copy_from_slice(&key[..n]);
    u128::from_be_bytes(bytes)
}

/// The shard of a key with this hash (under `PersistentStore::hasher`): bits the hash tables
/// use neither for the bucket (the low bits) nor for the tag (the top 7).
fn shard_index(hash: u64) -> usize {
    (hash >> 32) as usize % SHARDS
}

/// Whether a redb error comes from the storage under the file rather than from its content:
/// what reopening the file can heal once the storage works again.
fn is_io(error: &redb::Error) -> bool {
    match error {
        // InvalidData is how redb reports a file that is not a redb database.
        redb::Error::Io(io) => io.kind() != std::io::ErrorKind::InvalidData,
        redb::Error::PreviousIo | redb::Error::DatabaseClosed => true,
        _ => false,
    }
}

fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    // A processor panicking inside `update` poisons the shard, but the shard is only changed
    // after its closure returns, so its content is still whole.
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

fn lock<T>(lock: &Mutex<T>) -> MutexGuard<'_, T> {
    lock.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes a rename in `path`'s directory durable.
fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => std::fs::File::open(parent)?.sync_all(),
        _ => Ok(()),
    }
}

/// Refuses an empty file before redb sees it: redb would initialise it as a new database.
fn refuse_empty(path: &Path) -> Result<(), StoreError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.len() == 0 => Err(StoreError::new(
            path,
            "the store is empty (0 bytes): it is damaged, and is left as it is",
        )),
        _ => Ok(()),
    }
}

/// Reads the identity and checkpoint of an open database.
fn read_facts(db: &impl ReadableDatabase) -> Result<(Option<String>, Option<Checkpoint>), redb::Error> {
    let txn = db.begin_read()?;
    let log_id = match txn.open_table(IDENTITY) {
        Ok(table) => table.get(LOG_ID_KEY)?.map(|id| id.value().to_string()),
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(e.into()),
    };
    let checkpoint = match txn.open_table(META) {
        Ok(meta) => meta.get(CHECKPOINT_KEY)?.map(|guard| {
            let (watermark, retry_offset) = guard.value();
            Checkpoint {
                watermark,
                retry_offset,
                ..Checkpoint::default()
            }
        }),
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(e.into()),
    };
    Ok((log_id, checkpoint))
}

/// An open for writing that checks the whole file first (redb's integrity check): a damaged
/// file is an error and nothing is written into it but redb's recovery flag.
fn open_checked(path: &Path) -> Result<Database, StoreError> {
    refuse_empty(path)?;
    guarded(path, || {
        Ok(Database::builder()
            .set_cache_size(CACHE_BYTES)
            .set_check_integrity_on_open(true)
            .open(path)?)
    })
}

impl PersistentStore {
    /// Opens the store file, or creates it when missing (`create` is how a data dir creates its
    /// stores, with the log's id; `crate::datadir` checks existing ones first). An empty,
    /// corrupt or unreadable file, or one that is not a redb file, is a StoreError naming the
    /// file; it is never reset. Its clean cache has the default budget (`DEFAULT_CACHE_BYTES`).
    pub fn open(path: &Path) -> Result<PersistentStore, StoreError> {
        PersistentStore::open_with_cache(path, DEFAULT_CACHE_BYTES)
    }

    /// `open` with a clean cache of at most `cache_bytes` (keys, values and the overhead of
    /// each entry; 0: no cache), shared evenly by the shards.
    pub fn open_with_cache(path: &Path, cache_bytes: usize) -> Result<PersistentStore, StoreError> {
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::new(path, e))?;
        }
        refuse_empty(path)?;
        let db = guarded(path, || {
            Ok(Database::builder().set_cache_size(CACHE_BYTES).create(path)?)
        })?;
        let reopen_path = path.to_path_buf();
        let reopen: Reopen = Box::new(move || {
            // An existing file only: a store deleted meanwhile is not recreated empty.
            Database::builder().set_cache_size(CACHE_BYTES).open(&reopen_path)
        });
        PersistentStore::start(path, db, reopen, cache_bytes)
    }

    /// Makes sure the tables exist and loads the last commit.
    fn start(
        path: &Path,
        db: Database,
        reopen: Reopen,
        cache_bytes: usize,
    ) -> Result<PersistentStore, StoreError> {
        let (committed, empty) = guarded(path, || {
            let mut txn = db.begin_write()?;
            txn.set_quick_repair(true);
            txn.open_table(DATA)?;
            txn.open_table(META)?;
            txn.commit()?;
            let committed = Committed::load(&db)?;
            let empty = committed.data.is_empty()?;
            Ok((committed, empty))
        })?;
        let clean_half_budget = cache_bytes / SHARDS / 2;
        Ok(PersistentStore {
            hasher: std::hash::RandomState::new(),
            shards: (0..SHARDS)
                .map(|_| Shard(RwLock::new(ShardState::new(Clean::new(clean_half_budget, empty)))))
                .collect(),
            #[cfg(test)]
            redb_reads: std::sync::atomic::AtomicU64::new(0),
            committed: RwLock::new(Arc::new(committed)),
            pending: Mutex::new(None),
            writer: Mutex::new(()),
            announced: std::sync::atomic::AtomicU64::new(u64::MAX),
            last_begun: std::sync::atomic::AtomicBool::new(false),
            db: Mutex::new(Some(db)),
            reopen,
            path: path.to_path_buf(),
        })
    }

    /// Creates a new store file for the log `log_id`. Fails if the file exists. The file is
    /// made whole beside its place and then renamed, so a crash never leaves a store that is
    /// empty or has no id.
    pub fn create(path: &Path, log_id: &str) -> Result<(), StoreError> {
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::new(path, e))?;
        }
        if path.exists() {
            return Err(StoreError::new(path, "cannot create the store: the file exists"));
        }
        let partial = path.with_extension("redb.partial");
        // Left by a crash in an earlier create: it never was a store.
        let _ = std::fs::remove_file(&partial);
        guarded(&partial, || {
            let db = Database::builder().set_cache_size(CACHE_BYTES).create(&partial)?;
            let mut txn = db.begin_write()?;
            txn.set_quick_repair(true);
            txn.open_table(DATA)?;
            txn.open_table(META)?;
            txn.open_table(IDENTITY)?.insert(LOG_ID_KEY, log_id)?;
            txn.commit()?;
            Ok(db.close()?)
        })?;
        std::fs::rename(&partial, path)
            .and_then(|()| sync_parent(path))
            .map_err(|e| StoreError::new(path, format_args!("cannot create the store: {e}")))
    }

    /// What the file says about itself, read without writing to it when redb allows (a file
    /// closed cleanly: redb's read-only open), so a store that turns out to be another log's
    /// is left byte for byte as it was. A file that needs crash recovery (every file after a
    /// SIGKILL) can only be read by an open for writing, with the integrity check, which
    /// recovers it; a damaged file is an error, with nothing written but redb's recovery flag.
    pub fn inspect(path: &Path) -> Result<StoreFacts, StoreError> {
        refuse_empty(path)?;
        let read_only = catch_unwind(AssertUnwindSafe(|| -> Result<_, redb::Error> {
            let db = Database::builder().open_read_only(path)?;
            read_facts(&db)
        }));
        if let Ok(Ok((log_id, checkpoint))) = read_only {
            return Ok(StoreFacts {
                log_id,
                checkpoint,
                verified: false,
            });
        }
        let db = open_checked(path)?;
        let (log_id, checkpoint) = guarded(path, || read_facts(&db))?;
        Ok(StoreFacts {
            log_id,
            checkpoint,
            verified: true,
        })
    }

    /// Checks the whole file (redb's integrity check). See `open_checked`.
    pub fn verify(path: &Path) -> Result<(), StoreError> {
        open_checked(path).map(drop)
    }

    /// Records `log_id` in a store from before ids; one that has an id keeps it.
    pub fn set_log_id_if_absent(path: &Path, log_id: &str) -> Result<(), StoreError> {
        let db = open_checked(path)?;
        guarded(path, || {
            let mut txn = db.begin_write()?;
            txn.set_quick_repair(true);
            {
                let mut table = txn.open_table(IDENTITY)?;
                if table.get(LOG_ID_KEY)?.is_none() {
                    table.insert(LOG_ID_KEY, log_id)?;
                }
            }
            txn.commit()?;
            Ok(())
        })
    }

    /// The checkpoint of the last commit, None if never committed.
    pub fn checkpoint(&self) -> Option<Checkpoint> {
        read(&self.committed).checkpoint.clone()
    }

    /// Freezes the writes `checkpoint` covers as the next commit (see `WriteTag`); later
    /// writes stay for the one after. Answers false (and freezes nothing) while the previous
    /// frozen commit is still being written, or failed to be written, and for good once the
    /// store's last commit was begun (see `begin_last_commit`).
    ///
    /// Untracked writes are always covered, so for them the freeze is exact only while no
    /// processor of the task runs, which is how the runtime calls it for untracked tasks.
    pub fn begin_commit(&self, checkpoint: &Checkpoint) -> Result<bool, FreezeError> {
        let frozen = self.freeze(checkpoint, false);
        // Frozen or given up: either way, no commit is on its way any more.
        self.announced
            .store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
        frozen
    }

    /// `begin_commit` for the store's last commit (its task leaves, or the app stops), which
    /// from its first call on is the only one that may freeze: a commit decided before it
    /// (at an older checkpoint) and begun after it would otherwise write that checkpoint over
    /// this one's, while the data keeps every write this one covers, so whoever resumes from
    /// the file would apply the records between the two again. It may be called again after
    /// answering false, once the commit it found pending is written.
    pub fn begin_last_commit(&self, checkpoint: &Checkpoint) -> Result<bool, FreezeError> {
        let frozen = self.freeze(checkpoint, true);
        self.announced
            .store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
        frozen
    }

    /// Whether the store's last commit was begun: `begin_commit` freezes nothing any more.
    pub fn last_commit_begun(&self) -> bool {
        self.last_begun.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A commit at `watermark` will freeze soon: until it has, `apply` keeps every version it
    /// covers, however settled the caller thinks it is (a caller that started after the commit
    /// was decided may know a higher watermark than the commit's).
    pub fn announce_commit(&self, watermark: u64) {
        self.announced
            .fetch_min(watermark, std::sync::atomic::Ordering::SeqCst);
    }

    fn freeze(&self, checkpoint: &Checkpoint, last: bool) -> Result<bool, FreezeError> {
        let mut pending = lock(&self.pending);
        if last {
            self.last_begun.store(true, std::sync::atomic::Ordering::SeqCst);
        } else if self.last_commit_begun() {
            return Ok(false);
        }
        if pending.is_some() {
            return Ok(false);
        }
        // Every shard is checked before any is split, so a refused freeze changes nothing.
        // Writes arriving meanwhile are of records the checkpoint does not cover (those it
        // covers completed before it was taken), so they cannot make a checked shard unfit.
        if !self
            .shards
            .iter()
            .all(|shard| read(&shard.0).can_freeze(checkpoint))
        {
            return Err(FreezeError);
        }
        let layers: Arc<[Arc<FrozenLayer>]> = self
            .shards
            .iter()
            .map(|shard| write(&shard.0).freeze(checkpoint))
            .collect();
        *pending = Some(Pending {
            layers,
            checkpoint: checkpoint.clone(),
        });
        Ok(true)
    }

    /// Applies the writes of one successful attempt, tagged with its record. `settled_below`
    /// is a source offset every future checkpoint's watermark is at or above (the task's
    /// watermark when the attempt started), so older versions of a key can be dropped.
    pub fn apply(&self, tag: WriteTag, writes: impl IntoIterator<Item = Write>, settled_below: u64) {
        let settled_below = settled_below.min(self.announced.load(std::sync::atomic::Ordering::SeqCst));
        for (key, value) in writes {
            let (hash, shard) = self.locate(&key);
            write(shard).write(hash, &key, || key.clone(), tag, value, settled_below);
        }
    }

    /// Writes the frozen commit (its writes and its checkpoint) in one durable transaction,
    /// then drops the frozen layer; answers the checkpoint written, or None if nothing was
    /// frozen (another call wrote it). Safe to call from another thread than begin_commit's,
    /// while processors keep writing.
    ///
    /// On error the frozen commit stays in place (reads still see it) and pending: calling
    /// this again retries it, which is harmless since it holds plain puts and deletes.
    pub fn finish_commit(&self) -> Result<Option<Checkpoint>, StoreError> {
        // Without a changelog the writes are not copied out at all.
        self.write_pending(|_, _| Ok(None))
    }

    /// `finish_commit`, handing the frozen commit's checkpoint and writes (in key order) to
    /// `changelog` first (a store on Kafka sends the writes to its changelog topic there, and
    /// under exactly-once commits them with the checkpoint's positions in one transaction). It
    /// runs under the lock that serialises commits, so the writes of two commits never reach
    /// the changelog out of order, and answers the changelog offset after its writes (`None`:
    /// it sent nothing), which the checkpoint records; without one the checkpoint keeps the
    /// previous commit's. If it fails, nothing is written and the commit stays pending (sent
    /// twice is harmless: the changelog holds values, not changes).
    pub fn finish_commit_via(
        &self,
        changelog: impl FnOnce(&Checkpoint, Vec<Write>) -> Result<Option<u64>, StoreError>,
    ) -> Result<Option<Checkpoint>, StoreError> {
        self.write_pending(|checkpoint, sorted| {
            let writes = sorted
                .iter()
                .map(|(_, key, value)| ((*key).clone(), (*value).clone()))
                .collect();
            changelog(checkpoint, writes)
        })
    }

    /// `finish_commit_via` with the frozen writes as they are sorted for redb.
    fn write_pending(
        &self,
        changelog: impl FnOnce(&Checkpoint, &[SortedWrite<'_>]) -> Result<Option<u64>, StoreError>,
    ) -> Result<Option<Checkpoint>, StoreError> {
        let _writer = lock(&self.writer);
        let Some(pending) = lock(&self.pending).clone() else {
            return Ok(None);
        };
        // In key order over all shards: in hash order the inserts would land all over redb's
        // B-tree, and a tree larger than redb's page cache is then read from the file again
        // and again. Sorted here, once per commit, rather than kept in order on every write.
        let mut sorted: Vec<SortedWrite<'_>> = pending
            .layers
            .iter()
            .flat_map(|layer| layer.iter())
            .map(|entry| (sort_prefix(&entry.key), &entry.key, &entry.value))
            .collect();
        // Keys are unique (a key belongs to one shard), so an unstable sort is exact.
        sorted.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(b.1)));
        let mut checkpoint = pending.checkpoint.clone();
        checkpoint.changelog_offset = match changelog(&checkpoint, &sorted)? {
            Some(next) => Some(next),
            None => self.checkpoint().and_then(|c| c.changelog_offset),
        };
        self.write_durably(
            false,
            sorted.iter().map(|(_, key, value)| (*key, *value)),
            &checkpoint,
        )?;
        drop(sorted);
        // The frozen entries are committed now: into the clean cache, which they replace in the
        // read order under the same lock. The layers are one per shard, in shard order.
        for (shard, layer) in self.shards.iter().zip(pending.layers.iter()) {
            let mut state = write(&shard.0);
            for entry in layer.iter() {
                state.clean.insert(entry.hash, &entry.key, entry.value.as_deref());
            }
            state.frozen = None;
        }
        *lock(&self.pending) = None;
        Ok(Some(checkpoint))
    }

    /// Writes changelog records being restored straight to the file, with the checkpoint
    /// moved to `changelog_next` (the offset after them; the positions stay as they are,
    /// or 0 in a store that has none yet). Durable chunk by chunk, so a restore cut short
    /// resumes where it stopped. Only for a store the runtime does not write meanwhile.
    pub fn restore_batch(&self, writes: &[Write], changelog_next: u64) -> Result<(), StoreError> {
        let _writer = lock(&self.writer);
        self.check_quiet()?;
        let checkpoint = Checkpoint {
            changelog_offset: Some(changelog_next),
            ..self.checkpoint().unwrap_or_default()
        };
        // Every shard held across the write, so no read sees the file restored and the clean
        // cache not yet (no frozen layer covers these writes). Reads wait for the restore,
        // which runs before the task does.
        let mut states: Vec<_> = self.shards.iter().map(|s| write(&s.0)).collect();
        let written = self.write_durably(false, writes.iter().map(|(k, v)| (k, v)), &checkpoint);
        match &written {
            // In order: a key written twice in the batch ends with its last value, as in redb.
            Ok(()) => {
                for (key, value) in writes {
                    let hash = self.hasher.hash_one(key);
                    states[shard_index(hash)]
                        .clean
                        .insert(hash, key, value.as_deref());
                }
            }
            // The transaction may have committed before failing: what the cache knew may be
            // stale, so it forgets it all.
            Err(_) => states.iter_mut().for_each(|state| state.clean.clear(false)),
        }
        written
    }

    /// Removes every entry and writes `checkpoint` in one durable transaction: a copy that
    /// cannot be brought up to date from where it stands is emptied before a full restore.
    /// Only for a store the runtime does not write meanwhile.
    pub fn reset(&self, checkpoint: &Checkpoint) -> Result<(), StoreError> {
        let _writer = lock(&self.writer);
        self.check_quiet()?;
        // As in `restore_batch`. Emptied, the store is known whole again: the cache is complete.
        let mut states: Vec<_> = self.shards.iter().map(|s| write(&s.0)).collect();
        let written = self.write_durably(true, std::iter::empty(), checkpoint);
        let emptied = written.is_ok();
        states.iter_mut().for_each(|state| state.clean.clear(emptied));
        written
    }

    /// Restores and resets write below the overlay, so there must be none.
    fn check_quiet(&self) -> Result<(), StoreError> {
        let quiet =
            lock(&self.pending).is_none() && self.shards.iter().all(|shard| read(&shard.0).dirty.is_empty());
        if quiet {
            Ok(())
        } else {
            Err(StoreError::new(
                &self.path,
                "cannot restore into a store with uncommitted writes",
            ))
        }
    }

    /// One durable transaction: (if `clear`) every entry removed, then `writes`, and the
    /// checkpoint; the committed view is reloaded after it. An I/O error reopens the file, so
    /// that a later attempt can succeed.
    fn write_durably<'a>(
        &self,
        clear: bool,
        writes: impl Iterator<Item = (&'a Bytes, &'a Option<Bytes>)>,
        checkpoint: &Checkpoint,
    ) -> Result<(), StoreError> {
        let mut db = lock(&self.db);
        if db.is_none() {
            self.reopen(&mut db)?;
        }
        let Some(open) = db.as_ref() else {
            return Err(StoreError::new(&self.path, "the store's file is not open"));
        };
        let written = catch_unwind(AssertUnwindSafe(|| -> Result<Committed, redb::Error> {
            let mut txn = open.begin_write()?;
            // Saves the allocator state with each commit, so reopening after a crash does not
            // walk the whole file; costs a second fsync per commit, once a second.
            txn.set_quick_repair(true);
            {
                if clear {
                    txn.delete_table(DATA)?;
                }
                let mut data = txn.open_table(DATA)?;
                for (key, value) in writes {
                    match value {
                        Some(value) => data.insert(key.as_ref(), value.as_ref())?,
                        None => data.remove(key.as_ref())?,
                    };
                }
                let mut meta = txn.open_table(META)?;
                meta.insert(CHECKPOINT_KEY, (checkpoint.watermark, checkpoint.retry_offset))?;
                let done: Vec<u8> = checkpoint
                    .retry_done
                    .iter()
                    .flat_map(|o| o.to_le_bytes())
                    .collect();
                txn.open_table(RETRY_DONE)?
                    .insert(RETRY_DONE_KEY, done.as_slice())?;
                match checkpoint.changelog_offset {
                    Some(offset) => {
                        txn.open_table(CHANGELOG)?.insert(CHANGELOG_KEY, offset)?;
                    }
                    None => {
                        txn.open_table(CHANGELOG)?.remove(CHANGELOG_KEY)?;
                    }
                }
            }
            txn.commit()?;
            Committed::load(open)
        }));
        let committed = match written {
            Ok(Ok(committed)) => committed,
            Ok(Err(error)) => {
                let failed = StoreError::new(&self.path, &error);
                if is_io(&error) {
                    // Heals the store for the next attempt; the error stands for this one.
                    if let Err(reopen) = self.reopen(&mut db) {
                        tracing::warn!(store = %self.path.display(), error = %reopen, "cannot reopen the store yet");
                    }
                }
                return Err(failed);
            }
            Err(payload) => {
                // redb leaked the transaction's pages; the reopen repairs them.
                let _ = self.reopen(&mut db);
                return Err(StoreError::new(
                    &self.path,
                    format_args!("corrupt: redb panicked: {}", panic_message(&*payload)),
                ));
            }
        };
        drop(db);
        // The new view goes in before a frozen layer goes out: a reader finding no frozen
        // layer must find its writes below.
        *write(&self.committed) = Arc::new(committed);
        Ok(())
    }

    /// Closes the database and opens the file again: redb's way out of an I/O error. The last
    /// commit is loaded anew from the reopened file; reads wait for it meanwhile, and queries
    /// still holding a snapshot of the old database fail (retryably). The frozen layer, if any,
    /// stays pending, so a later `finish_commit` writes it.
    fn reopen(&self, db: &mut Option<Database>) -> Result<(), StoreError> {
        let mut committed = write(&self.committed);
        if let Some(old) = db.take() {
            // Fails after an I/O error (it cannot record a clean shutdown): the open below then
            // recovers the file as after a crash.
            let _ = old.close();
        }
        let reopened = guarded(&self.path, || Ok((self.reopen)()?))?;
        let fresh = guarded(&self.path, || Committed::load(&reopened))?;
        *committed = Arc::new(fresh);
        *db = Some(reopened);
        tracing::info!(store = %self.path.display(), "store file reopened");
        Ok(())
    }

    /// A consistent read-only view of the last commit: entries and checkpoint from one redb
    /// read transaction. While it is alive redb cannot reuse the pages it sees, so hold it
    /// for one query, not for long.
    pub fn snapshot(&self) -> Result<StoreSnapshot, StoreError> {
        Ok(StoreSnapshot {
            committed: read(&self.committed).clone(),
            path: self.path.clone(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The hash of `key` under the store's hasher, and its shard.
    fn locate(&self, key: &[u8]) -> (u64, &RwLock<ShardState>) {
        let hash = self.hasher.hash_one(key);
        (hash, &self.shards[shard_index(hash)].0)
    }

    /// The current value of `key` (hash `hash`), in the shard whose lock the caller holds.
    fn current(&self, state: &ShardState, hash: u64, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        if let Some(versions) = state.dirty(hash, key) {
            return Ok(versions.current().clone());
        }
        if let Some(value) = state.below_dirty(hash, key) {
            return Ok(value);
        }
        #[cfg(test)]
        self.redb_reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let committed = read(&self.committed);
        guarded(&self.path, || committed.get(key))
    }
}

/// Whether `key` is within `[lower, upper]`.
fn in_bounds(key: &[u8], lower: Bound<&[u8]>, upper: Bound<&[u8]>) -> bool {
    RangeBounds::<[u8]>::contains(&(lower, upper), key)
}

impl KeyValueStore for PersistentStore {
    fn get(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        let (hash, shard) = self.locate(key);
        self.current(&read(shard), hash, key)
    }

    fn put(&self, key: Bytes, value: Bytes) -> Result<(), StoreError> {
        let (hash, shard) = self.locate(&key);
        write(shard).write(hash, &key, || key.clone(), WriteTag::Untracked, Some(value), 0);
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        let (hash, shard) = self.locate(key);
        let mut state = write(shard);
        let old = self.current(&state, hash, key)?;
        if old.is_some() {
            state.write(
                hash,
                key,
                || Bytes::copy_from_slice(key),
                WriteTag::Untracked,
                None,
                0,
            );
        }
        Ok(old)
    }

    /// Scans every uncommitted key of every shard (they are in hash order) to merge those in
    /// range over redb's: a range costs the size of the dirty and frozen layers, which point
    /// reads and writes, the runtime's work per record, do not.
    fn range(
        &self,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Bytes, Bytes)>, StoreError> {
        if let (Some(f), Some(t)) = (from, to)
            && f > t
        {
            return Ok(Vec::new());
        }
        let lower = from.map_or(Bound::Unbounded, Bound::Included);
        let upper = to.map_or(Bound::Unbounded, Bound::Included);
        // Every shard at once, so the overlay is one moment; the committed view taken under
        // the same locks already holds any frozen layer that is gone. The redb scan then runs
        // on that immutable view without blocking writers.
        let states: Vec<_> = self.shards.iter().map(|s| read(&s.0)).collect();
        let committed = read(&self.committed).clone();
        let mut overlay = Layer::new();
        for state in &states {
            if let Some(frozen) = &state.frozen {
                for entry in frozen.iter().filter(|e| in_bounds(&e.key, lower, upper)) {
                    overlay.insert(entry.key.clone(), entry.value.clone());
                }
            }
            // After the frozen layer: a key in both takes its dirty value.
            for entry in state.dirty.iter().filter(|e| in_bounds(&e.key, lower, upper)) {
                overlay.insert(entry.key.clone(), entry.versions.current().clone());
            }
        }
        drop(states);
        guarded(&self.path, || committed.merged_range(overlay, from, to, limit))
    }

    fn update(
        &self,
        key: &[u8],
        f: &mut dyn FnMut(Option<&Bytes>) -> Option<Bytes>,
    ) -> Result<(), StoreError> {
        let (hash, shard) = self.locate(key);
        let mut state = write(shard);
        let old = self.current(&state, hash, key)?;
        let value = f(old.as_ref());
        if value.is_some() || old.is_some() {
            state.write(
                hash,
                key,
                || Bytes::copy_from_slice(key),
                WriteTag::Untracked,
                value,
                0,
            );
        }
        Ok(())
    }

    /// Exact: the committed count corrected by every overlay key. Costs a redb lookup per
    /// uncommitted key, which is acceptable for a rarely used call.
    fn len(&self) -> Result<usize, StoreError> {
        let states: Vec<_> = self.shards.iter().map(|s| read(&s.0)).collect();
        let committed = read(&self.committed).clone();
        guarded(&self.path, || {
            let mut count = committed.data.len()? as i64;
            for state in &states {
                let frozen = state.frozen.as_deref();
                let frozen_only = frozen
                    .into_iter()
                    .flatten()
                    .filter(|e| state.dirty(e.hash, &e.key).is_none())
                    .map(|e| (&e.key, e.value.is_some()));
                let dirty = state
                    .dirty
                    .iter()
                    .map(|e| (&e.key, e.versions.current().is_some()));
                for (key, present) in dirty.chain(frozen_only) {
                    count += i64::from(present) - i64::from(committed.contains(key)?);
                }
            }
            Ok(count.max(0) as usize)
        })
    }
}

/// The last commit of a store, as one redb read transaction: never sees uncommitted writes nor
/// later commits, and never blocks processing.
pub struct StoreSnapshot {
    committed: Arc<Committed>,
    path: PathBuf,
}

impl StoreSnapshot {
    pub fn checkpoint(&self) -> Option<Checkpoint> {
        self.committed.checkpoint.clone()
    }

    pub fn get(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        guarded(&self.path, || self.committed.get(key))
    }

    /// `from <= key <= to` (absent = open), at most `limit` (0 = all), in key order.
    pub fn range(
        &self,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Bytes, Bytes)>, StoreError> {
        if let (Some(f), Some(t)) = (from, to)
            && f > t
        {
            return Ok(Vec::new());
        }
        guarded(&self.path, || {
            self.committed.merged_range(Layer::new(), from, to, limit)
        })
    }

    pub fn len(&self) -> Result<u64, StoreError> {
        guarded(&self.path, || Ok(self.committed.data.len()?))
    }

    pub fn is_empty(&self) -> Result<bool, StoreError> {
        Ok(self.len()? == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
    use std::time::{Duration, Instant};

    /// A unique directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let dir = std::env::temp_dir().join(format!(
                "taskstream-persistent-{name}-{}-{nanos}-{}",
                std::process::id(),
                NEXT.fetch_add(1, AtomicOrdering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn file(&self) -> PathBuf {
            self.0.join("store.redb")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    fn keys(entries: &[(Bytes, Bytes)]) -> Vec<Bytes> {
        entries.iter().map(|(k, _)| k.clone()).collect()
    }

    fn checkpoint(watermark: u64) -> Checkpoint {
        Checkpoint {
            watermark,
            retry_offset: watermark / 2,
            ..Checkpoint::default()
        }
    }

    fn commit(store: &PersistentStore, watermark: u64) {
        assert!(store.begin_commit(&checkpoint(watermark)).unwrap());
        assert_eq!(store.finish_commit().unwrap(), Some(checkpoint(watermark)));
    }

    fn count(old: Option<&Bytes>) -> Option<Bytes> {
        let n = old.map_or(0, |v| u64::from_le_bytes(v.as_ref().try_into().unwrap()));
        Some(Bytes::copy_from_slice(&(n + 1).to_le_bytes()))
    }

    fn as_count(value: Option<Bytes>) -> u64 {
        u64::from_le_bytes(value.unwrap().as_ref().try_into().unwrap())
    }

    #[test]
    fn uncommitted_writes_are_visible_to_the_store_but_not_to_snapshots() {
        let dir = TempDir::new("uncommitted");
        let store = PersistentStore::open(&dir.file()).unwrap();
        assert_eq!(store.checkpoint(), None);
        store.put(b("a"), b("1")).unwrap();
        store
            .update(b"b", &mut |old| {
                assert_eq!(old, None);
                Some(b("2"))
            })
            .unwrap();
        store
            .update(b"a", &mut |old| {
                assert_eq!(old, Some(&b("1")));
                Some(b("11"))
            })
            .unwrap();
        assert_eq!(store.get(b"a").unwrap(), Some(b("11")));
        assert_eq!(keys(&store.range(None, None, 0).unwrap()), vec![b("a"), b("b")]);
        assert_eq!(store.len().unwrap(), 2);

        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.get(b"a").unwrap(), None);
        assert!(snapshot.range(None, None, 0).unwrap().is_empty());
        assert_eq!(snapshot.len().unwrap(), 0);
        assert_eq!(snapshot.checkpoint(), None);
    }

    #[test]
    fn a_commit_makes_writes_and_checkpoint_visible_to_snapshots_and_durable() {
        let dir = TempDir::new("commit");
        let store = PersistentStore::open(&dir.file()).unwrap();
        store.put(b("a"), b("1")).unwrap();
        store.put(b("b"), b("2")).unwrap();
        let before = store.snapshot().unwrap();
        commit(&store, 10);
        let checkpoint = Checkpoint {
            watermark: 10,
            retry_offset: 5,
            ..Checkpoint::default()
        };
        assert_eq!(store.checkpoint(), Some(checkpoint.clone()));
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.checkpoint(), Some(checkpoint.clone()));
        assert_eq!(snapshot.get(b"a").unwrap(), Some(b("1")));
        assert_eq!(
            snapshot.range(None, None, 0).unwrap(),
            vec![(b("a"), b("1")), (b("b"), b("2"))]
        );
        assert_eq!(snapshot.len().unwrap(), 2);
        // MVCC: a snapshot taken before the commit keeps seeing the state it was taken at.
        assert_eq!(before.get(b"a").unwrap(), None);
        assert_eq!(before.checkpoint(), None);
        drop((before, snapshot, store));

        let store = PersistentStore::open(&dir.file()).unwrap();
        assert_eq!(store.checkpoint(), Some(checkpoint.clone()));
        assert_eq!(store.get(b"b").unwrap(), Some(b("2")));
        assert_eq!(store.len().unwrap(), 2);
    }

    #[test]
    fn writes_after_begin_commit_are_not_part_of_that_commit() {
        let dir = TempDir::new("frozen");
        let store = PersistentStore::open(&dir.file()).unwrap();
        store.put(b("k"), b("frozen")).unwrap();
        store.put(b("gone"), b("x")).unwrap();
        let checkpoint = Checkpoint {
            watermark: 7,
            retry_offset: 3,
            ..Checkpoint::default()
        };
        assert!(store.begin_commit(&checkpoint).unwrap());
        store.put(b("k"), b("dirty")).unwrap();
        store.put(b("new"), b("dirty")).unwrap();
        store.delete(b"gone").unwrap();
        assert_eq!(store.get(b"k").unwrap(), Some(b("dirty")));
        store
            .update(b"k", &mut |old| {
                assert_eq!(old, Some(&b("dirty")));
                Some(b("dirty2"))
            })
            .unwrap();
        store.finish_commit().unwrap();
        // The later writes are still visible to the store itself...
        assert_eq!(store.get(b"k").unwrap(), Some(b("dirty2")));
        assert_eq!(store.get(b"gone").unwrap(), None);
        // ...but only the frozen ones are committed.
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.get(b"k").unwrap(), Some(b("frozen")));
        assert_eq!(snapshot.get(b"gone").unwrap(), Some(b("x")));
        assert_eq!(snapshot.get(b"new").unwrap(), None);
        drop((snapshot, store));

        let store = PersistentStore::open(&dir.file()).unwrap();
        assert_eq!(store.checkpoint(), Some(checkpoint.clone()));
        assert_eq!(
            store.range(None, None, 0).unwrap(),
            vec![(b("gone"), b("x")), (b("k"), b("frozen"))]
        );
    }

    #[test]
    fn dropping_without_a_commit_keeps_only_the_committed_state() {
        let dir = TempDir::new("crash");
        let store = PersistentStore::open(&dir.file()).unwrap();
        for i in 0..100 {
            store.update(format!("k{i:03}").as_bytes(), &mut count).unwrap();
        }
        commit(&store, 100);
        for i in 0..200 {
            store.update(format!("k{i:03}").as_bytes(), &mut count).unwrap();
        }
        // Frozen but never finished: as lost as the dirty writes.
        assert!(store.begin_commit(&checkpoint(300)).unwrap());
        store.delete(b"k000").unwrap();
        drop(store);

        let store = PersistentStore::open(&dir.file()).unwrap();
        assert_eq!(store.checkpoint().unwrap().watermark, 100);
        assert_eq!(store.len().unwrap(), 100);
        assert_eq!(as_count(store.get(b"k000").unwrap()), 1);
        assert_eq!(store.get(b"k150").unwrap(), None);
    }

    #[test]
    fn tombstones_delete_committed_keys() {
        let dir = TempDir::new("tombstones");
        let store = PersistentStore::open(&dir.file()).unwrap();
        for key in ["a", "b", "c", "d"] {
            store.put(b(key), b(key)).unwrap();
        }
        commit(&store, 1);
        assert_eq!(store.delete(b"a").unwrap(), Some(b("a")));
        assert_eq!(store.delete(b"a").unwrap(), None);
        store
            .update(b"b", &mut |old| {
                assert_eq!(old, Some(&b("b")));
                None
            })
            .unwrap();
        // Deleting and re-putting in one commit leaves the new value.
        store.delete(b"c").unwrap();
        store.put(b("c"), b("c2")).unwrap();
        assert_eq!(store.get(b"a").unwrap(), None);
        assert_eq!(store.get(b"b").unwrap(), None);
        assert_eq!(store.len().unwrap(), 2);
        assert_eq!(keys(&store.range(None, None, 0).unwrap()), vec![b("c"), b("d")]);
        commit(&store, 2);
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.get(b"a").unwrap(), None);
        assert_eq!(
            snapshot.range(None, None, 0).unwrap(),
            vec![(b("c"), b("c2")), (b("d"), b("d"))]
        );
        assert_eq!(snapshot.len().unwrap(), 2);
        drop((snapshot, store));
        let store = PersistentStore::open(&dir.file()).unwrap();
        assert_eq!(store.len().unwrap(), 2);
        assert_eq!(store.get(b"b").unwrap(), None);
    }

    #[test]
    fn range_merges_the_three_layers_in_key_order_with_limit() {
        let dir = TempDir::new("range");
        let store = PersistentStore::open(&dir.file()).unwrap();
        for i in (0..30).step_by(3) {
            store.put(format!("k{i:02}").into(), b("committed")).unwrap();
        }
        commit(&store, 1);
        // Frozen layer: new keys, an overwrite and a tombstone over committed keys.
        store.put(b("k01"), b("frozen")).unwrap();
        store.put(b("k03"), b("frozen")).unwrap();
        store.delete(b"k06").unwrap();
        assert!(store.begin_commit(&checkpoint(2)).unwrap());
        // Dirty layer: new keys, overrides of frozen and committed keys, tombstones.
        store.put(b("k02"), b("dirty")).unwrap();
        store.put(b("k01"), b("dirty")).unwrap();
        store.delete(b"k09").unwrap();
        store.put(b("k06"), b("dirty")).unwrap();
        store.delete(b"k03").unwrap();

        let expected: Vec<(Bytes, Bytes)> = [
            ("k00", "committed"),
            ("k01", "dirty"),
            ("k02", "dirty"),
            ("k06", "dirty"),
            ("k12", "committed"),
            ("k15", "committed"),
            ("k18", "committed"),
            ("k21", "committed"),
            ("k24", "committed"),
            ("k27", "committed"),
        ]
        .iter()
        .map(|(k, v)| (b(k), b(v)))
        .collect();
        assert_eq!(store.range(None, None, 0).unwrap(), expected);
        assert_eq!(store.len().unwrap(), expected.len());
        assert_eq!(store.range(None, None, 4).unwrap(), expected[..4]);
        assert_eq!(
            store.range(Some(b"k01"), Some(b"k12"), 0).unwrap(),
            expected[1..5]
        );
        assert_eq!(store.range(Some(b"k03"), None, 2).unwrap(), expected[3..5]);
        assert_eq!(store.range(None, Some(b"k05"), 0).unwrap(), expected[..3]);
        assert!(store.range(Some(b"z"), Some(b"a"), 0).unwrap().is_empty());

        // Same answer once the frozen layer is committed, and after the dirty one is too.
        store.finish_commit().unwrap();
        assert_eq!(store.range(None, None, 0).unwrap(), expected);
        commit(&store, 3);
        assert_eq!(store.range(None, None, 0).unwrap(), expected);
        assert_eq!(store.snapshot().unwrap().range(None, None, 0).unwrap(), expected);
        assert_eq!(
            store.snapshot().unwrap().range(Some(b"k02"), None, 3).unwrap(),
            expected[2..5]
        );
    }

    #[test]
    fn begin_commit_refuses_while_a_frozen_layer_is_pending() {
        let dir = TempDir::new("pending");
        let store = PersistentStore::open(&dir.file()).unwrap();
        store.put(b("a"), b("1")).unwrap();
        assert!(store.begin_commit(&checkpoint(0)).unwrap());
        store.put(b("b"), b("2")).unwrap();
        assert!(!store.begin_commit(&checkpoint(1)).unwrap());
        assert!(!store.begin_commit(&checkpoint(1)).unwrap());
        assert_eq!(store.finish_commit().unwrap(), Some(checkpoint(0)));
        assert_eq!(store.finish_commit().unwrap(), None, "nothing left to write");
        // The refused calls froze nothing: "b" waits for the next commit.
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.get(b"b").unwrap(), None);
        assert_eq!(snapshot.checkpoint(), Some(checkpoint(0)));
        commit(&store, 1);
        assert_eq!(store.snapshot().unwrap().get(b"b").unwrap(), Some(b("2")));
    }

    /// Once the last commit has begun, a commit decided before it (at an older checkpoint)
    /// freezes nothing, pending or written the last one; the last one itself begins again
    /// once the commit it found pending is written, and its checkpoint stays the file's.
    #[test]
    fn after_the_last_commit_begins_no_other_commit_freezes() {
        let dir = TempDir::new("last");
        let store = PersistentStore::open(&dir.file()).unwrap();
        commit(&store, 2);
        store.apply(WriteTag::Source(3), [(b("a"), Some(b("a@3")))], 0);
        store.apply(WriteTag::Source(6), [(b("b"), Some(b("b@6")))], 0);
        assert!(store.begin_commit(&checkpoint(4)).unwrap());
        assert!(!store.last_commit_begun());
        assert!(!store.begin_last_commit(&checkpoint(5)).unwrap(), "4 is pending");
        assert!(store.last_commit_begun());
        assert_eq!(store.finish_commit().unwrap(), Some(checkpoint(4)));
        assert!(
            !store.begin_commit(&checkpoint(4)).unwrap(),
            "nothing pending, still refused"
        );
        assert!(store.begin_last_commit(&checkpoint(5)).unwrap());
        assert!(!store.begin_commit(&checkpoint(4)).unwrap());
        assert_eq!(store.finish_commit().unwrap(), Some(checkpoint(5)));
        assert!(!store.begin_commit(&checkpoint(4)).unwrap());
        assert_eq!(store.finish_commit().unwrap(), None);
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.checkpoint(), Some(checkpoint(5)));
        assert_eq!(snapshot.get(b"a").unwrap(), Some(b("a@3")));
        assert_eq!(snapshot.get(b"b").unwrap(), None, "offset 6 is not covered");
    }

    /// Tagged writes: a commit takes exactly those of the records its checkpoint covers, per
    /// key the value as of the last covered one, and keeps the rest for the next commit.
    #[test]
    fn a_commit_takes_exactly_the_writes_its_checkpoint_covers() {
        let dir = TempDir::new("tagged");
        let store = PersistentStore::open(&dir.file()).unwrap();
        let put = |key: &str, value: &str, tag: WriteTag| store.apply(tag, [(b(key), Some(b(value)))], 0);
        put("a", "a@1", WriteTag::Source(1));
        put("b", "b@2", WriteTag::Source(2));
        put("a", "a@5", WriteTag::Source(5));
        put("c", "c@r7", WriteTag::Retry { entry: 7, source: 0 });
        // A retry of a record above the watermark is not covered, even when final.
        put("d", "d@r8", WriteTag::Retry { entry: 8, source: 9 });
        put("c", "c@6", WriteTag::Source(6));
        store.apply(WriteTag::Source(3), [(b("b"), None)], 0);
        assert_eq!(store.get(b"a").unwrap(), Some(b("a@5")), "reads see the newest");
        // Watermark 4, retry entry 7 final above the retry watermark 0.
        let covered = Checkpoint {
            watermark: 4,
            retry_offset: 0,
            retry_done: vec![7, 8],
            changelog_offset: None,
        };
        assert!(store.begin_commit(&covered).unwrap());
        store.finish_commit().unwrap();
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.get(b"a").unwrap(), Some(b("a@1")));
        assert_eq!(snapshot.get(b"b").unwrap(), None, "deleted at 3");
        assert_eq!(snapshot.get(b"c").unwrap(), Some(b("c@r7")));
        assert_eq!(snapshot.get(b"d").unwrap(), None);
        assert_eq!(store.get(b"a").unwrap(), Some(b("a@5")));
        assert_eq!(store.get(b"c").unwrap(), Some(b("c@6")));
        commit(&store, 10);
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.get(b"a").unwrap(), Some(b("a@5")));
        assert_eq!(snapshot.get(b"c").unwrap(), Some(b("c@6")));
    }

    #[test]
    fn a_key_written_out_of_offset_order_refuses_to_freeze_and_changes_nothing() {
        let dir = TempDir::new("interleaved");
        let store = PersistentStore::open(&dir.file()).unwrap();
        store.apply(WriteTag::Source(9), [(b("k"), Some(b("late")))], 0);
        store.apply(WriteTag::Source(2), [(b("k"), Some(b("early")))], 0);
        store.apply(WriteTag::Source(1), [(b("j"), Some(b("j")))], 0);
        assert_eq!(store.begin_commit(&checkpoint(5)), Err(FreezeError));
        assert_eq!(store.get(b"j").unwrap(), Some(b("j")));
        // Once everything is covered, it freezes.
        commit(&store, 10);
        assert_eq!(store.snapshot().unwrap().get(b"k").unwrap(), Some(b("early")));
    }

    #[test]
    fn settled_versions_are_dropped_so_a_hot_key_keeps_only_what_a_commit_may_need() {
        let dir = TempDir::new("settled");
        let store = PersistentStore::open(&dir.file()).unwrap();
        for offset in 0..1_000u64 {
            // Every offset below `offset - 10` is below every later checkpoint.
            let settled = offset.saturating_sub(10);
            store.apply(
                WriteTag::Source(offset),
                [(b("hot"), Some(Bytes::from(offset.to_string())))],
                settled,
            );
        }
        let (hash, shard) = store.locate(b"hot");
        let versions = match read(shard).dirty(hash, b"hot") {
            Some(Versions::Chain(chain)) => chain.len(),
            Some(Versions::One(..)) => 1,
            None => 0,
        };
        assert!(versions <= 12, "{versions} versions kept");
        assert!(store.begin_commit(&checkpoint(995)).unwrap());
        store.finish_commit().unwrap();
        assert_eq!(store.snapshot().unwrap().get(b"hot").unwrap(), Some(b("994")));
    }

    #[test]
    fn concurrent_updates_of_one_key_lose_nothing_while_a_commit_is_written() {
        let dir = TempDir::new("concurrent");
        let store = Arc::new(PersistentStore::open(&dir.file()).unwrap());
        for _ in 0..500 {
            store.update(b"hot", &mut count).unwrap();
        }
        commit(&store, 1);
        for _ in 0..500 {
            store.update(b"hot", &mut count).unwrap();
        }
        assert!(store.begin_commit(&checkpoint(2)).unwrap());
        let finisher = {
            let store = store.clone();
            std::thread::spawn(move || store.finish_commit().unwrap())
        };
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        store.update(b"hot", &mut count).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        finisher.join().unwrap();
        assert_eq!(as_count(store.get(b"hot").unwrap()), 41_000);
        assert_eq!(as_count(store.snapshot().unwrap().get(b"hot").unwrap()), 1_000);
        commit(&store, 3);
        assert_eq!(as_count(store.snapshot().unwrap().get(b"hot").unwrap()), 41_000);
    }

    /// Many keys, each commit written on another thread while this one reads and updates
    /// keys in every layer (dirty, frozen, the clean cache, redb: the cache is small enough to
    /// evict): every read is the model's value, every commit holds exactly what it froze, and
    /// a store dropped with a frozen commit unwritten (a crash mid-commit) reopens with the
    /// last written one.
    #[test]
    fn reads_and_updates_while_commits_are_written_elsewhere_match_a_model() {
        const KEYS: u64 = 3_000;
        let dir = TempDir::new("writer-model");
        let key = |k: u64| Bytes::from(format!("key-{k:05}"));
        let mut model: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
        let mut x = 7u64;
        let mut next_key = move || {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (x >> 33) % KEYS
        };
        let store = Arc::new(PersistentStore::open_with_cache(&dir.file(), tiny_budget(20)).unwrap());
        let mut durable = model.clone();
        for round in 1..=12u64 {
            for _ in 0..2_000 {
                let k = next_key();
                store.update(&key(k), &mut count).unwrap();
                *model.entry(k).or_default() += 1;
            }
            assert!(store.begin_commit(&checkpoint(round)).unwrap());
            let frozen = model.clone();
            let writer = {
                let store = store.clone();
                std::thread::spawn(move || store.finish_commit().unwrap())
            };
            let mut steps = 0;
            while steps < 2_000 || !writer.is_finished() {
                let k = next_key();
                if steps % 2 == 0 {
                    let seen = store.get(&key(k)).unwrap().map(|v| as_count(Some(v)));
                    assert_eq!(seen, model.get(&k).copied(), "key {k} in round {round}");
                } else {
                    store.update(&key(k), &mut count).unwrap();
                    *model.entry(k).or_default() += 1;
                }
                steps += 1;
            }
            assert_eq!(writer.join().unwrap(), Some(checkpoint(round)));
            let snapshot = store.snapshot().unwrap();
            for k in 0..KEYS {
                let committed = snapshot.get(&key(k)).unwrap().map(|v| as_count(Some(v)));
                assert_eq!(
                    committed,
                    frozen.get(&k).copied(),
                    "key {k} committed in round {round}"
                );
            }
            durable = frozen;
        }
        assert_eq!(store.len().unwrap(), model.len());
        // A crash after the freeze, before the write: the reopened store is the last commit.
        store.update(&key(0), &mut count).unwrap();
        assert!(store.begin_commit(&checkpoint(100)).unwrap());
        drop(store);
        let reopened = PersistentStore::open_with_cache(&dir.file(), tiny_budget(20)).unwrap();
        assert_eq!(reopened.checkpoint(), Some(checkpoint(12)));
        for k in 0..KEYS {
            let value = reopened.get(&key(k)).unwrap().map(|v| as_count(Some(v)));
            assert_eq!(value, durable.get(&k).copied(), "key {k} after the reopen");
        }
    }

    #[test]
    fn a_garbage_file_is_an_error_naming_it() {
        let dir = TempDir::new("garbage");
        let file = dir.file();
        std::fs::write(&file, vec![0x5a; 8192]).unwrap();
        let err = PersistentStore::open(&file).err().unwrap();
        assert_eq!(err.path, file.display().to_string());
        assert!(err.to_string().contains(&file.display().to_string()));
        // Never reset silently.
        assert_eq!(std::fs::read(&file).unwrap(), vec![0x5a; 8192]);
        let short = dir.0.join("short.redb");
        std::fs::write(&short, b"hello").unwrap();
        assert!(PersistentStore::open(&short).is_err());
    }

    #[test]
    fn a_damaged_redb_file_is_an_error_not_a_panic() {
        let dir = TempDir::new("damaged");
        let store = PersistentStore::open(&dir.file()).unwrap();
        for i in 0..5000 {
            store
                .put(format!("k{i}").into(), Bytes::from(vec![7u8; 100]))
                .unwrap();
        }
        commit(&store, 1);
        drop(store);
        // The magic number stays valid; the pages right after the header do not.
        let mut data = std::fs::read(dir.file()).unwrap();
        for byte in &mut data[4096..6096] {
            *byte ^= 0xff;
        }
        std::fs::write(dir.file(), &data).unwrap();
        let err = PersistentStore::open(&dir.file()).err().unwrap();
        assert_eq!(err.path, dir.file().display().to_string());
        assert!(err.message.contains("corrupt"), "{err}");
        assert_eq!(std::fs::read(dir.file()).unwrap(), data);
    }

    const LOG_ID: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn a_created_store_records_its_log_and_inspect_reads_it_without_writing() {
        let dir = TempDir::new("identity");
        let file = dir.file();
        PersistentStore::create(&file, LOG_ID).unwrap();
        assert!(
            PersistentStore::create(&file, LOG_ID).is_err(),
            "never over an existing file"
        );
        assert!(!dir.0.join("store.redb.partial").exists());
        let facts = PersistentStore::inspect(&file).unwrap();
        assert_eq!(facts.log_id.as_deref(), Some(LOG_ID));
        assert_eq!(facts.checkpoint, None);
        let store = PersistentStore::open(&file).unwrap();
        store.put(b("k"), b("v")).unwrap();
        commit(&store, 7);
        drop(store);
        let before = std::fs::read(&file).unwrap();
        let facts = PersistentStore::inspect(&file).unwrap();
        assert_eq!(facts.log_id.as_deref(), Some(LOG_ID));
        assert_eq!(
            facts.checkpoint.map(|c| (c.watermark, c.retry_offset)),
            Some((7, 3))
        );
        assert!(!facts.verified, "a cleanly closed file is read read-only");
        assert_eq!(std::fs::read(&file).unwrap(), before, "inspect writes nothing");
        PersistentStore::verify(&file).unwrap();
        // A store from before ids gets one; a store that has one keeps it.
        let legacy = dir.0.join("legacy.redb");
        drop(PersistentStore::open(&legacy).unwrap());
        assert_eq!(PersistentStore::inspect(&legacy).unwrap().log_id, None);
        PersistentStore::set_log_id_if_absent(&legacy, LOG_ID).unwrap();
        PersistentStore::set_log_id_if_absent(&legacy, "ffffffffffffffffffffffffffffffff").unwrap();
        assert_eq!(
            PersistentStore::inspect(&legacy).unwrap().log_id.as_deref(),
            Some(LOG_ID)
        );
    }

    #[test]
    fn an_empty_store_file_is_refused_by_every_open_and_left_empty() {
        let dir = TempDir::new("empty");
        let file = dir.file();
        std::fs::write(&file, b"").unwrap();
        for result in [
            PersistentStore::open(&file).map(drop),
            PersistentStore::inspect(&file).map(drop),
            PersistentStore::verify(&file),
            PersistentStore::set_log_id_if_absent(&file, LOG_ID),
        ] {
            let err = result.unwrap_err();
            assert_eq!(err.path, file.display().to_string());
            assert!(err.message.contains("empty"), "{err}");
        }
        assert_eq!(std::fs::metadata(&file).unwrap().len(), 0);
    }

    #[test]
    fn a_damaged_store_is_found_by_inspect_or_verify_and_only_the_recovery_flag_may_change() {
        let dir = TempDir::new("damaged-inspect");
        let file = dir.file();
        PersistentStore::create(&file, LOG_ID).unwrap();
        let store = PersistentStore::open(&file).unwrap();
        for i in 0..5000 {
            store
                .put(format!("k{i}").into(), Bytes::from(vec![7u8; 100]))
                .unwrap();
        }
        commit(&store, 1);
        drop(store);
        let mut data = std::fs::read(&file).unwrap();
        for byte in &mut data[4096..] {
            *byte ^= 0xff;
        }
        std::fs::write(&file, &data).unwrap();
        let found = PersistentStore::inspect(&file).and_then(|facts| {
            assert!(!facts.verified);
            PersistentStore::verify(&file)
        });
        let err = found.expect_err("damage over every page after the header is found");
        assert_eq!(err.path, file.display().to_string());
        let after = std::fs::read(&file).unwrap();
        assert_eq!(after.len(), data.len());
        let changed: Vec<usize> = (0..data.len()).filter(|&i| after[i] != data[i]).collect();
        assert!(changed.iter().all(|&i| i == 9), "bytes changed: {changed:?}");
    }

    #[test]
    fn a_commit_failed_by_a_full_disk_is_written_by_the_next_attempt_once_space_returns() {
        let dir = TempDir::new("enospc");
        let file = dir.file();
        let full = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = crate::fault_injection::opener(&file, &full);
        let db = open().unwrap();
        let store = PersistentStore::start(&file, db, Box::new(open), DEFAULT_CACHE_BYTES).unwrap();
        store.put(b("before"), b("1")).unwrap();
        commit(&store, 1);

        full.store(true, AtomicOrdering::Release);
        // Enough new data that the file must grow.
        for i in 0..20_000 {
            store
                .put(format!("k{i:05}").into(), Bytes::from(vec![7u8; 200]))
                .unwrap();
        }
        let checkpoint = Checkpoint {
            watermark: 2,
            retry_offset: 1,
            ..Checkpoint::default()
        };
        assert!(store.begin_commit(&checkpoint).unwrap());
        let err = store.finish_commit().unwrap_err();
        assert!(err.message.contains("No space left on device"), "{err}");
        // The store answers meanwhile: its frozen writes and, below them, the last commit.
        assert_eq!(store.get(b"k00042").unwrap(), Some(Bytes::from(vec![7u8; 200])));
        assert_eq!(store.get(b"before").unwrap(), Some(b("1")));
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.checkpoint().map(|c| c.watermark), Some(1));
        assert_eq!(snapshot.get(b"before").unwrap(), Some(b("1")));
        assert!(
            !store.begin_commit(&checkpoint).unwrap(),
            "the failed commit is still pending"
        );
        // Still full: the retry fails the same way, not with redb's "previous I/O error".
        let err = store.finish_commit().unwrap_err();
        assert!(err.message.contains("No space left on device"), "{err}");

        full.store(false, AtomicOrdering::Release);
        assert_eq!(store.finish_commit().unwrap(), Some(checkpoint.clone()));
        let snapshot = store.snapshot().unwrap();
        assert_eq!(snapshot.checkpoint().map(|c| c.watermark), Some(2));
        assert_eq!(snapshot.len().unwrap(), 20_001);
        assert!(
            store.begin_commit(&checkpoint).unwrap(),
            "nothing pending any more"
        );
        drop(snapshot);
        drop(store);
        let reopened = PersistentStore::open(&file).unwrap();
        assert_eq!(reopened.snapshot().unwrap().len().unwrap(), 20_001);
    }

    #[test]
    fn a_commit_hands_exactly_its_frozen_writes_to_the_changelog_and_records_its_end() {
        let dir = TempDir::new("changelog");
        let store = PersistentStore::open(&dir.file()).unwrap();
        store.apply(WriteTag::Source(0), [(b("a"), Some(b("1")))], 0);
        store.apply(WriteTag::Source(1), [(b("b"), Some(b("1")))], 0);
        store.apply(WriteTag::Source(5), [(b("a"), Some(b("2")))], 0);
        assert!(store.begin_commit(&checkpoint(2)).unwrap());
        let mut sent = Vec::new();
        let written = store
            .finish_commit_via(|_, writes| {
                sent = writes;
                Ok(Some(17))
            })
            .unwrap()
            .unwrap();
        // The write of offset 5 is not covered: neither committed nor sent.
        sent.sort();
        assert_eq!(sent, vec![(b("a"), Some(b("1"))), (b("b"), Some(b("1")))]);
        assert_eq!(written.changelog_offset, Some(17));
        assert_eq!(store.checkpoint().unwrap().changelog_offset, Some(17));

        // A commit that sends nothing keeps the offset; a failed send writes nothing.
        assert!(store.begin_commit(&checkpoint(3)).unwrap());
        store.finish_commit_via(|_, _| Ok(None)).unwrap();
        assert_eq!(store.checkpoint().unwrap().changelog_offset, Some(17));
        assert_eq!(store.checkpoint().unwrap().watermark, 3);
        assert!(store.begin_commit(&checkpoint(6)).unwrap());
        let refused = store.finish_commit_via(|_, _| Err(StoreError::new(Path::new("changelog-0"), "down")));
        assert!(refused.is_err());
        assert_eq!(store.checkpoint().unwrap().watermark, 3);
        assert_eq!(store.get(b"a").unwrap(), Some(b("2")));
        let again = store.finish_commit_via(|checkpoint, writes| {
            assert_eq!(checkpoint.watermark, 6);
            assert_eq!(writes, vec![(b("a"), Some(b("2")))]);
            Ok(Some(18))
        });
        assert_eq!(again.unwrap().unwrap().changelog_offset, Some(18));
        drop(store);
        let reopened = PersistentStore::open(&dir.file()).unwrap();
        assert_eq!(reopened.checkpoint().unwrap().changelog_offset, Some(18));
        assert_eq!(reopened.checkpoint().unwrap().watermark, 6);
    }

    #[test]
    fn restored_batches_are_durable_with_their_changelog_offset_and_reset_empties_the_store() {
        let dir = TempDir::new("restore");
        let store = PersistentStore::open(&dir.file()).unwrap();
        store
            .restore_batch(&[(b("a"), Some(b("1"))), (b("b"), Some(b("2")))], 10)
            .unwrap();
        store
            .restore_batch(&[(b("a"), None), (b("c"), Some(b("3")))], 25)
            .unwrap();
        // Positions stay as they were (none yet: 0); only the changelog offset moves.
        let restored = store.checkpoint().unwrap();
        assert_eq!((restored.watermark, restored.changelog_offset), (0, Some(25)));
        assert_eq!(
            keys(&store.snapshot().unwrap().range(None, None, 0).unwrap()),
            vec![b("b"), b("c")]
        );
        drop(store);
        let store = PersistentStore::open(&dir.file()).unwrap();
        assert_eq!(store.get(b"c").unwrap(), Some(b("3")));
        assert_eq!(store.checkpoint().unwrap().changelog_offset, Some(25));

        // A store with uncommitted writes refuses: a restore writes below them.
        store.put(b("d"), b("4")).unwrap();
        assert!(store.restore_batch(&[(b("e"), Some(b("5")))], 26).is_err());
        assert!(store.begin_commit(&checkpoint(4)).unwrap());
        assert_eq!(store.finish_commit().unwrap().unwrap().changelog_offset, Some(25));
        let emptied = Checkpoint {
            watermark: 40,
            retry_offset: 3,
            retry_done: vec![5],
            changelog_offset: Some(0),
        };
        store.reset(&emptied).unwrap();
        assert_eq!(store.len().unwrap(), 0);
        assert_eq!(store.checkpoint(), Some(emptied.clone()));
        drop(store);
        let store = PersistentStore::open(&dir.file()).unwrap();
        assert_eq!(store.len().unwrap(), 0);
        assert_eq!(store.checkpoint(), Some(emptied));
    }

    fn redb_reads(store: &PersistentStore) -> u64 {
        store.redb_reads.load(AtomicOrdering::Relaxed)
    }

    /// Whether every shard's clean cache is complete.
    fn complete(store: &PersistentStore) -> bool {
        store.shards.iter().all(|shard| read(&shard.0).clean.complete)
    }

    /// The bytes the clean caches are charged, checking each shard's accounting on the way.
    fn clean_bytes(store: &PersistentStore) -> usize {
        store
            .shards
            .iter()
            .map(|shard| {
                let clean = &read(&shard.0).clean;
                for generation in [&clean.young, &clean.old] {
                    assert!(
                        generation.arena.len() + SLOT_COST * generation.slots.len() <= generation.charged
                    );
                }
                assert!(clean.young.charged <= clean.half_budget);
                assert!(
                    clean
                        .young
                        .slots
                        .iter()
                        .all(|slot| { clean.old.find(slot.hash, slot.key(&clean.young.arena)).is_none() })
                );
                clean.young.charged + clean.old.charged
            })
            .sum()
    }

    /// A budget whose young generations hold about `entries` small entries per shard.
    fn tiny_budget(entries: usize) -> usize {
        SHARDS * 2 * entries * (SLOT_COST + 8)
    }

    #[test]
    fn a_complete_cache_answers_committed_and_absent_keys_without_redb() {
        let dir = TempDir::new("complete");
        let store = PersistentStore::open(&dir.file()).unwrap();
        store.put(b("a"), b("1")).unwrap();
        store.put(b("b"), Bytes::new()).unwrap();
        store.put(b("gone"), b("x")).unwrap();
        commit(&store, 1);
        store.delete(b"gone").unwrap();
        commit(&store, 2);
        assert!(complete(&store));
        assert_eq!(store.get(b"a").unwrap(), Some(b("1")));
        // An empty value is a value, not a tombstone.
        assert_eq!(store.get(b"b").unwrap(), Some(Bytes::new()));
        assert_eq!(store.get(b"gone").unwrap(), None);
        assert_eq!(store.get(b"never").unwrap(), None);
        store.update(b"c", &mut count).unwrap();
        assert_eq!(redb_reads(&store), 0, "every read answered from memory");

        // Opened with data, it knows nothing yet: misses ask redb, commits fill it again.
        drop(store);
        let store = PersistentStore::open(&dir.file()).unwrap();
        assert!(!complete(&store));
        assert_eq!(store.get(b"a").unwrap(), Some(b("1")));
        assert_eq!(store.get(b"never").unwrap(), None);
        assert_eq!(redb_reads(&store), 2);
        store.put(b("a"), b("2")).unwrap();
        store.delete(b"b").unwrap();
        commit(&store, 3);
        assert_eq!(redb_reads(&store), 3, "delete read b's old value");
        assert_eq!(store.get(b"a").unwrap(), Some(b("2")));
        // Not complete: the tombstone is kept, so the delete is known without redb too.
        assert_eq!(store.get(b"b").unwrap(), None);
        assert_eq!(redb_reads(&store), 3);

        // Without a cache, every read below the overlay is a redb lookup.
        drop(store);
        let store = PersistentStore::open_with_cache(&dir.file(), 0).unwrap();
        store.put(b("d"), b("4")).unwrap();
        commit(&store, 4);
        assert_eq!(store.get(b"d").unwrap(), Some(b("4")));
        assert_eq!(store.get(b"never").unwrap(), None);
        assert_eq!(redb_reads(&store), 2);
        assert_eq!(clean_bytes(&store), 0);
        // A new store without a cache cannot know its misses are absent either.
        let other = TempDir::new("complete-off");
        let store = PersistentStore::open_with_cache(&other.file(), 0).unwrap();
        assert!(!complete(&store));
    }

    #[test]
    fn eviction_keeps_reads_correct_and_the_cache_within_its_budget() {
        let dir = TempDir::new("evict");
        let budget = tiny_budget(4);
        let store = PersistentStore::open_with_cache(&dir.file(), budget).unwrap();
        let mut model = BTreeMap::new();
        for round in 0..8u64 {
            for i in 0..400u64 {
                let key = Bytes::from(format!("k{i:04}"));
                if (i + round) % 7 == 0 {
                    store.delete(&key).unwrap();
                    model.remove(&key);
                } else if (i * round) % 3 == 0 {
                    store.update(&key, &mut count).unwrap();
                    let n = model
                        .get(&key)
                        .map_or(0, |v: &Bytes| u64::from_le_bytes(v.as_ref().try_into().unwrap()));
                    model.insert(key, Bytes::copy_from_slice(&(n + 1).to_le_bytes()));
                }
            }
            commit(&store, round + 1);
            assert!(clean_bytes(&store) <= budget);
            for i in 0..410u64 {
                let key = Bytes::from(format!("k{i:04}"));
                assert_eq!(
                    store.get(&key).unwrap(),
                    model.get(&key).cloned(),
                    "{key:?} in round {round}"
                );
            }
        }
        assert!(!complete(&store), "400 keys do not fit");
        assert!(redb_reads(&store) > 0);
        assert!(clean_bytes(&store) > budget / 4, "the cache is used");
        assert_eq!(store.len().unwrap(), model.len());
    }

    #[test]
    fn an_entry_over_half_a_shard_budget_is_not_cached_and_ends_completeness() {
        let dir = TempDir::new("big");
        let store = PersistentStore::open_with_cache(&dir.file(), tiny_budget(2)).unwrap();
        store.put(b("small"), b("1")).unwrap();
        commit(&store, 1);
        assert!(complete(&store));
        store.put(b("big"), Bytes::from(vec![9u8; 1000])).unwrap();
        commit(&store, 2);
        assert!(!complete(&store));
        let before = redb_reads(&store);
        assert_eq!(store.get(b"big").unwrap(), Some(Bytes::from(vec![9u8; 1000])));
        assert_eq!(redb_reads(&store), before + 1);
    }

    #[test]
    fn restores_and_resets_keep_cached_reads_correct() {
        let dir = TempDir::new("restore-cache");
        let store = PersistentStore::open(&dir.file()).unwrap();
        store.put(b("a"), b("1")).unwrap();
        store.put(b("b"), b("2")).unwrap();
        commit(&store, 1);
        assert_eq!(store.get(b"a").unwrap(), Some(b("1")));
        // The restore writes below the cache: the cached values must follow.
        store
            .restore_batch(
                &[
                    (b("a"), Some(b("10"))),
                    (b("b"), None),
                    (b("c"), Some(b("3"))),
                    (b("a"), Some(b("11"))),
                ],
                5,
            )
            .unwrap();
        assert!(complete(&store), "a restore keeps a complete cache complete");
        assert_eq!(store.get(b"a").unwrap(), Some(b("11")));
        assert_eq!(store.get(b"b").unwrap(), None);
        assert_eq!(store.get(b"c").unwrap(), Some(b("3")));
        assert_eq!(redb_reads(&store), 0);
        // A reset empties the store, and the cache knows: complete, nothing left in it.
        store.reset(&checkpoint(9)).unwrap();
        assert!(complete(&store));
        assert_eq!(clean_bytes(&store), 0);
        assert_eq!(store.get(b"a").unwrap(), None);
        assert_eq!(store.get(b"c").unwrap(), None);
        assert_eq!(redb_reads(&store), 0);
        store.restore_batch(&[(b("d"), Some(b("4")))], 6).unwrap();
        assert_eq!(store.get(b"d").unwrap(), Some(b("4")));
        drop(store);

        // A store opened with data: the restore's values are cached, the rest read from redb.
        let store = PersistentStore::open(&dir.file()).unwrap();
        store
            .restore_batch(&[(b("e"), Some(b("5"))), (b("d"), None)], 7)
            .unwrap();
        assert_eq!(store.get(b"e").unwrap(), Some(b("5")));
        assert_eq!(store.get(b"d").unwrap(), None);
        assert_eq!(redb_reads(&store), 0);
        store.reset(&checkpoint(10)).unwrap();
        assert!(
            complete(&store),
            "a reset makes even a reopened store's cache complete"
        );
        assert_eq!(store.get(b"e").unwrap(), None);
        assert_eq!(redb_reads(&store), 0);
    }

    /// An operation of `a_cached_store_matches_a_model`.
    #[derive(Debug, Clone)]
    enum Op {
        Put(u8, Vec<u8>),
        Delete(u8),
        Update(u8),
        Get(u8),
        /// `range` from the first key to the second (`None`: open), at most `limit` entries.
        Range(Option<u8>, Option<u8>, usize),
        Len,
        BeginCommit,
        FinishCommit,
        Reopen,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0u8..24, proptest::collection::vec(any::<u8>(), 0..40)).prop_map(|(k, v)| Op::Put(k, v)),
            2 => (0u8..24).prop_map(Op::Delete),
            4 => (0u8..24).prop_map(Op::Update),
            6 => (0u8..24).prop_map(Op::Get),
            2 => (
                proptest::option::of(0u8..26),
                proptest::option::of(0u8..26),
                0usize..4
            )
                .prop_map(|(from, to, limit)| Op::Range(from, to, limit)),
            1 => Just(Op::Len),
            2 => Just(Op::BeginCommit),
            2 => Just(Op::FinishCommit),
            1 => Just(Op::Reopen),
        ]
    }

    /// Runs `ops` on a store with a clean cache of `cache_bytes` against a model: the current
    /// values, the values a frozen commit holds, and the last durable commit (what a reopen
    /// finds). Every read and the cache's accounting are checked as it goes.
    fn run_against_model(ops: &[Op], cache_bytes: usize) -> Result<(), proptest::test_runner::TestCaseError> {
        let dir = TempDir::new("cache-model");
        let mut store = Some(PersistentStore::open_with_cache(&dir.file(), cache_bytes).unwrap());
        let mut current: BTreeMap<u8, Bytes> = BTreeMap::new();
        let mut frozen: Option<BTreeMap<u8, Bytes>> = None;
        let mut durable: BTreeMap<u8, Bytes> = BTreeMap::new();
        let mut watermark = 0;
        let key = |k: u8| Bytes::from(vec![b'k', k]);
        for op in ops {
            let s = store.as_ref().unwrap();
            match op {
                Op::Put(k, v) => {
                    s.put(key(*k), Bytes::from(v.clone())).unwrap();
                    current.insert(*k, Bytes::from(v.clone()));
                }
                Op::Delete(k) => {
                    let old = s.delete(&key(*k)).unwrap();
                    proptest::prop_assert_eq!(old, current.remove(k));
                }
                Op::Update(k) => {
                    let mut seen = None;
                    s.update(&key(*k), &mut |old| {
                        seen = old.cloned();
                        let mut next = old.map_or_else(Vec::new, |v| v.to_vec());
                        next.push(*k);
                        Some(Bytes::from(next))
                    })
                    .unwrap();
                    proptest::prop_assert_eq!(&seen, &current.get(k).cloned());
                    let mut next = seen.map_or_else(Vec::new, |v| v.to_vec());
                    next.push(*k);
                    current.insert(*k, Bytes::from(next));
                }
                Op::Get(k) => {
                    proptest::prop_assert_eq!(s.get(&key(*k)).unwrap(), current.get(k).cloned(), "key {}", k);
                }
                Op::Range(from, to, limit) => {
                    let (low, high) = (from.unwrap_or(0), to.unwrap_or(u8::MAX));
                    let expected: Vec<(Bytes, Bytes)> = current
                        .iter()
                        .filter(|(k, _)| low <= **k && **k <= high)
                        .take(if *limit == 0 { usize::MAX } else { *limit })
                        .map(|(k, v)| (key(*k), v.clone()))
                        .collect();
                    let listed = s
                        .range(from.map(key).as_deref(), to.map(key).as_deref(), *limit)
                        .unwrap();
                    proptest::prop_assert_eq!(listed, expected, "range {:?}..={:?}", from, to);
                }
                Op::Len => {
                    proptest::prop_assert_eq!(s.len().unwrap(), current.len());
                }
                Op::BeginCommit => {
                    watermark += 1;
                    let began = s.begin_commit(&checkpoint(watermark)).unwrap();
                    proptest::prop_assert_eq!(began, frozen.is_none());
                    if began {
                        frozen = Some(current.clone());
                    }
                }
                Op::FinishCommit => {
                    let written = s.finish_commit().unwrap();
                    proptest::prop_assert_eq!(written.is_some(), frozen.is_some());
                    if let Some(committed) = frozen.take() {
                        durable = committed;
                    }
                }
                Op::Reopen => {
                    drop(store.take());
                    let s = PersistentStore::open_with_cache(&dir.file(), cache_bytes).unwrap();
                    current = durable.clone();
                    frozen = None;
                    let snapshot = s.snapshot().unwrap();
                    for k in 0u8..24 {
                        proptest::prop_assert_eq!(snapshot.get(&key(k)).unwrap(), durable.get(&k).cloned());
                    }
                    drop(snapshot);
                    store = Some(s);
                }
            }
            let s = store.as_ref().unwrap();
            proptest::prop_assert!(clean_bytes(s) <= cache_bytes);
        }
        let s = store.as_ref().unwrap();
        for k in 0u8..26 {
            proptest::prop_assert_eq!(
                s.get(&key(k)).unwrap(),
                current.get(&k).cloned(),
                "key {} at the end",
                k
            );
        }
        proptest::prop_assert_eq!(s.len().unwrap(), current.len());
        let listed: Vec<(Bytes, Bytes)> = current.iter().map(|(k, v)| (key(*k), v.clone())).collect();
        proptest::prop_assert_eq!(s.range(None, None, 0).unwrap(), listed);
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// The order a commit sorts its writes in (prefix, then the whole key) is byte order,
        /// for keys with zero bytes, keys that continue one another, and keys past 16 bytes.
        #[test]
        fn the_commit_order_is_byte_order(
            a in proptest::collection::vec(0u8..3, 0..20),
            b in proptest::collection::vec(0u8..3, 0..20),
        ) {
            let by_prefix = sort_prefix(&a).cmp(&sort_prefix(&b));
            proptest::prop_assert!(by_prefix == std::cmp::Ordering::Equal || by_prefix == a.cmp(&b));
            proptest::prop_assert_eq!(by_prefix.then_with(|| a.cmp(&b)), a.cmp(&b));
        }

        /// The store with a clean cache so small that it evicts all the time (a shard's young
        /// generation holds one or two entries, and some values fit in none) against a model.
        #[test]
        fn a_store_with_a_tiny_cache_matches_a_model(ops in proptest::collection::vec(op(), 1..160)) {
            run_against_model(&ops, tiny_budget(1))?;
        }

        /// The same with the default budget, where the cache of a new store stays complete.
        #[test]
        fn a_store_with_the_default_cache_matches_a_model(ops in proptest::collection::vec(op(), 1..160)) {
            run_against_model(&ops, DEFAULT_CACHE_BYTES)?;
        }

        /// The persistent store against a model: records (source offsets 0..n, each writing
        /// its key) complete in random order with each key's records in offset order, writes
        /// tagged and collapsed as the runtime does; commits at the completed prefix take
        /// exactly the values as of it, whatever was applied above.
        #[test]
        fn tagged_commits_match_a_model(
            keys in proptest::collection::vec(0u8..6, 1..120),
            order in proptest::collection::vec(proptest::prelude::any::<u16>(), 1..120),
            commit_every in 1usize..20,
        ) {
            let dir = TempDir::new("model");
            let store = PersistentStore::open(&dir.file()).unwrap();
            let n = keys.len();
            // Completion order: a permutation that keeps each key's offsets in order.
            let mut by_key: BTreeMap<u8, std::collections::VecDeque<usize>> = BTreeMap::new();
            for (o, k) in keys.iter().enumerate() {
                by_key.entry(*k).or_default().push_back(o);
            }
            let mut done = vec![false; n];
            let mut watermark = 0usize;
            let mut step = 0;
            // A commit decided at this watermark, frozen a few records later (as the runtime's
            // commit round announces, then freezes while other threads go on).
            let mut announced: Option<usize> = None;
            while done.iter().any(|d| !d) {
                let ready: Vec<u8> = by_key.iter().filter(|(_, q)| !q.is_empty()).map(|(k, _)| *k).collect();
                let k = ready[order[step % order.len()] as usize % ready.len()];
                let o = by_key.get_mut(&k).unwrap().pop_front().unwrap();
                // The record's write: its offset as the value, settled below the watermark
                // as it is now (at least as high as when the record started).
                store.apply(
                    WriteTag::Source(o as u64),
                    [(Bytes::from(vec![b'k', k]), Some(Bytes::from(o.to_string())))],
                    watermark as u64,
                );
                done[o] = true;
                while watermark < n && done[watermark] {
                    watermark += 1;
                }
                step += 1;
                if let Some(at) = announced.filter(|_| step % 3 == 0) {
                    let cp = Checkpoint { watermark: at as u64, ..Checkpoint::default() };
                    proptest::prop_assert!(store.begin_commit(&cp).unwrap());
                    store.finish_commit().unwrap();
                    announced = None;
                    let snapshot = store.snapshot().unwrap();
                    for key in 0u8..6 {
                        let expected = (0..at).rev().find(|&o| keys[o] == key).map(|o| Bytes::from(o.to_string()));
                        proptest::prop_assert_eq!(snapshot.get(&[b'k', key]).unwrap(), expected, "key {} at {}", key, at);
                    }
                } else if announced.is_none() && step % commit_every == 0 {
                    store.announce_commit(watermark as u64);
                    announced = Some(watermark);
                }
            }
        }
    }

    /// Updates of keys drawn uniformly from a million, committed every `PER_COMMIT` updates as
    /// the benchmark `floor` does, with the clean cache off and on: where the time goes. Run
    /// with `cargo test --release -p taskstream-server --lib cold_keys -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn cold_keys_update_throughput() {
        const KEYS: u64 = 1_000_000;
        const UPDATES: u64 = 4_000_000;
        const PER_COMMIT: u64 = 200_000;
        let keys: Vec<Vec<u8>> = (0..KEYS).map(|k| format!("key-{k:07}").into_bytes()).collect();
        for budget in [0, DEFAULT_CACHE_BYTES, 4 * DEFAULT_CACHE_BYTES] {
            let dir = TempDir::new("cold-keys");
            let store = PersistentStore::open_with_cache(&dir.file(), budget).unwrap();
            let (mut updating, mut committing) = (Duration::ZERO, Duration::ZERO);
            let mut x = 42u64;
            for round in 0..UPDATES / PER_COMMIT {
                let start = Instant::now();
                for _ in 0..PER_COMMIT {
                    // splitmix64
                    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = x;
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    z ^= z >> 31;
                    store.update(&keys[(z % KEYS) as usize], &mut count).unwrap();
                }
                let committed = Instant::now();
                commit(&store, round + 1);
                updating += committed - start;
                committing += committed.elapsed();
            }
            println!(
                "cache {budget:>10} B: {:.2} µs/update reading and writing, {:.2} µs/update committing, \
                 {} reads reached redb, complete: {}",
                updating.as_secs_f64() * 1e6 / UPDATES as f64,
                committing.as_secs_f64() * 1e6 / UPDATES as f64,
                redb_reads(&store),
                complete(&store)
            );
        }
    }

    /// Run with `cargo test --release -p taskstream-server --lib persistent -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn update_throughput() {
        const KEYS: usize = 1000;
        const SECONDS: f64 = 3.0;
        let keys: Arc<Vec<Vec<u8>>> =
            Arc::new((0..KEYS).map(|i| format!("key-{i:05}").into_bytes()).collect());
        for threads in [1, 4] {
            let memory = Arc::new(crate::store::MemoryStore::new());
            let rate = run(memory, threads, &keys, SECONDS, |_| ());
            println!("MemoryStore     {threads} thread(s): {rate:>10.0} updates/s per thread");

            let dir = TempDir::new("throughput");
            let store = Arc::new(PersistentStore::open(&dir.file()).unwrap());
            let commits = AtomicU64::new(0);
            let slowest_commit_us = Arc::new(AtomicU64::new(0));
            let rate = run(store.clone(), threads, &keys, SECONDS, |store| {
                let n = commits.load(AtomicOrdering::Relaxed) + 1;
                if store
                    .begin_commit(&Checkpoint {
                        watermark: n,
                        ..Checkpoint::default()
                    })
                    .unwrap()
                {
                    let (store, slowest) = (store.clone(), slowest_commit_us.clone());
                    commits.fetch_add(1, AtomicOrdering::Relaxed);
                    std::thread::spawn(move || {
                        let start = Instant::now();
                        store.finish_commit().unwrap();
                        let us = start.elapsed().as_micros() as u64;
                        slowest.fetch_max(us, AtomicOrdering::Relaxed);
                    });
                }
            });
            println!(
                "PersistentStore {threads} thread(s): {rate:>10.0} updates/s per thread \
                 ({} commits of {KEYS} keys, slowest finish_commit {} µs)",
                commits.load(AtomicOrdering::Relaxed),
                slowest_commit_us.load(AtomicOrdering::Relaxed)
            );
        }

        /// `threads` counting processors over the hot keys; every second `commit` runs while
        /// they are held at a gate, as the runtime's quiescence does. Returns updates/s/thread.
        fn run<S: KeyValueStore + 'static>(
            store: Arc<S>,
            threads: usize,
            keys: &Arc<Vec<Vec<u8>>>,
            seconds: f64,
            commit: impl Fn(&Arc<S>),
        ) -> f64 {
            let gate = Arc::new(RwLock::new(()));
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let (store, keys, gate, stop) = (store.clone(), keys.clone(), gate.clone(), stop.clone());
                    std::thread::spawn(move || {
                        let mut done = 0u64;
                        let mut i = t * 7919;
                        while !stop.load(AtomicOrdering::Relaxed) {
                            let _running = gate.read().unwrap();
                            for _ in 0..1000 {
                                i = (i + 1) % keys.len();
                                store.update(&keys[i], &mut count).unwrap();
                            }
                            done += 1000;
                        }
                        done
                    })
                })
                .collect();
            let start = Instant::now();
            while start.elapsed().as_secs_f64() < seconds {
                std::thread::sleep(Duration::from_secs(1));
                let _quiet = gate.write().unwrap();
                commit(&store);
            }
            stop.store(true, AtomicOrdering::Relaxed);
            let done = workers.into_iter().map(|w| w.join().unwrap()).sum::<u64>() as f64;
            done / start.elapsed().as_secs_f64() / threads as f64
        }
    }
}
