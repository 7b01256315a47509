//! The Scheduler driven step by step, with no thread and no I/O: a model log
//! answers fetches, and "threads" are indices that pick, hold units, complete
//! them, die or leave. Deterministic tests pin single behaviours; the
//! property test checks the invariants over random interleavings.

use super::*;
use crate::config::ProcessingOrder;
use crate::metadata::Outcome;
use crate::metrics::TaskMeters;
use crate::runtime::retry::Failure;
use crate::runtime::retry_queue::RetryQueue;
use crate::runtime::stores::TaskStore;
use crate::runtime::task::TaskInit;
use crate::runtime::work::{Gating, HoldLimits};
use bytes::Bytes;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const PIPELINE: usize = 0;

fn record(partition: u32, offset: u64, key: &str) -> Record {
    Record {
        partition,
        offset,
        timestamp_ms: 0,
        key: Some(Bytes::copy_from_slice(key.as_bytes())),
        value: Bytes::new(),
        headers: Vec::new(),
    }
}

fn gating(order: ProcessingOrder) -> Gating {
    match order {
        ProcessingOrder::Offset => Gating::Park,
        ProcessingOrder::Key => Gating::Hold,
        ProcessingOrder::Unordered => Gating::Off,
    }
}

fn init(partition: u32, order: ProcessingOrder, t: usize, start: u64, batch: usize) -> TaskInit {
    TaskInit {
        id: format!("p_{partition}").into(),
        pipeline: PIPELINE,
        partition,
        order,
        threads_per_task: t,
        gating: gating(order),
        start,
        committed: start,
        retry: RetryQueue::new(0, order != ProcessingOrder::Unordered, 1_000, Vec::new()),
        gated_keys: Vec::new(),
        store: Arc::new(TaskStore::memory()),
        restore: None,
        sink_topic: None,
        max_batch_records: batch,
        max_in_flight_records: 1_000,
        hold: HoldLimits::new(1_000, 100),
        outcome_retention_records: 10_000,
        transaction: None,
        meters: Arc::new(TaskMeters::new("p", &format!("p_{partition}"))),
        reprocessed_below: 0,
    }
}

fn scheduler(now: Instant) -> Scheduler {
    Scheduler::new(
        "app",
        vec![PipelineNames {
            name: "p".into(),
            topic: "t".into(),
        }],
        1_024,
        Duration::from_secs(3_600),
        Duration::from_secs(3_600),
        now,
    )
}

fn processed(context: &UnitContext, records: &[Record]) -> Vec<RecordOutcome> {
    records
        .iter()
        .map(|r| RecordOutcome {
            thread: context.record_threads.then(|| context.thread.clone()),
            offset: r.offset,
            key: r.key.clone(),
            key_truncated: false,
            timestamp_ms: r.timestamp_ms,
            outcome: Outcome::Processed,
            attempts: 1,
            error: None,
        })
        .collect()
}

fn done(context: &UnitContext, unit: &WorkUnit) -> UnitDone {
    UnitDone {
        lane: unit.lane,
        drains: unit.drains.clone(),
        outcomes: processed(context, &unit.records),
        returned: Vec::new(),
        retry_keys: Vec::new(),
        outputs: Vec::new(),
    }
}

/// Picks for `thread`, serving a fetch from `log` at once; answers a unit if one was handed out.
fn pick_unit(
    s: &mut Scheduler,
    thread: usize,
    log: &[Record],
    now: Instant,
) -> Option<(usize, WorkUnit, UnitContext)> {
    match s.pick(thread, now, 0) {
        Pick::Unit { task, unit, context } => Some((task, unit, context)),
        Pick::Fetch {
            task,
            from,
            max,
            generation,
            ..
        } => {
            let records = log
                .iter()
                .filter(|r| r.offset >= from)
                .take(max)
                .cloned()
                .collect();
            s.finish_fetch(thread, task, generation, Ok(records), now);
            None
        }
        Pick::RetryFetch { task, generation, .. } => {
            s.finish_retry_fetch(thread, task, generation, Ok(Vec::new()));
            None
        }
        Pick::Commit { .. } => {
            s.finish_commit_round(thread);
            None
        }
        Pick::Retry { .. } | Pick::Restore { .. } => panic!("no retries nor restores here"),
        Pick::Wait(_) | Pick::Exit => None,
    }
}

/// Picks for `thread` a few times (serving fetches from `log`): no unit comes.
fn no_unit_for(s: &mut Scheduler, thread: usize, log: &[Record], now: Instant, why: &str) {
    for _ in 0..4 {
        assert!(pick_unit(s, thread, log, now).is_none(), "{why}");
    }
}

/// Picks for `thread` until it gets a unit (fetches are served on the way).
fn first_unit(
    s: &mut Scheduler,
    thread: usize,
    log: &[Record],
    now: Instant,
) -> (usize, WorkUnit, UnitContext) {
    for _ in 0..100 {
        if let Some(found) = pick_unit(s, thread, log, now) {
            return found;
        }
    }
    panic!("no unit for thread {thread}");
}

