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
//! whose producer was fenced is revived with a new producer only when the
//! group still assigns its partition here once `FENCED_SETTLE` has passed:
//! the broker fences a producer whose transaction it aborted on
//! `transaction.timeout.ms` just as it fences one replaced by a new owner,
//! and a member that lost the partition (a zombie back from a pause) learns
//! it within that time. Were it not to, the group would still refuse its
//! offsets, so none of its transactions could commit.

use super::app::{Detached, close_when_idle};
use super::recovery;
use super::shared::Shared;
use std::time::{Duration, Instant};

/// How long a fenced task waits before its partition's assignment decides
/// whether it is revived here (see the module doc): a few heartbeats.
const FENCED_SETTLE: Duration = Duration::from_secs(3);

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
    let mut fenced = Vec::new();
    {
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
                fenced.push((pipeline, partition, fetched_end));
            } else {
                revive_if_assigned(shared, pipeline, partition, fetched_end, false);
            }
        }
        republish(shared);
    }
    if fenced.is_empty() {
        return;
    }
    std::thread::sleep(FENCED_SETTLE);
    let _membership = shared.membership.lock().unwrap_or_else(|e| e.into_inner());
    for (pipeline, partition, fetched_end) in fenced {
        revive_if_assigned(shared, pipeline, partition, fetched_end, true);
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
fn revive_if_assigned(shared: &Shared, pipeline: usize, partition: u32, fetched_end: u64, fenced: bool) {
    let p = &shared.pipelines[pipeline];
    let id = super::task::task_id(&p.name, partition);
    let held = shared
        .log
        .as_kafka()
        .is_some_and(|kafka| kafka.holds(&p.topic, partition));
    if !held {
        tracing::warn!(
            task = %id, fenced,
            "the group no longer assigns the task's partition here: not revived (its new owner resumes it)"
        );
        return;
    }
    if shared.lock().task_index(pipeline, partition).is_some() {
        return;
    }
    if fenced {
        tracing::warn!(
            task = %id,
            "the task's producer was fenced while the group still assigns its partition here \
             (the broker aborted its transaction past transaction.timeout.ms): revived with a new producer"
        );
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
