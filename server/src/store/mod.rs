//! State stores: the `KeyValueStore` trait processors read and write through
//! (get, put, delete, range, atomic update of one key — every call can fail
//! with a `StoreError`), the write batches the runtime applies after a
//! successful attempt, and `MemoryStore`, sharded by key hash so T threads of
//! one task can write at once without one big lock.

mod persistent;
pub use persistent::{Checkpoint, FreezeError, PersistentStore, StoreFacts, StoreSnapshot, WriteTag};

use bytes::Bytes;
use std::collections::BTreeMap;
use std::fmt::Display;
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

/// The shard of a key: FNV-1a, cheap, and keys of one partition are already
/// spread by murmur2. Shared by both backends.
pub(crate) fn shard_of(key: &[u8], shards: usize) -> usize {
    let mut hash: u32 = 0x811c_9dc5;
    for &byte in key {
        hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
    }
    hash as usize % shards
}

/// In-memory store: 16 shards of ordered maps; ranges merge the shards.
pub struct MemoryStore {
    shards: Vec<RwLock<BTreeMap<Bytes, Bytes>>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
        }
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn shard(&self, key: &[u8]) -> &RwLock<BTreeMap<Bytes, Bytes>> {
        &self.shards[shard_of(key, SHARDS)]
    }

    /// Applies the writes of one successful attempt, in order.
    pub fn apply(&self, writes: impl IntoIterator<Item = Write>) {
        for (key, value) in writes {
            let mut shard = self.shard(&key).write().unwrap_or_else(|e| e.into_inner());
            match value {
                Some(value) => {
                    shard.insert(key, value);
                }
                None => {
                    shard.remove(&key);
                }
            }
        }
    }
}

impl KeyValueStore for MemoryStore {
    fn get(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        Ok(self
            .shard(key)
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned())
    }

    fn put(&self, key: Bytes, value: Bytes) -> Result<(), StoreError> {
        self.shard(&key)
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, value);
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        Ok(self
            .shard(key)
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key))
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
            let shard = shard.read().unwrap_or_else(|e| e.into_inner());
            let mut taken = 0;
            for (k, v) in shard.range::<[u8], _>((lower, upper)) {
                entries.push((k.clone(), v.clone()));
                taken += 1;
                if limit != 0 && taken == limit {
                    break;
                }
            }
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
        let mut shard = self.shard(key).write().unwrap_or_else(|e| e.into_inner());
        match f(shard.get(key)) {
            Some(value) => {
                if let Some(slot) = shard.get_mut(key) {
                    *slot = value;
                } else {
                    shard.insert(Bytes::copy_from_slice(key), value);
                }
            }
            None => {
                shard.remove(key);
            }
        }
        Ok(())
    }

    fn len(&self) -> Result<usize, StoreError> {
        Ok(self
            .shards
            .iter()
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()).len())
            .sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
