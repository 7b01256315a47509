//! The data dir at start: which log it holds and which stores belong to that log. Before the
//! runtime opens anything, [`open`] checks every file the configuration will use and refuses a
//! dir whose log is missing, empty or another dir's, or whose stores are empty, damaged, ahead of
//! the log or another log's, naming each file and what the operator can do. Nothing is recreated
//! silently: `reset_stores` deletes the stores it refused and rebuilds them from the log.
//!
//! The identity is one id, the log's, written when the log is created: inside `log.redb`, inside
//! every store created for it, and in `taskstream.id` beside them (so a missing log is noticed
//! even where no store remains).

use crate::config::{Config, StoreKind};
use crate::log::{Log, Peeked, RedbLog};
use crate::runtime::RuntimeError;
use crate::store::{PersistentStore, StoreError, StoreFacts};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// The identity file, beside the log.
pub const IDENTITY_FILE: &str = "taskstream.id";
/// The log, as `RedbLog` names it.
const LOG_FILE: &str = "log.redb";

/// The id of one log: 32 lowercase hex digits, drawn when the log is created.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LogId(String);

impl LogId {
    /// A new id from the process's hash randomness, the time and a counter: unique across logs
    /// in practice (it names a log, it guards no secret).
    pub fn generate() -> LogId {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let count = NEXT.fetch_add(1, Ordering::Relaxed);
        let half = |salt: u64| {
            // Each RandomState carries keys seeded from the OS.
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(salt);
            hasher.write_u128(nanos);
            hasher.write_u32(std::process::id());
            hasher.write_u64(count);
            hasher.finish()
        };
        LogId(format!("{:016x}{:016x}", half(1), half(2)))
    }

    /// Accepts what `generate` makes; anything else is not an id of ours.
    pub fn parse(text: &str) -> Option<LogId> {
        let valid = text.len() == 32
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        valid.then(|| LogId(text.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LogId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The identity file's content.
fn identity_text(id: &LogId) -> String {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    format!(
        "# The identity of this taskstream data dir: the id of its log (log.redb), which every\n\
         # store under stores/ records too. Do not edit it, and do not copy it between data dirs.\n\
         log_id = \"{id}\"\n\
         written_unix_ms = {created}\n"
    )
}

/// Reads the identity file: `None` when there is none.
fn read_identity(file: &Path) -> Result<Option<LogId>, Problem> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Problem::fatal(file, format!("cannot be read: {e}")));
        }
    };
    let id = text
        .parse::<toml::Table>()
        .ok()
        .and_then(|table| table.get("log_id")?.as_str().and_then(LogId::parse));
    match id {
        Some(id) => Ok(Some(id)),
        None => Err(Problem::fatal(
            file,
            "is damaged: it holds no valid `log_id`. Restore it from a backup of this data dir, or \
             remove it: the next start writes it again from the log",
        )),
    }
}

fn write_identity(file: &Path, id: &LogId) -> Result<(), RuntimeError> {
    // Written beside, then renamed: a crash leaves the old file or the new one, never half.
    let partial = file.with_extension("id.partial");
    std::fs::write(&partial, identity_text(id))
        .and_then(|()| std::fs::File::open(&partial)?.sync_all())
        .and_then(|()| std::fs::rename(&partial, file))
        .and_then(|()| match file.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => std::fs::File::open(parent)?.sync_all(),
            _ => Ok(()),
        })
        .map_err(|e| RuntimeError::Storage {
            path: file.display().to_string(),
            message: format!("cannot write the data dir's identity file: {e}"),
        })
}

/// One file the data dir cannot be used with, and whether `reset_stores` resolves it (by
/// deleting the file; a store is then rebuilt from the log).
#[derive(Debug)]
struct Problem {
    file: PathBuf,
    what: String,
    resettable: bool,
}

impl Problem {
    fn fatal(file: &Path, what: impl Into<String>) -> Problem {
        Problem {
            file: file.to_path_buf(),
            what: what.into(),
            resettable: false,
        }
    }

