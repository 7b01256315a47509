//! peers: volume's workload (10,000 records, its drawn 0–5 ms latencies, a key per record) on
//! one Apache Kafka broker, through taskstream and, in the same run and on the same records,
//! through the peers themselves — Kafka Streams, Confluent Parallel Consumer and Flink's async
//! I/O, Java programs under bench/peers/ built with Maven — each against its lower bound.
//! Not part of `--quick`: a full run takes minutes and starts a dozen JVMs.

use super::Ctx;
use super::volume;
use crate::bare;
use crate::broker;
use crate::repeat::{self, Measured};
use crate::report::{ScenarioReport, Table, group, ratio, secs};
use anyhow::{Context as _, anyhow, bail};
use bytes::Bytes;
use std::collections::{HashMap, HashSet};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use taskstream_server::log::KafkaLog;
use taskstream_server::{
    Config, Log as _, PipelineConfig, ProcessError, ProcessingOrder, Processor, ProcessorContext,
    ProcessorSpec, ProducerRecord, Record, StreamsApp, TopicConfig,
};

/// What every mode runs at once: PC's maxConcurrency, Flink's capacity, our T.
const CONCURRENCY: usize = 16;
/// The "just add partitions" rows: Kafka Streams' way to run 16 records at once.
const WIDE_PARTITIONS: u32 = 16;
const ROUNDS: usize = 3;
/// The processor of our runs: sleeps the latency in the record's value.
const SLEEP_VALUE: &str = "sleep_value";
/// How long one run may take before it counts as not finished (T = 1 takes about 25 s).
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// Which guarantee a row's runs share; rows of one group are compared with each other.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Group {
    OneAtATime,
    OrderedDelivery,
    PerKey,
    Unordered,
    Partitions,
}

impl Group {
    fn describe(self) -> &'static str {
        match self {
            Group::OneAtATime => "one record at a time (1 partition)",
            Group::OrderedDelivery => "16 at once, results delivered in offset order",
            Group::PerKey => "16 at once, one at a time per key",
            Group::Unordered => "16 at once, no order",
            Group::Partitions => "16 partitions, one thread each",
        }
    }
}

#[derive(Clone)]
enum System {
    Taskstream {
        order: ProcessingOrder,
        stream_threads: usize,
        threads_per_task: usize,
    },
    /// A peer: `main` of Maven module `module` with MODE and CONCURRENCY.
    Java {
        module: &'static str,
        main: &'static str,
        mode: &'static str,
        concurrency: usize,
    },
}

#[derive(Clone)]
struct Variant {
    group: Group,
    system: &'static str,
    mode: String,
    run: System,
    /// On the 16-partition topic (else the 1-partition one).
    wide: bool,
}

