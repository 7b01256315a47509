//! Tasks whose transaction aborted (exactly_once_v2), closed dirty and
//! started again, as Kafka Streams does with a corrupted task: what the
//! aborted transaction held (outputs, retry and dead-letter entries,
//! changelog records, the offsets) is gone, so the task goes back to its
//! last committed transaction — its stores to the state that transaction
//! left (a persistent store's checkpoint is written only after its
//! transaction commits; a memory store is restored from the changelog,
//! read committed), its positions to the group's committed offsets and the
//! retry metadata committed with them — and every record since runs again.
//!
//! Invariants: a corrupted task never writes its last commit; it is revived
//! only while the group assigns its partition to this member (else it moved,
//! and its new owner resumes it) and no incarnation of it is here. A task
//! whose producer a new owner fenced is that owner's: closed, not revived
//! (a revival would fence the owner back, and the two would take turns).
//! The broker fences a producer whose transaction it aborted past
//! `transaction.timeout.ms` too; such a fence counts as an abort (see
//! `KafkaLog::transaction_doomed`), and the task is revived with a new
//! producer.

use super::app::{Detached, close_when_idle};
use super::recovery;
use super::shared::Shared;
use std::time::{Duration, Instant};

/// How long a partition whose task was fenced here is not adopted (see
/// `adopt_assigned`), though the group may still say it is this member's:
/// long enough for the member to learn it lost it.
const FENCED_QUARANTINE: Duration = Duration::from_secs(30);

/// Transactional ids of tasks closed here because a new owner fenced them,
/// with when: a static, not a field of the app, since it only ever keeps
/// ids of this process's apps for `FENCED_QUARANTINE`.
fn fenced_recently() -> &'static std::sync::Mutex<std::collections::HashMap<String, Instant>> {
    static FENCED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, Instant>>> =
        std::sync::OnceLock::new();
    FENCED.get_or_init(Default::default)
}

/// Whether the task `id` was fenced here within `FENCED_QUARANTINE`.
fn in_quarantine(shared: &Shared, id: &str) -> bool {
    let mut fenced = fenced_recently().lock().unwrap_or_else(|e| e.into_inner());
    fenced.retain(|_, at| at.elapsed() < FENCED_QUARANTINE);
    fenced.contains_key(&shared.transactional_id(id))
}

/// How long a revival keeps trying to plan a task (the broker not
/// answering) before it leaves the partition to the next rebalance.
const REVIVE_DEADLINE: Duration = Duration::from_secs(30);

/// Closes every corrupted task and revives those that may be (see the
/// module doc). Runs off the stream threads (the watchdog's), serialised
/// with rebalances and removals by the membership lock.
pub(crate) fn revive_corrupted(shared: &Shared) {
    // Looked at first without the membership lock, which a rebalance or a
    // removal holds for long: the watchdog's other work must not wait on it.
    if shared.lock().corrupted().is_empty() {
        return;
    }
    let _membership = shared.membership.lock().unwrap_or_else(|e| e.into_inner());
    let corrupted = shared.lock().corrupted();
    if corrupted.is_empty() {
        return;
    }
    let mut closed: Vec<(usize, u32, u64, bool)> = Vec::new();
    close_when_idle(shared, corrupted, |task: &Detached| {
        let Some(corruption) = task.corruption() else {
            return;
        };
        closed.push((
            task.pipeline(),
            task.partition(),
            corruption.fetched_end,
            corruption.fenced,
        ));
        tracing::warn!(
            task = %task.id(), committed = task.committed(), fetched_end = corruption.fetched_end,
            fenced = corruption.fenced,
            "task closed without a commit: its transaction aborted, and what it held is gone"
        );
    });
    for (pipeline, partition, fetched_end, was_fenced) in closed {
        if was_fenced {
            let id = super::task::task_id(&shared.pipelines[pipeline].name, partition);
            fenced_recently()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(shared.transactional_id(&id), Instant::now());
            tracing::warn!(
                task = %id,
                "the task's producer was fenced: another instance owns the task now; not revived here"
            );
        } else {
            revive_if_assigned(shared, pipeline, partition, fetched_end);
        }
    }
    republish(shared);
}