    fn store(file: &Path, what: impl Into<String>) -> Problem {
        Problem {
            file: file.to_path_buf(),
            what: what.into(),
            resettable: true,
        }
    }
}

/// What is on disk at a path before anything opens it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileState {
    Missing,
    /// Zero bytes: damaged (a crash or a full disk while it was created, or `: > file`).
    Empty,
    Present,
}

fn file_state(path: &Path) -> Result<FileState, Problem> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.len() == 0 => Ok(FileState::Empty),
        Ok(meta) if meta.is_file() => Ok(FileState::Present),
        Ok(_) => Err(Problem::fatal(path, "is not a regular file")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FileState::Missing),
        Err(e) => Err(Problem::fatal(path, format!("cannot be read: {e}"))),
    }
}

/// A persistent store the configuration opens, with what locates its progress in the log.
struct StorePlan {
    path: PathBuf,
    topic: String,
    retry_topic: String,
    partition: u32,
}

/// `<data_dir>/stores/<application_id>/<pipeline>_<partition>.redb`, as the runtime opens them.
fn store_plans(config: &Config, dir: &Path) -> Result<Vec<StorePlan>, RuntimeError> {
    let partitions = config.topic_partitions()?;
    let stores = dir.join("stores").join(&config.application_id);
    let mut plans = Vec::new();
    for pipeline in &config.pipelines {
        if config.store_kind(pipeline) != StoreKind::Persistent {
            continue;
        }
        let count = partitions.get(&pipeline.source_topic).copied().unwrap_or(0);
        for partition in 0..count {
            plans.push(StorePlan {
                path: stores.join(format!("{}_{partition}.redb", pipeline.name)),
                topic: pipeline.source_topic.clone(),
                retry_topic: config.retry_topic(&pipeline.name),
                partition,
            });
        }
    }
    Ok(plans)
}

/// Every `.redb` file under `<dir>/stores/*/`: the stores of any application that used this dir.
fn existing_store_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let Ok(apps) = std::fs::read_dir(dir.join("stores")) else {
        return files;
    };
    for app in apps.flatten() {
        let Ok(entries) = std::fs::read_dir(app.path()) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "redb") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Checks the data dir of `config` (which must have one), then opens its log. See the module doc.
