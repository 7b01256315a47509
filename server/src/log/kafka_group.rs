//! The consumer group of a `KafkaLog`: one consumer that joins the group (the
//! `application_id`) subscribed to the application's source topics, with
//! KIP-848's `group.protocol = consumer` or the classic protocol and its
//! `cooperative-sticky` assignor. Its rebalance callback, on the group's own
//! thread, turns librdkafka's incremental assignment into calls of a
//! [`GroupListener`] (the runtime adds and removes tasks there) placed so that
//! a revoked partition's tasks are drained and committed before the
//! rebalance completes, and an assigned partition's queue exists before its
//! first record is fetched. `KafkaLog` reads the assigned partitions through
//! this consumer's per-partition queues and commits the group's offsets
//! through it: a KIP-848 group refuses commits from a client that is not a
//! member.

use super::kafka::{KafkaLog, forward_error, forward_log};
use crate::config::GroupProtocol;
use rdkafka::bindings as rdsys;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::message::Message as _;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long leaving the group waits for the revocation of its partitions.
const LEAVE_DEADLINE: Duration = Duration::from_secs(120);

/// A topic partition as the group assigns it.
pub type GroupPartition = (String, u32);

/// What the group's membership drives. Every call runs on the group's thread
/// inside librdkafka's rebalance callback, so the rebalance waits for it.
pub trait GroupListener: Send + Sync {
    /// `partitions` are now this member's. Answers, per partition, the offset
    /// its reading starts at (its tasks' first fetch); a partition without
    /// one starts at the group's committed offset.
    fn assigned(&self, partitions: &[GroupPartition]) -> BTreeMap<GroupPartition, u64>;

    /// `partitions` leave this member: their tasks must be drained, committed
    /// and removed before this returns. `lost`: the group already gave them
    /// to another member (this one was fenced), so commits will be refused.
    fn revoked(&self, partitions: &[GroupPartition], lost: bool);

    /// A rebalance step ended; `generation` is the group generation (classic)
    /// or member epoch (KIP-848) this member now has, `assignment` all it holds.
    fn rebalanced(&self, generation: i32, assignment: &[GroupPartition]);
}

/// The group's consumer: the rebalance callback and librdkafka's log.
pub(crate) struct GroupContext {
    log: Weak<KafkaLog>,
    listener: Arc<dyn GroupListener>,
    /// The consumer itself, to split partition queues off in the callback
    /// (set once, right after the consumer is created).
    consumer: OnceLock<Weak<BaseConsumer<GroupContext>>>,
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        forward_log(level, facility, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        forward_error(&error, reason);
    }
}

impl ConsumerContext for GroupContext {
    fn rebalance(
        &self,
        base_consumer: &BaseConsumer<Self>,
        err: rdsys::rd_kafka_resp_err_t,
        tpl: &mut TopicPartitionList,
    ) {
        let partitions = partitions_of(tpl);
        let log = self.log.upgrade();
        let consumer = self.consumer.get().and_then(Weak::upgrade);
        match err {
            rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                tracing::info!(partitions = ?partitions, "kafka group: partitions assigned");
                let starts = match (&log, &consumer) {
                    (Some(log), Some(consumer)) => {
                        // Queues first: a partition's records must never reach the main queue.
                        log.prepare_group_partitions(consumer, &partitions);
                        self.listener.assigned(&partitions)
                    }
                    _ => BTreeMap::new(),
                };
                let mut assignment = TopicPartitionList::new();
                for (topic, partition) in &partitions {
                    let offset = starts
                        .get(&(topic.clone(), *partition))
                        .map_or(Offset::Stored, |&o| Offset::Offset(o as i64));
                    if let Err(e) = assignment.add_partition_offset(topic, *partition as i32, offset) {
                        tracing::error!(topic, partition, error = %e, "kafka group: bad assignment offset");
                    }
                }
                if let Err(e) = base_consumer.incremental_assign(&assignment) {
                    tracing::error!(error = %e, "kafka group: incremental assign failed");
                }
                if let Some(log) = &log {
                    log.group_partitions_assigned(&partitions, &starts);
                }
            }
            rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let lost = base_consumer.assignment_lost();
                tracing::info!(partitions = ?partitions, lost, "kafka group: partitions revoked");
                if let Some(log) = &log {
                    log.revoking_group_partitions(&partitions);
                }
                self.listener.revoked(&partitions, lost);
                if let Err(e) = base_consumer.incremental_unassign(tpl) {
                    tracing::error!(error = %e, "kafka group: incremental unassign failed");
                }
                if let Some(log) = &log {
                    log.release_group_partitions(&partitions);
                }
            }
            other => {
                tracing::error!(error = ?other, "kafka group: rebalance error");
                if let Err(e) = base_consumer.incremental_unassign(tpl) {
                    tracing::error!(error = %e, "kafka group: incremental unassign failed");
                }
                if let Some(log) = &log {
                    log.release_group_partitions(&partitions);
                }
            }
        }
        let assignment = base_consumer
            .assignment()
            .map(|tpl| partitions_of(&tpl))
            .unwrap_or_default();
        self.listener.rebalanced(generation(base_consumer), &assignment);
    }
}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<GroupPartition> {
    tpl.elements()
        .iter()
        .filter(|e| e.partition() >= 0)
        .map(|e| (e.topic().to_string(), e.partition() as u32))
        .collect()
}

