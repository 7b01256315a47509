//! durable: numbers for the durability work. Produce over gRPC in batches of
//! 1,000 into a memory log and a persistent log (`data_dir`), against an fsync
//! probe (the same bytes and group commits, nothing else) in the same run; then
//! restart a server on its data dir and time until its store holds every record
//! again: persistent store (read back) vs memory store (rebuilt from the log).

use super::Ctx;
use crate::repeat::{self, Measured, Samples};
use crate::report::{ScenarioReport, Table, Verdict, group, mib, rate, ratio, secs};
use crate::server::{STORE, ServeOptions, ServerProcess, TOPIC};
use crate::workload::{dir_bytes, temp_dir};
use anyhow::{Context as _, anyhow, bail};
use bytes::Bytes;
use std::io::Write as _;
use std::path::Path;
use std::sync::{Barrier, mpsc};
use std::time::{Duration, Instant};
use taskstream::v1 as pb;
use taskstream_client::StreamsClient;
use taskstream_server::config::StoreKind;
use taskstream_server::processor::splitmix64;

const BATCH: usize = 1_000;
const KEYS: u64 = 10_000;
const VALUE_BYTES: usize = 100;
const PARTITIONS: u32 = 4;
const ROUNDS: usize = 3;

/// One produce row.
#[derive(Clone, Copy)]
struct Variant {
    label: &'static str,
    /// `None`: the memory log (no `data_dir`); else the persistent log with this store.
    store: Option<StoreKind>,
    callers: usize,
    /// Whether each produce run is followed by a restart on its data dir.
    restart: bool,
}

const VARIANTS: [Variant; 5] = [
    Variant {
        label: "memory log",
        store: None,
        callers: 1,
        restart: false,
    },
    Variant {
        label: "memory log",
        store: None,
        callers: 4,
        restart: false,
    },
    Variant {
        label: "persistent log (data_dir)",
        store: Some(StoreKind::Persistent),
        callers: 1,
        restart: false,
    },
    Variant {
        label: "persistent log (data_dir)",
        store: Some(StoreKind::Persistent),
        callers: 4,
        restart: true,
    },
    Variant {
        label: "persistent log (data_dir)",
        store: Some(StoreKind::Memory),
        callers: 4,
        restart: true,
    },
];

impl Variant {
    fn restart_kind(&self) -> &'static str {
        if self.store == Some(StoreKind::Persistent) {
            "persistent store (read back)"
        } else {
            "memory store (rebuilt from the log)"
        }
    }
}

/// Record i's key index: `produce` and the fsync probe's bytes draw the same keys.
fn key_index(i: u64) -> u64 {
    splitmix64(11 ^ i) % KEYS
}

fn key_name(k: u64) -> String {
    format!("key-{k:07}")
}

