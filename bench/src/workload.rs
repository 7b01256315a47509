//! In-process runs of the runtime: prefill a `MemoryLog`, start a `StreamsApp`
//! on it and time it from start until every task's watermark reaches the end
//! of its partition, sampling progress on the way. Also peak RSS and temp dirs.

use crate::repeat::{self, Measured, cpu_seconds, load_average};
use anyhow::{Context as _, anyhow};
use bytes::Bytes;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use taskstream_server::config::{LatencySpec, StoreKind};
use taskstream_server::processor::splitmix64;
use taskstream_server::{
    Config, Log, MemoryLog, PipelineConfig, ProcessingOrder, Processor, ProcessorSpec, ProducerRecord,
    StreamsApp, TopicConfig,
};

pub const TOPIC: &str = "bench-in";
pub const STORE: &str = "bench";

/// How records are keyed.
#[derive(Debug, Clone, Copy)]
pub enum Keys {
    /// Each record draws one of `count` keys uniformly (seeded, reproducible).
    Uniform { count: u32, seed: u64 },
    /// Record i has key i: every record its own key.
    Distinct,
}

impl Keys {
    pub fn describe(&self) -> String {
        match self {
            Keys::Uniform { count, .. } => {
                format!("{} keys drawn uniformly", crate::report::group(*count as u64))
            }
            Keys::Distinct => "a distinct key per record".to_string(),
        }
    }

    /// Which key `prefill` gives record i (its index in the key table, or i itself).
    pub fn index_of(&self, i: u64) -> u64 {
        match *self {
            Keys::Uniform { count, seed } => splitmix64(seed ^ i) % u64::from(count),
            Keys::Distinct => i,
        }
    }
}

/// The distinct keys of a `Uniform` draw, made once (empty for `Distinct`).
pub fn key_table(keys: Keys) -> Vec<Bytes> {
    match keys {
        Keys::Uniform { count, .. } => (0..count).map(|k| Bytes::from(format!("key-{k:07}"))).collect(),
        Keys::Distinct => Vec::new(),
    }
}

/// Record i's key, `table` from `key_table`.
pub fn record_key(keys: Keys, table: &[Bytes], i: u64) -> Bytes {
    match keys {
        // Cloning a `Bytes` of the table shares it: no allocation per record.
        Keys::Uniform { .. } => table[keys.index_of(i) as usize].clone(),
        Keys::Distinct => Bytes::from(format!("key-{i:09}")),
    }
}

/// Appends `records` keyed records (value: `value_bytes` bytes) to `topic`.
pub fn prefill(
    log: &dyn Log,
    topic: &str,
    partitions: u32,
    records: u64,
    keys: Keys,
    value_bytes: usize,
) -> anyhow::Result<()> {
    log.ensure_topic(topic, partitions)?;
    let table = key_table(keys);
    let value = Bytes::from(vec![b'v'; value_bytes]);
    let mut next = 0u64;
    while next < records {
        let chunk = (records - next).min(50_000);
        let batch: Vec<ProducerRecord> = (next..next + chunk)
            .map(|i| ProducerRecord {
                key: Some(record_key(keys, &table, i)),
                value: value.clone(),
                ..ProducerRecord::default()
            })
            .collect();
        log.append(topic, batch)?;
        next += chunk;
    }
    Ok(())
}

/// One pipeline `STORE` on `TOPIC` with N threads and T per task.
pub fn config(
    partitions: u32,
    n: usize,
    t: usize,
    order: ProcessingOrder,
    processor: ProcessorSpec,
) -> Config {
    Config {
        application_id: "bench".into(),
        application_server: "127.0.0.1:0".into(),
        num_stream_threads: n,
        num_threads_per_task: t,
        processing_order: order,
        topics: vec![TopicConfig::new(TOPIC, partitions)],
        pipelines: vec![PipelineConfig::new(STORE, TOPIC, processor)],
        ..Config::default()
    }
}

/// The `simulate` processor with a latency and nothing else.
pub fn simulate(latency_ms: Option<LatencySpec>) -> ProcessorSpec {
    ProcessorSpec::Simulate {
        latency_ms,
        cpu_work_us: 0,
        failure_rate: 0.0,
        fail_attempts: 0,
        seed: 42,
    }
}

