//! The behaviour every `Log` implementation shares, as test functions over
//! `&dyn Log`: each backend's tests run them, then check what is its own
//! (durability across a reopen, files on disk).

use super::{Log, LogError, ProducerRecord, RecordPosition};

/// Keyed records go to Kafka's default partition for their key; offsets grow
/// per partition; reads respect `max` and the end; bad names are errors.
pub(super) fn keyed_records_follow_kafkas_partitioner(log: &dyn Log) {
    log.ensure_topic("t", 8).unwrap();
    let positions = log
        .append(
            "t",
            vec![
                ProducerRecord::keyed("a", "1"),
                ProducerRecord::keyed("key", "2"),
                ProducerRecord::keyed("a", "3"),
            ],
        )
        .unwrap();
    // From shared/testdata: "a" → 4 and "key" → 1 among 8 partitions.
    let at = |partition, offset| RecordPosition { partition, offset };
    assert_eq!(positions, vec![at(4, 0), at(1, 0), at(4, 1)]);
    let mut out = Vec::new();
    log.read("t", 4, 1, 10, &mut out).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].value, "3");
    assert_eq!(out[0].offset, 1);
    assert_eq!(out[0].partition, 4);
    assert_eq!(log.end_offset("t", 4).unwrap(), 2);
    out.clear();
    log.read("t", 4, 0, 1, &mut out).unwrap();
    assert_eq!(out.len(), 1, "max is respected");
    out.clear();
    log.read("t", 4, 2, 10, &mut out).unwrap();
    log.read("t", 0, 0, 10, &mut out).unwrap();
    assert!(out.is_empty(), "at or past the end yields nothing");
    assert!(matches!(
        log.read("t", 8, 0, 10, &mut out),
        Err(LogError::UnknownPartition {
            partition: 8,
            partitions: 8,
            ..
        })
    ));
    assert!(matches!(log.end_offset("u", 0), Err(LogError::UnknownTopic(_))));
}

/// Unkeyed records are spread round-robin; a batch with a bad partition is
/// rejected whole; an unknown topic is an error.
pub(super) fn unkeyed_records_are_spread_and_bad_batches_rejected_whole(log: &dyn Log) {
    log.ensure_topic("t", 4).unwrap();
    let records = (0..8).map(|i| ProducerRecord {
        value: format!("{i}").into(),
        ..Default::default()
    });
    let positions = log.append("t", records.collect()).unwrap();
    for p in 0..4 {
        assert_eq!(positions.iter().filter(|pos| pos.partition == p).count(), 2);
    }
    let bad = vec![
        ProducerRecord::keyed("x", "1"),
        ProducerRecord {
            partition: Some(9),
            ..Default::default()
        },
    ];
    assert!(matches!(
        log.append("t", bad),
        Err(LogError::UnknownPartition { partition: 9, .. })
    ));
    let total: u64 = (0..4).map(|p| log.end_offset("t", p).unwrap()).sum();
    assert_eq!(total, 8, "nothing of the rejected batch was written");
    assert!(matches!(
        log.append("nope", vec![]),
        Err(LogError::UnknownTopic(_))
    ));
    assert_eq!(log.append("t", vec![]).unwrap(), vec![]);
}

/// Committed offsets are kept per group and partition; a topic keeps its
/// partition count.
pub(super) fn commits_are_per_group_and_partition(log: &dyn Log) {
    log.ensure_topic("t", 2).unwrap();
    assert_eq!(log.committed("g", "t", 0).unwrap(), None);
    log.commit("g", "t", 0, 42).unwrap();
    log.commit("g", "t", 1, 7).unwrap();
    log.commit("g", "t", 1, 8).unwrap();
    assert_eq!(log.committed("g", "t", 0).unwrap(), Some(42));
    assert_eq!(log.committed("g", "t", 1).unwrap(), Some(8));
    assert_eq!(log.committed("h", "t", 0).unwrap(), None);
    assert!(matches!(
        log.ensure_topic("t", 3),
        Err(LogError::PartitionCountMismatch {
            existing: 2,
            requested: 3,
            ..
        })
    ));
    assert!(matches!(
        log.commit("g", "t", 2, 1),
        Err(LogError::UnknownPartition { .. })
    ));
    assert!(matches!(
        log.commit("g", "u", 0, 1),
        Err(LogError::UnknownTopic(_))
    ));
}
