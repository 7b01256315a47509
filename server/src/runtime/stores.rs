//! The state store of one task as the runtime holds it: in memory (rebuilt at
//! start by replaying the retained log up to the committed watermark) or
//! persistent (redb; the watermark is committed in the same transaction as the
//! data, so it is where a restart resumes, with nothing to replay). On Kafka
//! either kind has a changelog (`changelog`): what its commits cover is sent
//! there first, and it is restored from there instead.

use super::changelog::Changelog;
use crate::log::Log;
use crate::store::{Checkpoint, KeyValueStore, MemoryStore, PersistentStore, StoreError, Write, WriteTag};
use bytes::Bytes;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

pub(crate) struct TaskStore {
    backend: Backend,
    changelog: Option<Changelog>,
    /// Declared after `backend`, so dropped after it (fields drop in order):
    /// gone only once the backend is, a persistent store's file closed. The
    /// last `Arc<TaskStore>` counts zero before its drop runs, while the
    /// database still writes its shutdown and holds the file's lock.
    open: Arc<()>,
}

/// Whether a task's store is still open, its file included: what a task
/// added again waits for before it opens the file (see `recovery`).
#[derive(Clone)]
pub(crate) struct OpenWatch(Weak<()>);

impl OpenWatch {
    pub(crate) fn is_open(&self) -> bool {
        self.0.strong_count() > 0
    }
}

enum Backend {
    Memory(Arc<MemoryStore>),
    Persistent(Arc<PersistentStore>),
}

/// A query's answer read from one consistent state, with the watermark of that state.
pub(crate) struct StoreRead {
    pub(crate) position: u64,
    pub(crate) entries: Vec<(Bytes, Bytes)>,
}

impl TaskStore {
    pub(crate) fn memory() -> TaskStore {
        TaskStore {
            backend: Backend::Memory(Arc::new(MemoryStore::new())),
            changelog: None,
            open: Arc::new(()),
        }
    }

    /// The store with its changelog (on Kafka).
    pub(crate) fn with_changelog(mut self, changelog: Changelog) -> TaskStore {
        self.changelog = Some(changelog);
        self
    }

    pub(crate) fn changelog(&self) -> Option<&Changelog> {
        self.changelog.as_ref()
    }

    /// Tells when this store is closed: after the drop of its last `Arc`
    /// has closed the file too.
    pub(crate) fn open_watch(&self) -> OpenWatch {
        OpenWatch(Arc::downgrade(&self.open))
    }

    /// Opens `<data_dir>/stores/<application_id>/<task_id>.redb`, with a clean cache of
    /// `cache_bytes` (`store_cache_bytes`).
    pub(crate) fn open_persistent(
        data_dir: &Path,
        application_id: &str,
        task_id: &str,
        cache_bytes: usize,
    ) -> Result<TaskStore, StoreError> {
        let dir = data_dir.join("stores").join(application_id);
        std::fs::create_dir_all(&dir).map_err(|e| StoreError {
            path: dir.display().to_string(),
            message: format!("cannot create the store directory: {e}"),
        })?;
        let path: PathBuf = dir.join(format!("{task_id}.redb"));
        Ok(TaskStore {
            backend: Backend::Persistent(Arc::new(PersistentStore::open_with_cache(&path, cache_bytes)?)),
            changelog: None,
            open: Arc::new(()),
        })
    }

    /// Applies the writes of a successful attempt, draining `writes`. A memory
    /// store needs no tag: it is never frozen, only rebuilt from the log.
    #[inline]
    pub(crate) fn apply(&self, tag: WriteTag, writes: &mut Vec<Write>, settled_below: u64) {
        match &self.backend {
            Backend::Memory(store) => {
                if let Some(changelog) = &self.changelog {
                    changelog.note_written(writes);
                }
                store.apply(writes.drain(..));
            }
            Backend::Persistent(store) => store.apply(tag, writes.drain(..), settled_below),
        }
    }

    /// Writes a persistent store's frozen commit (see `PersistentStore::finish_commit`),
    /// on Kafka sending it to the changelog first, where the checkpoint then
    /// records its end, and calling `seal` with the checkpoint between the two
    /// (exactly-once: the transaction commits there, so the checkpoint is
    /// written only after it). A memory store has nothing frozen: `Ok(None)`.
    pub(crate) fn finish_commit(
        &self,
        log: &dyn Log,
        seal: &dyn Fn(&Checkpoint) -> Result<(), String>,
    ) -> Result<Option<Checkpoint>, StoreError> {
        let Backend::Persistent(store) = &self.backend else {
            return Ok(None);
        };
        match (&self.changelog, log.as_kafka()) {
            (Some(changelog), Some(kafka)) => store.finish_commit_via(|checkpoint, writes| {
                let sent = changelog
                    .send(kafka, &writes)
                    .map_err(|e| changelog_error(changelog, &e))?;
                seal(checkpoint).map_err(|message| StoreError {
                    path: format!("{}-{}", changelog.topic(), changelog.partition()),
                    message,
                })?;
                Ok(sent)
            }),
            _ => store.finish_commit(),
        }
    }

