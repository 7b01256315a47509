//! ordering: what offset order costs against unordered at T = 16 — with uniform
//! latency (target ratio ≥ 0.95), and with 1 % of records 50× slower, over a
//! range of `max_in_flight_records`, to show the bound a slow tail needs.

use super::Ctx;
use crate::plot::{self, Chart, Series};
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio, secs};
use crate::workload::{self, Keys, Run, deadline, run_fresh, simulate};
use std::sync::Arc;
use std::time::Duration;
use taskstream_server::config::LatencySpec;
use taskstream_server::log::Record;
use taskstream_server::processor::splitmix64;
use taskstream_server::{ProcessError, ProcessingOrder, Processor, ProcessorContext, ProcessorSpec};

const THREADS: usize = 16;
const LATENCY: [f64; 2] = [0.0, 4.0];
const MEAN_MS: f64 = (LATENCY[0] + LATENCY[1]) / 2.0;
const SLOW_FRACTION: f64 = 0.01;
const SLOW_FACTOR: f64 = 50.0;
const TARGET: f64 = 0.95;
const BOUNDS: [usize; 6] = [500, 1_000, 2_000, 5_000, 10_000, 20_000];

/// Uniform latency, except that a fixed 1 % of records (drawn by offset)
/// take 50× the mean: a remote call that sometimes hangs.
struct SlowTail;

/// The latency of the record at `offset` (partition 0), in ms.
fn tail_latency_ms(partition: u32, offset: u64) -> f64 {
    let draw = splitmix64(0x5eed ^ ((partition as u64) << 40) ^ offset);
    let unit = |x: u64| (x >> 11) as f64 / (1u64 << 53) as f64;
    if unit(splitmix64(draw ^ 0x51_0e)) < SLOW_FRACTION {
        MEAN_MS * SLOW_FACTOR
    } else {
        LATENCY[0] + (LATENCY[1] - LATENCY[0]) * unit(draw)
    }
}

impl Processor for SlowTail {
    fn process(&self, record: &Record, _ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
        let ms = tail_latency_ms(record.partition, record.offset);
        std::thread::sleep(Duration::from_secs_f64(ms / 1000.0));
        Ok(())
    }
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let seconds = ctx.variant_seconds();
    let keys = Keys::Uniform { count: 1000, seed: 3 };
    let mut report = ScenarioReport::new(
        "ordering",
        "offset order vs unordered",
        format!(
            "1 partition, T = N = {THREADS}, {}. Part 1: `simulate` latency uniform in {}–{} ms. \
             Part 2: the same latency, but {}% of records (fixed by offset) take {SLOW_FACTOR}× the \
             mean ({} ms), at several `max_in_flight_records` (records fetched beyond the watermark: \
             what lets other threads go past a slow record). Ratio = offset throughput / unordered \
             throughput at the same setting; efficiency = throughput / ideal, where ideal = T / mean \
             latency (part 2: the mean of the latencies actually drawn). \
             Each variant gets about {seconds} s of ideal work.",
            keys.describe(),
            LATENCY[0],
            LATENCY[1],
            SLOW_FRACTION * 100.0,
            MEAN_MS * SLOW_FACTOR
        ),
    );

    // Part 1: uniform latency.
    let uniform_ideal = THREADS as f64 * 1000.0 / MEAN_MS;
    let records = (seconds * uniform_ideal).round() as u64;
    let uniform = |order: ProcessingOrder| -> anyhow::Result<Run> {
        let config = workload::config(
            1,
            THREADS,
            THREADS,
            order,
            simulate(Some(LatencySpec::Uniform(LATENCY))),
        );
        run_fresh(config, records, keys, vec![], deadline(seconds))
    };
    let offset = uniform(ProcessingOrder::Offset)?;
    let unordered = uniform(ProcessingOrder::Unordered)?;
    let uniform_ratio = offset.throughput() / unordered.throughput();
    let mut table = Table::new(
        "Uniform latency",
        &[
            "order",
            "records",
            "seconds",
            "records/s",
            "efficiency",
            "ratio offset/unordered",
            "target",
            "pass/miss",
        ],
    );
    for (order, run) in [("unordered", &unordered), ("offset", &offset)] {
        let is_offset = order == "offset";
        table.row(vec![
            order.into(),
            group(run.completed),
            secs(run.seconds),
            rate(run.throughput()),
            ratio(run.throughput() / uniform_ideal),
            if is_offset {
                ratio(uniform_ratio)
            } else {
                "(reference)".into()
            },
            if is_offset {
                format!("≥ {TARGET}")
            } else {
                "–".into()
            },
            if is_offset {
                Verdict::of(offset.finished && unordered.finished && uniform_ratio >= TARGET)
            } else {
                Verdict::NoTarget
            }
            .as_str()
            .into(),
        ]);
    }
    report.tables.push(table);

