//! volume: the Confluent Parallel Consumer README's scenario — 10,000 records,
//! latency uniform in 0–5 ms, one partition, 16 threads — in each order, with
//! their published figures beside ours. Target: ≤ 1.7 s in every order.

use super::Ctx;
use crate::plot::{self, Chart, Series};
use crate::report::{ScenarioReport, Table, Verdict, group, rate, secs};
use crate::workload::{self, Keys, deadline, run_fresh, simulate};
use taskstream_server::ProcessingOrder;
use taskstream_server::config::LatencySpec;

const RECORDS: u64 = 10_000;
const THREADS: usize = 16;
const LATENCY: [f64; 2] = [0.0, 5.0];
const TARGET_S: f64 = 1.7;

/// Confluent Parallel Consumer's README, 16 threads, their machine.
const PUBLISHED: [(ProcessingOrder, &str, f64); 3] = [
    (ProcessingOrder::Offset, "PARTITION", 22.2),
    (ProcessingOrder::Key, "KEY (10,000 keys)", 2.13),
    (ProcessingOrder::Unordered, "UNORDERED", 2.8),
];

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let ideal = RECORDS as f64 * (LATENCY[0] + LATENCY[1]) / 2.0 / 1000.0 / THREADS as f64;
    let mut report = ScenarioReport::new(
        "volume",
        "Confluent Parallel Consumer's scenario",
        format!(
            "{} records with {}, `simulate` latency uniform in {}–{} ms, 1 partition, T = N = {THREADS}, \
             timed from `start()` on a prefilled log until the watermark reaches the end. \
             Ideal = records · mean latency / T = {ideal:.3} s. The same size runs with `--quick`: \
             it takes a few seconds.",
            group(RECORDS),
            Keys::Distinct.describe(),
            LATENCY[0],
            LATENCY[1]
        ),
    );
    let mut table = Table::new(
        "",
        &[
            "order",
            "seconds",
            "records/s",
            "ideal (s)",
            "target",
            "pass/miss",
            "Confluent PC, published figure (16 threads, another machine)",
        ],
    );
    let mut series = Vec::new();
    for (order, their_mode, their_seconds) in PUBLISHED {
        let config = workload::config(
            1,
            THREADS,
            THREADS,
            order,
            simulate(Some(LatencySpec::Uniform(LATENCY))),
        );
        let run = run_fresh(config, RECORDS, Keys::Distinct, vec![], deadline(ideal))?;
        table.row(vec![
            order.as_str().into(),
            format!(
                "{}{}",
                secs(run.seconds),
                if run.finished { "" } else { " (timed out)" }
            ),
            rate(run.throughput()),
            secs(ideal),
            format!("≤ {TARGET_S} s"),
            Verdict::of(run.finished && run.seconds <= TARGET_S)
                .as_str()
                .into(),
            format!("{their_mode}: {their_seconds} s"),
        ]);
        series.push(Series::progress(order.as_str(), run.progress));
    }
    report.tables.push(table);
    report.notes.push(
        "The Confluent figures are published numbers from another machine, not measured here; \
         only their order of magnitude compares. Their PARTITION mode processes one record at a \
         time per partition; our `offset` order processes T ranges of the partition at once and \
         delivers and commits them in offset order, which is what PARTITION order guarantees."
            .into(),
    );
    series.push(Series::reference(
        format!("ideal ({ideal:.2} s)"),
        vec![(0.0, 0.0), (ideal, RECORDS as f64)],
    ));
    plot::draw(
        &ctx.plot_path("volume"),
        &Chart {
            title: format!(
                "volume: {} records, 0–5 ms, 1 partition, T = {THREADS}",
                group(RECORDS)
            ),
            x_label: "seconds since start".into(),
            y_label: "records completed".into(),
            log_x: false,
            series,
        },
    )?;
    report.plots.push("volume.png".into());
    Ok(report)
}
