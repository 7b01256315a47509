//! Streams follow the partition (issue 42, item 5), on Apache Kafka
//! (tests/common/kafka.rs) with three server binaries: one is SIGKILLed while
//! records flow, and a fan-in subscriber (`get_metadata_async_all`) and the
//! CLI's `watch` must each go on with the partitions' new owners — every
//! produced offset delivered exactly once or named by an in-band lagged
//! notice, never twice.

mod common;

use common::cli_binary;
use common::instance::{Instance, Launch, own_partitions, runtime, share_all};
use common::kafka::{Broker, broker, unique};
use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use taskstream_client::{ClientError, MetadataBatch, MetadataOptions, Start, StreamsClient};
use taskstream_server::Log as _;

const PARTITIONS: u32 = 6;
/// Bound on a rebalance after a SIGKILL (the session timeout below, then
/// the restore), and on catching up.
const DEADLINE: Duration = Duration::from_secs(120);

/// `eventually_within` the test's `DEADLINE`.
fn eventually(what: &str, logs: &[PathBuf], condition: impl FnMut() -> bool) -> Duration {
    common::instance::eventually_within(DEADLINE, what, logs, condition)
}

/// What one subscriber saw, per partition.
#[derive(Default, Debug)]
struct Seen {
    /// Offset → how many final outcomes of it were delivered.
    delivered: BTreeMap<u32, BTreeMap<i64, u32>>,
    /// Ranges named by lagged notices.
    gaps: Vec<(u32, i64, i64)>,
    /// Anything else that reached the callback as an error.
    errors: Vec<String>,
    /// When each partition last had a delivery, and the longest pause of any.
    last_at: BTreeMap<u32, Instant>,
    longest_pause: Duration,
    longest_pause_partition: Option<u32>,
}

impl Seen {
    fn delivery(&mut self, partition: u32, offset: i64, now: Instant) {
        *self
            .delivered
            .entry(partition)
            .or_default()
            .entry(offset)
            .or_default() += 1;
        if let Some(last) = self.last_at.insert(partition, now) {
            let pause = now - last;
            if pause > self.longest_pause {
                self.longest_pause = pause;
                self.longest_pause_partition = Some(partition);
            }
        }
    }

    fn covered(&self, partition: u32, offset: i64) -> bool {
        self.delivered
            .get(&partition)
            .is_some_and(|d| d.contains_key(&offset))
            || self
                .gaps
                .iter()
                .any(|&(p, first, last)| p == partition && (first..=last).contains(&offset))
    }

    /// Offsets below `ends` neither delivered nor named lagged.
    fn missing(&self, ends: &BTreeMap<u32, i64>) -> usize {
        ends.iter()
            .map(|(&p, &end)| (0..end).filter(|&o| !self.covered(p, o)).count())
            .sum()
    }

    /// Every offset below `ends` delivered exactly once or named in one
    /// notice; nothing delivered twice, nothing delivered and named.
    fn check(&self, who: &str, ends: &BTreeMap<u32, i64>) {
        assert!(
            self.errors.is_empty(),
            "{who}: errors reached the callback: {:?}",
            self.errors
        );
        for (&partition, offsets) in &self.delivered {
            let twice: Vec<_> = offsets.iter().filter(|(_, n)| **n > 1).collect();
            assert!(
                twice.is_empty(),
                "{who}: partition {partition} delivered twice: {twice:?}"
            );
        }
        for &(p, first, last) in &self.gaps {
            let both: Vec<i64> = (first..=last)
                .filter(|o| self.delivered.get(&p).is_some_and(|d| d.contains_key(o)))
                .collect();
            assert!(
                both.is_empty(),
                "{who}: partition {p}: named lagged and delivered: {both:?}"
            );
        }
        assert_eq!(
            self.missing(ends),
            0,
            "{who}: offsets neither delivered nor named lagged"
        );
    }

    fn summary(&self) -> String {
        let delivered: usize = self.delivered.values().map(BTreeMap::len).sum();
        let lagged: i64 = self.gaps.iter().map(|(_, f, l)| l - f + 1).sum();
        format!(
            "{delivered} delivered, {} lagged notices covering {lagged} offsets {:?}, longest \
             pause {:?} (partition {:?})",
            self.gaps.len(),
            self.gaps,
            self.longest_pause,
            self.longest_pause_partition
        )
    }
}

struct Application {
    name: String,
    topic: String,
    config: PathBuf,
    dir: taskstream_server::scratch::TempDir,
}