/// Returns the log to run on; every persistent store the configuration uses exists and belongs
/// to it afterwards. Every refusal is `RuntimeError::Storage` (exit code 2 in the binary), with
/// one line per refused file and the choices.
pub fn open(config: &Config) -> Result<Arc<RedbLog>, RuntimeError> {
    let Some(dir) = config.data_dir.as_deref() else {
        return Err(RuntimeError::Internal("datadir::open without a data_dir".into()));
    };
    let reset = config.reset_stores;
    let plans = store_plans(config, dir)?;
    let identity_file = dir.join(IDENTITY_FILE);
    let log_file = dir.join(LOG_FILE);
    let refuse = |problems: Vec<Problem>| refusal(dir, reset, problems);
    let foreign_log = |log_id: &str, dir_id: &LogId| {
        Problem::store(
            &log_file,
            format!(
                "belongs to another data dir: it is log {log_id}, but {} says this data dir's log is {dir_id}",
                identity_file.display()
            ),
        )
    };

    // 1. What is there, before anything opens a file.
    let dir_id = read_identity(&identity_file).map_err(|p| refuse(vec![p]))?;
    let log_state = file_state(&log_file).map_err(|p| refuse(vec![p]))?;
    let mut problems = Vec::new();
    let mut store_states = Vec::with_capacity(plans.len());
    for plan in &plans {
        let state = match file_state(&plan.path) {
            Ok(state) => state,
            Err(problem) => {
                problems.push(problem);
                FileState::Missing
            }
        };
        if state == FileState::Empty {
            problems.push(Problem::store(
                &plan.path,
                "is empty (0 bytes): it is damaged, and is left as it is",
            ));
        }
        store_states.push(state);
    }
    let all_stores = existing_store_files(dir);

    // 2. The log, read without writing to it: is it this dir's?
    let log_problem = match log_state {
        FileState::Empty => Some(Problem::fatal(
            &log_file,
            "is empty (0 bytes): it is damaged, and is left as it is. Restore it from a backup of this \
             data dir; or remove it and start with --reset-stores to begin a new, empty log and rebuild \
             every store from it (everything the data dir held is then gone)",
        )),
        FileState::Missing => {
            let evidence: Vec<String> = dir_id
                .as_ref()
                .map(|_| identity_file.display().to_string())
                .into_iter()
                .chain(all_stores.iter().map(|p| p.display().to_string()))
                .collect();
            (!evidence.is_empty()).then(|| {
                Problem::store(
                    &log_file,
                    format!(
                        "is missing, but this data dir had a log{}: {} say so",
                        dir_id
                            .as_ref()
                            .map(|id| format!(" (id {id})"))
                            .unwrap_or_default(),
                        summarize(&evidence)
                    ),
                )
            })
        }
        FileState::Present => match (&dir_id, RedbLog::peek_log_id(dir).map_err(RuntimeError::from)?) {
            (Some(dir_id), Peeked::LogId(log_id)) if dir_id.as_str() != log_id => {
                Some(foreign_log(&log_id, dir_id))
            }
            (Some(dir_id), Peeked::NoLogId) => Some(foreign_log("without an id (an older one)", dir_id)),
            // The same id; or no identity file yet (an older data dir, or one removed: written
            // below from the log); or a file needing crash recovery, which only an open for
            // writing may do: checked once open.
            _ => None,
        },
    };
    if let Some(problem) = log_problem {
        let resolved = problem.resettable && reset;
        problems.insert(0, problem);
        if !resolved {
            return Err(refuse(problems));
        }
        // --reset-stores with a missing or foreign log: every store belongs to another log.
        let mut stale = Vec::new();
        for (plan, state) in plans.iter().zip(store_states.iter_mut()) {
            if *state != FileState::Missing {
                stale.push((plan.path.clone(), "it belongs to another log".to_string()));
                *state = FileState::Missing;
            }
        }
        delete_stores(&stale)?;
        problems.clear();
    }
    // Refused before anything opens a file: the whole dir stays as it was.
    if problems.iter().any(|p| !p.resettable) || (!problems.is_empty() && !reset) {
        return Err(refuse(problems));
    }

    // 3. Open the log: a full integrity check of the file, or a new log when none was there
    //    and nothing said there had been one (or --reset-stores asked for one).
    let log = RedbLog::open(dir).map_err(RuntimeError::from)?;
    let log_id = match (log.log_id().and_then(|id| LogId::parse(&id)), &dir_id) {
        (Some(id), _) => id,
        (None, Some(dir_id)) if !reset => {
            problems.insert(0, foreign_log("without an id (an older one)", dir_id));
            return Err(refuse(problems));
        }
        (None, _) => {
            // A log from before ids: it, and with it every store beside it, become this dir's.
            let id = LogId::generate();
            log.set_log_id(id.as_str()).map_err(RuntimeError::from)?;
            if dir_id.is_none() {
                for file in &all_stores {
                    if file_state(file).ok() == Some(FileState::Present) {
                        PersistentStore::set_log_id_if_absent(file, id.as_str()).map_err(store_error)?;
                    }
                }
                tracing::info!(log = %log_file.display(), log_id = %id, "a data dir from before log ids: its log and stores now carry one");
            }
            id
        }
    };
    match &dir_id {
        Some(dir_id) if *dir_id == log_id => {}
        Some(dir_id) if !reset => {
            // Known only now: the log needed crash recovery before its id could be read.
            problems.insert(0, foreign_log(log_id.as_str(), dir_id));
            return Err(refuse(problems));
        }
        _ => write_identity(&identity_file, &log_id)?,
    }

    // 4. Each store the configuration uses: this log's, whole, and not ahead of the log.
    for (plan, state) in plans.iter().zip(&store_states) {
        if *state == FileState::Present
            && let Err(problem) = check_store(plan, &log, &log_id)
        {
            problems.push(problem);
        }
    }
    let mut refused = Vec::new();
    if !problems.is_empty() {
        if !reset {
            return Err(refuse(problems));
        }
        refused = problems.into_iter().map(|p| (p.file, p.what)).collect();
        delete_stores(&refused)?;
    }

    // 5. New stores carry the log's id; the runtime builds them from what the log retains.
    for (plan, state) in plans.iter().zip(&store_states) {
        let deleted = refused.iter().any(|(file, _)| *file == plan.path);
        if *state != FileState::Missing && !deleted {
            continue;
        }
        PersistentStore::create(&plan.path, log_id.as_str()).map_err(store_error)?;
        let end = log.end_offset(&plan.topic, plan.partition).unwrap_or(0);
        if end > 0 {
            tracing::warn!(
                store = %plan.path.display(),
                topic = %plan.topic,
                partition = plan.partition,
                from_offset = log.start_offset(&plan.topic, plan.partition).unwrap_or(0),
                to_offset = end,
                "a new store for a partition that has records: it is built from the log"
            );
        }
    }
    Ok(log)
}

