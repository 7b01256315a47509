//! ordering: what offset order costs against unordered at T = 16 — with uniform latency
//! (target ratio ≥ 0.95), and with 1 % of records 50× slower over a range of
//! `max_in_flight_records` — each against bare loops sleeping the same latencies in the same
//! run (with the slow tail, windowed: the most overlap each order's bound allows). Every
//! variant runs several times, alternating; medians and min–max, CPU and load per variant.

use super::Ctx;
use crate::bare;
use crate::plot::{self, Chart, Series};
use crate::repeat::{self, Measured, Samples};
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio};
use crate::workload::{self, Keys, deadline, run_fresh, simulate};
use std::sync::Arc;
use std::time::Duration;
use taskstream_server::config::LatencySpec;
use taskstream_server::log::Record;
use taskstream_server::processor::{Simulate, splitmix64};
use taskstream_server::{ProcessError, ProcessingOrder, Processor, ProcessorContext, ProcessorSpec};

const THREADS: usize = 16;
const LATENCY: [f64; 2] = [0.0, 4.0];
const MEAN_MS: f64 = (LATENCY[0] + LATENCY[1]) / 2.0;
const SLOW_FRACTION: f64 = 0.01;
const SLOW_FACTOR: f64 = 50.0;
const TARGET: f64 = 0.95;
const BOUNDS: [usize; 6] = [500, 1_000, 2_000, 5_000, 10_000, 20_000];
const ROUNDS: usize = 3;
/// How far, as a multiple of `max_in_flight_records`, an `unordered` task may fetch beyond its
/// watermark: the runtime's `SPAN_FACTOR` (server/src/runtime/task.rs), copied here because it
/// is private there. `offset` order with T > 1 holds completed records until the watermark
/// passes them, and its span is the bound itself.
const UNORDERED_SPAN_FACTOR: usize = 8;

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

/// The latencies the `simulate` processor of `spec` sleeps for `records` records of one
/// partition. A fresh log's partition starts at offset 0, so record i is offset i.
fn drawn_latencies(spec: &ProcessorSpec, records: u64) -> anyhow::Result<Vec<f64>> {
    let ProcessorSpec::Simulate { latency_ms, seed, .. } = spec else {
        anyhow::bail!("the uniform runs' processor is not `simulate`");
    };
    let drawer = Simulate {
        latency_ms: *latency_ms,
        cpu_work_us: 0,
        failure_rate: 0.0,
        fail_attempts: 0,
        seed: *seed,
    };
    Ok((0..records).map(|o| drawer.latency_ms_of(0, o)).collect())
}

/// A bare loop of `THREADS` threads over `latencies_ms`, windowed when `window` is given.
fn bare_run(latencies_ms: &[f64], window: Option<usize>) -> Measured {
    let load = repeat::load_average();
    let cpu = repeat::cpu_seconds();
    let seconds = match window {
        Some(window) => bare::windowed_sleep_loop(latencies_ms, THREADS, window),
        None => bare::sleep_loop(latencies_ms, THREADS),
    };
    Measured {
        seconds,
        records: latencies_ms.len() as u64,
        cpu_seconds: repeat::cpu_seconds() - cpu,
        load,
        finished: true,
    }
}

/// A bare run with its records/s.
fn bare_rate(measured: Measured) -> (Measured, f64) {
    (measured, measured.records as f64 / measured.seconds.max(1e-9))
}

/// "min–max" of runs' records/s.
fn rate_spread(rates: &[f64]) -> String {
    let min = rates.iter().copied().fold(f64::INFINITY, f64::min);
    let max = rates.iter().copied().fold(0.0, f64::max);
    if rates.is_empty() {
        "–".into()
    } else {
        format!("{}–{}", rate(min), rate(max))
    }
}