/// A scheduler with `threads` threads and one task of partition 0.
fn one_task(threads: usize, order: ProcessingOrder, t: usize, batch: usize, now: Instant) -> Scheduler {
    let mut s = scheduler(now);
    for _ in 0..threads {
        s.add_thread();
    }
    s.add_task(init(0, order, t, 0, batch));
    s
}

#[test]
fn t_threads_work_in_one_task_at_once_and_never_more() {
    let now = Instant::now();
    let mut s = one_task(4, ProcessingOrder::Unordered, 2, 10, now);
    let log: Vec<Record> = (0..200).map(|o| record(0, o, &format!("k{o}"))).collect();
    let mut running: Vec<(usize, usize, WorkUnit, UnitContext)> = Vec::new();
    for _ in 0..3 {
        for thread in 0..4 {
            if running.iter().any(|(th, ..)| *th == thread) {
                continue;
            }
            if let Some((task, unit, context)) = pick_unit(&mut s, thread, &log, now) {
                running.push((thread, task, unit, context));
            }
        }
    }
    assert_eq!(running.len(), 2, "T = 2 reached, and not exceeded with 4 threads");
    assert_eq!(s.task(0).map(Task::active), Some(2));
    let owner_inside = running
        .iter()
        .any(|(thread, ..)| *thread == s.task(0).unwrap().owner());
    assert_eq!(
        s.helpers_of(0).len() + usize::from(owner_inside),
        2,
        "helpers are counted as such"
    );
}

#[test]
fn offset_order_with_several_threads_keeps_keys_apart_and_releases_in_offset_order() {
    let now = Instant::now();
    let mut s = one_task(3, ProcessingOrder::Offset, 3, 4, now);
    let keys = ["a", "b", "c", "d"];
    let log: Vec<Record> = (0..40).map(|o| record(0, o, keys[o as usize % 4])).collect();
    let feed = s.feed(PIPELINE).unwrap().subscribe();
    let mut feed = feed;
    let mut running: Vec<(usize, usize, WorkUnit, UnitContext)> = Vec::new();
    let mut seen = Vec::new();
    for round in 0..200 {
        for thread in 0..3 {
            if running.iter().any(|(th, ..)| *th == thread) {
                continue;
            }
            if let Some((task, unit, context)) = pick_unit(&mut s, thread, &log, now) {
                let keys: BTreeSet<_> = unit.records.iter().map(|r| r.key.clone()).collect();
                for (_, _, other, _) in &running {
                    assert!(
                        other.records.iter().all(|r| !keys.contains(&r.key)),
                        "two units of one key at once"
                    );
                }
                running.push((thread, task, unit, context));
            }
        }
        // Complete the newest unit first: completions out of offset order.
        if let Some((thread, task, unit, context)) = running.pop() {
            let _ = s.finish_unit(thread, task, done(&context, &unit));
        }
        while let Ok(FeedEvent::Batch(published)) = feed.try_recv() {
            seen.extend(published.batch().records.iter().map(|r| r.offset));
        }
        if s.task(0).unwrap().watermark() == 40 && running.is_empty() {
            assert!(round > 0);
            break;
        }
    }
    assert_eq!(
        seen,
        (0..40).collect::<Vec<_>>(),
        "every outcome once, in offset order"
    );
}

#[test]
fn a_retry_never_runs_before_its_first_outcome_is_published() {
    let now = Instant::now();
    let mut s = one_task(2, ProcessingOrder::Key, 2, 10, now);
    let log = vec![record(0, 0, "k")];
    let (task, unit, context) = first_unit(&mut s, 0, &log, now);
    // Thread 0 fails the record and has appended it to the retry topic; the
    // retry topic is read by thread 1 before thread 0 completes its unit.
    let item = failed_item(&log[0], 0);
    s.notify_append(task, false, 0);
    match s.pick(1, now, 1_000) {
        Pick::RetryFetch { task, generation, .. } => {
            s.finish_retry_fetch(1, task, generation, Ok(vec![item]))
        }
        _ => panic!("the retry topic has news"),
    }
    for _ in 0..3 {
        match s.pick(1, now, 1_000) {
            Pick::Retry { .. } => panic!("the retry ran before the record's RETRYING outcome was out"),
            Pick::Wait(_) => {}
            Pick::RetryFetch { task, generation, .. } => {
                s.finish_retry_fetch(1, task, generation, Ok(Vec::new()))
            }
            Pick::Fetch { task, generation, .. } => s.finish_fetch(1, task, generation, Ok(Vec::new()), now),
            _ => {}
        }
    }
    let mut failed = processed(&context, &unit.records);
    failed[0].outcome = Outcome::Retrying;
    let retry_keys = vec![Bytes::from_static(b"k")];
    let _ = s.finish_unit(
        0,
        task,
        UnitDone {
            lane: unit.lane,
            drains: unit.drains.clone(),
            outcomes: failed,
            returned: Vec::new(),
            retry_keys,
            outputs: Vec::new(),
        },
    );
    assert!(
        matches!(s.pick(1, now, 1_000), Pick::Retry { .. }),
        "due now that RETRYING is published"
    );
}

