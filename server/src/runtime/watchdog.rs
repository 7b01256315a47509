//! The watchdog: a thread of its own that looks at the scheduler once a
//! tick (or when woken) and does what the stream threads cannot do for
//! themselves: it says in the log when a task's records have waited
//! uncommitted for many commit intervals (with what holds its commit back),
//! when a commit round does not end, and when such a task commits again;
//! and it closes and revives the tasks whose transaction aborted
//! (`revival`), which needs the tasks idle — a wait no stream thread may do.
//! It must not depend on a stream thread being free, since a stalled commit
//! is one of the things it reports.
//!
//! Invariant: a stalled task is warned about at most once per
//! `REPEAT_AFTER`, and told about once when it commits again.

use super::scheduler::CommitStalls;
use super::shared::Shared;
use crate::metadata::AppState;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// A task is stalled once its records have waited this many commit intervals…
const STALL_INTERVALS: u32 = 10;
/// …and at least this long (a commit interval of milliseconds would make
/// every restore or drain a stall).
const STALL_FLOOR: Duration = Duration::from_secs(30);
/// How often a stall still going on is said again.
const REPEAT_AFTER: Duration = Duration::from_secs(60);

/// How long records may wait uncommitted before the watchdog warns.
pub(crate) fn stall_threshold(commit_interval: Duration) -> Duration {
    commit_interval.saturating_mul(STALL_INTERVALS).max(STALL_FLOOR)
}

/// What wakes the watchdog before its tick: a task to revive. Shared apart
/// from `Shared`, which the sleeping watchdog must not keep alive.
#[derive(Default)]
pub(crate) struct Watchdog {
    woken: Mutex<bool>,
    wake: Condvar,
}

impl Watchdog {
    /// Has the watchdog look now rather than at its next tick.
    pub(crate) fn wake(&self) {
        *self.woken.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.wake.notify_one();
    }

    /// Sleeps until the next tick or a wake-up.
    fn sleep(&self, tick: Duration) {
        let woken = self.woken.lock().unwrap_or_else(|e| e.into_inner());
        let (mut woken, _) = self
            .wake
            .wait_timeout_while(woken, tick, |woken| !*woken)
            .unwrap_or_else(|e| e.into_inner());
        *woken = false;
    }
}

/// Starts the watchdog of `shared`; it ends by itself once the app stops.
pub(crate) fn start(shared: &Arc<Shared>) -> std::io::Result<()> {
    let weak = Arc::downgrade(shared);
    let watchdog = shared.watchdog.clone();
    let interval = Duration::from_millis(shared.config.commit_interval_ms);
    let tick = interval.clamp(Duration::from_millis(100), Duration::from_secs(1));
    std::thread::Builder::new()
        .name(format!("{}-watchdog", shared.config.application_id))
        .spawn(move || run(&weak, &watchdog, tick, stall_threshold(interval)))?;
    Ok(())
}

fn run(shared: &Weak<Shared>, watchdog: &Watchdog, tick: Duration, threshold: Duration) {
    let mut said = Said::default();
    loop {
        watchdog.sleep(tick);
        let Some(shared) = shared.upgrade() else { return };
        match shared.app_state() {
            AppState::Stopped => return,
            // A shutdown drains and commits on its own clock.
            AppState::ShuttingDown => continue,
            _ => {}
        }
        super::revival::revive_corrupted(&shared);
        super::revival::adopt_assigned(&shared);
        let now = Instant::now();
        let stalls = shared.lock().commit_stalls(now, threshold);
        said.report(&stalls, now);
    }
}

/// What the watchdog has said, so that it does not repeat itself each tick.
#[derive(Default)]
struct Said {
    /// Stalled tasks, with when their stall was last said.
    tasks: HashMap<Arc<str>, Instant>,
    round: Option<Instant>,
}

impl Said {
    fn report(&mut self, stalls: &CommitStalls, now: Instant) {
        let due =
            |last: Option<&Instant>| last.is_none_or(|at| now.saturating_duration_since(*at) >= REPEAT_AFTER);
        match &stalls.round {
            Some((running, thread)) if due(self.round.as_ref()) => {
                tracing::warn!(
                    thread = %thread, running_s = running.as_secs(),
                    "a commit round has not ended: no task of this instance commits until it does"
                );
                self.round = Some(now);
            }
            Some(_) => {}
            None => self.round = None,
        }
        for stall in &stalls.tasks {
            if due(self.tasks.get(&stall.task)) {
                tracing::warn!(
                    task = %stall.task,
                    stalled_s = stall.stalled.as_secs(),
                    watermark = stall.watermark,
                    committed = stall.committed,
                    reason = %stall.blocker,
                    "task has not committed for many commit intervals: queries of a persistent store \
                     and the group's offsets stay at its last commit"
                );
                self.tasks.insert(stall.task.clone(), now);
            }
        }
        self.tasks.retain(|task, _| {
            let still = stalls.tasks.iter().any(|stall| stall.task == *task);
            if !still {
                tracing::info!(task = %task, "task commits again");
            }
            still
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::scheduler::CommitStall;
    use crate::runtime::task::CommitBlocker;

    fn stall(task: &str) -> CommitStall {
        CommitStall {
            task: task.into(),
            stalled: Duration::from_secs(31),
            watermark: 10,
            committed: 4,
            blocker: CommitBlocker::NotHandedOut,
        }
    }

    #[test]
    fn the_threshold_is_ten_intervals_and_at_least_thirty_seconds() {
        assert_eq!(
            stall_threshold(Duration::from_millis(100)),
            Duration::from_secs(30)
        );
        assert_eq!(stall_threshold(Duration::from_secs(5)), Duration::from_secs(50));
    }

    #[test]
    fn a_stall_is_said_once_a_minute_and_forgotten_once_it_commits() {
        let mut said = Said::default();
        let start = Instant::now();
        let stalls = CommitStalls {
            round: None,
            tasks: vec![stall("a_0")],
        };
        said.report(&stalls, start);
        let first = said.tasks[&Arc::<str>::from("a_0")];
        said.report(&stalls, start + Duration::from_secs(30));
        assert_eq!(
            said.tasks[&Arc::<str>::from("a_0")],
            first,
            "not said again within a minute"
        );
        said.report(&stalls, start + Duration::from_secs(61));
        assert!(
            said.tasks[&Arc::<str>::from("a_0")] > first,
            "said again after a minute"
        );
        said.report(&CommitStalls::default(), start + Duration::from_secs(62));
        assert!(said.tasks.is_empty(), "a task that commits again is forgotten");
    }
}
