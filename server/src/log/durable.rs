//! `RedbLog`: the embedded log kept on disk in one redb file (`<dir>/log.redb`), so records,
//! retention progress and committed offsets survive a restart or a SIGKILL. One writer thread
//! applies every mutation and commits whatever is queued in one transaction and one fsync
//! (group commit); reads use redb's MVCC snapshots and in-memory mirrors of the committed
//! metadata, so they never wait for the writer.

use super::{
    AppendListener, Log, LogError, ProducerRecord, Record, RecordPosition, Retention, partition_for_key,
    record_size,
};
use crate::health::{StorageComponent, StorageHealth};
use bytes::Bytes;
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, TableDefinition, TableError, WriteTransaction,
};
use std::collections::{HashMap, VecDeque};
use std::fmt::Display;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const FILE_NAME: &str = "log.redb";

/// Topic name → partition count.
const TOPICS: TableDefinition<&str, u32> = TableDefinition::new("topics");
/// (topic, partition) → (start offset, end offset, `record_size` summed over the retained records).
/// The end is stored because retention may leave a partition without any record.
const PARTITIONS: TableDefinition<(&str, u32), (u64, u64, u64)> = TableDefinition::new("partitions");
/// (group, topic, partition) → committed offset.
const COMMITTED: TableDefinition<(&str, &str, u32), u64> = TableDefinition::new("committed");
/// `log_id` → the id drawn when the log was created, which its data dir and stores record too
/// (`crate::datadir`). Logs from before ids have none until their data dir adopts them.
const IDENTITY: TableDefinition<&str, &str> = TableDefinition::new("identity");
const LOG_ID_KEY: &str = "log_id";
/// `last_probe_ms` → when a failing log last proved it can write again.
const PROBE: TableDefinition<&str, i64> = TableDefinition::new("probe");
const PROBE_KEY: &str = "last_probe_ms";

/// What `RedbLog::peek_log_id` could tell without writing to the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peeked {
    LogId(String),
    /// A log from before ids.
    NoLogId,
    /// Only an open for writing can tell: the file needs crash recovery (every file after a
    /// SIGKILL), is damaged, or is no redb file at all.
    Unknown,
}

/// Puts the calling thread (the writer) under Linux's `SCHED_BATCH`: the
/// same priority and share of the CPU, but its wake-ups never preempt a
/// running thread. Whoever wakes the writer — a stream thread appending a
/// failed record to the retry topic, a Produce — has more to do right after;
/// as an ordinary thread the writer took the waker's core at once, for a
/// group of one or two appends, and the waker waited. Now it runs on an idle
/// core, or once the waker's slice ends or it blocks, with a larger group
/// (measured: README, Benchmarks, the parked-keys probe; Produce on the
/// persistent log is as fast as before). The price: with every core busy, a
/// woken writer may wait up to a scheduler slice (a few ms) before it runs.
/// Elsewhere, or if Linux refuses, the writer stays an ordinary thread.
fn without_wakeup_preemption() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread, and `param` is a valid
        // sched_param that outlives the call (SCHED_BATCH takes priority 0).
        let refused = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &raw const param) } != 0;
        if refused {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "the log writer stays an ordinary thread (SCHED_BATCH refused)"
            );
        }
    }
}

/// One table per topic-partition, offset → encoded record.
fn records_table(name: &str) -> TableDefinition<'_, u64, &'static [u8]> {
    TableDefinition::new(name)
}

/// A group commit stops collecting requests at either bound, so one transaction (and the
/// latency of everything in it) stays bounded under a flood of producers.
const MAX_GROUP_REQUESTS: usize = 1024;
const MAX_GROUP_BYTES: usize = 64 << 20;

struct PartitionMirror {
    /// Name of the partition's records table, kept so a read does not format it.
    table: String,
    start: AtomicU64,
    end: AtomicU64,
    bytes: AtomicU64,
}

/// What is committed about a topic. Only the writer thread stores into it, and only after
/// the transaction that made the change is durable.
struct TopicMirror {
    partitions: Vec<PartitionMirror>,
    /// Round-robin cursor for records without key or partition; not persisted, like MemoryLog's.
    next_unkeyed: AtomicU32,
}

impl TopicMirror {
    fn new(topic: &str, metas: &[Meta]) -> TopicMirror {
        TopicMirror {
            partitions: metas
                .iter()
                .enumerate()
                .map(|(p, meta)| PartitionMirror {
                    table: format!("records/{topic}/{p}"),
                    start: AtomicU64::new(meta.start),
                    end: AtomicU64::new(meta.end),
                    bytes: AtomicU64::new(meta.bytes),
                })
                .collect(),
            next_unkeyed: AtomicU32::new(0),
        }
    }

    fn partition(&self, topic: &str, partition: u32) -> Result<&PartitionMirror, LogError> {
        self.partitions
            .get(partition as usize)
            .ok_or_else(|| LogError::UnknownPartition {
                topic: topic.to_string(),
                partition,
                partitions: self.partitions.len() as u32,
            })
    }