#[test]
fn key_order_holds_a_failed_keys_later_records_until_its_retry_is_final() {
    let now = Instant::now();
    let mut s = one_task(2, ProcessingOrder::Key, 2, 10, now);
    let first = vec![record(0, 0, "k")];
    let (task, unit, context) = first_unit(&mut s, 0, &first, now);
    let mut failed = processed(&context, &unit.records);
    failed[0].outcome = Outcome::Retrying;
    let _ = s.finish_unit(
        0,
        task,
        UnitDone {
            lane: unit.lane,
            drains: unit.drains.clone(),
            outcomes: failed,
            returned: Vec::new(),
            retry_keys: vec![Bytes::from_static(b"k")],
            outputs: Vec::new(),
        },
    );
    // Two more records of `k` arrive: held, not handed out, not parked.
    let log = vec![record(0, 0, "k"), record(0, 1, "k"), record(0, 2, "k")];
    s.notify_append(task, true, 0);
    no_unit_for(&mut s, 0, &log, now, "held while k is on the retry path");
    assert_eq!(s.task(task).unwrap().held(), 2);
    assert_eq!(
        s.task(task).unwrap().watermark(),
        1,
        "held records are not completed"
    );
    // The retry of offset 0 succeeds: the thread that ran it runs k's held
    // records next, in order, without a pick.
    let (unit, context) = retry_succeeds(&mut s, 1, task, failed_item(&first[0], 0), now)
        .expect("k's held records, for thread 1");
    assert_eq!(offsets(&unit), vec![1, 2]);
    assert!(unit.park.is_empty());
    assert_eq!(s.task(task).unwrap().held(), 0);
    // While they run, k stays gated: a later record of it is held, not handed out.
    let log = [log, vec![record(0, 3, "k")]].concat();
    s.notify_append(task, true, 0);
    no_unit_for(&mut s, 0, &log, now, "k's earlier records are running");
    assert_eq!(s.task(task).unwrap().held(), 1);
    let _ = s.finish_unit(1, task, done(&context, &unit));
    assert_eq!(s.task(task).unwrap().watermark(), 3);
    // Back: k opens, and what it held meanwhile runs.
    let (task, unit, context) = first_unit(&mut s, 0, &log, now);
    assert_eq!(offsets(&unit), vec![3]);
    let _ = s.finish_unit(0, task, done(&context, &unit));
    assert_eq!(s.task(task).unwrap().watermark(), 4);
}

/// A redriven dead letter joins the retry path from outside the task's
/// units: its key is gated for it as for a failed record, so when it
/// finishes the key stays gated for a later failure of the key still waiting.
#[test]
fn a_redriven_entry_counts_on_its_keys_gate_and_opens_only_its_own_share() {
    let now = Instant::now();
    let mut s = one_task(2, ProcessingOrder::Key, 2, 10, now);
    let task = s.task_index(PIPELINE, 0).expect("the task");
    let k = Bytes::from_static(b"k");
    // k@0 is out in a unit when a redrive gates k and appends its entry
    // (retry offset 0); then k@0 fails (entry 1, due later), and k@1 is held.
    let log = vec![record(0, 0, "k"), record(0, 1, "k")];
    let (_, unit, context) = first_unit(&mut s, 0, &log[..1], now);
    s.gate_retry_keys(PIPELINE, 0, std::slice::from_ref(&k));
    fail_first(&mut s, 0, task, &unit, &context);
    s.notify_append(task, true, 0);
    no_unit_for(&mut s, 0, &log, now, "k is gated");
    assert_eq!(s.task(task).unwrap().held(), 1);
    let mut redriven = failed_item(&record(0, 0, "k"), 0);
    redriven.failure.attempts = 0;
    let mut failed = failed_item(&log[0], 1);
    failed.due_ms = 60_000;
    s.notify_append(task, false, 0);
    let mut next = None;
    for _ in 0..10 {
        match s.pick(1, now, 1_000) {
            Pick::RetryFetch { task, generation, .. } => {
                s.finish_retry_fetch(1, task, generation, Ok(vec![redriven.clone(), failed.clone()]));
            }
            Pick::Retry { task, items, context } => {
                assert_eq!(items.len(), 1, "only the redriven entry is due");
                let (_, drained) = s.finish_retries(
                    1,
                    task,
                    RetriesDone {
                        finished: vec![(0, 0, Some(k.clone()))],
                        again: Vec::new(),
                        outcomes: processed(&context, &[items[0].record.clone()]),
                        outputs: Vec::new(),
                    },
                );
                next = Some(drained.is_none());
                break;
            }
            _ => {}
        }
    }
    assert_eq!(next, Some(true), "the redriven entry finished; k stays gated");
    assert_eq!(s.task(task).unwrap().held(), 1, "k@1 waits for k@0's retry");
    no_unit_for(&mut s, 0, &log, now, "k is still gated");
}

fn offsets(unit: &WorkUnit) -> Vec<u64> {
    unit.records.iter().map(|r| r.offset).collect()
}

