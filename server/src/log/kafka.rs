//! `KafkaLog`: the `Log` trait on Apache Kafka through rdkafka (bundled
//! librdkafka). It owns one producer, one reader consumer (manual assignment,
//! one queue per partition), a consumer that only asks (metadata and
//! watermarks), an admin client, one committing consumer per group it is not
//! a member of, and, once it joins the application's consumer group
//! (`join_group`, see `kafka_group`), the group's consumer; each call of the
//! trait is a blocking call on them.
//!
//! How it maps the trait:
//! - `ensure_topic` creates a missing topic through the admin client, with
//!   `replication_factor` (-1: the broker's default); a name ending in
//!   `-changelog` or `-metadata` is created compacted. An existing topic must
//!   have the partitions asked for.
//! - `append` enqueues every record of a batch, then waits for their delivery
//!   reports, which carry the offsets. The producer is idempotent (no duplicate
//!   or reordered records on retries) and uses `partitioner = murmur2_random`,
//!   which places keyed records exactly as Kafka's Java client does. Unkeyed
//!   records without a partition are spread round-robin, as in the embedded
//!   log. A batch is checked before anything is sent (unknown topic or
//!   partition: nothing is written), but Kafka does not write a batch
//!   atomically: if delivery fails midway, the records already delivered stay.
//! - `read` draws from the partition's own queue, which librdkafka keeps
//!   prefetched: the group consumer's for a partition the group assigned
//!   here (split off before the assignment, so no record of it reaches the
//!   main queue; a read waits while the assignment is under way), else the
//!   reader consumer's, assigned on first read. The queue remembers its
//!   position, so sequential reads never seek; a read elsewhere seeks once.
//!   When the queue is empty but the end offset says records exist, the read
//!   waits for them (up to `FETCH_WAIT`); at the end it answers nothing at once.
//! - `end_offset` is the high watermark: librdkafka's cached value (updated by
//!   every fetch response, so fresh within a fetch round trip) for partitions
//!   being read, else a cached answer of the broker refreshed in the
//!   background while it is asked for (metadata asks for every partition,
//!   under the runtime's locks); never below what this log itself appended.
//!   `start_offset` asks the broker for partitions being read, else the cache.
//! - `commit` writes the group's committed offsets through the group's
//!   consumer when this log is a member (a KIP-848 group refuses commits from
//!   non-members; a member may commit any partition, so retry positions ride
//!   along), else through a consumer with that `group.id` that never joins
//!   (Kafka accepts that only while the group has no members). `committed`
//!   reads them through the latter, which Kafka allows at any time.
//! - Append listeners: Kafka pushes nothing, so each partition queue has a
//!   non-empty callback. It fires when a fetch brings records to an empty
//!   queue, i.e. when a caught-up reader has new data — wherever the records
//!   were produced. The callback only sends on a channel (it runs on
//!   librdkafka's threads, where blocking could stall the fetcher); a notifier
//!   thread calls the listeners. This log's own appends notify too, and so
//!   does a group assignment. A control event (a barrier at each assignment or
//!   seek) can fire it as well: an empty read follows, harmless, and it keeps
//!   the queue drained.
//! - Beyond the trait, a store's changelog: `append_changelog` writes a
//!   store's writes with deletes as tombstones (null values, which the trait's
//!   records cannot carry), `read_changelog` reads them back the same way, and
//!   `latest_end_offset` asks the leader rather than a cache.
//! - `enforce_retention` is a no-op that answers the start offset: Kafka's
//!   own retention (`retention.ms`, `retention.bytes` of the topic) applies.

use super::kafka_group::{Group, GroupContext, GroupListener, GroupPartition};
use super::{AppendListener, Log, LogError, ProducerRecord, Record, RecordPosition, Retention};
use crate::config::{Config, GroupProtocol};
use bytes::Bytes;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer as _, ProducerContext, ThreadedProducer};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, mpsc};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest wait for one request to the cluster (metadata, watermarks, commits,
/// topic creation).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest wait of a `read` for records the end offset says exist.
const FETCH_WAIT: Duration = Duration::from_secs(30);

/// How often a read waiting for records looks whether its partition is
/// being revoked.
const REVOCATION_CHECK: Duration = Duration::from_millis(100);

/// How long a read below the end offset waits on the shared reader before
/// it asks a fresh one (`reread`): the range may hold only aborted records
/// and markers, whose end the shared handle may never report. Long enough
/// that a loaded machine's slow first fetch does not turn every read into
/// a fresh client's.
const REREAD_AFTER: Duration = Duration::from_secs(10);

/// The reader's group id: needed by librdkafka for manual assignment; the
/// reader never joins or commits, so it creates no group on the broker.
const READER_GROUP: &str = "taskstream-log-reader";

/// Settings of the reader consumer that a `[kafka]` table may still change:
/// prefetch per partition. librdkafka's 64 MiB per partition is a lot with
/// one queue per partition, so the bytes are capped at 8 MiB; the record
/// count stays librdkafka's 100,000. (A count of 10,000 let a task drain its
/// queue before the next fetch arrived: small records came in bursts of one
/// fetch each, about 30,000, with the task idle in between, and one instance
/// counted 160,000 records/s where it counts 400,000 with this; bench
/// scenario `kafka`.)
const READER_DEFAULTS: &[(&str, &str)] = &[
    ("queued.max.messages.kbytes", "8192"),
    ("queued.min.messages", "100000"),
    ("fetch.wait.max.ms", "100"),
];

/// The client id of the consumer that asks for metadata and watermarks.
///
/// It never reads records, because a broker answers one connection's requests
/// one at a time, in order. Asked through the reader, whose connection
/// carries fetches the broker holds up to `fetch.wait.max.ms` (100 ms) while
/// the partitions it reads have nothing new (the metadata topic, always), a
/// watermark query took 105 ms instead of 2. Adding a task asks four (its
/// topic's and retry topic's start, its changelog's start and end), and a
/// rebalance adds its tasks before it assigns their partitions: 16
/// partitions waited 7.1 s for their first fetch (bench scenario `peers`).
const QUERIES_CLIENT_ID: &str = "taskstream-queries";

/// What the producer is set up with unless a `[kafka]` table says otherwise.
const PRODUCER_DEFAULTS: &[(&str, &str)] = &[("enable.idempotence", "true"), ("linger.ms", "5")];

/// librdkafka's default `message.max.bytes`.
const DEFAULT_MESSAGE_MAX_BYTES: usize = 1_000_000;

/// The size librdkafka checks against `message.max.bytes` when a record is
/// produced (`rd_kafka_msg_max_wire_size`): key, value and headers, each
/// header with the zigzag varints of its name's and value's lengths, plus
/// the most a v2 record's own fields take (36 bytes).
fn wire_size(record: &Outgoing<'_>) -> usize {
    const RECORD_V2_MAX_OVERHEAD: usize = 5 + 1 + 10 + 5 + 5 + 5 + 5;
    let varint = |len: usize| {
        let zigzag = (len as u64) << 1;
        (64 - zigzag.leading_zeros() as usize).div_ceil(7).max(1)
    };
    let headers: usize = record
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len() + varint(name.len()) + varint(value.len()))
        .sum();
    RECORD_V2_MAX_OVERHEAD + record.key.map_or(0, <[u8]>::len) + record.value.map_or(0, <[u8]>::len) + headers
}

/// Produce and delivery errors no wait mends: the record is too large.
fn is_rejection(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidRecord
    )
}

/// Apache Kafka as the application's log. See the module doc.
pub struct KafkaLog {
    /// This log, for what it hands out (the group's callbacks hold it weakly).
    me: std::sync::Weak<KafkaLog>,
    bootstrap_servers: String,
    client_settings: BTreeMap<String, String>,
    /// The producers' `message.max.bytes`: a record over it is refused
    /// before anything of its append is sent (see `wire_size`).
    max_message_bytes: usize,
    replication_factor: i32,
    admin: AdminClient<ClientLog>,
    producer: ThreadedProducer<DeliveryContext>,
    reader: Arc<BaseConsumer<ClientLog>>,
    /// Asks for metadata and watermarks, and nothing else (see
    /// `QUERIES_CLIENT_ID`).
    queries: Arc<BaseConsumer<ClientLog>>,
    /// One reader per topic partition read so far, each behind its own lock:
    /// the group's queue for a partition the group assigned here, else the
    /// reader consumer's.
    partition_readers: Mutex<HashMap<(String, u32), SharedReader>>,
    committers: Mutex<HashMap<String, Arc<BaseConsumer<ClientLog>>>>,
    /// exactly_once_v2: each task's transaction, under every partition it
    /// writes (retry, dead-letter, changelog). Appends to them go through it.
    transactions: RwLock<HashMap<(String, u32), Arc<TaskTransaction>>>,
    /// Per handle (the group's consumer or the reader) and partition, the
    /// end offset at which librdkafka last reported the partition's end
    /// (`enable.partition.eof`). It reports each end offset once for the
    /// life of the handle, seeks or not, so a read below an end reported
    /// already cannot learn from it where the readable records end (see
    /// `reread`).
    eof_reported: Mutex<HashMap<(bool, String, u32), u64>>,
    /// Transactional ids whose next commit aborts (tests: `inject_abort`).
    #[cfg(any(test, feature = "fault-injection"))]
    injected_aborts: Mutex<HashSet<String>>,
    /// The consumer group joined (`join_group`): reads of its partitions and
    /// commits of its offsets go through it.
    group: RwLock<Option<Arc<Group>>>,
    /// Start and end offsets of partitions not read here, refreshed in the
    /// background while they are asked for (see `cached_watermarks`).
    watermark_cache: Mutex<HashMap<(String, u32), CachedWatermarks>>,
    /// Partition counts of the topics seen (they only grow in Kafka).
    partition_counts: RwLock<HashMap<String, u32>>,
    /// Per partition: one past the highest offset this log appended.
    appended_end: Mutex<HashMap<(String, u32), u64>>,
    round_robin: Mutex<HashMap<String, u32>>,
    listeners: Arc<RwLock<Vec<AppendListener>>>,
    events: Mutex<mpsc::Sender<Event>>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A task's transactional producer (exactly_once_v2), with its open
/// transaction: the writes of the task's partitions since its last commit.
struct TaskTransaction {
    id: String,
    producer: ThreadedProducer<DeliveryContext>,
    /// Appends share it; a commit takes it alone, so nothing lands between
    /// the offsets it sends and the end of its transaction.
    gate: RwLock<()>,
    /// Why the open transaction cannot commit, once an append in it failed
    /// (librdkafka then refuses to commit it: the broker aborted it on its
    /// timeout, or a record was not delivered); cleared when it is aborted.
    doomed: Mutex<Option<String>>,
    /// When the open transaction began (or the last one committed).
    opened: Mutex<Instant>,
    /// The producer's `transaction.timeout.ms`.
    timeout: Duration,
}

impl TaskTransaction {
    fn opened_now(&self) {
        *self.opened.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// Whether a fence of this producer is the broker's abort of a
    /// transaction open past its timeout (the broker bumps the epoch then,
    /// as a new owner's producer would): the task is still this member's,
    /// and is revived with a new producer. A fence sooner is a new owner's.
    fn fenced_for_good(&self) -> bool {
        self.is_fatal() && self.opened.lock().unwrap_or_else(|e| e.into_inner()).elapsed() < self.timeout
    }

    /// The failed append `error` dooms the open transaction: answered as
    /// `LogError::TransactionAborted`, fenced if the producer is fatal.
    fn doom(&self, error: LogError) -> LogError {
        if matches!(error, LogError::Rejected { .. }) {
            // Refused before anything was sent: the transaction goes on.
            return error;
        }
        let reason = error.to_string();
        *self.doomed.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.clone());
        LogError::TransactionAborted {
            transaction: self.id.clone(),
            reason,
            fenced: self.fenced_for_good(),
        }
    }

    /// Whether librdkafka gave the producer up (fenced, or its epoch bumped
    /// by the broker): no transaction of it can commit any more.
    fn is_fatal(&self) -> bool {
        self.producer.client().fatal_error().is_some()
    }