    // Part 2: slow tail, over max_in_flight_records; orders alternate per bound.
    let mean_ms = (1.0 - SLOW_FRACTION) * MEAN_MS + SLOW_FRACTION * MEAN_MS * SLOW_FACTOR;
    let records = ((seconds * THREADS as f64 * 1000.0 / mean_ms).round() as u64).max(1_000);
    // The ideal of the records actually drawn: the number of slow ones varies
    // enough from the expected 1 % to move a nominal ideal by several percent.
    let total_ms: f64 = (0..records).map(|o| tail_latency_ms(0, o)).sum();
    let slow = (0..records)
        .filter(|&o| tail_latency_ms(0, o) >= MEAN_MS * SLOW_FACTOR)
        .count();
    let tail_ideal = records as f64 / (total_ms / 1000.0 / THREADS as f64);
    let mut table = Table::new(
        format!(
            "{}% of records {SLOW_FACTOR}× slower: {} slow of {} records (ideal {} records/s)",
            SLOW_FRACTION * 100.0,
            slow,
            group(records),
            rate(tail_ideal)
        ),
        &[
            "max_in_flight_records",
            "offset records/s",
            "unordered records/s",
            "offset efficiency",
            "unordered efficiency",
            "ratio offset/unordered",
            "target",
            "pass/miss",
        ],
    );
    let mut offset_line = Vec::new();
    let mut unordered_line = Vec::new();
    for bound in BOUNDS {
        let tail = |order: ProcessingOrder| -> anyhow::Result<Run> {
            let mut config = workload::config(
                1,
                THREADS,
                THREADS,
                order,
                ProcessorSpec::Custom {
                    name: "slow-tail".into(),
                },
            );
            config.max_in_flight_records = bound;
            run_fresh(
                config,
                records,
                keys,
                vec![("slow-tail".to_string(), Arc::new(SlowTail) as Arc<dyn Processor>)],
                deadline(seconds),
            )
        };
        let offset = tail(ProcessingOrder::Offset)?;
        let unordered = tail(ProcessingOrder::Unordered)?;
        let r = offset.throughput() / unordered.throughput();
        offset_line.push((bound as f64, offset.throughput()));
        unordered_line.push((bound as f64, unordered.throughput()));
        table.row(vec![
            group(bound as u64),
            rate(offset.throughput()),
            rate(unordered.throughput()),
            ratio(offset.throughput() / tail_ideal),
            ratio(unordered.throughput() / tail_ideal),
            ratio(r),
            format!("≥ {TARGET}"),
            Verdict::of(offset.finished && unordered.finished && r >= TARGET)
                .as_str()
                .into(),
        ]);
    }
    report.tables.push(table);

    let best = offset_line.iter().map(|p| p.1).fold(0.0, f64::max);
    if let Some((bound, _)) = offset_line.iter().find(|p| p.1 >= 0.95 * best) {
        report.notes.push(format!(
            "With the slow tail, offset order reaches 95 % of its best throughput from \
             max_in_flight_records = {} on (about {:.0} ms of work at the ideal rate; a slow record \
             holds the watermark for {} ms).",
            group(*bound as u64),
            *bound / tail_ideal * 1000.0,
            MEAN_MS * SLOW_FACTOR
        ));
    }
    report.notes.push(
        "The in-flight bound counts records fetched beyond the watermark in every order, so a slow \
         record limits unordered too; offset order additionally holds completed ranges until the \
         earlier ones are done."
            .into(),
    );

    plot::draw(
        &ctx.plot_path("ordering"),
        &Chart {
            title: format!(
                "ordering: T = {THREADS}, {}% of records {SLOW_FACTOR}× slower",
                SLOW_FRACTION * 100.0
            ),
            x_label: "max_in_flight_records".into(),
            y_label: "records/s".into(),
            log_x: true,
            series: vec![
                Series::line("offset", offset_line),
                Series::line("unordered", unordered_line),
                Series::reference(
                    "ideal (T / mean latency)",
                    vec![
                        (BOUNDS[0] as f64, tail_ideal),
                        (BOUNDS[BOUNDS.len() - 1] as f64, tail_ideal),
                    ],
                ),
            ],
        },
    )?;
    report.plots.push("ordering.png".into());
    Ok(report)
}
