//! Tasks added and removed while records flow, as a consumer group's
//! assignment and revocation will do: in every order, with memory and
//! persistent stores, nothing is lost, nothing applied twice, every commit
//! moves forward, and a removed partition answers as one held elsewhere.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use taskstream_server::config::LatencySpec;
use taskstream_server::scratch::scratch_dir;
use taskstream_server::*;

const WAIT: Duration = Duration::from_secs(120);
const PARTITIONS: u32 = 4;
const KEYS: usize = 37;

fn config(order: ProcessingOrder, t: usize, store: StoreKind, dir: Option<&std::path::Path>) -> Config {
    Config {
        application_id: "churn".into(),
        num_stream_threads: 4,
        num_threads_per_task: t,
        processing_order: order,
        commit_interval_ms: 20,
        data_dir: dir.map(|d| d.to_path_buf()),
        pipelines: vec![PipelineConfig {
            name: "counts".into(),
            source_topic: "events".into(),
            partitions: Some(PARTITIONS),
            processor: ProcessorSpec::Simulate {
                latency_ms: Some(LatencySpec::Uniform([0.0, 0.3])),
                cpu_work_us: 0,
                failure_rate: 0.0,
                fail_attempts: 0,
                seed: 3,
            },
            num_threads_per_task: None,
            processing_order: None,
            store: Some(store),
            retry_policy: None,
            sink_topic: None,
        }],
        ..Config::default()
    }
}

fn count_of(app: &StreamsApp, key: &str) -> u64 {
    app.get("counts", key.as_bytes())
        .unwrap()
        .map_or(0, |v| std::str::from_utf8(&v).unwrap().parse().unwrap())
}

fn churn(order: ProcessingOrder, t: usize, store: StoreKind) {
    let dir = scratch_dir("churn").unwrap();
    let commits: Arc<Mutex<HashMap<String, Vec<u64>>>> = Arc::default();
    let seen = commits.clone();
    let app = StreamsApp::builder(config(order, t, store, Some(dir.path())))
        .on_commit(move |report| {
            if report.result.is_ok() {
                seen.lock()
                    .unwrap()
                    .entry(report.task_id.clone())
                    .or_default()
                    .push(report.offset);
            }
        })
        .start()
        .unwrap();
    let producing = Arc::new(AtomicBool::new(true));
    let producer = {
        let (app, producing) = (app.clone(), producing.clone());
        std::thread::spawn(move || {
            let mut expected: BTreeMap<String, u64> = BTreeMap::new();
            for batch in 0..40 {
                let records: Vec<ProducerRecord> = (0..100)
                    .map(|i| {
                        let key = format!("k{}", (batch * 100 + i) % KEYS);
                        *expected.entry(key.clone()).or_default() += 1;
                        ProducerRecord::keyed(key, "x")
                    })
                    .collect();
                app.produce("events", records).unwrap();
                std::thread::sleep(Duration::from_millis(3));
            }
            producing.store(false, Ordering::SeqCst);
            expected
        })
    };
    // Revoke and reassign partitions while the producer runs.
    let mut round = 0u32;
    while producing.load(Ordering::SeqCst) || round < 6 {
        let revoked: Vec<u32> = (0..PARTITIONS)
            .filter(|p| (p + round).is_multiple_of(3))
            .collect();
        app.remove_tasks("counts", &revoked).unwrap();
        let hosted = app.hosted_partitions("counts").unwrap();
        assert!(revoked.iter().all(|p| !hosted.contains(p)));
        // A removed partition answers as one held elsewhere.
        let key = (0..KEYS)
            .map(|k| format!("k{k}"))
            .find(|k| revoked.contains(&log::partition_for_key(k.as_bytes(), PARTITIONS)))
            .unwrap();
        assert!(matches!(
            app.get("counts", key.as_bytes()),
            Err(RuntimeError::NotHosted { .. })
        ));
        std::thread::sleep(Duration::from_millis(5));
        app.add_tasks("counts", &revoked, &BTreeMap::new()).unwrap();
        round += 1;
    }
    let expected = producer.join().unwrap();
    assert!(app.wait_until_caught_up(WAIT), "{:#?}", app.describe());
    for (key, count) in &expected {
        assert_eq!(
            count_of(&app, key),
            *count,
            "{key} in {order} order, {store:?} store"
        );
    }
    // Every task's commits moved forward, across its removals and re-adds.
    for (task, offsets) in commits.lock().unwrap().iter() {
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{task}: {offsets:?}");
    }
    app.shutdown().unwrap();
    drop(app);

    // After a restart the counts are still exact: nothing was committed twice.
    let app = StreamsApp::start(config(order, t, store, Some(dir.path()))).unwrap();
    assert!(app.wait_until_caught_up(WAIT));
    for (key, count) in &expected {
        assert_eq!(count_of(&app, key), *count, "{key} after restart");
    }
    app.shutdown().unwrap();
}

#[test]
fn offset_order_with_persistent_stores() {
    churn(ProcessingOrder::Offset, 3, StoreKind::Persistent);
}

#[test]
fn offset_order_with_memory_stores() {
    churn(ProcessingOrder::Offset, 3, StoreKind::Memory);
}

#[test]
fn key_order_with_persistent_stores() {
    churn(ProcessingOrder::Key, 2, StoreKind::Persistent);
}

#[test]
fn key_order_with_memory_stores() {
    churn(ProcessingOrder::Key, 2, StoreKind::Memory);
}

#[test]
fn unordered_with_persistent_stores() {
    churn(ProcessingOrder::Unordered, 2, StoreKind::Persistent);
}

#[test]
fn one_thread_per_task_with_persistent_stores() {
    churn(ProcessingOrder::Offset, 1, StoreKind::Persistent);
}

#[test]
fn adding_a_hosted_partition_or_removing_one_not_hosted_is_refused() {
    let app = StreamsApp::start(config(ProcessingOrder::Offset, 1, StoreKind::Memory, None)).unwrap();
    assert!(matches!(
        app.add_tasks("counts", &[0], &BTreeMap::new()),
        Err(RuntimeError::InvalidArgument { .. })
    ));
    assert!(matches!(
        app.add_tasks("counts", &[PARTITIONS], &BTreeMap::new()),
        Err(RuntimeError::InvalidArgument { .. })
    ));
    app.remove_tasks("counts", &[1]).unwrap();
    assert!(matches!(
        app.remove_tasks("counts", &[1]),
        Err(RuntimeError::NotHosted { partition: 1, .. })
    ));
    let metadata = app.process_metadata_for_store("counts", false).unwrap();
    let partitions: Vec<u32> = metadata.instances[0].tasks.iter().map(|t| t.partition).collect();
    assert_eq!(partitions, vec![0, 2, 3]);
    assert!(matches!(
        app.subscribe(
            "counts",
            SubscribeRequest {
                partitions: vec![1],
                ..SubscribeRequest::default()
            }
        ),
        Err(RuntimeError::NotHosted { partition: 1, .. })
    ));
}