fn store_error(error: StoreError) -> RuntimeError {
    RuntimeError::Storage {
        path: error.path,
        message: error.message,
    }
}

/// Whether a present store file is this log's, whole, and not ahead of the log.
fn check_store(plan: &StorePlan, log: &RedbLog, log_id: &LogId) -> Result<(), Problem> {
    let facts: StoreFacts = PersistentStore::inspect(&plan.path)
        .map_err(|e| Problem::store(&plan.path, format!("is damaged: {}", e.message)))?;
    match &facts.log_id {
        Some(id) if id == log_id.as_str() => {}
        Some(id) => {
            return Err(Problem::store(
                &plan.path,
                format!("belongs to another log: it records log {id}, this data dir's log is {log_id}"),
            ));
        }
        None => {
            return Err(Problem::store(
                &plan.path,
                format!("does not say which log it belongs to (this data dir's log is {log_id})"),
            ));
        }
    }
    if let Some(checkpoint) = &facts.checkpoint {
        for (topic, offset) in [
            (&plan.topic, checkpoint.watermark),
            (&plan.retry_topic, checkpoint.retry_offset),
        ] {
            // A topic the log does not hold yet ends at 0.
            let end = log.end_offset(topic, plan.partition).unwrap_or(0);
            if offset > end {
                return Err(Problem::store(
                    &plan.path,
                    format!(
                        "is ahead of the log: it committed offset {offset} of {topic}-{}, but the log ends \
                         at {end} (was the log restored from an older copy?)",
                        plan.partition
                    ),
                ));
            }
        }
    }
    if !facts.verified {
        PersistentStore::verify(&plan.path)
            .map_err(|e| Problem::store(&plan.path, format!("is damaged: {}", e.message)))?;
    }
    Ok(())
}

fn delete_stores(files: &[(PathBuf, String)]) -> Result<(), RuntimeError> {
    for (file, why) in files {
        match std::fs::remove_file(file) {
            Ok(()) => {
                tracing::warn!(store = %file.display(), reason = %why, "--reset-stores: deleted; it is rebuilt from the log")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(RuntimeError::Storage {
                    path: file.display().to_string(),
                    message: format!("--reset-stores cannot delete it: {e}"),
                });
            }
        }
    }
    Ok(())
}

/// "a, b and 3 more".
fn summarize(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [first, second] => format!("{first} and {second}"),
        [first, rest @ ..] => format!("{first} and {} more", rest.len()),
    }
}

