//! One processing attempt's view of its task's store: reads see the store
//! plus the attempt's own writes; writes stay in the attempt's buffer and
//! reach the store only if the attempt succeeds, so a failed attempt (an
//! error, a panic, a timeout) leaves nothing behind and a retry never applies
//! an update twice. `update` holds its key's stripe lock until the attempt
//! ends, so attempts that run at once never lose each other's updates.

use super::stores::TaskStore;
use crate::store::{KeyValueStore, StoreError, Write};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Stripes of the key locks per thread of the task. Two keys share a stripe
/// with probability 1/stripes, and then an attempt may wait for another that
/// updates a different key: with T attempts holding a key or two each, about
/// 2(T - 1)/(64 T) < 1/32 of attempts can meet a stranger's key. Sized by T
/// because every task pays for its stripes even when idle (8 bytes each: a
/// fixed 1,024 was 8 KiB of the 9 KiB an idle task cost, bench `scale`).
const STRIPES_PER_THREAD: usize = 64;

/// Beyond this, more stripes buy little: 2(T - 1)/1024 is under 1/8 at T = 64.
const MAX_STRIPES: usize = 1024;

/// How long an `update` waits for its key when the attempt has no deadline.
/// Two attempts that each hold a key the other wants wait this long, then
/// fail with `LockTimeout` and take the retry path, which breaks the cycle.
const LOCK_WAIT_WITHOUT_DEADLINE: Duration = Duration::from_secs(5);

/// Attempt ids: unique per process, never 0 (0 marks a free stripe).
static NEXT_ATTEMPT: AtomicU64 = AtomicU64::new(1);

/// Set in a stripe by an attempt that waits for it: its release must wake
/// the waiters. Attempt ids never reach this bit.
const WAITED_FOR: u64 = 1 << 63;

/// The key locks of one task's store: each stripe holds the id of the
/// attempt that owns it, or 0, plus `WAITED_FOR` once some attempt waits for
/// it. Uncontended, a lock is one compare-and-swap and a release one swap;
/// only the release of a stripe waited for takes the mutex and wakes.
/// (A count of waiters across all stripes woke on every release while any
/// waiter slept: on 2 busy cores a woken waiter can wait milliseconds to
/// run, and each release meanwhile made a futex call, tens of thousands in
/// a run of 200,000 records.)
pub(crate) struct KeyLocks {
    stripes: Box<[AtomicU64]>,
    // A std mutex and condvar: waiting is rare and short, and the stripes
    // themselves never take the mutex.
    wait: Mutex<()>,
    freed: Condvar,
}

impl KeyLocks {
    /// Key locks for a task that runs at most `threads_per_task` attempts at once.
    pub(crate) fn for_threads(threads_per_task: usize) -> Self {
        let stripes = (threads_per_task.max(1) * STRIPES_PER_THREAD)
            .next_power_of_two()
            .min(MAX_STRIPES);
        KeyLocks {
            stripes: (0..stripes).map(|_| AtomicU64::new(0)).collect(),
            wait: Mutex::new(()),
            freed: Condvar::new(),
        }
    }

    fn stripe(&self, key: &[u8]) -> usize {
        crate::store::shard_of(key, self.stripes.len())
    }