/// Fails `unit`'s first record (retrying, its key gated) and hands the rest
/// back untouched, as a unit whose key failed does in `key` order.
fn fail_first(s: &mut Scheduler, thread: usize, task: usize, unit: &WorkUnit, context: &UnitContext) {
    let mut outcomes = processed(context, &unit.records[..1]);
    outcomes[0].outcome = Outcome::Retrying;
    let _ = s.finish_unit(
        thread,
        task,
        UnitDone {
            lane: unit.lane,
            drains: unit.drains.clone(),
            outcomes,
            returned: unit.records[1..].to_vec(),
            retry_keys: unit.records[0].key.iter().cloned().collect(),
            outputs: Vec::new(),
        },
    );
}

#[test]
fn a_failed_keys_returned_records_wait_at_the_gate_and_run_after_its_retry() {
    let now = Instant::now();
    let mut s = one_task(2, ProcessingOrder::Key, 2, 10, now);
    // 24 queued: a unit takes 24 / (T × 4) = 3 of them.
    let log: Vec<Record> = (0..24).map(|o| record(0, o, "k")).collect();
    let (task, unit, context) = first_unit(&mut s, 0, &log, now);
    assert_eq!(offsets(&unit), vec![0, 1, 2]);
    fail_first(&mut s, 0, task, &unit, &context);
    // Records 1 and 2 went straight to the gate, not back to their lane.
    assert_eq!(s.task(task).unwrap().held(), 2);
    // The retry succeeds: the unit of held records has them first, then
    // what the gate took from the lane since, in offset order, up to
    // `max_batch_records` (10).
    let (unit, context) =
        retry_succeeds(&mut s, 1, task, failed_item(&log[0], 0), now).expect("the held records");
    assert_eq!(offsets(&unit), (1..=10).collect::<Vec<_>>());
    // Its first record fails again: the rest goes back in front of what the
    // gate took meanwhile, and the key stays gated.
    let log = [log, vec![record(0, 24, "k")]].concat();
    s.notify_append(task, true, 0);
    no_unit_for(&mut s, 0, &log, now, "k is gated: held");
    fail_first(&mut s, 1, task, &unit, &context);
    assert_eq!(
        s.task(task).unwrap().held(),
        23,
        "2..=24 wait behind the retry of 1"
    );
    let (unit, context) =
        retry_succeeds(&mut s, 1, task, failed_item(&log[1], 1), now).expect("the held records");
    assert_eq!(offsets(&unit), (2..=11).collect::<Vec<_>>(), "in offset order");
    let _ = s.finish_unit(1, task, done(&context, &unit));
    // k opened: what did not fit in the unit goes to its lane, in order.
    assert_eq!(s.task(task).unwrap().held(), 0);
    let mut ran = Vec::new();
    while let Some((task, unit, context)) = pick_unit(&mut s, 0, &log, now) {
        ran.extend(offsets(&unit));
        let _ = s.finish_unit(0, task, done(&context, &unit));
    }
    assert_eq!(ran, (12..=24).collect::<Vec<_>>());
    assert_eq!(s.task(task).unwrap().watermark(), 25);
}

#[test]
fn without_room_for_another_unit_held_records_go_back_to_their_lane() {
    let now = Instant::now();
    // T = 2 and three threads: two units run while the third runs the retry.
    let mut s = one_task(3, ProcessingOrder::Key, 2, 1, now);
    let keys = ["k", "k", "k", "a", "b", "c", "d"];
    let log: Vec<Record> = (0..7).map(|o| record(0, o, keys[o as usize])).collect();
    // Units of one record; k's lane is the longest, so it goes first.
    let (task, unit, context) = first_unit(&mut s, 0, &log, now);
    assert_eq!(offsets(&unit), vec![0]);
    fail_first(&mut s, 0, task, &unit, &context);
    let busy: Vec<_> = (0..2)
        .map(|thread| first_unit(&mut s, thread, &log, now))
        .collect();
    assert_eq!(s.task(task).unwrap().held(), 2, "k's lane was cut: 1 and 2 held");
    assert_eq!(s.task(task).unwrap().active(), 2);
    let next = retry_succeeds(&mut s, 2, task, failed_item(&log[0], 0), now);
    assert!(next.is_none(), "the task has T units running");
    assert_eq!(s.task(task).unwrap().held(), 0, "back to the lane");
    for (thread, (task, unit, context)) in busy.into_iter().enumerate() {
        let _ = s.finish_unit(thread, task, done(&context, &unit));
    }
    let mut ran = Vec::new();
    while let Some((task, unit, context)) = pick_unit(&mut s, 0, &log, now) {
        ran.extend(offsets(&unit));
        let _ = s.finish_unit(0, task, done(&context, &unit));
    }
    let of_k: Vec<u64> = ran.iter().copied().filter(|&o| o < 3).collect();
    assert_eq!(of_k, vec![1, 2], "k's records ran once each, in order");
}

