//! Kafka mode's consumer group as the application: the `GroupListener` that
//! turns the group's assignment into added tasks (every pipeline reading the
//! assigned topic partition) and its revocation into removed ones — drained,
//! committed and closed before the rebalance completes — marks the
//! instance REBALANCING meanwhile, and publishes what it holds after each
//! rebalance step (see `cluster`).

use super::shared::Shared;
use super::{RuntimeError, app};
use crate::log::{GroupListener, GroupPartition};
use crate::metadata::AppState;
use std::collections::BTreeMap;
use std::sync::Weak;
use std::time::{Duration, Instant};

/// How long an assignment keeps trying to add a task whose recovery fails
/// (the broker not answering, a store still closing) before giving up on it.
const ADD_DEADLINE: Duration = Duration::from_secs(30);

/// The runtime side of the group membership. Holds the app weakly: the group
/// belongs to the log, which the app owns.
pub(crate) struct Membership {
    shared: Weak<Shared>,
}

impl Membership {
    pub(crate) fn new(shared: Weak<Shared>) -> Membership {
        Membership { shared }
    }
}

impl GroupListener for Membership {
    fn assigned(&self, partitions: &[GroupPartition]) -> BTreeMap<GroupPartition, u64> {
        let Some(shared) = self.shared.upgrade() else {
            return BTreeMap::new();
        };
        shared.set_rebalancing(true);
        for (p, pipeline) in shared.pipelines.iter().enumerate() {
            let assigned: Vec<u32> = partitions
                .iter()
                .filter(|(t, _)| **t == *pipeline.topic)
                .map(|(_, partition)| *partition)
                .collect();
            add_tasks(&shared, p, &pipeline.name, &assigned);
        }
        // Where each partition's queue starts: its tasks' first read (the
        // lowest, when several pipelines read one topic).
        let scheduler = shared.lock();
        let mut starts = BTreeMap::new();
        for (topic, partition) in partitions {
            let first = shared
                .pipelines
                .iter()
                .enumerate()
                .filter(|(_, pipeline)| *pipeline.topic == **topic)
                .filter_map(|(p, _)| scheduler.task(scheduler.task_index(p, *partition)?))
                .map(|task| task.next_source_read())
                .min();
            if let Some(first) = first {
                starts.insert((topic.clone(), *partition), first);
            }
        }
        starts
    }

    fn revoked(&self, partitions: &[GroupPartition], lost: bool) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        shared.set_rebalancing(true);
        let mut released = Vec::new();
        for (p, pipeline) in shared.pipelines.iter().enumerate() {
            let revoked: Vec<u32> = partitions
                .iter()
                .filter(|(t, _)| **t == *pipeline.topic)
                .map(|(_, partition)| *partition)
                .collect();
            if revoked.is_empty() {
                continue;
            }
            // A partition without a task here (its add or revival failed)
            // has nothing to commit.
            let hosted: Vec<u32> = {
                let scheduler = shared.lock();
                revoked
                    .iter()
                    .copied()
                    .filter(|&partition| scheduler.task_index(p, partition).is_some())
                    .collect()
            };
            match app::remove_tasks(&shared, &pipeline.name, &hosted) {
                Ok(()) => {}
                // Another member owns them already: its commits win.
                Err(e) if lost => tracing::warn!(
                    pipeline = %pipeline.name, partitions = ?hosted, error = %e,
                    "partitions lost to the group; their last commit was refused"
                ),
                Err(e) => tracing::error!(
                    pipeline = %pipeline.name, partitions = ?hosted, error = %e,
                    "revoked tasks could not commit"
                ),
            }
            released.extend(revoked.iter().map(|&p| (pipeline.retry_topic.to_string(), p)));
            // A task revoked while it restored leaves its changelog partition assigned.
            if let Some(changelog) = &pipeline.changelog_topic {
                released.extend(revoked.iter().map(|&p| (changelog.to_string(), p)));
            }
        }
        if let Some(kafka) = shared.log.as_kafka() {
            kafka.release(&released);
        }
    }

    fn rebalanced(&self, generation: i32, assignment: &[GroupPartition]) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        tracing::info!(
            generation,
            partitions = assignment.len(),
            "kafka group: rebalance step done"
        );
        // The tasks, not the assignment: a partition whose task could not
        // be added is not answered here.
        if let Some(cluster) = shared.cluster() {
            cluster.publish(generation, shared.hosted());
        }
        shared.set_rebalancing(false);
    }
}

/// Adds the tasks of `partitions` of pipeline `store` (index `p`) that are
/// not here yet, all in one call (planned side by side: see
/// `app::add_tasks`), trying again for those whose recovery failed for a
/// passing reason: an assigned partition without a task would never be
/// processed until the next rebalance.
fn add_tasks(shared: &Shared, p: usize, store: &str, partitions: &[u32]) {
    let deadline = Instant::now() + ADD_DEADLINE;
    let mut pause = Duration::from_millis(50);
    loop {
        let missing: Vec<u32> = {
            let scheduler = shared.lock();
            partitions
                .iter()
                .copied()
                .filter(|&partition| scheduler.task_index(p, partition).is_none())
                .collect()
        };
        if missing.is_empty() {
            return;
        }
        match app::add_tasks(shared, store, &missing, &BTreeMap::new()) {
            Ok(()) => return,
            Err(e @ (RuntimeError::Unavailable { .. } | RuntimeError::Internal(_)))
                if Instant::now() < deadline
                    && matches!(shared.app_state(), AppState::Running | AppState::Starting) =>
            {
                tracing::warn!(store, partitions = ?missing, error = %e, "adding assigned tasks failed; trying again for those missing");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                tracing::error!(
                    store, partitions = ?missing, error = %e,
                    "cannot add the tasks of assigned partitions yet; the watchdog tries again while the group assigns them here"
                );
                return;
            }
        }
    }
}