    fn doomed(&self) -> Option<String> {
        self.doomed.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// What the notifier thread is told.
enum Event {
    Appended(Arc<str>, u32),
    Stop,
}

/// A reader behind its lock, and the condvar a read waits on while the
/// group is still assigning its partition.
struct ReaderSlot {
    state: Mutex<PartitionReader>,
    assigned: Condvar,
    /// Reads through the group consumer (fixed for the slot's life: a
    /// partition that joins or leaves the group gets a new slot).
    group: bool,
    /// The group is revoking the partition: its fetcher may stop, so a read
    /// waiting for records gives up instead of holding the revocation.
    revoking: AtomicBool,
}

type SharedReader = Arc<ReaderSlot>;

impl ReaderSlot {
    fn new(reader: PartitionReader, group: bool) -> SharedReader {
        Arc::new(ReaderSlot {
            state: Mutex::new(reader),
            assigned: Condvar::new(),
            group,
            revoking: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PartitionReader> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Where a partition's records arrive: the reader consumer's queue (manual
/// assignment) or the group consumer's (the group assigned it here).
enum Queue {
    Reader(PartitionQueue<ClientLog>),
    Group(PartitionQueue<GroupContext>),
}

impl Queue {
    fn poll(&self, timeout: Duration) -> Option<Result<BorrowedMessage<'_>, KafkaError>> {
        match self {
            Queue::Reader(queue) => queue.poll(timeout),
            Queue::Group(queue) => queue.poll(timeout),
        }
    }
}

/// One topic partition's queue, and where it stands.
struct PartitionReader {
    topic: String,
    partition: u32,
    queue: Queue,
    /// The offset the next message of the queue will have (the last returned + 1,
    /// or where it was assigned or sought).
    next: u64,
    /// A group partition whose assignment is under way: reads wait for it.
    pending: bool,
    /// The end offset a read saw when librdkafka said the queue reached the
    /// partition's end (`enable.partition.eof`, exactly_once_v2): records
    /// below it that never came are transaction markers or aborted, so no
    /// read waits for them. 0: none.
    eof_end: u64,
}

/// A partition's watermarks as last asked of the broker.
struct CachedWatermarks {
    low: u64,
    high: u64,
    refreshed: Instant,
    asked: Instant,
}

/// How old cached watermarks may be when answered (the background refresh
/// keeps partitions asked for within `WATERMARK_INTEREST` fresher than this).
const WATERMARK_TTL: Duration = Duration::from_secs(2);
/// Cached watermarks are refreshed while asked for within this long.
const WATERMARK_INTEREST: Duration = Duration::from_secs(30);
/// How often the background refresh runs.
const WATERMARK_REFRESH: Duration = Duration::from_millis(500);

impl KafkaLog {
    /// Connects to `config.bootstrap_servers` and checks that the cluster
    /// answers. `config.kafka` is passed to every client.
    pub fn connect(config: &Config) -> Result<Arc<KafkaLog>, LogError> {
        let bootstrap = config
            .bootstrap_servers
            .clone()
            .ok_or_else(|| LogError::Unavailable("no bootstrap_servers configured".into()))?;
        let mut settings = config.kafka.clone();
        if config.processing_guarantee == crate::config::ProcessingGuarantee::ExactlyOnceV2 {
            // Only committed transactions are read (restores, retries), and
            // a read learns where that ends: markers and aborted records
            // take offsets no record comes from.
            settings
                .entry("isolation.level".into())
                .or_insert_with(|| "read_committed".into());
            settings.insert("enable.partition.eof".into(), "true".into());
        }
        Self::with_settings(&bootstrap, &settings, config.replication_factor)
    }

    /// Connects with explicit settings: `bootstrap` servers, librdkafka
    /// `client_settings`, and the replication factor of created topics.
    pub fn with_settings(
        bootstrap: &str,
        client_settings: &BTreeMap<String, String>,
        replication_factor: i32,
    ) -> Result<Arc<KafkaLog>, LogError> {
        let base = |defaults: &[(&str, &str)]| {
            let mut config = ClientConfig::new();
            for (key, value) in defaults {
                config.set(*key, *value);
            }
            for (key, value) in client_settings {
                config.set(key, value);
            }
            config.set("bootstrap.servers", bootstrap);
            config
        };
        let admin: AdminClient<ClientLog> = base(&[])
            .set("client.id", "taskstream-admin")
            .create_with_context(ClientLog)
            .map_err(client_error("admin client"))?;
        let producer: ThreadedProducer<DeliveryContext> = base(PRODUCER_DEFAULTS)
            .set("client.id", "taskstream-producer")
            .set("partitioner", "murmur2_random")
            .set("allow.auto.create.topics", "false")
            .create_with_context(DeliveryContext)
            .map_err(client_error("producer"))?;
        let reader = reader_consumer(base(READER_DEFAULTS), "taskstream-reader")?;
        // A group id only because librdkafka's consumer polling wants one:
        // like the reader, it never joins or commits.
        let queries: BaseConsumer<ClientLog> = base(&[])
            .set("client.id", QUERIES_CLIENT_ID)
            .set("group.id", READER_GROUP)
            .set("enable.auto.commit", "false")
            .set("allow.auto.create.topics", "false")
            .create_with_context(ClientLog)
            .map_err(client_error("query consumer"))?;
        // Fail at start, not at the first record, when the cluster is unreachable.
        queries
            .fetch_metadata(None, REQUEST_TIMEOUT)
            .map_err(|e| LogError::Unavailable(format!("cannot reach Kafka at {bootstrap}: {e}")))?;

        let (events, received) = mpsc::channel();
        let log = Arc::new_cyclic(|me| KafkaLog {
            me: me.clone(),
            bootstrap_servers: bootstrap.to_string(),
            client_settings: client_settings.clone(),
            max_message_bytes: client_settings
                .get("message.max.bytes")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(DEFAULT_MESSAGE_MAX_BYTES),
            replication_factor,
            admin,
            producer,
            reader: Arc::new(reader),
            queries: Arc::new(queries),
            partition_readers: Mutex::new(HashMap::new()),
            committers: Mutex::new(HashMap::new()),
            transactions: RwLock::new(HashMap::new()),
            eof_reported: Mutex::new(HashMap::new()),
            #[cfg(any(test, feature = "fault-injection"))]
            injected_aborts: Mutex::new(HashSet::new()),
            group: RwLock::new(None),
            watermark_cache: Mutex::new(HashMap::new()),
            partition_counts: RwLock::new(HashMap::new()),
            appended_end: Mutex::new(HashMap::new()),
            round_robin: Mutex::new(HashMap::new()),
            listeners: Arc::new(RwLock::new(Vec::new())),
            events: Mutex::new(events),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Mutex::new(Vec::new()),
        });
        log.start_threads(received)?;
        Ok(log)
    }

    /// The bootstrap servers this log talks to.
    pub fn bootstrap_servers(&self) -> &str {
        &self.bootstrap_servers
    }

    /// The notifier (calls append listeners) and the poller (serves the
    /// consumers' main queues: errors and logs; messages never arrive there,
    /// each partition has its own queue).
    fn start_threads(self: &Arc<Self>, received: mpsc::Receiver<Event>) -> Result<(), LogError> {
        let listeners = self.listeners.clone();
        let notifier = std::thread::Builder::new()
            .name("kafka-log-notifier".into())
            .spawn(move || {
                for event in received {
                    match event {
                        Event::Appended(topic, partition) => {
                            let listeners = listeners.read().unwrap_or_else(|e| e.into_inner());
                            for listener in listeners.iter() {
                                listener(&topic, partition);
                            }
                        }
                        Event::Stop => break,
                    }
                }
            })
            .map_err(|e| LogError::Unavailable(format!("cannot start the notifier thread: {e}")))?;
        let weak = Arc::downgrade(self);
        let stop = self.stop.clone();
        let poller = std::thread::Builder::new()
            .name("kafka-log-poller".into())
            .spawn(move || {
                let mut refreshed = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let Some(log) = weak.upgrade() else { break };
                    if refreshed.elapsed() >= WATERMARK_REFRESH {
                        log.refresh_watermarks();
                        refreshed = Instant::now();
                    }
                    let committers: Vec<_> = log
                        .committers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .values()
                        .cloned()
                        .collect();
                    for committer in committers {
                        if let Some(Err(e)) = committer.poll(Duration::ZERO) {
                            tracing::warn!(error = %e, "kafka committer");
                        }
                    }
                    if let Some(Err(e)) = log.queries.poll(Duration::ZERO) {
                        tracing::warn!(error = %e, "kafka query consumer");
                    }
                    let reader = log.reader.clone();
                    drop(log);
                    // Blocks up to 100 ms: also how soon a dropped log is noticed.
                    match reader.poll(Duration::from_millis(100)) {
                        Some(Ok(message)) => tracing::error!(
                            topic = message.topic(),
                            partition = message.partition(),
                            "a record reached the reader's main queue instead of its partition queue"
                        ),
                        Some(Err(e)) => tracing::warn!(error = %e, "kafka reader"),
                        None => {}
                    }
                }
            })
            .map_err(|e| LogError::Unavailable(format!("cannot start the poller thread: {e}")))?;
        self.threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend([notifier, poller]);
        Ok(())
    }

    fn notify(&self, topic: &str, partition: u32) {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let _ = events.send(Event::Appended(topic.into(), partition));
    }

    /// The partition count of `topic`, from the cache or the cluster.
    fn partition_count(&self, topic: &str) -> Result<u32, LogError> {
        if let Some(&count) = self
            .partition_counts
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(topic)
        {
            return Ok(count);
        }
        self.refresh_partition_count(topic)?
            .ok_or_else(|| LogError::UnknownTopic(topic.to_string()))
    }

    /// Whether every partition of `topic` has a leader, as this client's
    /// metadata says.
    fn has_leaders(&self, topic: &str) -> Result<bool, LogError> {
        let metadata = self
            .queries
            .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
            .map_err(unavailable("metadata"))?;
        Ok(metadata.topics().iter().any(|t| {
            t.name() == topic
                && t.error().is_none()
                && !t.partitions().is_empty()
                && t.partitions()
                    .iter()
                    .all(|p| p.error().is_none() && p.leader() >= 0)
        }))
    }

    /// Asks the cluster; `None` when the topic does not exist.
    fn refresh_partition_count(&self, topic: &str) -> Result<Option<u32>, LogError> {
        let metadata = self
            .queries
            .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
            .map_err(unavailable("metadata"))?;
        let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
            return Ok(None);
        };
        match found.error() {
            None => {}
            Some(e) if RDKafkaErrorCode::from(e) == RDKafkaErrorCode::UnknownTopicOrPartition => {
                return Ok(None);
            }
            Some(e) => {
                return Err(LogError::Unavailable(format!(
                    "metadata of `{topic}`: {}",
                    RDKafkaErrorCode::from(e)
                )));
            }
        }
        let count = found.partitions().len() as u32;
        if count == 0 {
            return Ok(None);
        }
        self.partition_counts
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(topic.to_string(), count);
        Ok(Some(count))
    }

    /// Checks that `partition` exists (asking the cluster again before saying
    /// no: partitions may have been added); answers the partition count.
    fn check_partition(&self, topic: &str, partition: u32) -> Result<u32, LogError> {
        let mut count = self.partition_count(topic)?;
        if partition >= count {
            count = self
                .refresh_partition_count(topic)?
                .ok_or_else(|| LogError::UnknownTopic(topic.to_string()))?;
        }
        if partition >= count {
            return Err(LogError::UnknownPartition {
                topic: topic.to_string(),
                partition,
                partitions: count,
            });
        }
        Ok(count)
    }

    fn next_round_robin(&self, topic: &str, partitions: u32) -> u32 {
        let mut counters = self.round_robin.lock().unwrap_or_else(|e| e.into_inner());
        let counter = counters.entry(topic.to_string()).or_default();
        let current = *counter;
        *counter = current.wrapping_add(1);
        current % partitions
    }

    /// The reader of a partition, assigned at `offset` to the reader consumer
    /// when it is new (a partition of the group has its reader already).
    fn partition_reader(&self, topic: &str, partition: u32, offset: u64) -> Result<SharedReader, LogError> {
        let mut readers = self.partition_readers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reader) = readers.get(&(topic.to_string(), partition)) {
            return Ok(reader.clone());
        }
        let mut queue = self.split(topic, partition)?;
        watch(&self.events, &mut queue, topic, partition);
        self.assign_at(topic, partition, offset)?;
        let reader = ReaderSlot::new(
            PartitionReader {
                topic: topic.to_string(),
                partition,
                queue: Queue::Reader(queue),
                next: offset,
                pending: false,
                eof_end: 0,
            },
            false,
        );
        readers.insert((topic.to_string(), partition), reader.clone());
        Ok(reader)
    }

    /// Splits off a partition's queue. Done before the partition is assigned:
    /// a queue split first is marked as the application's, so the fetcher
    /// never routes it to the main queue (split after, the first fetched
    /// records could already have gone there).
    fn split(&self, topic: &str, partition: u32) -> Result<PartitionQueue<ClientLog>, LogError> {
        self.reader
            .split_partition_queue(topic, partition as i32)
            .ok_or_else(|| LogError::Unavailable(format!("no queue for {topic}-{partition}")))
    }

    /// Adds a partition at `offset` to the reader's assignment; the fetcher
    /// starts in the background.
    fn assign_at(&self, topic: &str, partition: u32, offset: u64) -> Result<(), LogError> {
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(topic, partition as i32, Offset::Offset(offset as i64))
            .map_err(unavailable("assignment"))?;
        self.reader
            .incremental_assign(&assignment)
            .map_err(unavailable("assign"))
    }

    /// Removes a partition from the reader consumer's assignment.
    fn unassign(&self, topic: &str, partition: u32) -> Result<(), LogError> {
        let mut unassign = TopicPartitionList::new();
        unassign.add_partition(topic, partition as i32);
        self.reader
            .incremental_unassign(&unassign)
            .map_err(unavailable("unassign"))
    }

    /// The high watermark librdkafka last saw in a fetch response of a
    /// partition being read; `None` when it has none yet.
    fn cached_high_watermark(&self, topic: &str, partition: u32) -> Option<u64> {
        let slot = self
            .partition_readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(topic.to_string(), partition))
            .cloned()?;
        let client = if slot.group {
            let group = self.group.read().unwrap_or_else(|e| e.into_inner()).clone()?;
            group.consumer.client().native_ptr()
        } else {
            self.reader.client().native_ptr()
        };
        let topic = std::ffi::CString::new(topic).ok()?;
        let (mut low, mut high) = (-1i64, -1i64);
        // SAFETY: the client handle lives as long as its consumer, which the
        // log (or the group `Arc` above) holds; the topic is a NUL-terminated
        // string and both out-pointers outlive the call, which only reads
        // librdkafka's cache (rdkafka wraps the network variant only).
        let err = unsafe {
            rdkafka::bindings::rd_kafka_get_watermark_offsets(
                client,
                topic.as_ptr(),
                partition as i32,
                &mut low,
                &mut high,
            )
        };
        (err == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0)
            .then_some(high as u64)
    }

    fn appended_end(&self, topic: &str, partition: u32) -> u64 {
        self.appended_end
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(topic.to_string(), partition))
            .copied()
            .unwrap_or(0)
    }

    /// The partition's start and end offsets, from its leader. A partition
    /// whose leader is moving (or was just created) answers with a retriable
    /// error for a moment: asked again until `REQUEST_TIMEOUT`.
    fn watermarks(&self, topic: &str, partition: u32) -> Result<(u64, u64), LogError> {
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        loop {
            match self
                .queries
                .fetch_watermarks(topic, partition as i32, REQUEST_TIMEOUT)
            {
                Ok((low, high)) => return Ok((low.max(0) as u64, high.max(0) as u64)),
                Err(e) if Instant::now() < deadline && is_leader_moving(&e) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(unavailable("watermarks")(e)),
            }
        }
    }

    /// Watermarks of a partition not read here, from the cache when fresh
    /// enough, else from the broker (then cached, and kept fresh in the
    /// background while asked for): metadata and gauges ask for every
    /// partition, some under the runtime's locks, and must not wait for the
    /// network each time.
    fn cached_watermarks(&self, topic: &str, partition: u32) -> Result<(u64, u64), LogError> {
        let key = (topic.to_string(), partition);
        let now = Instant::now();
        {
            let mut cache = self.watermark_cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(entry) = cache.get_mut(&key)
                && now.duration_since(entry.refreshed) < WATERMARK_TTL
            {
                entry.asked = now;
                return Ok((entry.low, entry.high));
            }
        }
        let (low, high) = self.watermarks(topic, partition)?;
        self.watermark_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                key,
                CachedWatermarks {
                    low,
                    high,
                    refreshed: Instant::now(),
                    asked: now,
                },
            );
        Ok((low, high))
    }