#[test]
fn a_dead_threads_unit_goes_back_and_its_tasks_move_to_the_replacement() {
    let now = Instant::now();
    let mut s = one_task(1, ProcessingOrder::Offset, 1, 100, now);
    let log: Vec<Record> = (0..5).map(|o| record(0, o, "k")).collect();
    let (task, unit, context) = first_unit(&mut s, 0, &log, now);
    s.return_unit(0, task, unit);
    let replacement = s.thread_exited(0, true).expect("a dead thread is replaced");
    assert_eq!(s.task(task).unwrap().owner(), replacement);
    let (task, unit, _) = pick_unit(&mut s, replacement, &log, now).expect("the unit is still there");
    assert_eq!(unit.records.len(), 5);
    let _ = s.finish_unit(replacement, task, done(&context, &unit));
    assert_eq!(s.task(task).unwrap().watermark(), 5);
}

#[test]
fn a_removed_task_drops_what_is_queued_and_leaves_once_its_units_are_back() {
    let now = Instant::now();
    let mut s = scheduler(now);
    s.add_thread();
    s.add_thread();
    let t = s.add_task(init(0, ProcessingOrder::Unordered, 2, 0, 5));
    let log: Vec<Record> = (0..100).map(|o| record(0, o, &format!("k{o}"))).collect();
    let (task, unit, context) = first_unit(&mut s, 0, &log, now);
    assert_eq!(task, t);
    let dropped = s.begin_removal(t);
    assert!(dropped > 0);
    assert!(s.detach_if_idle(t).is_none(), "a unit is still out");
    assert!(
        pick_unit(&mut s, 1, &log, now).is_none(),
        "no new work for a leaving task"
    );
    let _ = s.finish_unit(0, task, done(&context, &unit));
    let gone = s.detach_if_idle(t).expect("idle now");
    assert_eq!(
        gone.watermark(),
        unit.records.len() as u64,
        "the exact completed prefix"
    );
    assert_eq!(s.task_index(PIPELINE, 0), None);
}

/// An untagged persistent store (T = 1) commits while its task is idle: a
/// round that finds the task busy leaves the commit waiting, and the unit
/// that makes the task idle hands it out. Until that commit is frozen, a
/// later round hands out no second one: frozen after the first had let units
/// run again, it would take their (untracked) writes under its older
/// watermark, and a crash before the next commit would apply them twice.
#[test]
fn a_commit_waiting_for_an_idle_task_is_handed_out_once_until_it_is_frozen() {
    let dir = crate::scratch::scratch_dir("scheduler-commit").expect("scratch dir");
    let now = Instant::now();
    let mut s = scheduler(now);
    s.add_thread();
    s.add_thread();
    let mut persistent = init(0, ProcessingOrder::Offset, 1, 0, 10);
    persistent.store = Arc::new(
        TaskStore::open_persistent(dir.path(), "app", "p_0", crate::store::DEFAULT_CACHE_BYTES)
            .expect("store"),
    );
    let t = s.add_task(persistent);
    let log: Vec<Record> = (0..30).map(|o| record(0, o, "k")).collect();
    let (_, unit, context) = first_unit(&mut s, 0, &log, now);
    assert!(s.finish_unit(0, t, done(&context, &unit)).is_none());
    let (_, unit, context) = first_unit(&mut s, 0, &log, now);
    let round = |s: &mut Scheduler, hours: u64| {
        let Pick::Commit { items, .. } = s.pick(1, now + Duration::from_secs(3_600 * hours), 0) else {
            panic!("a commit round was due");
        };
        s.finish_commit_round(1);
        items.iter().map(|item| item.offset).collect::<Vec<_>>()
    };
    assert_eq!(round(&mut s, 2), Vec::<u64>::new(), "busy: the commit waits");
    let waiting = s.finish_unit(0, t, done(&context, &unit)).expect("idle: it goes");
    assert_eq!(waiting.offset, 20);
    assert_eq!(round(&mut s, 4), Vec::<u64>::new(), "that one is being frozen");
    assert!(
        pick_unit(&mut s, 0, &log, now).is_none(),
        "no unit runs meanwhile"
    );
    s.frozen(&waiting, FreezeResult::Frozen);
    let (_, unit, _) = first_unit(&mut s, 0, &log, now);
    assert_eq!(unit.records[0].offset, 20, "frozen: the task goes on");
}

