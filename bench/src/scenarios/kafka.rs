//! kafka: taskstream on Apache Kafka (a broker of its own from `crate::broker`).
//! Throughput of one instance (8 partitions, `count` into memory stores,
//! changelogs on; at-least-once and exactly_once_v2) against two bare rdkafka
//! limits over the same records on the same broker, alternating: a read-only
//! loop (consume and count per key, nothing produced) and a same-work loop
//! (count per key, one changelog record per key written in each commit
//! interval, offsets committed each interval), both with taskstream's thread
//! count and its Kafka log's client settings; then, with each group protocol,
//! the time from a SIGKILL and from a graceful stop of one of two instances
//! until the other processes all 8 partitions again.

use super::Ctx;
use crate::broker;
use crate::repeat::{self, Measured, Samples};
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio, secs};
use crate::server::{STORE, ServeOptions, ServerProcess, TOPIC};
use anyhow::{Context as _, anyhow, bail};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::producer::{BaseRecord, Producer as _, ThreadedProducer};
use rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use taskstream_client::StreamsClient;
use taskstream_server::config::LatencySpec;
use taskstream_server::log::KafkaLog;
use taskstream_server::{
    Config, Log as _, PipelineConfig, ProcessingGuarantee, ProcessorSpec, ProducerRecord, StreamsApp,
    TopicConfig,
};

