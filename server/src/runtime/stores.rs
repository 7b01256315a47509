//! The state store of one task as the runtime holds it: in memory (rebuilt at
//! start by replaying the retained log up to the committed watermark) or
//! persistent (redb; the watermark is committed in the same transaction as the
//! data, so it is where a restart resumes, with nothing to replay).

use crate::store::{Checkpoint, KeyValueStore, MemoryStore, PersistentStore, StoreError, Write, WriteTag};
use bytes::Bytes;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(crate) enum TaskStore {
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
        TaskStore::Memory(Arc::new(MemoryStore::new()))
    }

    /// Opens `<data_dir>/stores/<application_id>/<task_id>.redb`.
    pub(crate) fn open_persistent(
        data_dir: &Path,
        application_id: &str,
        task_id: &str,
    ) -> Result<TaskStore, StoreError> {
        let dir = data_dir.join("stores").join(application_id);
        std::fs::create_dir_all(&dir).map_err(|e| StoreError {
            path: dir.display().to_string(),
            message: format!("cannot create the store directory: {e}"),
        })?;
        let path: PathBuf = dir.join(format!("{task_id}.redb"));
        Ok(TaskStore::Persistent(Arc::new(PersistentStore::open(&path)?)))
    }

    /// Applies the writes of a successful attempt, draining `writes`. A memory
    /// store needs no tag: it is never frozen, only rebuilt from the log.
    pub(crate) fn apply(&self, tag: WriteTag, writes: &mut Vec<Write>, settled_below: u64) {
        match self {
            TaskStore::Memory(store) => store.apply(writes.drain(..)),
            TaskStore::Persistent(store) => store.apply(tag, writes.drain(..), settled_below),
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
        match self {
            TaskStore::Memory(store) => store.as_ref(),
            TaskStore::Persistent(store) => store.as_ref(),
        }
    }

    pub(crate) fn persistent(&self) -> Option<&Arc<PersistentStore>> {
        match self {
            TaskStore::Persistent(store) => Some(store),
            TaskStore::Memory(_) => None,
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
        match self {
            TaskStore::Memory(store) => Ok(StoreRead {
                position: live_position,
                entries: match (from, to) {
                    (Some(f), Some(t)) if f == t => store
                        .get(f)?
                        .map(|v| vec![(Bytes::copy_from_slice(f), v)])
                        .unwrap_or_default(),
                    _ => store.range(from, to, limit)?,
                },
            }),
            TaskStore::Persistent(store) => {
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
