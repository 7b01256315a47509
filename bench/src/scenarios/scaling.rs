//! scaling: `simulate` with a fixed 2 ms latency on one partition, T from 1 to
//! 64 (N = T), per order. Efficiency = throughput / (T / latency), the absolute
//! ideal; the target is ≥ 0.9 at every T. A bare sleep loop with T threads is
//! the real limit, measured in the same run; variants alternate over rounds.

use super::Ctx;
use crate::bare;
use crate::plot::{self, Chart, Series};
use crate::repeat::{self, Measured};
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio};
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

const ROUNDS: usize = 3;

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let seconds = ctx.variant_seconds();
    let rounds = ctx.pick(ROUNDS, 1);
    let keys = Keys::Uniform { count: 1000, seed: 1 };
    let mut report = ScenarioReport::new(
        "scaling",
        "throughput vs threads per task",
        format!(
            "`simulate` processor, fixed {LATENCY_MS} ms latency per record, 1 partition, {}, \
             N = T stream threads. Each variant is prefilled with about {seconds} s of ideal work \
             (T · {} records/s) and timed from `start()` until the watermark reaches the end. \
             Efficiency = throughput / (T / latency), the absolute ideal; bare = T threads doing \
             nothing but sleeping {LATENCY_MS} ms per record over the same records, in the same run \
             (the real limit: a sleep oversleeps). Every variant runs {rounds} times, alternating \
             with the others; medians and min–max. T = 1 runs once per round: with one thread per \
             task every order is offset order.",
            keys.describe(),
            1000.0 / LATENCY_MS
        ),
    );
    let records_for =
        |t: usize| ((seconds * t as f64 * 1000.0 / LATENCY_MS).round() as u64).max(20 * t as u64);

    #[derive(Clone, Copy)]
    enum Job {
        Ours(usize, ProcessingOrder),
        Bare(usize),
    }
    let mut jobs = vec![Job::Ours(1, ProcessingOrder::Offset), Job::Bare(1)];
    for &t in &THREADS[1..] {
        jobs.extend(ORDERS.iter().map(|&order| Job::Ours(t, order)));
        jobs.push(Job::Bare(t));
    }
    let samples = repeat::alternate(&jobs, rounds, |job| match *job {
        Job::Ours(t, order) => {
            let config = workload::config(1, t, t, order, simulate(Some(LatencySpec::Fixed(LATENCY_MS))));
            let run: Run = run_fresh(config, records_for(t), keys, vec![], deadline(seconds))?;
            Ok(run.measured())
        }
        Job::Bare(t) => {
            let records = records_for(t);
            let load = repeat::load_average();
            let cpu = repeat::cpu_seconds();
            let seconds = bare::sleep_loop(&vec![LATENCY_MS; records as usize], t);
            Ok(Measured {
                seconds,
                records,
                cpu_seconds: repeat::cpu_seconds() - cpu,
                load,
                finished: true,
            })
        }
    })?;
    let bare_rate = |t: usize| {
        jobs.iter()
            .position(|j| matches!(j, Job::Bare(b) if *b == t))
            .map_or(0.0, |p| samples[p].median_rate())
    };

    let mut table = Table::new(
        "",
        &[
            "order",
            "T",
            "records",
            "seconds (median)",
            "min–max",
            "records/s",
            "bare loop records/s",
            "ours / bare",
            "efficiency (vs T / latency)",
            "CPU µs/record",
            "load",
            "target",
            "pass/miss",
        ],
    );
    let mut lines: Vec<Vec<(f64, f64)>> = ORDERS.iter().map(|_| Vec::new()).collect();
    let mut rows: Vec<Vec<Vec<String>>> = ORDERS.iter().map(|_| Vec::new()).collect();
    let mut overloaded = false;
    for (job, runs) in jobs.iter().zip(&samples) {
        let Job::Ours(t, order) = *job else { continue };
        overloaded |= runs.overloaded();
        let ideal = t as f64 * 1000.0 / LATENCY_MS;
        let efficiency = runs.median_rate() / ideal;
        let row = vec![
            if t == 1 {
                "any (T = 1)".into()
            } else {
                order.as_str().into()
            },
            t.to_string(),
            group(records_for(t)),
            runs.median_seconds_cell(),
            runs.seconds_spread(),
            rate(runs.median_rate()),
            rate(bare_rate(t)),
            ratio(runs.median_rate() / bare_rate(t).max(1e-9)),
            ratio(efficiency),
            format!("{:.1}", runs.cpu_us_per_record()),
            runs.load_cell(),
            format!("≥ {TARGET}"),
            Verdict::of(runs.all_finished() && efficiency >= TARGET)
                .as_str()
                .into(),
        ];
        let i = ORDERS.iter().position(|o| *o == order).unwrap_or(0);
        if t == 1 {
            for line in &mut lines {
                line.push((1.0, runs.median_rate()));
            }
            table.row(row);
        } else {
            lines[i].push((t as f64, runs.median_rate()));
            rows[i].push(row);
        }
    }
    // Grouped by order in the table, though measured interleaved.
    for order_rows in rows {
        for row in order_rows {
            table.row(row);
        }
    }
    report.tables.push(table);
    if overloaded {
        report.notes.push(
            "Some runs started with the load average above the core count: another process \
             shared the CPU."
                .into(),
        );
    }

    let mut series: Vec<Series> = ORDERS
        .iter()
        .zip(lines)
        .map(|(order, points)| Series::line(order.as_str(), points))
        .collect();
    series.push(Series::reference(
        "ideal (T / latency)",
        THREADS
            .iter()
            .map(|&t| (t as f64, t as f64 * 1000.0 / LATENCY_MS))
            .collect(),
    ));
    series.push(Series::reference(
        "bare sleep loop",
        THREADS.iter().map(|&t| (t as f64, bare_rate(t))).collect(),
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
