//! The application's instances as one instance sees them (Kafka mode): who
//! holds which active partitions of which pipeline. Each instance publishes an
//! [`InstanceRecord`] to the compacted `<application_id>-metadata` topic,
//! keyed by its `host:port`, after every rebalance (an empty value when it
//! stops); every instance applies the topic's records, in order, to its
//! [`ClusterView`]. No I/O here: the runtime's `cluster` module moves the records.

use super::HostInfo;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Version of the record format; a record of another version is skipped.
const RECORD_VERSION: u32 = 1;

/// What one instance publishes about itself: the value of its record in the
/// metadata topic (the key is [`InstanceRecord::key`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceRecord {
    version: u32,
    /// Where the instance answers gRPC (its `application_server`).
    pub host: String,
    pub port: u16,
    /// The group generation (classic) or member epoch (KIP-848) the
    /// instance had when it published: a partition claimed by two records
    /// (one not yet updated after the partition moved) is the newer one's.
    pub generation: i32,
    /// Pipeline → the partitions the instance runs active tasks for.
    pub partitions: BTreeMap<String, BTreeSet<u32>>,
}

/// A record of the metadata topic that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("metadata record is not UTF-8 TOML: {0}")]
    Malformed(String),
    #[error("metadata record has format version {found}; this instance reads version {RECORD_VERSION}")]
    Version { found: u32 },
}

impl InstanceRecord {
    pub fn new(host: &HostInfo, generation: i32, partitions: BTreeMap<String, BTreeSet<u32>>) -> Self {
        InstanceRecord {
            version: RECORD_VERSION,
            host: host.host.clone(),
            port: host.port,
            generation,
            partitions,
        }
    }

    pub fn host_info(&self) -> HostInfo {
        HostInfo {
            host: self.host.clone(),
            port: self.port,
        }
    }

    /// The record's key in the metadata topic: the instance's `host:port`,
    /// so a restarted instance replaces its old record and compaction keeps
    /// one per address.
    pub fn key(&self) -> String {
        self.host_info().to_string()
    }

    /// The record's value: TOML, readable with Kafka's console consumer.
    pub fn encode(&self) -> Bytes {
        // A struct of strings, integers and maps of sets always serializes.
        Bytes::from(toml::to_string(self).unwrap_or_default())
    }

    pub fn decode(value: &[u8]) -> Result<InstanceRecord, RecordError> {
        let text = std::str::from_utf8(value).map_err(|e| RecordError::Malformed(e.to_string()))?;
        let record: InstanceRecord =
            toml::from_str(text).map_err(|e| RecordError::Malformed(e.to_string()))?;
        if record.version != RECORD_VERSION {
            return Err(RecordError::Version {
                found: record.version,
            });
        }
        Ok(record)
    }
}

/// Who holds what, from the metadata topic's records.
///
/// Invariant: `owners[(pipeline, partition)]` is the key of the instance
/// whose latest record claims that partition with the highest
/// (generation, key) among all claimants, and has no entry when no latest
/// record claims it. So owners are disjoint by construction, even while a
/// record published before its partitions moved is still the latest of its
/// instance.
#[derive(Debug, Default, Clone)]
pub struct ClusterView {
    /// The latest record of every instance, by key.
    instances: BTreeMap<String, InstanceRecord>,
    owners: BTreeMap<(String, u32), String>,
}