/// Produces `records` records in batches of `BATCH` from `callers` concurrent
/// callers; returns the seconds from the first request to the last answer.
async fn produce(url: &str, records: u64, callers: usize) -> anyhow::Result<f64> {
    let value = Bytes::from(vec![b'v'; VALUE_BYTES]);
    let keys: Vec<Bytes> = (0..KEYS).map(|k| Bytes::from(key_name(k))).collect();
    let batches = records.div_ceil(BATCH as u64);
    let mut work: Vec<Vec<Vec<pb::ProducerRecord>>> = (0..callers).map(|_| Vec::new()).collect();
    // Built before the clock starts: only the RPCs are timed.
    for b in 0..batches {
        let first = b * BATCH as u64;
        let last = (first + BATCH as u64).min(records);
        let batch = (first..last)
            .map(|i| pb::ProducerRecord {
                key: Some(keys[key_index(i) as usize].clone()),
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

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// The bytes the persistent log stores for the first produce batch: per record an 8-byte
/// offset (the records table's key), then as `RedbLog` encodes a record: a format byte, the
/// zigzag timestamp and the key length as varints, the key, a header count, the value. What
/// redb adds around them (B-tree pages, the partition table, the commit header) is left out:
/// the probe is a floor.
fn batch_bytes(records: u64) -> Vec<u8> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let value = vec![b'v'; VALUE_BYTES];
    let mut buf = Vec::new();
    for i in 0..(BATCH as u64).min(records) {
        let key = key_name(key_index(i));
        buf.extend_from_slice(&i.to_be_bytes());
        buf.push(1);
        put_varint(&mut buf, now_ms << 1);
        put_varint(&mut buf, key.len() as u64 + 1);
        buf.extend_from_slice(key.as_bytes());
        put_varint(&mut buf, 0);
        buf.extend_from_slice(&value);
    }
    buf
}

/// What one fsync probe run did.
struct Probed {
    seconds: f64,
    fsyncs: u64,
}

/// The bare limit of a produce into the persistent log. `writers` threads hand `batches`
/// batches (dealt round-robin, as `produce` deals them to callers) to one committer thread,
/// each waiting for its batch's answer before it sends the next. The committer takes every
/// batch queued, appends their bytes to one file in `dir` and calls `sync_data` once for
/// them before it answers each: the log's group commit (one writer thread, one transaction
/// and one fsync per group of queued appends) without the encoding, B-tree or RPC around it,
/// nor the commits of offsets and store that the server makes besides.
fn fsync_probe(dir: &Path, batch: &[u8], batches: u64, writers: usize) -> anyhow::Result<Probed> {
    let path = dir.join("probe.log");
    let mut file = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("create {}", path.display()))?;
    let (requests, queue) = mpsc::channel::<mpsc::SyncSender<Result<(), String>>>();
    let start_line = Barrier::new(writers + 1);
    std::thread::scope(|scope| {
        let committer = scope.spawn(move || -> std::io::Result<u64> {
            let mut fsyncs = 0;
            while let Ok(first) = queue.recv() {
                let mut group = vec![first];
                group.extend(queue.try_iter());
                let written = group
                    .iter()
                    .try_for_each(|_| file.write_all(batch))
                    .and_then(|()| file.sync_data());
                fsyncs += 1;
                for reply in group {
                    let _ = reply.send(written.as_ref().map(drop).map_err(|e| e.to_string()));
                }
                written?;
            }
            Ok(fsyncs)
        });
        let start_line = &start_line;
        let handles: Vec<_> = (0..writers as u64)
            .map(|w| {
                let requests = requests.clone();
                scope.spawn(move || -> anyhow::Result<()> {
                    let mine = (0..batches).filter(|b| b % writers as u64 == w).count();
                    let (reply, answer) = mpsc::sync_channel(1);
                    start_line.wait();
                    for _ in 0..mine {
                        requests
                            .send(reply.clone())
                            .map_err(|_| anyhow!("the fsync probe's committer stopped"))?;
                        answer
                            .recv()
                            .map_err(|_| anyhow!("the fsync probe's committer stopped"))?
                            .map_err(|e| anyhow!("fsync probe: {e}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        // The committer stops once every writer is done and has dropped its sender.
        drop(requests);
        start_line.wait();
        let start = Instant::now();
        for handle in handles {
            handle
                .join()
                .map_err(|_| anyhow!("an fsync probe writer panicked"))??;
        }
        let seconds = start.elapsed().as_secs_f64();
        let fsyncs = committer
            .join()
            .map_err(|_| anyhow!("the fsync probe's committer panicked"))?
            .context("fsync probe")?;
        Ok(Probed { seconds, fsyncs })
    })
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
    /// The restarted server's CPU time from its start until complete (or given up).
    cpu_seconds: f64,
    load: f64,
}

/// Restarts a server on `data_dir` and times it until ready, then until its
/// store holds `records` records.
fn restart(
    runtime: &tokio::runtime::Runtime,
    options: &ServeOptions,
    records: u64,
    timeout: Duration,
) -> anyhow::Result<Restore> {
    let load = repeat::load_average();
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
            // A fresh process: all its CPU time is the restart's.
            cpu_seconds: server.cpu_seconds(),
            load,
        })
    });
    server.stop(timeout).context("stop the restarted server")?;
    result
}

/// One produce run: the seconds, and the server's CPU time from before the first request
/// until every record was processed.
fn produce_variant(
    runtime: &tokio::runtime::Runtime,
    options: &ServeOptions,
    records: u64,
    callers: usize,
    timeout: Duration,
) -> anyhow::Result<(f64, f64)> {
    let server = ServerProcess::spawn(options, timeout).context("start the server")?;
    let cpu_before = server.cpu_seconds();
    let seconds = runtime.block_on(async {
        let seconds = produce(&server.url(), records, callers).await?;
        let client = StreamsClient::connect(server.url()).await?;
        caught_up(&client, timeout).await?;
        anyhow::Ok(seconds)
    })?;
    let cpu_seconds = server.cpu_seconds() - cpu_before;
    // Graceful: drain and commit, so a restart resumes from the end.
    server.stop(timeout).context("stop the server")?;
    Ok((seconds, cpu_seconds))
}

/// The restarts after one variant's produce runs.
#[derive(Default)]
struct Restarts {
    ready: Samples,
    complete: Samples,
    runs: usize,
    /// Runs that restored every record.
    completed: usize,
    /// The fewest records the store and the log held after a restart that answered.
    restored: Option<u64>,
    log_after: Option<u64>,
    errors: Vec<String>,
}

impl Restarts {
    fn add(&mut self, records: u64, restore: anyhow::Result<Restore>) {
        self.runs += 1;
        let r = match restore {
            Ok(r) => r,
            Err(error) => {
                self.errors.push(format!("{error:#}"));
                return;
            }
        };
        self.restored = Some(self.restored.map_or(r.restored, |n| n.min(r.restored)));
        self.log_after = Some(self.log_after.map_or(r.log_after, |n| n.min(r.log_after)));
        self.ready.push(Measured {
            seconds: r.ready_seconds,
            records,
            cpu_seconds: 0.0,
            load: r.load,
            finished: true,
        });
        if let Some(seconds) = r.complete_seconds {
            self.completed += 1;
            self.complete.push(Measured {
                seconds,
                records,
                cpu_seconds: r.cpu_seconds,
                load: r.load,
                finished: true,
            });
        }
    }

    /// Runs that answered but did not restore every record.
    fn not_restored(&self) -> usize {
        self.runs - self.errors.len() - self.completed
    }
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let records = ctx.pick(1_000_000u64, 100_000);
    let rounds = ctx.pick(ROUNDS, 1);
    let timeout = Duration::from_secs(ctx.pick(300, 60));
    let batches = records.div_ceil(BATCH as u64);
    let batch = batch_bytes(records);
    let mut probe_writers: Vec<usize> = VARIANTS
        .iter()
        .filter(|v| v.store.is_some())
        .map(|v| v.callers)
        .collect();
    probe_writers.sort_unstable();
    probe_writers.dedup();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let base = ServeOptions {
        partitions: PARTITIONS,
        threads: 2,
        ..ServeOptions::default()
    };

    // Each produce variant (with the restart that follows it) and each probe, alternated
    // together so all see the same machine.
    #[derive(Clone, Copy)]
    enum Job {
        Produce(usize),
        /// The fsync probe with `probe_writers[k]` writers.
        Probe(usize),
    }
    let mut jobs: Vec<Job> = (0..VARIANTS.len()).map(Job::Produce).collect();
    jobs.extend((0..probe_writers.len()).map(Job::Probe));
    let mut disk: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    let mut restarts: Vec<Restarts> = (0..VARIANTS.len()).map(|_| Restarts::default()).collect();
    let mut fsyncs: Vec<Vec<f64>> = vec![Vec::new(); probe_writers.len()];
    let samples = repeat::alternate(&jobs, rounds, |job| match *job {
        Job::Produce(i) => {
            let v = VARIANTS[i];
            let dir = temp_dir("durable")?;
            let options = ServeOptions {
                data_dir: v.store.map(|_| dir.path().to_path_buf()),
                store: v.store,
                ..base.clone()
            };
            let load = repeat::load_average();
            let (seconds, cpu_seconds) = produce_variant(&runtime, &options, records, v.callers, timeout)?;
            if v.store.is_some() {
                disk[i].push(dir_bytes(dir.path()) as f64);
            }
            if v.restart {
                restarts[i].add(records, restart(&runtime, &options, records, timeout));
            }
            Ok(Measured {
                seconds,
                records,
                cpu_seconds,
                load,
                finished: true,
            })
        }
        Job::Probe(k) => {
            let dir = temp_dir("durable-fsync")?;
            let load = repeat::load_average();
            let cpu = repeat::cpu_seconds();
            let probed = fsync_probe(dir.path(), &batch, batches, probe_writers[k])?;
            fsyncs[k].push(probed.fsyncs as f64);
            Ok(Measured {
                seconds: probed.seconds,
                records,
                cpu_seconds: repeat::cpu_seconds() - cpu,
                load,
                finished: true,
            })
        }
    })?;
    let probe_of = |writers: usize| -> Option<&Samples> {
        jobs.iter()
            .position(|j| matches!(j, Job::Probe(k) if probe_writers[*k] == writers))
            .map(|p| &samples[p])
    };

    let commit_ms = base.config(String::new()).commit_interval_ms;
    let mut report = ScenarioReport::new(
        "durable",
        "produce, restart and restore, against an fsync probe",
        format!(
            "Servers in their own processes, `count` on {PARTITIONS} partitions, N = 2, T = 1. \
             Produce: {} records ({VALUE_BYTES}-byte values, {} keys) in unary Produce calls of \
             {} records over TCP on 127.0.0.1, from 1 caller or 4 concurrent callers; timed from \
             the first request to the last answer. Every variant runs {rounds} time(s), \
             alternating with the others and with the probes; seconds and records/s are medians, \
             with min–max of the seconds. CPU µs/record is the server process's user + system CPU \
             time (read from /proc/<pid>/stat) from before the first request until every record \
             is processed, over the records: its gRPC handling, log writes and the `count` \
             pipeline, not the harness's client. Load = the highest 1-minute load average at a \
             run's start. \
             Fsync probe, the bare limit of the persistent log's produce: in a fresh temp dir \
             like the log's, {} batches of {} bytes (the first produce batch as the log stores \
             it: an 8-byte offset key and the log's record encoding — format byte, timestamp, \
             key length, key, header count, value — for each of its {} records; redb's B-tree \
             pages and commit header are left out) appended to one file by one committer thread \
             for as many writers as callers, each writer waiting for its batch's answer before \
             sending the next. The committer takes every batch queued, writes them and calls \
             `sync_data` once for the group, as the persistent log's writer thread does (one \
             redb transaction and one fsync per group of queued appends); the server's commits of \
             offsets and store (every {commit_ms} ms) are not in it. Ours / probe = our \
             records/s over the probe's with as many writers; the memory log has no fsync. \
             Restart: after each run of the persistent variants with 4 callers, the server stops \
             gracefully (drain and commit) and a new process starts on the same `data_dir`; \
             timed from spawn until it reports every task running and caught up (ready) and \
             until a range query over the store counts every record (complete); its CPU is the \
             new process's whole CPU time until complete.",
            group(records),
            group(KEYS),
            group(BATCH as u64),
            group(batches),
            group(batch.len() as u64),
            group((BATCH as u64).min(records)),
        ),
    );

    let mut table = Table::new(
        format!("Produce over gRPC, batches of {}", group(BATCH as u64)),
        &[
            "log",
            "store",
            "callers",
            "records",
            "seconds (median)",
            "min–max",
            "records/s",
            "fsync probe records/s",
            "ours / probe",
            "on disk after",
            "server CPU µs/record",
            "load",
            "target",
            "pass/miss",
        ],
    );
    let mut overloaded = false;
    for (i, v) in VARIANTS.iter().enumerate() {
        let ours = &samples[i];
        overloaded |= ours.overloaded();
        let probe = v.store.and(probe_of(v.callers));
        let disk_cell = if v.store.is_none() {
            "–".to_string()
        } else {
            let bytes = repeat::median(disk[i].iter().copied()) as u64;
            if bytes == 0 {
                "nothing written (not honoured yet)".into()
            } else {
                mib(bytes)
            }
        };
        table.row(vec![
            v.label.into(),
            v.store.map_or("memory", |s| s.as_str()).into(),
            v.callers.to_string(),
            group(records),
            secs(ours.median_seconds()),
            ours.seconds_spread(),
            rate(ours.median_rate()),
            probe.map_or("–".into(), |p| rate(p.median_rate())),
            probe.map_or("–".into(), |p| {
                ratio(ours.median_rate() / p.median_rate().max(1e-9))
            }),
            disk_cell,
            format!("{:.2}", ours.cpu_us_per_record()),
            ours.load_cell(),
            "–".into(),
            Verdict::NoTarget.as_str().into(),
        ]);
    }
    report.tables.push(table);

    let mut table = Table::new(
        "Fsync probe: the same bytes per batch, one sync_data per group of queued batches",
        &[
            "writers",
            "records",
            "batches",
            "seconds (median)",
            "min–max",
            "records/s",
            "fsyncs (median)",
            "batches per fsync",
            "ms per fsync",
            "harness CPU µs/record",
            "load",
        ],
    );
    for (j, job) in jobs.iter().enumerate() {
        let Job::Probe(k) = *job else { continue };
        let runs = &samples[j];
        overloaded |= runs.overloaded();
        let fsyncs = repeat::median(fsyncs[k].iter().copied());
        table.row(vec![
            probe_writers[k].to_string(),
            group(records),
            group(batches),
            secs(runs.median_seconds()),
            runs.seconds_spread(),
            rate(runs.median_rate()),
            group(fsyncs.round() as u64),
            format!("{:.2}", batches as f64 / fsyncs.max(1.0)),
            format!("{:.2}", runs.median_seconds() * 1000.0 / fsyncs.max(1.0)),
            format!("{:.2}", runs.cpu_us_per_record()),
            runs.load_cell(),
        ]);
    }
    report.tables.push(table);

    let mut table = Table::new(
        format!("Restart and restore {} records", group(records)),
        &[
            "store",
            "ready (s, median)",
            "min–max",
            "complete (s, median)",
            "min–max",
            "records in store after restart",
            "records in log after restart",
            "server CPU µs/record",
            "load",
            "target",
            "status",
        ],
    );
    for (v, r) in VARIANTS.iter().zip(&restarts) {
        if !v.restart {
            continue;
        }
        overloaded |= r.ready.overloaded();
        let answered = r.runs - r.errors.len();
        let complete = r.completed;
        let status = if complete == r.runs {
            "restored".to_string()
        } else {
            let mut status = format!("**restored in {complete} of {} runs**", r.runs);
            if r.not_restored() > 0 {
                status.push_str(" (durability not implemented yet?)");
            }
            if let Some(error) = r.errors.first() {
                status.push_str(&format!("; error: {error}"));
            }
            status
        };
        let median_or_dash = |s: &Samples| {
            if s.all_finished() {
                (secs(s.median_seconds()), s.seconds_spread())
            } else {
                ("–".to_string(), "–".to_string())
            }
        };
        let (ready, ready_spread) = median_or_dash(&r.ready);
        let (done, done_spread) = median_or_dash(&r.complete);
        table.row(vec![
            v.restart_kind().into(),
            ready,
            ready_spread,
            done,
            done_spread,
            r.restored
                .map_or("–".into(), |n| format!("{} of {}", group(n), group(records))),
            r.log_after.map_or("–".into(), group),
            if complete > 0 {
                format!("{:.2}", r.complete.cpu_us_per_record())
            } else {
                "–".into()
            },
            if answered > 0 {
                r.ready.load_cell()
            } else {
                "–".into()
            },
            "–".into(),
            status,
        ]);
    }
    report.tables.push(table);
    report.notes.push(
        "No targets are set for this scenario yet: it gives the numbers for the durability work. \
         The memory-store restart replays the persistent log to rebuild its store. Records in \
         store and log after restart are the fewest over the runs."
            .into(),
    );
    if overloaded {
        report.notes.push(
            "Some runs started with the load average above the core count: another process \
             shared the CPU, or this scenario's own earlier runs did. Its server and client \
             together keep about two cores busy, and the 1-minute average carries \
             them into the runs that follow; the load before the first run is in the header."
                .into(),
        );
    }
    Ok(report)
}