    /// Sends what a memory store wrote since its last send to the changelog
    /// (current values), before a commit of its positions covers it; then
    /// `seal` (exactly-once: the transaction's commit). If either fails, the
    /// keys are sent again with the next commit.
    pub(crate) fn send_written(
        &self,
        log: &dyn Log,
        seal: &dyn Fn() -> Result<(), String>,
    ) -> Result<(), StoreError> {
        let (Backend::Memory(store), Some(changelog), Some(kafka)) =
            (&self.backend, &self.changelog, log.as_kafka())
        else {
            return seal().map_err(|message| StoreError {
                path: "changelog".into(),
                message,
            });
        };
        changelog
            .send_written(kafka, |key| store.get(key).ok().flatten(), seal)
            .map_err(|message| StoreError {
                path: format!("{}-{}", changelog.topic(), changelog.partition()),
                message,
            })
    }

    /// Applies changelog records being restored (`next`: the offset after
    /// them), bypassing the changelog: they are in it already. A persistent
    /// store writes them durably with its checkpoint at `next`.
    pub(crate) fn restore(&self, writes: &[Write], next: u64) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Memory(store) => {
                store.apply(writes.iter().cloned());
                Ok(())
            }
            Backend::Persistent(store) => store.restore_batch(writes, next),
        }
    }

    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        self.kv().get(key)
    }

    pub(crate) fn range(
        &self,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Bytes, Bytes)>, StoreError> {
        self.kv().range(from, to, limit)
    }

    pub(crate) fn len(&self) -> Result<usize, StoreError> {
        self.kv().len()
    }

    pub(crate) fn kv(&self) -> &dyn KeyValueStore {
        match &self.backend {
            Backend::Memory(store) => store.as_ref(),
            Backend::Persistent(store) => store.as_ref(),
        }
    }

    pub(crate) fn persistent(&self) -> Option<&Arc<PersistentStore>> {
        match &self.backend {
            Backend::Persistent(store) => Some(store),
            Backend::Memory(_) => None,
        }
    }

    /// What the last commit of a persistent store recorded.
    pub(crate) fn checkpoint(&self) -> Option<Checkpoint> {
        self.persistent().and_then(|store| store.checkpoint())
    }

    /// A key or range read. A persistent store answers from its last commit
    /// (an MVCC snapshot: never blocks processing, never half a commit) at
    /// that commit's watermark; a memory store answers live at `live_position`.
    pub(crate) fn read(
        &self,
        from: Option<&[u8]>,
        to: Option<&[u8]>,
        limit: usize,
        live_position: u64,
        start_position: u64,
    ) -> Result<StoreRead, StoreError> {
        match &self.backend {
            Backend::Memory(store) => Ok(StoreRead {
                position: live_position,
                entries: match (from, to) {
                    (Some(f), Some(t)) if f == t => store
                        .get(f)?
                        .map(|v| vec![(Bytes::copy_from_slice(f), v)])
                        .unwrap_or_default(),
                    _ => store.range(from, to, limit)?,
                },
            }),
            Backend::Persistent(store) => {
                let snapshot = store.snapshot()?;
                let position = snapshot.checkpoint().map_or(start_position, |c| c.watermark);
                let entries = match (from, to) {
                    (Some(f), Some(t)) if f == t => snapshot
                        .get(f)?
                        .map(|v| vec![(Bytes::copy_from_slice(f), v)])
                        .unwrap_or_default(),
                    _ => snapshot.range(from, to, limit)?,
                };
                Ok(StoreRead { position, entries })
            }
        }
    }
}

/// A changelog failure, as the store's error (it fails the store's commit).
fn changelog_error(changelog: &Changelog, error: &crate::log::LogError) -> StoreError {
    StoreError {
        path: format!("{}-{}", changelog.topic(), changelog.partition()),
        message: format!("cannot write the changelog: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scratch::scratch_dir;

    /// Another thread drops the last handle of a store while this one waits
    /// for its watch to say it is closed and then opens the file at once, as
    /// a task added again does while a commit round lets go of the old store.
    /// The last `Arc` counts zero before the database has closed the file: a
    /// watch on the `Arc` itself would let the open fail ("already open").
    #[test]
    fn a_store_is_closed_by_its_watch_only_once_its_file_can_be_opened_again() {
        let dir = scratch_dir("store-watch").expect("scratch dir");
        for round in 0..20 {
            let store = Arc::new(
                TaskStore::open_persistent(dir.path(), "app", "t_0", crate::store::DEFAULT_CACHE_BYTES)
                    .expect("open"),
            );
            let watch = store.open_watch();
            let last_holder = std::thread::spawn(move || drop(store));
            while watch.is_open() {
                std::hint::spin_loop();
            }
            if let Err(e) =
                TaskStore::open_persistent(dir.path(), "app", "t_0", crate::store::DEFAULT_CACHE_BYTES)
            {
                panic!(
                    "round {round}: closed, yet the file cannot be opened: {}",
                    e.message
                );
            }
            last_holder.join().expect("the holder dropped the store");
        }
    }
}