/// The window of a bare loop that allows what `order` allows at `bound`.
fn window_of(order: ProcessingOrder, bound: usize) -> usize {
    match order {
        ProcessingOrder::Offset => bound,
        ProcessingOrder::Key | ProcessingOrder::Unordered => bound * UNORDERED_SPAN_FACTOR,
    }
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let seconds = ctx.variant_seconds();
    let rounds = ctx.pick(ROUNDS, 1);
    let keys = Keys::Uniform { count: 1000, seed: 3 };
    let mut report = ScenarioReport::new(
        "ordering",
        "offset order vs unordered, each against bare loops over the same latencies",
        format!(
            "1 partition, T = N = {THREADS}, {}. Part 1: `simulate` latency uniform in {}–{} ms; \
             offset and unordered order, and a bare loop: {THREADS} threads taking the records \
             from a shared cursor and sleeping exactly the latencies `simulate` draws for them, \
             nothing else. Part 2: the same latency, but {}% of records (fixed by offset) take \
             {SLOW_FACTOR}× the mean ({} ms), at several `max_in_flight_records`. In `offset` \
             order (T > 1) the bound caps the records from the watermark to the fetch position \
             (completed ones wait there until every earlier one is done), so record o is fetched \
             only once o < watermark + bound; in `unordered` order it caps unfinished records, \
             and the span from the watermark may reach {UNORDERED_SPAN_FACTOR} × the bound. Each \
             order's limit at a bound is a windowed bare loop: {THREADS} threads take the records \
             in offset order from a shared cursor, record o starting only while o < (lowest \
             unfinished offset) + window, window = the bound (offset) or {UNORDERED_SPAN_FACTOR} × \
             the bound (unordered); a window of at least the record count is the plain loop, \
             which also runs once per round. Ours / bare = our median records/s over the bare \
             loop's. Ratio = offset median records/s / unordered median records/s at the same \
             setting. Part 2's verdict: each order at ≥ {TARGET} × its own windowed loop (the \
             ratio at one setting compares two different windows: at small bounds it shows what \
             the bound's meaning costs offset order, which no runtime could make up). Efficiency = records/s / (T / mean drawn latency). Each run gets about \
             {seconds} s of ideal work and is timed from `start()` until the watermark reaches \
             the end. Every variant runs {rounds} times: rounds outermost, and in each round a \
             group (part 1; in part 2 a bound with its bare loops) starts at a different variant; \
             medians with min–max. CPU µs/record = this process's CPU time over a run per \
             record. Load = the highest 1-minute load average at a run's start, marked when \
             above the core count.",
            keys.describe(),
            LATENCY[0],
            LATENCY[1],
            SLOW_FRACTION * 100.0,
            MEAN_MS * SLOW_FACTOR
        ),
    );
    let uniform_overloaded = uniform(&mut report, seconds, rounds, keys)?;
    let tail_overloaded = slow_tail(ctx, &mut report, seconds, rounds, keys)?;
    if uniform_overloaded || tail_overloaded {
        report.notes.push(
            "Some runs started with the load average above the core count: another process \
             shared the CPU, and their times say more about it than about taskstream."
                .into(),
        );
    }
    Ok(report)
}

/// Part 1: uniform latency, both orders and the bare loop, alternating. Whether a run was
/// overloaded.
fn uniform(report: &mut ScenarioReport, seconds: f64, rounds: usize, keys: Keys) -> anyhow::Result<bool> {
    let spec = simulate(Some(LatencySpec::Uniform(LATENCY)));
    let nominal_ideal = THREADS as f64 * 1000.0 / MEAN_MS;
    let records = (seconds * nominal_ideal).round() as u64;
    let latencies = drawn_latencies(&spec, records)?;
    let ideal = records as f64 / (latencies.iter().sum::<f64>() / 1000.0 / THREADS as f64);

    // None = the bare loop.
    let jobs = [
        Some(ProcessingOrder::Unordered),
        Some(ProcessingOrder::Offset),
        None,
    ];
    let samples = repeat::alternate(&jobs, rounds, |job| match *job {
        Some(order) => {
            let config = workload::config(1, THREADS, THREADS, order, spec.clone());
            Ok(run_fresh(config, records, keys, vec![], deadline(seconds))?.measured())
        }
        None => Ok(bare_run(&latencies, None)),
    })?;
    let (unordered, offset, bare) = (&samples[0], &samples[1], &samples[2]);
    let uniform_ratio = offset.median_rate() / unordered.median_rate().max(1e-9);

    let mut table = Table::new(
        format!(
            "Uniform latency: {} records (T / mean drawn latency = {} records/s)",
            group(records),
            rate(ideal)
        ),
        &[
            "order",
            "seconds (median)",
            "min–max",
            "records/s",
            "efficiency",
            "ours / bare",
            "ratio offset/unordered",
            "CPU µs/record",
            "load",
            "target",
            "pass/miss",
        ],
    );
    for (name, runs) in [
        ("unordered", unordered),
        ("offset", offset),
        ("bare sleep loop", bare),
    ] {
        let is_offset = name == "offset";
        let is_bare = name == "bare sleep loop";
        table.row(vec![
            name.into(),
            runs.median_seconds_cell(),
            runs.seconds_spread(),
            rate(runs.median_rate()),
            ratio(runs.median_rate() / ideal),
            if is_bare {
                "(limit)".into()
            } else {
                ratio(runs.median_rate() / bare.median_rate().max(1e-9))
            },
            if is_offset {
                ratio(uniform_ratio)
            } else if is_bare {
                "–".into()
            } else {
                "(reference)".into()
            },
            format!("{:.1}", runs.cpu_us_per_record()),
            runs.load_cell(),
            if is_offset {
                format!("≥ {TARGET}")
            } else {
                "–".into()
            },
            if is_offset {
                Verdict::of(offset.all_finished() && unordered.all_finished() && uniform_ratio >= TARGET)
            } else {
                Verdict::NoTarget
            }
            .as_str()
            .into(),
        ]);
    }
    report.tables.push(table);
    Ok(samples.iter().any(Samples::overloaded))
}

