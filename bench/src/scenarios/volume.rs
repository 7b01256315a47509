//! volume: the Confluent Parallel Consumer README's scenario — 10,000 records, latency
//! uniform in 0–5 ms — with each of our rows beside the peer mode it corresponds to, the lower
//! bound of its row, and a bare loop sleeping the same drawn latencies measured in the same run
//! (the real limit). Every variant runs `ROUNDS` times, alternating; medians and min–max.

use super::Ctx;
use crate::bare;
use crate::plot::{self, Chart, Series};
use crate::repeat::{self, Measured, Samples};
use crate::report::{ScenarioReport, Table, Verdict, group, ratio, secs};
use crate::workload::{self, Keys, Run, deadline, run_fresh, simulate};
use taskstream_server::ProcessingOrder;
use taskstream_server::config::LatencySpec;
use taskstream_server::processor::Simulate;

pub(super) const RECORDS: u64 = 10_000;
pub(super) const LATENCY: [f64; 2] = [0.0, 5.0];
/// Ours over the limit of its row: the bare loop where there is one, else the lower bound
/// (which a real sleep, oversleeping by tens of µs per record, cannot quite reach).
const TARGET_OVER_BARE: f64 = 1.1;
const TARGET_OVER_BOUND: f64 = 1.15;
const ROUNDS: usize = 3;
/// Parallel Consumer's own key sweep (its README's table).
const KEY_SWEEP: [u32; 6] = [1, 2, 5, 10, 100, 10_000];

/// One row: how it runs, and which peer mode it answers.
#[derive(Clone)]
struct Variant {
    name: String,
    peer: &'static str,
    order: ProcessingOrder,
    partitions: u32,
    threads_per_task: usize,
    stream_threads: usize,
    keys: Keys,
    /// Whether a bare sleep loop with `stream_threads` threads is its limit (else the bound).
    bare: bool,
}

impl Variant {
    fn one_partition(name: &str, peer: &'static str, order: ProcessingOrder, t: usize, keys: Keys) -> Self {
        Variant {
            name: name.into(),
            peer,
            order,
            partitions: 1,
            threads_per_task: t,
            stream_threads: t,
            keys,
            bare: true,
        }
    }
}

/// Confluent Parallel Consumer's README (16 threads, their machine): PARTITION 22.2 s, KEY
/// (10,000 keys) 2.13 s, UNORDERED 2.8 s.
const PC_SOURCE: &str =
    "Confluent Parallel Consumer README, 10,000 records, 0–5 ms, 16 threads, their machine";

fn variants(records: u64) -> Vec<Variant> {
    let uniform = |count| Keys::Uniform { count, seed: 7 };
    let mut all = vec![
        Variant::one_partition(
            "offset, T = 16",
            "PC UNORDERED (2.8 s) plus offset-ordered delivery, commits and per-key order",
            ProcessingOrder::Offset,
            16,
            Keys::Distinct,
        ),
        Variant::one_partition(
            "key, T = 16, a key per record",
            "PC KEY, 10,000 keys (2.13 s)",
            ProcessingOrder::Key,
            16,
            Keys::Distinct,
        ),
        Variant::one_partition(
            "unordered, T = 16",
            "PC UNORDERED (2.8 s)",
            ProcessingOrder::Unordered,
            16,
            Keys::Distinct,
        ),
        Variant::one_partition(
            "T = 1",
            "Kafka Streams (one thread per task); PC PARTITION (22.2 s)",
            ProcessingOrder::Offset,
            1,
            Keys::Distinct,
        ),
        Variant {
            name: "16 partitions, N = 16, T = 1".into(),
            peer: "Kafka Streams scaled the only way it can: more partitions",
            order: ProcessingOrder::Offset,
            partitions: 16,
            threads_per_task: 1,
            stream_threads: 16,
            keys: Keys::Distinct,
            bare: false,
        },
        Variant::one_partition(
            "unordered, T = 100",
            "PC UNORDERED, maxConcurrency = 100",
            ProcessingOrder::Unordered,
            100,
            Keys::Distinct,
        ),
    ];
    for count in KEY_SWEEP {
        // With a quick run's few records, more keys than records say nothing new.
        if u64::from(count) > records {
            continue;
        }
        for (order, peer) in [
            (ProcessingOrder::Key, "PC KEY, same key count"),
            (
                ProcessingOrder::Offset,
                "PC KEY, same key count (we also keep offset order)",
            ),
        ] {
            all.push(Variant {
                name: format!(
                    "{}, T = 16, {} key{}",
                    order.as_str(),
                    group(u64::from(count)),
                    if count == 1 { "" } else { "s" }
                ),
                peer,
                order,
                partitions: 1,
                threads_per_task: 16,
                stream_threads: 16,
                keys: uniform(count),
                bare: false,
            });
        }
    }
    all
}