impl ClusterView {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies the record of `key` read from the topic; `None` (an empty
    /// value) is the instance leaving.
    pub fn apply(&mut self, key: &str, record: Option<InstanceRecord>) {
        let mut touched: BTreeSet<(String, u32)> = BTreeSet::new();
        if let Some(old) = self.instances.remove(key) {
            touched.extend(claims(&old));
        }
        if let Some(record) = record {
            touched.extend(claims(&record));
            self.instances.insert(key.to_string(), record);
        }
        for claim in touched {
            match self.resolve(&claim) {
                Some(owner) => self.owners.insert(claim, owner),
                None => self.owners.remove(&claim),
            };
        }
    }

    /// The claimant of one partition with the highest (generation, key).
    fn resolve(&self, (pipeline, partition): &(String, u32)) -> Option<String> {
        self.instances
            .iter()
            .filter(|(_, r)| {
                r.partitions
                    .get(pipeline)
                    .is_some_and(|ps| ps.contains(partition))
            })
            .max_by_key(|(key, r)| (r.generation, key.as_str()))
            .map(|(key, _)| key.clone())
    }

    /// The instance holding `partition` of `pipeline`, if any claims it.
    pub fn owner(&self, pipeline: &str, partition: u32) -> Option<&InstanceRecord> {
        let key = self.owners.get(&(pipeline.to_string(), partition))?;
        self.instances.get(key)
    }

    /// Every instance holding partitions of `pipeline`, with the partitions
    /// it holds (disjoint across instances, sorted), by key.
    pub fn holders(&self, pipeline: &str) -> Vec<(&InstanceRecord, Vec<u32>)> {
        let mut held: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for ((p, partition), key) in &self.owners {
            if p == pipeline {
                held.entry(key.as_str()).or_default().push(*partition);
            }
        }
        held.into_iter()
            .filter_map(|(key, partitions)| Some((self.instances.get(key)?, partitions)))
            .collect()
    }

    /// The latest record of every instance that has not left, by key.
    pub fn instances(&self) -> impl Iterator<Item = &InstanceRecord> {
        self.instances.values()
    }
}

fn claims(record: &InstanceRecord) -> impl Iterator<Item = (String, u32)> + '_ {
    record
        .partitions
        .iter()
        .flat_map(|(pipeline, partitions)| partitions.iter().map(move |p| (pipeline.clone(), *p)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(port: u16, generation: i32, partitions: &[(&str, &[u32])]) -> InstanceRecord {
        InstanceRecord::new(
            &HostInfo {
                host: "127.0.0.1".into(),
                port,
            },
            generation,
            partitions
                .iter()
                .map(|(p, ps)| (p.to_string(), ps.iter().copied().collect()))
                .collect(),
        )
    }

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let original = record(5001, 7, &[("counts", &[0, 3]), ("sums", &[])]);
        assert_eq!(original.key(), "127.0.0.1:5001");
        let decoded = InstanceRecord::decode(&original.encode()).unwrap();
        assert_eq!(decoded, original);
        assert!(matches!(
            InstanceRecord::decode(b"\xff\xfe"),
            Err(RecordError::Malformed(_))
        ));
        assert!(matches!(
            InstanceRecord::decode(b"host = 1"),
            Err(RecordError::Malformed(_))
        ));
        let newer = String::from_utf8(original.encode().to_vec())
            .unwrap()
            .replace("version = 1", "version = 2");
        assert_eq!(
            InstanceRecord::decode(newer.as_bytes()),
            Err(RecordError::Version { found: 2 })
        );
    }

    #[test]
    fn a_moved_partition_belongs_to_the_newer_generation_until_the_old_record_is_replaced() {
        let mut view = ClusterView::new();
        view.apply("a", Some(record(1, 3, &[("counts", &[0, 1, 2])])));
        assert_eq!(view.owner("counts", 1).unwrap().port, 1);
        // b received partition 1 at generation 5; a has not published yet.
        view.apply("b", Some(record(2, 5, &[("counts", &[1])])));
        assert_eq!(view.owner("counts", 1).unwrap().port, 2);
        assert_eq!(view.owner("counts", 0).unwrap().port, 1);
        let holders: Vec<(u16, Vec<u32>)> = view
            .holders("counts")
            .into_iter()
            .map(|(r, ps)| (r.port, ps))
            .collect();
        assert_eq!(holders, vec![(1, vec![0, 2]), (2, vec![1])]);
        // a leaves: its partitions have no owner until someone claims them.
        view.apply("a", None);
        assert!(view.owner("counts", 0).is_none());
        assert_eq!(view.instances().count(), 1);
        assert!(view.holders("sums").is_empty());
    }

    /// What an instance publishes: its generation and (pipeline, partition) claims.
    type Published = (i32, Vec<(usize, u32)>);

    /// One step: an instance (of 4) publishes a record or leaves.
    fn op() -> impl Strategy<Value = (usize, Option<Published>)> {
        let claim = (0usize..2, 0u32..6);
        (
            0usize..4,
            proptest::option::weighted(0.8, (0i32..4, proptest::collection::vec(claim, 0..8))),
        )
    }

    proptest! {
        /// Any sequence of records gives the owners a brute-force model
        /// computes from the latest record of each instance; owners are disjoint.
        #[test]
        fn the_view_answers_as_the_model(ops in proptest::collection::vec(op(), 1..60)) {
            let pipelines = ["counts", "sums"];
            let mut view = ClusterView::new();
            let mut latest: BTreeMap<String, InstanceRecord> = BTreeMap::new();
            for (instance, published) in ops {
                let key = format!("127.0.0.1:{}", 5000 + instance);
                let record = published.map(|(generation, claims)| {
                    let mut partitions: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
                    for (pipeline, partition) in claims {
                        partitions.entry(pipelines[pipeline].to_string()).or_default().insert(partition);
                    }
                    let host = HostInfo { host: "127.0.0.1".into(), port: 5000 + instance as u16 };
                    InstanceRecord::new(&host, generation, partitions)
                });
                match &record {
                    Some(r) => latest.insert(key.clone(), r.clone()),
                    None => latest.remove(&key),
                };
                view.apply(&key, record);

                for pipeline in pipelines {
                    let mut seen = BTreeSet::new();
                    for (holder, partitions) in view.holders(pipeline) {
                        for p in partitions {
                            prop_assert!(seen.insert(p), "partition {} held twice", p);
                            prop_assert_eq!(view.owner(pipeline, p).map(InstanceRecord::key), Some(holder.key()));
                        }
                    }
                    for partition in 0..6 {
                        let expected = latest
                            .iter()
                            .filter(|(_, r)| r.partitions.get(pipeline).is_some_and(|ps| ps.contains(&partition)))
                            .max_by(|(ka, a), (kb, b)| (a.generation, ka).cmp(&(b.generation, kb)))
                            .map(|(k, _)| k.clone());
                        prop_assert_eq!(view.owner(pipeline, partition).map(InstanceRecord::key), expected);
                        prop_assert_eq!(seen.contains(&partition), view.owner(pipeline, partition).is_some());
                    }
                }
                prop_assert_eq!(view.instances().cloned().collect::<Vec<_>>(), latest.values().cloned().collect::<Vec<_>>());
            }
        }
    }
}
