//! Where a task resumes, at start or when it is added while running: open its
//! store; read the positions it committed (a persistent store's checkpoint,
//! committed with its data, else the log's committed offsets); scan its
//! retry-topic partition for what is still pending; and plan what rebuilds
//! its store. The answer is a `TaskInit` for the scheduler.
//!
//! On Kafka the positions are reconciled (`kafka_positions`) and the store
//! catches up with its changelog (`changelog_restore`): from its checkpoint's
//! changelog offset when it has a usable one, else emptied and from the start.

use super::RuntimeError;
use super::changelog::Changelog;
use super::retry::RetryBacklog;
use super::retry_done;
use super::retry_queue::RetryQueue;
use super::shared::Shared;
use super::stores::TaskStore;
use super::task::{Restore, TaskInit, task_id};
use super::work::{Gating, HoldLimits};
use crate::config::{ProcessingOrder, RetryPolicy, StoreKind};
use crate::log::KafkaLog;
use crate::metrics::TaskMeters;
use crate::store::Checkpoint;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a task added again waits for its previous store to close.
const CLOSE_WAIT: Duration = Duration::from_secs(30);

/// Waits until the store of a previous incarnation of task `id` is closed
/// (its last commit written), so the file is not opened twice.
fn wait_until_closed(shared: &Shared, id: &Arc<str>) -> Result<(), RuntimeError> {
    let deadline = Instant::now() + CLOSE_WAIT;
    loop {
        let open = shared
            .closing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(task, store)| task == id && store.is_open());
        if !open {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(RuntimeError::Unavailable {
                reason: format!("task {id} is still closing its store"),
                retry_after: Duration::from_secs(1),
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Plans task `partition` of pipeline `pipeline`. `start` overrides where a
/// task without a checkpoint of its own resumes (a persistent store that has
/// committed resumes at its checkpoint: its data is as of that point).
/// `revival`: the task is started again after its transaction aborted (see
/// `task::Corruption`), its records below this offset processed before.
pub(crate) fn plan(
    shared: &Shared,
    pipeline: usize,
    partition: u32,
    start: Option<u64>,
    revival: Option<u64>,
) -> Result<TaskInit, RuntimeError> {
    let config = &shared.config;
    let log = shared.log.as_ref();
    let p = &shared.pipelines[pipeline];
    let group = config.application_id.as_str();
    let id: Arc<str> = task_id(&p.name, partition).into();
    wait_until_closed(shared, &id)?;
    let store = match (p.store_kind, &config.data_dir) {
        (StoreKind::Persistent, Some(dir)) => {
            TaskStore::open_persistent(dir, group, &id, config.store_cache_bytes).map_err(|e| {
                RuntimeError::Storage {
                    path: e.path,
                    message: e.message,
                }
            })?
        }
        _ => TaskStore::memory(),
    };
    let store = match &p.changelog_topic {
        Some(topic) => store.with_changelog(Changelog::new(topic.clone(), partition)),
        None => store,
    };
    let earliest = log.start_offset(&p.topic, partition)?;
    let retry_earliest = log.start_offset(&p.retry_topic, partition)?;
    let retry_end = log.end_offset(&p.retry_topic, partition)?;
    let checkpoint = store.checkpoint();
    let (committed, retry_committed, retry_done) = match (&checkpoint, store.persistent()) {
        _ if let Some(kafka) = log.as_kafka() => {
            kafka_positions(shared, kafka, pipeline, partition, start, checkpoint.as_ref())?
        }
        (Some(c), _) => (Some(c.watermark), Some(c.retry_offset), c.retry_done.clone()),
        (None, Some(_)) => (start, None, Vec::new()),
        (None, None) => (
            start.or(log.committed(group, &p.topic, partition)?),
            log.committed(group, &p.retry_topic, partition)?,
            Vec::new(),
        ),
    };
    let resume = committed.unwrap_or(earliest).max(earliest);
    let retry_start = retry_committed.unwrap_or(retry_earliest).max(retry_earliest);
    let gating = gating_of(p.retry_policy, p.order, shared.exactly_once());
    let keyed = gating != Gating::Off;
    let retry_done_kept = retry_done.clone();
    let backlog = RetryBacklog::scan(
        log,
        &p.retry_topic,
        partition,
        retry_start..retry_end,
        retry_done,
        resume,
    )?;
    let mut retry = RetryQueue::new(
        retry_start,
        keyed,
        config.max_in_flight_records,
        backlog.final_offsets,
    )
    .with_fetch_delay(super::retry_queue::fetch_delay_ms(
        config.retry_backoff_ms,
        config.retry_backoff_max_ms,
    ));
    retry.mark_committed(retry_committed.unwrap_or(retry_start), 0);
    let restore = if store.changelog().is_some() {
        if shared.exactly_once()
            && let Some(kafka) = log.as_kafka()
        {
            // Before the restore: fencing the task's previous producer aborts
            // its open transaction, so the changelog reads to its end now.
            let written = [&p.retry_topic, &p.dead_letter_topic]
                .into_iter()
                .chain(p.changelog_topic.as_ref())
                .map(|topic| (topic.to_string(), partition))
                .collect::<Vec<_>>();
            // A revival goes on with its producer, whose transaction it
            // restarted (see `revival`): beginning anew would fence no one
            // but itself, yet a zombie that does not know it is one would
            // fence the task's owner.
            let transactional_id = shared.transactional_id(&id);
            if revival.is_none() || !kafka.has_transaction(&transactional_id) {
                kafka.begin_transactions(&transactional_id, &written)?;
            }
        }
        // Under exactly-once the transaction is the commit point: a local
        // copy is current only if its checkpoint is where the group's
        // offsets are; any other is rebuilt from the changelog.
        let trusted = !shared.exactly_once()
            || checkpoint
                .as_ref()
                .is_some_and(|c| committed == Some(c.watermark));
        let positions = Checkpoint {
            watermark: resume,
            retry_offset: retry_start,
            retry_done: retry_done_kept,
            changelog_offset: None,
        };
        let local = checkpoint.as_ref().filter(|_| trusted);
        changelog_restore(shared, &store, partition, local, positions)?
    } else {
        // A memory store is rebuilt from what the log retains, up to the
        // committed watermark, before the task runs.
        (store.persistent().is_none() && resume > earliest)
            .then(|| Restore::replay(earliest, resume, backlog.pending_sources))
    };
    let transaction = shared.exactly_once().then(|| shared.transactional_id(&id));
    Ok(TaskInit {
        meters: Arc::new(TaskMeters::new(&p.name, &id)),
        id,
        pipeline,
        partition,
        order: p.order,
        threads_per_task: p.threads_per_task,
        gating,
        start: resume,
        committed: committed.unwrap_or(0),
        retry,
        gated_keys: if keyed { backlog.pending_keys } else { Vec::new() },
        store: Arc::new(store),
        restore,
        sink_topic: p.sink.as_ref().map(|sink| sink.topic.clone()),
        max_batch_records: config.max_batch_records,
        max_in_flight_records: config.max_in_flight_records,
        hold: HoldLimits::new(config.max_in_flight_records, config.retry_backoff_ms),
        outcome_retention_records: config.outcome_retention_records,
        transaction,
        reprocessed_below: revival.unwrap_or(0),
    })
}

/// Where a task resumes: its source offset and retry offset (`None`: none
/// committed), and the final retry offsets above the latter.
type Positions = (Option<u64>, Option<u64>, Vec<u64>);

/// How a task keeps a key's later records behind one on the retry path.
/// `key` order holds them in memory, except under exactly-once: there a
/// retry entry can be read only once the transaction that wrote it commits,
/// and a commit waits until every fetched record is complete, held ones
/// included, so each would wait for the other for good. Parked records
/// complete at once (their entries wait on the retry topic), as in `offset`
/// order.
fn gating_of(policy: RetryPolicy, order: ProcessingOrder, exactly_once: bool) -> Gating {
    match (policy, order) {
        (RetryPolicy::Blocking, _) | (_, ProcessingOrder::Unordered) => Gating::Off,
        (RetryPolicy::RetryTopic, ProcessingOrder::Key) if !exactly_once => Gating::Hold,
        (RetryPolicy::RetryTopic, ProcessingOrder::Key | ProcessingOrder::Offset) => Gating::Park,
    }
}

/// The positions (source, retry, final retries) a task on Kafka resumes at.
/// The group's committed offsets are where the partition's last owner
/// stopped, whichever instance that was: they win, unless this instance's
/// own checkpoint is ahead of them — a persistent store commits its
/// checkpoint first and the group's offsets after, so a crash in between
/// leaves the group behind, and the checkpoint (whose writes reached the
/// changelog before it was written) is then the newer. Under exactly-once
/// the group's offsets always win: they commit with the transaction, before
/// the checkpoint. The group's retry offset carries the final entries above
/// it in its metadata (see `retry_done`).
fn kafka_positions(
    shared: &Shared,
    kafka: &KafkaLog,
    pipeline: usize,
    partition: u32,
    start: Option<u64>,
    checkpoint: Option<&Checkpoint>,
) -> Result<Positions, RuntimeError> {
    let log = shared.log.as_ref();
    let group = shared.config.application_id.as_str();
    let p = &shared.pipelines[pipeline];
    let source = match start {
        Some(start) => Some(start),
        None => log.committed(group, &p.topic, partition)?,
    };
    Ok(match checkpoint {
        Some(c) if !shared.exactly_once() && source.is_none_or(|g| c.watermark > g) => {
            (Some(c.watermark), Some(c.retry_offset), c.retry_done.clone())
        }
        _ => match kafka.committed_with_metadata(group, &p.retry_topic, partition)? {
            Some((retry, metadata)) => (source, Some(retry), retry_done::decode(retry, &metadata)),
            None => (source, None, Vec::new()),
        },
    })
}

/// What brings a store on Kafka up to its changelog's end (asked of the
/// broker now: the previous owner may have written it a moment ago). A
/// persistent store whose checkpoint names a changelog offset within the
/// partition restores from there; any other persistent store (none, or a
/// copy from elsewhere) is emptied first, with `positions` as its
/// checkpoint, and restores it all, as a memory store does. `None`: nothing
/// to restore.
fn changelog_restore(
    shared: &Shared,
    store: &TaskStore,
    partition: u32,
    checkpoint: Option<&Checkpoint>,
    positions: Checkpoint,
) -> Result<Option<Restore>, RuntimeError> {
    let (Some(kafka), Some(changelog)) = (shared.log.as_kafka(), store.changelog()) else {
        return Ok(None);
    };
    let topic = changelog.topic();
    let begin = shared.log.start_offset(topic, partition)?;
    let end = kafka.latest_end_offset(topic, partition)?;
    let local = checkpoint
        .and_then(|c| c.changelog_offset)
        .filter(|&offset| (begin..=end).contains(&offset));
    let from = match (store.persistent(), local) {
        (Some(_), Some(offset)) => offset,
        (Some(persistent), None) => {
            let emptied = Checkpoint {
                changelog_offset: Some(begin),
                ..positions
            };
            persistent.reset(&emptied).map_err(|e| RuntimeError::Storage {
                path: e.path,
                message: e.message,
            })?;
            begin
        }
        (None, _) => begin,
    };
    if from >= end {
        return Ok(None);
    }
    tracing::info!(
        changelog = %topic, partition, from, end,
        "restoring the store from its changelog"
    );
    Ok(Some(Restore::changelog(from, end)))
}