    /// Refreshes the cached watermarks asked for lately; forgets the others.
    /// Runs on the poller thread, holding no lock while it asks the broker.
    fn refresh_watermarks(&self) {
        let due: Vec<(String, u32)> = {
            let mut cache = self.watermark_cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.retain(|_, entry| entry.asked.elapsed() < WATERMARK_INTEREST);
            cache
                .iter()
                .filter(|(_, entry)| entry.refreshed.elapsed() >= WATERMARK_TTL / 2)
                .map(|(key, _)| key.clone())
                .collect()
        };
        for (topic, partition) in due {
            let Ok((low, high)) = self.watermarks(&topic, partition) else {
                continue;
            };
            let mut cache = self.watermark_cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(entry) = cache.get_mut(&(topic, partition)) {
                entry.low = low;
                entry.high = high;
                entry.refreshed = Instant::now();
            }
        }
    }

    /// Joins the consumer group `group` subscribed to `topics` with
    /// `protocol`; `listener` hears of every assignment and revocation (see
    /// `kafka_group`). From now on the partitions the group assigns here are
    /// read through the group's consumer, and the group's offsets are
    /// committed through it.
    pub fn join_group(
        &self,
        group: &str,
        topics: &[String],
        protocol: GroupProtocol,
        listener: Arc<dyn GroupListener>,
    ) -> Result<(), LogError> {
        let mut joined = self.group.write().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = joined.as_ref() {
            return Err(LogError::Unavailable(format!(
                "this log is a member of group `{}` already",
                existing.name
            )));
        }
        let config = self.client_config(READER_DEFAULTS);
        let member = Group::join(&self.me, config, group, topics, protocol, listener)
            .map_err(LogError::Unavailable)?;
        *joined = Some(member);
        Ok(())
    }

    /// Leaves the group joined with `join_group` (every partition is revoked
    /// through the listener first); blocks until it has. Nothing if none.
    pub fn leave_group(&self) {
        let group = self.group.read().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(group) = group else { return };
        group.leave();
        // Whatever the revocation did not release (nothing, normally).
        let leftover: Vec<GroupPartition> = self
            .partition_readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, slot)| slot.group)
            .map(|(key, _)| key.clone())
            .collect();
        self.release_group_partitions(&leftover);
        *self.group.write().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The group this log is a member of, if any.
    fn member(&self, group: &str) -> Option<Arc<Group>> {
        self.group
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .filter(|g| g.name == group)
            .cloned()
    }

    /// The group generation (classic) or member epoch (KIP-848) of this
    /// log's membership; `None` outside a group.
    pub fn group_generation(&self) -> Option<i32> {
        let group = self.group.read().unwrap_or_else(|e| e.into_inner()).clone()?;
        Some(super::kafka_group::generation(&group.consumer))
    }

    /// In the rebalance callback, before the group assigns `partitions`:
    /// each gets a reader on its own group queue, split before the
    /// assignment, waiting (`pending`) until `group_partitions_assigned`. A
    /// reader the reader consumer had for one of them is given up.
    pub(crate) fn prepare_group_partitions(
        &self,
        consumer: &Arc<BaseConsumer<GroupContext>>,
        partitions: &[GroupPartition],
    ) {
        let mut readers = self.partition_readers.lock().unwrap_or_else(|e| e.into_inner());
        for (topic, partition) in partitions {
            let Some(mut queue) = consumer.split_partition_queue(topic, *partition as i32) else {
                tracing::error!(
                    topic,
                    partition,
                    "kafka group: no queue for an assigned partition"
                );
                continue;
            };
            watch(&self.events, &mut queue, topic, *partition);
            let slot = ReaderSlot::new(
                PartitionReader {
                    topic: topic.clone(),
                    partition: *partition,
                    queue: Queue::Group(queue),
                    next: 0,
                    pending: true,
                    eof_end: 0,
                },
                true,
            );
            if let Some(old) = readers.insert((topic.clone(), *partition), slot)
                && !old.group
                && let Err(e) = self.unassign(topic, *partition)
            {
                tracing::warn!(topic, partition, error = %e, "cannot unassign a partition from the reader");
            }
        }
    }

    /// The group assigned `partitions`, each at `starts[p]` (where it is
    /// missing, at the committed offset: its first read seeks): their reads
    /// may go on, and their tasks are woken.
    pub(crate) fn group_partitions_assigned(
        &self,
        partitions: &[GroupPartition],
        starts: &BTreeMap<GroupPartition, u64>,
    ) {
        for key in partitions {
            let slot = self
                .partition_readers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(key)
                .cloned();
            if let Some(slot) = slot.filter(|s| s.group) {
                let mut reader = slot.lock();
                reader.pending = false;
                reader.next = starts.get(key).copied().unwrap_or(u64::MAX);
                slot.assigned.notify_all();
            }
            self.notify(&key.0, key.1);
        }
    }

    /// The group is taking `partitions` away: reads waiting for their records
    /// give up (their tasks are about to drain).
    pub(crate) fn revoking_group_partitions(&self, partitions: &[GroupPartition]) {
        let readers = self.partition_readers.lock().unwrap_or_else(|e| e.into_inner());
        for key in partitions {
            if let Some(slot) = readers.get(key).filter(|slot| slot.group) {
                slot.revoking.store(true, Ordering::Release);
            }
        }
    }

    /// The group took `partitions` away (their tasks are gone): their group
    /// queues are dropped.
    pub(crate) fn release_group_partitions(&self, partitions: &[GroupPartition]) {
        let mut readers = self.partition_readers.lock().unwrap_or_else(|e| e.into_inner());
        for key in partitions {
            if readers.get(key).is_some_and(|slot| slot.group)
                && let Some(slot) = readers.remove(key)
            {
                // A read still waiting for the assignment gives up.
                let mut reader = slot.lock();
                reader.pending = false;
                reader.next = u64::MAX;
                slot.assigned.notify_all();
            }
        }
    }

    /// Stops reading partitions of topics outside the group (a task's retry
    /// or changelog partitions, once the task left): their queues and
    /// prefetched records are dropped. A later read starts afresh.
    pub fn release(&self, partitions: &[(String, u32)]) {
        let mut readers = self.partition_readers.lock().unwrap_or_else(|e| e.into_inner());
        for (topic, partition) in partitions {
            let key = (topic.clone(), *partition);
            if readers.get(&key).is_some_and(|slot| !slot.group) {
                readers.remove(&key);
                if let Err(e) = self.unassign(topic, *partition) {
                    tracing::warn!(topic, partition, error = %e, "cannot unassign a partition from the reader");
                }
            }
        }
    }

    /// A client configuration with the log's settings and `defaults` under them.
    fn client_config(&self, defaults: &[(&str, &str)]) -> ClientConfig {
        let mut config = ClientConfig::new();
        for (key, value) in defaults {
            config.set(*key, *value);
        }
        for (key, value) in &self.client_settings {
            config.set(key, value);
        }
        config.set("bootstrap.servers", &self.bootstrap_servers);
        config
    }

    /// The consumer that commits for `group` (created on first use).
    fn committer(&self, group: &str) -> Result<Arc<BaseConsumer<ClientLog>>, LogError> {
        let mut committers = self.committers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(committer) = committers.get(group) {
            return Ok(committer.clone());
        }
        let mut config = ClientConfig::new();
        for (key, value) in &self.client_settings {
            config.set(key, value);
        }
        let committer: BaseConsumer<ClientLog> = config
            .set("bootstrap.servers", &self.bootstrap_servers)
            .set("client.id", "taskstream-committer")
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("allow.auto.create.topics", "false")
            .create_with_context(ClientLog)
            .map_err(client_error("committer"))?;
        let committer = Arc::new(committer);
        committers.insert(group.to_string(), committer.clone());
        Ok(committer)
    }

    /// Creates `topic`; answers whether it existed already.
    fn create_topic(&self, topic: &str, partitions: u32) -> Result<bool, LogError> {
        let compacted = topic.ends_with("-changelog") || topic.ends_with("-metadata");
        let mut new_topic = NewTopic::new(
            topic,
            partitions as i32,
            TopicReplication::Fixed(self.replication_factor),
        );
        if compacted {
            new_topic = new_topic.set("cleanup.policy", "compact");
        }
        let options = AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT));
        let results = block_on(self.admin.create_topics([&new_topic], &options))
            .map_err(unavailable("create topic"))?;
        for result in results {
            match result {
                Ok(_) => {}
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => return Ok(true),
                Err((name, code)) => {
                    return Err(LogError::Unavailable(format!(
                        "cannot create topic `{name}`: {code}"
                    )));
                }
            }
        }
        Ok(false)
    }
}

