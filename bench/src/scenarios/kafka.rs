//! kafka: taskstream on Apache Kafka (a broker of its own from `crate::broker`).
//! Throughput of one instance (8 partitions, `count` into memory stores,
//! changelogs on) against a bare rdkafka consume→produce loop over the same
//! records on the same broker, alternating; then, with each group protocol,
//! the time from a SIGKILL and from a graceful stop of one of two instances
//! until the other processes all 8 partitions again.

use super::Ctx;
use crate::broker;
use crate::repeat::{self, Measured, Samples};
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio, secs};
use crate::server::{STORE, ServeOptions, ServerProcess, TOPIC};
use anyhow::{Context as _, anyhow, bail};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::{BaseRecord, Producer as _, ThreadedProducer};
use rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use taskstream_client::StreamsClient;
use taskstream_server::log::KafkaLog;
use taskstream_server::{
    Config, Log as _, PipelineConfig, ProcessorSpec, ProducerRecord, StreamsApp, TopicConfig,
};

const PARTITIONS: u32 = 8;
const KEYS: u64 = 10_000;
const VALUE_BYTES: usize = 16;
const ROUNDS: usize = 3;
/// The window a rate is measured over: from this share of the records done
/// to that one, so group joins and the last stragglers do not count.
const WINDOW: (f64, f64) = (0.1, 0.9);
const TARGET_RATIO: f64 = 0.8;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Loop {
    Taskstream,
    Bare,
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let broker = broker::start()?;
    let (formatted_in, started_in) = broker.start_times();
    let broker_rss = broker.rss_kib();
    let bootstrap = broker.bootstrap().to_string();
    let records: u64 = ctx.pick(1_000_000, 20_000);
    let rounds = ctx.pick(ROUNDS, 1);
    let failover_rounds = ctx.pick(ROUNDS, 1);
    // --quick: the classic protocol's failover is left to the full run (each
    // SIGKILL waits out a 6 s session).
    let protocols: &[&str] = ctx.pick(&["consumer", "classic"], &["consumer"]);
    let mut report = ScenarioReport::new(
        "kafka",
        "one instance vs a bare rdkafka loop; failover times",
        format!(
            "Apache Kafka (tests/kafka/pom.xml) on loopback: one broker and controller, started by \
             `bench::broker` (the tests' harness), on the same 2 cores as everything else. \
             Throughput: {} keyed records ({} keys, {VALUE_BYTES}-byte values) in {PARTITIONS} \
             partitions, written before any clock starts and read from the beginning by every run. \
             taskstream: one instance in the harness's process (a new application id per run; 2 \
             stream threads, T = 1, `count` into memory stores, changelogs on, commits every \
             200 ms, at-least-once, KIP-848 group). Bare loop: one rdkafka consumer (manual \
             assignment of the {PARTITIONS} partitions, from the beginning) producing every record \
             it reads to another topic (idempotent producer, linger.ms = 5). Both are timed from \
             {:.0} % to {:.0} % of the records done (taskstream: the sum of its watermarks; bare: \
             records handed to the producer), {rounds} runs each, alternating; medians. After each \
             taskstream run its tasks must report every record processed and none failed. \
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
    let output = format!("{input}-bare-out");
    broker.create_topic(&output, PARTITIONS)?;
    prefill(&log, &input, records)?;

    let mut problems = Vec::new();
    let samples = repeat::alternate(&[Loop::Taskstream, Loop::Bare], rounds, |variant| match variant {
        Loop::Taskstream => {
            let (measured, problem) = taskstream_run(&bootstrap, &input, records)?;
            problems.extend(problem);
            Ok(measured)
        }
        Loop::Bare => bare_run(&bootstrap, &input, &output, records),
    })?;
    let (ours, bare) = (&samples[0], &samples[1]);
    let mut table = Table::new(
        "Throughput on one broker (records/s, median)",
        &[
            "loop",
            "records/s",
            "window seconds min–max",
            "CPU µs/record",
            "load",
        ],
    );
    for (name, samples) in [
        ("taskstream (count, changelogs)", ours),
        ("bare rdkafka consume→produce", bare),
    ] {
        table.row(vec![
            name.into(),
            rate(samples.median_rate()),
            samples.seconds_spread(),
            format!("{:.2}", samples.cpu_us_per_record()),
            samples.load_cell(),
        ]);
    }
    report.tables.push(table);
    let r = ours.median_rate() / bare.median_rate().max(1e-9);
    let mut verdict = Table::new("taskstream / bare loop", &["ratio", "target", "pass/miss"]);
    verdict.row(vec![
        ratio(r),
        format!("≥ {TARGET_RATIO}"),
        Verdict::of(ours.all_finished() && r >= TARGET_RATIO)
            .as_str()
            .into(),
    ]);
    report.tables.push(verdict);
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
        "The two loops do not send the same: the bare loop (one thread, as issue 11 describes it) \
         produces one record per record read; taskstream (2 stream threads) sends its changelog, one \
         record per key written since the last commit (at most 10,000 per 200 ms commit here), and \
         commits offsets. Both read every record from the broker, which shares the 2 cores."
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

/// One instance counting `records` from `input` (a new application: a new
/// group, from the beginning). Also answers what went wrong, if its tasks do
/// not report every record processed once and none failed.
fn taskstream_run(bootstrap: &str, input: &str, records: u64) -> anyhow::Result<(Measured, Option<String>)> {
    let config = Config {
        application_id: broker::unique("bench-kafka-app"),
        num_stream_threads: 2,
        commit_interval_ms: 200,
        bootstrap_servers: Some(bootstrap.to_string()),
        replication_factor: 1,
        topics: vec![TopicConfig::new(input, PARTITIONS)],
        pipelines: vec![PipelineConfig::new("counts", input, ProcessorSpec::Count)],
        ..Config::default()
    };
    let app = StreamsApp::start(config).context("start the instance")?;
    let tasks = || {
        app.process_metadata_for_store("counts", false)
            .map(|m| m.instances.into_iter().flat_map(|i| i.tasks).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    let measured = window_run(records, || tasks().iter().map(|t| t.watermark).sum());
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
    let mut measured = measured?;
    let processed: u64 = finished.iter().map(|t| t.records_processed).sum();
    let failed: u64 = finished.iter().map(|t| t.records_failed).sum();
    let problem = (processed != records || failed != 0 || finished.len() != PARTITIONS as usize).then(|| {
        measured.finished = false;
        format!(
            "a taskstream run reported {} of {} records processed, {failed} failed, on {} tasks",
            group(processed),
            group(records),
            finished.len()
        )
    });
    Ok((measured, problem))
}

/// A bare rdkafka loop: read every record of `input` and produce it to `output`.
fn bare_run(bootstrap: &str, input: &str, output: &str, records: u64) -> anyhow::Result<Measured> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", broker::unique("bench-kafka-bare"))
        .set("enable.auto.commit", "false")
        .create()
        .context("the bare consumer")?;
    let producer: ThreadedProducer<_> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("partitioner", "murmur2_random")
        .create()
        .context("the bare producer")?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        assignment.add_partition_offset(input, partition as i32, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let read = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let loop_thread = {
        let (read, stop, output) = (read.clone(), stop.clone(), output.to_string());
        std::thread::spawn(move || -> anyhow::Result<()> {
            while !stop.load(Ordering::Acquire) {
                let Some(message) = consumer.poll(Duration::from_millis(100)) else {
                    continue;
                };
                let message = message?;
                let mut record =
                    BaseRecord::<[u8], [u8]>::to(&output).payload(message.payload().unwrap_or_default());
                if let Some(key) = message.key() {
                    record = record.key(key);
                }
                let mut pending = record;
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
                read.fetch_add(1, Ordering::Release);
            }
            producer.flush(Duration::from_secs(30))?;
            Ok(())
        })
    };
    let measured = window_run(records, || read.load(Ordering::Acquire));
    stop.store(true, Ordering::Release);
    loop_thread
        .join()
        .map_err(|_| anyhow!("the bare loop panicked"))??;
    measured
}

/// Polls `done` (records completed so far) until the window's end; answers
/// the window's records, seconds and this process's CPU time in it.
fn window_run(records: u64, done: impl Fn() -> u64) -> anyhow::Result<Measured> {
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
            started = Some((Instant::now(), now, repeat::cpu_seconds()));
        }
        if now >= high
            && let Some((at, from, cpu)) = started
        {
            return Ok(Measured {
                seconds: at.elapsed().as_secs_f64(),
                records: now - from,
                cpu_seconds: repeat::cpu_seconds() - cpu,
                load,
                finished: true,
            });
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
