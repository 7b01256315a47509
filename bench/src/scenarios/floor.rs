//! floor: the runtime's own cost per record — a `count` pipeline on one
//! partition with one thread, so records/s is per thread — with the memory
//! store (target ≥ 2,000,000/s) and the persistent store (≥ 500,000/s).

use super::Ctx;
use crate::report::{ScenarioReport, Table, Verdict, group, mib, rate, secs};
use crate::workload::{self, Keys, deadline, persistence_note, prefill, run_prefilled, temp_dir};
use taskstream_server::config::StoreKind;
use taskstream_server::{MemoryLog, ProcessingOrder, ProcessorSpec};

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let keys = Keys::Uniform {
        count: 10_000,
        seed: 5,
    };
    let variants = [
        (StoreKind::Memory, 2_000_000.0, ctx.pick(4_000_000u64, 200_000)),
        (StoreKind::Persistent, 500_000.0, ctx.pick(4_000_000u64, 200_000)),
    ];
    let mut report = ScenarioReport::new(
        "floor",
        "per-thread floor of the runtime",
        format!(
            "`count` processor (one atomic update of a decimal counter per record), {}, 1 partition, \
             N = T = 1, so records/s is per thread. The log (a `MemoryLog`) is prefilled before the \
             clock starts; the run is timed from `start()` until the watermark reaches the end. \
             Persistent variant: `data_dir` = a fresh temp dir and pipeline `store = \"persistent\"` \
             (the log stays a `MemoryLog`: this measures the store), default `commit_interval_ms` \
             (1 s). Records/s counts until caught up; the verdict uses the time until `shutdown()` \
             returned, which adds the drain and the last commit (a persistent store's durable \
             point). Peak RSS is the harness process's VmHWM during the run (reset before it), which \
             includes the prefilled log.",
            keys.describe()
        ),
    );
    let mut table = Table::new(
        "",
        &[
            "store",
            "records",
            "seconds",
            "records/s per thread",
            "incl. last commit",
            "peak RSS",
            "RSS before start",
            "on disk",
            "target",
            "pass/miss",
        ],
    );
    for (kind, target, records) in variants {
        let data_dir = temp_dir("floor")?;
        let mut config = workload::config(1, 1, 1, ProcessingOrder::Offset, ProcessorSpec::Count);
        if kind == StoreKind::Persistent {
            config.data_dir = Some(data_dir.path().to_path_buf());
        }
        config.pipelines[0].store = Some(kind);
        let log = MemoryLog::new();
        prefill(log.as_ref(), workload::TOPIC, 1, records, keys, 8)?;
        let expected_seconds = records as f64 / target;
        // The persistent store is being built: a failure to start is a row, not the end of the run.
        match run_prefilled(config, log, vec![], records, deadline(expected_seconds)) {
            Ok(run) => {
                let committed = run.completed as f64 / run.until_shutdown.max(1e-9);
                let disk = if kind == StoreKind::Persistent {
                    persistence_note(kind, run.store_kind, data_dir.path())
                } else {
                    "–".into()
                };
                table.row(vec![
                    kind.as_str().into(),
                    group(run.completed),
                    format!(
                        "{}{}",
                        secs(run.seconds),
                        if run.finished { "" } else { " (timed out)" }
                    ),
                    rate(run.throughput()),
                    rate(committed),
                    run.peak_rss.map_or("unknown".into(), mib),
                    run.rss_before.map_or("unknown".into(), mib),
                    disk,
                    format!("≥ {}", rate(target)),
                    Verdict::of(run.finished && run.throughput() >= target)
                        .as_str()
                        .into(),
                ]);
            }
            Err(error) => table.row(vec![
                kind.as_str().into(),
                group(records),
                "–".into(),
                format!("error: {error:#}"),
                "–".into(),
                "–".into(),
                "–".into(),
                "–".into(),
                format!("≥ {}", rate(target)),
                Verdict::NotRun.as_str().into(),
            ]),
        }
    }
    report.tables.push(table);
    Ok(report)
}