/// One timed variant of part 2.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Job {
    Ours(usize, ProcessingOrder),
    /// The bare loop with this window.
    Window(usize),
    /// The bare loop without one.
    Plain,
}

/// Part 2: the slow tail over `BOUNDS`, both orders and their windowed bare loops per bound.
/// Whether a run was overloaded.
fn slow_tail(
    ctx: &Ctx,
    report: &mut ScenarioReport,
    seconds: f64,
    rounds: usize,
    keys: Keys,
) -> anyhow::Result<bool> {
    let mean_ms = (1.0 - SLOW_FRACTION) * MEAN_MS + SLOW_FRACTION * MEAN_MS * SLOW_FACTOR;
    let records = ((seconds * THREADS as f64 * 1000.0 / mean_ms).round() as u64).max(1_000);
    let latencies: Vec<f64> = (0..records).map(|o| tail_latency_ms(0, o)).collect();
    // The ideal of the records actually drawn: the number of slow ones varies
    // enough from the expected 1 % to move a nominal ideal by several percent.
    let ideal = records as f64 / (latencies.iter().sum::<f64>() / 1000.0 / THREADS as f64);
    let slow = latencies
        .iter()
        .filter(|&&ms| ms >= MEAN_MS * SLOW_FACTOR)
        .count();

    // Groups: the plain loop, then per bound both orders and the windowed loops it brings in
    // (a window of at least the record count is the plain loop and is not run again).
    let mut jobs = vec![Job::Plain];
    let mut groups = vec![vec![0]];
    for bound in BOUNDS {
        let mut members = Vec::new();
        for order in [ProcessingOrder::Offset, ProcessingOrder::Unordered] {
            jobs.push(Job::Ours(bound, order));
            members.push(jobs.len() - 1);
        }
        for order in [ProcessingOrder::Offset, ProcessingOrder::Unordered] {
            let window = window_of(order, bound);
            if (window as u64) < records && !jobs.contains(&Job::Window(window)) {
                jobs.push(Job::Window(window));
                members.push(jobs.len() - 1);
            }
        }
        groups.push(members);
    }
    let limit_of = |bound: usize, order: ProcessingOrder| -> usize {
        let window = window_of(order, bound);
        jobs.iter().position(|j| *j == Job::Window(window)).unwrap_or(0)
    };

    // A run and its records/s.
    let measure = |job: Job| -> anyhow::Result<(Measured, f64)> {
        match job {
            Job::Ours(bound, order) => {
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
                let processors = vec![("slow-tail".to_string(), Arc::new(SlowTail) as Arc<dyn Processor>)];
                let run = run_fresh(config, records, keys, processors, deadline(seconds))?;
                Ok((run.measured(), run.throughput()))
            }
            Job::Window(window) => Ok(bare_rate(bare_run(&latencies, Some(window)))),
            Job::Plain => Ok(bare_rate(bare_run(&latencies, None))),
        }
    };
    // Rounds outermost, so each variant's runs spread over the whole part and a neighbour's
    // burst does not land on every run of one bound; within a round each bound's group starts
    // at a different variant, so neither order always runs first.
    let mut samples = vec![Samples::default(); jobs.len()];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); jobs.len()];
    for round in 0..rounds {
        for members in &groups {
            for step in 0..members.len() {
                let i = members[(round + step) % members.len()];
                let (measured, records_per_second) = measure(jobs[i])?;
                rates[i].push(records_per_second);
                samples[i].push(measured);
            }
        }
    }
    let plain_rate = samples[0].median_rate();

    let mut table = Table::new(
        format!(
            "{}% of records {SLOW_FACTOR}× slower: {slow} slow of {} records (T / mean drawn \
             latency = {} records/s; bare loop without a window {} records/s, median)",
            SLOW_FRACTION * 100.0,
            group(records),
            rate(ideal),
            rate(plain_rate)
        ),
        &[
            "max_in_flight_records",
            "offset records/s",
            "min–max",
            "unordered records/s",
            "min–max",
            "bare, window = bound",
            "offset / bare",
            &format!("bare, window = {UNORDERED_SPAN_FACTOR} × bound"),
            "unordered / bare",
            "ratio offset/unordered",
            "CPU µs/record (offset / unordered)",
            "load",
            "target",
            "pass/miss",
        ],
    );
    let position = |job: Job| jobs.iter().position(|j| *j == job).unwrap_or(0);
    let mut lines: [Vec<(f64, f64)>; 4] = Default::default();
    let mut smallest_bound: Option<(usize, f64, f64)> = None;
    for bound in BOUNDS {
        let offset_i = position(Job::Ours(bound, ProcessingOrder::Offset));
        let unordered_i = position(Job::Ours(bound, ProcessingOrder::Unordered));
        let (offset, unordered) = (&samples[offset_i], &samples[unordered_i]);
        let offset_bare = &samples[limit_of(bound, ProcessingOrder::Offset)];
        let unordered_bare = &samples[limit_of(bound, ProcessingOrder::Unordered)];
        let r = offset.median_rate() / unordered.median_rate().max(1e-9);
        let mut load = offset.clone();
        for other in [unordered, offset_bare, unordered_bare] {
            load.extend(other);
        }
        let x = bound as f64;
        lines[0].push((x, offset.median_rate()));
        lines[1].push((x, unordered.median_rate()));
        lines[2].push((x, offset_bare.median_rate()));
        lines[3].push((x, unordered_bare.median_rate()));
        if smallest_bound.is_none() {
            smallest_bound = Some((bound, offset_bare.median_rate(), unordered_bare.median_rate()));
        }
        table.row(vec![
            group(bound as u64),
            format!(
                "{}{}",
                rate(offset.median_rate()),
                if offset.all_finished() { "" } else { " (timed out)" }
            ),
            rate_spread(&rates[offset_i]),
            format!(
                "{}{}",
                rate(unordered.median_rate()),
                if unordered.all_finished() {
                    ""
                } else {
                    " (timed out)"
                }
            ),
            rate_spread(&rates[unordered_i]),
            rate(offset_bare.median_rate()),
            ratio(offset.median_rate() / offset_bare.median_rate().max(1e-9)),
            rate(unordered_bare.median_rate()),
            ratio(unordered.median_rate() / unordered_bare.median_rate().max(1e-9)),
            ratio(r),
            format!(
                "{:.1} / {:.1}",
                offset.cpu_us_per_record(),
                unordered.cpu_us_per_record()
            ),
            load.load_cell(),
            format!("each ≥ {TARGET} × its bare loop"),
            Verdict::of(
                offset.all_finished()
                    && unordered.all_finished()
                    && offset.median_rate() >= TARGET * offset_bare.median_rate()
                    && unordered.median_rate() >= TARGET * unordered_bare.median_rate(),
            )
            .as_str()
            .into(),
        ]);
    }
    report.tables.push(table);
    let overloaded = samples.iter().any(Samples::overloaded);

    let best = lines[0].iter().map(|p| p.1).fold(0.0, f64::max);
    if let Some((bound, _)) = lines[0].iter().find(|p| p.1 >= 0.95 * best) {
        report.notes.push(format!(
            "With the slow tail, offset order reaches 95 % of its best throughput from \
             max_in_flight_records = {} on (about {:.0} ms of work at the ideal rate; a slow record \
             holds the watermark for {} ms).",
            group(*bound as u64),
            *bound / ideal * 1000.0,
            MEAN_MS * SLOW_FACTOR
        ));
    }
    if let Some((bound, offset_window, unordered_window)) = smallest_bound {
        report.notes.push(format!(
            "At max_in_flight_records = {}, the bare loop with offset order's window runs at {} × \
             the one with unordered's: what the bound alone allows each order, with no runtime, \
             against offset / unordered measured in the table.",
            group(bound as u64),
            ratio(offset_window / unordered_window.max(1e-9))
        ));
    }
    report.notes.push(format!(
        "The bound limits both orders, differently: `offset` order (T > 1) fetches only while the \
         span from the watermark to the fetch position, completed records included, is below it; \
         `unordered` releases records as they complete, so the bound counts unfinished records, \
         and its span may reach {UNORDERED_SPAN_FACTOR} × the bound (a bare loop has at most T \
         records unfinished, fewer than any bound here, so only the span binds it). The windowed \
         bare loops model only these windows: they start records one by one as a thread frees, \
         while the runtime fetches in batches and, in offset order, runs records of one key (and \
         of keys sharing a lane) one at a time, so a slow record also holds the records queued \
         behind it in its lane."
    ));

    let [offset_line, unordered_line, offset_bare_line, unordered_bare_line] = lines;
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
                Series::line("bare loop, window = bound", offset_bare_line),
                Series::line(
                    format!("bare loop, window = {UNORDERED_SPAN_FACTOR} × bound"),
                    unordered_bare_line,
                ),
                Series::reference(
                    "bare loop, no window",
                    vec![
                        (BOUNDS[0] as f64, plain_rate),
                        (BOUNDS[BOUNDS.len() - 1] as f64, plain_rate),
                    ],
                ),
            ],
        },
    )?;
    report.plots.push("ordering.png".into());
    Ok(overloaded)
}
