//! State stores: the `KeyValueStore` trait processors read and write through
//! (get, put, delete, range, atomic update of one key — every call can fail
//! with a `StoreError`), the write batches the runtime applies after a
//! successful attempt, and `MemoryStore`, sharded by key hash so T threads of
//! one task can write at once without one big lock, each shard a hash map for
//! the per-record reads and writes with the key order kept for ranges.

mod compact;
mod entry;
mod persistent;
use compact::Compact;
use entry::Entry;
pub use persistent::{
    Checkpoint, DEFAULT_CACHE_BYTES, FreezeError, PersistentStore, StoreFacts, StoreSnapshot, WriteTag,
};

use bytes::Bytes;
use std::collections::BTreeSet;
use std::fmt::Display;
use std::hash::{BuildHasher, RandomState};
use std::ops::Bound;
use std::path::Path;
use std::sync::RwLock;

/// A store call that failed: the file (or store) it concerns and why. To a
/// processor it is a failed record of kind `StoreError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("data file {path}: {message}")]
pub struct StoreError {
    pub path: String,
    pub message: String,
}

impl StoreError {
    pub fn new(path: &Path, message: impl Display) -> Self {
        StoreError {
            path: path.display().to_string(),
            message: message.to_string(),
        }
    }
}

/// One write of a batch: a value, or `None` to delete the key.
pub type Write = (Bytes, Option<Bytes>);

