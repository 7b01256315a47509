//! scale: how cost grows — throughput and peak RSS against partitions, distinct keys,
//! `max_in_flight_records` and stream subscribers; resident memory per idle task. A no-op
//! `count` pipeline on a prefilled in-memory log, so what grows is the runtime's own cost.

use super::Ctx;
use crate::bare;
use crate::plot::{self, Chart, Series};
use crate::repeat::{self, Samples};
use crate::report::{ScenarioReport, Table, Verdict, group, mib, rate, ratio};
use crate::workload::{self, Keys, deadline, prefill, run_prefilled};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use taskstream_server::config::StoreKind;
use taskstream_server::{
    EndAt, MemoryLog, ProcessingOrder, ProcessorSpec, StartAt, StreamsApp, SubscribeRequest,
    SubscriptionEvent,
};

const ROUNDS: usize = 3;
/// Targets of the benchmark issue.
const PARTITIONS_SHARE: f64 = 0.8;
const KEYS_SHARE: f64 = 0.5;
const IDLE_TASK_BYTES: f64 = 4096.0;
const SUBSCRIBERS_SHARE: f64 = 0.7;

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let records = ctx.pick(2_000_000u64, 100_000);
    let rounds = ctx.pick(ROUNDS, 1);
    let mut report = ScenarioReport::new(
        "scale",
        "how cost grows with partitions, keys, in-flight records and subscribers",
        format!(
            "`count` processor on a prefilled in-memory log, memory store unless said otherwise, \
             {} records, timed from `start()` until caught up; N = 2 stream threads (the cores), \
             T = 1 unless said otherwise. Every variant runs {rounds} times, alternating with the \
             others of its table; medians and min–max. Peak RSS is the harness's VmHWM during \
             the first run (reset before it; it includes the prefilled log).",
            group(records)
        ),
    );
    partitions_table(ctx, &mut report, records, rounds)?;
    keys_table(ctx, &mut report, records, rounds)?;
    in_flight_table(ctx, &mut report, records, rounds)?;
    subscribers_table(ctx, &mut report, records, rounds)?;
    idle_tasks_table(ctx, &mut report)?;
    Ok(report)
}

/// One throughput run of the count pipeline; its peak RSS is kept in `rss` when asked.
fn count_run(
    partitions: u32,
    keys: Keys,
    records: u64,
    configure: impl FnOnce(&mut taskstream_server::Config),
) -> anyhow::Result<workload::Run> {
    let mut config = workload::config(partitions, 2, 1, ProcessingOrder::Offset, ProcessorSpec::Count);
    config.pipelines[0].store = Some(StoreKind::Memory);
    configure(&mut config);
    let log = MemoryLog::new();
    prefill(log.as_ref(), workload::TOPIC, partitions, records, keys, 8)?;
    run_prefilled(config, log, vec![], records, deadline(records as f64 / 200_000.0))
}

/// Runs `values` alternating; answers each value's samples and its first run's peak RSS.
fn sweep<V: Copy>(
    values: &[V],
    rounds: usize,
    mut one: impl FnMut(V) -> anyhow::Result<workload::Run>,
) -> anyhow::Result<(Vec<Samples>, Vec<Option<u64>>)> {
    let mut peaks = vec![None; values.len()];
    let indices: Vec<usize> = (0..values.len()).collect();
    let samples = repeat::alternate(&indices, rounds, |&i| {
        let run = one(values[i])?;
        if peaks[i].is_none() {
            peaks[i] = run.peak_rss;
        }
        let complete = run.counted == run.completed && run.failed == 0;
        Ok(repeat::Measured {
            finished: run.finished && complete,
            ..run.measured()
        })
    })?;
    Ok((samples, peaks))
}

