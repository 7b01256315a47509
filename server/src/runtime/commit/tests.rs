//! Commits of a task that leaves while a commit round is under way, in the
//! order a loaded machine can produce: the app is laid out with no stream
//! thread, "threads" are scheduler slots the test picks for, units run the
//! real processor on a persistent store, and the round's commits are carried
//! out exactly when the test says.

use super::run;
use crate::config::{Config, PipelineConfig, ProcessingOrder, ProcessorSpec, StoreKind};
use crate::log::ProducerRecord;
use crate::runtime::scheduler::{CommitItem, Pick};
use crate::runtime::shared::Shared;
use crate::runtime::{AppBuilder, app, process};
use crate::scratch::scratch_dir;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const STORE: &str = "counts";
const TOPIC: &str = "events";

/// `key` order with two threads per task over a persistent store: its
/// commits freeze by write tag, at once, without waiting for the task.
fn config(dir: &std::path::Path) -> Config {
    Config {
        application_id: "leaving".into(),
        num_stream_threads: 2,
        num_threads_per_task: 2,
        processing_order: ProcessingOrder::Key,
        // Rounds come only when a pick is told the time is past this.
        commit_interval_ms: 3_600_000,
        data_dir: Some(dir.to_path_buf()),
        pipelines: vec![PipelineConfig {
            name: STORE.into(),
            source_topic: TOPIC.into(),
            partitions: Some(1),
            processor: ProcessorSpec::Count,
            num_threads_per_task: None,
            processing_order: None,
            store: Some(StoreKind::Persistent),
            retry_policy: None,
            sink_topic: None,
        }],
        ..Config::default()
    }
}

/// Appends one record per key, in order.
fn produce(shared: &Shared, keys: &[&'static str]) {
    let records = keys.iter().map(|k| ProducerRecord::keyed(*k, "x")).collect();
    shared.log.append(TOPIC, records).expect("append");
}

/// Thread `me` carries out its picks until it has nothing left to do:
/// fetches read the log, units run the processor and come back.
fn drive(shared: &Shared, me: usize) {
    loop {
        let pick = shared.lock().pick(me, Instant::now(), process::now_ms());
        match pick {
            Pick::Fetch {
                task,
                from,
                max,
                generation,
                context,
            } => {
                let mut records = Vec::new();
                let topic = &shared.pipelines[context.pipeline].topic;
                shared
                    .log
                    .read(topic, context.partition, from, max, &mut records)
                    .expect("read");
                shared
                    .lock()
                    .finish_fetch(me, task, generation, Ok(records), Instant::now());
            }
            Pick::RetryFetch { task, generation, .. } => {
                shared
                    .lock()
                    .finish_retry_fetch(me, task, generation, Ok(Vec::new()));
            }
            Pick::Unit { task, unit, context } => {
                let done = process::run_unit(shared, &context, &unit);
                drop(context);
                let waiting = shared.lock().finish_unit(me, task, done);
                assert!(waiting.is_none(), "a tagged commit never waits for its task");
            }
            Pick::Wait(_) => return,
            Pick::Commit { .. } | Pick::Retry { .. } | Pick::Restore { .. } | Pick::Exit => {
                panic!("only fetches and units were expected here")
            }
        }
    }
}

/// The commits of the round thread `me` picks now (a round is due).
fn commit_round(shared: &Shared, me: usize) -> Vec<CommitItem> {
    let later = Instant::now() + Duration::from_secs(7_200);
    match shared.lock().pick(me, later, process::now_ms()) {
        Pick::Commit { items, .. } => items,
        _ => panic!("a commit round was due"),
    }
}

/// The task of partition 0: its watermark and its store's count of `key`.
fn watermark_and_count(shared: &Shared, key: &str) -> (u64, u64) {
    let scheduler = shared.lock();
    let task = scheduler
        .task_index(0, 0)
        .and_then(|t| scheduler.task(t))
        .expect("partition 0 is hosted");
    let count = task
        .store()
        .get(key.as_bytes())
        .expect("store read")
        .map_or(0, |v| {
            std::str::from_utf8(&v).expect("utf-8").parse().expect("a count")
        });
    (task.watermark(), count)
}

/// The flake of `tests/dynamic_tasks.rs` (a count one too high in `key`
/// order with persistent stores), forced: a round decides a commit at 4, the
/// task runs on to 8 and leaves, its final commit writes 8, and only then
/// does the round freeze and write its commit. Written, its checkpoint (4)
/// would sit over data that holds the writes of offsets 4 to 7, and the
/// task added again would resume at 4 and count those records twice.
#[test]
fn a_commit_decided_before_its_task_left_is_not_written_after_the_final_one() {
    let dir = scratch_dir("commit-leaving").expect("scratch dir");
    let shared = AppBuilder::new(config(dir.path()))
        .manual_assignment()
        .start_without_threads()
        .expect("laid out");
    app::add_tasks(&shared, STORE, &[0], &BTreeMap::new()).expect("added");
    produce(&shared, &["a", "b", "a", "b"]);
    drive(&shared, 0);
    assert_eq!(watermark_and_count(&shared, "a"), (4, 2));

    // Thread 1 decides the round's commits, then stalls before freezing them.
    let round = commit_round(&shared, 1);
    assert_eq!(round.iter().map(|item| item.offset).collect::<Vec<_>>(), [4]);
    produce(&shared, &["a", "b", "a", "b"]);
    drive(&shared, 0);
    assert_eq!(watermark_and_count(&shared, "a"), (8, 4));
    app::remove_tasks(&shared, STORE, &[0]).expect("removed, its final commit at 8 written");

    // The round goes on: nothing of it may reach the store's file.
    run(&shared, round);
    shared.lock().finish_commit_round(1);

    app::add_tasks(&shared, STORE, &[0], &BTreeMap::new()).expect("added again");
    assert_eq!(
        watermark_and_count(&shared, "a"),
        (8, 4),
        "the task resumes where its final commit left it"
    );
    drive(&shared, 0);
    for key in ["a", "b"] {
        assert_eq!(
            watermark_and_count(&shared, key),
            (8, 4),
            "{key}: no record counted twice"
        );
    }
}