fn variants() -> Vec<Variant> {
    let ours = |group, mode: &str, order, n, t, wide| Variant {
        group,
        system: "taskstream",
        mode: mode.into(),
        run: System::Taskstream {
            order,
            stream_threads: n,
            threads_per_task: t,
        },
        wide,
    };
    let peer = |group, system, module, main, mode, concurrency, wide| Variant {
        group,
        system,
        mode: format!("{mode}, {concurrency}"),
        run: System::Java {
            module,
            main,
            mode,
            concurrency,
        },
        wide,
    };
    let kstreams = |group, threads, wide| Variant {
        mode: format!("{threads} stream thread{}", if threads == 1 { "" } else { "s" }),
        ..peer(
            group,
            "Kafka Streams 4.4.0",
            "kafka-streams",
            "taskstream.peers.KafkaStreamsPeer",
            "-",
            threads,
            wide,
        )
    };
    let pc = |group, mode| {
        let mut v = peer(
            group,
            "Parallel Consumer 0.5.3.3",
            "parallel-consumer",
            "taskstream.peers.ParallelConsumerPeer",
            mode,
            CONCURRENCY,
            false,
        );
        v.mode = format!("{mode}, maxConcurrency {CONCURRENCY}");
        v
    };
    let flink = |group, mode: &'static str| {
        let mut v = peer(
            group,
            "Flink 2.2.1 async I/O",
            "flink",
            "taskstream.peers.FlinkAsyncPeer",
            mode,
            CONCURRENCY,
            false,
        );
        v.mode = format!("{mode}Wait, capacity {CONCURRENCY}");
        v
    };
    use Group::*;
    vec![
        ours(OneAtATime, "T = 1", ProcessingOrder::Offset, 1, 1, false),
        kstreams(OneAtATime, 1, false),
        pc(OneAtATime, "PARTITION"),
        ours(
            OrderedDelivery,
            "offset, T = 16",
            ProcessingOrder::Offset,
            16,
            16,
            false,
        ),
        flink(OrderedDelivery, "ordered"),
        ours(PerKey, "key, T = 16", ProcessingOrder::Key, 16, 16, false),
        pc(PerKey, "KEY"),
        ours(
            Unordered,
            "unordered, T = 16",
            ProcessingOrder::Unordered,
            16,
            16,
            false,
        ),
        pc(Unordered, "UNORDERED"),
        flink(Unordered, "unordered"),
        ours(Partitions, "N = 16, T = 1", ProcessingOrder::Offset, 16, 1, true),
        kstreams(Partitions, WIDE_PARTITIONS as usize, true),
    ]
}

/// The records as written: each one's latency in µs (its value) and where it landed.
struct Topic {
    name: String,
    partition_totals_ms: Vec<f64>,
}

/// Writes record i (key `key-<i>`, value: latency i in µs, ASCII) for every latency; on the
/// wide topic record i goes to partition i mod 16, so the partitions carry equal counts.
fn prefill(log: &KafkaLog, name: &str, partitions: u32, micros: &[u64]) -> anyhow::Result<Topic> {
    let mut totals = vec![0.0; partitions as usize];
    for (chunk_index, chunk) in micros.chunks(5_000).enumerate() {
        let first = chunk_index * 5_000;
        let batch: Vec<ProducerRecord> = chunk
            .iter()
            .enumerate()
            .map(|(j, us)| {
                let i = first + j;
                ProducerRecord {
                    key: Some(Bytes::from(format!("key-{i:09}"))),
                    value: Bytes::from(us.to_string()),
                    partition: Some(i as u32 % partitions),
                    ..ProducerRecord::default()
                }
            })
            .collect();
        let positions = log
            .append(name, batch)
            .map_err(|e| anyhow!("prefill {name}: {e}"))?;
        for (position, us) in positions.iter().zip(chunk) {
            totals[position.partition as usize] += *us as f64 / 1000.0;
        }
    }
    Ok(Topic {
        name: name.to_string(),
        partition_totals_ms: totals,
    })
}

/// One run's clock, kept the same way in our processor and in every Java peer
/// (bench/peers/common Progress.java): the first record handed to processing starts it, the
/// last distinct (partition, offset) processed stops it.
struct Progress {
    records: usize,
    created: Instant,
    state: Mutex<ProgressState>,
    done: Condvar,
}

#[derive(Default)]
struct ProgressState {
    /// When the first record came, and this process's CPU seconds then.
    first: Option<(Instant, f64)>,
    /// Each partition's first record: how far apart the partitions started.
    first_by_partition: HashMap<u32, Instant>,
    seen: HashSet<(u32, u64)>,
    duplicates: u64,
    last: Option<(Instant, f64)>,
}

