//! cpu: records that cost about 20 µs of hashing each (`simulate`
//! `cpu_work_us = 20`), one partition: the speedup of T = 2 over T = 1 on a
//! 2-core machine, target ≥ 1.8. Runs alternate so load drift hits both.

use super::Ctx;
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio, secs};
use crate::workload::{self, Keys, deadline, run_fresh};
use taskstream_server::{ProcessingOrder, ProcessorSpec};

const CPU_US: u64 = 20;
const TARGET: f64 = 1.8;

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let seconds = ctx.variant_seconds();
    let records = (seconds * 1e6 / CPU_US as f64).round() as u64;
    let keys = Keys::Uniform { count: 1000, seed: 4 };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut report = ScenarioReport::new(
        "cpu",
        "CPU-bound records",
        format!(
            "`simulate` with `cpu_work_us = {CPU_US}` (busy hashing, calibrated once per process), \
             no latency, 1 partition, {} records with {}; N = T. Speedup = throughput(T) / \
             throughput(T = 1). This machine has {cores} cores; other processes on it take from them.",
            group(records),
            keys.describe()
        ),
    );
    let spec = ProcessorSpec::Simulate {
        latency_ms: None,
        cpu_work_us: CPU_US,
        failure_rate: 0.0,
        fail_attempts: 0,
        seed: 4,
    };
    let variants = [
        (1, ProcessingOrder::Offset),
        (2, ProcessingOrder::Offset),
        (2, ProcessingOrder::Unordered),
    ];
    let mut runs = Vec::new();
    for (t, order) in variants {
        let config = workload::config(1, t, t, order, spec.clone());
        runs.push(run_fresh(config, records, keys, vec![], deadline(seconds))?);
    }
    let base = runs[0].throughput();
    let mut table = Table::new(
        "",
        &[
            "T",
            "order",
            "seconds",
            "records/s",
            "µs per record",
            "speedup",
            "target",
            "pass/miss",
        ],
    );
    for ((t, order), run) in variants.iter().zip(&runs) {
        let speedup = run.throughput() / base;
        table.row(vec![
            t.to_string(),
            order.as_str().into(),
            format!(
                "{}{}",
                secs(run.seconds),
                if run.finished { "" } else { " (timed out)" }
            ),
            rate(run.throughput()),
            format!("{:.1}", 1e6 / run.throughput()),
            ratio(speedup),
            if *t == 1 {
                "baseline".into()
            } else {
                format!("≥ {TARGET}")
            },
            if *t == 1 {
                Verdict::NoTarget
            } else {
                Verdict::of(run.finished && speedup >= TARGET)
            }
            .as_str()
            .into(),
        ]);
    }
    report.tables.push(table);
    Ok(report)
}