/// What one timed run did.
#[derive(Debug, Clone)]
pub struct Run {
    /// Records completed (every record, when `finished`).
    pub completed: u64,
    /// Seconds from `start()` until caught up (or until the deadline).
    pub seconds: f64,
    /// Caught up before the deadline.
    pub finished: bool,
    /// (seconds, records completed) samples, for progress plots.
    pub progress: Vec<(f64, f64)>,
    /// Peak RSS of this process during the run (VmHWM after a reset), if known.
    pub peak_rss: Option<u64>,
    /// RSS just before `start()` (the prefilled log is part of it).
    pub rss_before: Option<u64>,
    /// The store kind the runtime reports for the pipeline (it may differ from the config's).
    pub store_kind: Option<StoreKind>,
    /// Seconds from `start()` until `shutdown()` returned: caught up, then
    /// drained and committed (what a persistent store's last commit costs).
    pub until_shutdown: f64,
    /// CPU time of this process from `start()` until caught up.
    pub cpu_seconds: f64,
    /// The load average when the run started.
    pub load: f64,
    /// Once caught up: the store's counts summed over every key (what `count` and `simulate`
    /// add per record), and records that failed. Together they say whether every record was
    /// applied once.
    pub counted: u64,
    pub failed: u64,
}

impl Run {
    pub fn throughput(&self) -> f64 {
        self.completed as f64 / self.seconds.max(1e-9)
    }

    pub fn measured(&self) -> Measured {
        Measured {
            seconds: self.seconds,
            records: self.completed,
            cpu_seconds: self.cpu_seconds,
            load: self.load,
            finished: self.finished,
        }
    }
}

/// Sleep between progress polls, as a multiple of what the last poll took.
const POLL_COST_RATIO: u32 = 50;

/// Starts `config` on `log` (already holding `expected` records in the
/// pipeline's source topic) and waits until every task's watermark reaches its
/// partition's end, or `timeout`. The clock starts before `start()`.
pub fn run_prefilled(
    config: Config,
    log: Arc<MemoryLog>,
    processors: Vec<(String, Arc<dyn Processor>)>,
    expected: u64,
    timeout: Duration,
) -> anyhow::Result<Run> {
    let store = config
        .pipelines
        .first()
        .map(|p| p.name.clone())
        .ok_or_else(|| anyhow!("the config has no pipeline"))?;
    let mut builder = StreamsApp::builder(config).log(log);
    for (name, processor) in processors {
        builder = builder.processor(&name, processor);
    }
    reset_peak_rss();
    let rss_before = rss_field(None, "VmRSS:");
    let load = load_average();
    let cpu_before = cpu_seconds();
    let start = Instant::now();
    let app = builder.start().context("start the runtime")?;
    let mut progress = vec![(0.0, 0.0)];
    let mut last_sample = Duration::ZERO;
    let (completed, seconds, finished) = loop {
        let poll_started = repeat::thread_cpu();
        // Errors while the app is starting are retried: it may report UNAVAILABLE.
        let (done, caught_up) = match app.process_metadata_for_store(&store, false) {
            Ok(metadata) => {
                let tasks: Vec<_> = metadata.instances.iter().flat_map(|i| i.tasks.iter()).collect();
                let done: u64 = tasks.iter().map(|t| t.records_processed).sum();
                let end: u64 = tasks.iter().map(|t| t.end_offset).sum();
                (done, end >= expected && tasks.iter().all(|t| t.lag == 0))
            }
            Err(_) => (0, false),
        };
        let now = start.elapsed();
        if caught_up {
            progress.push((now.as_secs_f64(), expected as f64));
            break (expected, now.as_secs_f64(), true);
        }
        if now.saturating_sub(last_sample) >= Duration::from_millis(10) {
            progress.push((now.as_secs_f64(), done as f64));
            last_sample = now;
        }
        if now >= timeout {
            break (done, now.as_secs_f64(), false);
        }
        // The metadata call takes the scheduler lock and grows with the tasks:
        // polling stays under ~2 % of the time, whatever the partition count.
        // Its CPU time, not its wall time, which a loaded machine inflates.
        let poll = repeat::thread_cpu().saturating_sub(poll_started);
        std::thread::sleep((poll * POLL_COST_RATIO).max(Duration::from_millis(1)));
    };
    let cpu_seconds = cpu_seconds() - cpu_before;
    let peak_rss = peak_rss(None);
    // A persistent store answers queries from its last commit: wait for it before counting.
    let (counted, failed) = if finished && app.wait_until_caught_up(timeout) {
        tally(&app, &store)?
    } else {
        (0, 0)
    };
    let store_kind = app.describe().pipelines.first().map(|p| p.store_kind);
    app.shutdown().context("shut the runtime down")?;
    let until_shutdown = start.elapsed().as_secs_f64();
    Ok(Run {
        completed,
        seconds,
        finished,
        progress,
        peak_rss,
        rss_before,
        store_kind,
        until_shutdown,
        cpu_seconds,
        load,
        counted,
        failed,
    })
}