impl Drop for KafkaLog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // The queues' callbacks hold senders; dropping the queues first stops them.
        self.partition_readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let _ = self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Event::Stop);
        let current = std::thread::current().id();
        for thread in self.threads.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            // The poller may hold the last reference for a moment; it cannot join itself.
            if thread.thread().id() != current {
                let _ = thread.join();
            }
        }
    }
}

impl Log for KafkaLog {
    fn ensure_topic(&self, topic: &str, partitions: u32) -> Result<(), LogError> {
        let existing = match self.refresh_partition_count(topic)? {
            Some(existing) => existing,
            None => {
                let raced = self.create_topic(topic, partitions)?;
                // Metadata reaches every broker shortly after creation; wait
                // until this client sees every partition with a leader, so
                // the next call finds the topic ready.
                let deadline = Instant::now() + REQUEST_TIMEOUT;
                loop {
                    match self.refresh_partition_count(topic)? {
                        Some(count) if (raced || count >= partitions) && self.has_leaders(topic)? => {
                            break count;
                        }
                        _ if Instant::now() >= deadline => {
                            return Err(LogError::Unavailable(format!(
                                "topic `{topic}` was created but its metadata did not appear within {REQUEST_TIMEOUT:?}"
                            )));
                        }
                        // Polling the cluster's metadata, which has no notification.
                        _ => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }
        };
        if existing != partitions {
            return Err(LogError::PartitionCountMismatch {
                topic: topic.to_string(),
                existing,
                requested: partitions,
            });
        }
        Ok(())
    }

    fn partitions(&self, topic: &str) -> Result<u32, LogError> {
        self.partition_count(topic)
    }

    /// A produce of many records is many Kafka messages: some may be written
    /// when another fails.
    fn append_is_atomic(&self) -> bool {
        false
    }

    fn append(&self, topic: &str, records: Vec<ProducerRecord>) -> Result<Vec<RecordPosition>, LogError> {
        let partitions = self.partition_count(topic)?;
        if let Some(bad) = records
            .iter()
            .filter_map(|r| r.partition)
            .find(|&p| p >= partitions)
        {
            // The cluster may know more partitions than the cache.
            self.check_partition(topic, bad)?;
        }
        self.send(topic, partitions, records.iter().map(Outgoing::of).collect())
    }

    fn check_record(&self, topic: &str, record: &ProducerRecord) -> Result<(), LogError> {
        match self.refusal(topic, &[Outgoing::of(record)]) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    fn read(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
        out: &mut Vec<Record>,
    ) -> Result<(), LogError> {
        self.read_messages(topic, partition, offset, max, &mut |message| {
            out.push(to_record(message, partition));
        })
    }

    fn end_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError> {
        self.check_partition(topic, partition)?;
        let appended = self.appended_end(topic, partition);
        let high = match self.cached_high_watermark(topic, partition) {
            Some(high) => high,
            None => self.cached_watermarks(topic, partition)?.1,
        };
        Ok(high.max(appended))
    }

    fn start_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError> {
        self.check_partition(topic, partition)?;
        let read_here = self
            .partition_readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&(topic.to_string(), partition));
        if read_here {
            Ok(self.watermarks(topic, partition)?.0)
        } else {
            Ok(self.cached_watermarks(topic, partition)?.0)
        }
    }

    fn commit(&self, group: &str, topic: &str, partition: u32, offset: u64) -> Result<(), LogError> {
        self.commit_with_metadata(group, topic, partition, offset, "")
    }

    fn committed(&self, group: &str, topic: &str, partition: u32) -> Result<Option<u64>, LogError> {
        Ok(self
            .committed_with_metadata(group, topic, partition)?
            .map(|(offset, _)| offset))
    }

    fn as_kafka(&self) -> Option<&KafkaLog> {
        Some(self)
    }

    fn add_append_listener(&self, listener: AppendListener) {
        self.listeners
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(listener);
    }

    /// Kafka applies its own retention (`retention.ms`, `retention.bytes` of
    /// the topic): nothing to do here but answer where the partition starts.
    fn enforce_retention(
        &self,
        topic: &str,
        partition: u32,
        _retention: Retention,
        _keep_from: u64,
        _now_ms: i64,
    ) -> Result<u64, LogError> {
        self.start_offset(topic, partition)
    }
}

impl KafkaLog {
    /// Sends `records` to `topic` (of `partitions` partitions) and waits for
    /// their delivery reports, which carry the offsets. See the module doc.
    fn send(
        &self,
        topic: &str,
        partitions: u32,
        records: Vec<Outgoing<'_>>,
    ) -> Result<Vec<RecordPosition>, LogError> {
        // A task's partition under exactly_once_v2: inside its transaction.
        let transaction = self.transaction_of(topic, &records);
        let _inside = transaction
            .as_ref()
            .map(|t| t.gate.read().unwrap_or_else(|e| e.into_inner()));
        match &transaction {
            Some(transaction) => self
                .send_with(&transaction.producer, topic, partitions, records)
                .map_err(|error| transaction.doom(error)),
            None => self.send_with(&self.producer, topic, partitions, records),
        }
    }

    /// The transaction every one of `records` belongs to (all to one
    /// registered partition), if any.
    fn transaction_of(&self, topic: &str, records: &[Outgoing<'_>]) -> Option<Arc<TaskTransaction>> {
        let transactions = self.transactions.read().unwrap_or_else(|e| e.into_inner());
        if transactions.is_empty() {
            return None;
        }
        let partition = records.first()?.partition?;
        if records.iter().any(|r| r.partition != Some(partition)) {
            return None;
        }
        transactions.get(&(topic.to_string(), partition)).cloned()
    }

    /// The error for the first of `records` over the producers'
    /// `message.max.bytes`, which librdkafka would refuse as it is sent.
    fn refusal(&self, topic: &str, records: &[Outgoing<'_>]) -> Option<LogError> {
        let size = records
            .iter()
            .map(wire_size)
            .find(|&size| size > self.max_message_bytes)?;
        Some(LogError::Rejected {
            topic: topic.to_string(),
            reason: format!(
                "a record of {size} bytes (key, value and headers) is over the producer's \
                 `message.max.bytes` ({})",
                self.max_message_bytes
            ),
        })
    }

    /// Sends through `producer`; see `send`.
    fn send_with(
        &self,
        producer: &ThreadedProducer<DeliveryContext>,
        topic: &str,
        partitions: u32,
        records: Vec<Outgoing<'_>>,
    ) -> Result<Vec<RecordPosition>, LogError> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        // Checked for every record before any is sent: a refused record
        // would otherwise leave those before it sent and the rest not.
        if let Some(error) = self.refusal(topic, &records) {
            return Err(error);
        }
        let batch = Arc::new(Batch::new(records.len()));
        let mut sent = 0;
        let mut send_error = None;
        for (index, record) in records.iter().enumerate() {
            let partition = match (record.partition, &record.key) {
                (Some(p), _) => Some(p),
                // librdkafka's murmur2_random: Kafka's Java default for keys.
                (None, Some(_)) => None,
                (None, None) => Some(self.next_round_robin(topic, partitions)),
            };
            let mut headers = OwnedHeaders::new_with_capacity(record.headers.len());
            for (name, value) in record.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(&value[..]),
                });
            }
            let mut message = BaseRecord::with_opaque_to(
                topic,
                Box::new(Delivery {
                    batch: batch.clone(),
                    index,
                }),
            )
            .headers(headers);
            if let Some(value) = record.value {
                message = message.payload(value);
            }
            if let Some(key) = record.key {
                message = message.key(key);
            }
            if let Some(partition) = partition {
                message = message.partition(partition as i32);
            }
            if let Some(timestamp) = record.timestamp_ms {
                message = message.timestamp(timestamp);
            }
            // A full local queue drains as deliveries complete: wait for some.
            let deadline = Instant::now() + REQUEST_TIMEOUT;
            let outcome = loop {
                match producer.send(message) {
                    Ok(()) => break Ok(()),
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                        if Instant::now() < deadline =>
                    {
                        message = back;
                        batch.wait_for_progress(Duration::from_millis(10));
                    }
                    Err((e, _)) => break Err(e),
                }
            };
            match outcome {
                Ok(()) => sent += 1,
                Err(e) => {
                    send_error = Some(match e.rdkafka_error_code() {
                        Some(code) if is_rejection(code) => LogError::Rejected {
                            topic: topic.to_string(),
                            reason: e.to_string(),
                        },
                        _ => LogError::Unavailable(format!("cannot send to `{topic}`: {e}")),
                    });
                    break;
                }
            }
        }
        let result = batch.wait(sent);
        let delivered = match (&result, send_error) {
            (_, Some(error)) => Err(error),
            (Ok(positions), None) => Ok(positions.clone()),
            (Err(e), None) => Err(e.clone()),
        };
        // Whatever was delivered moved the end, even when the batch failed.
        let landed: Vec<RecordPosition> = match &result {
            Ok(positions) => positions.clone(),
            Err(_) => batch.delivered_positions(),
        };
        let mut touched = HashSet::new();
        {
            let mut ends = self.appended_end.lock().unwrap_or_else(|e| e.into_inner());
            for position in &landed {
                let end = ends.entry((topic.to_string(), position.partition)).or_insert(0);
                *end = (*end).max(position.offset + 1);
                touched.insert(position.partition);
            }
        }
        for partition in touched {
            self.notify(topic, partition);
        }
        delivered
    }

    /// Appends a store's writes to partition `partition` of its changelog
    /// topic, in order: a value as the record's value, a delete as a
    /// tombstone (a null value, which compaction removes with the key). Waits
    /// until they are durable; answers the offset after the last, `None`
    /// when there was nothing to send.
    pub fn append_changelog(
        &self,
        topic: &str,
        partition: u32,
        writes: &[(Bytes, Option<Bytes>)],
    ) -> Result<Option<u64>, LogError> {
        let partitions = self.check_partition(topic, partition)?;
        let outgoing: Vec<Outgoing<'_>> = writes
            .iter()
            .map(|(key, value)| Outgoing {
                key: Some(&key[..]),
                value: value.as_deref(),
                partition: Some(partition),
                timestamp_ms: None,
                headers: &[],
            })
            .collect();
        let positions = self.send(topic, partitions, outgoing)?;
        Ok(positions.iter().map(|p| p.offset + 1).max())
    }

    /// Up to `max` records of a changelog partition from `offset`, as the
    /// store writes they stand for (a tombstone: a delete), each with its
    /// offset. Offsets have gaps where compaction removed records. Like
    /// `read`, through the reader consumer (never the group).
    pub fn read_changelog(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
        out: &mut Vec<(u64, (Bytes, Option<Bytes>))>,
    ) -> Result<(), LogError> {
        self.read_messages(topic, partition, offset, max, &mut |message| {
            let key = Bytes::copy_from_slice(message.key().unwrap_or_default());
            let value = message.payload().map(Bytes::copy_from_slice);
            out.push((message.offset().max(0) as u64, (key, value)));
        })
    }

    /// The end offset of a partition as its leader says now (not a cached
    /// one): where a restore must read up to, since another instance may
    /// have written the partition a moment ago.
    pub fn latest_end_offset(&self, topic: &str, partition: u32) -> Result<u64, LogError> {
        self.check_partition(topic, partition)?;
        Ok(self
            .watermarks(topic, partition)?
            .1
            .max(self.appended_end(topic, partition)))
    }

