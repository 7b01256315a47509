//! A data dir is never silently reset. The server binary refuses, with exit
//! code 2 and a message naming the file, a data dir whose log is missing, empty
//! or another dir's, or whose stores are empty, damaged or ahead of the log; the
//! refused files are left as they were (compared byte for byte). `--reset-stores`
//! rebuilds the stores from what the log holds, and counts are then exact.
//! Data dirs are prepared and read back in-process (`StreamsApp`, the binary's
//! embedded default on `--data-dir`); a data dir after SIGKILL is tests/crash.rs.

mod common;

use common::{Output, run, server_binary, temp_dir};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use taskstream_server::{Config, ProducerRecord, StreamsApp};

/// Bound on anything expected to happen promptly (start, catch up, exit).
const DEADLINE: Duration = Duration::from_secs(60);

/// The binary's embedded default (application `taskstream`, topic `events` with
/// 8 partitions, persistent store `counts`) on `dir`, committing every 50 ms.
fn config(dir: &Path, reset_stores: bool) -> Config {
    let mut config = Config::embedded_default();
    config.data_dir = Some(dir.to_path_buf());
    config.commit_interval_ms = 50;
    config.reset_stores = reset_stores;
    config
}

fn store_file(dir: &Path, partition: u32) -> PathBuf {
    dir.join("stores")
        .join("taskstream")
        .join(format!("counts_{partition}.redb"))
}

/// Starts the app on `dir`, produces `records` records over `keys` keys, waits
/// until every one is processed and committed, and stops it cleanly.
fn produce(dir: &Path, records: usize, keys: usize) {
    let app = StreamsApp::start(config(dir, false)).expect("start on the data dir");
    for chunk in (0..records).collect::<Vec<_>>().chunks(1000) {
        let batch = chunk
            .iter()
            .map(|i| ProducerRecord::keyed(format!("key-{}", i % keys), format!("{i}")))
            .collect();
        app.produce("events", batch).expect("produce");
    }
    assert!(app.wait_until_caught_up(DEADLINE), "not caught up");
    app.shutdown().expect("a clean shutdown");
}

/// Starts the app on `dir` (with `reset_stores`), waits until it caught up, and
/// answers the sum of every count in store `counts`, read from its commits.
fn counted(dir: &Path, reset_stores: bool) -> u64 {
    let app = StreamsApp::start(config(dir, reset_stores)).expect("start on the data dir");
    assert!(app.wait_until_caught_up(DEADLINE), "not caught up");
    let total = app
        .query_range("counts", None, None, &[], 0)
        .expect("range query")
        .iter()
        .flat_map(|partition| &partition.entries)
        .map(|(_, value)| {
            std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .expect("a count")
        })
        .sum();
    app.shutdown().expect("a clean shutdown");
    total
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next)
            .expect("read a data dir folder")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.insert(path.clone(), std::fs::read(&path).expect("read a data dir file"));
            }
        }
    }
    files
}

fn assert_unchanged(before: &BTreeMap<PathBuf, Vec<u8>>, dir: &Path, case: &str) {
    let after = snapshot(dir);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>(),
        "{case}: files were added or removed"
    );
    for (path, bytes) in before {
        assert!(
            after[path] == *bytes,
            "{case}: {} was changed ({} bytes, was {})",
            path.display(),
            after[path].len(),
            bytes.len()
        );
    }
}

/// The binary with a clean environment on `--data-dir dir`, port 0.
fn server_command(dir: &Path) -> Command {
    let mut command = Command::new(server_binary());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TASKSTREAM_") {
            command.env_remove(name);
        }
    }
    command
        .env("RUST_LOG", "info")
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir);
    command
}

/// Runs the binary on `dir` expecting it to refuse the data dir: exit code 2,
/// never listening, every one of `named` in the message.
fn expect_refused(dir: &Path, extra: &[&str], named: &[&str], case: &str) -> Output {
    let mut command = server_command(dir);
    command.args(extra);
    let output = run(command, case, DEADLINE);
    assert_eq!(
        output.status.code(),
        Some(2),
        "{case}: expected exit code 2\n{}",
        output.describe()
    );
    assert!(
        !output.stdout.contains("listening on"),
        "{case}: it started\n{}",
        output.describe()
    );
    for text in named {
        assert!(
            output.stderr.contains(text),
            "{case}: the message does not name `{text}`\n{}",
            output.describe()
        );
    }
    output
}

/// Starts the binary with `--reset-stores`, waits until it listens, and stops it with SIGTERM.
fn start_binary_with_reset_stores(dir: &Path) {
    let mut child = server_command(dir)
        .arg("--reset-stores")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the server binary");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let listening = loop {
        match rx.recv_timeout(DEADLINE) {
            Ok(line) if line.starts_with("taskstream listening on") => break true,
            Ok(_) => {}
            Err(_) => break false,
        }
    };
    if !listening {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the server did not start with --reset-stores");
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    // Its stdout closes when it exits.
    while rx.recv_timeout(DEADLINE).is_ok() {}
    assert_eq!(child.wait().expect("wait for the server").code(), Some(0));
}

#[test]
fn a_missing_log_is_refused_naming_it_and_reset_stores_starts_over_with_exact_counts() {
    let dir = temp_dir("datadir-missing-log");
    produce(dir.path(), 1_000, 50);
    let log = dir.path().join("log.redb");
    std::fs::remove_file(&log).expect("remove the log");
    let before = snapshot(dir.path());
    let output = expect_refused(
        dir.path(),
        &[],
        &[&log.display().to_string(), "--reset-stores", "is missing"],
        "missing log.redb",
    );
    assert_unchanged(&before, dir.path(), "missing log.redb");
    assert!(!log.exists(), "the log was recreated\n{}", output.describe());

    // The operator chooses to start over: the stores are rebuilt from the new,
    // empty log, so records produced now are all counted (none skipped below
    // the old stores' committed offsets).
    assert_eq!(counted(dir.path(), true), 0);
    produce(dir.path(), 2_000, 50);
    assert_eq!(counted(dir.path(), false), 2_000);
}