/// The store's counts summed over every key, and the records that failed.
fn tally(app: &StreamsApp, store: &str) -> anyhow::Result<(u64, u64)> {
    let mut counted = 0u64;
    for partition in app.query_range(store, None, None, &[], usize::MAX)? {
        for (key, value) in partition.entries {
            let count: u64 = std::str::from_utf8(&value)
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| anyhow!("the count of key {key:?} is not a number: {value:?}"))?;
            counted += count;
        }
    }
    let failed = app
        .process_metadata_for_store(store, false)?
        .instances
        .iter()
        .flat_map(|i| i.tasks.iter())
        .map(|t| t.records_failed)
        .sum();
    Ok((counted, failed))
}

/// A prefilled log plus `run_prefilled`, for the common case.
pub fn run_fresh(
    config: Config,
    records: u64,
    keys: Keys,
    processors: Vec<(String, Arc<dyn Processor>)>,
    timeout: Duration,
) -> anyhow::Result<Run> {
    let partitions = config.topics.first().map_or(1, |t| t.partitions);
    let log = MemoryLog::new();
    prefill(log.as_ref(), TOPIC, partitions, records, keys, 8)?;
    run_prefilled(config, log, processors, records, timeout)
}

/// A deadline for a run expected to take `expected` seconds: generous, so a
/// slow machine still finishes, but bounded, so a stuck run cannot hang CI.
pub fn deadline(expected: f64) -> Duration {
    Duration::from_secs_f64((expected * 10.0 + 10.0).min(300.0))
}

/// Resets this process's peak RSS (VmHWM), so the next reading covers what follows.
pub fn reset_peak_rss() {
    // Linux ≥ 4.0: writing 5 to clear_refs resets the high-water mark.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak RSS in bytes (VmHWM) of `pid`, or of this process.
pub fn peak_rss(pid: Option<u32>) -> Option<u64> {
    rss_field(pid, "VmHWM:")
}

/// Resident memory in bytes (VmRSS) of `pid`, or of this process.
pub fn rss(pid: Option<u32>) -> Option<u64> {
    rss_field(pid, "VmRSS:")
}

/// A `kB` field of /proc/<pid>/status, in bytes.
fn rss_field(pid: Option<u32>, field: &str) -> Option<u64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_string(),
    };
    let status = std::fs::read_to_string(path).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

pub use taskstream_server::scratch::TempDir;

/// A fresh directory `taskstream-bench-<name>-…` under the system temp dir,
/// removed on drop.
pub fn temp_dir(name: &str) -> anyhow::Result<TempDir> {
    taskstream_server::scratch::scratch_dir(&format!("bench-{name}"))
        .with_context(|| format!("create a temp dir for {name}"))
}

/// Bytes of every file under `dir` (0 when it is empty or missing).
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

/// What a persistent variant really ran with: the store kind the runtime
/// reports, and what it wrote under `data_dir`.
pub fn persistence_note(wanted: StoreKind, reported: Option<StoreKind>, data_dir: &Path) -> String {
    let bytes = dir_bytes(data_dir);
    match reported {
        Some(kind) if kind != wanted => format!(
            "store = \"{}\" not honoured: the runtime reports \"{}\"",
            wanted.as_str(),
            kind.as_str()
        ),
        _ if bytes == 0 => format!(
            "store = \"{}\" not honoured yet: nothing was written under data_dir",
            wanted.as_str()
        ),
        _ => format!("{} under data_dir", crate::report::mib(bytes)),
    }
}