fn row_cells(samples: &Samples, peak: Option<u64>) -> Vec<String> {
    vec![
        format!(
            "{}{}",
            rate(samples.median_rate()),
            if samples.all_finished() {
                ""
            } else {
                " (not caught up or miscounted)"
            }
        ),
        samples.seconds_spread(),
        peak.map_or("unknown".into(), mib),
        format!("{:.2}", samples.cpu_us_per_record()),
        samples.load_cell(),
    ]
}

const COLUMNS: [&str; 5] = [
    "records/s (median)",
    "seconds min–max",
    "peak RSS",
    "CPU µs/record",
    "load",
];

fn partitions_table(
    ctx: &Ctx,
    report: &mut ScenarioReport,
    records: u64,
    rounds: usize,
) -> anyhow::Result<()> {
    let values: Vec<u32> = ctx.pick(vec![1, 8, 64, 512, 2048], vec![1, 8, 512]);
    let keys = Keys::Uniform {
        count: 10_000,
        seed: 3,
    };
    let (samples, peaks) = sweep(&values, rounds, |p| count_run(p, keys, records, |_| {}))?;
    let at = |p: u32| {
        values
            .iter()
            .position(|&v| v == p)
            .map_or(0.0, |i| samples[i].median_rate())
    };
    let mut columns = vec!["partitions"];
    columns.extend(COLUMNS);
    columns.extend(["target", "pass/miss"]);
    let mut table = Table::new(
        format!("partitions ({}, N = 2, T = 1)", keys.describe()),
        &columns,
    );
    for (i, &p) in values.iter().enumerate() {
        let mut row = vec![group(u64::from(p))];
        row.extend(row_cells(&samples[i], peaks[i]));
        if p == 512 {
            let share = samples[i].median_rate() / at(8).max(1e-9);
            row.push(format!("≥ {PARTITIONS_SHARE} × P = 8 (is {})", ratio(share)));
            row.push(
                Verdict::of(samples[i].all_finished() && share >= PARTITIONS_SHARE)
                    .as_str()
                    .into(),
            );
        } else {
            row.extend(["—".to_string(), Verdict::NoTarget.as_str().into()]);
        }
        table.row(row);
    }
    report.tables.push(table);
    let points = values
        .iter()
        .zip(&samples)
        .map(|(&p, s)| (f64::from(p), s.median_rate()))
        .collect();
    plot::draw(
        &ctx.plot_path("scale-partitions"),
        &Chart {
            title: "scale: records/s against partitions (count, N = 2)".into(),
            x_label: "partitions".into(),
            y_label: "records/s".into(),
            log_x: true,
            series: vec![Series::line("count pipeline", points)],
        },
    )?;
    report.plots.push("scale-partitions.png".into());
    Ok(())
}