/// Adds the tasks of partitions the group assigns here that have none: their
/// adding failed in the rebalance (the broker not answering for longer than
/// it tried), and nothing else would process them before the next rebalance.
/// Skipped during a rebalance: between a revocation's removal of its tasks
/// and its unassigning them, the partitions are assigned and without tasks.
pub(crate) fn adopt_assigned(shared: &Shared) {
    let Some(kafka) = shared.log.as_kafka() else {
        return;
    };
    if shared.is_rebalancing() {
        return;
    }
    let orphans: Vec<(usize, Vec<u32>)> = {
        let scheduler = shared.lock();
        shared
            .pipelines
            .iter()
            .enumerate()
            .map(|(p, pipeline)| {
                let missing = kafka
                    .assigned(&pipeline.topic)
                    .into_iter()
                    .filter(|&partition| scheduler.task_index(p, partition).is_none())
                    .collect::<Vec<u32>>();
                (p, missing)
            })
            .filter(|(_, missing)| !missing.is_empty())
            .collect()
    };
    if orphans.is_empty() || shared.app_state() != crate::metadata::AppState::Running {
        return;
    }
    for (p, partitions) in orphans {
        let pipeline = &shared.pipelines[p];
        // Looked at again: a rebalance may have begun, or added them.
        if shared.is_rebalancing() {
            return;
        }
        let missing: Vec<u32> = {
            let scheduler = shared.lock();
            partitions
                .into_iter()
                .filter(|&partition| {
                    scheduler.task_index(p, partition).is_none()
                        && kafka.holds(&pipeline.topic, partition)
                        && !in_quarantine(shared, &super::task::task_id(&pipeline.name, partition))
                })
                .collect()
        };
        if missing.is_empty() {
            continue;
        }
        match super::app::add_tasks(
            shared,
            &pipeline.name,
            &missing,
            &std::collections::BTreeMap::new(),
        ) {
            Ok(()) => tracing::info!(
                store = %pipeline.name, partitions = ?missing,
                "added the tasks of assigned partitions whose adding had failed in the rebalance"
            ),
            Err(e) => tracing::warn!(
                store = %pipeline.name, partitions = ?missing, error = %e,
                "adding the tasks of assigned partitions failed again; trying at the next watchdog tick"
            ),
        }
    }
    republish(shared);
}

/// The rebalance that published this instance's tasks may have run while
/// they were closed.
fn republish(shared: &Shared) {
    if let Some(cluster) = shared.cluster() {
        cluster.republish(shared.hosted());
    }
    shared.wake.notify_all();
}

/// Revives a closed task if the group still assigns its partition here and
/// no incarnation of it is here already (a rebalance may have added one).
/// Called under the membership lock.
fn revive_if_assigned(shared: &Shared, pipeline: usize, partition: u32, fetched_end: u64) {
    let p = &shared.pipelines[pipeline];
    let id = super::task::task_id(&p.name, partition);
    let held = shared
        .log
        .as_kafka()
        .is_some_and(|kafka| kafka.holds(&p.topic, partition));
    if !held {
        tracing::warn!(
            task = %id,
            "the group no longer assigns the task's partition here: not revived (its new owner resumes it)"
        );
        return;
    }
    if shared.lock().task_index(pipeline, partition).is_some() {
        return;
    }
    revive(shared, pipeline, partition, fetched_end, &id);
}

/// Plans task `partition` of `pipeline` again from its last commit and adds
/// it, trying again for a while when planning fails for a passing reason.
fn revive(shared: &Shared, pipeline: usize, partition: u32, fetched_end: u64, id: &str) {
    // First the closed incarnation's appends since the abort go (they opened
    // the producer's next transaction, whose records would also hold back
    // every read_committed read of the task's partitions): its producer goes
    // on, fencing no one; without one, planning begins transactions anew.
    if let Some(kafka) = shared.log.as_kafka() {
        let transactional_id = shared.transactional_id(id);
        if !kafka.restart_transaction(&transactional_id) {
            // Its producer cannot go on (the broker bumped its epoch when it
            // timed the transaction out): planning makes a new one.
            kafka.end_transactions(&transactional_id);
        }
    }
    let deadline = Instant::now() + REVIVE_DEADLINE;
    let mut pause = Duration::from_millis(50);
    loop {
        match recovery::plan(shared, pipeline, partition, None, Some(fetched_end)) {
            Ok(init) => {
                let start = init.start;
                shared.lock().add_task(init);
                tracing::info!(
                    task = %id, from = start, again = fetched_end.saturating_sub(start),
                    "task revived from its last committed transaction: the records since run again"
                );
                return;
            }
            Err(e) if Instant::now() < deadline => {
                tracing::warn!(task = %id, error = %e, "reviving the task failed; trying again");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                tracing::error!(
                    task = %id, error = %e,
                    "cannot revive the task; its partition waits for the next rebalance"
                );
                return;
            }
        }
    }
}