/// What draws each record's latency from its (partition, offset): the `simulate` processor of
/// these runs (`workload::simulate`, seed 42). Scenario `peers` draws the same latencies.
pub(super) fn drawer() -> Simulate {
    Simulate {
        latency_ms: Some(LatencySpec::Uniform(LATENCY)),
        cpu_work_us: 0,
        failure_rate: 0.0,
        fail_attempts: 0,
        seed: 42,
    }
}

/// The latencies `simulate` draws for the records as `prefill` lays them out, and each
/// record's key, in (partition, offset) order per partition.
struct Drawn {
    latencies_ms: Vec<f64>,
    keys: Vec<u64>,
    /// Each partition's total latency.
    partition_totals_ms: Vec<f64>,
}

fn drawn(variant: &Variant, records: u64) -> anyhow::Result<Drawn> {
    let sim = drawer();
    // Where each record lands: lay the records out as a run does and read them back.
    let log = taskstream_server::MemoryLog::new();
    workload::prefill(
        log.as_ref(),
        workload::TOPIC,
        variant.partitions,
        records,
        variant.keys,
        8,
    )?;
    let mut drawn = Drawn {
        latencies_ms: Vec::with_capacity(records as usize),
        keys: Vec::with_capacity(records as usize),
        partition_totals_ms: vec![0.0; variant.partitions as usize],
    };
    let mut key_ids = std::collections::HashMap::new();
    for partition in 0..variant.partitions {
        let mut out = Vec::new();
        let mut offset = 0;
        loop {
            out.clear();
            taskstream_server::Log::read(log.as_ref(), workload::TOPIC, partition, offset, 10_000, &mut out)?;
            if out.is_empty() {
                break;
            }
            for record in &out {
                let latency = sim.latency_ms_of(partition, record.offset);
                drawn.latencies_ms.push(latency);
                drawn.partition_totals_ms[partition as usize] += latency;
                let next_id = key_ids.len() as u64;
                let id = *key_ids.entry(record.key.clone()).or_insert(next_id);
                drawn.keys.push(id);
                offset = record.offset + 1;
            }
        }
    }
    Ok(drawn)
}

