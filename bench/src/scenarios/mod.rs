//! The scenarios, one module each. A scenario runs its variants one after the
//! other in the same process and run (so their ratios are comparable), sizes
//! them by `Ctx::quick`, and returns a `ScenarioReport`.

mod cpu;
mod durable;
mod floor;
mod kafka;
mod ordering;
mod peers;
mod remote;
mod retry;
mod rpc;
mod scale;
pub use scale::{IDLE_TASKS_PROBE, idle_tasks_probe};
mod scaling;
mod volume;

use crate::report::ScenarioReport;
use std::path::PathBuf;

/// What every scenario gets.
pub struct Ctx {
    pub quick: bool,
    /// The results folder (plots are written here by the scenarios).
    pub out: PathBuf,
}

impl Ctx {
    /// `full` in a full run, `quick` with `--quick`.
    pub fn pick<T>(&self, full: T, quick: T) -> T {
        if self.quick { quick } else { full }
    }

    /// Seconds a variant should run for: long enough to mean something in a
    /// full run, tiny with `--quick`.
    pub fn variant_seconds(&self) -> f64 {
        self.pick(2.0, 0.25)
    }

    pub fn plot_path(&self, name: &str) -> PathBuf {
        self.out.join(format!("{name}.png"))
    }
}

pub struct Scenario {
    pub name: &'static str,
    pub summary: &'static str,
    pub run: fn(&Ctx) -> anyhow::Result<ScenarioReport>,
    /// Whether `--quick` without scenario names runs it (CI's run); `peers` starts a dozen
    /// JVMs and is left to the full run.
    pub in_quick_run: bool,
}

pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "scaling",
        summary: "throughput vs threads per task (simulate, 2 ms), per order",
        run: scaling::run,
        in_quick_run: true,
    },
    Scenario {
        name: "volume",
        summary: "10,000 records, 0–5 ms, T = 16: Confluent Parallel Consumer's scenario",
        run: volume::run,
        in_quick_run: true,
    },
    Scenario {
        name: "ordering",
        summary: "offset vs unordered at T = 16, and with a slow tail vs max_in_flight_records",
        run: ordering::run,
        in_quick_run: true,
    },
    Scenario {
        name: "cpu",
        summary: "CPU-bound records (20 µs of hashing): speedup of T = 2 over T = 1",
        run: cpu::run,
        in_quick_run: true,
    },
    Scenario {
        name: "floor",
        summary: "per-thread records/s of a no-op-ish count pipeline, memory and persistent store",
        run: floor::run,
        in_quick_run: true,
    },
    Scenario {
        name: "retry",
        summary: "healthy throughput with 1 % of records failing twice, retry topic vs blocking",
        run: retry::run,
        in_quick_run: true,
    },
    Scenario {
        name: "rpc",
        summary: "ProcessMetadataForStore vs a bare tonic server; GetMetadataAsync into Rust and Python",
        run: rpc::run,
        in_quick_run: true,
    },
    Scenario {
        name: "remote",
        summary: "remote ProcessorService sleeping 2 ms per call, T = 1…64, vs a bare tonic client; no-op remote vs count",
        run: remote::run,
        in_quick_run: true,
    },
    Scenario {
        name: "kafka",
        summary: "on Apache Kafka: one instance vs bare rdkafka limits (read-only, same work), exactly_once_v2 cost; SIGKILL and graceful failover times",
        run: kafka::run,
        in_quick_run: true,
    },
    Scenario {
        name: "durable",
        summary: "Produce over gRPC (memory vs persistent log), restart and restore",
        run: durable::run,
        in_quick_run: true,
    },
    Scenario {
        name: "scale",
        summary: "how cost grows: partitions, distinct keys, in-flight records, subscribers, idle tasks",
        run: scale::run,
        in_quick_run: true,
    },
    Scenario {
        name: "peers",
        summary: "volume's workload on Kafka: taskstream vs Kafka Streams, Parallel Consumer, Flink async I/O",
        run: peers::run,
        in_quick_run: false,
    },
];
