//! bare: the limits our runs are measured against, run in the same process and run as ours —
//! no runtime, just the work. A sleep loop over the exact latencies `simulate` draws for each
//! record (volume, scaling, ordering), a loop calling the processor alone (floor), and a
//! count per key in one `HashMap` (scale: the cost of many keys that any store pays).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// T threads take the next record's latency from a shared cursor and sleep it, until every
/// latency is slept: the fastest any T-thread runtime can go over these records. Seconds.
pub fn sleep_loop(latencies_ms: &[f64], threads: usize) -> f64 {
    let latencies: Arc<Vec<Duration>> = Arc::new(
        latencies_ms
            .iter()
            .map(|&ms| Duration::from_secs_f64(ms / 1000.0))
            .collect(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let latencies = latencies.clone();
            let next = next.clone();
            std::thread::spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&latency) = latencies.get(i) else { break };
                    std::thread::sleep(latency);
                }
            })
        })
        .collect();
    for handle in handles {
        let _ = handle.join();
    }
    start.elapsed().as_secs_f64()
}

/// The lower bound of a run over these latencies with T threads when records of one key
/// never run at once: max(total / T, the heaviest key's total). Seconds. `keys[i]` is record
/// i's key.
pub fn keyed_bound(latencies_ms: &[f64], keys: &[u64], threads: usize) -> f64 {
    let total: f64 = latencies_ms.iter().sum();
    let mut per_key: std::collections::HashMap<u64, f64> = std::collections::HashMap::new();
    for (latency, key) in latencies_ms.iter().zip(keys) {
        *per_key.entry(*key).or_default() += latency;
    }
    let heaviest = per_key.values().copied().fold(0.0, f64::max);
    (total / threads.max(1) as f64).max(heaviest) / 1000.0
}

/// Counts the records of `keys` per key in one `HashMap<Bytes, Bytes>` (std hasher), as
/// `count` does — the decimal value read, parsed and written back per record — over the
/// record keys `prefill` gives: what a million keys cost when nothing but the map is there.
/// Seconds for the counting alone (the keys are made before the clock starts).
pub fn count_loop(keys: crate::workload::Keys, records: u64) -> f64 {
    use bytes::Bytes;
    use std::collections::HashMap;
    let table = crate::workload::key_table(keys);
    let record_keys: Vec<Bytes> = (0..records)
        .map(|i| crate::workload::record_key(keys, &table, i))
        .collect();
    let mut counts: HashMap<Bytes, Bytes> = HashMap::new();
    let start = Instant::now();
    for key in &record_keys {
        let current: i64 = counts
            .get(key)
            .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
            .unwrap_or(0);
        counts.insert(key.clone(), Bytes::from((current + 1).to_string()));
    }
    let seconds = start.elapsed().as_secs_f64();
    std::hint::black_box(counts.len());
    seconds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_loop_runs_over_every_record() {
        let keys = crate::workload::Keys::Uniform { count: 10, seed: 3 };
        assert!(count_loop(keys, 1_000) > 0.0);
    }

    #[test]
    fn the_sleep_loop_takes_the_total_over_the_threads() {
        let latencies = vec![10.0; 20];
        let seconds = sleep_loop(&latencies, 4);
        // 200 ms of sleeping over 4 threads: 50 ms at best.
        assert!(seconds >= 0.05, "{seconds}");
    }

    #[test]
    fn the_keyed_bound_is_the_heaviest_key_when_keys_are_few() {
        let latencies = [1.0, 1.0, 1.0, 1.0, 4.0];
        assert_eq!(keyed_bound(&latencies, &[0, 0, 0, 0, 0], 4), 0.008);
        assert_eq!(keyed_bound(&latencies, &[0, 1, 2, 3, 4], 4), 0.004);
        assert_eq!(keyed_bound(&latencies, &[0, 1, 2, 3, 0], 2), 0.005);
    }
}
