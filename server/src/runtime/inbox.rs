//! The append inbox: how the log's append listener tells the scheduler of new
//! records without waiting for its lock. The listener runs on the log's
//! writer thread; waiting there for a lock the stream threads hold stalls the
//! next group commit behind them. What it cannot hand over at once waits here
//! and is applied by whoever takes the scheduler's lock next.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// A partition with new records: (pipeline, partition, whether the source
/// rather than the retry partition).
pub(crate) type Appended = (usize, u32, bool);

/// Appends waiting for the scheduler, and how many threads are about to
/// sleep on its condvar.
///
/// No append is forgotten and no thread sleeps through one (a Dekker-style
/// handshake, so every access is `SeqCst`): `post` publishes `pending` and
/// then reads `waiting`; a thread that will wait first raises `waiting` (its
/// `Waiting` guard) and then reads `pending`. One of the two sees the other:
/// either the thread stays awake to take the lock (which applies the inbox),
/// or the listener sees it and takes the lock itself to wake it.
#[derive(Default)]
pub(crate) struct AppendInbox {
    pending: AtomicBool,
    /// Touched by the listener and by a lock holder once per take: never
    /// contended for long. A std mutex: nothing is held across a wait.
    queue: Mutex<Vec<Appended>>,
    waiting: AtomicUsize,
}

impl AppendInbox {
    /// Leaves `appended` for the next holder of the scheduler's lock.
    /// Answers whether a thread may be asleep (or about to be) on the
    /// condvar: then the caller must take the lock itself and wake it.
    pub(crate) fn post(&self, appended: impl IntoIterator<Item = Appended>) -> bool {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(appended);
        self.pending.store(true, Ordering::SeqCst);
        self.waiting.load(Ordering::SeqCst) > 0
    }

    /// What was posted since the last take (cheap when nothing was).
    pub(crate) fn take(&self) -> Vec<Appended> {
        // A load first: every lock of the scheduler asks, and a swap would
        // take the line from the writer's core each time.
        if !self.pending.load(Ordering::SeqCst) || !self.pending.swap(false, Ordering::SeqCst) {
            return Vec::new();
        }
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether something was posted and not taken yet.
    pub(crate) fn has_pending(&self) -> bool {
        self.pending.load(Ordering::SeqCst)
    }

    /// Announces a thread about to wait on the scheduler's condvar, until
    /// the guard drops. Check `has_pending` after this and before waiting.
    pub(crate) fn waiting(&self) -> Waiting<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting(self)
    }
}

/// A thread waiting (or about to) on the scheduler's condvar.
pub(crate) struct Waiting<'a>(&'a AppendInbox);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_posted_is_taken_once_and_in_order() {
        let inbox = AppendInbox::default();
        assert!(inbox.take().is_empty());
        assert!(!inbox.post([(0, 1, true)]), "nobody waits");
        assert!(!inbox.post([(0, 1, false), (1, 0, true)]));
        assert!(inbox.has_pending());
        assert_eq!(inbox.take(), vec![(0, 1, true), (0, 1, false), (1, 0, true)]);
        assert!(!inbox.has_pending());
        assert!(inbox.take().is_empty());
    }

    #[test]
    fn a_post_tells_whether_a_thread_waits_and_a_waiter_sees_what_was_posted_before() {
        let inbox = AppendInbox::default();
        {
            let _waiting = inbox.waiting();
            assert!(inbox.post([(0, 0, true)]), "a waiter must be woken by the poster");
        }
        assert!(!inbox.post([(0, 0, false)]), "the guard dropped: nobody waits");
        // Posted before the thread announced itself: it sees it and stays awake.
        let _waiting = inbox.waiting();
        assert!(inbox.has_pending());
    }
}
