//! Test-only storage faults: a redb backend whose disk can be made full, for the tests of how
//! the log and the stores fail and heal.

use redb::{Database, StorageBackend};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A file on a disk that can be full: growing the file fails with ENOSPC while `full`,
/// while reads and writes within its length go through, as on a real full disk.
#[derive(Debug)]
pub struct FullableDisk {
    file: redb::backends::FileBackend,
    full: Arc<AtomicBool>,
}

impl StorageBackend for FullableDisk {
    fn len(&self) -> Result<u64, std::io::Error> {
        self.file.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.file.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        if self.full.load(Ordering::Acquire) && len > self.file.len()? {
            return Err(std::io::Error::from_raw_os_error(28));
        }
        self.file.set_len(len)
    }
    fn sync_data(&self) -> Result<(), std::io::Error> {
        self.file.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        if self.full.load(Ordering::Acquire) && offset + data.len() as u64 > self.file.len()? {
            return Err(std::io::Error::from_raw_os_error(28));
        }
        self.file.write(offset, data)
    }
    fn close(&self) -> Result<(), std::io::Error> {
        self.file.close()
    }
    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, redb::BackendError> {
        self.file.try_lock_range(start, end)
    }
    fn try_lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, redb::BackendError> {
        self.file.try_lock_shared_range(start, end)
    }
    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), redb::BackendError> {
        self.file.lock_range(start, end)
    }
    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), redb::BackendError> {
        self.file.lock_shared_range(start, end)
    }
    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), redb::BackendError> {
        self.file.unlock_range(start, end)
    }
    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, redb::BackendError> {
        self.file.query_lock_range(start, end)
    }
}

/// Opens (creating if missing) the redb file at `path` on a disk that is full while `full`.
pub fn opener(
    path: &Path,
    full: &Arc<AtomicBool>,
) -> impl Fn() -> Result<Database, redb::DatabaseError> + Send + Sync + 'static {
    let path: PathBuf = path.to_path_buf();
    let full = full.clone();
    move || {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        Database::builder().create_with_backend(FullableDisk {
            file: redb::backends::FileBackend::new(file)?,
            full: full.clone(),
        })
    }
}