/// The fastest any runtime could go: T threads over the drawn latencies, records of one key
/// never at once where the order keeps keys apart, and one thread per partition at T = 1.
fn lower_bound(variant: &Variant, drawn: &Drawn) -> f64 {
    let t = variant.threads_per_task * variant.partitions as usize;
    let keyed = match variant.order {
        ProcessingOrder::Unordered => drawn.latencies_ms.iter().sum::<f64>() / t as f64 / 1000.0,
        ProcessingOrder::Key | ProcessingOrder::Offset => {
            bare::keyed_bound(&drawn.latencies_ms, &drawn.keys, t)
        }
    };
    let heaviest_partition = drawn.partition_totals_ms.iter().copied().fold(0.0, f64::max) / 1000.0;
    let per_partition = heaviest_partition / variant.threads_per_task as f64;
    keyed.max(per_partition)
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let records = ctx.pick(RECORDS, 500);
    let rounds = ctx.pick(ROUNDS, 1);
    let variants = variants(records);
    let drawn: Vec<Drawn> = variants
        .iter()
        .map(|v| drawn(v, records))
        .collect::<anyhow::Result<_>>()?;
    let bounds: Vec<f64> = variants
        .iter()
        .zip(&drawn)
        .map(|(v, d)| lower_bound(v, d))
        .collect();

    // Each variant and, where it has one, its bare loop: alternated together, so both see
    // the same machine.
    #[derive(Clone, Copy)]
    enum Job {
        Ours(usize),
        Bare(usize),
    }
    let mut jobs: Vec<Job> = (0..variants.len()).map(Job::Ours).collect();
    jobs.extend((0..variants.len()).filter(|&i| variants[i].bare).map(Job::Bare));
    let mut first_runs: Vec<Option<Run>> = vec![None; variants.len()];
    let samples = repeat::alternate(&jobs, rounds, |job| match *job {
        Job::Ours(i) => {
            let v = &variants[i];
            let mut config = workload::config(
                v.partitions,
                v.stream_threads,
                v.threads_per_task,
                v.order,
                simulate(Some(LatencySpec::Uniform(LATENCY))),
            );
            config.num_stream_threads = v.stream_threads;
            let run = run_fresh(config, records, v.keys, vec![], deadline(bounds[i]))?;
            let measured = run.measured();
            if first_runs[i].is_none() {
                first_runs[i] = Some(run);
            }
            Ok(measured)
        }
        Job::Bare(i) => {
            let load = repeat::load_average();
            let cpu = repeat::cpu_seconds();
            let seconds = bare::sleep_loop(&drawn[i].latencies_ms, variants[i].stream_threads);
            Ok(Measured {
                seconds,
                records,
                cpu_seconds: repeat::cpu_seconds() - cpu,
                load,
                finished: true,
            })
        }
    })?;
    let bare_of = |i: usize| -> Option<&Samples> {
        jobs.iter()
            .position(|j| matches!(j, Job::Bare(b) if *b == i))
            .map(|p| &samples[p])
    };

    let mut report = ScenarioReport::new(
        "volume",
        "Confluent Parallel Consumer's scenario, each row against its peer mode and its limit",
        format!(
            "{} records, `simulate` latency uniform in {}–{} ms (drawn per record), timed from \
             `start()` on a prefilled in-memory log until the watermark reaches the end. Each row \
             runs {rounds} times, alternating with the others and with the bare loops; seconds are \
             medians with min–max. Lower bound = max(total drawn latency / threads, the heaviest \
             key's total where records of a key never run at once, the heaviest partition's \
             total / T). Bare = threads sleeping exactly the drawn latencies, nothing else, in the \
             same run: the real limit of a row. CPU µs per record is this process's CPU time over \
             the run. Load = the highest load average at a run's start.",
            group(records),
            LATENCY[0],
            LATENCY[1],
        ),
    );
    let mut table = Table::new(
        "",
        &[
            "variant",
            "peer mode it corresponds to",
            "seconds (median)",
            "min–max",
            "lower bound (s)",
            "bare loop (s)",
            "ours / limit",
            "CPU µs/record",
            "load",
            "target",
            "pass/miss",
        ],
    );
    let mut overloaded = false;
    for (i, variant) in variants.iter().enumerate() {
        let ours = &samples[i];
        overloaded |= ours.overloaded();
        let bare = bare_of(i);
        let (limit, target) = match bare {
            Some(bare) => (bare.median_seconds(), TARGET_OVER_BARE),
            None => (bounds[i], TARGET_OVER_BOUND),
        };
        let over = ours.median_seconds() / limit.max(1e-9);
        table.row(vec![
            variant.name.clone(),
            variant.peer.into(),
            format!(
                "{}{}",
                secs(ours.median_seconds()),
                if ours.all_finished() { "" } else { " (timed out)" }
            ),
            ours.seconds_spread(),
            secs(bounds[i]),
            bare.map_or_else(|| "—".into(), |b| secs(b.median_seconds())),
            ratio(over),
            format!("{:.1}", ours.cpu_us_per_record()),
            ours.load_cell(),
            format!("≤ {target} × {}", if bare.is_some() { "bare" } else { "bound" }),
            Verdict::of(ours.all_finished() && over <= target).as_str().into(),
        ]);
    }
    report.tables.push(table);
    report.notes.push(format!(
        "Peer figures in parentheses are published numbers ({PC_SOURCE}), not measured here. \
         PC's PARTITION mode runs one record at a time per partition: its peer here is T = 1, \
         which is also Kafka Streams' one thread per task. Our `offset` order runs T records of \
         the partition at once, never two of one key, and delivers, releases and commits them \
         in offset order: PC's UNORDERED concurrency with PARTITION's guarantees on what is \
         delivered and committed."
    ));
    if overloaded {
        report.notes.push(
            "Some runs started with the load average above the core count: another process \
             shared the CPU, and their times say more about it than about taskstream."
                .into(),
        );
    }

    let mut series: Vec<Series> = first_runs
        .iter()
        .zip(&variants)
        .take(3)
        .filter_map(|(run, v)| {
            run.as_ref()
                .map(|r| Series::progress(v.name.clone(), r.progress.clone()))
        })
        .collect();
    if let Some(bare) = bare_of(0) {
        let limit = bare.median_seconds();
        series.push(Series::reference(
            format!("bare loop, 16 threads ({limit:.2} s)"),
            vec![(0.0, 0.0), (limit, records as f64)],
        ));
    }
    plot::draw(
        &ctx.plot_path("volume"),
        &Chart {
            title: format!("volume: {} records, 0–5 ms, 1 partition, T = 16", group(records)),
            x_label: "seconds since start".into(),
            y_label: "records completed".into(),
            log_x: false,
            series,
        },
    )?;
    report.plots.push("volume.png".into());
    Ok(report)
}