const PARTITIONS: u32 = 8;
const KEYS: u64 = 10_000;
const VALUE_BYTES: usize = 16;
const ROUNDS: usize = 3;
/// The window a rate is measured over: from this share of the records done
/// to that one, so group joins and the last stragglers do not count.
const WINDOW: (f64, f64) = (0.1, 0.9);
/// Stream threads of taskstream's run, and threads of each bare loop.
const THREADS: usize = 2;
/// taskstream's commit interval, and the bare same-work loop's.
const COMMIT_MS: u64 = 200;
/// Stream threads of the `simulate` runs of the exactly-once cost (enough for T = 16).
const SIM_THREADS: usize = 16;
/// Targets of issue 47: taskstream's `count` against each limit.
const TARGET_READ_ONLY: f64 = 0.7;
const TARGET_SAME_WORK: f64 = 0.9;
/// exactly_once_v2 / at-least-once at T = 16.
const TARGET_EOS: f64 = 0.7;
/// taskstream's Kafka log's fetch settings (`READER_DEFAULTS` in
/// server/src/log/kafka.rs, which its group consumer and reader use).
const FETCH_SETTINGS: &[(&str, &str)] = &[
    ("queued.max.messages.kbytes", "8192"),
    ("queued.min.messages", "100000"),
    ("fetch.wait.max.ms", "100"),
];
/// taskstream's Kafka log's producer settings (`PRODUCER_DEFAULTS` and the
/// producer's partitioner in server/src/log/kafka.rs).
const PRODUCER_SETTINGS: &[(&str, &str)] = &[
    ("enable.idempotence", "true"),
    ("linger.ms", "5"),
    ("partitioner", "murmur2_random"),
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Loop {
    Taskstream(ProcessingGuarantee),
    /// Consume and count per key; nothing produced, nothing committed.
    ReadOnly,
    /// `ReadOnly` plus one changelog record per key written in each commit
    /// interval and the offsets committed each interval.
    SameWork,
}

impl Loop {
    fn name(self) -> &'static str {
        match self {
            Loop::Taskstream(ProcessingGuarantee::AtLeastOnce) => {
                "taskstream count, changelogs, at-least-once"
            }
            Loop::Taskstream(ProcessingGuarantee::ExactlyOnceV2) => {
                "taskstream count, changelogs, exactly_once_v2"
            }
            Loop::ReadOnly => "bare rdkafka read-only (count per key in a HashMap)",
            Loop::SameWork => "bare rdkafka same work (count, changelog per key per commit, offsets)",
        }
    }
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let broker = broker::start()?;
    let (formatted_in, started_in) = broker.start_times();
    let broker_rss = broker.rss_kib();
    let broker_pid = broker.pid();
    let bootstrap = broker.bootstrap().to_string();
    let records: u64 = ctx.pick(1_000_000, 20_000);
    let rounds = ctx.pick(ROUNDS, 1);
    let failover_rounds = ctx.pick(ROUNDS, 1);
    // --quick: the classic protocol's failover is left to the full run (each
    // SIGKILL waits out a 6 s session).
    let protocols: &[&str] = ctx.pick(&["consumer", "classic"], &["consumer"]);
    let mut report = ScenarioReport::new(
        "kafka",
        "one instance vs bare rdkafka limits (read-only, same work); exactly_once_v2; failover times",
        format!(
            "Apache Kafka (tests/kafka/pom.xml) on loopback: one broker and controller, started by \
             `bench::broker` (the tests' harness), on the same 2 cores as everything else. \
             Throughput: {} keyed records ({} keys, {VALUE_BYTES}-byte values) in {PARTITIONS} \
             partitions, written before any clock starts and read from the beginning by every run. \
             taskstream: one instance in the harness's process (a new application id per run; \
             {THREADS} stream threads, T = 1, `count` into memory stores, changelogs on, commits \
             every {COMMIT_MS} ms, KIP-848 group), at-least-once and exactly_once_v2. Bare loops: \
             {THREADS} threads, each with one rdkafka consumer manually assigned half of the \
             {PARTITIONS} partitions from the beginning, with taskstream's Kafka log's fetch \
             settings (queued.max.messages.kbytes = 8192, queued.min.messages = 100000, \
             fetch.wait.max.ms = 100); each counts per key in its own `HashMap`. The read-only \
             loop does nothing else. The same-work loop also, every {COMMIT_MS} ms, produces one \
             record per key counted since the last commit (its count, to the key's partition of a \
             changelog topic; one shared producer with taskstream's settings: idempotent, \
             linger.ms = 5), flushes it, and commits its partitions' offsets (synchronous), as \
             taskstream's at-least-once commit does; the commit runs on a thread beside each \
             consuming thread, which never waits for it. All are timed from {:.0} % to {:.0} % of the \
             records done (taskstream: the sum of its watermarks; bare: records counted), {rounds} \
             runs each, alternating; medians. CPU µs per record: the measuring process's CPU \
             time (user + system, /proc/self/stat) over the window's records; the broker's, from \
             /proc/<pid>/stat over the same window, apart. After each taskstream run its tasks \
             must report every record processed and none failed. \
             Failover: two server processes (the bench's `__serve`, 2 stream threads each) share \
             {PARTITIONS} partitions while about 2,000 records/s flow; one is killed (SIGKILL) or \
             stopped (graceful: drain and commit); the time is until the other hosts every \
             partition, RUNNING, each watermark at or past the partition's end at the kill or \
             stop, polled every 20 ms; {failover_rounds} run(s) of each, median.",
            group(records),
            group(KEYS),
            WINDOW.0 * 100.0,
            WINDOW.1 * 100.0,
        ),
    );

    let log = broker.log().clone();
    let input = format!("{}-in", broker::unique("bench-kafka"));
    broker.create_topic(&input, PARTITIONS)?;
    let changelog = format!("{input}-bare-changelog");
    broker.create_topic(&changelog, PARTITIONS)?;
    prefill(&log, &input, records)?;

    let variants = [
        Loop::Taskstream(ProcessingGuarantee::AtLeastOnce),
        Loop::ReadOnly,
        Loop::SameWork,
        Loop::Taskstream(ProcessingGuarantee::ExactlyOnceV2),
    ];
    let mut problems = Vec::new();
    let mut broker_cpu: Vec<(Loop, f64)> = Vec::new();
    let samples = repeat::alternate(&variants, rounds, |&variant| {
        let (measured, broker_seconds) = match variant {
            Loop::Taskstream(guarantee) => {
                let (measured, problem) = taskstream_run(
                    &bootstrap,
                    broker_pid,
                    &input,
                    records,
                    guarantee,
                    &Shape::count(),
                )?;
                problems.extend(problem);
                measured
            }
            Loop::ReadOnly => bare_run(&bootstrap, broker_pid, &input, None, records)?,
            Loop::SameWork => bare_run(&bootstrap, broker_pid, &input, Some(&changelog), records)?,
        };
        broker_cpu.push((variant, broker_seconds * 1e6 / measured.records.max(1) as f64));
        Ok(measured)
    })?;
    let broker_us = |variant: Loop| {
        repeat::median(
            broker_cpu
                .iter()
                .filter(|(v, _)| *v == variant)
                .map(|(_, us)| *us),
        )
    };
    let mut table = Table::new(
        "Throughput on one broker (records/s, median)",
        &[
            "loop",
            "records/s",
            "window seconds min–max",
            "CPU µs/record",
            "broker CPU µs/record",
            "load",
        ],
    );
    for (variant, samples) in variants.iter().zip(&samples) {
        table.row(vec![
            variant.name().into(),
            rate(samples.median_rate()),
            samples.seconds_spread(),
            format!("{:.2}", samples.cpu_us_per_record()),
            format!("{:.2}", broker_us(*variant)),
            samples.load_cell(),
        ]);
    }
    report.tables.push(table);
    let (ours, read_only, same_work, eos) = (&samples[0], &samples[1], &samples[2], &samples[3]);
    let mut verdict = Table::new(
        "taskstream count (at-least-once) / each limit, records/s",
        &["limit", "ratio", "target", "pass/miss"],
    );
    for (name, limit, target) in [
        ("bare read-only", read_only, TARGET_READ_ONLY),
        ("bare same work", same_work, TARGET_SAME_WORK),
    ] {
        let r = ours.median_rate() / limit.median_rate().max(1e-9);
        verdict.row(vec![
            name.into(),
            ratio(r),
            format!("≥ {target}"),
            Verdict::of(ours.all_finished() && r >= target).as_str().into(),
        ]);
    }
    report.tables.push(verdict);
    let mut eos_table = Table::new(
        "What exactly_once_v2 costs: taskstream count, T = 1, commits every 200 ms",
        &[
            "exactly_once_v2 / at-least-once, records/s",
            "CPU µs/record EOS / ALOS",
        ],
    );
    eos_table.row(vec![
        ratio(eos.median_rate() / ours.median_rate().max(1e-9)),
        ratio(eos.cpu_us_per_record() / ours.cpu_us_per_record().max(1e-9)),
    ]);
    report.tables.push(eos_table);

    // exactly_once_v2 against at-least-once with `simulate`, where a commit
    // waits for the task's records in flight to drain.
    let sim_records: u64 = ctx.pick(8_000, 800);
    let sim_input = format!("{}-sim", broker::unique("bench-kafka"));
    broker.create_topic(&sim_input, PARTITIONS)?;
    prefill(&log, &sim_input, sim_records)?;
    let sim_variants: Vec<(usize, ProcessingGuarantee)> = [1, 16]
        .into_iter()
        .flat_map(|t| {
            [
                ProcessingGuarantee::AtLeastOnce,
                ProcessingGuarantee::ExactlyOnceV2,
            ]
            .map(move |g| (t, g))
        })
        .collect();
    let mut sim_problems = Vec::new();
    let sim_samples = repeat::alternate(&sim_variants, rounds, |&(per_task, guarantee)| {
        let ((measured, _), problem) = taskstream_run(
            &bootstrap,
            broker_pid,
            &sim_input,
            sim_records,
            guarantee,
            &Shape::simulate(per_task),
        )?;
        sim_problems.extend(problem);
        Ok(measured)
    })?;
    let mut sim_table = Table::new(
        "What exactly_once_v2 costs with `simulate` 0–5 ms (records/s, median)",
        &[
            "T",
            "at-least-once records/s",
            "exactly_once_v2 records/s",
            "EOS / ALOS",
            "target",
            "pass/miss",
            "load",
        ],
    );
    for (i, per_task) in [1usize, 16].into_iter().enumerate() {
        let (alos, eos) = (&sim_samples[2 * i], &sim_samples[2 * i + 1]);
        let r = eos.median_rate() / alos.median_rate().max(1e-9);
        let mut both = alos.clone();
        both.extend(eos);
        sim_table.row(vec![
            per_task.to_string(),
            rate(alos.median_rate()),
            rate(eos.median_rate()),
            ratio(r),
            if per_task == 16 {
                format!("≥ {TARGET_EOS}")
            } else {
                "—".into()
            },
            if per_task == 16 {
                Verdict::of(alos.all_finished() && eos.all_finished() && r >= TARGET_EOS)
                    .as_str()
                    .into()
            } else {
                "—".into()
            },
            both.load_cell(),
        ]);
    }
    report.tables.push(sim_table);
    report.notes.push(format!(
        "The `simulate` runs: {} records in {PARTITIONS} partitions, latency uniform in 0–5 ms per \
         record (seed 42), {SIM_THREADS} stream threads, T = 1 and T = 16, commits every {COMMIT_MS} ms, \
         each guarantee {rounds} runs, alternating; timed like the count runs.",
        group(sim_records)
    ));
    problems.extend(sim_problems);
    for problem in problems {
        report.notes.push(format!("**problem:** {problem}"));
    }

    let mut failover = Table::new(
        "From one instance's end to all partitions processing on the other (seconds, median)",
        &[
            "group protocol",
            "SIGKILL",
            "min–max",
            "graceful stop",
            "min–max",
            "load",
        ],
    );
    for &protocol in protocols {
        let mut killed = Samples::default();
        let mut stopped = Samples::default();
        for _ in 0..failover_rounds {
            let (k, s) = failover_times(&log, &bootstrap, protocol)?;
            killed.push(k);
            stopped.push(s);
        }
        let mut every = killed.clone();
        every.extend(&stopped);
        let load = every.load_cell();
        failover.row(vec![
            if protocol == "consumer" {
                "consumer (KIP-848)"
            } else {
                "classic (cooperative-sticky)"
            }
            .into(),
            secs(killed.median_seconds()),
            killed.seconds_spread(),
            secs(stopped.median_seconds()),
            stopped.seconds_spread(),
            load,
        ]);
    }
    report.tables.push(failover);
    report.notes.push(
        "A SIGKILLed member's partitions move once the group's session times out: the test broker sets \
         group.consumer.session.timeout.ms = 6000 (KIP-848; Kafka's default is 45 s), and the classic \
         runs ask for session.timeout.ms = 6000 (the broker's group.min.session.timeout.ms is 1000). A \
         graceful stop drains and commits, then leaves the group, which hands its partitions over at once."
            .into(),
    );
    report.notes.push(
        "The read-only loop is the rate at which this machine brings the records in and counts them \
         with these client settings; the same-work loop adds what taskstream's at-least-once `count` \
         must send (one changelog record per key per commit, at most 10,000 per 200 ms here) and its \
         offset commits. Neither has stores, a scheduler or metadata; both read every record from the \
         broker, which shares the 2 cores."
            .into(),
    );
    report.notes.push(format!(
        "The broker: StorageTool format {:.1} s, first answer {:.1} s after the JVM's launch, RSS {} \
         after start (-Xmx512m, serial GC).",
        formatted_in.as_secs_f64(),
        started_in.as_secs_f64(),
        broker_rss.map_or("unknown".into(), |kib| format!("{} MiB", kib / 1024)),
    ));
    Ok(report)
}