#[test]
fn records_left_uncommitted_past_the_threshold_are_reported_with_what_holds_them_back() {
    let now = Instant::now();
    let threshold = Duration::from_secs(30);
    let mut s = one_task(2, ProcessingOrder::Offset, 1, 10, now);
    let log: Vec<Record> = (0..10).map(|o| record(0, o, "k")).collect();
    assert!(
        s.commit_stalls(now, threshold).tasks.is_empty(),
        "nothing uncommitted"
    );
    let (t, unit, context) = first_unit(&mut s, 0, &log, now);
    assert!(s.finish_unit(0, t, done(&context, &unit)).is_none());
    // The first sample starts the clock; a later one past the threshold reports.
    assert!(s.commit_stalls(now, threshold).tasks.is_empty());
    assert!(
        s.commit_stalls(now + Duration::from_secs(29), threshold)
            .tasks
            .is_empty()
    );
    // A commit round taken and never finished: reported as such, its task too.
    let later = now + Duration::from_secs(3_600);
    let Pick::Commit { items, .. } = s.pick(1, later, 0) else {
        panic!("a commit round was due");
    };
    assert_eq!(items.len(), 1);
    let stalls = s.commit_stalls(later + Duration::from_secs(31), threshold);
    assert_eq!(
        stalls
            .round
            .map(|(running, thread)| (running, thread.to_string())),
        Some((Duration::from_secs(31), "app-StreamThread-2".to_string()))
    );
    assert_eq!(stalls.tasks.len(), 1);
    assert_eq!((stalls.tasks[0].watermark, stalls.tasks[0].committed), (10, 0));
    assert_eq!(stalls.tasks[0].blocker, CommitBlocker::NotHandedOut);
    s.finish_commit_round(1);
    s.commit_applied(&items[0], true, later);
    let stalls = s.commit_stalls(later + Duration::from_secs(40), threshold);
    assert_eq!(stalls, CommitStalls::default(), "committed: no stall, no round");
}

#[test]
fn a_unit_is_cut_short_by_time_and_the_rest_runs_next_in_order() {
    let now = Instant::now();
    let mut s = one_task(1, ProcessingOrder::Offset, 1, 100, now);
    let log: Vec<Record> = (0..10).map(|o| record(0, o, "k")).collect();
    let (task, unit, context) = first_unit(&mut s, 0, &log, now);
    let (ran, rest) = unit.records.split_at(3);
    let _ = s.finish_unit(
        0,
        task,
        UnitDone {
            lane: unit.lane,
            drains: unit.drains.clone(),
            outcomes: processed(&context, ran),
            returned: rest.to_vec(),
            retry_keys: Vec::new(),
            outputs: Vec::new(),
        },
    );
    assert_eq!(s.task(task).unwrap().watermark(), 3);
    let (_, next, _) = pick_unit(&mut s, 0, &log, now).expect("the rest");
    assert_eq!(next.records.first().map(|r| r.offset), Some(3));
}

fn failed_item(record: &Record, retry_offset: u64) -> RetryItem {
    RetryItem {
        retry_offset,
        record: record.clone(),
        failure: Failure {
            kind: "Boom".into(),
            message: "failed".into(),
            attempts: 1,
            first_failure_ms: 0,
            last_failure_ms: 0,
        },
        due_ms: 0,
        marker: false,
    }
}

/// Thread `thread` reads `item` from the retry topic, runs it and succeeds.
/// Answers the unit of held records the thread is to run next, if any.
fn retry_succeeds(
    s: &mut Scheduler,
    thread: usize,
    task: usize,
    item: RetryItem,
    now: Instant,
) -> Option<(WorkUnit, UnitContext)> {
    s.notify_append(task, false, 0);
    let mut item = Some(item);
    for _ in 0..10 {
        match s.pick(thread, now, 1_000) {
            Pick::RetryFetch { task, generation, .. } => {
                s.finish_retry_fetch(thread, task, generation, Ok(item.take().into_iter().collect()));
            }
            Pick::Retry { task, items, context } => {
                let finished = items
                    .iter()
                    .map(|i| (i.retry_offset, i.record.offset, i.record.key.clone()))
                    .collect();
                let outcomes = items
                    .iter()
                    .map(|i| processed(&context, std::slice::from_ref(&i.record))[0].clone())
                    .collect();
                let (_, next) = s.finish_retries(
                    thread,
                    task,
                    RetriesDone {
                        finished,
                        again: Vec::new(),
                        outcomes,
                        outputs: Vec::new(),
                    },
                );
                return next;
            }
            Pick::Fetch { task, generation, .. } => {
                s.finish_fetch(thread, task, generation, Ok(Vec::new()), now)
            }
            Pick::Commit { .. } => s.finish_commit_round(thread),
            _ => {}
        }
    }
    panic!("the retry never ran");
}

// ---- the model-based property test ----

#[derive(Debug, Clone)]
enum Op {
    Pick(usize),
    Complete(usize),
    /// Complete only the first `n` records; the rest go back (time limit).
    CompletePart(usize, usize),
    Crash(usize),
    AddThread,
    StopThread(usize),
    AddTask(u32),
    RemoveTask(u32),
    Append(u32, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0usize..8).prop_map(Op::Pick),
        6 => (0usize..8).prop_map(Op::Complete),
        2 => (0usize..8, 0usize..4).prop_map(|(u, n)| Op::CompletePart(u, n)),
        1 => (0usize..8).prop_map(Op::Crash),
        1 => Just(Op::AddThread),
        1 => (0usize..8).prop_map(Op::StopThread),
        1 => (0u32..3).prop_map(Op::AddTask),
        1 => (0u32..3).prop_map(Op::RemoveTask),
        3 => (0u32..3, 1u8..20).prop_map(|(p, n)| Op::Append(p, n)),
    ]
}

struct Running {
    thread: usize,
    task: usize,
    unit: WorkUnit,
    context: UnitContext,
}