impl Application {
    /// `retention`: the instances' `outcome_retention_records`.
    fn new(retention: usize) -> Application {
        let name = unique("follow");
        let topic = format!("{name}-events");
        let dir = taskstream_server::scratch::scratch_dir("follow").expect("a scratch dir");
        let config = dir.path().join("taskstream.toml");
        // The session timeout is the broker's (group.protocol=consumer):
        // tests/common/kafka.rs sets 6 s, so the group notices the SIGKILL soon.
        std::fs::write(
            &config,
            format!(
                r#"
                application_id = "{name}"
                num_stream_threads = 2
                num_threads_per_task = 1
                replication_factor = 1
                commit_interval_ms = 500
                outcome_retention_records = {retention}
                [[topics]]
                name = "{topic}"
                partitions = {PARTITIONS}
                [[pipelines]]
                name = "counts"
                source_topic = "{topic}"
                processor = "count"
                "#
            ),
        )
        .expect("write the config");
        Application {
            name,
            topic,
            config,
            dir,
        }
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("instance-{i}.log"))
    }

    fn logs(&self) -> Vec<PathBuf> {
        let mut logs: Vec<PathBuf> = (0..3).map(|i| self.log(i)).collect();
        logs.push(self.dir.path().join("watch.log"));
        logs
    }

    fn start(&self, broker: &Broker, i: usize) -> Instance {
        let started = std::panic::catch_unwind(|| {
            Launch::kafka(&self.config, &broker.bootstrap)
                .log_file(self.log(i))
                .start()
        });
        started.unwrap_or_else(|panic| {
            // The scratch dir goes with the panic: show why it did not start.
            eprintln!("{}", std::fs::read_to_string(self.log(i)).unwrap_or_default());
            std::panic::resume_unwind(panic)
        })
    }
}

/// Produces keyed records to Kafka in steps until `stop` says so; answers
/// how many were written.
fn produce_until(broker: &Broker, topic: &str, stop: &std::sync::atomic::AtomicBool) -> usize {
    let log = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1)
        .expect("connect to the broker");
    let mut written = 0;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let batch = (0..40)
            .map(|i| taskstream_server::ProducerRecord::keyed(format!("key-{}", (written + i) % 97), "1"))
            .collect();
        log.append(topic, batch).expect("produce to Kafka");
        written += 40;
        std::thread::sleep(Duration::from_millis(50));
    }
    written
}

fn end_offsets(broker: &Broker, topic: &str) -> BTreeMap<u32, i64> {
    let log = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1)
        .expect("connect to the broker");
    (0..PARTITIONS)
        .map(|p| {
            let end = log.end_offset(topic, p).expect("the end offset");
            (p, i64::try_from(end).expect("an offset"))
        })
        .collect()
}

/// `taskstream --json watch` on instance 0's address, its lines parsed
/// into `seen` as they come.
fn watch(instance: &Instance, log: PathBuf, seen: Arc<Mutex<Seen>>) -> std::process::Child {
    let stderr = std::fs::File::create(&log).expect("the watch log");
    let mut child = Command::new(cli_binary())
        .env_remove("TASKSTREAM_ADDR")
        .env("RUST_LOG", "taskstream_client=info")
        .args([
            "--addr",
            &instance.addr,
            "--json",
            "watch",
            "--store",
            "counts",
            "--in-order",
            "--from-earliest",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        .spawn()
        .expect("start taskstream watch");
    let stdout = child.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let now = Instant::now();
            let mut seen = seen.lock().expect("lock");
            let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) else {
                seen.errors.push(format!("not JSON: {line}"));
                continue;
            };
            if let Some(lagged) = value.get("lagged") {
                let field = |name: &str| lagged[name].as_i64().unwrap_or(-1);
                seen.gaps.push((
                    field("partition") as u32,
                    field("first_offset"),
                    field("last_offset"),
                ));
                continue;
            }
            for record in value["records"].as_array().into_iter().flatten() {
                if record["outcome"] == "RETRYING" {
                    continue;
                }
                let partition = record["partition"].as_u64().unwrap_or(u64::MAX) as u32;
                seen.delivery(partition, record["offset"].as_i64().unwrap_or(-1), now);
            }
        }
    });
    child
}

