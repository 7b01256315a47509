//! durable: numbers for the durability work. Produce over gRPC in batches of
//! 1,000 into a memory log and a persistent log (`data_dir`), then restart a
//! server on its data dir and time until its store holds every record again:
//! persistent store (read back) vs memory store (rebuilt by replaying the log).

use super::Ctx;
use crate::report::{ScenarioReport, Table, Verdict, group, mib, rate, secs};
use crate::server::{STORE, ServeOptions, ServerProcess, TOPIC};
use crate::workload::{dir_bytes, temp_dir};
use anyhow::{Context as _, bail};
use bytes::Bytes;
use std::time::{Duration, Instant};
use taskstream::v1 as pb;
use taskstream_client::StreamsClient;
use taskstream_server::config::StoreKind;
use taskstream_server::processor::splitmix64;

const BATCH: usize = 1_000;
const KEYS: u64 = 10_000;
const VALUE_BYTES: usize = 100;
const PARTITIONS: u32 = 4;

/// Produces `records` records in batches of `BATCH` from `callers` concurrent
/// callers; returns the seconds from the first request to the last answer.
async fn produce(url: &str, records: u64, callers: usize) -> anyhow::Result<f64> {
    let value = Bytes::from(vec![b'v'; VALUE_BYTES]);
    let keys: Vec<Bytes> = (0..KEYS).map(|k| Bytes::from(format!("key-{k:07}"))).collect();
    let batches = records.div_ceil(BATCH as u64);
    let mut work: Vec<Vec<Vec<pb::ProducerRecord>>> = (0..callers).map(|_| Vec::new()).collect();
    // Built before the clock starts: only the RPCs are timed.
    for b in 0..batches {
        let first = b * BATCH as u64;
        let last = (first + BATCH as u64).min(records);
        let batch = (first..last)
            .map(|i| pb::ProducerRecord {
                key: Some(keys[(splitmix64(11 ^ i) % KEYS) as usize].clone()),
                value: value.clone(),
                ..Default::default()
            })
            .collect();
        work[(b % callers as u64) as usize].push(batch);
    }
    let mut clients = Vec::new();
    for _ in 0..callers {
        clients.push(StreamsClient::connect(url).await?);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (client, batches) in clients.into_iter().zip(work) {
        tasks.push(tokio::spawn(async move {
            for records in batches {
                client.produce(TOPIC, records).await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Waits until every task's watermark reaches the end of its partition.
async fn caught_up(client: &StreamsClient, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(metadata) = client.process_metadata_for_store(STORE, false).await
            && metadata
                .metadata
                .iter()
                .flat_map(|m| &m.tasks)
                .all(|t| t.lag == 0)
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the server did not catch up within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Records counted by the store: the sum of every key's count.
async fn stored(client: &StreamsClient) -> anyhow::Result<u64> {
    let entries = client.range(STORE, None, None).await?;
    Ok(entries
        .iter()
        .filter_map(|(_, v)| std::str::from_utf8(v).ok()?.trim().parse::<u64>().ok())
        .sum())
}

/// Records in the log after a restart: the sum of end offsets.
async fn log_records(client: &StreamsClient) -> anyhow::Result<u64> {
    let metadata = client.process_metadata_for_store(STORE, false).await?;
    Ok(metadata
        .metadata
        .iter()
        .flat_map(|m| &m.tasks)
        .map(|t| t.end_offset.max(0) as u64)
        .sum())
}

struct Restore {
    ready_seconds: f64,
    /// Seconds from spawn until the store answered with every record.
    complete_seconds: Option<f64>,
    restored: u64,
    log_after: u64,
}

/// Restarts a server on `data_dir` and times it until ready, then until its
/// store holds `records` records.
fn restart(
    runtime: &tokio::runtime::Runtime,
    options: &ServeOptions,
    records: u64,
    timeout: Duration,
) -> anyhow::Result<Restore> {
    let spawned = Instant::now();
    let server = ServerProcess::spawn(options, timeout).context("restart the server")?;
    let ready_seconds = server.ready_after.as_secs_f64();
    let result = runtime.block_on(async {
        let client = StreamsClient::connect(server.url()).await?;
        let log_after = log_records(&client).await?;
        let deadline = Instant::now() + timeout;
        let mut restored = stored(&client).await.unwrap_or(0);
        // Nothing in the log means nothing to wait for.
        while restored < records && log_after > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
            restored = stored(&client).await.unwrap_or(0);
        }
        let complete_seconds = (restored >= records).then(|| spawned.elapsed().as_secs_f64());
        anyhow::Ok(Restore {
            ready_seconds,
            complete_seconds,
            restored,
            log_after,
        })
    });
    server.stop(timeout).context("stop the restarted server")?;
    result
}

struct Produced {
    label: String,
    store: &'static str,
    callers: usize,
    seconds: f64,
    disk: Option<u64>,
}

fn produce_variant(
    runtime: &tokio::runtime::Runtime,
    options: &ServeOptions,
    records: u64,
    callers: usize,
    timeout: Duration,
) -> anyhow::Result<f64> {
    let server = ServerProcess::spawn(options, timeout).context("start the server")?;
    let seconds = runtime.block_on(async {
        let seconds = produce(&server.url(), records, callers).await?;
        let client = StreamsClient::connect(server.url()).await?;
        caught_up(&client, timeout).await?;
        anyhow::Ok(seconds)
    })?;
    // Graceful: drain and commit, so a restart resumes from the end.
    server.stop(timeout).context("stop the server")?;
    Ok(seconds)
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let records = ctx.pick(1_000_000u64, 100_000);
    let timeout = Duration::from_secs(ctx.pick(300, 60));
    let mut report = ScenarioReport::new(
        "durable",
        "produce, restart and restore",
        format!(
            "Servers in their own processes, `count` on {PARTITIONS} partitions, N = 2, T = 1. \
             Produce: {} records ({VALUE_BYTES}-byte values, {} keys) in unary Produce calls of \
             {} records over TCP on 127.0.0.1, from 1 caller or 4 concurrent callers; timed from \
             the first request to the last answer. Restart: after the records are processed the \
             server stops gracefully (drain and commit) and a new process starts on the same \
             `data_dir`; timed from spawn until it reports every task running and caught up \
             (ready) and until a range query over the store counts every record (complete).",
            group(records),
            group(KEYS),
            group(BATCH as u64)
        ),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let base = ServeOptions {
        partitions: PARTITIONS,
        threads: 2,
        ..ServeOptions::default()
    };

    let mut produced: Vec<Produced> = Vec::new();
    let mut restores: Vec<(&'static str, anyhow::Result<Restore>)> = Vec::new();
    let variants: [(&str, Option<StoreKind>, usize, bool); 5] = [
        ("memory log", None, 1, false),
        ("memory log", None, 4, false),
        ("persistent log (data_dir)", Some(StoreKind::Persistent), 1, false),
        ("persistent log (data_dir)", Some(StoreKind::Persistent), 4, true),
        ("persistent log (data_dir)", Some(StoreKind::Memory), 4, true),
    ];
    for (label, store, callers, then_restart) in variants {
        let dir = temp_dir("durable")?;
        let options = ServeOptions {
            data_dir: store.map(|_| dir.path().to_path_buf()),
            store,
            ..base.clone()
        };
        let seconds = produce_variant(&runtime, &options, records, callers, timeout)?;
        produced.push(Produced {
            label: label.to_string(),
            store: store.map_or("memory", |s| s.as_str()),
            callers,
            seconds,
            disk: store.map(|_| dir_bytes(dir.path())),
        });
        if then_restart {
            let kind = if store == Some(StoreKind::Persistent) {
                "persistent store (read back)"
            } else {
                "memory store (rebuilt from the log)"
            };
            restores.push((kind, restart(&runtime, &options, records, timeout)));
        }
    }

    let mut table = Table::new(
        format!("Produce over gRPC, batches of {}", group(BATCH as u64)),
        &[
            "log",
            "store",
            "callers",
            "records",
            "seconds",
            "records/s",
            "on disk after",
            "target",
            "pass/miss",
        ],
    );
    for p in &produced {
        table.row(vec![
            p.label.clone(),
            p.store.into(),
            p.callers.to_string(),
            group(records),
            secs(p.seconds),
            rate(records as f64 / p.seconds.max(1e-9)),
            p.disk.map_or("–".into(), |b| {
                if b == 0 {
                    "nothing written (not honoured yet)".into()
                } else {
                    mib(b)
                }
            }),
            "–".into(),
            Verdict::NoTarget.as_str().into(),
        ]);
    }
    report.tables.push(table);

    let mut table = Table::new(
        format!("Restart and restore {} records", group(records)),
        &[
            "store",
            "ready (s)",
            "complete (s)",
            "records in store after restart",
            "records in log after restart",
            "target",
            "status",
        ],
    );
    for (kind, restore) in &restores {
        match restore {
            Ok(r) => table.row(vec![
                kind.to_string(),
                secs(r.ready_seconds),
                r.complete_seconds.map_or("–".into(), secs),
                format!("{} of {}", group(r.restored), group(records)),
                group(r.log_after),
                "–".into(),
                if r.complete_seconds.is_some() {
                    "restored".into()
                } else {
                    "**not restored** (durability not implemented yet?)".into()
                },
            ]),
            Err(error) => table.row(vec![
                kind.to_string(),
                "–".into(),
                "–".into(),
                "–".into(),
                "–".into(),
                "–".into(),
                format!("error: {error:#}"),
            ]),
        }
    }
    report.tables.push(table);
    report.notes.push(
        "No targets are set for this scenario yet: it gives the numbers for the durability work. \
         The memory-store restart replays the persistent log to rebuild its store."
            .into(),
    );
    Ok(report)
}
