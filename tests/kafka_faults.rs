//! Faults on Apache Kafka (tests/common/kafka.rs), with the server binary as
//! a user runs it: instances killed with SIGKILL while they hold persistent
//! stores, and what the survivors must go on doing — commit every task they
//! hold, the ones they gained included, so that queries (which a persistent
//! store answers from its last commit) show every record.

mod common;

use common::instance::{Instance, Launch, counts_of, own_metadata, share_all};
use common::kafka::{Broker, broker, unique};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use taskstream_server::Log as _;

/// Bound on a rebalance, a restore, a catch-up: generous, since a stall is
/// what these tests look for and they report how long each step took.
const DEADLINE: Duration = Duration::from_secs(120);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Polls `condition` until it holds or `DEADLINE` passes; answers how long it took.
fn eventually(what: &str, logs: &[PathBuf], mut condition: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !condition() {
        if started.elapsed() > DEADLINE {
            for log in logs {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                eprintln!("--- last lines of {}:", log.display());
                for line in tail.into_iter().rev() {
                    eprintln!("{line}");
                }
            }
            panic!("not within {DEADLINE:?}: {what}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    started.elapsed()
}

/// Produces `records` straight to Kafka, keyed `{prefix}-{i % keys}`; answers the count per key.
fn produce(broker: &Broker, topic: &str, prefix: &str, records: usize, keys: usize) -> BTreeMap<String, u64> {
    let log = taskstream_server::log::KafkaLog::with_settings(&broker.bootstrap, &BTreeMap::new(), 1)
        .expect("connect to the broker");
    let mut produced = BTreeMap::new();
    let all: Vec<String> = (0..records).map(|i| format!("{prefix}-{}", i % keys)).collect();
    for chunk in all.chunks(500) {
        let batch = chunk
            .iter()
            .map(|key| taskstream_server::ProducerRecord::keyed(key.clone(), "1"))
            .collect();
        log.append(topic, batch).expect("produce to Kafka");
        for key in chunk {
            *produced.entry(key.clone()).or_default() += 1;
        }
    }
    produced
}

/// Tasks of an instance whose committed offset is behind its end offset
/// (`task: committed/watermark/end`), or `Err` while it cannot answer.
async fn uncommitted_tasks(instance: &Instance) -> Result<Vec<String>, ()> {
    let own = own_metadata(instance, "counts").await.ok_or(())?;
    Ok(own
        .tasks
        .iter()
        .filter(|t| t.committed_offset < t.end_offset || t.watermark < t.end_offset)
        .map(|t| {
            format!(
                "{}: committed {} watermark {} end {}",
                t.task_id, t.committed_offset, t.watermark, t.end_offset
            )
        })
        .collect())
}

/// A three-instance application on one topic of `PARTITIONS` partitions:
/// persistent `count` stores, each instance in its own data dir, N = T = 2
/// in `offset` order (as the issue's reproduction), logs in files.
struct Application {
    name: String,
    topic: String,
    config: PathBuf,
    dir: taskstream_server::scratch::TempDir,
}

const PARTITIONS: u32 = 12;

impl Application {
    fn new(prefix: &str, guarantee: &str) -> Application {
        let name = unique(prefix);
        let topic = format!("{name}-events");
        let dir = taskstream_server::scratch::scratch_dir(prefix).expect("a scratch dir");
        let config = dir.path().join("taskstream.toml");
        std::fs::write(
            &config,
            format!(
                r#"
                application_id = "{name}"
                num_stream_threads = 2
                num_threads_per_task = 2
                processing_order = "offset"
                replication_factor = 1
                processing_guarantee = "{guarantee}"
                [kafka]
                "transaction.timeout.ms" = 10000
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

    fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("data-{i}"))
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("instance-{i}.log"))
    }

    fn logs(&self) -> Vec<PathBuf> {
        (0..3).map(|i| self.log(i)).collect()
    }

    fn start(&self, broker: &Broker, i: usize) -> Instance {
        let data_dir = self.data_dir(i);
        Launch::kafka(&self.config, &broker.bootstrap)
            .data_dir(Some(&data_dir))
            .log_file(self.log(i))
            .start()
    }
}

/// The defect of the faults issue: after one of three instances with
/// persistent stores is SIGKILLed, the survivors process every record but
/// stop committing, so queries (answered from the last commit) never show
/// the records produced since. Here every task on the survivors must commit
/// up to its end offset after the reassignment, and the counts must show
/// every record produced before and after the kill.
fn survivors_commit_after_a_sigkill(guarantee: &str) {
    let Some(broker) = broker() else { return };
    let app = Application::new(
        &format!("sigkill-commits-{}", guarantee.replace('_', "-")),
        guarantee,
    );
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

    let before = produce(broker, &app.topic, "key", 6_000, 600);
    let took = eventually("the three instances count all 6,000 records", &logs, || {
        runtime
            .block_on(counts_of(&instances.iter().collect::<Vec<_>>(), "counts"))
            .is_some_and(|counts| counts == before)
    });
    println!("6,000 records counted and committed after {took:?}");

    instances[1].kill();
    let killed_at = Instant::now();
    let survivors = [&instances[0], &instances[2]];
    let took = eventually("the survivors take over every partition", &logs, || {
        runtime.block_on(share_all(&survivors, "counts", PARTITIONS))
    });
    println!("SIGKILL: every partition on the survivors after {took:?}");

    let after = produce(broker, &app.topic, "after", 120, 120);
    let mut expected = before.clone();
    expected.extend(after);
    let mut behind = Vec::new();
    let took = eventually(
        "every task on the survivors commits up to its end offset",
        &logs,
        || {
            behind.clear();
            for survivor in survivors {
                match runtime.block_on(uncommitted_tasks(survivor)) {
                    Ok(tasks) => behind.extend(tasks),
                    Err(()) => behind.push(format!("{} does not answer", survivor.address)),
                }
            }
            if !behind.is_empty() && killed_at.elapsed().as_secs().is_multiple_of(10) {
                println!("still behind: {behind:?}");
            }
            behind.is_empty()
        },
    );
    println!("every task committed its end offset {took:?} after the new records");
    let mut last = BTreeMap::new();
    eventually("the counts show every record", &logs, || {
        let Some(counts) = runtime.block_on(counts_of(&survivors, "counts")) else {
            return false;
        };
        let done = expected
            .iter()
            .all(|(key, n)| counts.get(key).is_some_and(|c| c >= n));
        last = counts;
        done
    });
    let twice: u64 = last.values().sum::<u64>() - expected.values().sum::<u64>();
    println!("{guarantee}: 6,120 records, {twice} applied twice");
    if guarantee == "exactly_once_v2" {
        assert_eq!(last, expected, "exactly_once_v2 applies every record once");
    }
}

#[test]
fn survivors_of_a_sigkill_commit_every_task_at_least_once() {
    survivors_commit_after_a_sigkill("at_least_once");
}

#[test]
fn survivors_of_a_sigkill_commit_every_task_exactly_once() {
    survivors_commit_after_a_sigkill("exactly_once_v2");
}