/// Writes `records` keyed records to `topic` (before any clock starts).
fn prefill(log: &KafkaLog, topic: &str, records: u64) -> anyhow::Result<()> {
    let value = bytes::Bytes::from(vec![b'v'; VALUE_BYTES]);
    let mut written = 0;
    while written < records {
        let batch: Vec<ProducerRecord> = (written..(written + 10_000).min(records))
            .map(|i| {
                let key = format!("key-{:06}", taskstream_server::processor::splitmix64(i) % KEYS);
                ProducerRecord::keyed(key, value.clone())
            })
            .collect();
        written += batch.len() as u64;
        log.append(topic, batch).map_err(|e| anyhow!("prefill: {e}"))?;
    }
    Ok(())
}

/// What a taskstream run processes with: its processor and threads.
struct Shape {
    processor: ProcessorSpec,
    threads: usize,
    per_task: usize,
}

impl Shape {
    /// `count`, `THREADS` stream threads, T = 1.
    fn count() -> Shape {
        Shape {
            processor: ProcessorSpec::Count,
            threads: THREADS,
            per_task: 1,
        }
    }

    /// `simulate`, latency uniform in 0–5 ms per record, `SIM_THREADS` threads, T = `per_task`.
    fn simulate(per_task: usize) -> Shape {
        Shape {
            processor: ProcessorSpec::Simulate {
                latency_ms: Some(LatencySpec::Uniform([0.0, 5.0])),
                cpu_work_us: 0,
                failure_rate: 0.0,
                fail_attempts: 0,
                seed: 42,
            },
            threads: SIM_THREADS,
            per_task,
        }
    }
}