    /// Serves `read` and `read_changelog`: hands up to `max` messages of the
    /// partition from `offset` to `take`. See the module doc.
    fn read_messages(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
        take: &mut dyn FnMut(&BorrowedMessage<'_>),
    ) -> Result<(), LogError> {
        self.check_partition(topic, partition)?;
        if max == 0 {
            return Ok(());
        }
        // Before the partition is assigned: a fetcher started past the end
        // would stop on an out-of-range error.
        let end = self.end_offset(topic, partition)?;
        if offset > end {
            return Ok(());
        }
        let slot = self.partition_reader(topic, partition, offset)?;
        let mut guard = slot.lock();
        if guard.pending {
            // The group is assigning the partition right now (the rebalance
            // callback adds its tasks, then assigns it): a moment's wait.
            let (waited, _) = slot
                .assigned
                .wait_timeout_while(guard, FETCH_WAIT, |r| r.pending)
                .unwrap_or_else(|e| e.into_inner());
            guard = waited;
            if guard.pending {
                return Err(LogError::Unavailable(format!(
                    "{topic}-{partition} was not assigned within {FETCH_WAIT:?}"
                )));
            }
        }
        // A plain reference, so the queue and the position borrow apart.
        let reader: &mut PartitionReader = &mut guard;
        // Below an end librdkafka said already (through this reader, or one
        // released since: librdkafka keeps what it said per partition), it
        // will not say it again, and a read would wait for records that may
        // all be markers or aborted. Every record below that end was queued
        // before it was said, so a reader standing there has only such left.
        // The shared reader stays where it is.
        if offset < end && end > reader.eof_end {
            let eof_key = (slot.group, topic.to_string(), partition);
            let reported = self
                .eof_reported
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&eof_key)
                .copied();
            if reported.is_some_and(|reported| reported >= end) {
                drop(guard);
                return self.reread(topic, partition, offset, max, end, take);
            }
        }
        // At the end the reader still stands at `offset`, so that records
        // appended there fill the queue and fire its callback.
        if reader.next != offset {
            self.seek(reader, offset)?;
        }
        // Wait for records the end offset promises; at the end, only take what
        // is queued. Either way the queue is served, which also consumes
        // librdkafka's control events: its callback fires only when the queue
        // goes from empty to non-empty, so nothing may linger there.
        let mut promised = offset < end && end > reader.eof_end;
        let mut taken = 0;
        let started = Instant::now();
        while taken < max {
            // Wait only for the first record; then take what is already here.
            // A wait is cut in slices, to notice a revocation.
            let wait = if promised && taken == 0 {
                REREAD_AFTER
                    .saturating_sub(started.elapsed())
                    .min(REVOCATION_CHECK)
            } else {
                Duration::ZERO
            };
            match reader.queue.poll(wait) {
                Some(Ok(message)) => {
                    let message_offset = message.offset().max(0) as u64;
                    if message_offset < offset {
                        // Left over from before a seek.
                        continue;
                    }
                    reader.next = message_offset + 1;
                    take(&message);
                    taken += 1;
                }
                // With `auto.offset.reset = error` an offset the broker no
                // longer has stops the fetcher and arrives here.
                Some(Err(KafkaError::MessageConsumption(
                    code @ (RDKafkaErrorCode::OffsetOutOfRange | RDKafkaErrorCode::AutoOffsetReset),
                ))) => {
                    // The fetcher stopped; the next read seeks.
                    reader.next = u64::MAX;
                    let (earliest, _) = self.watermarks(topic, partition)?;
                    if offset < earliest {
                        return Err(LogError::OffsetOutOfRange {
                            topic: topic.to_string(),
                            partition,
                            requested: offset,
                            earliest,
                        });
                    }
                    return Err(LogError::Unavailable(format!(
                        "reading {topic}-{partition} from {offset}: {code}"
                    )));
                }
                // At the end of what can be read (read_committed: the last
                // stable offset); what the end offset promised beyond is
                // markers, aborted or not yet committed.
                // Records that came after it may wait behind it: take them,
                // without waiting for more.
                Some(Err(KafkaError::PartitionEOF(_))) => {
                    reader.eof_end = end;
                    promised = false;
                    let mut reported = self.eof_reported.lock().unwrap_or_else(|e| e.into_inner());
                    let at = reported
                        .entry((slot.group, topic.to_string(), partition))
                        .or_default();
                    *at = (*at).max(end);
                }
                Some(Err(e)) => {
                    if taken > 0 {
                        break;
                    }
                    return Err(LogError::Unavailable(format!("reading {topic}-{partition}: {e}")));
                }
                None if promised && taken == 0 && slot.revoking.load(Ordering::Acquire) => {
                    return Err(LogError::Unavailable(format!(
                        "{topic}-{partition} is being revoked from this member"
                    )));
                }
                None if promised && taken == 0 && started.elapsed() >= REREAD_AFTER => {
                    drop(guard);
                    return self.reread(topic, partition, offset, max, end, take);
                }
                None if promised && taken == 0 => {}
                None => break,
            }
        }
        Ok(())
    }

    /// `read_messages` of a range below an end offset whose end the shared
    /// handle reported already (see `eof_reported`), through a consumer made
    /// for this read alone: a fresh handle reports where the readable
    /// records end. Costs a client of its own (tens of milliseconds): taken
    /// only on the way back over a range read before, such as a task revived
    /// from its last commit after an aborted transaction.
    fn reread(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max: usize,
        end: u64,
        take: &mut dyn FnMut(&BorrowedMessage<'_>),
    ) -> Result<(), LogError> {
        let mut config = self.client_config(READER_DEFAULTS);
        config.set("enable.partition.eof", "true");
        let consumer = reader_consumer(config, "taskstream-rereader")?;
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(topic, partition as i32, Offset::Offset(offset as i64))
            .map_err(unavailable("assignment"))?;
        consumer.assign(&assignment).map_err(unavailable("assign"))?;
        let deadline = Instant::now() + FETCH_WAIT;
        let mut taken = 0;
        while taken < max {
            let wait = deadline.saturating_duration_since(Instant::now());
            match consumer.poll(if taken == 0 { wait } else { Duration::ZERO }) {
                Some(Ok(message)) => {
                    let at = message.offset().max(0) as u64;
                    if at >= end {
                        break;
                    }
                    take(&message);
                    taken += 1;
                }
                Some(Err(KafkaError::PartitionEOF(_))) => break,
                Some(Err(e)) => {
                    if taken > 0 {
                        break;
                    }
                    return Err(LogError::Unavailable(format!(
                        "re-reading {topic}-{partition}: {e}"
                    )));
                }
                None if taken == 0 && Instant::now() < deadline => {}
                None if taken == 0 => {
                    return Err(LogError::Unavailable(format!(
                        "{topic}-{partition} holds offsets up to {end} but none arrived from {offset} within {:?} (an open transaction holds them back?)",
                        FETCH_WAIT + REREAD_AFTER
                    )));
                }
                None => break,
            }
        }
        Ok(())
    }

    /// exactly_once_v2: creates the transactional producer `transactional_id`
    /// of a task and opens its first transaction; from now on appends to
    /// `partitions` (the task's retry, dead-letter and changelog partitions)
    /// go into it. Initialising it fences an earlier producer of that id
    /// (the task's previous owner, alive or not) and aborts its open
    /// transaction, so read_committed readers go on at once.
    pub fn begin_transactions(
        &self,
        transactional_id: &str,
        partitions: &[(String, u32)],
    ) -> Result<(), LogError> {
        self.end_transactions(transactional_id);
        let producer: ThreadedProducer<DeliveryContext> = self
            .client_config(PRODUCER_DEFAULTS)
            .set("client.id", "taskstream-transactions")
            .set("transactional.id", transactional_id)
            .set("partitioner", "murmur2_random")
            .set("allow.auto.create.topics", "false")
            .create_with_context(DeliveryContext)
            .map_err(client_error("transactional producer"))?;
        producer
            .init_transactions(REQUEST_TIMEOUT)
            .map_err(unavailable("init transactions"))?;
        producer
            .begin_transaction()
            .map_err(unavailable("begin transaction"))?;
        let transaction = Arc::new(TaskTransaction {
            id: transactional_id.to_string(),
            producer,
            gate: RwLock::new(()),
            doomed: Mutex::new(None),
            opened: Mutex::new(Instant::now()),
            timeout: self.transaction_timeout(),
        });
        let mut transactions = self.transactions.write().unwrap_or_else(|e| e.into_inner());
        for key in partitions {
            transactions.insert(key.clone(), transaction.clone());
        }
        Ok(())
    }

    /// `Log::commit` with `metadata` stored beside the offset (Kafka keeps
    /// up to `offset.metadata.max.bytes`, 4,096 by default).
    pub fn commit_with_metadata(
        &self,
        group: &str,
        topic: &str,
        partition: u32,
        offset: u64,
        metadata: &str,
    ) -> Result<(), LogError> {
        self.check_partition(topic, partition)?;
        let mut offsets = TopicPartitionList::new();
        offsets
            .add_partition_offset(topic, partition as i32, Offset::Offset(offset as i64))
            .map_err(unavailable("commit"))?;
        set_metadata(&mut offsets, topic, partition, metadata);
        match self.member(group) {
            // A KIP-848 group refuses commits from a client that is not a
            // member; Kafka accepts a member's commit of any partition.
            Some(member) => member.consumer.commit(&offsets, CommitMode::Sync),
            None => self.committer(group)?.commit(&offsets, CommitMode::Sync),
        }
        .map_err(unavailable("commit"))
    }

    /// `Log::committed` with the metadata committed beside the offset.
    pub fn committed_with_metadata(
        &self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<(u64, String)>, LogError> {
        self.check_partition(topic, partition)?;
        let mut wanted = TopicPartitionList::new();
        wanted.add_partition(topic, partition as i32);
        let answer = self
            .committer(group)?
            .committed_offsets(wanted, REQUEST_TIMEOUT)
            .map_err(unavailable("committed offsets"))?;
        let committed = answer
            .find_partition(topic, partition as i32)
            .and_then(|element| match element.offset() {
                // The broker (Java) keeps metadata as a string and answers it
                // as UTF-8 whatever bytes a client sent, so `metadata()`,
                // which panics on anything else, is safe here.
                Offset::Offset(offset) if offset >= 0 => {
                    Some((offset as u64, element.metadata().to_string()))
                }
                _ => None,
            });
        Ok(committed)
    }

    /// Commits the open transaction of `transactional_id` with the group's
    /// `offsets` (topic, partition, next offset, metadata; sent with the group's
    /// metadata, so a fenced member cannot commit), then opens the next.
    /// On failure the transaction is aborted — its writes are gone — and
    /// `LogError::TransactionAborted` says whether the producer goes on with
    /// a new transaction or was fenced (then it is dropped).
    pub fn commit_transaction(
        &self,
        transactional_id: &str,
        offsets: &[(&str, u32, u64, &str)],
    ) -> Result<(), LogError> {
        let transaction = self.transaction(transactional_id)?;
        let group = self
            .group
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| LogError::Unavailable("exactly_once_v2 commits need the consumer group".into()))?;
        let metadata = group
            .consumer
            .group_metadata()
            .ok_or_else(|| LogError::Unavailable("the group has no metadata yet".into()))?;
        let mut list = TopicPartitionList::new();
        for (topic, partition, offset, offset_metadata) in offsets {
            list.add_partition_offset(topic, *partition as i32, Offset::Offset(*offset as i64))
                .map_err(unavailable("offsets"))?;
            set_metadata(&mut list, topic, *partition, offset_metadata);
        }
        let alone = transaction.gate.write().unwrap_or_else(|e| e.into_inner());
        let producer = &transaction.producer;
        if let Some(reason) = transaction.doomed() {
            let fenced = transaction.fenced_for_good();
            let gone = transaction.is_fatal()
                || producer
                    .abort_transaction(REQUEST_TIMEOUT)
                    .and_then(|()| producer.begin_transaction())
                    .is_err();
            *transaction.doomed.lock().unwrap_or_else(|e| e.into_inner()) = None;
            transaction.opened_now();
            drop(alone);
            if gone {
                self.forget_transaction(transactional_id);
            }
            return Err(LogError::TransactionAborted {
                transaction: transactional_id.to_string(),
                reason: format!("an append in it failed: {reason}"),
                fenced,
            });
        }
        #[cfg(any(test, feature = "fault-injection"))]
        if self.take_injected_abort(transactional_id) {
            let aborted = producer
                .abort_transaction(REQUEST_TIMEOUT)
                .and_then(|()| producer.begin_transaction());
            return Err(LogError::TransactionAborted {
                transaction: transactional_id.to_string(),
                reason: "injected abort".into(),
                fenced: aborted.is_err(),
            });
        }
        let committed = producer
            .send_offsets_to_transaction(&list, &metadata, REQUEST_TIMEOUT)
            .and_then(|()| producer.commit_transaction(REQUEST_TIMEOUT));
        let Err(error) = committed else {
            transaction.opened_now();
            return producer
                .begin_transaction()
                .map_err(unavailable("begin transaction"));
        };
        // Its writes are gone either way; what is left to decide is whether
        // this producer may go on (abortable) or was fenced: for good (a new
        // owner) or by the broker's timeout (see `fenced_for_good`).
        let fatal = transaction.is_fatal();
        let fenced = (is_fenced(&error) && !fatal) || transaction.fenced_for_good();
        let gone = fatal
            || is_fenced(&error)
            || producer
                .abort_transaction(REQUEST_TIMEOUT)
                .and_then(|()| producer.begin_transaction())
                .is_err();
        transaction.opened_now();
        drop(alone);
        if gone {
            self.forget_transaction(transactional_id);
        }
        Err(LogError::TransactionAborted {
            transaction: transactional_id.to_string(),
            reason: error.to_string(),
            fenced,
        })
    }

    /// Fault injection for tests: the next commit of `transactional_id`
    /// aborts its transaction (really: its writes are gone) instead.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn inject_abort(&self, transactional_id: &str) {
        self.injected_aborts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(transactional_id.to_string());
    }

