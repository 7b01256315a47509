//! cpu: records that cost about 20 µs of hashing each (`simulate`
//! `cpu_work_us = 20`), one partition: the speedup of T = 2 over T = 1 on a
//! 2-core machine, target ≥ 1.8; T = 4 (oversubscribed) against T = 2; two
//! partitions with a thread each (Kafka Streams' way) against one. Repeated,
//! alternating; medians.

use super::Ctx;
use crate::repeat;
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio};
use crate::workload::{self, Keys, deadline, run_fresh};
use taskstream_server::{ProcessingOrder, ProcessorSpec};

const CPU_US: u64 = 20;
const TARGET: f64 = 1.8;
const ROUNDS: usize = 3;
/// "Not slower than T = 2", allowing the medians' own noise (a few per cent here).
const OVERSUBSCRIBED_SHARE: f64 = 0.95;

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
             throughput(T = 1). This machine has {cores} cores; other processes on it take from them. \
             Every variant runs {} times, alternating; medians and min–max. T = 4 oversubscribes \
             the cores and must keep ≥ {OVERSUBSCRIBED_SHARE} of T = 2's throughput; P = 2, T = 1 \
             is how Kafka Streams would use the two cores (two partitions, a thread each).",
            group(records),
            keys.describe(),
            ctx.pick(ROUNDS, 1)
        ),
    );
    let spec = ProcessorSpec::Simulate {
        latency_ms: None,
        cpu_work_us: CPU_US,
        failure_rate: 0.0,
        fail_attempts: 0,
        seed: 4,
    };
    // (partitions, T, order). P = 2, T = 1 is how Kafka Streams uses two cores; T = 4 on two
    // cores is oversubscribed and must not lose to T = 2.
    let variants: [(u32, usize, ProcessingOrder); 5] = [
        (1, 1, ProcessingOrder::Offset),
        (1, 2, ProcessingOrder::Offset),
        (1, 2, ProcessingOrder::Unordered),
        (1, 4, ProcessingOrder::Offset),
        (2, 1, ProcessingOrder::Offset),
    ];
    let rounds = ctx.pick(ROUNDS, 1);
    let samples = repeat::alternate(&variants, rounds, |&(partitions, t, order)| {
        let n = t * partitions as usize;
        let config = workload::config(partitions, n, t, order, spec.clone());
        Ok(run_fresh(config, records, keys, vec![], deadline(seconds))?.measured())
    })?;
    let base = samples[0].median_rate();
    let t2 = samples[1].median_rate();
    let mut table = Table::new(
        "",
        &[
            "partitions",
            "T",
            "order",
            "seconds (median)",
            "min–max",
            "records/s",
            "CPU µs/record",
            "speedup over T = 1",
            "load",
            "target",
            "pass/miss",
        ],
    );
    for ((partitions, t, order), runs) in variants.iter().zip(&samples) {
        let speedup = runs.median_rate() / base.max(1e-9);
        let (target, pass) = match (partitions, t) {
            (1, 1) => ("baseline".to_string(), None),
            (1, 2) => (format!("≥ {TARGET}"), Some(speedup >= TARGET)),
            (1, 4) => (
                "≥ T = 2 (offset)".to_string(),
                Some(runs.median_rate() >= t2 * OVERSUBSCRIBED_SHARE),
            ),
            _ => (format!("≥ {TARGET}"), Some(speedup >= TARGET)),
        };
        table.row(vec![
            partitions.to_string(),
            t.to_string(),
            order.as_str().into(),
            runs.median_seconds_cell(),
            runs.seconds_spread(),
            rate(runs.median_rate()),
            format!("{:.1}", runs.cpu_us_per_record()),
            ratio(speedup),
            runs.load_cell(),
            target,
            match pass {
                None => Verdict::NoTarget,
                Some(pass) => Verdict::of(runs.all_finished() && pass),
            }
            .as_str()
            .into(),
        ]);
    }
    report.tables.push(table);
    Ok(report)
}
