//! Faults on Apache Kafka (tests/common/kafka.rs), with the server binary as
//! a user runs it: instances killed with SIGKILL while they hold persistent
//! stores, and what the survivors must go on doing — commit every task they
//! hold, the ones they gained included, so that queries (which a persistent
//! store answers from its last commit) show every record; and instances
//! added and removed while records flow, through which the tasks that stay
//! where they are must keep processing.

mod common;

use common::instance::{Instance, Launch, counts_of, own_metadata, runtime, share_all};
use common::kafka::{Broker, broker, unique};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use taskstream_server::Log as _;

/// Bound on a rebalance, a restore, a catch-up: generous, since a stall is
/// what these tests look for and they report how long each step took.
const DEADLINE: Duration = Duration::from_secs(120);

/// `eventually_within` the test's `DEADLINE`.
fn eventually(what: &str, logs: &[PathBuf], condition: impl FnMut() -> bool) -> Duration {
    common::instance::eventually_within(DEADLINE, what, logs, condition)
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
        Application::with_protocol(prefix, guarantee, "consumer")
    }

    /// `new` on the consumer group protocol `protocol` (`consumer`: KIP-848;
    /// `classic`: the cooperative-sticky assignor).
    fn with_protocol(prefix: &str, guarantee: &str, protocol: &str) -> Application {
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
                group_protocol = "{protocol}"
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

/// Each task's watermark on each instance, sampled until `stop`: per
/// (instance, task), the samples `(when, watermark)`.
type Samples = BTreeMap<(usize, String), Vec<(Instant, u64)>>;

fn sample_watermarks(
    addresses: &[(usize, String, u32)],
    runtime: &tokio::runtime::Runtime,
    samples: &mut Samples,
) {
    for (i, address, _) in addresses {
        // DescribeRuntime answers through a rebalance (metadata queries may not).
        let described = runtime.block_on(async {
            let client = taskstream_client::StreamsClient::connect(address.as_str())
                .await
                .ok()?;
            client.describe_runtime().await.ok()
        });
        let now = Instant::now();
        for task in described.map(|d| d.tasks).unwrap_or_default() {
            samples
                .entry((*i, task.task_id.clone()))
                .or_default()
                .push((now, u64::try_from(task.watermark).unwrap_or(0)));
        }
    }
}

/// For each task hosted on the same instance through all of `window` (its
/// samples cover it), the longest time within the window its watermark did
/// not move; tasks that moved are left out.
fn stalls_of_staying_tasks(samples: &Samples, window: (Instant, Instant)) -> BTreeMap<String, Duration> {
    let (from, to) = window;
    let mut stalls = BTreeMap::new();
    for ((instance, task), points) in samples {
        // From the last sample at or before the window to the first at or
        // after it, with no hole: a task that left and came back (or moved
        // in later) has one at least as long as the calm between phases.
        let Some(first) = points.iter().rposition(|(at, _)| *at <= from) else {
            continue;
        };
        let Some(last) = points.iter().position(|(at, _)| *at >= to) else {
            continue;
        };
        let inside: Vec<&(Instant, u64)> = points[first..=last].iter().collect();
        let continuous = inside
            .windows(2)
            .all(|w| w[1].0 - w[0].0 < Duration::from_secs(1));
        if !continuous || inside.len() < 2 {
            continue;
        }
        let mut longest = Duration::ZERO;
        let mut since = inside[0].0;
        let mut last = inside[0].1;
        for (at, watermark) in &inside[1..] {
            if *watermark > last {
                since = *at;
                last = *watermark;
            }
            longest = longest.max(*at - since);
        }
        stalls.insert(format!("{task}@{instance}"), longest);
    }
    stalls
}

/// KIP-848's promise (and the cooperative-sticky assignor's): a rebalance
/// stops only the tasks that move. Two instances process a steady flow; a
/// third joins, then leaves with SIGTERM. Every task that stays on its
/// instance through a rebalance must advance its watermark during it; the
/// longest stall of any of them is reported.
fn unaffected_tasks_run_through_rebalances(protocol: &str) {
    let Some(broker) = broker() else { return };
    let app = Application::with_protocol(&format!("rebalance-{protocol}"), "at_least_once", protocol);
    let logs = app.logs();
    println!("application {} in {}", app.name, app.dir.path().display());
    let mut instances: Vec<Instance> = (0..3).map(|i| app.start(broker, i)).take(2).collect();
    let runtime = runtime();
    eventually("two instances share the partitions", &logs, || {
        runtime.block_on(share_all(
            &instances.iter().collect::<Vec<_>>(),
            "counts",
            PARTITIONS,
        ))
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = {
        let stop = stop.clone();
        let bootstrap = broker.bootstrap.clone();
        let topic = app.topic.clone();
        std::thread::spawn(move || {
            let log = taskstream_server::log::KafkaLog::with_settings(&bootstrap, &BTreeMap::new(), 1)
                .expect("connect to the broker");
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Every partition gets records all the time.
                let batch = (0..PARTITIONS)
                    .map(|p| taskstream_server::ProducerRecord {
                        partition: Some(p),
                        ..taskstream_server::ProducerRecord::keyed(format!("k{}", n % 97), "1")
                    })
                    .collect();
                log.append(&topic, batch).expect("produce to Kafka");
                n += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            n * u64::from(PARTITIONS)
        })
    };
    let mut samples = Samples::new();
    let sample_until =
        |instances: &[Instance], samples: &mut Samples, what: &str, done: &dyn Fn() -> bool| {
            let addresses: Vec<(usize, String, u32)> = instances
                .iter()
                .enumerate()
                .map(|(i, instance)| (i, instance.addr.clone(), instance.port()))
                .collect();
            let started = Instant::now();
            loop {
                sample_watermarks(&addresses, &runtime, samples);
                if done() {
                    return Instant::now();
                }
                assert!(started.elapsed() < DEADLINE, "not within {DEADLINE:?}: {what}");
                std::thread::sleep(Duration::from_millis(100));
            }
        };
    // Steady flow first: a few seconds of samples before anything moves.
    let calm = Instant::now() + Duration::from_secs(3);
    sample_until(&instances, &mut samples, "samples", &|| Instant::now() >= calm);

    // The third starts beside the sampling: a start takes a while, and the
    // samples must cover the rebalance it sets off.
    let joined_from = Instant::now();
    let third = std::thread::scope(|scope| {
        let starting = scope.spawn(|| app.start(broker, 2));
        let _ = sample_until(&instances, &mut samples, "the third instance starts", &|| {
            starting.is_finished()
        });
        starting.join().expect("start the third instance")
    });
    instances.push(third);
    // Settled: every instance runs its even share of the tasks (both
    // assignors balance 12 partitions evenly; KIP-848 moves them a few at a
    // time), as each describes its own.
    let check = |instances: &[Instance]| {
        let share = PARTITIONS as usize / instances.len();
        runtime.block_on(async {
            let mut all = Vec::new();
            for instance in instances {
                let Ok(client) = taskstream_client::StreamsClient::connect(instance.addr.as_str()).await
                else {
                    return false;
                };
                let Ok(described) = client.describe_runtime().await else {
                    return false;
                };
                if described.tasks.len() != share {
                    return false;
                }
                all.extend(described.tasks.into_iter().map(|t| t.task_id));
            }
            all.sort_unstable();
            all.dedup();
            all.len() == PARTITIONS as usize
        })
    };
    let joined = {
        let mut settled_at = None;
        while settled_at.is_none() {
            let now = sample_until(
                &instances,
                &mut samples,
                "three instances share the partitions",
                &|| true,
            );
            if check(&instances) {
                settled_at = Some(now);
            }
            assert!(
                joined_from.elapsed() < DEADLINE,
                "three instances never shared the partitions"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        settled_at.unwrap_or_else(Instant::now)
    };
    let calm = Instant::now() + Duration::from_secs(2);
    sample_until(&instances, &mut samples, "samples", &|| Instant::now() >= calm);

    let left_from = Instant::now();
    instances[2].signal("TERM");
    let remaining = &instances[..2];
    let left = {
        let mut settled_at = None;
        while settled_at.is_none() {
            let now = sample_until(
                remaining,
                &mut samples,
                "two instances share the partitions",
                &|| true,
            );
            if check(remaining) {
                settled_at = Some(now);
            }
            assert!(
                left_from.elapsed() < DEADLINE,
                "two instances never took the partitions back"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        settled_at.unwrap_or_else(Instant::now)
    };
    let calm = Instant::now() + Duration::from_secs(2);
    sample_until(remaining, &mut samples, "samples", &|| Instant::now() >= calm);
    assert!(
        instances[2].terminate(),
        "the third instance stops cleanly on SIGTERM"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let produced = producer.join().expect("the producer");

    for (what, window) in [("join", (joined_from, joined)), ("leave", (left_from, left))] {
        let stalls = stalls_of_staying_tasks(&samples, window);
        let longest = stalls.iter().max_by_key(|(_, d)| **d);
        println!(
            "{protocol} {what}: rebalance {:?}, {} tasks stayed, longest stall of one {longest:?}",
            window.1 - window.0,
            stalls.len()
        );
        // 12 tasks on 2 instances and 4 on each of 3: 8 stay where they are.
        assert_eq!(
            stalls.len(),
            8,
            "{what}: the tasks that stay where they are: {stalls:?}"
        );
        let stopped: Vec<_> = stalls
            .iter()
            .filter(|(_, d)| **d >= window.1 - window.0)
            .collect();
        assert!(
            stopped.is_empty(),
            "{what}: tasks that stayed did not advance during the rebalance: {stopped:?}"
        );
    }
    println!("{protocol}: {produced} records produced while instances came and went");
}

#[test]
fn unaffected_tasks_run_through_rebalances_on_kip_848() {
    unaffected_tasks_run_through_rebalances("consumer");
}

#[test]
fn unaffected_tasks_run_through_rebalances_on_the_classic_protocol() {
    unaffected_tasks_run_through_rebalances("classic");
}