    #[cfg(any(test, feature = "fault-injection"))]
    fn take_injected_abort(&self, transactional_id: &str) -> bool {
        self.injected_aborts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(transactional_id)
    }

    /// Aborts the open transaction of `transactional_id` and opens the next
    /// on the same producer, fencing no one: what a task revived after an
    /// abort starts from (the old incarnation may have appended since).
    /// Answers false if there is no usable producer of that id (none, or
    /// fenced): the caller then begins transactions anew.
    pub fn restart_transaction(&self, transactional_id: &str) -> bool {
        let Ok(transaction) = self.transaction(transactional_id) else {
            return false;
        };
        let _alone = transaction.gate.write().unwrap_or_else(|e| e.into_inner());
        let producer = &transaction.producer;
        // Aborting with no open transaction fails; beginning then decides.
        let _ = producer.abort_transaction(REQUEST_TIMEOUT);
        *transaction.doomed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        transaction.opened_now();
        !transaction.is_fatal() && producer.begin_transaction().is_ok()
    }

    /// Whether a transactional producer of `transactional_id` is here.
    pub fn has_transaction(&self, transactional_id: &str) -> bool {
        self.transaction(transactional_id).is_ok()
    }

    /// Whether the group assigns `topic`-`partition` to this member now,
    /// its assignment not lost: only then may a task of it start here
    /// outside a rebalance (a revival after an aborted transaction).
    pub fn holds(&self, topic: &str, partition: u32) -> bool {
        let Some(group) = self.group.read().unwrap_or_else(|e| e.into_inner()).clone() else {
            return false;
        };
        !group.consumer.assignment_lost()
            && group
                .consumer
                .assignment()
                .is_ok_and(|tpl| tpl.find_partition(topic, partition as i32).is_some())
    }

    /// The partitions of `topic` the group assigns to this member now
    /// (none while the assignment is lost).
    pub fn assigned(&self, topic: &str) -> Vec<u32> {
        let Some(group) = self.group.read().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Vec::new();
        };
        if group.consumer.assignment_lost() {
            return Vec::new();
        }
        group.consumer.assignment().map_or_else(
            |_| Vec::new(),
            |list| {
                list.elements_for_topic(topic)
                    .iter()
                    .filter_map(|element| u32::try_from(element.partition()).ok())
                    .collect()
            },
        )
    }

    /// Appends `records` (keyed or not, any partition: a sink topic's) inside
    /// the open transaction of `transactional_id`.
    pub fn append_in_transaction(
        &self,
        transactional_id: &str,
        topic: &str,
        records: &[ProducerRecord],
    ) -> Result<Vec<RecordPosition>, LogError> {
        let transaction = self.transaction(transactional_id)?;
        let partitions = self.partition_count(topic)?;
        let outgoing = records.iter().map(|record| Outgoing {
            key: record.key.as_deref(),
            value: Some(&record.value[..]),
            partition: record.partition,
            timestamp_ms: record.timestamp_ms,
            headers: &record.headers,
        });
        let _inside = transaction.gate.read().unwrap_or_else(|e| e.into_inner());
        self.send_with(&transaction.producer, topic, partitions, outgoing.collect())
            .map_err(|error| transaction.doom(error))
    }

    /// Whether the open transaction of `transactional_id` cannot commit (an
    /// append in it failed; see `TaskTransaction::doomed`), and if so
    /// whether its producer is fenced for good.
    pub fn transaction_doomed(&self, transactional_id: &str) -> Option<bool> {
        let transaction = self.transaction(transactional_id).ok()?;
        transaction.doomed().map(|_| transaction.fenced_for_good())
    }

    /// `transaction.timeout.ms` of the transactional producers (librdkafka's
    /// default: 60 s).
    fn transaction_timeout(&self) -> Duration {
        let ms = self
            .client_settings
            .get("transaction.timeout.ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(60_000);
        Duration::from_millis(ms)
    }

    /// The transaction of `transactional_id`.
    fn transaction(&self, transactional_id: &str) -> Result<Arc<TaskTransaction>, LogError> {
        self.transactions
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .find(|t| t.id == transactional_id)
            .cloned()
            .ok_or_else(|| LogError::Unavailable(format!("no transaction {transactional_id}")))
    }

    /// Drops the transactional producer of `transactional_id` without
    /// touching its transaction (it was fenced: the broker ended it).
    fn forget_transaction(&self, transactional_id: &str) {
        self.transactions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, t| t.id != transactional_id);
    }

    /// Drops the transactional producer of `transactional_id` (its task
    /// left, committed): its open transaction, empty, is aborted.
    pub fn end_transactions(&self, transactional_id: &str) {
        let mut transactions = self.transactions.write().unwrap_or_else(|e| e.into_inner());
        let mut ended = None;
        transactions.retain(|_, t| {
            if t.id == transactional_id {
                ended = Some(t.clone());
                false
            } else {
                true
            }
        });
        drop(transactions);
        if let Some(transaction) = ended {
            let _alone = transaction.gate.write().unwrap_or_else(|e| e.into_inner());
            let _ = transaction.producer.abort_transaction(REQUEST_TIMEOUT);
        }
    }

    /// Moves a partition's reader to `offset`. librdkafka drops what the queue
    /// prefetched from the old position.
    fn seek(&self, reader: &mut PartitionReader, offset: u64) -> Result<(), LogError> {
        let to = Offset::Offset(offset as i64);
        let (topic, partition) = (reader.topic.clone(), reader.partition as i32);
        if let Queue::Group(_) = &reader.queue {
            // A partition the group assigned a moment ago is not fetching yet
            // and refuses a seek ("erroneous state") until it is. It cannot be
            // assigned again here (the group owns the assignment): ask again.
            let group = self
                .group
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .ok_or_else(|| LogError::Unavailable(format!("{topic}-{partition} left the group")))?;
            let deadline = Instant::now() + REQUEST_TIMEOUT;
            loop {
                match group.consumer.seek(&topic, partition, to, REQUEST_TIMEOUT) {
                    Ok(()) => break,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(LogError::Unavailable(format!(
                            "cannot seek {topic}-{partition} to {offset}: {e}"
                        )));
                    }
                    // Polling librdkafka's partition state, which has no notification.
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
            reader.next = offset;
            reader.eof_end = 0;
            return Ok(());
        }
        if self.reader.seek(&topic, partition, to, REQUEST_TIMEOUT).is_err() {
            // A partition whose fetcher stopped on an error, or that was
            // assigned a moment ago and is not fetching yet, refuses a seek
            // ("erroneous state"): assign it again at `offset` instead.
            self.unassign(&reader.topic, reader.partition)?;
            // The new handle is of the same librdkafka queue as the old one,
            // whose drop clears the queue's callback: replace, then watch.
            let mut queue = self.split(&reader.topic, reader.partition)?;
            watch(&self.events, &mut queue, &reader.topic, reader.partition);
            reader.queue = Queue::Reader(queue);
            self.assign_at(&reader.topic, reader.partition, offset)?;
        }
        reader.next = offset;
        reader.eof_end = 0;
        Ok(())
    }
}

impl KafkaLog {
    /// Appends a tombstone of `key` (a record without a value, which
    /// compaction removes with the key's earlier records) to the key's
    /// partition, and waits for its delivery. A reader sees an empty value.
    pub fn append_tombstone(&self, topic: &str, key: &[u8]) -> Result<RecordPosition, LogError> {
        self.partition_count(topic)?;
        let batch = Arc::new(Batch::new(1));
        let message: BaseRecord<'_, [u8], [u8], Box<Delivery>> = BaseRecord::with_opaque_to(
            topic,
            Box::new(Delivery {
                batch: batch.clone(),
                index: 0,
            }),
        )
        .key(key);
        self.producer
            .send(message)
            .map_err(|(e, _)| LogError::Unavailable(format!("cannot send to `{topic}`: {e}")))?;
        let position = batch.wait(1)?.remove(0);
        let mut ends = self.appended_end.lock().unwrap_or_else(|e| e.into_inner());
        let end = ends.entry((topic.to_string(), position.partition)).or_insert(0);
        *end = (*end).max(position.offset + 1);
        drop(ends);
        self.notify(topic, position.partition);
        Ok(position)
    }
}

/// Makes records arriving in an empty queue call the append listeners.
/// The callback fires only when the queue goes from empty to non-empty,
/// and librdkafka also queues control events (a version barrier at each
/// assignment and seek). So it is set before the partition is assigned, and
/// every read serves the queue: a barrier then wakes the runtime once (a
/// harmless empty read) instead of leaving the queue non-empty and the
/// callback silent.
fn watch<C: ConsumerContext>(
    events: &Mutex<mpsc::Sender<Event>>,
    queue: &mut PartitionQueue<C>,
    topic: &str,
    partition: u32,
) {
    let events = events.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let name: Arc<str> = topic.into();
    queue.set_nonempty_callback(move || {
        let _ = events.send(Event::Appended(name.clone(), partition));
    });
}

fn to_record(message: &BorrowedMessage<'_>, partition: u32) -> Record {
    let headers = message
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|h| {
                    (
                        h.key.to_string(),
                        Bytes::copy_from_slice(h.value.unwrap_or_default()),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Record {
        partition,
        offset: message.offset().max(0) as u64,
        timestamp_ms: message.timestamp().to_millis().unwrap_or(0),
        key: message.key().map(Bytes::copy_from_slice),
        value: message.payload().map(Bytes::copy_from_slice).unwrap_or_default(),
        headers,
    }
}

/// The delivery reports of one `append`: each record's position, in order.
struct Batch {
    state: Mutex<BatchState>,
    progress: Condvar,
}

struct BatchState {
    positions: Vec<Option<RecordPosition>>,
    reported: usize,
    error: Option<LogError>,
}

impl Batch {
    fn new(len: usize) -> Batch {
        Batch {
            state: Mutex::new(BatchState {
                positions: vec![None; len],
                reported: 0,
                error: None,
            }),
            progress: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BatchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn report(&self, index: usize, result: Result<RecordPosition, LogError>) {
        let mut state = self.lock();
        match result {
            Ok(position) => state.positions[index] = Some(position),
            Err(error) => {
                state.error.get_or_insert(error);
            }
        }
        state.reported += 1;
        self.progress.notify_all();
    }

    fn wait_for_progress(&self, timeout: Duration) {
        let state = self.lock();
        let before = state.reported;
        let _ = self
            .progress
            .wait_timeout_while(state, timeout, |s| s.reported == before);
    }

    /// Waits for the reports of the first `sent` records. librdkafka reports
    /// every enqueued record (`message.timeout.ms` bounds it), so this ends.
    fn wait(&self, sent: usize) -> Result<Vec<RecordPosition>, LogError> {
        let mut state = self.lock();
        while state.reported < sent {
            state = self.progress.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(error) = &state.error {
            return Err(error.clone());
        }
        state.positions[..sent]
            .iter()
            .map(|p| p.ok_or_else(|| LogError::Unavailable("a record was not delivered".into())))
            .collect()
    }

    fn delivered_positions(&self) -> Vec<RecordPosition> {
        self.lock().positions.iter().flatten().copied().collect()
    }
}

struct Delivery {
    batch: Arc<Batch>,
    index: usize,
}

/// A record to send: a `ProducerRecord`, or a changelog write whose `value`
/// may be `None`, a tombstone.
struct Outgoing<'a> {
    key: Option<&'a [u8]>,
    value: Option<&'a [u8]>,
    partition: Option<u32>,
    timestamp_ms: Option<i64>,
    headers: &'a [(String, Bytes)],
}

impl Outgoing<'_> {
    fn of(record: &ProducerRecord) -> Outgoing<'_> {
        Outgoing {
            key: record.key.as_deref(),
            value: Some(&record.value[..]),
            partition: record.partition,
            timestamp_ms: record.timestamp_ms,
            headers: &record.headers,
        }
    }
}

/// librdkafka's log lines through `tracing` (target `librdkafka`), less its
/// warning that a setting does not apply to this kind of client: the
/// `[kafka]` table goes to producer and consumers alike, by design.
pub(crate) struct ClientLog;

impl ClientContext for ClientLog {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        forward_log(level, facility, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        forward_error(&error, reason);
    }
}

impl ConsumerContext for ClientLog {}

/// librdkafka's client errors through `tracing`, less the end-of-partition
/// events `enable.partition.eof` (exactly_once_v2) makes it report there too:
/// reads learn of those through their queues.
pub(crate) fn forward_error(error: &KafkaError, reason: &str) {
    if matches!(
        error,
        KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
    ) {
        tracing::debug!(target: "librdkafka", "{reason}");
        return;
    }
    tracing::error!(target: "librdkafka", error = %error, "{reason}");
}

pub(crate) fn forward_log(level: RDKafkaLogLevel, facility: &str, message: &str) {
    if facility == "CONFWARN" && message.contains("will be ignored by this") {
        tracing::debug!(target: "librdkafka", "{facility} {message}");
        return;
    }
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => {
            tracing::error!(target: "librdkafka", "{facility} {message}");
        }
        RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", "{facility} {message}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
            tracing::info!(target: "librdkafka", "{facility} {message}");
        }
        RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", "{facility} {message}"),
    }
}