/// The member's generation (classic) or member epoch (KIP-848); -1 outside the group.
pub(crate) fn generation<C: ConsumerContext>(consumer: &BaseConsumer<C>) -> i32 {
    // SAFETY: the client handle lives as long as `consumer`; the metadata
    // object librdkafka returns is ours, read once and destroyed here.
    unsafe {
        let metadata = rdsys::rd_kafka_consumer_group_metadata(consumer.client().native_ptr());
        if metadata.is_null() {
            return -1;
        }
        let generation = rdsys::rd_kafka_consumer_group_metadata_generation_id(metadata);
        rdsys::rd_kafka_consumer_group_metadata_destroy(metadata);
        generation
    }
}

/// A joined group: the consumer and the thread that serves its callbacks.
pub(crate) struct Group {
    pub(crate) name: String,
    pub(crate) consumer: Arc<BaseConsumer<GroupContext>>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Group {
    /// Creates the member and subscribes it to `topics`; its thread starts
    /// serving callbacks at once. `base` holds the client settings shared by
    /// every client of the log.
    pub(crate) fn join(
        log: &Weak<KafkaLog>,
        mut config: ClientConfig,
        name: &str,
        topics: &[String],
        protocol: GroupProtocol,
        listener: Arc<dyn GroupListener>,
    ) -> Result<Arc<Group>, String> {
        config
            .set("client.id", "taskstream-group")
            .set("group.id", name)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "error")
            .set("allow.auto.create.topics", "false");
        match protocol {
            GroupProtocol::Consumer => config.set("group.protocol", "consumer"),
            GroupProtocol::Classic => config
                .set("group.protocol", "classic")
                .set("partition.assignment.strategy", "cooperative-sticky"),
        };
        let context = GroupContext {
            log: log.clone(),
            listener,
            consumer: OnceLock::new(),
        };
        let consumer: BaseConsumer<GroupContext> = config
            .create_with_context(context)
            .map_err(|e| format!("cannot create the group consumer: {e}"))?;
        let consumer = Arc::new(consumer);
        let _ = consumer.context().consumer.set(Arc::downgrade(&consumer));
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&names)
            .map_err(|e| format!("cannot subscribe to {topics:?}: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let serving = consumer.clone();
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kafka-group".into())
            .spawn(move || serve(&serving, &stopping))
            .map_err(|e| format!("cannot start the group thread: {e}"))?;
        Ok(Arc::new(Group {
            name: name.to_string(),
            consumer,
            stop,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Leaves the group: the thread closes the consumer, which revokes every
    /// partition through the listener first. Blocks until it has.
    pub(crate) fn leave(&self) {
        self.stop.store(true, Ordering::Release);
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.leave();
    }
}

/// The group thread: serves the consumer's main queue (rebalances, errors;
/// records go to the partition queues) until told to stop, then closes it.
fn serve(consumer: &BaseConsumer<GroupContext>, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Err(
                rdkafka::error::KafkaError::PartitionEOF(_)
                | rdkafka::error::KafkaError::Global(rdkafka::error::RDKafkaErrorCode::PartitionEOF),
            )) => {}
            Some(Err(e)) => tracing::warn!(error = %e, "kafka group"),
            Some(Ok(message)) => tracing::error!(
                topic = message.topic(),
                partition = message.partition(),
                "a record reached the group's main queue instead of its partition queue"
            ),
            None => {}
        }
    }
    // Unsubscribing revokes the assignment through the rebalance callback,
    // so the tasks are drained and committed before the member leaves. (The
    // consumer's drop then closes it; closing it here instead would make
    // that drop fail.)
    consumer.unsubscribe();
    let deadline = std::time::Instant::now() + LEAVE_DEADLINE;
    while consumer.assignment().is_ok_and(|a| a.count() > 0) {
        if std::time::Instant::now() >= deadline {
            tracing::error!("kafka group: partitions still assigned {LEAVE_DEADLINE:?} after leaving");
            break;
        }
        let _ = consumer.poll(Duration::from_millis(100));
    }
    tracing::info!("kafka group: left the group");
}
