//! bare: the limits our runs are measured against, run in the same process and run as ours —
//! no runtime, just the work. A sleep loop over the exact latencies `simulate` draws for each
//! record (volume, scaling, ordering) and its windowed form (ordering: at most a bound beyond
//! the lowest unfinished record), a loop calling the processor alone (floor), and a count per
//! key in one `HashMap` (scale: the cost of many keys that any store pays).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
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

/// `sleep_loop` with a window: T threads take the records in offset order from a shared
/// cursor, but record o starts only while o < (the lowest offset not yet finished) + `window`.
/// The most any T-thread runtime can overlap when it may fetch at most `window` records beyond
/// its watermark: a slow record stops the cursor `window` records past it until it is done.
/// With `window` ≥ the record count it is `sleep_loop`; with 1, one record at a time. Seconds.
pub fn windowed_sleep_loop(latencies_ms: &[f64], threads: usize, window: usize) -> f64 {
    struct Cursor {
        next: usize,
        /// The lowest offset not finished: every record below it is done.
        watermark: usize,
        done: Vec<bool>,
    }
    let latencies: Arc<Vec<Duration>> = Arc::new(
        latencies_ms
            .iter()
            .map(|&ms| Duration::from_secs_f64(ms / 1000.0))
            .collect(),
    );
    let count = latencies.len();
    // A window of 0 would admit nothing.
    let window = window.max(1);
    let shared = Arc::new((
        Mutex::new(Cursor {
            next: 0,
            watermark: 0,
            done: vec![false; count],
        }),
        Condvar::new(),
    ));
    let start = Instant::now();
    let handles: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let latencies = latencies.clone();
            let shared = shared.clone();
            std::thread::spawn(move || {
                let (cursor, advanced) = &*shared;
                loop {
                    let mut state = cursor.lock().unwrap_or_else(PoisonError::into_inner);
                    // The lowest unfinished record is always running on some thread, so a full
                    // window always opens again.
                    let i = loop {
                        if state.next >= count {
                            return;
                        }
                        if state.next < state.watermark + window {
                            state.next += 1;
                            break state.next - 1;
                        }
                        state = advanced.wait(state).unwrap_or_else(PoisonError::into_inner);
                    };
                    drop(state);
                    std::thread::sleep(latencies[i]);
                    let mut state = cursor.lock().unwrap_or_else(PoisonError::into_inner);
                    state.done[i] = true;
                    let before = state.watermark;
                    while state.watermark < count && state.done[state.watermark] {
                        state.watermark += 1;
                    }
                    if state.watermark != before {
                        advanced.notify_all();
                    }
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
    fn an_ample_window_is_the_plain_loop() {
        // 400 ms of sleeping over 4 threads: 100 ms at best; serial would be 400 ms. The upper
        // tolerance leaves room for oversleeping on a shared machine.
        let latencies = vec![10.0; 40];
        let seconds = windowed_sleep_loop(&latencies, 4, latencies.len());
        assert!((0.1..0.2).contains(&seconds), "{seconds}");
    }

    #[test]
    fn a_window_of_one_is_serial() {
        let latencies = vec![5.0; 10];
        let seconds = windowed_sleep_loop(&latencies, 4, 1);
        // The sum of the latencies, where 4 threads could do it in 12.5 ms.
        assert!(seconds >= 0.05, "{seconds}");
    }

    #[test]
    fn a_slow_record_stops_the_window_past_it() {
        // Record 0 takes 50 ms; with a window of 4 only records 1–3 run meanwhile, so the 37
        // records from 4 on (5 ms each) start after it: at least 50 + 37 · 5 / 4 ms. Without a
        // window the other 3 threads would do the 40 short records in about 67 ms.
        let mut latencies = vec![50.0];
        latencies.extend([5.0; 40]);
        let seconds = windowed_sleep_loop(&latencies, 4, 4);
        assert!(seconds >= 0.05 + 37.0 * 0.005 / 4.0, "{seconds}");
    }

    #[test]
    fn the_keyed_bound_is_the_heaviest_key_when_keys_are_few() {
        let latencies = [1.0, 1.0, 1.0, 1.0, 4.0];
        assert_eq!(keyed_bound(&latencies, &[0, 0, 0, 0, 0], 4), 0.008);
        assert_eq!(keyed_bound(&latencies, &[0, 1, 2, 3, 4], 4), 0.004);
        assert_eq!(keyed_bound(&latencies, &[0, 1, 2, 3, 0], 2), 0.005);
    }
}