    /// Takes `stripe` for `attempt`; answers whether it was newly taken
    /// (false: the attempt already held it). Err once `until` has passed.
    fn acquire(&self, stripe: usize, attempt: u64, until: Instant) -> Result<bool, ()> {
        debug_assert!(attempt != 0 && attempt & WAITED_FOR == 0);
        let slot = &self.stripes[stripe];
        loop {
            match slot.compare_exchange(0, attempt, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(true),
                Err(owner) if owner & !WAITED_FOR == attempt => return Ok(false),
                Err(_) => {}
            }
            let now = Instant::now();
            if now >= until {
                return Err(());
            }
            let guard = self.wait.lock().unwrap_or_else(|e| e.into_inner());
            // Marked under the mutex: a release that sees the mark takes the
            // mutex before it notifies, so it cannot notify before this
            // thread waits. A release before the mark changes the stripe, so
            // the mark fails and the stripe is tried again.
            let owner = slot.load(Ordering::Acquire);
            let marked = owner != 0
                && (owner & WAITED_FOR != 0
                    || slot
                        .compare_exchange(owner, owner | WAITED_FOR, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok());
            if marked {
                let timeout = (until - now).min(Duration::from_millis(10));
                drop(self.freed.wait_timeout(guard, timeout));
            }
        }
    }

    fn release(&self, stripe: usize) {
        if self.stripes[stripe].swap(0, Ordering::Release) & WAITED_FOR != 0 {
            let _guard = self.wait.lock().unwrap_or_else(|e| e.into_inner());
            self.freed.notify_all();
        }
    }
}

struct Buffer {
    /// In the order made; a later write of a key wins.
    writes: Vec<Write>,
    /// Stripes this attempt holds.
    locked: Vec<usize>,
}

/// The store as one attempt sees it. Dropped without `succeed`, its writes
/// are discarded; either way its key locks are released.
pub(crate) struct AttemptStore<'a> {
    base: &'a TaskStore,
    locks: &'a KeyLocks,
    attempt: u64,
    lock_until: Instant,
    /// The record's own key: writes to it reuse its bytes instead of copying.
    record_key: Option<&'a Bytes>,
    // A mutex only because `KeyValueStore` is `Sync`: one thread uses it.
    buffer: Mutex<Buffer>,
}

impl<'a> AttemptStore<'a> {
    /// A view for one attempt; `writes` is an empty buffer to reuse.
    pub(crate) fn new(
        base: &'a TaskStore,
        locks: &'a KeyLocks,
        deadline: Option<Instant>,
        record_key: Option<&'a Bytes>,
        writes: Vec<Write>,
    ) -> AttemptStore<'a> {
        debug_assert!(writes.is_empty());
        AttemptStore {
            base,
            locks,
            attempt: NEXT_ATTEMPT.fetch_add(1, Ordering::Relaxed),
            lock_until: deadline.unwrap_or_else(|| Instant::now() + LOCK_WAIT_WITHOUT_DEADLINE),
            record_key,
            buffer: Mutex::new(Buffer {
                writes,
                locked: Vec::new(),
            }),
        }
    }

    fn buffer(&self) -> MutexGuard<'_, Buffer> {
        self.buffer.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn owned_key(&self, key: &[u8]) -> Bytes {
        match self.record_key {
            Some(own) if own.as_ref() == key => own.clone(),
            _ => Bytes::copy_from_slice(key),
        }
    }

    /// The attempt succeeded: `apply` gets its writes (in order, to drain)
    /// while its keys are still locked, so no other attempt reads a key
    /// between this one's write and the store's. Answers the emptied buffer.
    #[inline]
    pub(crate) fn succeed(self, apply: impl FnOnce(&mut Vec<Write>)) -> Vec<Write> {
        let mut writes = std::mem::take(&mut self.buffer().writes);
        apply(&mut writes);
        writes.clear();
        writes
    }

    /// The first `Some` that `check` answers for one of the attempt's writes
    /// (key, value; `None` a delete), in the order they were made.
    pub(crate) fn find_write<T>(&self, check: impl FnMut(&(Bytes, Option<Bytes>)) -> Option<T>) -> Option<T> {
        self.buffer().writes.iter().find_map(check)
    }

    /// The attempt failed: its writes are dropped. Answers the emptied buffer.
    pub(crate) fn discard(self) -> Vec<Write> {
        let mut writes = std::mem::take(&mut self.buffer().writes);
        writes.clear();
        writes
    }

    fn read(&self, buffer: &Buffer, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        match buffer.writes.iter().rev().find(|(k, _)| k.as_ref() == key) {
            Some((_, value)) => Ok(value.clone()),
            None => self.base.get(key),
        }
    }
}

impl Drop for AttemptStore<'_> {
    fn drop(&mut self) {
        let buffer = self.buffer.get_mut().unwrap_or_else(|e| e.into_inner());
        for stripe in buffer.locked.drain(..) {
            self.locks.release(stripe);
        }
    }
}