#[test]
fn an_empty_log_is_refused_even_with_reset_stores_and_stays_empty() {
    let dir = temp_dir("datadir-empty-log");
    produce(dir.path(), 1_000, 50);
    let log = dir.path().join("log.redb");
    std::fs::write(&log, b"").expect("truncate the log");
    let before = snapshot(dir.path());
    let shown = log.display().to_string();
    expect_refused(dir.path(), &[], &[&shown, "empty (0 bytes)"], "empty log.redb");
    assert_unchanged(&before, dir.path(), "empty log.redb");
    // A damaged log is not something --reset-stores may paper over.
    expect_refused(
        dir.path(),
        &["--reset-stores"],
        &[&shown, "empty (0 bytes)"],
        "empty log.redb with --reset-stores",
    );
    assert_unchanged(&before, dir.path(), "empty log.redb with --reset-stores");
}

#[test]
fn a_foreign_log_is_refused_and_reset_stores_rebuilds_the_stores_from_it() {
    let dir = temp_dir("datadir-foreign-log");
    let other = temp_dir("datadir-foreign-log-other");
    produce(dir.path(), 1_000, 50);
    produce(other.path(), 300, 30);
    let log = dir.path().join("log.redb");
    std::fs::copy(other.path().join("log.redb"), &log).expect("copy the other dir's log");
    let before = snapshot(dir.path());
    expect_refused(
        dir.path(),
        &[],
        &[&log.display().to_string(), "another data dir", "--reset-stores"],
        "foreign log.redb",
    );
    assert_unchanged(&before, dir.path(), "foreign log.redb");
    assert_eq!(
        counted(dir.path(), true),
        300,
        "the stores hold what this log holds"
    );
    assert_eq!(
        counted(dir.path(), false),
        300,
        "and a later start accepts the dir"
    );
}

#[test]
fn an_empty_store_is_refused_naming_it_and_reset_stores_rebuilds_it_from_the_log() {
    let dir = temp_dir("datadir-empty-store");
    produce(dir.path(), 1_000, 50);
    let store = store_file(dir.path(), 3);
    std::fs::write(&store, b"").expect("truncate a store");
    let before = snapshot(dir.path());
    expect_refused(
        dir.path(),
        &[],
        &[&store.display().to_string(), "empty (0 bytes)", "--reset-stores"],
        "empty store",
    );
    assert_unchanged(&before, dir.path(), "empty store");
    start_binary_with_reset_stores(dir.path());
    assert!(std::fs::metadata(&store).expect("the store is back").len() > 0);
    assert_eq!(counted(dir.path(), false), 1_000);
}

#[test]
fn a_damaged_store_is_refused_naming_it_with_nothing_written_but_the_recovery_flag() {
    let dir = temp_dir("datadir-damaged-store");
    produce(dir.path(), 5_000, 2_000);
    let store = store_file(dir.path(), 5);
    let mut bytes = std::fs::read(&store).expect("read the store");
    // Every page after the header: the store's trees cannot be read.
    for byte in &mut bytes[4096..] {
        *byte ^= 0x5a;
    }
    std::fs::write(&store, &bytes).expect("damage the store");
    let files_before: Vec<PathBuf> = snapshot(dir.path()).into_keys().collect();
    let output = expect_refused(
        dir.path(),
        &[],
        &[&store.display().to_string(), "damaged", "--reset-stores"],
        "damaged store",
    );
    let after = std::fs::read(&store).expect("the store is still there");
    assert_eq!(after.len(), bytes.len());
    let changed: Vec<usize> = (0..bytes.len()).filter(|&i| after[i] != bytes[i]).collect();
    assert!(
        changed.iter().all(|&i| i == 9),
        "bytes other than redb's recovery flag changed: {changed:?}\n{}",
        output.describe()
    );
    let files_after: Vec<PathBuf> = snapshot(dir.path()).into_keys().collect();
    assert_eq!(files_before, files_after, "no file was created or removed");
    assert_eq!(counted(dir.path(), true), 5_000);
}

#[test]
fn a_store_ahead_of_a_restored_log_is_refused_and_reset_stores_rebuilds_it() {
    let dir = temp_dir("datadir-store-ahead");
    produce(dir.path(), 500, 50);
    let log = dir.path().join("log.redb");
    let backup = std::fs::read(&log).expect("back the log up");
    produce(dir.path(), 500, 50);
    // The log restored from the older copy: same log, fewer records than the stores committed.
    std::fs::write(&log, &backup).expect("restore the older log");
    let before = snapshot(dir.path());
    let output = expect_refused(
        dir.path(),
        &[],
        &["ahead of the log", "--reset-stores"],
        "store ahead",
    );
    assert!(
        (0..8).any(|p| output
            .stderr
            .contains(&store_file(dir.path(), p).display().to_string())),
        "no store named\n{}",
        output.describe()
    );
    // Refused after the log was opened (its end offsets were needed): the stores are as they were.
    let after = snapshot(dir.path());
    for p in 0..8 {
        let file = store_file(dir.path(), p);
        assert!(after[&file] == before[&file], "{} changed", file.display());
    }
    assert_eq!(counted(dir.path(), true), 500);
}