/// Hands each delivery report to its batch.
struct DeliveryContext;

impl ClientContext for DeliveryContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        forward_log(level, facility, message);
    }
}

impl ProducerContext for DeliveryContext {
    type DeliveryOpaque = Box<Delivery>;

    fn delivery(&self, result: &DeliveryResult<'_>, delivery: Box<Delivery>) {
        let result = match result {
            Ok(message) => Ok(RecordPosition {
                partition: message.partition().max(0) as u32,
                offset: message.offset().max(0) as u64,
            }),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::UnknownTopicOrPartition), message)) => {
                Err(LogError::UnknownTopic(message.topic().to_string()))
            }
            Err((KafkaError::MessageProduction(code), message)) if is_rejection(*code) => {
                Err(LogError::Rejected {
                    topic: message.topic().to_string(),
                    reason: format!("the broker refused it: {code}"),
                })
            }
            Err((e, message)) => Err(LogError::Unavailable(format!(
                "delivery to `{}` failed: {e}",
                message.topic()
            ))),
        };
        delivery.batch.report(delivery.index, result);
    }
}

/// Errors that mean "no leader to answer yet": a new topic, a leader election.
fn is_leader_moving(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::UnknownTopicOrPartition
                | RDKafkaErrorCode::UnknownLeaderEpoch
                | RDKafkaErrorCode::FencedLeaderEpoch
        )
    )
}

fn client_error(what: &'static str) -> impl Fn(KafkaError) -> LogError {
    move |e| LogError::Unavailable(format!("cannot create the Kafka {what}: {e}"))
}

/// Sets the metadata committed with `topic`/`partition` of `offsets` (added
/// before); an empty one is left unset, as a plain commit sends it.
fn set_metadata(offsets: &mut TopicPartitionList, topic: &str, partition: u32, metadata: &str) {
    if metadata.is_empty() {
        return;
    }
    if let Some(mut element) = offsets.find_partition(topic, partition as i32) {
        element.set_metadata(metadata);
    }
}

/// Whether a failed transaction's producer was fenced for good (another
/// producer of its id, or the broker bumped its epoch): it cannot go on.
fn is_fenced(error: &KafkaError) -> bool {
    use RDKafkaErrorCode::{
        Fenced, InvalidProducerEpoch, ProducerFenced, TransactionalIdAuthorizationFailed,
    };
    match error {
        KafkaError::Transaction(e) => {
            e.is_fatal()
                || matches!(
                    e.code(),
                    Fenced | ProducerFenced | InvalidProducerEpoch | TransactionalIdAuthorizationFailed
                )
        }
        _ => matches!(
            error.rdkafka_error_code(),
            Some(Fenced | ProducerFenced | InvalidProducerEpoch)
        ),
    }
}

/// A consumer that reads by manual assignment and never joins or commits
/// (the shared reader, a re-reader): a position the broker no longer has is
/// an error, not a reset.
fn reader_consumer(mut config: ClientConfig, client_id: &str) -> Result<BaseConsumer<ClientLog>, LogError> {
    config
        .set("client.id", client_id)
        .set("group.id", READER_GROUP)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "error")
        .set("allow.auto.create.topics", "false")
        .create_with_context(ClientLog)
        .map_err(client_error("reader consumer"))
}

fn unavailable(what: &'static str) -> impl Fn(KafkaError) -> LogError {
    move |e| LogError::Unavailable(format!("kafka {what}: {e}"))
}

/// Runs an admin future to completion on this thread. The admin client's own
/// thread completes it; no async runtime is needed (and `Log` is sync).
fn block_on<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut context = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        match future.as_mut().poll(&mut context) {
            Poll::Ready(output) => return output,
            Poll::Pending => std::thread::park(),
        }
    }
}

/// The test broker (Apache Kafka itself), shared with the end-to-end tests.
#[cfg(test)]
#[path = "../../../tests/common/kafka.rs"]
mod test_broker;

#[cfg(test)]
mod tests {
    use super::test_broker::{broker, unique};
    use super::*;
    use crate::log::contract;

    fn connect(bootstrap: &str) -> Arc<KafkaLog> {
        KafkaLog::with_settings(bootstrap, &BTreeMap::new(), 1).expect("connect to the test broker")
    }

    /// The contract's fixed names (`t`, `g`, …) made unique per test, since
    /// every test of the binary shares one broker.
    struct Namespaced {
        log: Arc<KafkaLog>,
        prefix: String,
    }

    impl Namespaced {
        fn new(log: Arc<KafkaLog>) -> Namespaced {
            Namespaced {
                log,
                prefix: unique("contract"),
            }
        }

        fn name(&self, name: &str) -> String {
            format!("{}-{name}", self.prefix)
        }

        /// Errors name the caller's topic, not the prefixed one.
        fn strip(&self, error: LogError) -> LogError {
            let strip = |topic: String| {
                topic
                    .strip_prefix(&format!("{}-", self.prefix))
                    .map(str::to_string)
                    .unwrap_or(topic)
            };
            match error {
                LogError::UnknownTopic(topic) => LogError::UnknownTopic(strip(topic)),
                LogError::UnknownPartition {
                    topic,
                    partition,
                    partitions,
                } => LogError::UnknownPartition {
                    topic: strip(topic),
                    partition,
                    partitions,
                },
                LogError::PartitionCountMismatch {
                    topic,
                    existing,
                    requested,
                } => LogError::PartitionCountMismatch {
                    topic: strip(topic),
                    existing,
                    requested,
                },
                other => other,
            }
        }
    }

    impl Log for Namespaced {
        fn ensure_topic(&self, topic: &str, partitions: u32) -> Result<(), LogError> {
            self.log
                .ensure_topic(&self.name(topic), partitions)
                .map_err(|e| self.strip(e))
        }
        fn partitions(&self, topic: &str) -> Result<u32, LogError> {
            self.log.partitions(&self.name(topic)).map_err(|e| self.strip(e))
        }
        fn append(&self, topic: &str, records: Vec<ProducerRecord>) -> Result<Vec<RecordPosition>, LogError> {
            self.log
                .append(&self.name(topic), records)
                .map_err(|e| self.strip(e))
        }
        fn append_is_atomic(&self) -> bool {
            self.log.append_is_atomic()
        }
        fn read(
            &self,
            topic: &str,
            p: u32,
            offset: u64,
            max: usize,
            out: &mut Vec<Record>,
        ) -> Result<(), LogError> {
            self.log
                .read(&self.name(topic), p, offset, max, out)
                .map_err(|e| self.strip(e))
        }
        fn end_offset(&self, topic: &str, p: u32) -> Result<u64, LogError> {
            self.log
                .end_offset(&self.name(topic), p)
                .map_err(|e| self.strip(e))
        }
        fn start_offset(&self, topic: &str, p: u32) -> Result<u64, LogError> {
            self.log
                .start_offset(&self.name(topic), p)
                .map_err(|e| self.strip(e))
        }
        fn commit(&self, group: &str, topic: &str, p: u32, offset: u64) -> Result<(), LogError> {
            self.log
                .commit(&self.name(group), &self.name(topic), p, offset)
                .map_err(|e| self.strip(e))
        }
        fn committed(&self, group: &str, topic: &str, p: u32) -> Result<Option<u64>, LogError> {
            self.log
                .committed(&self.name(group), &self.name(topic), p)
                .map_err(|e| self.strip(e))
        }
        fn add_append_listener(&self, listener: AppendListener) {
            self.log.add_append_listener(listener);
        }
        fn enforce_retention(
            &self,
            topic: &str,
            p: u32,
            retention: Retention,
            keep_from: u64,
            now_ms: i64,
        ) -> Result<u64, LogError> {
            self.log
                .enforce_retention(&self.name(topic), p, retention, keep_from, now_ms)
                .map_err(|e| self.strip(e))
        }
    }

    // The shared contract. What it does not cover on Kafka: retention (Kafka's
    // own applies; `enforce_retention` only answers the start offset, tested
    // below) and atomic batches (checked before sending; see the module doc).

    #[test]
    fn contract_keyed_records_follow_kafkas_partitioner() {
        let Some(broker) = broker() else { return };
        contract::keyed_records_follow_kafkas_partitioner(&Namespaced::new(connect(&broker.bootstrap)));
    }

    #[test]
    fn contract_unkeyed_records_are_spread_and_bad_batches_rejected_whole() {
        let Some(broker) = broker() else { return };
        contract::unkeyed_records_are_spread_and_bad_batches_rejected_whole(&Namespaced::new(connect(
            &broker.bootstrap,
        )));
    }

    #[test]
    fn contract_commits_are_per_group_and_partition() {
        let Some(broker) = broker() else { return };
        contract::commits_are_per_group_and_partition(&Namespaced::new(connect(&broker.bootstrap)));
    }

    /// `wire_size` is the size librdkafka checks: around a small
    /// `message.max.bytes`, a record is refused at `send` exactly when
    /// `wire_size` is over it (no broker needed: the check is local).
    #[test]
    fn wire_size_is_what_librdkafka_checks_against_message_max_bytes() {
        use rdkafka::producer::BaseProducer;
        const MAX: usize = 1_000;
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:9")
            .set("message.max.bytes", MAX.to_string())
            .create()
            .expect("a producer needs no broker to be made");
        let long_name = "n".repeat(70);
        let header_sets: Vec<Vec<(String, Bytes)>> = vec![
            vec![],
            vec![("a".into(), Bytes::from(vec![1u8; 63]))],
            vec![
                ("a".into(), Bytes::from(vec![1u8; 64])),
                (long_name, Bytes::new()),
            ],
            vec![("taskstream.retry.entry".into(), Bytes::from(vec![2u8; 200])); 3],
        ];
        let mut refused = 0;
        for headers in &header_sets {
            for key_len in [0usize, 10, 64] {
                for value_len in 500..=MAX {
                    let key = vec![7u8; key_len];
                    let value = vec![9u8; value_len];
                    let outgoing = Outgoing {
                        key: (key_len > 0).then_some(&key[..]),
                        value: Some(&value[..]),
                        partition: Some(0),
                        timestamp_ms: None,
                        headers,
                    };
                    let mut owned = OwnedHeaders::new();
                    for (name, value) in headers {
                        owned = owned.insert(Header {
                            key: name,
                            value: Some(&value[..]),
                        });
                    }
                    let mut record = BaseRecord::<[u8], [u8]>::to("t")
                        .payload(&value[..])
                        .headers(owned);
                    if key_len > 0 {
                        record = record.key(&key[..]);
                    }
                    let too_large = match producer.send(record) {
                        Ok(()) => false,
                        Err((e, _)) => {
                            assert_eq!(
                                e.rdkafka_error_code(),
                                Some(RDKafkaErrorCode::MessageSizeTooLarge),
                                "{e}"
                            );
                            true
                        }
                    };
                    assert_eq!(
                        wire_size(&outgoing) > MAX,
                        too_large,
                        "key {key_len}, value {value_len}, headers {:?}",
                        headers
                            .iter()
                            .map(|(n, v)| (n.len(), v.len()))
                            .collect::<Vec<_>>()
                    );
                    refused += usize::from(too_large);
                }
            }
        }
        assert!(refused > 0, "the sizes cross the limit");
        // What was accepted waits for a broker that is not there.
        producer.purge(rdkafka::producer::PurgeConfig::default().queue());
    }

