//! Scratch directories for tests and the benchmark harness: a fresh directory
//! under the system temp dir, named after what it is for, removed with
//! everything in it when the returned [`TempDir`] is dropped.

pub use tempfile::TempDir;

/// A new directory `taskstream-<purpose>-XXXXXX` under the system temp dir.
pub fn scratch_dir(purpose: &str) -> std::io::Result<TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("taskstream-{purpose}-"))
        .tempdir()
}
