//! floor: the runtime's own cost per record — a `count` pipeline on one partition with one
//! thread, so records/s is per thread — with the memory and the persistent store, over 10 k
//! and 1 M distinct keys, against the processor alone over the same records (the bare limit),
//! with a check that every record was counted once and none failed.

use super::Ctx;
use crate::repeat::{self, Measured, Samples};
use crate::report::{ScenarioReport, Table, Verdict, group, mib, rate, ratio};
use crate::workload::{self, Keys, Run, deadline, persistence_note, prefill, run_prefilled, temp_dir};
use std::time::Instant;
use taskstream_server::config::StoreKind;
use taskstream_server::processor::builtin;
use taskstream_server::{Log, MemoryLog, MemoryStore, ProcessingOrder, ProcessorContext, ProcessorSpec};

const ROUNDS: usize = 3;
const MEMORY_TARGET: f64 = 2_000_000.0;
const PERSISTENT_TARGET: f64 = 500_000.0;
/// A million keys may cost more than ten thousand (the map outgrows the caches), but not
/// half the throughput: the `scale` target of the benchmark issue.
const MANY_KEYS_SHARE: f64 = 0.5;

#[derive(Clone, Copy)]
struct Variant {
    store: StoreKind,
    keys: u32,
}

#[derive(Clone, Copy)]
enum Job {
    Ours(usize),
    /// The processor alone over the records of this key count.
    Bare(u32),
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let records = ctx.pick(4_000_000u64, 200_000);
    let rounds = ctx.pick(ROUNDS, 1);
    let key_counts = [10_000u32, ctx.pick(1_000_000, 100_000)];
    let variants: Vec<Variant> = key_counts
        .iter()
        .flat_map(|&keys| {
            [StoreKind::Memory, StoreKind::Persistent]
                .into_iter()
                .map(move |store| Variant { store, keys })
        })
        .collect();
    let mut jobs: Vec<Job> = (0..variants.len()).map(Job::Ours).collect();
    jobs.extend(key_counts.iter().map(|&k| Job::Bare(k)));

    // A run's details beyond its time: kept from each variant's first run.
    let mut first: Vec<Option<(Run, String)>> = vec![None; variants.len()];
    let mut miscounted: Vec<String> = Vec::new();
    let samples = repeat::alternate(&jobs, rounds, |job| match *job {
        Job::Ours(i) => {
            let variant = variants[i];
            let data_dir = temp_dir("floor")?;
            let mut config = workload::config(1, 1, 1, ProcessingOrder::Offset, ProcessorSpec::Count);
            if variant.store == StoreKind::Persistent {
                config.data_dir = Some(data_dir.path().to_path_buf());
            }
            config.pipelines[0].store = Some(variant.store);
            let log = MemoryLog::new();
            prefill(
                log.as_ref(),
                workload::TOPIC,
                1,
                records,
                keys_of(variant.keys),
                8,
            )?;
            let target = match variant.store {
                StoreKind::Memory => MEMORY_TARGET,
                StoreKind::Persistent => PERSISTENT_TARGET,
            };
            let run = run_prefilled(config, log, vec![], records, deadline(records as f64 / target))?;
            if !run.finished {
                miscounted.push(format!(
                    "{} store, {} keys: not caught up within its deadline ({} of {} records)",
                    variant.store.as_str(),
                    group(u64::from(variant.keys)),
                    group(run.completed),
                    group(records)
                ));
            } else if run.counted != records || run.failed != 0 {
                miscounted.push(format!(
                    "{} store, {} keys: {} counted of {} records, {} failed",
                    variant.store.as_str(),
                    group(u64::from(variant.keys)),
                    group(run.counted),
                    group(records),
                    group(run.failed)
                ));
            }
            let measured = Measured {
                // Only a run that counted every record once counts as finished.
                finished: run.finished && run.counted == records && run.failed == 0,
                ..run.measured()
            };
            if first[i].is_none() {
                let disk = if variant.store == StoreKind::Persistent {
                    persistence_note(variant.store, run.store_kind, data_dir.path())
                } else {
                    "–".into()
                };
                first[i] = Some((run, disk));
            }
            Ok(measured)
        }
        Job::Bare(keys) => processor_alone(records, keys),
    })?;
    let bare = |keys: u32| -> &Samples {
        let at = jobs
            .iter()
            .position(|j| matches!(j, Job::Bare(k) if *k == keys))
            .unwrap_or(0);
        &samples[at]
    };
    let median_rate_of = |store: StoreKind, keys: u32| {
        variants
            .iter()
            .position(|v| v.store == store && v.keys == keys)
            .map_or(0.0, |i| samples[i].median_rate())
    };

