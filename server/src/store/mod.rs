//! State stores: the key-value `KeyValueStore` trait (get, put, delete, range,
//! atomic update of one key) and `MemoryStore`, an in-memory backend sharded by
//! key hash so T threads of one task can write at once without one big lock.

mod persistent;
pub use persistent::{Checkpoint, PersistentStore, StoreError, StoreFacts, StoreSnapshot};

use bytes::Bytes;
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::RwLock;

/// A key-value store of one pipeline and partition. Safe for concurrent use.
pub trait KeyValueStore: Send + Sync {
    fn get(&self, key: &[u8]) -> Option<Bytes>;
    fn put(&self, key: Bytes, value: Bytes);
    fn delete(&self, key: &[u8]) -> Option<Bytes>;
    /// Entries with `from <= key <= to` in key order (absent bound = open), at most `limit` (0 = all).
    fn range(&self, from: Option<&[u8]>, to: Option<&[u8]>, limit: usize) -> Vec<(Bytes, Bytes)>;
    /// Atomically replaces the value of `key` with `f(current)`; `None` deletes it.
    /// No other write to `key` happens between the read and the write.
    fn update(&self, key: &[u8], f: &mut dyn FnMut(Option<&Bytes>) -> Option<Bytes>);
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const SHARDS: usize = 16;

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
        // FNV-1a: cheap, and keys of one partition are already spread by murmur2.
        let mut hash: u32 = 0x811c_9dc5;
        for &byte in key {
            hash = (hash ^ byte as u32).wrapping_mul(0x0100_0193);
        }
        &self.shards[hash as usize % SHARDS]
    }
}

impl KeyValueStore for MemoryStore {
    fn get(&self, key: &[u8]) -> Option<Bytes> {
        self.shard(key)
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    fn put(&self, key: Bytes, value: Bytes) {
        self.shard(&key)
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, value);
    }

    fn delete(&self, key: &[u8]) -> Option<Bytes> {
        self.shard(key)
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key)
    }

    fn range(&self, from: Option<&[u8]>, to: Option<&[u8]>, limit: usize) -> Vec<(Bytes, Bytes)> {
        let lower = from.map_or(Bound::Unbounded, Bound::Included);
        let upper = to.map_or(Bound::Unbounded, Bound::Included);
        if let (Some(f), Some(t)) = (from, to)
            && f > t
        {
            return Vec::new();
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
        entries
    }

    fn update(&self, key: &[u8], f: &mut dyn FnMut(Option<&Bytes>) -> Option<Bytes>) {
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
    }

    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
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
            store.put(format!("k{i:03}").into(), format!("{i}").into());
        }
        assert_eq!(store.get(b"k042").unwrap(), "42");
        assert_eq!(store.delete(b"k042").unwrap(), "42");
        assert_eq!(store.get(b"k042"), None);
        let range = store.range(Some(b"k040"), Some(b"k045"), 0);
        let keys: Vec<_> = range.iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(keys, vec!["k040", "k041", "k043", "k044", "k045"]);
        assert_eq!(store.range(None, None, 3).len(), 3);
        assert_eq!(store.range(None, None, 3)[0].0, "k000");
        assert_eq!(store.range(Some(b"z"), Some(b"a"), 0).len(), 0);
        assert_eq!(store.len(), 99);
    }

    #[test]
    fn concurrent_updates_of_one_key_lose_nothing() {
        let store = Arc::new(MemoryStore::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        store.update(b"hot", &mut |old| {
                            let n: u64 = old.map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
                            Some(Bytes::from((n + 1).to_string()))
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(store.get(b"hot").unwrap(), "40000");
    }
}