impl Progress {
    fn new(records: usize) -> Self {
        Progress {
            records,
            created: Instant::now(),
            state: Mutex::new(ProgressState::default()),
            done: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ProgressState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn begin(&self, partition: u32) {
        let mut state = self.lock();
        state
            .first_by_partition
            .entry(partition)
            .or_insert_with(Instant::now);
        if state.first.is_none() {
            state.first = Some((Instant::now(), repeat::cpu_seconds()));
        }
    }

    fn completed(&self, partition: u32, offset: u64) {
        let mut state = self.lock();
        if !state.seen.insert((partition, offset)) {
            state.duplicates += 1;
        } else if state.seen.len() == self.records {
            state.last = Some((Instant::now(), repeat::cpu_seconds()));
            self.done.notify_all();
        }
    }

    /// Waits for the last record (or the timeout); the run's measurement, its start-up and
    /// the spread of its partitions' first records.
    fn wait(&self, timeout: Duration, load: f64) -> (Measured, f64, f64) {
        let state = self.lock();
        let (state, _) = self
            .done
            .wait_timeout_while(state, timeout, |s| s.last.is_none())
            .unwrap_or_else(|e| e.into_inner());
        let now = (Instant::now(), repeat::cpu_seconds());
        let Some(first) = state.first else {
            return (
                Measured {
                    seconds: timeout.as_secs_f64(),
                    records: 0,
                    cpu_seconds: 0.0,
                    load,
                    finished: false,
                },
                0.0,
                0.0,
            );
        };
        let last = state.last.unwrap_or(now);
        let spread = state
            .first_by_partition
            .values()
            .map(|at| at.duration_since(first.0).as_secs_f64())
            .fold(0.0, f64::max);
        (
            Measured {
                seconds: last.0.duration_since(first.0).as_secs_f64(),
                records: state.seen.len() as u64,
                cpu_seconds: last.1 - first.1,
                load,
                finished: state.last.is_some(),
            },
            first.0.duration_since(self.created).as_secs_f64(),
            spread,
        )
    }
}

/// Our processor: sleeps the latency in the record's value (µs), as every peer does.
struct SleepValue {
    progress: Arc<Progress>,
}

impl Processor for SleepValue {
    fn process(&self, record: &Record, _ctx: &ProcessorContext<'_>) -> Result<(), ProcessError> {
        self.progress.begin(record.partition);
        let micros: u64 = std::str::from_utf8(&record.value)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| {
                ProcessError::new("BadValue", format!("offset {}: no latency in µs", record.offset))
                    .permanent()
            })?;
        std::thread::sleep(Duration::from_micros(micros));
        self.progress.completed(record.partition, record.offset);
        Ok(())
    }
}

/// What one run gave beyond `Measured`: seconds from launch to the first record, and what went
/// wrong, if anything.
struct Extra {
    startup: f64,
    /// From the first record to the first of the partition that started last.
    partition_spread: f64,
    problem: Option<String>,
}

fn taskstream_run(
    bootstrap: &str,
    topic: &str,
    partitions: u32,
    records: usize,
    order: ProcessingOrder,
    stream_threads: usize,
    threads_per_task: usize,
) -> anyhow::Result<(Measured, Extra)> {
    let config = Config {
        application_id: broker::unique("bench-peers-app"),
        num_stream_threads: stream_threads,
        num_threads_per_task: threads_per_task,
        processing_order: order,
        bootstrap_servers: Some(bootstrap.to_string()),
        replication_factor: 1,
        topics: vec![TopicConfig::new(topic, partitions)],
        pipelines: vec![PipelineConfig::new(
            "peers",
            topic,
            ProcessorSpec::Custom {
                name: SLEEP_VALUE.into(),
            },
        )],
        ..Config::default()
    };
    let load = repeat::load_average();
    let progress = Arc::new(Progress::new(records));
    let app = StreamsApp::builder(config)
        .processor(
            SLEEP_VALUE,
            Arc::new(SleepValue {
                progress: progress.clone(),
            }),
        )
        .start()
        .context("start taskstream on the broker")?;
    let (mut measured, startup, partition_spread) = progress.wait(RUN_TIMEOUT, load);
    // The tasks' own counts must agree: every record processed once, none failed.
    let tasks = || {
        app.process_metadata_for_store("peers", false)
            .map(|m| m.instances.into_iter().flat_map(|i| i.tasks).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let tasks = loop {
        let tasks = tasks();
        let processed: u64 = tasks.iter().map(|t| t.records_processed).sum();
        if processed >= records as u64 || !measured.finished || Instant::now() >= deadline {
            break tasks;
        }
        // Polling: the counters trail the processor's return by a moment.
        std::thread::sleep(Duration::from_millis(10));
    };
    app.shutdown().map_err(|e| anyhow!("{e}"))?;
    let processed: u64 = tasks.iter().map(|t| t.records_processed).sum();
    let failed: u64 = tasks.iter().map(|t| t.records_failed).sum();
    let problem = (!measured.finished
        || processed != records as u64
        || failed != 0
        || tasks.len() != partitions as usize)
        .then(|| {
            measured.finished = false;
            format!(
                "taskstream ({} order, N = {stream_threads}, T = {threads_per_task}) reported {} of {} \
                 records processed, {failed} failed, on {} tasks",
                order.as_str(),
                group(processed),
                group(records as u64),
                tasks.len()
            )
        });
    Ok((
        measured,
        Extra {
            startup,
            partition_spread,
            problem,
        },
    ))
}

/// The Java peers, built: bench/peers/<module>/target/{classes,classpath.txt}.
struct Peers {
    dir: PathBuf,
    /// Why none can run (Maven failed), if so.
    unbuilt: Option<String>,
}

impl Peers {
    fn build(dir: &Path) -> Peers {
        let pom = dir.join("pom.xml");
        // --fail-at-end: a module that cannot be built leaves the others.
        let output = Command::new("mvn")
            .args(["-B", "-q", "--fail-at-end", "-f"])
            .arg(&pom)
            .arg("package")
            .stdin(Stdio::null())
            .output();
        let unbuilt = match output {
            Ok(output) if output.status.success() => None,
            Ok(output) => Some(format!(
                "`mvn -f {} package` failed ({}): {}",
                pom.display(),
                output.status,
                tail(&String::from_utf8_lossy(&output.stdout), 600)
            )),
            Err(e) => Some(format!("cannot run mvn: {e}")),
        };
        Peers {
            dir: dir.to_path_buf(),
            unbuilt,
        }
    }

    /// The classpath of a built module, or why it is missing.
    fn classpath(&self, module: &str) -> Result<String, String> {
        let target = self.dir.join(module).join("target");
        match std::fs::read_to_string(target.join("classpath.txt")) {
            Ok(dependencies) => Ok(format!(
                "{}:{}",
                target.join("classes").display(),
                dependencies.trim()
            )),
            Err(e) => Err(self
                .unbuilt
                .clone()
                .unwrap_or_else(|| format!("{module} is not built ({}: {e})", target.display()))),
        }
    }
}

/// Runs a peer's JVM to its end and reads its `PEER_RESULT` line.
fn java_run(
    classpath: &str,
    main: &str,
    mode: &str,
    bootstrap: &str,
    topic: &str,
    records: usize,
    concurrency: usize,
) -> anyhow::Result<(Measured, Extra)> {
    let stderr_path = std::env::temp_dir().join(format!("{}.log", broker::unique("bench-peer")));
    let stderr =
        std::fs::File::create(&stderr_path).with_context(|| format!("create {}", stderr_path.display()))?;
    let load = repeat::load_average();
    let mut child = Command::new("java")
        .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=error")
        .arg(format!("-Dpeer.timeout.seconds={}", RUN_TIMEOUT.as_secs()))
        .args(["-cp", classpath, main, mode, bootstrap, topic])
        .arg(records.to_string())
        .arg(concurrency.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .context("start java")?;
    let mut stdout = child.stdout.take().context("the peer's stdout")?;
    // The JVM gives up by itself after RUN_TIMEOUT, closing its clients within a minute.
    let deadline = Instant::now() + RUN_TIMEOUT + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            break child.wait()?;
        }
        // Polling the child: std has no wait with a timeout.
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    stdout.read_to_string(&mut out)?;
    let errors = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let _ = std::fs::remove_file(&stderr_path);
    let Some(line) = out.lines().find(|l| l.starts_with("PEER_RESULT ")) else {
        bail!(
            "{main} {mode} ended ({status}) without a result; its stderr ends with: {}",
            tail(&errors, 800)
        );
    };
    let result = parse_result(line)?;
    let finished = result.finished && result.records == records as u64;
    let measured = Measured {
        seconds: result.seconds,
        records: result.records,
        cpu_seconds: result.cpu_seconds,
        load,
        finished,
    };
    let problem = (!finished || result.duplicates > 0).then(|| {
        format!(
            "{main} {mode}: {} of {} records processed, {} processed twice ({status}); stderr: {}",
            group(result.records),
            group(records as u64),
            result.duplicates,
            tail(&errors, 400)
        )
    });
    Ok((
        measured,
        Extra {
            startup: result.startup,
            partition_spread: result.partition_spread,
            problem,
        },
    ))
}

/// A peer's `PEER_RESULT` line (bench/peers/common Peer.java).
#[derive(Debug, PartialEq)]
struct PeerResult {
    seconds: f64,
    /// Distinct records processed.
    records: u64,
    duplicates: u64,
    cpu_seconds: f64,
    startup: f64,
    partition_spread: f64,
    finished: bool,
}

fn parse_result(line: &str) -> anyhow::Result<PeerResult> {
    let field = |name: &str| -> anyhow::Result<&str> {
        line.split_whitespace()
            .skip(1)
            .find_map(|f| f.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
            .with_context(|| format!("no `{name}` in `{line}`"))
    };
    let number = |name: &str| -> anyhow::Result<f64> {
        field(name)?
            .parse()
            .with_context(|| format!("`{name}` in `{line}`"))
    };
    let count = |name: &str| -> anyhow::Result<u64> {
        field(name)?
            .parse()
            .with_context(|| format!("`{name}` in `{line}`"))
    };
    Ok(PeerResult {
        seconds: number("seconds")?,
        records: count("records")?,
        duplicates: count("duplicates")?,
        cpu_seconds: number("cpu_seconds")?,
        startup: number("startup_seconds")?,
        partition_spread: number("partition_spread_seconds")?,
        finished: field("finished")? == "true",
    })
}

/// The last `chars` characters of `text`, on one line.
fn tail(text: &str, chars: usize) -> String {
    let text = text.trim();
    // The index of the `chars`-th character from the end (0 when the text is shorter).
    let start = match chars.checked_sub(1) {
        Some(back) => text.char_indices().rev().nth(back).map_or(0, |(i, _)| i),
        None => text.len(),
    };
    text[start..].replace('\n', " ⏎ ")
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let records = ctx.pick(volume::RECORDS, 2_000) as usize;
    let rounds = ctx.pick(ROUNDS, 1);
    // volume's latencies: `simulate`'s draw for partition 0, offset i — on the 1-partition
    // topic record i is at offset i, as in volume's 1-partition rows.
    let drawer = volume::drawer();
    let micros: Vec<u64> = (0..records as u64)
        .map(|i| (drawer.latency_ms_of(0, i) * 1000.0).round() as u64)
        .collect();
    let latencies_ms: Vec<f64> = micros.iter().map(|&us| us as f64 / 1000.0).collect();
    let total_ms: f64 = latencies_ms.iter().sum();
    let keys: Vec<u64> = (0..records as u64).collect();

    let peers = Peers::build(&Path::new(env!("CARGO_MANIFEST_DIR")).join("peers"));
    let broker = broker::start()?;
    let bootstrap = broker.bootstrap().to_string();
    let one = broker::unique("bench-peers-1p");
    broker.create_topic(&one, 1)?;
    let one = prefill(broker.log(), &one, 1, &micros)?;
    let wide = broker::unique("bench-peers-16p");
    broker.create_topic(&wide, WIDE_PARTITIONS)?;
    let wide = prefill(broker.log(), &wide, WIDE_PARTITIONS, &micros)?;

    let variants = variants();
    let bound = |v: &Variant| -> f64 {
        match v.group {
            Group::OneAtATime => total_ms / 1000.0,
            Group::OrderedDelivery | Group::PerKey | Group::Unordered => {
                bare::keyed_bound(&latencies_ms, &keys, CONCURRENCY)
            }
            Group::Partitions => {
                let heaviest = wide.partition_totals_ms.iter().copied().fold(0.0, f64::max);
                (total_ms / WIDE_PARTITIONS as f64).max(heaviest) / 1000.0
            }
        }
    };
    let mut startups: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut spreads: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut problems: Vec<String> = Vec::new();
    // A peer that cannot run: why, instead of its numbers (its later runs are skipped).
    let mut not_run: Vec<Option<String>> = variants
        .iter()
        .map(|v| match &v.run {
            System::Java { module, .. } => peers.classpath(module).err(),
            System::Taskstream { .. } => None,
        })
        .collect();
    let indexes: Vec<usize> = (0..variants.len()).collect();
    let samples = repeat::alternate(&indexes, rounds, |&i| {
        let v = &variants[i];
        let topic = if v.wide { &wide } else { &one };
        let partitions = if v.wide { WIDE_PARTITIONS } else { 1 };
        let skipped = Measured {
            seconds: 0.0,
            records: 0,
            cpu_seconds: 0.0,
            load: repeat::load_average(),
            finished: false,
        };
        if not_run[i].is_some() {
            return Ok(skipped);
        }
        eprintln!("peers: {} {} …", v.system, v.mode);
        let result = match &v.run {
            System::Taskstream {
                order,
                stream_threads,
                threads_per_task,
            } => taskstream_run(
                &bootstrap,
                &topic.name,
                partitions,
                records,
                *order,
                *stream_threads,
                *threads_per_task,
            ),
            System::Java {
                module,
                main,
                mode,
                concurrency,
            } => match peers.classpath(module) {
                Ok(classpath) => java_run(
                    &classpath,
                    main,
                    mode,
                    &bootstrap,
                    &topic.name,
                    records,
                    *concurrency,
                ),
                Err(why) => Err(anyhow!(why)),
            },
        };
        match result {
            Ok((measured, extra)) => {
                startups[i].push(extra.startup);
                spreads[i].push(extra.partition_spread);
                problems.extend(extra.problem);
                Ok(measured)
            }
            // A peer that fails says why in the table; ours failing fails the scenario.
            Err(e) if matches!(v.run, System::Java { .. }) => {
                not_run[i] = Some(format!("{e:#}"));
                Ok(skipped)
            }
            Err(e) => Err(e),
        }
    })?;

    let mut report = ScenarioReport::new(
        "peers",
        "volume's workload on one Kafka broker: taskstream and the peers themselves",
        format!(
            "{} records (a key per record, value = the record's latency in µs: volume's draw, uniform \
             in {}–{} ms, seed 42; {:.3} s in all) written once to a 1-partition topic and once to a \
             {WIDE_PARTITIONS}-partition one (record i to partition i mod {WIDE_PARTITIONS}) of one \
             Apache Kafka {} broker (bench::broker) on this machine's 2 cores; every system reads the \
             same records from the beginning and \"processes\" each by sleeping its latency \
             (taskstream: a Rust processor registered with `StreamsApp::builder(..).processor(..)`, \
             `std::thread::sleep`; the peers: Java programs under bench/peers/, `LockSupport.parkNanos`). \
             Every system is timed the same way, inside its processing function: from the first \
             record handed to it until the last of the {} distinct (partition, offset) pairs is \
             processed; group joins, JVM and client start-up come before the clock starts and are \
             shown apart (\"to first record\"). Each row runs {rounds} time(s), the rows alternating \
             (each round starts at another); seconds are medians with min–max. Lower bound = \
             max(total latency / concurrency, the heaviest key's total), one at a time: the total; \
             16 partitions: max(total / 16, the heaviest partition's total). taskstream / best peer \
             compares medians within a group. CPU µs/record: the measured process's CPU over the \
             timed span (taskstream: the harness process, the runtime in it; a peer: its JVM). Load: \
             the highest 1-minute load average at a run's start.",
            group(records as u64),
            volume::LATENCY[0],
            volume::LATENCY[1],
            total_ms / 1000.0,
            "4.4.0",
            group(records as u64),
        ),
    );
    let mut table = Table::new(
        "",
        &[
            "what is compared",
            "system",
            "mode",
            "seconds (median)",
            "min–max",
            "to first record (s)",
            "lower bound (s)",
            "/ bound",
            "taskstream / best peer",
            "CPU µs/record",
            "load",
        ],
    );
    let mut overloaded = false;
    for (i, v) in variants.iter().enumerate() {
        let s = &samples[i];
        let b = bound(v);
        if let Some(why) = &not_run[i] {
            table.row(vec![
                v.group.describe().into(),
                v.system.into(),
                v.mode.clone(),
                "not run".into(),
                "—".into(),
                "—".into(),
                secs(b),
                "—".into(),
                "—".into(),
                "—".into(),
                "—".into(),
            ]);
            problems.push(format!("{} {} was not run: {why}", v.system, v.mode));
            continue;
        }
        overloaded |= s.overloaded();
        let versus = if matches!(v.run, System::Taskstream { .. }) {
            let best = variants
                .iter()
                .enumerate()
                .filter(|(j, p)| {
                    p.group == v.group
                        && matches!(p.run, System::Java { .. })
                        && not_run[*j].is_none()
                        && samples[*j].all_finished()
                })
                .map(|(j, _)| samples[j].median_seconds())
                .fold(f64::INFINITY, f64::min);
            if best.is_finite() {
                ratio(s.median_seconds() / best.max(1e-9))
            } else {
                "no peer finished".into()
            }
        } else {
            "—".into()
        };
        table.row(vec![
            v.group.describe().into(),
            v.system.into(),
            v.mode.clone(),
            format!(
                "{}{}",
                secs(s.median_seconds()),
                if s.all_finished() { "" } else { " (not finished)" }
            ),
            s.seconds_spread(),
            format!("{:.2}", repeat::median(startups[i].iter().copied())),
            secs(b),
            ratio(s.median_seconds() / b.max(1e-9)),
            versus,
            format!("{:.1}", s.cpu_us_per_record()),
            s.load_cell(),
        ]);
    }
    report.tables.push(table);
    report.notes.push(
        "Which of our modes answers which peer mode: T = 1 is Kafka Streams' one thread per task \
         and Parallel Consumer's PARTITION order (one record at a time per partition). `offset` \
         order runs 16 records of the partition at once, never two of a key, and delivers, \
         releases and commits in offset order — Flink's orderedWait emits in order too, without \
         keeping keys apart (with a key per record that costs it nothing here). `key` order is \
         PC's KEY; `unordered` is PC's UNORDERED and Flink's unorderedWait. Kafka Streams cannot \
         run two records of a partition at once: its 16 at once needs 16 partitions and 16 \
         threads, which is the last group, beside ours with the same partitions and threads."
            .into(),
    );
    report.notes.push(
        "What the clock ends on: the last record processed. Offsets are committed after that on \
         every system's own schedule (taskstream every commit interval, Kafka Streams every \
         commit.interval.ms, PC periodically, Flink not at all without checkpoints), so commit \
         latency is not in these numbers. The peers run with their defaults otherwise (JVM \
         heap, G1, fetch sizes); Parallel Consumer runs on kafka-clients 3.9.1, the client it is \
         built for (on 4.4.0 it fails: it uses classes Kafka 4.0 removed)."
            .into(),
    );
    report.notes.push(
        "This machine has 2 cores, shared with the broker (a JVM), the peer's JVM and, during this \
         run, other work on the machine: every runner here sleeps most of the time, so the load \
         matters less than in the CPU-bound scenarios, but a busy neighbour still delays wake-ups."
            .into(),
    );
    let wide_spreads: Vec<String> = variants
        .iter()
        .enumerate()
        .filter(|(i, v)| v.wide && not_run[*i].is_none() && !spreads[*i].is_empty())
        .map(|(i, v)| {
            format!(
                "{} {} {:.2} s",
                v.system,
                v.mode,
                repeat::median(spreads[i].iter().copied())
            )
        })
        .collect();
    if !wide_spreads.is_empty() {
        report.notes.push(format!(
            "16 partitions: the clock starts at the first record of any partition, so a system \
             whose partitions start processing apart pays that spread in its seconds. From the \
             first record to the first record of the partition that started last (median): {}.",
            wide_spreads.join("; ")
        ));
    }
    if overloaded {
        report.notes.push(
            "Some runs started with the load average above the core count: another process \
             shared the CPU."
                .into(),
        );
    }
    for problem in problems {
        report.notes.push(format!("**problem:** {problem}"));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_line_a_peer_prints() {
        // As Peer.java formats it.
        let line = "PEER_RESULT seconds=1.893214 records=10000 duplicates=0 cpu_seconds=1.710 \
                    startup_seconds=1.620 partition_spread_seconds=0.000 finished=true";
        assert_eq!(
            parse_result(line).unwrap(),
            PeerResult {
                seconds: 1.893214,
                records: 10_000,
                duplicates: 0,
                cpu_seconds: 1.71,
                startup: 1.62,
                partition_spread: 0.0,
                finished: true,
            }
        );
        let unfinished = line.replace("finished=true", "finished=false");
        assert!(!parse_result(&unfinished).unwrap().finished);
        let error = parse_result("PEER_RESULT seconds=1.0 records=3").unwrap_err();
        assert!(format!("{error:#}").contains("duplicates"), "{error:#}");
        assert!(parse_result(&line.replace("records=10000", "records=x")).is_err());
    }

    #[test]
    fn the_clock_stops_at_the_last_distinct_record() {
        let progress = Progress::new(3);
        progress.begin(0);
        progress.completed(0, 0);
        progress.begin(1);
        progress.completed(1, 0);
        // A record processed again does not count towards the end.
        progress.completed(1, 0);
        let (measured, _, _) = progress.wait(Duration::from_millis(10), 0.5);
        assert!(!measured.finished);
        assert_eq!(measured.records, 2);
        progress.completed(0, 1);
        let (measured, _, spread) = progress.wait(Duration::from_secs(5), 0.5);
        assert!(measured.finished);
        assert_eq!(measured.records, 3);
        assert_eq!(progress.lock().duplicates, 1);
        assert!(
            spread >= 0.0 && spread <= measured.seconds,
            "{spread} vs {}",
            measured.seconds
        );
    }

    #[test]
    fn no_record_is_not_a_result() {
        let (measured, startup, _) = Progress::new(1).wait(Duration::from_millis(1), 0.0);
        assert!(!measured.finished);
        assert_eq!((measured.records, startup), (0, 0.0));
    }

    #[test]
    fn the_tail_is_the_end_on_one_line() {
        assert_eq!(tail("abc\ndef", 3), "def");
        assert_eq!(tail("ab", 10), "ab");
        assert_eq!(tail("x\ny", 10), "x ⏎ y");
        assert_eq!(tail("ééé", 2), "éé");
        assert_eq!(tail("abc", 0), "");
    }
}