    let mut report = ScenarioReport::new(
        "floor",
        "per-thread floor of the runtime",
        format!(
            "`count` processor (one update of a decimal counter per record), {} records with keys \
             drawn uniformly from 10,000 or {} keys, 1 partition, N = T = 1, so records/s is per \
             thread. The log (a `MemoryLog`) is prefilled before the clock starts; each run is \
             timed from `start()` until the watermark reaches the end, and the verdict uses that \
             time. Persistent variants: `data_dir` = a fresh temp dir and `store = \"persistent\"` \
             (the log stays a `MemoryLog`: this measures the store), default \
             `commit_interval_ms` (1 s); \"incl. last commit\" adds the drain and the last commit \
             until `shutdown()` returned. Bare = the `count` processor alone calling a memory \
             store over the same records, in the same run. After each run the store's counts \
             are summed: a run whose sum is not the record count, or with a failed record, is a \
             miss. Every variant runs {rounds} times, alternating; medians and min–max. Peak RSS \
             is the harness's VmHWM during the first run (it includes the prefilled log).",
            group(records),
            group(u64::from(key_counts[1])),
        ),
    );
    let mut table = Table::new(
        "",
        &[
            "store",
            "keys",
            "records/s per thread (median)",
            "seconds min–max",
            "incl. last commit",
            "bare processor records/s",
            "ours / bare",
            "CPU µs/record",
            "peak RSS",
            "on disk",
            "load",
            "target",
            "pass/miss",
        ],
    );
    for (i, variant) in variants.iter().enumerate() {
        let ours = &samples[i];
        let bare = bare(variant.keys);
        let throughput = ours.median_rate();
        let (target, target_text) = if variant.keys == key_counts[0] {
            let target = match variant.store {
                StoreKind::Memory => MEMORY_TARGET,
                StoreKind::Persistent => PERSISTENT_TARGET,
            };
            (target, format!("≥ {}", rate(target)))
        } else {
            let few = median_rate_of(variant.store, key_counts[0]);
            (
                few * MANY_KEYS_SHARE,
                format!("≥ {MANY_KEYS_SHARE} × {} keys", group(u64::from(key_counts[0]))),
            )
        };
        let (until_shutdown, peak, disk) = first[i].as_ref().map_or_else(
            || ("–".into(), "–".into(), "–".into()),
            |(run, disk)| {
                (
                    rate(run.completed as f64 / run.until_shutdown.max(1e-9)),
                    format!(
                        "{} ({} before start)",
                        run.peak_rss.map_or("unknown".into(), mib),
                        run.rss_before.map_or("unknown".into(), mib)
                    ),
                    disk.clone(),
                )
            },
        );
        table.row(vec![
            variant.store.as_str().into(),
            group(u64::from(variant.keys)),
            format!(
                "{}{}",
                rate(throughput),
                if ours.all_finished() {
                    ""
                } else {
                    " (not all counted or finished)"
                }
            ),
            ours.seconds_spread(),
            until_shutdown,
            rate(bare.median_rate()),
            ratio(throughput / bare.median_rate().max(1e-9)),
            format!("{:.2}", ours.cpu_us_per_record()),
            peak,
            disk,
            ours.load_cell(),
            target_text,
            Verdict::of(ours.all_finished() && throughput >= target)
                .as_str()
                .into(),
        ]);
    }
    report.tables.push(table);
    for problem in miscounted {
        report
            .notes
            .push(format!("A run that is a miss whatever its speed: {problem}."));
    }
    Ok(report)
}

fn keys_of(count: u32) -> Keys {
    Keys::Uniform { count, seed: 5 }
}

/// The `count` processor alone over the records a run gets, on a memory store, one thread.
fn processor_alone(records: u64, keys: u32) -> anyhow::Result<Measured> {
    let log = MemoryLog::new();
    prefill(log.as_ref(), workload::TOPIC, 1, records, keys_of(keys), 8)?;
    let processor = builtin(&ProcessorSpec::Count).ok_or_else(|| anyhow::anyhow!("no count processor"))?;
    let store = MemoryStore::new();
    let context = ProcessorContext::standalone("bare_0", 0, &store);
    let mut batch = Vec::new();
    let load = repeat::load_average();
    let cpu = repeat::cpu_seconds();
    let start = Instant::now();
    let mut offset = 0;
    loop {
        batch.clear();
        log.read(workload::TOPIC, 0, offset, 10_000, &mut batch)?;
        if batch.is_empty() {
            break;
        }
        for record in &batch {
            processor
                .process(record, &context)
                .map_err(|e| anyhow::anyhow!("the count processor failed: {}", e.message))?;
        }
        offset += batch.len() as u64;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(Measured {
        seconds,
        records: offset,
        cpu_seconds: repeat::cpu_seconds() - cpu,
        load,
        finished: offset == records,
    })
}
