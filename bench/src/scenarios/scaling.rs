//! scaling: `simulate` with a fixed 2 ms latency on one partition, T from 1 to
//! 64 (N = T), per order. Efficiency = throughput(T) / (T · throughput(1));
//! the target is ≥ 0.9 at every T. Orders are interleaved per T so that drift
//! in the machine's load hits every order alike.

use super::Ctx;
use crate::plot::{self, Chart, Series};
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio, secs};
use crate::workload::{self, Keys, Run, deadline, run_fresh, simulate};
use taskstream_server::ProcessingOrder;
use taskstream_server::config::LatencySpec;

const THREADS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
const ORDERS: [ProcessingOrder; 3] = [
    ProcessingOrder::Offset,
    ProcessingOrder::Key,
    ProcessingOrder::Unordered,
];
const LATENCY_MS: f64 = 2.0;
const TARGET: f64 = 0.9;

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let seconds = ctx.variant_seconds();
    let keys = Keys::Uniform { count: 1000, seed: 1 };
    let mut report = ScenarioReport::new(
        "scaling",
        "throughput vs threads per task",
        format!(
            "`simulate` processor, fixed {LATENCY_MS} ms latency per record, 1 partition, {}, \
             N = T stream threads. Each variant is prefilled with about {seconds} s of ideal work \
             (T · {} records/s) and timed from `start()` until the watermark reaches the end. \
             Efficiency = throughput(T) / (T · throughput(1)); ideal = T · measured throughput(1). \
             T = 1 runs once: with one thread per task every order is offset order.",
            keys.describe(),
            1000.0 / LATENCY_MS
        ),
    );

    let measure = |t: usize, order: ProcessingOrder| -> anyhow::Result<Run> {
        let ideal = t as f64 * 1000.0 / LATENCY_MS;
        let records = ((seconds * ideal).round() as u64).max(20 * t as u64);
        let config = workload::config(1, t, t, order, simulate(Some(LatencySpec::Fixed(LATENCY_MS))));
        run_fresh(config, records, keys, vec![], deadline(seconds))
    };

    let base = measure(1, ProcessingOrder::Offset)?;
    let base_rate = base.throughput();
    let mut table = Table::new(
        "",
        &[
            "order",
            "T",
            "records",
            "seconds",
            "records/s",
            "efficiency",
            "target",
            "pass/miss",
        ],
    );
    table.row(vec![
        "any (T = 1)".into(),
        "1".into(),
        group(base.completed),
        secs(base.seconds),
        rate(base_rate),
        "1.000".into(),
        "baseline".into(),
        if base.finished {
            Verdict::NoTarget
        } else {
            Verdict::Miss
        }
        .as_str()
        .into(),
    ]);

    let mut lines: Vec<Vec<(f64, f64)>> = ORDERS.iter().map(|_| vec![(1.0, base_rate)]).collect();
    let mut rows: Vec<Vec<Vec<String>>> = ORDERS.iter().map(|_| Vec::new()).collect();
    for &t in &THREADS[1..] {
        for (i, &order) in ORDERS.iter().enumerate() {
            let run = measure(t, order)?;
            let efficiency = run.throughput() / (t as f64 * base_rate);
            lines[i].push((t as f64, run.throughput()));
            let verdict = Verdict::of(run.finished && efficiency >= TARGET);
            rows[i].push(vec![
                order.as_str().into(),
                t.to_string(),
                group(run.completed),
                format!(
                    "{}{}",
                    secs(run.seconds),
                    if run.finished { "" } else { " (timed out)" }
                ),
                rate(run.throughput()),
                ratio(efficiency),
                format!("≥ {TARGET}"),
                verdict.as_str().into(),
            ]);
        }
    }
    // Grouped by order in the table, though measured interleaved.
    for order_rows in rows {
        for row in order_rows {
            table.row(row);
        }
    }
    report.tables.push(table);

    let mut series: Vec<Series> = ORDERS
        .iter()
        .zip(lines)
        .map(|(order, points)| Series::line(order.as_str(), points))
        .collect();
    series.push(Series::reference(
        "ideal (T · throughput(1))",
        THREADS
            .iter()
            .map(|&t| (t as f64, t as f64 * base_rate))
            .collect(),
    ));
    plot::draw(
        &ctx.plot_path("scaling"),
        &Chart {
            title: format!("scaling: simulate {LATENCY_MS} ms, 1 partition"),
            x_label: "threads per task T (N = T)".into(),
            y_label: "records/s".into(),
            log_x: true,
            series,
        },
    )?;
    report.plots.push("scaling.png".into());
    Ok(report)
}