/// One instance counting `records` from `input` (a new application: a new
/// group, from the beginning) under `guarantee`. Also answers the broker's CPU
/// seconds in the window and what went wrong, if its tasks do not report every
/// record processed once and none failed.
fn taskstream_run(
    bootstrap: &str,
    broker_pid: u32,
    input: &str,
    records: u64,
    guarantee: ProcessingGuarantee,
    shape: &Shape,
) -> anyhow::Result<((Measured, f64), Option<String>)> {
    let config = Config {
        application_id: broker::unique("bench-kafka-app"),
        num_stream_threads: shape.threads,
        num_threads_per_task: shape.per_task,
        commit_interval_ms: COMMIT_MS,
        processing_guarantee: guarantee,
        bootstrap_servers: Some(bootstrap.to_string()),
        replication_factor: 1,
        topics: vec![TopicConfig::new(input, PARTITIONS)],
        pipelines: vec![PipelineConfig::new("counts", input, shape.processor.clone())],
        ..Config::default()
    };
    let app = StreamsApp::start(config).context("start the instance")?;
    let tasks = || {
        app.process_metadata_for_store("counts", false)
            .map(|m| m.instances.into_iter().flat_map(|i| i.tasks).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    let measured = window_run(records, broker_pid, || tasks().iter().map(|t| t.watermark).sum());
    // Every record reaches the watermark once processed; wait for the end.
    let deadline = Instant::now() + Duration::from_secs(120);
    let finished = loop {
        let tasks = tasks();
        if tasks.iter().map(|t| t.watermark).sum::<u64>() >= records {
            break tasks;
        }
        if Instant::now() >= deadline {
            break tasks;
        }
        // Polling: the runtime has no completion signal for a bounded input.
        std::thread::sleep(Duration::from_millis(10));
    };
    app.shutdown().map_err(|e| anyhow!("{e}"))?;
    let (mut measured, broker_seconds) = measured?;
    let processed: u64 = finished.iter().map(|t| t.records_processed).sum();
    let failed: u64 = finished.iter().map(|t| t.records_failed).sum();
    let problem = (processed != records || failed != 0 || finished.len() != PARTITIONS as usize).then(|| {
        measured.finished = false;
        format!(
            "a taskstream run ({guarantee:?}) reported {} of {} records processed, {failed} failed, on {} tasks",
            group(processed),
            group(records),
            finished.len()
        )
    });
    Ok(((measured, broker_seconds), problem))
}

/// A bare rdkafka loop of `THREADS` threads over `input`, each counting its
/// share of the partitions per key. With a `changelog` topic it also does what
/// taskstream's at-least-once commit does, every `COMMIT_MS`: one record per
/// key counted since the last commit, flushed, then the offsets committed.
/// Answers the window's measurement and the broker's CPU seconds in it.
fn bare_run(
    bootstrap: &str,
    broker_pid: u32,
    input: &str,
    changelog: Option<&str>,
    records: u64,
) -> anyhow::Result<(Measured, f64)> {
    let group_id = broker::unique("bench-kafka-bare");
    let producer: Option<Arc<ThreadedProducer<_>>> = match changelog {
        Some(_) => {
            let mut config = ClientConfig::new();
            for (key, value) in PRODUCER_SETTINGS {
                config.set(*key, *value);
            }
            let producer: ThreadedProducer<_> = config
                .set("bootstrap.servers", bootstrap)
                .create()
                .context("the bare producer")?;
            Some(Arc::new(producer))
        }
        None => None,
    };
    let read = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for thread in 0..THREADS {
        let mut config = ClientConfig::new();
        for (key, value) in FETCH_SETTINGS {
            config.set(*key, *value);
        }
        let consumer: BaseConsumer = config
            .set("bootstrap.servers", bootstrap)
            .set("group.id", &group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .create()
            .context("a bare consumer")?;
        let mine: Vec<i32> = (0..PARTITIONS as i32)
            .filter(|p| *p as usize % THREADS == thread)
            .collect();
        let mut assignment = TopicPartitionList::new();
        for &partition in &mine {
            assignment.add_partition_offset(input, partition, Offset::Beginning)?;
        }
        consumer.assign(&assignment)?;
        let consumer = Arc::new(consumer);
        // The commit of the same-work loop runs beside its consuming thread, as taskstream's
        // commit overlaps its processing: it sends an interval's changelog records, flushes
        // them, then commits the offsets read by the interval's end. The consumer never waits
        // for it (offsets are still committed only after their interval's records are
        // delivered): the fastest this work can go.
        let committer = match (&producer, changelog) {
            (Some(producer), Some(changelog)) => {
                let (send, receive) = std::sync::mpsc::channel::<Interval>();
                let (producer, consumer) = (producer.clone(), consumer.clone());
                let (input, changelog) = (input.to_string(), changelog.to_string());
                let handle = std::thread::spawn(move || -> anyhow::Result<()> {
                    for interval in receive {
                        for (key, value, partition) in &interval.written {
                            let mut pending = BaseRecord::<[u8], [u8]>::to(&changelog)
                                .key(key.as_slice())
                                .payload(value.as_bytes())
                                .partition(*partition);
                            loop {
                                match producer.send(pending) {
                                    Ok(()) => break,
                                    Err((_, back)) => {
                                        // Queue full: let deliveries drain, then again.
                                        pending = back;
                                        producer.poll(Duration::from_millis(1));
                                    }
                                }
                            }
                        }
                        producer.flush(Duration::from_secs(30))?;
                        let mut offsets = TopicPartitionList::new();
                        for &(partition, offset) in &interval.positions {
                            offsets.add_partition_offset(&input, partition, Offset::Offset(offset))?;
                        }
                        if offsets.count() > 0 {
                            consumer.commit(&offsets, CommitMode::Sync)?;
                        }
                    }
                    Ok(())
                });
                Some((send, handle))
            }
            _ => None,
        };
        let (read, stop) = (read.clone(), stop.clone());
        threads.push(std::thread::spawn(move || -> anyhow::Result<()> {
            // key → (count, partition, written since the last commit).
            let mut counts: HashMap<Vec<u8>, (u64, i32, bool)> = HashMap::new();
            // partition → the next offset to commit.
            let mut positions: HashMap<i32, i64> = HashMap::new();
            let mut unpublished = 0u64;
            let mut last_commit = Instant::now();
            while !stop.load(Ordering::Acquire) {
                if let Some(message) = consumer.poll(Duration::from_millis(100)) {
                    let message = message?;
                    let key = message.key().unwrap_or_default();
                    match counts.get_mut(key) {
                        Some(entry) => {
                            entry.0 += 1;
                            entry.2 = true;
                        }
                        None => {
                            counts.insert(key.to_vec(), (1, message.partition(), true));
                        }
                    }
                    positions.insert(message.partition(), message.offset() + 1);
                    unpublished += 1;
                    if unpublished >= 256 {
                        read.fetch_add(unpublished, Ordering::Release);
                        unpublished = 0;
                    }
                } else {
                    read.fetch_add(unpublished, Ordering::Release);
                    unpublished = 0;
                }
                if let Some((send, _)) = &committer
                    && last_commit.elapsed() >= Duration::from_millis(COMMIT_MS)
                {
                    last_commit = Instant::now();
                    let written = counts
                        .iter_mut()
                        .filter(|(_, e)| e.2)
                        .map(|(key, (count, partition, dirty))| {
                            *dirty = false;
                            (key.clone(), count.to_string(), *partition)
                        })
                        .collect();
                    let positions = positions.iter().map(|(&p, &o)| (p, o)).collect();
                    if send.send(Interval { written, positions }).is_err() {
                        break;
                    }
                }
            }
            if let Some((send, handle)) = committer {
                drop(send);
                handle
                    .join()
                    .map_err(|_| anyhow!("a bare committer panicked"))??;
            }
            Ok(())
        }));
    }
    let measured = window_run(records, broker_pid, || read.load(Ordering::Acquire));
    stop.store(true, Ordering::Release);
    for thread in threads {
        thread.join().map_err(|_| anyhow!("a bare loop panicked"))??;
    }
    measured
}

/// What the same-work loop commits for one interval: one changelog record per
/// key counted in it (key, count, partition) and the offsets read by its end.
struct Interval {
    written: Vec<(Vec<u8>, String, i32)>,
    positions: Vec<(i32, i64)>,
}

/// Polls `done` (records completed so far) until the window's end; answers
/// the window's records, seconds and this process's CPU time in it, and the
/// broker's (process `broker_pid`) CPU seconds in the same window.
fn window_run(records: u64, broker_pid: u32, done: impl Fn() -> u64) -> anyhow::Result<(Measured, f64)> {
    let load = repeat::load_average();
    let (low, high) = (
        (records as f64 * WINDOW.0) as u64,
        (records as f64 * WINDOW.1) as u64,
    );
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut started = None;
    loop {
        let now = done();
        if started.is_none() && now >= low {
            started = Some((
                Instant::now(),
                now,
                repeat::cpu_seconds(),
                repeat::cpu_seconds_of(Some(broker_pid)),
            ));
        }
        if now >= high
            && let Some((at, from, cpu, broker_cpu)) = started
        {
            return Ok((
                Measured {
                    seconds: at.elapsed().as_secs_f64(),
                    records: now - from,
                    cpu_seconds: repeat::cpu_seconds() - cpu,
                    load,
                    finished: true,
                },
                repeat::cpu_seconds_of(Some(broker_pid)) - broker_cpu,
            ));
        }
        if Instant::now() >= deadline {
            bail!("only {now} of {records} records done after 600 s");
        }
        // Polling a counter: the measured loops have no completion signal.
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The seconds from a SIGKILL, then from a graceful stop, of one of two
/// instances until the other processes every partition again.
fn failover_times(
    log: &Arc<KafkaLog>,
    bootstrap: &str,
    protocol: &str,
) -> anyhow::Result<(Measured, Measured)> {
    let application = broker::unique(&format!("bench-failover-{protocol}"));
    let options = ServeOptions {
        threads: 2,
        kafka: Some((bootstrap.to_string(), application.clone(), protocol.to_string())),
        ..ServeOptions::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let survivor = ServerProcess::spawn(&options, Duration::from_secs(120))?;
    // The servers' topic (`TOPIC`, shared by runs; each run is its own
    // application, which starts at the earliest offset and catches up first).
    let topic = TOPIC.to_string();
    let flow = Flow::start(log.clone(), &topic);
    let mut times = Vec::new();
    for graceful in [false, true] {
        let leaving = ServerProcess::spawn(&options, Duration::from_secs(120))?;
        wait(
            &runtime,
            "both instances share the partitions, caught up",
            || async {
                let a = own_tasks(&survivor.url(), &survivor.addr).await;
                let b = own_tasks(&leaving.url(), &leaving.addr).await;
                let (Some(a), Some(b)) = (a, b) else { return false };
                !a.is_empty()
                    && !b.is_empty()
                    && a.len() + b.len() == PARTITIONS as usize
                    && a.iter().chain(&b).all(|t| t.lag < 1_000)
            },
        )?;
        let ends: Vec<u64> = (0..PARTITIONS)
            .map(|p| log.end_offset(&topic, p).unwrap_or(0))
            .collect();
        let load = repeat::load_average();
        let from = Instant::now();
        if graceful {
            leaving.stop(Duration::from_secs(120))?;
        } else {
            leaving.kill();
        }
        wait(&runtime, "the survivor processes every partition", || async {
            own_tasks(&survivor.url(), &survivor.addr)
                .await
                .is_some_and(|tasks| {
                    tasks.len() == PARTITIONS as usize
                        && tasks.iter().all(|t| {
                            t.state == taskstream::v1::TaskState::Running as i32
                                && t.watermark as u64 >= ends[t.partition as usize]
                        })
                })
        })?;
        times.push(Measured {
            seconds: from.elapsed().as_secs_f64(),
            records: 0,
            cpu_seconds: 0.0,
            load,
            finished: true,
        });
    }
    flow.stop();
    survivor.stop(Duration::from_secs(120))?;
    Ok((times[0], times[1]))
}

/// The tasks an instance reports as its own; `None` while it cannot answer.
async fn own_tasks(url: &str, addr: &str) -> Option<Vec<taskstream::v1::TaskMetadata>> {
    let port: u32 = addr.rsplit(':').next()?.parse().ok()?;
    let client = StreamsClient::connect(url).await.ok()?;
    let metadata = client.process_metadata_for_store(STORE, false).await.ok()?;
    metadata
        .metadata
        .into_iter()
        .find(|m| m.host_info.as_ref().is_some_and(|h| h.port == port))
        .map(|m| m.tasks)
}

/// Polls `condition` every 20 ms (the time measured is this fine) for up to 120 s.
fn wait<F, Fut>(runtime: &tokio::runtime::Runtime, what: &str, mut condition: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(120);
    while !runtime.block_on(condition()) {
        if Instant::now() >= deadline {
            bail!("not within 120 s: {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// About 2,000 records/s to every partition of a topic, in the background.
struct Flow {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Flow {
    fn start(log: Arc<KafkaLog>, topic: &str) -> Flow {
        let stop = Arc::new(AtomicBool::new(false));
        let (stopping, topic) = (stop.clone(), topic.to_string());
        let thread = std::thread::spawn(move || {
            let mut n = 0u64;
            while !stopping.load(Ordering::Acquire) {
                let batch: Vec<ProducerRecord> = (0..40)
                    .map(|_| {
                        n += 1;
                        ProducerRecord::keyed(format!("key-{}", n % 1_000), "1")
                    })
                    .collect();
                if let Err(e) = log.append(&topic, batch) {
                    eprintln!("kafka bench flow: {e}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Flow { stop, thread }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.thread.join();
    }
}