fn keys_table(ctx: &Ctx, report: &mut ScenarioReport, records: u64, rounds: usize) -> anyhow::Result<()> {
    let values: Vec<u32> = ctx.pick(
        vec![10, 1_000, 10_000, 100_000, 1_000_000],
        vec![10, 10_000, 100_000],
    );
    let many = *values.last().unwrap_or(&1);
    let (samples, peaks) = sweep(&values, rounds, |count| {
        count_run(1, Keys::Uniform { count, seed: 3 }, records, |config| {
            config.num_stream_threads = 1;
        })
    })?;
    // The bare limit, in the same run: a count per key in one HashMap, the median of `rounds`.
    let bare: Vec<f64> = values
        .iter()
        .map(|&count| {
            let keys = Keys::Uniform { count, seed: 3 };
            repeat::median((0..rounds).map(|_| records as f64 / bare::count_loop(keys, records).max(1e-9)))
        })
        .collect();
    let at = |k: u32| {
        values
            .iter()
            .position(|&v| v == k)
            .map_or(0.0, |i| samples[i].median_rate())
    };
    let bare_at = |k: u32| values.iter().position(|&v| v == k).map_or(0.0, |i| bare[i]);
    let mut columns = vec!["distinct keys"];
    columns.extend(COLUMNS);
    columns.extend([
        "bare HashMap count, records/s",
        "ours / bare",
        "target",
        "pass/miss",
    ]);
    let mut table = Table::new("distinct keys (1 partition, N = T = 1, memory store)", &columns);
    for (i, &k) in values.iter().enumerate() {
        let mut row = vec![group(u64::from(k))];
        row.extend(row_cells(&samples[i], peaks[i]));
        row.push(rate(bare[i]));
        row.push(ratio(samples[i].median_rate() / bare[i].max(1e-9)));
        if k == many {
            let share = samples[i].median_rate() / at(10_000).max(1e-9);
            let bare_share = bare[i] / bare_at(10_000).max(1e-9);
            row.push(format!(
                "≥ {KEYS_SHARE} × 10,000 keys (is {}; bare {})",
                ratio(share),
                ratio(bare_share)
            ));
            row.push(
                Verdict::of(samples[i].all_finished() && share >= KEYS_SHARE)
                    .as_str()
                    .into(),
            );
        } else {
            row.extend(["—".to_string(), Verdict::NoTarget.as_str().into()]);
        }
        table.row(row);
    }
    report.tables.push(table);
    let points = values
        .iter()
        .zip(&samples)
        .map(|(&k, s)| (f64::from(k), s.median_rate()))
        .collect();
    plot::draw(
        &ctx.plot_path("scale-keys"),
        &Chart {
            title: "scale: records/s against distinct keys (count, N = T = 1)".into(),
            x_label: "distinct keys".into(),
            y_label: "records/s".into(),
            log_x: true,
            series: vec![Series::line("count pipeline", points)],
        },
    )?;
    report.plots.push("scale-keys.png".into());
    Ok(())
}

fn in_flight_table(
    ctx: &Ctx,
    report: &mut ScenarioReport,
    records: u64,
    rounds: usize,
) -> anyhow::Result<()> {
    let values: Vec<usize> = ctx.pick(vec![100, 1_000, 10_000, 100_000], vec![100, 10_000]);
    let keys = Keys::Uniform {
        count: 10_000,
        seed: 3,
    };
    let (samples, peaks) = sweep(&values, rounds, |limit| {
        count_run(1, keys, records, |config| {
            config.num_threads_per_task = 2;
            config.max_in_flight_records = limit;
            // A unit never holds more than the in-flight bound allows.
            config.max_batch_records = config.max_batch_records.min(limit);
        })
    })?;
    let mut columns = vec!["max_in_flight_records"];
    columns.extend(COLUMNS);
    let mut table = Table::new(
        format!(
            "max_in_flight_records (1 partition, N = T = 2, {})",
            keys.describe()
        ),
        &columns,
    );
    for (i, &limit) in values.iter().enumerate() {
        let mut row = vec![group(limit as u64)];
        row.extend(row_cells(&samples[i], peaks[i]));
        table.row(row);
    }
    report.tables.push(table);
    Ok(())
}