/// The scenario; `retention` is the instances' `outcome_retention_records`.
fn follow_across_a_sigkill(retention: usize) {
    let Some(broker) = broker() else { return };
    let app = Application::new(retention);
    let logs = app.logs();
    println!("application {} in {}", app.name, app.dir.path().display());
    let mut instances: Vec<Instance> = (0..3).map(|i| app.start(broker, i)).collect();
    let runtime = runtime();
    eventually("three instances share the partitions", &logs, || {
        runtime.block_on(share_all(
            &instances.iter().collect::<Vec<_>>(),
            "counts",
            PARTITIONS,
        ))
    });

    // The subscriber asks instance 0, which survives; from offset 0 of every
    // partition, in offset order.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let client = runtime
        .block_on(StreamsClient::connect(instances[0].addr.as_str()))
        .expect("connect");
    let options = MetadataOptions::follow()
        .in_order(true)
        .start(Start::Offsets((0..PARTITIONS).map(|p| (p, 0)).collect()));
    let into = seen.clone();
    let handle = {
        let _guard = runtime.enter();
        client.get_metadata_async_all(
            "counts",
            options,
            move |result: Result<MetadataBatch, ClientError>| {
                let now = Instant::now();
                let mut seen = into.lock().expect("lock");
                match result {
                    Ok(batch) => {
                        for record in &batch.records {
                            if record.outcome != taskstream_client::v1::RecordOutcome::Retrying {
                                seen.delivery(record.partition, record.offset, now);
                            }
                        }
                    }
                    Err(ClientError::LaggedOffsets {
                        partition,
                        first_offset,
                        last_offset,
                    }) => seen.gaps.push((partition, first_offset, last_offset)),
                    Err(error) => seen.errors.push(error.to_string()),
                }
            },
        )
    };
    let watched = Arc::new(Mutex::new(Seen::default()));
    let mut watcher = watch(&instances[0], app.dir.path().join("watch.log"), watched.clone());

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = {
        let stop = stop.clone();
        let topic = app.topic.clone();
        std::thread::spawn(move || produce_until(broker, &topic, &stop))
    };
    eventually("the subscriber sees records of every partition", &logs, || {
        seen.lock().expect("lock").delivered.len() == PARTITIONS as usize
    });
    std::thread::sleep(Duration::from_secs(2));

    let moved = runtime
        .block_on(own_partitions(&instances[1], "counts"))
        .expect("instance 1 answers");
    instances[1].kill();
    let killed_at = Instant::now();
    println!("SIGKILL of instance 1, which held partitions {moved:?}");
    let survivors = [&instances[0], &instances[2]];
    let took = eventually("the survivors take over every partition", &logs, || {
        runtime.block_on(share_all(&survivors, "counts", PARTITIONS))
    });
    println!("every partition on the survivors {took:?} after the kill");
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let produced = producer.join().expect("the producer");
    let ends = end_offsets(broker, &app.topic);
    println!("{produced} records produced; end offsets {ends:?}");

    for (who, seen) in [("fan-in", &seen), ("watch", &watched)] {
        let took = eventually(&format!("the {who} covers every produced offset"), &logs, || {
            seen.lock().expect("lock").missing(&ends) == 0
        });
        let seen = seen.lock().expect("lock");
        println!(
            "{who}: complete {took:?} after the last record; {}",
            seen.summary()
        );
        seen.check(who, &ends);
        // Going on on the new owners: the moved partitions had deliveries
        // after the kill.
        for &partition in &moved {
            assert!(
                seen.last_at.get(&partition).is_some_and(|&at| at > killed_at),
                "{who}: nothing of moved partition {partition} after the kill"
            );
        }
    }
    handle.cancel();
    let _ = watcher.kill();
    let _ = watcher.wait();
    let watch_log = std::fs::read_to_string(app.dir.path().join("watch.log")).unwrap_or_default();
    let followed = watch_log
        .lines()
        .filter(|l| l.contains("followed the partition"))
        .count();
    println!("watch logged {followed} follows, e.g.:");
    for line in watch_log
        .lines()
        .filter(|l| l.contains("followed the partition"))
        .take(3)
    {
        println!("  {line}");
    }
    assert!(followed >= moved.len(), "watch logs each follow:\n{watch_log}");
}

/// The default retention (100,000 records per task): the new owners still
/// hold everything the subscribers had not seen, so nothing is lost.
#[test]
fn a_fan_in_and_watch_follow_partitions_to_their_new_owners_across_a_sigkill() {
    follow_across_a_sigkill(100_000);
}

/// Ten records per task: by the time a subscriber finds a new owner, that
/// owner has processed on and let go of the outcomes after the last commit,
/// so the subscribers must be told in-band which offsets they lost (and a
/// run that happens to lose none is still checked for repeats and holes).
#[test]
fn offsets_a_new_owner_no_longer_holds_are_named_lagged_across_a_sigkill() {
    follow_across_a_sigkill(10);
}