/// The error that stops the start: every refused file on a line, then the choices.
fn refusal(dir: &Path, reset: bool, problems: Vec<Problem>) -> RuntimeError {
    let first = problems
        .first()
        .map_or_else(|| dir.to_path_buf(), |p| p.file.clone());
    let mut message =
        String::from("the data dir cannot be used as it is; the files named here are left as they are:\n");
    for problem in &problems {
        message.push_str(&format!("  - {} {}\n", problem.file.display(), problem.what));
    }
    let resettable = problems.iter().all(|p| p.resettable);
    message.push_str("Choose one:\n  - restore the files named above from a backup of this data dir;\n");
    if resettable && !reset {
        message.push_str(
            "  - or start once with --reset-stores (TASKSTREAM_RESET_STORES=true): it deletes the stores \
             named above (all of them when the log is missing or another dir's) and rebuilds them from \
             what the log holds;\n",
        );
    }
    message.push_str("  - or point --data-dir at the data dir these files belong to.");
    RuntimeError::Storage {
        path: first.display().to_string(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(purpose: &str) -> crate::scratch::TempDir {
        crate::scratch::scratch_dir(purpose).unwrap()
    }

    #[test]
    fn log_ids_are_32_hex_digits_and_differ() {
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|_| LogId::generate().as_str().to_string())
            .collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            assert_eq!(LogId::parse(id).as_ref().map(LogId::as_str), Some(id.as_str()));
        }
        for bad in ["", "xyz", "0123456789ABCDEF0123456789ABCDEF", "0123456789abcdef"] {
            assert_eq!(LogId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_data_dir_from_before_ids_is_adopted_log_and_stores_alike() {
        let scratch = temp_dir("datadir-legacy");
        let dir = scratch.path();
        // A log and stores as written before ids: no identity anywhere.
        drop(redb::Database::create(dir.join(LOG_FILE)).unwrap());
        let ours = dir.join("stores").join("taskstream").join("counts_0.redb");
        let theirs = dir.join("stores").join("other").join("p_0.redb");
        for store in [&ours, &theirs] {
            drop(PersistentStore::open(store).unwrap());
            assert_eq!(PersistentStore::inspect(store).unwrap().log_id, None);
        }
        let mut config = Config::embedded_default();
        config.data_dir = Some(dir.to_path_buf());
        let log = open(&config).unwrap();
        let id = log.log_id().expect("the log now has an id");
        drop(log);
        let written = read_identity(&dir.join(IDENTITY_FILE)).unwrap();
        assert_eq!(written.as_ref().map(LogId::as_str), Some(id.as_str()));
        for store in [&ours, &theirs] {
            assert_eq!(
                PersistentStore::inspect(store).unwrap().log_id.as_deref(),
                Some(id.as_str())
            );
        }
        // The stores the configuration uses and that were missing are created for this log.
        for partition in 1..8 {
            let store = dir
                .join("stores")
                .join("taskstream")
                .join(format!("counts_{partition}.redb"));
            assert_eq!(
                PersistentStore::inspect(&store).unwrap().log_id.as_deref(),
                Some(id.as_str())
            );
        }
        // And the next start finds everything in order.
        assert_eq!(open(&config).unwrap().log_id(), Some(id));
    }

    #[test]
    fn a_damaged_identity_file_is_refused_whatever_the_flags() {
        let scratch = temp_dir("datadir-bad-identity");
        let dir = scratch.path();
        let file = dir.join(IDENTITY_FILE);
        std::fs::write(&file, "log_id = 42\n").unwrap();
        let mut config = Config::embedded_default();
        config.data_dir = Some(dir.to_path_buf());
        config.reset_stores = true;
        match open(&config) {
            Err(RuntimeError::Storage { path, message }) => {
                assert_eq!(path, file.display().to_string());
                assert!(message.contains("no valid `log_id`"), "{message}");
            }
            Err(other) => panic!("expected a storage error, got {other}"),
            Ok(_) => panic!("a damaged identity file was accepted"),
        }
        assert!(!dir.join(LOG_FILE).exists(), "nothing was created");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "log_id = 42\n");
    }
}
