//! Apache Kafka for bench scenarios: one broker per `start()`, the tests'
//! own (tests/common/kafka.rs: jars from tests/kafka/pom.xml, KRaft on free
//! loopback ports, short group timings), stopped when the `Broker` is dropped.
//! Scenarios that compare taskstream with Kafka peers (rdkafka loops, Java
//! programs) run them all against one of these.

#[path = "../../tests/common/kafka.rs"]
mod harness;

use anyhow::{anyhow, bail};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use taskstream_server::Log as _;
use taskstream_server::log::KafkaLog;

/// A running broker; dropping it stops the broker and removes its data.
pub struct Broker {
    harness: harness::Broker,
    /// Creates topics; dropped before the broker stops.
    admin: Option<Arc<KafkaLog>>,
}

/// Starts a broker and waits until it answers (seconds; the first start in a
/// target dir also copies the jars with Maven). Fails, saying why, when
/// `java` or `mvn` is missing.
pub fn start() -> anyhow::Result<Broker> {
    if let Some(reason) = harness::missing_tool() {
        bail!("{reason}");
    }
    let harness = harness::launch().map_err(|e| anyhow!("{e}"))?;
    let admin = KafkaLog::with_settings(&harness.bootstrap, &BTreeMap::new(), 1)
        .map_err(|e| anyhow!("connect to the broker at {}: {e}", harness.bootstrap));
    let admin = match admin {
        Ok(admin) => admin,
        Err(e) => {
            harness.stop();
            return Err(e);
        }
    };
    Ok(Broker {
        harness,
        admin: Some(admin),
    })
}

/// A name no other topic or group of this process has: `<prefix>-<pid>-<n>`.
pub fn unique(prefix: &str) -> String {
    harness::unique(prefix)
}

impl Broker {
    /// `host:port` for `bootstrap.servers`.
    pub fn bootstrap(&self) -> &str {
        &self.harness.bootstrap
    }

    /// Creates `name` with `partitions` partitions (replication factor 1;
    /// compacted when it ends in `-changelog` or `-metadata`) and returns once
    /// every partition has a leader. An existing topic with the same count is
    /// fine; another count is an error.
    pub fn create_topic(&self, name: &str, partitions: u32) -> anyhow::Result<()> {
        self.log()
            .ensure_topic(name, partitions)
            .map_err(|e| anyhow!("create topic `{name}`: {e}"))
    }

    /// A taskstream `KafkaLog` on this broker (for writing and reading records).
    pub fn log(&self) -> &Arc<KafkaLog> {
        self.admin.as_ref().expect("present until drop")
    }

    /// Kafka's StorageTool format time and the JVM's time to its first answer.
    pub fn start_times(&self) -> (Duration, Duration) {
        (self.harness.formatted_in, self.harness.started_in)
    }

    /// The broker JVM's process id (for its CPU time, shown apart from the measured process's).
    pub fn pid(&self) -> u32 {
        self.harness.pid
    }

    /// The broker JVM's resident memory now, in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        self.harness.rss_kib()
    }

    /// The broker's log file, for a scenario's error message.
    pub fn log_path(&self) -> std::path::PathBuf {
        self.harness.dir.join("broker.log")
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        // The client first, so it does not spend its last moments reconnecting.
        drop(self.admin.take());
        self.harness.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use taskstream_server::ProducerRecord;

    /// A started broker takes topics and records; dropping it ends its JVM.
    #[test]
    fn starts_takes_a_topic_and_stops_on_drop() {
        if let Some(reason) = harness::missing_tool() {
            assert!(
                std::env::var_os("TASKSTREAM_REQUIRE_KAFKA").is_none_or(|v| v.is_empty() || v == "0"),
                "TASKSTREAM_REQUIRE_KAFKA is set but {reason}"
            );
            eprintln!("skipping: {reason}");
            return;
        }
        let broker = start().expect("start a broker");
        assert!(broker.bootstrap().starts_with("127.0.0.1:"));
        let topic = unique("bench-broker");
        broker.create_topic(&topic, 3).expect("create the topic");
        broker
            .create_topic(&topic, 3)
            .expect("an existing topic with the same count");
        assert!(broker.create_topic(&topic, 4).is_err(), "another partition count");
        let written = broker
            .log()
            .append(&topic, vec![ProducerRecord::keyed("k", "v")])
            .expect("append");
        assert_eq!(
            broker
                .log()
                .end_offset(&topic, written[0].partition)
                .expect("end"),
            1
        );

        let pid = broker.harness.pid;
        let dir = broker.harness.dir.clone();
        assert!(broker.rss_kib().is_some_and(|kib| kib > 0));
        drop(broker);
        // Dropping waited for the JVM: no process and no run dir are left.
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            state.is_empty() || state.contains(") Z "),
            "the broker JVM still runs: {state}"
        );
        assert!(!dir.exists(), "the run dir {} is left", dir.display());
    }
}