/// Subscribers follow the store's outcomes from offset 0 while the pipeline runs (they subscribe
/// right after `start()`, inside the timed run); each counts what it receives, and a run counts
/// only when every one of them saw every record.
fn subscribers_table(
    ctx: &Ctx,
    report: &mut ScenarioReport,
    records: u64,
    rounds: usize,
) -> anyhow::Result<()> {
    let values: Vec<usize> = ctx.pick(vec![0, 1, 10, 100, 1_000], vec![0, 10, 100]);
    let keys = Keys::Uniform {
        count: 10_000,
        seed: 3,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut peaks = vec![None; values.len()];
    let mut short = vec![false; values.len()];
    let indices: Vec<usize> = (0..values.len()).collect();
    let samples = repeat::alternate(&indices, rounds, |&i| {
        let (measured, peak, all_seen) = subscribed_run(&runtime, values[i], keys, records)?;
        if peaks[i].is_none() {
            peaks[i] = peak;
        }
        short[i] |= !all_seen;
        Ok(measured)
    })?;
    let none = samples[0].median_rate();
    let mut columns = vec!["subscribers"];
    columns.extend(COLUMNS);
    columns.extend(["target", "pass/miss"]);
    let mut table = Table::new(
        format!(
            "stream subscribers following at full rate (1 partition, N = T = 1, {})",
            keys.describe()
        ),
        &columns,
    );
    for (i, &n) in values.iter().enumerate() {
        let mut row = vec![group(n as u64)];
        let mut cells = row_cells(&samples[i], peaks[i]);
        if short[i] {
            cells[0].push_str(" (a subscriber missed outcomes)");
        }
        row.extend(cells);
        let share = samples[i].median_rate() / none.max(1e-9);
        let ok = samples[i].all_finished() && !short[i];
        let (target, verdict) = match n {
            100 => (
                format!("≥ {SUBSCRIBERS_SHARE} × none (is {})", ratio(share)),
                Verdict::of(ok && share >= SUBSCRIBERS_SHARE),
            ),
            1_000 => ("every subscriber sees every record".into(), Verdict::of(ok)),
            _ => ("—".into(), Verdict::NoTarget),
        };
        row.push(target);
        row.push(verdict.as_str().into());
        table.row(row);
    }
    report.tables.push(table);
    Ok(())
}

fn subscribed_run(
    runtime: &tokio::runtime::Runtime,
    subscribers: usize,
    keys: Keys,
    records: u64,
) -> anyhow::Result<(repeat::Measured, Option<u64>, bool)> {
    let mut config = workload::config(1, 1, 1, ProcessingOrder::Offset, ProcessorSpec::Count);
    config.pipelines[0].store = Some(StoreKind::Memory);
    // Every variant retains the whole run's outcomes, so a subscriber that joins a few
    // milliseconds after the start still gets every record from offset 0.
    config.outcome_retention_records = records as usize;
    let log = MemoryLog::new();
    prefill(log.as_ref(), workload::TOPIC, 1, records, keys, 8)?;
    workload::reset_peak_rss();
    let load = repeat::load_average();
    let cpu = repeat::cpu_seconds();
    let start = Instant::now();
    let app = StreamsApp::builder(config).log(log).start()?;
    let seen = Arc::new(AtomicU64::new(0));
    let mut followers = Vec::with_capacity(subscribers);
    for _ in 0..subscribers {
        let request = || SubscribeRequest {
            in_order: false,
            start: StartAt::Offsets([(0, 0)].into()),
            end: EndAt::Offsets([(0, records)].into()),
            partitions: vec![0],
        };
        // The task may still be starting (UNAVAILABLE): retry for a while.
        let mut subscription = loop {
            match app.subscribe(workload::STORE, request()) {
                Ok(subscription) => break subscription,
                Err(error) if start.elapsed() > Duration::from_secs(10) => return Err(error.into()),
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        };
        let seen = seen.clone();
        followers.push(runtime.spawn(async move {
            while let Some(Ok(event)) = subscription.next().await {
                if let SubscriptionEvent::Batch(batch) = event {
                    seen.fetch_add(batch.records.len() as u64, Ordering::Relaxed);
                }
            }
        }));
    }
    let finished = app.wait_until_caught_up(deadline(records as f64 / 200_000.0));
    let seconds = start.elapsed().as_secs_f64();
    let cpu_seconds = repeat::cpu_seconds() - cpu;
    let wanted = records * subscribers as u64;
    let drained = Instant::now();
    while seen.load(Ordering::Relaxed) < wanted && drained.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let all_seen = seen.load(Ordering::Relaxed) == wanted;
    let peak = workload::peak_rss(None);
    app.shutdown()?;
    for follower in followers {
        follower.abort();
    }
    Ok((
        repeat::Measured {
            seconds,
            records,
            cpu_seconds,
            load,
            finished,
        },
        peak,
        all_seen,
    ))
}

/// Resident memory of tasks that hold no record: fresh child processes (so that memory freed
/// by earlier runs and kept by the allocator cannot hide the growth) start the app on 1 and on
/// P empty partitions; the cost per task is the difference over P - 1, so the app's fixed cost
/// (its threads, runtimes and first allocations, about 1.4 MiB here) is not charged to tasks.
fn idle_tasks_table(ctx: &Ctx, report: &mut ScenarioReport) -> anyhow::Result<()> {
    let partitions: u32 = ctx.pick(2048, 256);
    let mut table = Table::new(
        format!("idle tasks: 1 and {partitions} empty partitions, one task each, N = 2 (fresh processes)"),
        &[
            "store",
            "RSS with 1 task",
            &format!("RSS with {partitions} tasks"),
            "per added task",
            "target",
            "pass/miss",
        ],
    );
    for store in [StoreKind::Memory, StoreKind::Persistent] {
        let one = idle_rss(1, store)?;
        let many = idle_rss(partitions, store)?;
        let per_task = many.saturating_sub(one) as f64 / f64::from(partitions - 1);
        let (target, verdict) = match store {
            StoreKind::Memory => (
                format!("≤ {} KiB", IDLE_TASK_BYTES / 1024.0),
                Verdict::of(per_task <= IDLE_TASK_BYTES),
            ),
            StoreKind::Persistent => ("reported (a file per task)".into(), Verdict::NoTarget),
        };
        table.row(vec![
            store.as_str().into(),
            mib(one),
            mib(many),
            format!("{:.1} KiB", per_task / 1024.0),
            target,
            verdict.as_str().into(),
        ]);
    }
    report.tables.push(table);
    Ok(())
}

/// RSS in bytes of a fresh child process whose app holds `partitions` idle tasks.
fn idle_rss(partitions: u32, store: StoreKind) -> anyhow::Result<u64> {
    let output = std::process::Command::new(std::env::current_exe()?)
        .args([IDLE_TASKS_PROBE, &partitions.to_string(), store.as_str()])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "the idle-task probe failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answer = String::from_utf8_lossy(&output.stdout);
    let mut numbers = answer.split_whitespace().map(str::parse::<u64>);
    let (Some(Ok(_before)), Some(Ok(after))) = (numbers.next(), numbers.next()) else {
        anyhow::bail!("the idle-task probe answered `{answer}`, not two byte counts");
    };
    Ok(after)
}

/// The hidden first argument that runs [`idle_tasks_probe`] in a child process.
pub const IDLE_TASKS_PROBE: &str = "__idle_tasks";

/// Child side of the idle-task table: `__idle_tasks <partitions> <memory|persistent>` prints
/// the process's RSS in bytes before the app starts and once its tasks are idle.
pub fn idle_tasks_probe(args: &[String]) -> anyhow::Result<()> {
    let [partitions, store] = args else {
        anyhow::bail!("usage: {IDLE_TASKS_PROBE} <partitions> <memory|persistent>");
    };
    let partitions: u32 = partitions.parse()?;
    let store = match store.as_str() {
        "memory" => StoreKind::Memory,
        "persistent" => StoreKind::Persistent,
        other => anyhow::bail!("unknown store kind `{other}`"),
    };
    let data_dir = workload::temp_dir("scale-idle")?;
    let mut config = workload::config(partitions, 2, 1, ProcessingOrder::Offset, ProcessorSpec::Count);
    config.pipelines[0].store = Some(store);
    config.data_dir = Some(data_dir.path().to_path_buf());
    let log = MemoryLog::new();
    taskstream_server::Log::ensure_topic(log.as_ref(), workload::TOPIC, partitions)?;
    let before = workload::rss(None).unwrap_or(0);
    let app = StreamsApp::builder(config).log(log).start()?;
    app.wait_until_caught_up(Duration::from_secs(120));
    // Let the threads settle into their idle waits before reading.
    std::thread::sleep(Duration::from_millis(500));
    let after = workload::rss(None).unwrap_or(0);
    app.shutdown()?;
    println!("{before} {after}");
    Ok(())
}