/// A key-value store of one pipeline and partition. Safe for concurrent use.
pub trait KeyValueStore: Send + Sync {
    fn get(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError>;
    fn put(&self, key: Bytes, value: Bytes) -> Result<(), StoreError>;
    /// Removes `key`, answering the value it had.
    fn delete(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError>;
    /// Entries with `from <= key <= to` in key order (absent bound = open), at most `limit` (0 = all).
    fn range(
        &self,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Bytes, Bytes)>, StoreError>;
    /// Atomically replaces the value of `key` with `f(current)`; `None` deletes it.
    /// No other write to `key` happens between the read and the write.
    fn update(
        &self,
        key: &[u8],
        f: &mut dyn FnMut(Option<&Bytes>) -> Option<Bytes>,
    ) -> Result<(), StoreError>;
    fn len(&self) -> Result<usize, StoreError>;
    fn is_empty(&self) -> Result<bool, StoreError> {
        Ok(self.len()? == 0)
    }
}

const SHARDS: usize = 16;

/// The shard of a key in a persistent store: FNV-1a, cheap, and keys of one
/// partition are already spread by murmur2. (A memory store takes it from
/// the keyed hash its table needs anyway: `MemoryStore::locate`.)
pub(crate) fn shard_of(key: &[u8], shards: usize) -> usize {
    let mut hash: u32 = 0x811c_9dc5;
    for &byte in key {
        hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
    }
    hash as usize % shards
}

/// Below this many keys waiting for the order, a shard never sorts them in
/// on a write: only a range does (see `Shard::note_new_key`).
const PENDING_MIN: usize = 1024;

/// One shard of a `MemoryStore`. Point reads and writes — all the runtime
/// does per record — go to a hash map: one probe, where an ordered map of a
/// million keys walks a dozen nodes and compares a key behind a pointer at
/// each step (bench `scale`: 70 % of a stream thread's time with 1 M keys).
/// The key order that ranges need is kept beside it and brought up to date
/// only when a range asks for it, so a key pays for the order once, and
/// nothing if no range is ever read.
///
/// The table holds `Entry`s, a key and its value in one 64-byte slot aligned
/// to a cache line, so a read or an overwrite of a short key touches one line
/// (with key and value each in a 40-byte slot of a map, an 80-byte pair that
/// mostly straddled two: 6 % more CPU per `count` record in bench `floor`
/// with 10 k keys, 23 % with 1 M).
struct Shard {
    /// The store's hasher (see `MemoryStore::hasher`), for the table's growth
    /// and the key order's lookups.
    hasher: RandomState,
    /// Every entry is found by the hash of its key under `hasher`.
    entries: hashbrown::HashTable<Entry>,
    /// Keys in order: every key of `entries` is here or in `pending`, and
    /// every key here is in `entries` (a delete removes it from both).
    ordered: BTreeSet<Compact>,
    /// Keys added since the order was last brought up to date. May hold keys
    /// deleted since, or twice (deleted and added again): `sort_in` skips them.
    pending: Vec<Compact>,
}

impl Shard {
    fn new(hasher: RandomState) -> Shard {
        Shard {
            hasher,
            entries: hashbrown::HashTable::new(),
            ordered: BTreeSet::new(),
            pending: Vec::new(),
        }
    }

    fn get(&self, key: &[u8]) -> Option<&Entry> {
        self.find(self.hasher.hash_one(key), key)
    }

    /// The entry of `key`, whose hash is `hash`.
    fn find(&self, hash: u64, key: &[u8]) -> Option<&Entry> {
        self.entries.find(hash, |entry| entry.key() == key)
    }

    fn insert(&mut self, hash: u64, key: &[u8], value: Bytes) {
        if let Some(entry) = self.entries.find_mut(hash, |entry| entry.key() == key) {
            entry.set_value(value);
            return;
        }
        let hasher = &self.hasher;
        self.entries
            .insert_unique(hash, Entry::new(key, value), |entry| hasher.hash_one(entry.key()));
        self.note_new_key(Compact::copy_from(key));
    }

    fn remove(&mut self, hash: u64, key: &[u8]) -> Option<Bytes> {
        let (old, _) = self
            .entries
            .find_entry(hash, |entry| entry.key() == key)
            .ok()?
            .remove();
        self.ordered.remove(key);
        Some(old.into_value())
    }

    /// A key new to `entries` waits for the order. Keys deleted and added
    /// again would pile up here without a range to sort them in, so past as
    /// many waiting keys as live ones they are sorted in on the write: the
    /// list stays within the store's size and each key is sorted in once.
    fn note_new_key(&mut self, key: Compact) {
        self.pending.push(key);
        if self.pending.len() > self.entries.len().max(PENDING_MIN) {
            self.sort_in();
        }
    }

    /// Brings `ordered` up to date with `entries`.
    fn sort_in(&mut self) {
        let mut pending = std::mem::take(&mut self.pending);
        for key in pending.drain(..) {
            if self.get(&key).is_some() {
                self.ordered.insert(key);
            }
        }
        self.pending = pending;
    }

    /// Entries with keys within `bounds`, in order, at most `limit` (0 = all).
    /// The order must be up to date (`pending` empty).
    fn range(&self, bounds: (Bound<&[u8]>, Bound<&[u8]>), limit: usize, out: &mut Vec<(Bytes, Bytes)>) {
        debug_assert!(self.pending.is_empty());
        let keys = self.ordered.range::<[u8], _>(bounds);
        let limit = if limit == 0 { usize::MAX } else { limit };
        for key in keys.take(limit) {
            if let Some(entry) = self.get(key) {
                out.push((key.to_bytes(), entry.value_bytes()));
            }
        }
    }
}

/// In-memory store: 16 shards, each a hash map with a key order kept for
/// ranges (see `Shard`); ranges merge the shards.
pub struct MemoryStore {
    /// The standard library's keyed hasher on purpose: keys come from
    /// producers, and a fixed or guessable hash would let one send keys that
    /// all collide. One for the whole store: a key's hash picks its shard and
    /// finds it in the shard's table, so an access hashes the key once.
    hasher: RandomState,
    shards: Vec<RwLock<Shard>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        let hasher = RandomState::new();
        MemoryStore {
            shards: (0..SHARDS)
                .map(|_| RwLock::new(Shard::new(hasher.clone())))
                .collect(),
            hasher,
        }
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// The hash of `key` and its shard. The shard comes from bits 32–35 of
    /// the hash, which a shard's table uses for neither its buckets (the low
    /// bits) nor its tags (the top 7), so keys of one shard spread over both.
    fn locate(&self, key: &[u8]) -> (u64, &RwLock<Shard>) {
        let hash = self.hasher.hash_one(key);
        (hash, &self.shards[(hash >> 32) as usize % SHARDS])
    }

    /// Applies the writes of one successful attempt, in order.
    pub fn apply(&self, writes: impl IntoIterator<Item = Write>) {
        for (key, value) in writes {
            let (hash, shard) = self.locate(&key);
            let mut shard = shard.write().unwrap_or_else(|e| e.into_inner());
            match value {
                Some(value) => shard.insert(hash, &key, value),
                None => {
                    shard.remove(hash, &key);
                }
            }
        }
    }
}

impl KeyValueStore for MemoryStore {
    fn get(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        let (hash, shard) = self.locate(key);
        let shard = shard.read().unwrap_or_else(|e| e.into_inner());
        Ok(shard.find(hash, key).map(Entry::value_bytes))
    }

    fn put(&self, key: Bytes, value: Bytes) -> Result<(), StoreError> {
        let (hash, shard) = self.locate(&key);
        shard
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(hash, &key, value);
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        let (hash, shard) = self.locate(key);
        Ok(shard.write().unwrap_or_else(|e| e.into_inner()).remove(hash, key))
    }

    fn range(
        &self,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Bytes, Bytes)>, StoreError> {
        let lower = from.map_or(Bound::Unbounded, Bound::Included);
        let upper = to.map_or(Bound::Unbounded, Bound::Included);
        if let (Some(f), Some(t)) = (from, to)
            && f > t
        {
            return Ok(Vec::new());
        }
        let mut entries = Vec::new();
        for shard in &self.shards {
            let read = shard.read().unwrap_or_else(|e| e.into_inner());
            if read.pending.is_empty() {
                read.range((lower, upper), limit, &mut entries);
                continue;
            }
            drop(read);
            // Read under the same write lock that sorted the keys in, so
            // no key added in between is missing from the order.
            let mut write = shard.write().unwrap_or_else(|e| e.into_inner());
            write.sort_in();
            write.range((lower, upper), limit, &mut entries);
        }
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if limit != 0 {
            entries.truncate(limit);
        }
        Ok(entries)
    }

    fn update(
        &self,
        key: &[u8],
        f: &mut dyn FnMut(Option<&Bytes>) -> Option<Bytes>,
    ) -> Result<(), StoreError> {
        let (hash, shard) = self.locate(key);
        let mut shard = shard.write().unwrap_or_else(|e| e.into_inner());
        let old = shard.find(hash, key).map(Entry::value_bytes);
        match f(old.as_ref()) {
            Some(value) => shard.insert(hash, key, value),
            None => {
                shard.remove(hash, key);
            }
        }
        Ok(())
    }

    fn len(&self) -> Result<usize, StoreError> {
        Ok(self
            .shards
            .iter()
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()).entries.len())
            .sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    #[test]
    fn get_put_delete_and_ordered_range_across_shards() {
        let store = MemoryStore::new();
        for i in 0..100u32 {
            store
                .put(format!("k{i:03}").into(), format!("{i}").into())
                .unwrap();
        }
        assert_eq!(store.get(b"k042").unwrap().unwrap(), "42");
        assert_eq!(store.delete(b"k042").unwrap().unwrap(), "42");
        assert_eq!(store.get(b"k042").unwrap(), None);
        let range = store.range(Some(b"k040"), Some(b"k045"), 0).unwrap();
        let keys: Vec<_> = range.iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(keys, vec!["k040", "k041", "k043", "k044", "k045"]);
        assert_eq!(store.range(None, None, 3).unwrap().len(), 3);
        assert_eq!(store.range(None, None, 3).unwrap()[0].0, "k000");
        assert_eq!(store.range(Some(b"z"), Some(b"a"), 0).unwrap().len(), 0);
        assert_eq!(store.len().unwrap(), 99);
    }

    #[test]
    fn keys_spread_over_every_shard() {
        let store = MemoryStore::new();
        for key in 0..1_000u32 {
            store.put(format!("k{key}").into(), "1".into()).unwrap();
        }
        for shard in &store.shards {
            // 1,000 keys over 16 shards: an empty one would take a broken
            // choice of shard (a chance of 16 · (15/16)^1000 otherwise).
            assert!(!shard.read().unwrap().entries.is_empty());
        }
    }

    #[test]
    fn keys_deleted_and_added_again_without_ranges_stay_bounded() {
        let store = MemoryStore::new();
        for round in 0..100u32 {
            for key in 0..1_000u32 {
                store
                    .put(format!("k{key:04}").into(), round.to_string().into())
                    .unwrap();
            }
            for key in 0..1_000u32 {
                store.delete(format!("k{key:04}").as_bytes()).unwrap();
            }
        }
        store.put("last".into(), "1".into()).unwrap();
        for shard in &store.shards {
            let shard = shard.read().unwrap();
            assert!(shard.pending.len() <= PENDING_MIN + 1, "{}", shard.pending.len());
            assert!(shard.ordered.len() <= shard.entries.len());
        }
        let all = store.range(None, None, 0).unwrap();
        assert_eq!(all, vec![(Bytes::from("last"), Bytes::from("1"))]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u8, u8),
        Delete(u8),
        Update(u8, Option<u8>),
        Apply(Vec<(u8, Option<u8>)>),
        Range(Option<u8>, Option<u8>, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few keys, so puts, deletes and re-adds of one key mix.
        let key = 0u8..40;
        prop_oneof![
            (key.clone(), any::<u8>()).prop_map(|(k, v)| Op::Put(k, v)),
            key.clone().prop_map(Op::Delete),
            (key.clone(), proptest::option::of(any::<u8>())).prop_map(|(k, v)| Op::Update(k, v)),
            proptest::collection::vec((key.clone(), proptest::option::of(any::<u8>())), 0..5)
                .prop_map(Op::Apply),
            (
                proptest::option::of(key.clone()),
                proptest::option::of(key),
                0usize..6
            )
                .prop_map(|(f, t, l)| Op::Range(f, t, l)),
        ]
    }

    /// Keys of 4 to 48 bytes, so entries keep them in the slot with their
    /// value, beside it, or apart.
    fn bytes(n: u8) -> Bytes {
        Bytes::from(format!("k{n:03}{}", "x".repeat(usize::from(n) * 7 % 45)))
    }

    /// Values of 1 to 100 bytes: a key's entry changes form as it is overwritten.
    fn value(n: u8) -> Bytes {
        Bytes::from(format!("{}{}", n % 10, "v".repeat(usize::from(n) % 100)))
    }

    proptest! {
        /// Any sequence of writes and ranges answers what an ordered map does.
        #[test]
        fn the_memory_store_behaves_as_an_ordered_map(ops in proptest::collection::vec(op(), 1..200)) {
            let store = MemoryStore::new();
            let mut model: BTreeMap<Bytes, Bytes> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Put(k, v) => {
                        store.put(bytes(k), value(v)).unwrap();
                        model.insert(bytes(k), value(v));
                    }
                    Op::Delete(k) => {
                        prop_assert_eq!(store.delete(&bytes(k)).unwrap(), model.remove(&bytes(k)));
                    }
                    Op::Update(k, v) => {
                        store.update(&bytes(k), &mut |_| v.map(value)).unwrap();
                        match v {
                            Some(v) => model.insert(bytes(k), value(v)),
                            None => model.remove(&bytes(k)),
                        };
                    }
                    Op::Apply(writes) => {
                        store.apply(writes.iter().map(|&(k, v)| (bytes(k), v.map(value))));
                        for (k, v) in writes {
                            match v {
                                Some(v) => model.insert(bytes(k), value(v)),
                                None => model.remove(&bytes(k)),
                            };
                        }
                    }
                    Op::Range(from, to, limit) => {
                        let (from, to) = (from.map(bytes), to.map(bytes));
                        let got = store.range(from.as_deref(), to.as_deref(), limit).unwrap();
                        let lower = from.as_ref().map_or(Bound::Unbounded, Bound::Included);
                        let upper = to.as_ref().map_or(Bound::Unbounded, Bound::Included);
                        let expected: Vec<(Bytes, Bytes)> = if from.is_some() && to.is_some() && from > to {
                            Vec::new()
                        } else {
                            model
                                .range::<Bytes, _>((lower, upper))
                                .take(if limit == 0 { usize::MAX } else { limit })
                                .map(|(k, v)| (k.clone(), v.clone()))
                                .collect()
                        };
                        prop_assert_eq!(got, expected);
                    }
                }
                prop_assert_eq!(store.len().unwrap(), model.len());
                for k in 0u8..40 {
                    prop_assert_eq!(store.get(&bytes(k)).unwrap(), model.get(&bytes(k)).cloned());
                }
            }
        }
    }

    #[test]
    fn concurrent_updates_of_one_key_lose_nothing() {
        let store = Arc::new(MemoryStore::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        store
                            .update(b"hot", &mut |old| {
                                let n: u64 =
                                    old.map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
                                Some(Bytes::from((n + 1).to_string()))
                            })
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(store.get(b"hot").unwrap().unwrap(), "40000");
    }
}