/// Per partition: the log and what the current incarnation of its task completed.
#[derive(Default)]
struct PartitionModel {
    log: Vec<Record>,
    /// Where the current task started (its previous incarnation's watermark).
    start: u64,
    completed: BTreeMap<u64, u32>,
    hosted: bool,
    removing: Option<usize>,
}

struct Model {
    s: Scheduler,
    now: Instant,
    order: ProcessingOrder,
    t: usize,
    live: Vec<usize>,
    running: Vec<Running>,
    partitions: Vec<PartitionModel>,
    keys: u8,
}

impl Model {
    fn new(order: ProcessingOrder, t: usize, threads: usize, keys: u8) -> Model {
        let now = Instant::now();
        let mut s = scheduler(now);
        let live = (0..threads).map(|_| s.add_thread()).collect();
        let mut model = Model {
            s,
            now,
            order,
            t,
            live,
            running: Vec::new(),
            partitions: (0..3).map(|_| PartitionModel::default()).collect(),
            keys,
        };
        model.add_task(0);
        model
    }

    fn add_task(&mut self, partition: u32) {
        let p = &mut self.partitions[partition as usize];
        if p.hosted || p.removing.is_some() {
            return;
        }
        p.hosted = true;
        p.completed.clear();
        self.s.add_task(init(partition, self.order, self.t, p.start, 4));
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Pick(i) => {
                let thread = self.live[i % self.live.len()];
                if self.running.iter().any(|r| r.thread == thread) {
                    return;
                }
                let now = self.now;
                match self.s.pick(thread, now, 0) {
                    Pick::Unit { task, unit, context } => self.running.push(Running {
                        thread,
                        task,
                        unit,
                        context,
                    }),
                    Pick::Fetch {
                        task,
                        from,
                        max,
                        generation,
                        context,
                    } => {
                        let log = &self.partitions[context.partition as usize].log;
                        let records = log
                            .iter()
                            .filter(|r| r.offset >= from)
                            .take(max)
                            .cloned()
                            .collect();
                        self.s.finish_fetch(thread, task, generation, Ok(records), now);
                    }
                    Pick::RetryFetch { task, generation, .. } => {
                        self.s
                            .finish_retry_fetch(thread, task, generation, Ok(Vec::new()));
                    }
                    Pick::Commit { items, .. } => {
                        for item in &items {
                            self.s.commit_applied(item, true, self.now);
                        }
                        self.s.finish_commit_round(thread);
                    }
                    Pick::Retry { .. } | Pick::Restore { .. } => unreachable!("nothing fails here"),
                    Pick::Wait(_) | Pick::Exit => {}
                }
            }
            Op::Complete(i) | Op::CompletePart(i, _) if !self.running.is_empty() => {
                let Running {
                    thread,
                    task,
                    unit,
                    context,
                } = self.running.remove(i % self.running.len());
                let ran = match op {
                    Op::CompletePart(_, n) => n.clamp(1, unit.records.len()),
                    _ => unit.records.len(),
                };
                let (done_records, rest) = unit.records.split_at(ran);
                for r in done_records {
                    *self.partitions[r.partition as usize]
                        .completed
                        .entry(r.offset)
                        .or_default() += 1;
                }
                let _ = self.s.finish_unit(
                    thread,
                    task,
                    UnitDone {
                        lane: unit.lane,
                        drains: unit.drains.clone(),
                        outcomes: processed(&context, done_records),
                        returned: rest.to_vec(),
                        retry_keys: Vec::new(),
                        outputs: Vec::new(),
                    },
                );
            }
            Op::Crash(i) if !self.running.is_empty() => {
                let Running {
                    thread, task, unit, ..
                } = self.running.remove(i % self.running.len());
                self.s.return_unit(thread, task, unit);
                self.live.retain(|&l| l != thread);
                if let Some(replacement) = self.s.thread_exited(thread, true) {
                    self.live.push(replacement);
                }
            }
            Op::AddThread => {
                if self.live.len() < 8 {
                    let slot = self.s.add_thread();
                    self.live.push(slot);
                }
            }
            Op::StopThread(i) => {
                let thread = self.live[i % self.live.len()];
                if self.live.len() > self.t && !self.running.iter().any(|r| r.thread == thread) {
                    self.s.stop_thread(thread);
                    assert!(matches!(self.s.pick(thread, self.now, 0), Pick::Exit));
                    assert_eq!(self.s.thread_exited(thread, false), None);
                    self.live.retain(|&l| l != thread);
                }
            }
            Op::AddTask(p) => self.add_task(p),
            Op::RemoveTask(p) => {
                let model = &mut self.partitions[p as usize];
                if model.hosted
                    && model.removing.is_none()
                    && let Some(index) = self.s.task_index(PIPELINE, p)
                {
                    self.s.begin_removal(index);
                    model.removing = Some(index);
                }
            }
            Op::Append(p, n) => {
                let keys = self.keys;
                let model = &mut self.partitions[p as usize];
                let next = model.log.len() as u64;
                for o in next..next + u64::from(n) {
                    let key = format!("k{}", o % u64::from(keys));
                    model.log.push(record(p, o, &key));
                }
                if let Some(index) = self.s.task_index(PIPELINE, p) {
                    self.s.notify_append(index, true, 0);
                }
            }
            Op::Complete(_) | Op::CompletePart(..) | Op::Crash(_) => {}
        }
        self.detach_removed();
        self.check();
    }

    fn detach_removed(&mut self) {
        for p in 0..self.partitions.len() {
            let Some(index) = self.partitions[p].removing else {
                continue;
            };
            if let Some(task) = self.s.detach_if_idle(index) {
                let model = &mut self.partitions[p];
                let prefix = prefix_of(model.start, &model.completed);
                assert_eq!(
                    task.watermark(),
                    prefix,
                    "a leaving task commits exactly its completed prefix"
                );
                model.start = prefix;
                model.hosted = false;
                model.removing = None;
            }
        }
    }

    fn check(&self) {
        for (index, task) in self.s.tasks() {
            let units: Vec<&Running> = self.running.iter().filter(|r| r.task == index).collect();
            assert!(units.len() <= self.t, "more than T threads inside a task");
            assert_eq!(task.active(), units.len());
            let mut offsets = BTreeSet::new();
            let mut keys = BTreeSet::new();
            for unit in &units {
                for r in &unit.unit.records {
                    assert!(offsets.insert(r.offset), "offset {} out in two units", r.offset);
                    if self.t > 1 && self.order != ProcessingOrder::Unordered {
                        keys.insert(r.key.clone());
                    }
                }
                if self.t > 1 && self.order != ProcessingOrder::Unordered {
                    let mine: BTreeSet<_> = unit.unit.records.iter().map(|r| r.key.clone()).collect();
                    let others: usize = units
                        .iter()
                        .filter(|u| !std::ptr::eq(**u, *unit))
                        .filter(|u| u.unit.records.iter().any(|r| mine.contains(&r.key)))
                        .count();
                    assert_eq!(others, 0, "one key in two units at once");
                }
            }
            let model = &self.partitions[task.partition() as usize];
            for (offset, count) in &model.completed {
                assert_eq!(*count, 1, "offset {offset} completed twice");
                assert!(
                    !offsets.contains(offset),
                    "offset {offset} out again after completing"
                );
            }
            assert_eq!(task.watermark(), prefix_of(model.start, &model.completed));
            // Every fetched offset is queued, held, out in a unit, or completed.
            let completed_above = model.completed.keys().filter(|&&o| o >= task.watermark()).count();
            if !task.is_removing() {
                assert_eq!(task.pending(), task.queued() + task.held() + offsets.len());
                assert_eq!(task.in_flight() - task.pending(), completed_above);
            }
        }
    }

    /// Runs everything to the end: every appended record completed exactly once.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            // Tasks still leaving come back once gone.
            for p in 0..3 {
                self.add_task(p);
            }
            for i in 0..self.live.len() {
                self.apply(Op::Pick(i));
            }
            if !self.running.is_empty() {
                self.apply(Op::Complete(0));
            }
            let done = self.partitions.iter().enumerate().all(|(p, model)| {
                self.s
                    .task_index(PIPELINE, p as u32)
                    .and_then(|t| self.s.task(t))
                    .is_some_and(|t| t.watermark() == model.log.len() as u64)
            });
            if done && self.running.is_empty() {
                return;
            }
        }
        let state: Vec<String> = self
            .s
            .tasks()
            .map(|(i, t)| {
                format!(
                    "task {i} p{} wm {} log {} pending {} queued {} held {} active {} can_fetch {} removing {}",
                    t.partition(),
                    t.watermark(),
                    self.partitions[t.partition() as usize].log.len(),
                    t.pending(),
                    t.queued(),
                    t.held(),
                    t.active(),
                    t.can_fetch(self.now),
                    t.is_removing()
                )
            })
            .collect();
        panic!(
            "the scheduler stopped making progress: {state:#?}, live {:?}",
            self.live
        );
    }
}

fn prefix_of(start: u64, completed: &BTreeMap<u64, u32>) -> u64 {
    let mut prefix = start;
    while completed.contains_key(&prefix) {
        prefix += 1;
    }
    prefix
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random interleavings of pick / complete (whole or in part) / thread
    /// death / thread added and removed / task added and removed / appends:
    /// at most T threads in a task, never one key in two units (key lanes),
    /// no offset out twice, the watermark exactly the completed prefix, a
    /// removed task's watermark its exact prefix, and in the end every
    /// record completed exactly once per task incarnation.
    #[test]
    fn invariants_hold_for_random_interleavings(
        order in prop_oneof![Just(ProcessingOrder::Offset), Just(ProcessingOrder::Key), Just(ProcessingOrder::Unordered)],
        t in 1usize..4,
        extra in 0usize..3,
        keys in 1u8..6,
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let mut model = Model::new(order, t, t + extra, keys);
        for op in ops {
            model.apply(op);
        }
        model.drain();
    }
}
