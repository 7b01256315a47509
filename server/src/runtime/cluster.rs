//! Kafka mode's exchange of who holds what: this instance publishes its
//! address, active partitions per pipeline and group generation to the
//! compacted `<application_id>-metadata` topic after every rebalance (a
//! tombstone when it stops gracefully), and reads that topic from the
//! beginning, by manual assignment (never through the group), into a
//! [`ClusterView`]. One thread does both, so the group's rebalance callback
//! only hands it the latest state and never waits for the broker.

use crate::log::{Log, LogError, ProducerRecord};
use crate::metadata::HostInfo;
use crate::metadata::cluster::{ClusterView, InstanceRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// Records read from the topic per read.
const READ_BATCH: usize = 500;

/// Longest wait of the thread with nothing to do: a safety net under the
/// log's append notices.
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Pause after a failed read or publish before the next try.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// The metadata topic's one partition.
const PARTITION: u32 = 0;

/// This instance's side of the metadata topic. See the module doc.
pub(crate) struct Cluster {
    topic: String,
    host: HostInfo,
    /// This instance's key in the topic (`host:port`).
    me: String,
    view: RwLock<ClusterView>,
    work: Mutex<Work>,
    wake: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What the thread has to do next.
#[derive(Default)]
struct Work {
    /// A record to publish (only the latest matters).
    publish: Option<InstanceRecord>,
    /// The topic has new records (an append notice).
    readable: bool,
    /// Publish a tombstone and stop.
    leave: bool,
    /// The group generation of the last `publish`, for `republish`.
    generation: Option<i32>,
}

impl Cluster {
    /// Starts the thread for `topic` (which must exist, with one partition).
    pub(crate) fn start(log: Arc<dyn Log>, topic: String, host: HostInfo) -> Result<Arc<Cluster>, String> {
        let cluster = Arc::new(Cluster {
            me: host.to_string(),
            topic,
            host,
            view: RwLock::new(ClusterView::new()),
            work: Mutex::new(Work::default()),
            wake: Condvar::new(),
            thread: Mutex::new(None),
        });
        let weak: Weak<Cluster> = Arc::downgrade(&cluster);
        let topic = cluster.topic.clone();
        log.add_append_listener(Arc::new(move |appended, _| {
            if appended == topic
                && let Some(cluster) = weak.upgrade()
            {
                cluster.lock_work().readable = true;
                cluster.wake.notify_all();
            }
        }));
        let running = cluster.clone();
        let thread = std::thread::Builder::new()
            .name("cluster-metadata".into())
            .spawn(move || running.run(log.as_ref()))
            .map_err(|e| format!("cannot start the cluster metadata thread: {e}"))?;
        *cluster.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(thread);
        Ok(cluster)
    }

    /// This instance's key in the view (`host:port`).
    pub(crate) fn me(&self) -> &str {
        &self.me
    }

    /// The view as read so far.
    pub(crate) fn view(&self) -> RwLockReadGuard<'_, ClusterView> {
        self.view.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes what this instance holds now (pipeline → active partitions)
    /// at `generation`; returns at once.
    pub(crate) fn publish(&self, generation: i32, partitions: BTreeMap<String, BTreeSet<u32>>) {
        let record = InstanceRecord::new(&self.host, generation, partitions);
        let mut work = self.lock_work();
        if !work.leave {
            work.generation = Some(generation);
            work.publish = Some(record);
            self.wake.notify_all();
        }
    }

    /// Publishes what this instance holds now at the generation published
    /// last, when its tasks changed between rebalances (a task revived after
    /// an aborted transaction); nothing before the first `publish`.
    pub(crate) fn republish(&self, partitions: BTreeMap<String, BTreeSet<u32>>) {
        let mut work = self.lock_work();
        if let Some(generation) = work.generation
            && !work.leave
        {
            work.publish = Some(InstanceRecord::new(&self.host, generation, partitions));
            self.wake.notify_all();
        }
    }

    /// Publishes the tombstone of this instance and stops the thread;
    /// blocks until it has (the log's own timeouts bound the publish).
    pub(crate) fn leave(&self) {
        {
            let mut work = self.lock_work();
            work.leave = true;
            work.publish = None;
            self.wake.notify_all();
        }
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }

    fn lock_work(&self) -> std::sync::MutexGuard<'_, Work> {
        self.work.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The thread: publish what is pending, read what is new, wait.
    fn run(&self, log: &dyn Log) {
        let mut next = 0u64;
        let mut records = Vec::new();
        loop {
            let (publish, leave) = {
                let mut work = self.lock_work();
                work.readable = false;
                (work.publish.take(), work.leave)
            };
            if leave {
                // A real tombstone on Kafka; an empty value on a log without them.
                let left = match log.as_kafka() {
                    Some(kafka) => kafka.append_tombstone(&self.topic, self.me.as_bytes()).map(drop),
                    None => log
                        .append(&self.topic, vec![ProducerRecord::keyed(self.me.clone(), "")])
                        .map(drop),
                };
                match left {
                    Ok(()) => tracing::info!(topic = %self.topic, "published this instance's departure"),
                    Err(e) => tracing::warn!(error = %e, "could not publish this instance's departure"),
                }
                return;
            }
            if let Some(record) = publish {
                let appended = log.append(
                    &self.topic,
                    vec![ProducerRecord::keyed(self.me.clone(), record.encode())],
                );
                match appended {
                    Ok(_) => tracing::info!(
                        generation = record.generation,
                        partitions = ?record.partitions,
                        "published this instance's partitions"
                    ),
                    Err(e) => {
                        tracing::warn!(error = %e, "could not publish this instance's partitions; trying again");
                        self.retry_later(record);
                    }
                }
            }
            records.clear();
            match log.read(&self.topic, PARTITION, next, READ_BATCH, &mut records) {
                Ok(()) => {}
                // Retention (not compaction, which keeps offsets) removed
                // records: what remains is the latest of each key anyway.
                Err(LogError::OffsetOutOfRange { earliest, .. }) => {
                    next = earliest;
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, topic = %self.topic, "could not read the metadata topic");
                    self.idle(RETRY_PAUSE);
                    continue;
                }
            }
            if !records.is_empty() {
                let mut view = self.view.write().unwrap_or_else(|e| e.into_inner());
                for record in &records {
                    next = record.offset + 1;
                    apply(&mut view, record);
                }
                continue;
            }
            self.idle(IDLE_WAIT);
        }
    }

    /// Puts a record that failed to publish back, unless a newer one came.
    fn retry_later(&self, record: InstanceRecord) {
        let mut work = self.lock_work();
        if work.publish.is_none() && !work.leave {
            work.publish = Some(record);
        }
        drop(work);
        std::thread::sleep(RETRY_PAUSE);
    }

    /// Waits until there is something to do, or `timeout`.
    fn idle(&self, timeout: Duration) {
        let work = self.lock_work();
        let _ = self
            .wake
            .wait_timeout_while(work, timeout, |w| !w.readable && w.publish.is_none() && !w.leave);
    }
}

/// One record of the topic into the view; an unreadable one is skipped.
fn apply(view: &mut ClusterView, record: &crate::log::Record) {
    let Some(key) = record.key.as_deref() else {
        return;
    };
    let key = String::from_utf8_lossy(key);
    if record.value.is_empty() {
        view.apply(&key, None);
        return;
    }
    match InstanceRecord::decode(&record.value) {
        Ok(instance) => view.apply(&key, Some(instance)),
        Err(e) => {
            tracing::warn!(key = %key, offset = record.offset, error = %e, "skipping a metadata record")
        }
    }
}