    /// A batch with a record over the producer's `message.max.bytes` is
    /// refused whole, before anything is sent: none of it lands.
    #[test]
    fn a_batch_with_a_record_over_message_max_bytes_is_refused_whole() {
        let Some(broker) = broker() else { return };
        let settings = BTreeMap::from([("message.max.bytes".to_string(), "1000".to_string())]);
        let log =
            KafkaLog::with_settings(&broker.bootstrap, &settings, 1).expect("connect to the test broker");
        let topic = unique("refused");
        log.ensure_topic(&topic, 1).unwrap();
        let small = || ProducerRecord {
            partition: Some(0),
            ..ProducerRecord::keyed("k", "small")
        };
        let big = ProducerRecord {
            partition: Some(0),
            ..ProducerRecord::keyed("k", vec![b'x'; 2_000])
        };
        assert!(log.check_record(&topic, &small()).is_ok());
        assert!(matches!(
            log.check_record(&topic, &big),
            Err(LogError::Rejected { .. })
        ));
        match log.append(&topic, vec![small(), big, small()]) {
            Err(LogError::Rejected {
                topic: refused,
                reason,
            }) => {
                assert_eq!(refused, topic);
                assert!(reason.contains("message.max.bytes"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            log.append(&topic, vec![small()]).unwrap()[0].offset,
            0,
            "none of the batch landed"
        );
    }

    /// An offset commit keeps the metadata sent with it; a plain commit
    /// after it keeps none.
    #[test]
    fn committed_offsets_keep_their_metadata() {
        let Some(broker) = broker() else { return };
        let log = connect(&broker.bootstrap);
        let (topic, group) = (unique("metadata-topic"), unique("metadata-group"));
        log.ensure_topic(&topic, 1).unwrap();
        assert_eq!(log.committed_with_metadata(&group, &topic, 0).unwrap(), None);
        log.commit_with_metadata(&group, &topic, 0, 5, "rd1:AB").unwrap();
        assert_eq!(
            log.committed_with_metadata(&group, &topic, 0).unwrap(),
            Some((5, "rd1:AB".to_string()))
        );
        log.commit(&group, &topic, 0, 6).unwrap();
        assert_eq!(
            log.committed_with_metadata(&group, &topic, 0).unwrap(),
            Some((6, String::new()))
        );
    }

    /// Keys land where Kafka's Java client puts them: librdkafka's
    /// `murmur2_random` against the vectors of Kafka's own partitioner.
    #[test]
    fn keyed_records_land_on_the_java_clients_partition() {
        let Some(broker) = broker() else { return };
        let log = connect(&broker.bootstrap);
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/kafka-default-partitioner.tsv"
        );
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
        let rows: Vec<Vec<&str>> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.split('\t').collect())
            .collect();
        assert!(rows.len() >= 18, "{path} has {} rows", rows.len());
        for (partitions, column) in [(8, 2), (12, 3), (100, 4)] {
            let topic = unique(&format!("partitioner-{partitions}"));
            log.ensure_topic(&topic, partitions).unwrap();
            let records = rows
                .iter()
                .map(|row| ProducerRecord::keyed(row[0].as_bytes().to_vec(), "v"))
                .collect();
            let positions = log.append(&topic, records).unwrap();
            for (row, position) in rows.iter().zip(&positions) {
                assert_eq!(
                    position.partition,
                    row[column].parse::<u32>().unwrap(),
                    "key {:?} among {partitions} partitions",
                    row[0]
                );
            }
        }
    }

    #[test]
    fn changelog_and_metadata_topics_are_created_compacted() {
        let Some(broker) = broker() else { return };
        let log = connect(&broker.bootstrap);
        let app = unique("app");
        let cases = [
            (format!("{app}-counts-changelog"), "compact"),
            (format!("{app}-metadata"), "compact"),
            (format!("{app}-counts-retry"), "delete"),
            (format!("{app}-events"), "delete"),
        ];
        for (topic, _) in &cases {
            log.ensure_topic(topic, 3).unwrap();
            // Idempotent: a second call finds it with the same partitions.
            log.ensure_topic(topic, 3).unwrap();
            assert_eq!(log.partitions(topic).unwrap(), 3);
        }
        let resources: Vec<_> = cases
            .iter()
            .map(|(topic, _)| rdkafka::admin::ResourceSpecifier::Topic(topic))
            .collect();
        let described = block_on(log.admin.describe_configs(
            &resources,
            &AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT)),
        ))
        .unwrap();
        for ((topic, policy), resource) in cases.iter().zip(described) {
            let resource = resource.unwrap_or_else(|e| panic!("describe {topic}: {e}"));
            let found = resource
                .get("cleanup.policy")
                .and_then(|entry| entry.value.clone());
            assert_eq!(found.as_deref(), Some(*policy), "cleanup.policy of {topic}");
        }
    }

    /// Kafka pushes nothing: a caught-up reader learns of records another
    /// client produced through its partition queue's callback.
    #[test]
    fn listeners_hear_of_records_another_client_produced() {
        let Some(broker) = broker() else { return };
        let reader = connect(&broker.bootstrap);
        let writer = connect(&broker.bootstrap);
        let topic = unique("listened");
        reader.ensure_topic(&topic, 2).unwrap();
        let (heard, hearing) = mpsc::channel();
        let wanted = topic.clone();
        reader.add_append_listener(Arc::new(move |topic, partition| {
            if topic == wanted {
                let _ = heard.send(partition);
            }
        }));
        let mut out = Vec::new();
        reader.read(&topic, 1, 0, 10, &mut out).unwrap();
        assert!(out.is_empty());
        writer
            .append(
                &topic,
                vec![ProducerRecord {
                    value: "hello".into(),
                    partition: Some(1),
                    ..Default::default()
                }],
            )
            .unwrap();
        // As the runtime does: read once after each call. A call may come
        // with nothing to read (librdkafka's control events wake it too), but
        // the record must arrive through calls alone.
        let deadline = Instant::now() + Duration::from_secs(30);
        while out.is_empty() {
            let partition = hearing
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .expect("the reader's listener was not called for the record");
            assert_eq!(partition, 1);
            reader.read(&topic, 1, 0, 10, &mut out).unwrap();
        }
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].value, "hello");
        assert_eq!(reader.end_offset(&topic, 1).unwrap(), 1);
    }

    /// Everything a record carries survives the round trip; a large batch is
    /// appended in one go and read back in order, sequentially and after
    /// seeks; offsets before the start are out of range.
    #[test]
    fn records_round_trip_and_deleted_offsets_are_out_of_range() {
        let Some(broker) = broker() else { return };
        let log = connect(&broker.bootstrap);
        let topic = unique("roundtrip");
        log.ensure_topic(&topic, 1).unwrap();
        let first = ProducerRecord {
            key: Some("k".into()),
            value: "v".into(),
            partition: None,
            timestamp_ms: Some(1_700_000_000_123),
            headers: vec![("h1".into(), "x".into()), ("h2".into(), Bytes::new())],
        };
        log.append(&topic, vec![first.clone()]).unwrap();
        let count = 20_000;
        let records: Vec<ProducerRecord> = (0..count)
            .map(|i| ProducerRecord {
                value: format!("{i}").into(),
                partition: Some(0),
                ..Default::default()
            })
            .collect();
        let started = Instant::now();
        let positions = log.append(&topic, records).unwrap();
        let appended_in = started.elapsed();
        let offsets: Vec<u64> = positions.iter().map(|p| p.offset).collect();
        assert_eq!(offsets, (1..=count as u64).collect::<Vec<_>>());

        let mut out = Vec::new();
        log.read(&topic, 0, 0, 1, &mut out).unwrap();
        assert_eq!(out[0].offset, 0, "{:?}", out[0]);
        assert_eq!(out[0].key.as_deref(), Some(&b"k"[..]));
        assert_eq!(out[0].value, "v");
        assert_eq!(out[0].timestamp_ms, 1_700_000_000_123);
        assert_eq!(out[0].headers, first.headers);

        let started = Instant::now();
        let mut next = 1;
        while next <= count as u64 {
            out.clear();
            log.read(&topic, 0, next, 500, &mut out).unwrap();
            assert!(!out.is_empty() && out.len() <= 500);
            for record in &out {
                assert_eq!(record.offset, next);
                assert_eq!(record.value, format!("{}", next - 1));
                next += 1;
            }
        }
        let read_in = started.elapsed();
        eprintln!(
            "{count} records: appended in {:.0} ms, read back in {:.0} ms",
            appended_in.as_secs_f64() * 1e3,
            read_in.as_secs_f64() * 1e3
        );
        out.clear();
        log.read(&topic, 0, 10_000, 3, &mut out).unwrap();
        let found: Vec<u64> = out.iter().map(|r| r.offset).collect();
        assert_eq!(found, vec![10_000, 10_001, 10_002], "after a seek back");

        // Kafka removes records (here by DeleteRecords, as retention would);
        // reading below the new start is out of range, not silently skipped.
        let mut below = TopicPartitionList::new();
        below
            .add_partition_offset(&topic, 0, Offset::Offset(5_000))
            .unwrap();
        block_on(log.admin.delete_records(
            &below,
            &AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT)),
        ))
        .unwrap();
        assert_eq!(log.start_offset(&topic, 0).unwrap(), 5_000);
        assert_eq!(
            log.enforce_retention(&topic, 0, Retention::default(), 0, 0)
                .unwrap(),
            5_000
        );
        match log.read(&topic, 0, 10, 10, &mut out) {
            Err(LogError::OffsetOutOfRange {
                requested: 10,
                earliest: 5_000,
                ..
            }) => {}
            other => panic!("expected OffsetOutOfRange, got {other:?}"),
        }
        out.clear();
        log.read(&topic, 0, 5_000, 1, &mut out).unwrap();
        assert_eq!(out[0].offset, 5_000);
    }

    /// One step of the model test.
    #[derive(Debug, Clone)]
    enum Op {
        /// Records as (key index or none, explicit partition or none).
        Append(Vec<(Option<u8>, Option<u32>)>),
        Read {
            partition: u32,
            at: u8,
            max: usize,
        },
        End(u32),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let record = (
            proptest::option::of(0u8..20),
            proptest::option::weighted(0.2, 0u32..3),
        );
        prop_oneof![
            proptest::collection::vec(record, 1..40).prop_map(Op::Append),
            (0u32..3, any::<u8>(), 1usize..60).prop_map(|(partition, at, max)| Op::Read {
                partition,
                at,
                max
            }),
            (0u32..3).prop_map(Op::End),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, ..Default::default() })]

        /// In the way of redb's fuzz target: random appends (keyed, unkeyed,
        /// to a partition), reads at random offsets (so forward and backward
        /// seeks, reads at and past the end) and end offsets give on Kafka
        /// exactly what the embedded `MemoryLog` gives.
        #[test]
        fn kafka_log_answers_as_the_memory_log_does(ops in proptest::collection::vec(op(), 1..40)) {
            let Some(broker) = broker() else { return Ok(()) };
            static LOG: std::sync::OnceLock<Arc<KafkaLog>> = std::sync::OnceLock::new();
            let kafka = LOG.get_or_init(|| connect(&broker.bootstrap));
            let model = crate::log::MemoryLog::new();
            let topic = unique("model");
            kafka.ensure_topic(&topic, 3).unwrap();
            model.ensure_topic(&topic, 3).unwrap();
            let mut written = 0i64;
            for op in ops {
                match op {
                    Op::Append(records) => {
                        let records: Vec<ProducerRecord> = records
                            .into_iter()
                            .map(|(key, partition)| {
                                written += 1;
                                ProducerRecord {
                                    key: key.map(|k| Bytes::from(format!("key-{k}"))),
                                    value: Bytes::from(format!("value-{written}")),
                                    partition,
                                    timestamp_ms: Some(1_700_000_000_000 + written),
                                    headers: vec![("n".into(), Bytes::from(written.to_string()))],
                                }
                            })
                            .collect();
                        let expected = model.append(&topic, records.clone()).unwrap();
                        proptest::prop_assert_eq!(kafka.append(&topic, records).unwrap(), expected);
                    }
                    Op::Read { partition, at, max } => {
                        let end = model.end_offset(&topic, partition).unwrap();
                        let offset = u64::from(at) % (end + 2);
                        let (mut expected, mut found) = (Vec::new(), Vec::new());
                        model.read(&topic, partition, offset, max, &mut expected).unwrap();
                        kafka.read(&topic, partition, offset, max, &mut found).unwrap();
                        // Kafka may answer fewer than `max` (what one fetch
                        // brought); never other records, never none when some exist.
                        proptest::prop_assert!(found.len() <= expected.len());
                        proptest::prop_assert_eq!(found.is_empty(), expected.is_empty());
                        proptest::prop_assert_eq!(&found[..], &expected[..found.len()]);
                    }
                    Op::End(partition) => {
                        proptest::prop_assert_eq!(
                            kafka.end_offset(&topic, partition).unwrap(),
                            model.end_offset(&topic, partition).unwrap()
                        );
                    }
                }
            }
        }
    }
}