    fn meta(&self, partition: u32) -> Meta {
        let p = &self.partitions[partition as usize];
        Meta {
            start: p.start.load(Ordering::Acquire),
            end: p.end.load(Ordering::Acquire),
            bytes: p.bytes.load(Ordering::Acquire),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Meta {
    start: u64,
    end: u64,
    bytes: u64,
}

/// Opens the log's file again after a storage error (`Builder::open`: an existing file only,
/// so a log deleted meanwhile is never recreated empty). A parameter so tests can put a
/// fault-injecting storage backend under the log.
type Reopen = Box<dyn Fn() -> Result<Database, redb::DatabaseError> + Send + Sync>;

/// Told to callers while the database is closed between a storage error and its reopening.
const REOPENING: &str = "the log is reopening its file after a storage error; retry shortly";

/// State shared by the callers and the writer thread.
struct Shared {
    /// The database file, as errors name it.
    path: String,
    /// The open database. After an I/O error redb fails every later operation until the file
    /// is closed and opened again, which only the writer thread does (`Writer::reopen`); `None`
    /// while that failed. Readers hold the lock only to begin a transaction.
    db: RwLock<Option<Database>>,
    topics: RwLock<HashMap<String, Arc<TopicMirror>>>,
    committed: RwLock<HashMap<(String, String, u32), u64>>,
    log_id: RwLock<Option<String>>,
    listeners: RwLock<Vec<AppendListener>>,
    health: Arc<StorageHealth>,
    /// `AppendMode::Behind` appends handed to the writer and not yet written (queued or in
    /// its `behind` queue); at most `MAX_BEHIND`.
    behind: AtomicUsize,
}

impl Shared {
    fn storage(&self, message: impl Display) -> LogError {
        LogError::Storage {
            path: self.path.clone(),
            message: message.to_string(),
        }
    }

    /// A redb error as callers see it: an I/O failure (a full disk, an unreadable block, or
    /// the latch redb sets after one) is retryable, `Unavailable`, since the log heals by
    /// reopening its file; anything else means the file itself is wrong.
    fn fault(&self, error: impl Into<redb::Error>) -> LogError {
        let error = error.into();
        if is_io(&error) {
            LogError::Unavailable(format!(
                "the log cannot use its file right now ({error}); retry later"
            ))
        } else {
            self.storage(error)
        }
    }

    fn begin_read(&self) -> Result<redb::ReadTransaction, LogError> {
        let db = self.db.read().unwrap_or_else(|e| e.into_inner());
        let db = db
            .as_ref()
            .ok_or_else(|| LogError::Unavailable(REOPENING.into()))?;
        db.begin_read().map_err(|e| self.fault(e))
    }

    fn topic(&self, topic: &str) -> Result<Arc<TopicMirror>, LogError> {
        self.topics
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(topic)
            .cloned()
            .ok_or_else(|| LogError::UnknownTopic(topic.to_string()))
    }

    fn notify(&self, topic: &str, partition: u32) {
        let listeners = self.listeners.read().unwrap_or_else(|e| e.into_inner());
        for listener in listeners.iter() {
            listener(topic, partition);
        }
    }
}

/// Whether a redb error comes from the storage under the file rather than from its content.
fn is_io(error: &redb::Error) -> bool {
    match error {
        // InvalidData is how redb reports a file that is not a redb database.
        redb::Error::Io(io) => io.kind() != std::io::ErrorKind::InvalidData,
        redb::Error::PreviousIo | redb::Error::DatabaseClosed => true,
        _ => false,
    }
}

/// A record encoded on the caller's thread, so the writer thread only inserts bytes.
struct Encoded {
    partition: u32,
    data: Vec<u8>,
    size: u64,
}

enum Op {
    EnsureTopic {
        topic: String,
        partitions: u32,
    },
    Append {
        topic: String,
        records: Vec<Encoded>,
        mode: AppendMode,
    },
    /// Makes everything written so far durable.
    Flush,
    Commit {
        group: String,
        topic: String,
        partition: u32,
        offset: u64,
    },
    Retention {
        topic: String,
        partition: u32,
        retention: Retention,
        keep_from: u64,
        now_ms: i64,
    },
    SetLogId {
        log_id: String,
    },
    /// A reader met an I/O error: the writer checks the file (and reopens it) even if nothing
    /// is written meanwhile.
    Heal,
}

impl Op {
    fn weight(&self) -> usize {
        match self {
            Op::Append { records, .. } => records.iter().map(|r| r.data.len() + 16).sum(),
            _ => 64,
        }
    }
}

/// How an append reaches the file, and who learns of a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AppendMode {
    /// Durable before the reply (`append`).
    Durable,
    /// Written (not fsynced) before the reply; the caller waits and sees a failure.
    Unflushed,
    /// Written behind the caller, who does not wait (`append_unflushed`): a failure keeps the
    /// records in the writer's `behind` queue, retried before anything else is written, and
    /// `flush` fails until they are in the file.
    Behind,
}

/// Appends the writer has taken from their callers but not yet written (`AppendMode::Behind`)
/// are capped: past the cap `append_unflushed` waits for its write like `AppendMode::Unflushed`,
/// so a log that cannot write holds back its callers instead of growing without bound.
const MAX_BEHIND: usize = 256;

/// An append made without an fsync: what to write again if a reopen of the file finds it gone.
struct Appended {
    topic: String,
    records: Vec<Encoded>,
    /// Where each record went; empty while the append waits in the `behind` queue.
    positions: Vec<RecordPosition>,
}

/// What a group wrote: whether it was made durable, the positions of the `behind` appends it
/// wrote first, and each request's result.
struct Written {
    durable: bool,
    behind: Vec<Vec<RecordPosition>>,
    results: Vec<Result<Reply, LogError>>,
}

enum Reply {
    Done,
    Positions(Vec<RecordPosition>),
    Start(u64),
}

struct Request {
    op: Op,
    reply: mpsc::SyncSender<Result<Reply, LogError>>,
}

/// A durable `Log` in a redb file. Cheap to share: clone the `Arc`.
///
/// Blocking: `ensure_topic` (for a new topic), `append`, `commit` and `enforce_retention`
/// (when it has something to remove) block the calling thread until the writer thread has
/// committed the change with an fsync; call them from `spawn_blocking` in async code. There is
/// no cancellation: once submitted, a request is applied and made durable even if its caller
/// stops caring. Reads never block on the writer.
///
/// Dropping the last `Arc` stops the writer thread (every queued request is finished first) and
/// closes the file, after which the directory can be opened again.
pub struct RedbLog {
    shared: Arc<Shared>,
    requests: Option<mpsc::Sender<Request>>,
    /// The reply channel of requests nobody waits for (appends behind their callers, heal
    /// requests), its receiver dropped: the writer's answer is discarded at once. One shared
    /// sender instead of a channel per request, which cost every failing record's retry
    /// append two allocations (bench `retry`, parked-keys probe).
    unanswered: mpsc::SyncSender<Result<Reply, LogError>>,
    writer: Option<JoinHandle<()>>,
}

impl RedbLog {
    /// Opens the log kept in `dir`, creating the directory and `dir/log.redb` if missing (a new
    /// log draws its id, `log_id`). A file that is empty, not a redb database, corrupt or cannot
    /// be read is reported as `LogError::Storage` naming it; it is never reset. The whole file is
    /// checked at open (redb's integrity check), so opening takes time proportional to its size.
    /// The file is locked: a second open, from this process or another, fails until the first is
    /// dropped. Whether the log belongs to its data dir is `crate::datadir`'s question.
    pub fn open(dir: &Path) -> Result<Arc<RedbLog>, LogError> {
        std::fs::create_dir_all(dir).map_err(|e| LogError::Storage {
            path: dir.display().to_string(),
            message: format!("cannot create the log directory: {e}"),
        })?;
        let path = dir.join(FILE_NAME);
        let shown = path.display().to_string();
        let storage = |message: String| LogError::Storage {
            path: shown.clone(),
            message,
        };
        // redb would initialise an empty file as a new database: a log that lost its content
        // must not come back as an empty one.
        let created = match std::fs::metadata(&path) {
            Ok(meta) if meta.len() == 0 => {
                return Err(storage(
                    "the log is empty (0 bytes): it is damaged, and is left as it is".into(),
                ));
            }
            Ok(_) => false,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => return Err(storage(format!("cannot read the log: {e}"))),
        };
        if created {
            create_stamped(&path).map_err(|e| storage(format!("cannot create the log: {e}")))?;
        }
        // Without the integrity check redb trusts the file and may panic on a damaged one; with
        // it a damaged file is an error. The catch is for whatever the check still misses.
        let opened = catch_unwind(AssertUnwindSafe(|| {
            Database::builder().set_check_integrity_on_open(true).open(&path)
        }));
        let db = match opened {
            Ok(Ok(db)) => db,
            Ok(Err(redb::DatabaseError::DatabaseAlreadyOpen)) => {
                return Err(storage(
                    "the log is already open (in this or another process)".into(),
                ));
            }
            Ok(Err(e)) => return Err(storage(format!("cannot open the log: {e}"))),
            Err(_) => return Err(storage("cannot open the log: the file is corrupt".into())),
        };
        let reopen_path = path.clone();
        let reopen: Reopen = Box::new(move || Database::builder().open(&reopen_path));
        RedbLog::start(shown, db, reopen, StorageHealth::new())
    }

    /// Loads the mirrors from `db` and starts the writer thread.
    fn start(
        path: String,
        db: Database,
        reopen: Reopen,
        health: Arc<StorageHealth>,
    ) -> Result<Arc<RedbLog>, LogError> {
        let shared = Shared {
            path,
            db: RwLock::new(Some(db)),
            topics: RwLock::new(HashMap::new()),
            committed: RwLock::new(HashMap::new()),
            log_id: RwLock::new(None),
            listeners: RwLock::new(Vec::new()),
            health,
            behind: AtomicUsize::new(0),
        };
        let (topics, committed, log_id) = catch_unwind(AssertUnwindSafe(|| load(&shared)))
            .unwrap_or_else(|_| Err(shared.storage("cannot load the log: the file is corrupt")))?;
        *shared.topics.write().unwrap_or_else(|e| e.into_inner()) = topics;
        *shared.committed.write().unwrap_or_else(|e| e.into_inner()) = committed;
        *shared.log_id.write().unwrap_or_else(|e| e.into_inner()) = log_id;
        let shared = Arc::new(shared);
        let (requests, receiver) = mpsc::channel();
        let writer = Writer {
            shared: shared.clone(),
            requests: receiver,
            reopen,
            failing: false,
            behind: VecDeque::new(),
            since_durable: Vec::new(),
        };
        let writer = std::thread::Builder::new()
            .name("taskstream-log-writer".into())
            .spawn(move || {
                without_wakeup_preemption();
                writer.run()
            })
            .map_err(|e| shared.storage(format!("cannot start the log writer thread: {e}")))?;
        let (unanswered, _) = mpsc::sync_channel(1);
        Ok(Arc::new(RedbLog {
            shared,
            requests: Some(requests),
            unanswered,
            writer: Some(writer),
        }))
    }

    /// The id of the log kept in `dir`, read without writing anything into the file (redb's
    /// read-only open), so a log that turns out to be another data dir's is left byte for byte
    /// as it was. `Unknown` when only an open for writing can tell.
    pub fn peek_log_id(dir: &Path) -> Result<Peeked, LogError> {
        let path = dir.join(FILE_NAME);
        let peek = || -> Result<Peeked, redb::Error> {
            let db = Database::builder().open_read_only(&path)?;
            let txn = db.begin_read()?;
            let table = match txn.open_table(IDENTITY) {
                Ok(table) => table,
                Err(TableError::TableDoesNotExist(_)) => return Ok(Peeked::NoLogId),
                Err(e) => return Err(e.into()),
            };
            Ok(match table.get(LOG_ID_KEY)? {
                Some(id) => Peeked::LogId(id.value().to_string()),
                None => Peeked::NoLogId,
            })
        };
        match catch_unwind(AssertUnwindSafe(peek)) {
            Ok(Ok(peeked)) => Ok(peeked),
            Ok(Err(redb::Error::DatabaseAlreadyOpen)) => Err(LogError::Storage {
                path: path.display().to_string(),
                message: "the log is already open (in this or another process)".into(),
            }),
            Ok(Err(_)) | Err(_) => Ok(Peeked::Unknown),
        }
    }

    /// The log's id; `None` for a log from before ids.
    pub fn log_id(&self) -> Option<String> {
        self.shared
            .log_id
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Gives a log from before ids its id (durably). A log that has one keeps it: an id names
    /// one log for its whole life.
    pub fn set_log_id(&self, log_id: &str) -> Result<(), LogError> {
        if let Some(existing) = self.log_id() {
            return if existing == log_id {
                Ok(())
            } else {
                Err(self
                    .shared
                    .storage(format!("the log already has the id {existing}")))
            };
        }
        self.submit(Op::SetLogId {
            log_id: log_id.to_string(),
        })
        .map(drop)
    }

    /// `Log::append`, durable before it returns or (`durable == false`) left to the next
    /// durable commit.
    fn append_with(
        &self,
        topic: &str,
        records: &[ProducerRecord],
        mode: AppendMode,
    ) -> Result<Vec<RecordPosition>, LogError> {
        match self.encode_append(topic, records, mode)? {
            Some(op) => self.submit_append(topic, op),
            None => Ok(Vec::new()),
        }
    }

    /// The writer's operation appending `records` (`None` when there are none).
    fn encode_append(
        &self,
        topic: &str,
        records: &[ProducerRecord],
        mode: AppendMode,
    ) -> Result<Option<Op>, LogError> {
        let mirror = self.shared.topic(topic)?;
        if records.is_empty() {
            return Ok(None);
        }
        let count = mirror.partitions.len() as u32;
        let now = now_ms();
        let mut encoded = Vec::with_capacity(records.len());
        // Route and encode every record before submitting, so a bad partition rejects the
        // whole batch and the writer thread only has bytes to insert.
        for record in records {
            let partition = match (record.partition, &record.key) {
                (Some(p), _) => {
                    mirror.partition(topic, p)?;
                    p
                }
                // A topic created with no partition has nowhere to put the record.
                (None, _) if count == 0 => {
                    return Err(LogError::UnknownPartition {
                        topic: topic.to_string(),
                        partition: 0,
                        partitions: 0,
                    });
                }
                (None, Some(key)) => partition_for_key(key, count),
                (None, None) => mirror.next_unkeyed.fetch_add(1, Ordering::Relaxed) % count,
            };
            encoded.push(Encoded {
                partition,
                data: encode(record, record.timestamp_ms.unwrap_or(now)),
                size: record_size(record.key.as_deref(), &record.value, &record.headers),
            });
        }
        Ok(Some(Op::Append {
            topic: topic.to_string(),
            records: encoded,
            mode,
        }))
    }

    /// Hands an append to the writer: its positions once written, or nothing
    /// at once (`AppendMode::Behind`).
    fn submit_append(&self, topic: &str, op: Op) -> Result<Vec<RecordPosition>, LogError> {
        if matches!(
            op,
            Op::Append {
                mode: AppendMode::Behind,
                ..
            }
        ) {
            // The writer notifies the partitions' listeners once the records are written.
            return self.submit_behind(op).map(|()| Vec::new());
        }
        let Reply::Positions(positions) = self.submit(op)? else {
            return Err(LogError::Unavailable(
                "unexpected reply from the log writer".into(),
            ));
        };
        let mut touched: Vec<u32> = positions.iter().map(|p| p.partition).collect();
        touched.sort_unstable();
        touched.dedup();
        for partition in touched {
            self.shared.notify(topic, partition);
        }
        Ok(positions)
    }

    /// Hands `op` to the writer thread without waiting for it (`AppendMode::Behind`).
    fn submit_behind(&self, op: Op) -> Result<(), LogError> {
        // Nobody reads the reply: the writer keeps a failed write and retries it itself.
        let reply = self.unanswered.clone();
        self.requests
            .as_ref()
            .ok_or_else(|| LogError::Unavailable("the log writer thread has stopped".into()))?
            .send(Request { op, reply })
            .map_err(|_| LogError::Unavailable("the log writer thread has stopped".into()))
    }

    /// Hands `op` to the writer thread and waits until it is durable (or failed).
    fn submit(&self, op: Op) -> Result<Reply, LogError> {
        let stopped = || LogError::Unavailable("the log writer thread has stopped".into());
        let (reply, answer) = mpsc::sync_channel(1);
        self.requests
            .as_ref()
            .ok_or_else(stopped)?
            .send(Request { op, reply })
            .map_err(|_| stopped())?;
        answer.recv().map_err(|_| stopped())?
    }

    /// `Log::read` without the health bookkeeping of its errors.
    fn read_records(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
        out: &mut Vec<Record>,
    ) -> Result<(), LogError> {
        let mirror = self.shared.topic(topic)?;
        let part = mirror.partition(topic, partition)?;
        let start = part.start.load(Ordering::Acquire);
        if offset < start {
            return Err(LogError::OffsetOutOfRange {
                topic: topic.to_string(),
                partition,
                requested: offset,
                earliest: start,
            });
        }
        // Only up to the published end: what `end_offset` answers and listeners announced.
        // The mirror is published after its commit, so the snapshot below holds all of it.
        let end = part.end.load(Ordering::Acquire);
        if offset >= end || max == 0 {
            return Ok(());
        }
        let want = max.min((end - offset).min(usize::MAX as u64) as usize);
        let txn = self.shared.begin_read()?;
        let table = match txn.open_table(records_table(&part.table)) {
            Ok(table) => table,
            Err(TableError::TableDoesNotExist(_)) => {
                return self.missing_records(&txn, topic, partition, offset);
            }
            Err(e) => return Err(self.shared.fault(e)),
        };
        out.reserve(want);
        let mut next = offset;
        for entry in table
            .range(offset..end)
            .map_err(|e| self.shared.fault(e))?
            .take(want)
        {
            let (key, raw) = entry.map_err(|e| self.shared.fault(e))?;
            if key.value() != next {
                return self.missing_records(&txn, topic, partition, next);
            }
            let record = decode(raw.value(), partition, next).map_err(|e| {
                self.shared
                    .storage(format!("record {next} of {topic}-{partition}: {e}"))
            })?;
            out.push(record);
            next += 1;
        }
        if next - offset < want as u64 {
            return self.missing_records(&txn, topic, partition, next);
        }
        Ok(())
    }

    /// Passes a read's error on; an I/O failure also counts against the log's health and asks
    /// the writer thread to check the file, which it reopens if redb latched the failure.
    fn reader_fault(&self, error: LogError) -> LogError {
        if let LogError::Unavailable(message) = &error {
            self.shared
                .health
                .failed(StorageComponent::Log, &self.shared.path, message);
            if let Some(requests) = &self.requests {
                // Nobody waits for the answer.
                let reply = self.unanswered.clone();
                let _ = requests.send(Request { op: Op::Heal, reply });
            }
        }
        error
    }

    /// Explains a read that found no record at `offset`: retention that ran between the mirror
    /// check and the snapshot (out of range, with the snapshot's start), or a damaged file.
    fn missing_records(
        &self,
        txn: &redb::ReadTransaction,
        topic: &str,
        partition: u32,
        offset: u64,
    ) -> Result<(), LogError> {
        let table = txn.open_table(PARTITIONS).map_err(|e| self.shared.fault(e))?;
        let start = table
            .get((topic, partition))
            .map_err(|e| self.shared.fault(e))?
            .map(|row| row.value().0);
        match start {
            Some(start) if offset < start => Err(LogError::OffsetOutOfRange {
                topic: topic.to_string(),
                partition,
                requested: offset,
                earliest: start,
            }),
            _ => Err(self
                .shared
                .storage(format!("record {offset} of {topic}-{partition} is missing"))),
        }
    }
}

impl Drop for RedbLog {
    fn drop(&mut self) {
        // Disconnecting the channel is the writer's signal to finish what is queued and stop.
        drop(self.requests.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// Makes a new log at `path` with its id, beside it and then renamed into place: a crash leaves
/// no log, or a whole one that has its id, never an empty file.
fn create_stamped(path: &Path) -> Result<(), String> {
    let partial = path.with_extension("redb.partial");
    // Left by a crash in an earlier create: it never was a log.
    let _ = std::fs::remove_file(&partial);
    let log_id = crate::datadir::LogId::generate();
    let write = || -> Result<(), redb::Error> {
        let db = Database::create(&partial)?;
        let txn = db.begin_write()?;
        txn.open_table(IDENTITY)?.insert(LOG_ID_KEY, log_id.as_str())?;
        txn.commit()?;
        Ok(db.close()?)
    };
    catch_unwind(AssertUnwindSafe(write))
        .map_err(|_| "redb panicked".to_string())?
        .map_err(|e| e.to_string())?;
    std::fs::rename(&partial, path)
        .and_then(|()| match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => std::fs::File::open(parent)?.sync_all(),
            _ => Ok(()),
        })
        .map_err(|e| e.to_string())
}

type Mirrors = (
    HashMap<String, Arc<TopicMirror>>,
    HashMap<(String, String, u32), u64>,
    Option<String>,
);

/// Reads the committed metadata into the mirrors.
fn load(shared: &Shared) -> Result<Mirrors, LogError> {
    let txn = shared.begin_read()?;
    let mut topics = HashMap::new();
    let mut committed = HashMap::new();
    let log_id = match txn.open_table(IDENTITY) {
        Ok(table) => table
            .get(LOG_ID_KEY)
            .map_err(|e| shared.fault(e))?
            .map(|id| id.value().to_string()),
        Err(TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(shared.fault(e)),
    };
    let topic_table = match txn.open_table(TOPICS) {
        Ok(table) => table,
        // A new file: nothing was ever committed.
        Err(TableError::TableDoesNotExist(_)) => return Ok((topics, committed, log_id)),
        Err(e) => return Err(shared.fault(e)),
    };
    let partition_table = txn.open_table(PARTITIONS).map_err(|e| shared.fault(e))?;
    for entry in topic_table.iter().map_err(|e| shared.fault(e))? {
        let (name, count) = entry.map_err(|e| shared.fault(e))?;
        let (name, count) = (name.value(), count.value());
        // Not sized from the file: a damaged count must not ask for an absurd allocation.
        let mut metas = Vec::new();
        for p in 0..count {
            let row = partition_table.get((name, p)).map_err(|e| shared.fault(e))?;
            let Some(row) = row else {
                return Err(shared.storage(format!("no metadata for partition {p} of topic `{name}`")));
            };
            let (start, end, bytes) = row.value();
            if start > end {
                return Err(shared.storage(format!(
                    "partition {p} of topic `{name}` starts at {start} after its end {end}"
                )));
            }
            metas.push(Meta { start, end, bytes });
        }
        topics.insert(name.to_string(), Arc::new(TopicMirror::new(name, &metas)));
    }
    match txn.open_table(COMMITTED) {
        Ok(table) => {
            for entry in table.iter().map_err(|e| shared.fault(e))? {
                let (key, offset) = entry.map_err(|e| shared.fault(e))?;
                let (group, topic, partition) = key.value();
                committed.insert((group.to_string(), topic.to_string(), partition), offset.value());
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(shared.fault(e)),
    }
    Ok((topics, committed, log_id))
}

/// Changes made by the open transaction, published to the mirrors only once it is durable.
#[derive(Default)]
struct Pending {
    topics: HashMap<String, u32>,
    partitions: HashMap<(String, u32), Meta>,
    committed: Vec<((String, String, u32), u64)>,
    log_id: Option<String>,
    /// Whether anything was written; a group that wrote nothing is aborted, saving the fsync.
    dirty: bool,
}

impl Pending {
    fn meta(&self, topic: &str, mirror: &TopicMirror, partition: u32) -> Meta {
        self.partitions
            .get(&(topic.to_string(), partition))
            .copied()
            .unwrap_or_else(|| mirror.meta(partition))
    }
}

/// How often a failing log checks whether it can write again, at first and at most.
const PROBE_MIN: Duration = Duration::from_millis(100);

/// Bytes a probe must be able to write for a failing log to count as healed.
const PROBE_ROOM: usize = 1 << 20;

/// Where a probe writes its `PROBE_ROOM` bytes (removed again at once).
const PROBE_ROOM_TABLE: TableDefinition<&str, &[u8]> = TableDefinition::new("probe_room");
const PROBE_MAX: Duration = Duration::from_secs(2);

struct Writer {
    shared: Arc<Shared>,
    requests: mpsc::Receiver<Request>,
    reopen: Reopen,
    /// From a storage error until a write succeeds again. Meanwhile the thread also wakes on
    /// its own to probe the file, so the log recovers (and says so) even if nobody writes.
    failing: bool,
    /// `AppendMode::Behind` appends whose write failed, oldest first: written before anything
    /// else, so each partition keeps its order.
    behind: VecDeque<Appended>,
    /// Appends written without an fsync since the last durable commit, oldest first.
    since_durable: Vec<Appended>,
}

impl Writer {
    fn run(mut self) {
        let mut probe_after = PROBE_MIN;
        loop {
            let first = if self.failing {
                match self.requests.recv_timeout(probe_after) {
                    Ok(request) => request,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        probe_after = if self.probe() {
                            if !self.behind.is_empty() {
                                // Nobody may write for a while: the records behind are due now.
                                self.apply_group(Vec::new());
                            }
                            PROBE_MIN
                        } else {
                            (probe_after * 2).min(PROBE_MAX)
                        };
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                match self.requests.recv() {
                    Ok(request) => request,
                    Err(_) => break,
                }
            };
            let mut weight = first.op.weight();
            let mut group = vec![first];
            while group.len() < MAX_GROUP_REQUESTS && weight < MAX_GROUP_BYTES {
                match self.requests.try_recv() {
                    Ok(request) => {
                        weight += request.op.weight();
                        group.push(request);
                    }
                    Err(_) => break,
                }
            }
            self.apply_group(group);
        }
    }

    fn apply_group(&mut self, group: Vec<Request>) {
        if group.iter().any(|r| matches!(r.op, Op::Heal)) {
            // Checked by a write: the group's own, or the next probe.
            self.failing = true;
        }
        let closed = self.shared.db.read().unwrap_or_else(|e| e.into_inner()).is_none();
        if closed && let Err(error) = self.reopen() {
            self.answer_failed(group, &error);
            return;
        }
        let behind = std::mem::take(&mut self.behind);
        let mut pending = Pending::default();
        // A panic inside redb must not leave callers waiting forever: they get an error, and
        // the thread keeps serving (the reopen below repairs the leaked pages).
        let outcome = catch_unwind(AssertUnwindSafe(|| self.run_group(&behind, &group, &mut pending)))
            .unwrap_or_else(|_| {
                Err(self
                    .shared
                    .storage("the log writer panicked; nothing was written"))
            });
        match outcome {
            Ok(written) => {
                let wrote = pending.dirty;
                self.publish(pending);
                if self.failing && wrote {
                    self.recovered();
                }
                if written.durable {
                    self.since_durable.clear();
                }
                for (mut appended, positions) in behind.into_iter().zip(written.behind) {
                    self.shared.behind.fetch_sub(1, Ordering::AcqRel);
                    self.notify_written(&appended.topic, &positions);
                    if !written.durable {
                        appended.positions = positions;
                        self.since_durable.push(appended);
                    }
                }
                for (request, result) in group.into_iter().zip(written.results) {
                    self.answer(request, result, written.durable);
                }
            }
            Err(error) => {
                self.behind = behind;
                self.answer_failed(group, &error);
                self.failed(&error);
            }
        }
    }

    /// Replies to a request the group wrote (or rejected). Unflushed appends are remembered
    /// until a durable commit, in case a reopen finds them gone.
    fn answer(&mut self, request: Request, result: Result<Reply, LogError>, durable: bool) {
        let Request { op, reply } = request;
        let Op::Append { topic, records, mode } = op else {
            let _ = reply.send(result);
            return;
        };
        if mode == AppendMode::Behind {
            self.shared.behind.fetch_sub(1, Ordering::AcqRel);
        }
        match (&result, mode) {
            (Ok(Reply::Positions(positions)), AppendMode::Unflushed | AppendMode::Behind) => {
                if mode == AppendMode::Behind {
                    self.notify_written(&topic, positions);
                }
                if !durable {
                    self.since_durable.push(Appended {
                        topic,
                        records,
                        positions: positions.clone(),
                    });
                }
            }
            // Routed and checked by its caller, so only a topic that vanished gets here.
            (Err(error), AppendMode::Behind) => {
                tracing::error!(log = %self.shared.path, topic, %error, "dropping records appended behind their caller");
            }
            _ => {}
        }
        let _ = reply.send(result);
    }

    /// Answers every request of a group that wrote nothing with `error`, except the appends
    /// written behind their callers: those wait in `behind` for the next write.
    fn answer_failed(&mut self, group: Vec<Request>, error: &LogError) {
        for Request { op, reply } in group {
            match op {
                Op::Append {
                    topic,
                    records,
                    mode: AppendMode::Behind,
                } => self.behind.push_back(Appended {
                    topic,
                    records,
                    positions: Vec::new(),
                }),
                _ => {
                    let _ = reply.send(Err(error.clone()));
                }
            }
        }
    }

    fn notify_written(&self, topic: &str, positions: &[RecordPosition]) {
        let mut touched: Vec<u32> = positions.iter().map(|p| p.partition).collect();
        touched.sort_unstable();
        touched.dedup();
        for partition in touched {
            self.shared.notify(topic, partition);
        }
    }

    /// After a reopen: the appends made without an fsync that the file no longer holds go to
    /// the front of `behind`, so they are written again, at the same offsets, before anything
    /// else. (Whether a non-durable commit survives closing the file after an I/O error is
    /// redb's business; each record is checked against the partition's end as reloaded.)
    fn requeue_lost_appends(&mut self) {
        let mut lost = Vec::new();
        for appended in std::mem::take(&mut self.since_durable) {
            let Ok(mirror) = self.shared.topic(&appended.topic) else {
                continue;
            };
            let mut missing = Vec::new();
            for (record, position) in appended.records.into_iter().zip(&appended.positions) {
                let end = mirror
                    .partitions
                    .get(position.partition as usize)
                    .map_or(0, |p| p.end.load(Ordering::Acquire));
                if position.offset >= end {
                    missing.push(record);
                }
            }
            if !missing.is_empty() {
                lost.push(Appended {
                    topic: appended.topic,
                    records: missing,
                    positions: Vec::new(),
                });
            }
        }
        if !lost.is_empty() {
            tracing::warn!(log = %self.shared.path, appends = lost.len(), "rewriting unflushed appends the reopened file lost");
            self.shared.behind.fetch_add(lost.len(), Ordering::AcqRel);
            for appended in lost.into_iter().rev() {
                self.behind.push_front(appended);
            }
        }
    }

    /// A storage error: counted, reported, and the file reopened at once, so reads work
    /// again as soon as redb can read it (a full disk still reads).
    fn failed(&mut self, error: &LogError) {
        self.shared
            .health
            .failed(StorageComponent::Log, &self.shared.path, error);
        self.failing = true;
        if let Err(error) = self.reopen() {
            tracing::warn!(log = %self.shared.path, %error, "cannot reopen the log yet; retrying");
        }
    }

    fn recovered(&mut self) {
        self.failing = false;
        self.shared
            .health
            .recovered(StorageComponent::Log, &self.shared.path);
    }

    /// Whether the log can write again: reopens the file if it is closed, then durably writes
    /// `PROBE_ROOM` bytes and removes them again. A tiny write could fit in pages the file
    /// already has free while a real batch still finds the disk full, and health would flap.
    /// Runs only while failing.
    fn probe(&mut self) -> bool {
        let closed = self.shared.db.read().unwrap_or_else(|e| e.into_inner()).is_none();
        if closed && self.reopen().is_err() {
            return false;
        }
        let write = || -> Result<(), redb::Error> {
            let db = self.shared.db.read().unwrap_or_else(|e| e.into_inner());
            let Some(db) = db.as_ref() else {
                return Err(redb::Error::DatabaseClosed);
            };
            let room = vec![0u8; PROBE_ROOM];
            let mut txn = db.begin_write()?;
            txn.set_durability(Durability::Immediate)?;
            {
                let mut probe = txn.open_table(PROBE_ROOM_TABLE)?;
                probe.insert(PROBE_KEY, room.as_slice())?;
            }
            txn.commit()?;
            let mut txn = db.begin_write()?;
            txn.set_durability(Durability::Immediate)?;
            txn.open_table(PROBE_ROOM_TABLE)?.remove(PROBE_KEY)?;
            txn.open_table(PROBE)?.insert(PROBE_KEY, now_ms())?;
            txn.commit()?;
            Ok(())
        };
        let result = catch_unwind(AssertUnwindSafe(write))
            .unwrap_or_else(|_| Err(redb::Error::Corrupted("redb panicked in a probe".into())));
        match result {
            Ok(()) => {
                self.recovered();
                true
            }
            Err(e) => {
                let error = self.shared.fault(e);
                self.failed(&error);
                false
            }
        }
    }

    /// Closes the database and opens the file again: redb's way out of an I/O error. Read
    /// transactions still open on the old database fail (`DatabaseClosed`, retryable); the
    /// mirrors are reloaded from the file, which may hold a commit that reported failure after
    /// it reached the disk.
    fn reopen(&mut self) -> Result<(), LogError> {
        let mut slot = self.shared.db.write().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = slot.take() {
            // Fails after an I/O error (it cannot record a clean shutdown): the open below then
            // recovers the file as after a crash.
            let _ = old.close();
        }
        let opened = catch_unwind(AssertUnwindSafe(|| (self.reopen)())).unwrap_or_else(|_| {
            Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(
                "redb panicked".into(),
            )))
        });
        let db = opened.map_err(|e| self.shared.fault(e))?;
        *slot = Some(db);
        drop(slot);
        let (topics, committed, log_id) = catch_unwind(AssertUnwindSafe(|| load(&self.shared)))
            .unwrap_or_else(|_| Err(self.shared.storage("cannot load the log: the file is corrupt")))?;
        self.refresh(topics, committed, log_id);
        self.requeue_lost_appends();
        tracing::info!(log = %self.shared.path, "log file reopened");
        Ok(())
    }

    /// Makes the mirrors what the file holds, and wakes the listeners of every partition: a
    /// reader that failed while the file was closed may wait for an append that will not come.
    fn refresh(
        &self,
        topics: HashMap<String, Arc<TopicMirror>>,
        committed: HashMap<(String, String, u32), u64>,
        log_id: Option<String>,
    ) {
        let mut partitions = Vec::new();
        {
            let mut mirrors = self.shared.topics.write().unwrap_or_else(|e| e.into_inner());
            for (name, loaded) in topics {
                partitions.extend((0..loaded.partitions.len() as u32).map(|p| (name.clone(), p)));
                match mirrors.get(&name) {
                    Some(mirror) if mirror.partitions.len() == loaded.partitions.len() => {
                        for (old, new) in mirror.partitions.iter().zip(&loaded.partitions) {
                            old.start
                                .store(new.start.load(Ordering::Acquire), Ordering::Release);
                            old.bytes
                                .store(new.bytes.load(Ordering::Acquire), Ordering::Release);
                            old.end.store(new.end.load(Ordering::Acquire), Ordering::Release);
                        }
                    }
                    _ => {
                        mirrors.insert(name, loaded);
                    }
                }
            }
        }
        *self.shared.committed.write().unwrap_or_else(|e| e.into_inner()) = committed;
        *self.shared.log_id.write().unwrap_or_else(|e| e.into_inner()) = log_id;
        for (topic, partition) in partitions {
            self.shared.notify(&topic, partition);
        }
    }

    /// Applies the appends left `behind` by earlier groups, then every request, in one
    /// transaction. A request rejected for a reason of its own (unknown topic, mismatch) is
    /// rejected before it writes anything, so the others still commit; a storage error fails
    /// the whole group, since none of it is then durable.
    fn run_group(
        &self,
        behind: &VecDeque<Appended>,
        group: &[Request],
        pending: &mut Pending,
    ) -> Result<Written, LogError> {
        let db = self.shared.db.read().unwrap_or_else(|e| e.into_inner());
        let db = db
            .as_ref()
            .ok_or_else(|| LogError::Unavailable(REOPENING.into()))?;
        let mut txn = db.begin_write().map_err(|e| self.shared.fault(e))?;
        // Callers are told "durable" the moment commit returns, unless every request of the
        // group asked for an unflushed append: then the commit skips its fsync, and the next
        // durable commit (a flush, a committed offset, any durable append) persists it too.
        let durable = group.iter().any(|r| {
            !matches!(
                r.op,
                Op::Append {
                    mode: AppendMode::Unflushed | AppendMode::Behind,
                    ..
                }
            )
        });
        let durability = if durable {
            Durability::Immediate
        } else {
            Durability::None
        };
        txn.set_durability(durability).map_err(|e| self.shared.fault(e))?;
        let mut written = Written {
            durable,
            behind: Vec::with_capacity(behind.len()),
            results: Vec::with_capacity(group.len()),
        };
        for appended in behind {
            let positions = self.append_records(&txn, &appended.topic, &appended.records, pending)?;
            written.behind.push(positions);
        }
        for request in group {
            match self.apply(&txn, &request.op, pending) {
                Err(error @ (LogError::Storage { .. } | LogError::Unavailable(_))) => return Err(error),
                result => written.results.push(result),
            }
        }
        if pending.dirty {
            txn.commit().map_err(|e| self.shared.fault(e))?;
        } else {
            txn.abort().map_err(|e| self.shared.fault(e))?;
        }
        Ok(written)
    }

    /// Writes `records` at the ends of their partitions in `txn`; answers their positions.
    fn append_records(
        &self,
        txn: &WriteTransaction,
        topic: &str,
        records: &[Encoded],
        pending: &mut Pending,
    ) -> Result<Vec<RecordPosition>, LogError> {
        let mirror = self.shared.topic(topic)?;
        for record in records {
            mirror.partition(topic, record.partition)?;
        }
        // Stable, so records of one partition keep their order in the batch.
        let mut order: Vec<usize> = (0..records.len()).collect();
        order.sort_by_key(|&i| records[i].partition);
        let mut positions = vec![
            RecordPosition {
                partition: 0,
                offset: 0
            };
            records.len()
        ];
        let mut metas = txn.open_table(PARTITIONS).map_err(|e| self.shared.fault(e))?;
        for run in order.chunk_by(|&a, &b| records[a].partition == records[b].partition) {
            let partition = records[run[0]].partition;
            let mut meta = pending.meta(topic, &mirror, partition);
            let name = &mirror.partitions[partition as usize].table;
            let mut table = txn
                .open_table(records_table(name))
                .map_err(|e| self.shared.fault(e))?;
            for &i in run {
                table
                    .insert(meta.end, records[i].data.as_slice())
                    .map_err(|e| self.shared.fault(e))?;
                positions[i] = RecordPosition {
                    partition,
                    offset: meta.end,
                };
                meta.end += 1;
                meta.bytes += records[i].size;
            }
            metas
                .insert((topic, partition), (meta.start, meta.end, meta.bytes))
                .map_err(|e| self.shared.fault(e))?;
            pending.partitions.insert((topic.to_string(), partition), meta);
        }
        pending.dirty = true;
        Ok(positions)
    }

    fn apply(&self, txn: &WriteTransaction, op: &Op, pending: &mut Pending) -> Result<Reply, LogError> {
        match op {
            Op::EnsureTopic { topic, partitions } => {
                let existing = match pending.topics.get(topic) {
                    Some(&count) => Some(count),
                    None => self.shared.topic(topic).ok().map(|t| t.partitions.len() as u32),
                };
                if let Some(existing) = existing {
                    if existing != *partitions {
                        return Err(LogError::PartitionCountMismatch {
                            topic: topic.clone(),
                            existing,
                            requested: *partitions,
                        });
                    }
                    return Ok(Reply::Done);
                }
                txn.open_table(TOPICS)
                    .and_then(|mut t| t.insert(topic.as_str(), partitions).map(drop).map_err(Into::into))
                    .map_err(|e| self.shared.fault(e))?;
                let mut table = txn.open_table(PARTITIONS).map_err(|e| self.shared.fault(e))?;
                for p in 0..*partitions {
                    table
                        .insert((topic.as_str(), p), (0, 0, 0))
                        .map_err(|e| self.shared.fault(e))?;
                    pending.partitions.insert((topic.clone(), p), Meta::default());
                }
                pending.topics.insert(topic.clone(), *partitions);
                pending.dirty = true;
                Ok(Reply::Done)
            }
            Op::Append { topic, records, .. } => self
                .append_records(txn, topic, records, pending)
                .map(Reply::Positions),
            Op::Commit {
                group,
                topic,
                partition,
                offset,
            } => {
                self.shared.topic(topic)?.partition(topic, *partition)?;
                txn.open_table(COMMITTED)
                    .and_then(|mut t| {
                        t.insert((group.as_str(), topic.as_str(), *partition), offset)
                            .map(drop)
                            .map_err(Into::into)
                    })
                    .map_err(|e| self.shared.fault(e))?;
                pending
                    .committed
                    .push(((group.clone(), topic.clone(), *partition), *offset));
                pending.dirty = true;
                Ok(Reply::Done)
            }
            Op::Retention {
                topic,
                partition,
                retention,
                keep_from,
                now_ms,
            } => {
                let mirror = self.shared.topic(topic)?;
                let name = &mirror.partition(topic, *partition)?.table;
                let mut meta = pending.meta(topic, &mirror, *partition);
                let limit = (*keep_from).min(meta.end);
                if retention.is_unlimited() || meta.start >= limit {
                    return Ok(Reply::Start(meta.start));
                }
                let oldest_kept = retention
                    .max_age_ms
                    .map(|age| now_ms.saturating_sub(age.min(i64::MAX as u64) as i64));
                let mut table = txn
                    .open_table(records_table(name))
                    .map_err(|e| self.shared.fault(e))?;
                let mut new_start = meta.start;
                let mut bytes = meta.bytes;
                for entry in table.range(meta.start..limit).map_err(|e| self.shared.fault(e))? {
                    let (offset, raw) = entry.map_err(|e| self.shared.fault(e))?;
                    if offset.value() != new_start {
                        return Err(self
                            .shared
                            .storage(format!("record {new_start} of {topic}-{partition} is missing")));
                    }
                    let layout = Layout::parse(raw.value()).map_err(|e| {
                        self.shared
                            .storage(format!("record {new_start} of {topic}-{partition}: {e}"))
                    })?;
                    let too_big = retention.max_bytes.is_some_and(|max| bytes > max);
                    let too_old = oldest_kept.is_some_and(|oldest| layout.timestamp_ms < oldest);
                    if !(too_big || too_old) {
                        break;
                    }
                    bytes = bytes.checked_sub(layout.size()).ok_or_else(|| {
                        self.shared
                            .storage(format!("byte total of {topic}-{partition} is below its records"))
                    })?;
                    new_start += 1;
                }
                if new_start == meta.start {
                    return Ok(Reply::Start(meta.start));
                }
                table
                    .retain_in(meta.start..new_start, |_, _| false)
                    .map_err(|e| self.shared.fault(e))?;
                meta.start = new_start;
                meta.bytes = bytes;
                txn.open_table(PARTITIONS)
                    .and_then(|mut t| {
                        t.insert((topic.as_str(), *partition), (meta.start, meta.end, meta.bytes))
                            .map(drop)
                            .map_err(Into::into)
                    })
                    .map_err(|e| self.shared.fault(e))?;
                pending.partitions.insert((topic.clone(), *partition), meta);
                pending.dirty = true;
                Ok(Reply::Start(new_start))
            }
            Op::Heal => Ok(Reply::Done),
            Op::Flush => {
                // An empty durable commit persists the unflushed ones before it.
                pending.dirty = true;
                Ok(Reply::Done)
            }
            Op::SetLogId { log_id } => {
                txn.open_table(IDENTITY)
                    .and_then(|mut t| {
                        t.insert(LOG_ID_KEY, log_id.as_str())
                            .map(drop)
                            .map_err(Into::into)
                    })
                    .map_err(|e| self.shared.fault(e))?;
                pending.log_id = Some(log_id.clone());
                pending.dirty = true;
                Ok(Reply::Done)
            }
        }
    }

    fn publish(&self, pending: Pending) {
        if !pending.topics.is_empty() {
            let mut topics = self.shared.topics.write().unwrap_or_else(|e| e.into_inner());
            for (name, count) in &pending.topics {
                let metas = vec![Meta::default(); *count as usize];
                topics.insert(name.clone(), Arc::new(TopicMirror::new(name, &metas)));
            }
        }
        for ((topic, partition), meta) in pending.partitions {
            let Ok(mirror) = self.shared.topic(&topic) else {
                continue;
            };
            let p = &mirror.partitions[partition as usize];
            p.start.store(meta.start, Ordering::Release);
            p.bytes.store(meta.bytes, Ordering::Release);
            p.end.store(meta.end, Ordering::Release);
        }
        if !pending.committed.is_empty() {
            let mut committed = self.shared.committed.write().unwrap_or_else(|e| e.into_inner());
            committed.extend(pending.committed);
        }
        if let Some(log_id) = pending.log_id {
            *self.shared.log_id.write().unwrap_or_else(|e| e.into_inner()) = Some(log_id);
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Log for RedbLog {
    fn ensure_topic(&self, topic: &str, partitions: u32) -> Result<(), LogError> {
        if let Ok(existing) = self.shared.topic(topic) {
            let existing = existing.partitions.len() as u32;
            if existing != partitions {
                return Err(LogError::PartitionCountMismatch {
                    topic: topic.to_string(),
                    existing,
                    requested: partitions,
                });
            }
            return Ok(());
        }
        self.submit(Op::EnsureTopic {
            topic: topic.to_string(),
            partitions,
        })
        .map(drop)
    }

    fn partitions(&self, topic: &str) -> Result<u32, LogError> {
        Ok(self.shared.topic(topic)?.partitions.len() as u32)
    }

    fn append(&self, topic: &str, records: Vec<ProducerRecord>) -> Result<Vec<RecordPosition>, LogError> {
        // Encoded, the records are not needed while the write waits for its fsync.
        let Some(op) = self.encode_append(topic, &records, AppendMode::Durable)? else {
            return Ok(Vec::new());
        };
        drop(records);
        self.submit_append(topic, op)
    }

    /// Returns once the records are routed and handed to the writer thread, which writes them
    /// behind the caller (at most `MAX_BEHIND` appends at a time; past that it waits for the
    /// write). A write that fails is retried, in order, before anything else; `flush` fails
    /// until it succeeds.
    fn append_unflushed(&self, topic: &str, records: &[ProducerRecord]) -> Result<(), LogError> {
        let taken = self.shared.behind.fetch_add(1, Ordering::AcqRel) < MAX_BEHIND;
        if !taken {
            self.shared.behind.fetch_sub(1, Ordering::AcqRel);
            return self.append_with(topic, records, AppendMode::Unflushed).map(drop);
        }
        let result = self.append_with(topic, records, AppendMode::Behind).map(drop);
        if result.is_err() {
            // Rejected before it reached the writer (an unknown topic or partition).
            self.shared.behind.fetch_sub(1, Ordering::AcqRel);
        }
        result
    }

    fn flush(&self) -> Result<(), LogError> {
        self.submit(Op::Flush).map(drop)
    }

    fn read(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
        out: &mut Vec<Record>,
    ) -> Result<(), LogError> {
        self.read_records(topic, partition, offset, max, out)
            .map_err(|e| self.reader_fault(e))
    }

    fn end_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError> {
        let mirror = self.shared.topic(topic)?;
        Ok(mirror.partition(topic, partition)?.end.load(Ordering::Acquire))
    }

    fn start_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError> {
        let mirror = self.shared.topic(topic)?;
        Ok(mirror.partition(topic, partition)?.start.load(Ordering::Acquire))
    }

    fn commit(&self, group: &str, topic: &str, partition: u32, offset: u64) -> Result<(), LogError> {
        self.shared.topic(topic)?.partition(topic, partition)?;
        self.submit(Op::Commit {
            group: group.to_string(),
            topic: topic.to_string(),
            partition,
            offset,
        })
        .map(drop)
    }

    fn committed(&self, group: &str, topic: &str, partition: u32) -> Result<Option<u64>, LogError> {
        self.shared.topic(topic)?.partition(topic, partition)?;
        Ok(self
            .shared
            .committed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(group.to_string(), topic.to_string(), partition))
            .copied())
    }

    fn storage_health(&self) -> Option<Arc<StorageHealth>> {
        Some(self.shared.health.clone())
    }

    fn add_append_listener(&self, listener: AppendListener) {
        self.shared
            .listeners
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(listener);
    }

    fn enforce_retention(
        &self,
        topic: &str,
        partition: u32,
        retention: Retention,
        keep_from: u64,
        now_ms: i64,
    ) -> Result<u64, LogError> {
        let mirror = self.shared.topic(topic)?;
        let part = mirror.partition(topic, partition)?;
        // Most calls find nothing to remove; answering them here spares a trip to the writer.
        let start = part.start.load(Ordering::Acquire);
        if retention.is_unlimited() || start >= keep_from.min(part.end.load(Ordering::Acquire)) {
            return Ok(start);
        }
        match self.submit(Op::Retention {
            topic: topic.to_string(),
            partition,
            retention,
            keep_from,
            now_ms,
        })? {
            Reply::Start(start) => Ok(start),
            _ => Err(LogError::Unavailable(
                "unexpected reply from the log writer".into(),
            )),
        }
    }
}

// Record encoding, version 1:
//   u8 version | varint zigzag(timestamp_ms) | varint key tag (0 = no key, n + 1 = n bytes) | key
//   | varint header count | per header: varint name length, name (UTF-8), varint length, value
//   | value (the rest).
// The value runs to the end so it needs no length of its own.
const FORMAT_V1: u8 = 1;

fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push(value as u8 | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

fn encode(record: &ProducerRecord, timestamp_ms: i64) -> Vec<u8> {
    let headers: usize = record.headers.iter().map(|(n, v)| n.len() + v.len() + 20).sum();
    let key = record.key.as_ref().map_or(0, |k| k.len());
    let mut buf = Vec::with_capacity(1 + 10 + 10 + key + 10 + headers + record.value.len());
    buf.push(FORMAT_V1);
    put_varint(&mut buf, ((timestamp_ms << 1) ^ (timestamp_ms >> 63)) as u64);
    match &record.key {
        Some(key) => {
            put_varint(&mut buf, key.len() as u64 + 1);
            buf.extend_from_slice(key);
        }
        None => put_varint(&mut buf, 0),
    }
    put_varint(&mut buf, record.headers.len() as u64);
    for (name, value) in &record.headers {
        put_varint(&mut buf, name.len() as u64);
        buf.extend_from_slice(name.as_bytes());
        put_varint(&mut buf, value.len() as u64);
        buf.extend_from_slice(value);
    }
    buf.extend_from_slice(&record.value);
    buf
}

/// Where the parts of an encoded record lie, checked but not copied.
struct Layout {
    timestamp_ms: i64,
    key: Option<Range<usize>>,
    headers: Vec<(Range<usize>, Range<usize>)>,
    value: Range<usize>,
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&byte) = self.data.get(self.pos) else {
                return Err("truncated".into());
            };
            self.pos += 1;
            if shift == 63 && byte > 1 {
                return Err("varint overflows 64 bits".into());
            }
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint overflows 64 bits".into())
    }

    fn span(&mut self, len: u64) -> Result<Range<usize>, String> {
        let left = (self.data.len() - self.pos) as u64;
        if len > left {
            return Err(format!("truncated: {len} bytes announced, {left} left"));
        }
        let range = self.pos..self.pos + len as usize;
        self.pos = range.end;
        Ok(range)
    }
}

impl Layout {
    fn parse(data: &[u8]) -> Result<Layout, String> {
        match data.first() {
            Some(&FORMAT_V1) => {}
            Some(version) => return Err(format!("unknown record format version {version}")),
            None => return Err("empty record".into()),
        }
        let mut reader = Reader { data, pos: 1 };
        let zigzag = reader.varint()?;
        let timestamp_ms = (zigzag >> 1) as i64 ^ -((zigzag & 1) as i64);
        let key = match reader.varint()? {
            0 => None,
            tag => Some(reader.span(tag - 1)?),
        };
        let count = reader.varint()?;
        // Each header takes at least two bytes, which bounds the allocation a bad count asks for.
        if count > (data.len() - reader.pos) as u64 / 2 {
            return Err(format!("{count} headers cannot fit in the record"));
        }
        let mut headers = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let len = reader.varint()?;
            let name = reader.span(len)?;
            if std::str::from_utf8(&data[name.clone()]).is_err() {
                return Err("a header name is not UTF-8".into());
            }
            let len = reader.varint()?;
            headers.push((name, reader.span(len)?));
        }
        Ok(Layout {
            timestamp_ms,
            key,
            headers,
            value: reader.pos..data.len(),
        })
    }

    /// `record_size` of the record, from the lengths alone.
    fn size(&self) -> u64 {
        16 + self.key.as_ref().map_or(0, |k| k.len() as u64)
            + self.value.len() as u64
            + self
                .headers
                .iter()
                .map(|(name, value)| (name.len() + value.len()) as u64)
                .sum::<u64>()
    }
}

fn decode(data: &[u8], partition: u32, offset: u64) -> Result<Record, String> {
    let layout = Layout::parse(data)?;
    // One copy of the whole encoding per record; key, value and header values share it.
    let buf = Bytes::copy_from_slice(data);
    let headers = layout
        .headers
        .into_iter()
        .map(|(name, value)| {
            let name = String::from_utf8_lossy(&data[name]).into_owned();
            (name, buf.slice(value))
        })
        .collect();
    Ok(Record {
        partition,
        offset,
        timestamp_ms: layout.timestamp_ms,
        key: layout.key.map(|k| buf.slice(k)),
        value: buf.slice(layout.value),
        headers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;

    /// A fresh directory under the system temp dir, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let dir = std::env::temp_dir().join(format!(
                "taskstream-redblog-{name}-{}-{}-{nanos}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn value(i: usize) -> ProducerRecord {
        ProducerRecord {
            value: format!("{i}").into(),
            ..Default::default()
        }
    }

    fn read_all(log: &RedbLog, topic: &str, partition: u32) -> Vec<Record> {
        let mut out = Vec::new();
        let start = log.start_offset(topic, partition).unwrap();
        log.read(topic, partition, start, usize::MAX, &mut out).unwrap();
        out
    }

    #[test]
    fn keyed_records_follow_kafkas_partitioner_and_offsets_grow_per_partition() {
        let dir = TempDir::new("keyed");
        super::super::contract::keyed_records_follow_kafkas_partitioner(
            RedbLog::open(&dir.0).unwrap().as_ref(),
        );
    }

    #[test]
    fn unkeyed_records_are_spread_and_bad_partitions_reject_the_whole_batch() {
        let dir = TempDir::new("unkeyed");
        let log = RedbLog::open(&dir.0).unwrap();
        super::super::contract::unkeyed_records_are_spread_and_bad_batches_rejected_whole(log.as_ref());
        log.ensure_topic("empty", 0).unwrap();
        assert!(matches!(
            log.append("empty", vec![value(1)]),
            Err(LogError::UnknownPartition { partitions: 0, .. })
        ));
    }

    #[test]
    fn retention_removes_oldest_records_but_never_from_keep_from_on_and_survives_reopen() {
        let dir = TempDir::new("retention");
        let log = RedbLog::open(&dir.0).unwrap();
        log.ensure_topic("t", 1).unwrap();
        let records = (0..10)
            .map(|i| ProducerRecord {
                value: vec![b'x'; 84].into(),
                partition: Some(0),
                timestamp_ms: Some(1_000 + i),
                ..Default::default()
            })
            .collect();
        log.append("t", records).unwrap();
        let unlimited = Retention::default();
        assert_eq!(
            log.enforce_retention("t", 0, unlimited, 100, i64::MAX).unwrap(),
            0
        );
        // Each record counts 100 bytes: keep 300 bytes, but offset 5 on is still needed.
        let by_size = Retention {
            max_bytes: Some(300),
            max_age_ms: None,
        };
        assert_eq!(log.enforce_retention("t", 0, by_size, 5, 0).unwrap(), 5);
        assert_eq!(log.enforce_retention("t", 0, by_size, 100, 0).unwrap(), 7);
        let mut out = Vec::new();
        assert!(matches!(
            log.read("t", 0, 6, 10, &mut out),
            Err(LogError::OffsetOutOfRange {
                requested: 6,
                earliest: 7,
                ..
            })
        ));
        assert_eq!(read_all(&log, "t", 0).len(), 3);
        // By age: at now = 1_009 with 1 ms, timestamps below 1_008 go.
        let by_age = Retention {
            max_bytes: None,
            max_age_ms: Some(1),
        };
        assert_eq!(log.enforce_retention("t", 0, by_age, 100, 1_009).unwrap(), 8);
        assert_eq!(log.end_offset("t", 0).unwrap(), 10);
        drop(log);

        let log = RedbLog::open(&dir.0).unwrap();
        assert_eq!(log.start_offset("t", 0).unwrap(), 8);
        assert_eq!(log.end_offset("t", 0).unwrap(), 10);
        let kept = read_all(&log, "t", 0);
        assert_eq!(kept.iter().map(|r| r.offset).collect::<Vec<_>>(), vec![8, 9]);
        assert!(matches!(
            log.read("t", 0, 0, 10, &mut out),
            Err(LogError::OffsetOutOfRange { earliest: 8, .. })
        ));
        // The byte total came back too: 200 bytes, so a 100-byte limit removes one more.
        let small = Retention {
            max_bytes: Some(100),
            max_age_ms: None,
        };
        assert_eq!(log.enforce_retention("t", 0, small, 100, 0).unwrap(), 9);
        // Everything can go; the end stays and appends carry on from it.
        let all = Retention {
            max_bytes: Some(0),
            max_age_ms: None,
        };
        assert_eq!(log.enforce_retention("t", 0, all, 100, 0).unwrap(), 10);
        assert!(read_all(&log, "t", 0).is_empty());
        drop(log);
        let log = RedbLog::open(&dir.0).unwrap();
        assert_eq!(log.start_offset("t", 0).unwrap(), 10);
        let positions = log.append("t", vec![value(10)]).unwrap();
        assert_eq!(positions[0].offset, 10);
        assert_eq!(read_all(&log, "t", 0)[0].value, "10");
    }

    #[test]
    fn commits_are_per_group_and_partition_and_survive_reopen() {
        let dir = TempDir::new("commits");
        let log = RedbLog::open(&dir.0).unwrap();
        super::super::contract::commits_are_per_group_and_partition(log.as_ref());
        drop(log);
        let log = RedbLog::open(&dir.0).unwrap();
        assert_eq!(log.committed("g", "t", 0).unwrap(), Some(42));
        assert_eq!(log.committed("g", "t", 1).unwrap(), Some(8));
        assert_eq!(log.committed("h", "t", 1).unwrap(), None);
        assert_eq!(log.partitions("t").unwrap(), 2);
        log.ensure_topic("t", 2).unwrap();
        assert!(log.ensure_topic("t", 1).is_err());
    }

    #[test]
    fn reopen_keeps_topics_records_and_offsets() {
        let dir = TempDir::new("reopen");
        let log = RedbLog::open(&dir.0).unwrap();
        log.ensure_topic("a", 3).unwrap();
        log.ensure_topic("b/with slash", 1).unwrap();
        let keyed: Vec<_> = (0..30)
            .map(|i| ProducerRecord::keyed(format!("k{i}"), format!("v{i}")))
            .collect();
        let positions = log.append("a", keyed).unwrap();
        log.append("b/with slash", vec![value(1), value(2)]).unwrap();
        let before: Vec<Vec<Record>> = (0..3).map(|p| read_all(&log, "a", p)).collect();
        drop(log);

        let log = RedbLog::open(&dir.0).unwrap();
        assert_eq!(log.partitions("a").unwrap(), 3);
        assert_eq!(log.partitions("b/with slash").unwrap(), 1);
        for p in 0..3 {
            assert_eq!(read_all(&log, "a", p), before[p as usize]);
            assert_eq!(log.end_offset("a", p).unwrap(), before[p as usize].len() as u64);
        }
        for (i, pos) in positions.iter().enumerate() {
            let mut out = Vec::new();
            log.read("a", pos.partition, pos.offset, 1, &mut out).unwrap();
            assert_eq!(out[0].key.as_deref(), Some(format!("k{i}").as_bytes()));
        }
        assert_eq!(log.end_offset("b/with slash", 0).unwrap(), 2);
        // Offsets carry on where they stopped.
        let next = log.append("b/with slash", vec![value(3)]).unwrap();
        assert_eq!(next[0].offset, 2);
    }

    #[test]
    fn a_record_with_headers_and_no_key_round_trips_exactly() {
        let dir = TempDir::new("roundtrip");
        let log = RedbLog::open(&dir.0).unwrap();
        log.ensure_topic("t", 1).unwrap();
        let with_headers = ProducerRecord {
            key: None,
            value: Bytes::from_static(b"\x00payload\xff"),
            partition: Some(0),
            timestamp_ms: Some(-5),
            headers: vec![
                ("error".to_string(), Bytes::from_static(b"boom")),
                ("empty".to_string(), Bytes::new()),
                ("ünïcode".to_string(), Bytes::from_static(b"\x80\x81")),
                ("error".to_string(), Bytes::from_static(b"again")),
            ],
        };
        let keyed_empty = ProducerRecord {
            key: Some(Bytes::new()),
            value: Bytes::new(),
            partition: Some(0),
            timestamp_ms: Some(i64::MAX),
            headers: vec![],
        };
        log.append("t", vec![with_headers.clone(), keyed_empty.clone()])
            .unwrap();
        drop(log);
        let log = RedbLog::open(&dir.0).unwrap();
        let out = read_all(&log, "t", 0);
        let expect = |r: &ProducerRecord, offset| Record {
            partition: 0,
            offset,
            timestamp_ms: r.timestamp_ms.unwrap(),
            key: r.key.clone(),
            value: r.value.clone(),
            headers: r.headers.clone(),
        };
        assert_eq!(out, vec![expect(&with_headers, 0), expect(&keyed_empty, 1)]);
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64;
        log.append("t", vec![value(1)]).unwrap();
        let mut out = Vec::new();
        log.read("t", 0, 2, 1, &mut out).unwrap();
        assert!(out[0].timestamp_ms >= before, "no timestamp means append time");
    }

    #[test]
    fn encoding_sizes_match_record_size_and_damaged_records_are_errors() {
        let record = ProducerRecord {
            key: Some(Bytes::from_static(b"key")),
            value: Bytes::from(vec![7u8; 300]),
            partition: None,
            timestamp_ms: None,
            headers: vec![("h".into(), Bytes::from_static(b"vv"))],
        };
        let data = encode(&record, 1_700_000_000_000);
        let layout = Layout::parse(&data).unwrap();
        assert_eq!(
            layout.size(),
            record_size(record.key.as_deref(), &record.value, &record.headers)
        );
        let decoded = decode(&data, 3, 9).unwrap();
        assert_eq!(decoded.timestamp_ms, 1_700_000_000_000);
        assert_eq!(decoded.headers, record.headers);
        // Every strict prefix that cuts into the fields before the value fails to parse.
        let value_start = layout.value.start;
        for cut in 0..value_start {
            assert!(decode(&data[..cut], 0, 0).is_err(), "prefix of {cut} bytes");
        }
        assert!(decode(&[2, 0, 0, 0], 0, 0).unwrap_err().contains("version 2"));
        assert!(
            decode(
                &[1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
                0,
                0
            )
            .is_err()
        );
        assert!(
            decode(&[1, 0, 0, 0xff, 0xff, 0xff, 0x0f], 0, 0).is_err(),
            "absurd header count"
        );
        assert!(
            decode(&[1, 0, 0, 1, 1, 0xff, 0], 0, 0).is_err(),
            "header name not UTF-8"
        );
    }

    #[test]
    fn concurrent_appenders_get_contiguous_unique_offsets_and_all_data_survives() {
        const THREADS: usize = 8;
        const BATCHES: usize = 200;
        const PER_BATCH: usize = 5;
        let dir = TempDir::new("concurrent");
        let log = RedbLog::open(&dir.0).unwrap();
        log.ensure_topic("t", 3).unwrap();
        let notified = Arc::new(AtomicUsize::new(0));
        let counter = notified.clone();
        log.add_append_listener(Arc::new(move |topic, _| {
            assert_eq!(topic, "t");
            counter.fetch_add(1, Ordering::Relaxed);
        }));
        let landed = Arc::new(Mutex::new(HashMap::new()));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let log = log.clone();
                let landed = landed.clone();
                std::thread::spawn(move || {
                    for b in 0..BATCHES {
                        let batch = (0..PER_BATCH)
                            .map(|i| ProducerRecord::keyed(format!("{t}-{b}-{i}"), format!("{t}-{b}-{i}")))
                            .collect();
                        let positions = log.append("t", batch).unwrap();
                        // A batch is applied whole, so its records of one partition are adjacent.
                        for p in 0..3 {
                            let offsets: Vec<u64> = positions
                                .iter()
                                .filter(|pos| pos.partition == p)
                                .map(|pos| pos.offset)
                                .collect();
                            assert!(offsets.windows(2).all(|w| w[1] == w[0] + 1), "{offsets:?}");
                        }
                        let mut landed = landed.lock().unwrap();
                        for (i, pos) in positions.into_iter().enumerate() {
                            let previous = landed.insert((pos.partition, pos.offset), format!("{t}-{b}-{i}"));
                            assert_eq!(previous, None, "offset given twice: {pos:?}");
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert!(notified.load(Ordering::Relaxed) >= THREADS * BATCHES);
        let landed = Arc::into_inner(landed).unwrap().into_inner().unwrap();
        assert_eq!(landed.len(), THREADS * BATCHES * PER_BATCH);
        drop(log);

        let log = RedbLog::open(&dir.0).unwrap();
        let mut total = 0;
        for p in 0..3 {
            let records = read_all(&log, "t", p);
            assert_eq!(log.end_offset("t", p).unwrap(), records.len() as u64);
            for (i, record) in records.iter().enumerate() {
                assert_eq!(record.offset, i as u64, "offsets are contiguous from 0");
                let expected = &landed[&(p, record.offset)];
                assert_eq!(record.value, expected.as_bytes());
                assert_eq!(record.key.as_deref(), Some(expected.as_bytes()));
            }
            total += records.len();
        }
        assert_eq!(total, THREADS * BATCHES * PER_BATCH);
    }

    /// Each telling of a listener: topic, partition, and the partition's end read then.
    type Heard = Arc<Mutex<Vec<(String, u32, Option<u64>)>>>;

    /// What the log's listeners are told from now on.
    fn hear_ends(log: &Arc<RedbLog>) -> Heard {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let weak = Arc::downgrade(log);
        let sink = heard.clone();
        log.add_append_listener(Arc::new(move |topic, partition| {
            let end = weak
                .upgrade()
                .map(|log| log.end_offset(topic, partition).unwrap());
            sink.lock().unwrap().push((topic.to_string(), partition, end));
        }));
        heard
    }

    #[test]
    fn listeners_hear_each_touched_partition_after_the_records_are_readable() {
        let dir = TempDir::new("listeners");
        let log = RedbLog::open(&dir.0).unwrap();
        log.ensure_topic("t", 2).unwrap();
        let heard = hear_ends(&log);
        let to = |partition| ProducerRecord {
            partition: Some(partition),
            ..Default::default()
        };
        log.append("t", vec![to(1), to(0), to(1)]).unwrap();
        let heard = heard.lock().unwrap().clone();
        assert_eq!(
            heard,
            vec![("t".to_string(), 0, Some(1)), ("t".to_string(), 1, Some(2))]
        );
    }

    #[test]
    fn a_file_that_is_not_a_redb_database_is_a_storage_error_naming_it() {
        let dir = TempDir::new("garbage");
        std::fs::create_dir_all(&dir.0).unwrap();
        let file = dir.0.join("log.redb");
        let garbage: Vec<u8> = (0..10_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&file, &garbage).unwrap();
        match RedbLog::open(&dir.0) {
            Err(LogError::Storage { path, message }) => {
                assert_eq!(path, file.display().to_string(), "{message}");
            }
            Err(other) => panic!("expected a storage error, got {other}"),
            Ok(_) => panic!("a garbage file was accepted"),
        }
        assert_eq!(
            std::fs::read(&file).unwrap(),
            garbage,
            "the file was left as it was"
        );
    }

    #[test]
    fn a_damaged_log_file_is_a_storage_error_not_a_reset() {
        let dir = TempDir::new("damaged");
        let log = RedbLog::open(&dir.0).unwrap();
        log.ensure_topic("t", 1).unwrap();
        for _ in 0..20 {
            let batch = (0..100)
                .map(|i| ProducerRecord {
                    value: vec![i as u8; 200].into(),
                    partition: Some(0),
                    ..Default::default()
                })
                .collect();
            log.append("t", batch).unwrap();
        }
        drop(log);
        let file = dir.0.join("log.redb");
        let mut bytes = std::fs::read(&file).unwrap();
        // Past the header, over the pages that hold records.
        let len = bytes.len();
        for b in &mut bytes[len / 4..len / 2] {
            *b ^= 0x5a;
        }
        std::fs::write(&file, &bytes).unwrap();
        match RedbLog::open(&dir.0) {
            Err(LogError::Storage { path, .. }) => assert_eq!(path, file.display().to_string()),
            Err(other) => panic!("expected a storage error, got {other}"),
            Ok(log) => {
                // If the damage missed every live page the data must still be whole.
                assert_eq!(read_all(&log, "t", 0).len(), 2_000);
            }
        }
    }

    #[test]
    fn a_new_log_draws_an_id_that_it_keeps_and_that_a_peek_reads_without_writing() {
        let dir = TempDir::new("identity");
        assert_eq!(
            RedbLog::peek_log_id(&dir.0).unwrap(),
            Peeked::Unknown,
            "no file yet"
        );
        let log = RedbLog::open(&dir.0).unwrap();
        let id = log.log_id().expect("a new log has an id");
        assert!(crate::datadir::LogId::parse(&id).is_some(), "{id}");
        log.ensure_topic("t", 1).unwrap();
        log.append("t", vec![value(1)]).unwrap();
        assert!(
            log.set_log_id(&id).is_ok(),
            "setting the same id again is a no-op"
        );
        assert!(matches!(
            log.set_log_id("0123456789abcdef0123456789abcdef"),
            Err(LogError::Storage { .. })
        ));
        drop(log);
        let file = dir.0.join(FILE_NAME);
        let before = std::fs::read(&file).unwrap();
        assert_eq!(RedbLog::peek_log_id(&dir.0).unwrap(), Peeked::LogId(id.clone()));
        assert_eq!(std::fs::read(&file).unwrap(), before, "a peek writes nothing");
        assert_eq!(RedbLog::open(&dir.0).unwrap().log_id(), Some(id));
        assert!(!dir.0.join("log.redb.partial").exists());
        // Another log, another id.
        let other = TempDir::new("identity-other");
        assert_ne!(
            RedbLog::open(&other.0).unwrap().log_id(),
            RedbLog::open(&dir.0).unwrap().log_id()
        );
    }

    #[test]
    fn a_log_from_before_ids_has_none_until_one_is_set() {
        let dir = TempDir::new("legacy");
        std::fs::create_dir_all(&dir.0).unwrap();
        // As the log was written before ids: records, no identity table.
        {
            let db = Database::create(dir.0.join(FILE_NAME)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(TOPICS).unwrap().insert("t", 1).unwrap();
            txn.open_table(PARTITIONS)
                .unwrap()
                .insert(("t", 0), (0, 0, 0))
                .unwrap();
            txn.commit().unwrap();
        }
        assert_eq!(RedbLog::peek_log_id(&dir.0).unwrap(), Peeked::NoLogId);
        let log = RedbLog::open(&dir.0).unwrap();
        assert_eq!(log.log_id(), None);
        log.append("t", vec![value(1)]).unwrap();
        log.set_log_id("0123456789abcdef0123456789abcdef").unwrap();
        drop(log);
        let log = RedbLog::open(&dir.0).unwrap();
        assert_eq!(log.log_id().as_deref(), Some("0123456789abcdef0123456789abcdef"));
        assert_eq!(read_all(&log, "t", 0).len(), 1);
    }

    #[test]
    fn an_empty_log_file_is_refused_and_left_empty() {
        let dir = TempDir::new("empty");
        std::fs::create_dir_all(&dir.0).unwrap();
        let file = dir.0.join(FILE_NAME);
        std::fs::write(&file, b"").unwrap();
        match RedbLog::open(&dir.0) {
            Err(LogError::Storage { path, message }) => {
                assert_eq!(path, file.display().to_string());
                assert!(message.contains("empty"), "{message}");
            }
            Err(other) => panic!("expected a storage error, got {other}"),
            Ok(_) => panic!("an empty log file was accepted"),
        }
        assert_eq!(RedbLog::peek_log_id(&dir.0).unwrap(), Peeked::Unknown);
        assert_eq!(std::fs::metadata(&file).unwrap().len(), 0);
    }

    #[test]
    fn a_log_open_twice_is_refused_and_reopens_once_dropped() {
        let dir = TempDir::new("twice");
        let log = RedbLog::open(&dir.0).unwrap();
        assert!(matches!(RedbLog::open(&dir.0), Err(LogError::Storage { .. })));
        drop(log);
        // The writer thread has stopped and released the file.
        let log = RedbLog::open(&dir.0).unwrap();
        log.ensure_topic("t", 1).unwrap();
    }

    /// A `RedbLog` in `dir` whose file sits on a disk that can be filled, and its switch.
    fn log_on_fullable_disk(dir: &Path) -> (Arc<RedbLog>, Arc<std::sync::atomic::AtomicBool>) {
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join(FILE_NAME);
        let full = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = crate::fault_injection::opener(&path, &full);
        let db = open().unwrap();
        let log = RedbLog::start(
            path.display().to_string(),
            db,
            Box::new(open),
            StorageHealth::new(),
        )
        .unwrap();
        (log, full)
    }

    /// Polls `done` until it holds, for at most 10 s.
    fn eventually(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(
                std::time::Instant::now() < deadline,
                "{what} did not happen within 10 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_full_disk_fails_appends_as_unavailable_and_the_log_heals_without_a_reopen_by_its_owner() {
        let dir = TempDir::new("enospc");
        let (log, full) = log_on_fullable_disk(&dir.0);
        let health = log.storage_health().unwrap();
        log.ensure_topic("t", 2).unwrap();
        let batch = |n: usize, tag: &str| -> Vec<ProducerRecord> {
            (0..n)
                .map(|i| ProducerRecord {
                    value: format!("{tag}-{i}-{}", "x".repeat(1000)).into(),
                    partition: Some((i % 2) as u32),
                    ..Default::default()
                })
                .collect()
        };
        let mut acked = Vec::new();
        log.append("t", batch(100, "before")).unwrap();
        acked.extend((0..100).map(|i| format!("before-{i}")));

        full.store(true, Ordering::Release);
        // The file has some room inside; appends fail once it must grow.
        let mut failures = 0;
        for round in 0..1000 {
            let tag = format!("full{round}");
            match log.append("t", batch(50, &tag)) {
                Ok(_) => acked.extend((0..50).map(|i| format!("{tag}-{i}"))),
                Err(LogError::Unavailable(message)) => {
                    assert!(message.contains("No space left on device"), "{message}");
                    failures += 1;
                    if failures == 3 {
                        break;
                    }
                }
                Err(other) => panic!("a full disk must be retryable, got {other}"),
            }
        }
        assert_eq!(failures, 3, "the disk never filled up");
        // The writer answers before it records the failure and reopens the file.
        eventually("the failure on record", || {
            health.is_failing(StorageComponent::Log)
        });
        // Reads go on once the file is reopened: a full disk still reads.
        eventually("reading during the outage", || {
            let mut out = Vec::new();
            log.read("t", 0, 0, 10, &mut out).is_ok() && out.len() == 10
        });

        full.store(false, Ordering::Release);
        // Nobody writes: the log's own probe finds the room and recovers.
        eventually("recovery", || !health.is_failing(StorageComponent::Log));
        log.append("t", batch(100, "after")).unwrap();
        acked.extend((0..100).map(|i| format!("after-{i}")));

        let mut stored = Vec::new();
        for partition in 0..2 {
            let records = read_all(&log, "t", partition);
            for (i, record) in records.iter().enumerate() {
                assert_eq!(record.offset, i as u64, "offsets stay contiguous");
            }
            stored.extend(records.into_iter().map(|r| {
                let value = String::from_utf8(r.value.to_vec()).unwrap();
                value.split('-').take(2).collect::<Vec<_>>().join("-")
            }));
        }
        stored.sort();
        acked.sort();
        assert_eq!(stored, acked, "every acknowledged record, and only those");
        drop(log);
        let reopened = RedbLog::open(&dir.0).unwrap();
        assert_eq!(
            (0..2).map(|p| read_all(&reopened, "t", p).len()).sum::<usize>(),
            acked.len()
        );
    }

    #[test]
    fn appends_behind_their_callers_are_heard_once_readable_and_each_partition_at_its_end() {
        let dir = TempDir::new("behind-listeners");
        let log = RedbLog::open(&dir.0).unwrap();
        log.ensure_topic("t", 2).unwrap();
        let heard = hear_ends(&log);
        const APPENDS: u64 = 300;
        for i in 0..APPENDS {
            let record = ProducerRecord {
                partition: Some((i % 2) as u32),
                value: format!("v{i}").into(),
                ..Default::default()
            };
            log.append_unflushed("t", &[record]).unwrap();
        }
        log.flush().unwrap();
        let heard = heard.lock().unwrap().clone();
        for p in 0..2 {
            let ends: Vec<u64> = heard
                .iter()
                .filter(|(_, q, _)| *q == p)
                .filter_map(|(_, _, e)| *e)
                .collect();
            // Each telling comes after what it tells of is readable, and the last one tells the end.
            assert!(
                !ends.is_empty() && ends.iter().all(|&e| e > 0),
                "partition {p}: {ends:?}"
            );
            assert!(ends.windows(2).all(|w| w[0] <= w[1]), "partition {p}: {ends:?}");
            assert_eq!(ends.last().copied(), Some(APPENDS / 2), "partition {p}: {ends:?}");
            let values: Vec<String> = read_all(&log, "t", p)
                .iter()
                .map(|r| String::from_utf8_lossy(&r.value).into_owned())
                .collect();
            let expected: Vec<String> = (0..APPENDS)
                .filter(|i| i % 2 == u64::from(p))
                .map(|i| format!("v{i}"))
                .collect();
            assert_eq!(values, expected, "partition {p}: in the order appended");
        }
        assert!(heard.len() <= APPENDS as usize, "at most one telling per append");
    }

    /// `append_unflushed` returns before the write; on a full disk its records wait in the
    /// writer and `flush` fails until they are in the file, in order, each once, including
    /// those a reopen of the file lost after they were written without an fsync.
    #[test]
    fn unflushed_appends_land_in_order_and_a_flush_fails_until_they_have() {
        let dir = TempDir::new("behind");
        let (log, full) = log_on_fullable_disk(&dir.0);
        let health = log.storage_health().unwrap();
        log.ensure_topic("t", 2).unwrap();
        let record = |tag: &str, i: usize| ProducerRecord {
            value: format!("{tag}-{i}-{}", "x".repeat(1000)).into(),
            partition: Some((i % 2) as u32),
            ..Default::default()
        };
        let mut expected = Vec::new();
        let mut append = |tag: String, n: usize| {
            let records: Vec<_> = (0..n).map(|i| record(&tag, i)).collect();
            log.append_unflushed("t", &records).unwrap();
            expected.extend((0..n).map(|i| ((i % 2) as u32, format!("{tag}-{i}"))));
        };
        for round in 0..20 {
            append(format!("before{round}"), 10);
        }
        full.store(true, Ordering::Release);
        // Unflushed appends never fail while the writer has room for them behind: the disk
        // fills up under them, and a flush says so.
        for round in 0..200 {
            append(format!("full{round}"), 10);
        }
        eventually("the failure on record", || {
            health.is_failing(StorageComponent::Log)
        });
        assert!(
            log.flush().is_err(),
            "a flush with records still behind must fail"
        );

        full.store(false, Ordering::Release);
        eventually("the records behind written and flushed", || log.flush().is_ok());
        for round in 0..20 {
            append(format!("after{round}"), 10);
        }
        log.flush().unwrap();
        let check = |log: &RedbLog| {
            for partition in 0..2 {
                let stored: Vec<String> = read_all(log, "t", partition)
                    .iter()
                    .map(|r| {
                        let value = String::from_utf8(r.value.to_vec()).unwrap();
                        value.split('-').take(2).collect::<Vec<_>>().join("-")
                    })
                    .collect();
                let wanted: Vec<String> = expected
                    .iter()
                    .filter(|(p, _)| *p == partition)
                    .map(|(_, v)| v.clone())
                    .collect();
                assert_eq!(
                    stored, wanted,
                    "partition {partition}: every record once, in order"
                );
            }
        };
        check(&log);
        drop(log);
        check(&RedbLog::open(&dir.0).unwrap());
    }

    const CRASH_DIR_ENV: &str = "TASKSTREAM_REDBLOG_CRASH_DIR";
    const CRASH_BATCH: usize = 10;

    /// The child half of `acknowledged_appends_survive_sigkill`: appends until killed and
    /// reports every acknowledged batch on stdout. Does nothing when run on its own.
    #[test]
    #[ignore]
    fn crash_child_appends_until_killed() {
        use std::io::Write;
        let Some(dir) = std::env::var_os(CRASH_DIR_ENV) else {
            return;
        };
        let log = RedbLog::open(Path::new(&dir)).unwrap();
        log.ensure_topic("t", 2).unwrap();
        let mut stdout = std::io::stdout();
        // Bounded, so an orphaned child cannot run forever.
        for b in 0..100_000usize {
            let partition = (b % 2) as u32;
            let batch = (0..CRASH_BATCH)
                .map(|i| ProducerRecord {
                    value: format!("{b}-{i}").into(),
                    partition: Some(partition),
                    ..Default::default()
                })
                .collect();
            let positions = log.append("t", batch).unwrap();
            writeln!(stdout, "acked {b} {partition} {}", positions[0].offset).unwrap();
            stdout.flush().unwrap();
        }
    }

    #[test]
    fn acknowledged_appends_survive_sigkill() {
        use std::io::BufRead;
        let dir = TempDir::new("sigkill");
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "log::durable::tests::crash_child_appends_until_killed",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_DIR_ENV, &dir.0)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut acked = Vec::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.unwrap();
            let Some(rest) = line.strip_prefix("acked ") else {
                continue;
            };
            let fields: Vec<u64> = rest.split(' ').map(|f| f.parse().unwrap()).collect();
            acked.push((fields[0], fields[1] as u32, fields[2]));
            if acked.len() == 200 {
                // Child::kill sends SIGKILL on Unix: no destructor, no flush, no clean close.
                child.kill().unwrap();
                break;
            }
        }
        child.wait().unwrap();
        assert_eq!(acked.len(), 200, "the child stopped before it was killed");

        let log = RedbLog::open(&dir.0).unwrap();
        for &(batch, partition, first) in &acked {
            let mut out = Vec::new();
            log.read("t", partition, first, CRASH_BATCH, &mut out).unwrap();
            let values: Vec<String> = out
                .iter()
                .map(|r| String::from_utf8(r.value.to_vec()).unwrap())
                .collect();
            let expected: Vec<String> = (0..CRASH_BATCH).map(|i| format!("{batch}-{i}")).collect();
            assert_eq!(values, expected, "acknowledged batch {batch} is intact");
        }
        // Whatever was in flight at the kill landed whole or not at all.
        for partition in 0..2 {
            let end = log.end_offset("t", partition).unwrap();
            assert_eq!(
                end % CRASH_BATCH as u64,
                0,
                "partition {partition} ends mid-batch at {end}"
            );
            assert_eq!(read_all(&log, "t", partition).len() as u64, end);
        }
    }

    /// Rough append throughput; prints numbers, asserts nothing about time. Run with
    /// `cargo test --release -p taskstream-server --lib durable -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn measure_append_throughput() {
        const BATCH: usize = 1000;
        for appenders in [1usize, 4] {
            let dir = TempDir::new("measure");
            let log = RedbLog::open(&dir.0).unwrap();
            log.ensure_topic("t", 4).unwrap();
            let batches_each = 200 / appenders;
            let started = std::time::Instant::now();
            let threads: Vec<_> = (0..appenders)
                .map(|t| {
                    let log = log.clone();
                    std::thread::spawn(move || {
                        for b in 0..batches_each {
                            let batch = (0..BATCH)
                                .map(|i| {
                                    ProducerRecord::keyed(format!("key-{t}-{i}"), format!("value-{b}-{i}"))
                                })
                                .collect();
                            log.append("t", batch).unwrap();
                        }
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap();
            }
            let elapsed = started.elapsed();
            let records = appenders * batches_each * BATCH;
            println!(
                "{appenders} appender(s), batches of {BATCH}: {records} records in {elapsed:?} = {:.0} records/s",
                records as f64 / elapsed.as_secs_f64()
            );
            let started = std::time::Instant::now();
            let mut read = 0;
            for p in 0..4 {
                let mut offset = 0;
                loop {
                    let mut out = Vec::new();
                    log.read("t", p, offset, 10_000, &mut out).unwrap();
                    if out.is_empty() {
                        break;
                    }
                    offset += out.len() as u64;
                    read += out.len();
                }
            }
            let elapsed = started.elapsed();
            println!(
                "  read back {read} records in {elapsed:?} = {:.0} records/s",
                read as f64 / elapsed.as_secs_f64()
            );
        }
    }
}
