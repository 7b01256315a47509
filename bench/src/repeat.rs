//! repeat: how a scenario measures on a shared, noisy machine. Every variant runs several
//! times, the variants alternating (each round starts at a different one, so a neighbour's
//! burst does not always land on the same variant); a table shows the median with min–max,
//! the load average at each run's start and the process CPU time per record.

use std::fmt::Write as _;
use std::time::Duration;

/// What one timed run of a variant gave.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    pub seconds: f64,
    /// Records the run completed (all of them when `finished`).
    pub records: u64,
    /// CPU time (user + system) this process spent during the run.
    pub cpu_seconds: f64,
    /// The 1-minute load average when the run started.
    pub load: f64,
    pub finished: bool,
}

/// The runs of one variant.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    runs: Vec<Measured>,
}

impl Samples {
    pub fn push(&mut self, run: Measured) {
        self.runs.push(run);
    }

    /// Adds the runs of `other` (for one load cell over several variants).
    pub fn extend(&mut self, other: &Samples) {
        self.runs.extend_from_slice(&other.runs);
    }

    pub fn median_seconds(&self) -> f64 {
        median(self.runs.iter().map(|r| r.seconds))
    }

    pub fn median_rate(&self) -> f64 {
        median(self.runs.iter().map(|r| r.records as f64 / r.seconds.max(1e-9)))
    }

    /// The median seconds, marked when a run did not finish.
    pub fn median_seconds_cell(&self) -> String {
        let mark = if self.all_finished() { "" } else { " (timed out)" };
        format!("{}{mark}", crate::report::secs(self.median_seconds()))
    }

    /// "min–max" of the runs' seconds.
    pub fn seconds_spread(&self) -> String {
        let min = self.runs.iter().map(|r| r.seconds).fold(f64::INFINITY, f64::min);
        let max = self.runs.iter().map(|r| r.seconds).fold(0.0, f64::max);
        format!("{min:.3}–{max:.3}")
    }

    /// Median CPU µs per record.
    pub fn cpu_us_per_record(&self) -> f64 {
        median(
            self.runs
                .iter()
                .map(|r| r.cpu_seconds * 1e6 / r.records.max(1) as f64),
        )
    }

    pub fn all_finished(&self) -> bool {
        !self.runs.is_empty() && self.runs.iter().all(|r| r.finished)
    }

    /// The highest load seen at a run's start, marked when it exceeds the core count: such a
    /// run shared the CPU with something else.
    pub fn load_cell(&self) -> String {
        let load = self.runs.iter().map(|r| r.load).fold(0.0, f64::max);
        let cores = cores();
        let mut cell = format!("{load:.1}");
        if load > cores as f64 {
            let _ = write!(cell, " (> {cores} cores)");
        }
        cell
    }

    /// Whether any run started with the load above the core count.
    pub fn overloaded(&self) -> bool {
        self.runs.iter().any(|r| r.load > cores() as f64)
    }
}

/// Median of `values` (the mean of the middle two for an even count); 0 when empty.
pub fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut sorted: Vec<f64> = values.collect();
    if sorted.is_empty() {
        return 0.0;
    }
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        f64::midpoint(sorted[mid - 1], sorted[mid])
    } else {
        sorted[mid]
    }
}

/// Runs every variant `rounds` times; round r starts at variant r (mod the count) and goes on
/// in order, wrapping around. Answers one `Samples` per variant, in the variants' order.
pub fn alternate<V>(
    variants: &[V],
    rounds: usize,
    mut run: impl FnMut(&V) -> anyhow::Result<Measured>,
) -> anyhow::Result<Vec<Samples>> {
    let mut samples = vec![Samples::default(); variants.len()];
    for round in 0..rounds {
        for step in 0..variants.len() {
            let i = (round + step) % variants.len();
            samples[i].push(run(&variants[i])?);
        }
    }
    Ok(samples)
}

/// CPU time (user + system) of this process so far, in seconds.
pub fn cpu_seconds() -> f64 {
    cpu_seconds_of(None)
}

/// CPU time (user + system) of process `pid` (this process for `None`) so far, in seconds; 0
/// when unknown. For servers the harness runs as child processes.
pub fn cpu_seconds_of(pid: Option<u32>) -> f64 {
    let path = pid.map_or_else(
        || "/proc/self/stat".to_string(),
        |pid| format!("/proc/{pid}/stat"),
    );
    // /proc/<pid>/stat fields 14 and 15 (utime, stime) in clock ticks, every thread's; the comm
    // field may hold spaces, so count from the ")" that ends it. USER_HZ is 100 on Linux.
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0.0;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // After ")": state is field 3, so utime (14) and stime (15) are at 11 and 12.
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU time of the calling thread so far (0 when unknown), from
/// `CLOCK_THREAD_CPUTIME_ID`. Unlike a wall clock it does not count the time
/// the thread waited for a core, which on a loaded machine is most of it. A
/// clock read, not a read of /proc/thread-self/schedstat: the runs' progress
/// loop reads it twice a poll, about a thousand polls a second, and opening,
/// reading and closing the file each time was 2 % of the process's CPU in the
/// `remote` scenario, counted against the runtime.
pub fn thread_cpu() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable `timespec` for the duration of the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(now.tv_sec.max(0) as u64, now.tv_nsec.clamp(0, 999_999_999) as u32)
}

/// The 1-minute load average (0 when unknown).
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().and_then(|f| f.parse().ok()))
        .unwrap_or(0.0)
}

pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
        assert_eq!(median(std::iter::empty()), 0.0);
    }

    #[test]
    fn thread_cpu_counts_this_threads_work() {
        let before = thread_cpu();
        let mut sum = 0u64;
        for i in 0..2_000_000u64 {
            sum = std::hint::black_box(sum.wrapping_add(i * i));
        }
        assert!(thread_cpu() > before, "{sum}");
    }

    #[test]
    fn rounds_rotate_which_variant_runs_first() {
        let mut order = Vec::new();
        let samples = alternate(&["a", "b", "c"], 3, |v| {
            order.push(*v);
            Ok(Measured {
                seconds: 1.0,
                records: 1,
                cpu_seconds: 0.0,
                load: 0.0,
                finished: true,
            })
        })
        .unwrap();
        assert_eq!(order, ["a", "b", "c", "b", "c", "a", "c", "a", "b"]);
        assert!(samples.iter().all(|s| s.runs.len() == 3));
    }

    #[test]
    fn cpu_time_grows_with_work() {
        let before = cpu_seconds();
        // A fixed amount of work (not of wall time, which a loaded machine stretches).
        let mut x = 0u64;
        for _ in 0..50_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
        }
        assert!(cpu_seconds() - before >= 0.02, "the work shows as CPU time");
        let now = cpu_seconds();
        assert!(
            cpu_seconds_of(Some(std::process::id())) >= now,
            "by pid it reads the same counters"
        );
    }
}