impl KeyValueStore for AttemptStore<'_> {
    fn get(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        self.read(&self.buffer(), key)
    }

    fn put(&self, key: Bytes, value: Bytes) -> Result<(), StoreError> {
        self.buffer().writes.push((key, Some(value)));
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        let mut buffer = self.buffer();
        let old = self.read(&buffer, key)?;
        if old.is_some() {
            let key = self.owned_key(key);
            buffer.writes.push((key, None));
        }
        Ok(old)
    }

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
        let inside = |key: &[u8]| from.is_none_or(|f| key >= f) && to.is_none_or(|t| key <= t);
        let overlay: BTreeMap<Bytes, Option<Bytes>> = self
            .buffer()
            .writes
            .iter()
            .filter(|(k, _)| inside(k))
            .cloned()
            .collect();
        if overlay.is_empty() {
            return self.base.range(from, to, limit);
        }
        let mut merged: BTreeMap<Bytes, Option<Bytes>> = self
            .base
            .range(from, to, 0)?
            .into_iter()
            .map(|(k, v)| (k, Some(v)))
            .collect();
        merged.extend(overlay);
        let entries = merged.into_iter().filter_map(|(k, v)| v.map(|v| (k, v)));
        Ok(if limit == 0 {
            entries.collect()
        } else {
            entries.take(limit).collect()
        })
    }

    fn update(
        &self,
        key: &[u8],
        f: &mut dyn FnMut(Option<&Bytes>) -> Option<Bytes>,
    ) -> Result<(), StoreError> {
        let stripe = self.locks.stripe(key);
        let newly = self
            .locks
            .acquire(stripe, self.attempt, self.lock_until)
            .map_err(|()| StoreError {
                path: "key lock".to_string(),
                message: format!(
                    "key {:?} stayed locked by another attempt past this attempt's deadline",
                    String::from_utf8_lossy(&key[..key.len().min(64)])
                ),
            })?;
        let mut buffer = self.buffer();
        if newly {
            buffer.locked.push(stripe);
        }
        let old = self.read(&buffer, key)?;
        let value = f(old.as_ref());
        if value.is_some() || old.is_some() {
            let key = self.owned_key(key);
            buffer.writes.push((key, value));
        }
        Ok(())
    }

    fn len(&self) -> Result<usize, StoreError> {
        let buffer = self.buffer();
        let mut latest: BTreeMap<&[u8], bool> = BTreeMap::new();
        for (key, value) in &buffer.writes {
            latest.insert(key.as_ref(), value.is_some());
        }
        let mut count = self.base.len()? as i64;
        for (key, present) in latest {
            count += i64::from(present) - i64::from(self.base.get(key)?.is_some());
        }
        Ok(count.max(0) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn count(old: Option<&Bytes>) -> Option<Bytes> {
        let n: u64 = old.map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
        Some(Bytes::from((n + 1).to_string()))
    }

    #[test]
    fn reads_see_own_writes_and_only_success_reaches_the_store() {
        let base = TaskStore::memory();
        let locks = KeyLocks::for_threads(4);
        base.kv()
            .put(Bytes::from_static(b"a"), Bytes::from_static(b"1"))
            .unwrap();
        let attempt = AttemptStore::new(&base, &locks, None, None, Vec::new());
        attempt.update(b"a", &mut count).unwrap();
        attempt
            .put(Bytes::from_static(b"b"), Bytes::from_static(b"x"))
            .unwrap();
        assert_eq!(attempt.delete(b"b").unwrap().as_deref(), Some(&b"x"[..]));
        assert_eq!(attempt.get(b"a").unwrap().as_deref(), Some(&b"2"[..]));
        assert_eq!(attempt.range(None, None, 0).unwrap().len(), 1);
        assert_eq!(attempt.len().unwrap(), 1);
        attempt.discard();
        assert_eq!(
            base.kv().get(b"a").unwrap().as_deref(),
            Some(&b"1"[..]),
            "failed: nothing applied"
        );

        let attempt = AttemptStore::new(&base, &locks, None, None, Vec::new());
        attempt.update(b"a", &mut count).unwrap();
        attempt.succeed(|writes| base.apply(crate::store::WriteTag::Untracked, writes, 0));
        assert_eq!(base.kv().get(b"a").unwrap().as_deref(), Some(&b"2"[..]));
    }

    #[test]
    fn concurrent_attempts_updating_one_key_lose_nothing() {
        let base = Arc::new(TaskStore::memory());
        let locks = Arc::new(KeyLocks::for_threads(4));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (base, locks) = (base.clone(), locks.clone());
                std::thread::spawn(move || {
                    for i in 0..2_000 {
                        let attempt = AttemptStore::new(&base, &locks, None, None, Vec::new());
                        attempt.update(b"hot", &mut count).unwrap();
                        // Every third attempt fails after its update.
                        if i % 3 == 0 {
                            attempt.discard();
                        } else {
                            attempt
                                .succeed(|writes| base.apply(crate::store::WriteTag::Untracked, writes, 0));
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let expected = 4 * (0..2_000).filter(|i| i % 3 != 0).count();
        assert_eq!(
            base.kv().get(b"hot").unwrap().unwrap(),
            expected.to_string().as_bytes()
        );
    }

    #[test]
    fn an_update_waiting_past_its_deadline_fails() {
        let base = TaskStore::memory();
        let locks = KeyLocks::for_threads(4);
        let holder = AttemptStore::new(&base, &locks, None, None, Vec::new());
        holder.update(b"k", &mut count).unwrap();
        let waiter = AttemptStore::new(
            &base,
            &locks,
            Some(Instant::now() + Duration::from_millis(20)),
            None,
            Vec::new(),
        );
        assert!(waiter.update(b"k", &mut count).is_err());
        drop(holder);
        let again = AttemptStore::new(&base, &locks, None, None, Vec::new());
        again.update(b"k", &mut count).unwrap();
    }

    #[test]
    fn only_the_release_of_a_stripe_waited_for_takes_the_mutex_and_wakes() {
        let locks = Arc::new(KeyLocks::for_threads(1));
        let far = Instant::now() + Duration::from_secs(60);
        assert_eq!(locks.acquire(0, 1, far), Ok(true));
        assert_eq!(
            locks.acquire(0, 1, far),
            Ok(false),
            "its holder takes it again at once"
        );
        // An attempt waits for stripe 1 and marks it.
        assert_eq!(locks.acquire(1, 2, far), Ok(true));
        let waiter = {
            let locks = locks.clone();
            std::thread::spawn(move || locks.acquire(1, 3, far))
        };
        let given_up = Instant::now() + Duration::from_secs(30);
        while locks.stripes[1].load(Ordering::SeqCst) != 2 | WAITED_FOR {
            assert!(Instant::now() < given_up, "the waiter never marked the stripe");
            std::thread::yield_now();
        }
        // Nobody waits for stripe 0: its release must not need the mutex,
        // which this thread holds meanwhile.
        let held = locks.wait.lock().unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        let releaser = {
            let locks = locks.clone();
            std::thread::spawn(move || {
                locks.release(0);
                done.send(()).unwrap();
            })
        };
        assert!(
            finished.recv_timeout(Duration::from_secs(30)).is_ok(),
            "the release of a stripe nobody waits for waited for the mutex"
        );
        drop(held);
        releaser.join().unwrap();
        assert_eq!(locks.stripes[0].load(Ordering::SeqCst), 0);
        // The release of stripe 1 clears the mark and hands it over.
        locks.release(1);
        assert_eq!(waiter.join().unwrap(), Ok(true));
        assert_eq!(
            locks.stripes[1].load(Ordering::SeqCst),
            3,
            "the mark went with the release"
        );
        locks.release(1);
        assert_eq!(locks.stripes[1].load(Ordering::SeqCst), 0);
    }

    #[test]
    fn stripes_grow_with_the_threads_of_the_task_up_to_the_cap() {
        let stripes = |threads| KeyLocks::for_threads(threads).stripes.len();
        assert_eq!(stripes(0), STRIPES_PER_THREAD);
        assert_eq!(stripes(1), STRIPES_PER_THREAD);
        assert_eq!(stripes(3), 256);
        assert_eq!(stripes(16), MAX_STRIPES);
        assert_eq!(stripes(100), MAX_STRIPES);
        // Every key maps inside the task's stripes.
        let locks = KeyLocks::for_threads(1);
        for key in 0..10_000u32 {
            assert!(locks.stripe(&key.to_be_bytes()) < locks.stripes.len());
        }
    }
}
