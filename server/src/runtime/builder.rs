//! `AppBuilder`: a config plus what code provides (the log, custom
//! processors, a commit callback), and the start of a `StreamsApp`: validate,
//! create topics, lay out the pipelines, plan every task (unless the caller
//! assigns partitions itself, as Kafka's group membership does), start the
//! stream threads.

use super::app::{AppInner, StreamsApp};
use super::commit::Committer;
use super::membership::Membership;
use super::scheduler::{PipelineNames, Scheduler};
use super::shared::{CommitCallback, CommitReport, PipelineProcessor, PipelineRuntime, Shared, SinkTopic};
use super::{RuntimeError, driver, recovery};
use crate::config::ProcessorSpec;
use crate::config::{Config, ConfigError};
use crate::log::{KafkaLog, Log, LogError, MemoryLog};
use crate::metadata::{AppState, HostInfo};
use crate::processor::remote::{RemoteProcessor, RemoteRuntime};
use crate::processor::{self, Processor};
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How often retention is enforced (at a commit round).
const RETENTION_INTERVAL: Duration = Duration::from_secs(1);

/// Builds a `StreamsApp`: config plus what code provides (log, custom
/// processors, commit callback).
pub struct AppBuilder {
    config: Config,
    log: Option<Arc<dyn Log>>,
    processors: HashMap<String, Arc<dyn Processor>>,
    on_commit: Option<CommitCallback>,
    assignment: Assignment,
}

/// Who decides which tasks run here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Assignment {
    /// Every partition of every pipeline (the embedded log), or, on Kafka,
    /// the consumer group of the `application_id`.
    Default,
    /// The caller, with `add_tasks` / `remove_tasks`.
    Manual,
}

impl AppBuilder {
    pub fn new(config: Config) -> Self {
        AppBuilder {
            config,
            log: None,
            processors: HashMap::new(),
            on_commit: None,
            assignment: Assignment::Default,
        }
    }

    /// The log to consume and produce (default: the embedded log, on disk
    /// with a `data_dir`, else in memory).
    pub fn log(mut self, log: Arc<dyn Log>) -> Self {
        self.log = Some(log);
        self
    }

    /// Registers a processor that pipelines name with `processor = "<name>"`.
    pub fn processor(mut self, name: &str, processor: Arc<dyn Processor>) -> Self {
        self.processors.insert(name.to_string(), processor);
        self
    }

    /// Called after every commit of a task with its result (in order).
    pub fn on_commit(mut self, callback: impl Fn(&CommitReport) + Send + Sync + 'static) -> Self {
        self.on_commit = Some(Arc::new(callback));
        self
    }

    /// Starts with no task: the caller adds and removes them with
    /// `StreamsApp::add_tasks` / `remove_tasks`. By default every partition of
    /// every pipeline is a task, or, on Kafka, the instances of one
    /// `application_id` form a consumer group and each runs the tasks of the
    /// partitions the group assigns it.
    pub fn manual_assignment(mut self) -> Self {
        self.assignment = Assignment::Manual;
        self
    }

    /// Validates the config, creates topics and tasks, and starts the threads.
    pub fn start(self) -> Result<StreamsApp, RuntimeError> {
        let Laid { shared, slots, group } = self.lay_out()?;
        let app = StreamsApp {
            inner: Arc::new(AppInner {
                shared: shared.clone(),
            }),
        };
        {
            let scheduler = shared.lock();
            // Restoring: calls answer UNAVAILABLE until the last store is rebuilt.
            if scheduler.all_restored() {
                shared.set_state(AppState::Running);
            }
            let names: Vec<_> = slots
                .iter()
                .map(|&s| scheduler.threads()[s].name().clone())
                .collect();
            drop(scheduler);
            for (slot, name) in slots.into_iter().zip(names) {
                driver::spawn(&shared, slot, &name);
            }
        }
        super::watchdog::start(&shared)
            .map_err(|e| RuntimeError::Internal(format!("cannot start the watchdog thread: {e}")))?;
        if group {
            join_group(&shared)?;
        }
        Ok(app)
    }

    /// The app as `start` lays it out, with the scheduler's thread slots but
    /// no stream thread: a test picks for the slots and carries the picks out
    /// itself, in the order it means to check.
    #[cfg(test)]
    pub(crate) fn start_without_threads(self) -> Result<Arc<Shared>, RuntimeError> {
        Ok(self.lay_out()?.shared)
    }

    /// Everything `start` does before the stream threads: validate, create
    /// topics, lay out the pipelines, plan the tasks.
    fn lay_out(self) -> Result<Laid, RuntimeError> {
        let config = self.config;
        config.validate()?;
        let (host, port) = crate::config::parse_host_port(&config.application_server)
            .map_err(|m| ConfigError::new("application_server", m))?;
        let log: Arc<dyn Log> = match (self.log, &config.bootstrap_servers, &config.data_dir) {
            (Some(log), _, _) => log,
            (None, Some(_), _) => KafkaLog::connect(&config)?,
            (None, None, Some(_)) => crate::datadir::open(&config)?,
            (None, None, None) => MemoryLog::new(),
        };
        let group = log.as_kafka().is_some() && self.assignment == Assignment::Default;
        for (topic, partitions) in config.topic_partitions()? {
            log.ensure_topic(&topic, partitions).map_err(|e| match e {
                LogError::PartitionCountMismatch { .. } => {
                    ConfigError::new("topics", format!("{e}; the log already holds this topic")).into()
                }
                other => RuntimeError::from(other),
            })?;
        }
        let pipelines = layout_pipelines(&config, log.as_ref(), &self.processors)?;
        let names = pipelines
            .iter()
            .map(|p| PipelineNames {
                name: p.name.clone(),
                topic: p.topic.clone(),
            })
            .collect();
        let scheduler = Scheduler::new(
            &config.application_id,
            names,
            config.subscriber_buffer_batches,
            Duration::from_millis(config.commit_interval_ms),
            RETENTION_INTERVAL,
            Instant::now(),
        );
        let threads = config.num_stream_threads;
        let shared = Arc::new(Shared::new(
            config,
            log.clone(),
            HostInfo { host, port },
            pipelines,
            scheduler,
            self.on_commit,
        ));
        if shared.config.commit_mode == crate::config::CommitMode::Async {
            Committer::start(&shared)
                .map_err(|e| RuntimeError::Internal(format!("could not start the committer: {e}")))?;
        }
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        log.add_append_listener(Arc::new(move |topic, partition| {
            if let Some(shared) = weak.upgrade() {
                on_append(&shared, topic, partition);
            }
        }));
        let slots: Vec<usize> = {
            let mut scheduler = shared.lock();
            (0..threads).map(|_| scheduler.add_thread()).collect()
        };
        if self.assignment == Assignment::Default && !group {
            for pipeline in 0..shared.pipelines.len() {
                for partition in 0..shared.pipelines[pipeline].partitions {
                    let init = recovery::plan(&shared, pipeline, partition, None, None)?;
                    shared.lock().add_task(init);
                }
            }
        }
        Ok(Laid { shared, slots, group })
    }
}

/// An app laid out, its threads not yet started.
struct Laid {
    shared: Arc<Shared>,
    /// The scheduler's slots for the stream threads.
    slots: Vec<usize>,
    /// It joins the consumer group of its `application_id` (Kafka).
    group: bool,
}

/// Joins the consumer group of the `application_id`, subscribed to every
/// pipeline's source topic: the instance is REBALANCING until its first
/// assignment, whose tasks are added then (see `membership`).
fn join_group(shared: &Arc<Shared>) -> Result<(), RuntimeError> {
    let Some(kafka) = shared.log.as_kafka() else {
        return Ok(());
    };
    let mut topics: Vec<String> = shared.pipelines.iter().map(|p| p.topic.to_string()).collect();
    topics.sort();
    topics.dedup();
    // Who holds what is exchanged through the metadata topic: read from
    // the start before joining, so the view fills while the group assigns.
    let topic = shared.config.metadata_topic();
    shared.log.ensure_topic(&topic, 1)?;
    let cluster = super::cluster::Cluster::start(shared.log.clone(), topic, shared.host_info.clone())
        .map_err(RuntimeError::Internal)?;
    shared.set_cluster(cluster);
    shared.set_rebalancing(true);
    let listener = Arc::new(Membership::new(Arc::downgrade(shared)));
    kafka
        .join_group(
            &shared.config.application_id,
            &topics,
            shared.config.group_protocol,
            listener,
        )
        .map_err(RuntimeError::from)
}

/// The pipelines as they will run: processor, topics, order.
fn layout_pipelines(
    config: &Config,
    log: &dyn Log,
    registered: &HashMap<String, Arc<dyn Processor>>,
) -> Result<Vec<PipelineRuntime>, RuntimeError> {
    let mut pipelines = Vec::new();
    // One runtime and one channel per endpoint for every remote processor.
    let mut remote_runtime: Option<Arc<RemoteRuntime>> = None;
    for (index, pipeline) in config.pipelines.iter().enumerate() {
        if let ProcessorSpec::Grpc(spec) = &pipeline.processor {
            let runtime = match &remote_runtime {
                Some(runtime) => runtime.clone(),
                None => {
                    let runtime = RemoteRuntime::new().map_err(|e| {
                        RuntimeError::Internal(format!("could not start the remote processors' runtime: {e}"))
                    })?;
                    remote_runtime = Some(runtime.clone());
                    runtime
                }
            };
            let remote = RemoteProcessor::new(spec.clone(), &pipeline.name, &pipeline.source_topic, runtime)
                .map_err(|m| ConfigError::new(format!("pipelines[{index}].processor.endpoint"), m))?
                .with_crash_attempts(config.retry_max_attempts);
            pipelines.push(layout_pipeline(
                config,
                log,
                pipeline,
                PipelineProcessor::Remote(Arc::new(remote)),
            )?);
            continue;
        }
        // A processor registered in code wins over a built-in of the same name.
        let registered = registered.get(pipeline.processor.name()).cloned();
        let Some(processor) = registered.or_else(|| processor::builtin(&pipeline.processor)) else {
            return Err(ConfigError::new(
                format!("pipelines[{index}].processor"),
                format!(
                    "`{}` is neither a built-in (count, sum, latest, simulate) nor registered with \
                     AppBuilder::processor",
                    pipeline.processor.name()
                ),
            )
            .into());
        };
        pipelines.push(layout_pipeline(
            config,
            log,
            pipeline,
            PipelineProcessor::Local(processor),
        )?);
    }
    Ok(pipelines)
}

/// One pipeline as it will run, its retry and dead-letter topics created.
fn layout_pipeline(
    config: &Config,
    log: &dyn Log,
    pipeline: &crate::config::PipelineConfig,
    processor: PipelineProcessor,
) -> Result<PipelineRuntime, RuntimeError> {
    let partitions = log.partitions(&pipeline.source_topic)?;
    let retry_topic = config.retry_topic(&pipeline.name);
    let dead_letter_topic = config.dead_letter_topic(&pipeline.name);
    for internal in [&retry_topic, &dead_letter_topic] {
        log.ensure_topic(internal, partitions)?;
    }
    // Created compacted, with the source's partition count (`KafkaLog::ensure_topic`).
    let changelog_topic = match log.as_kafka() {
        Some(_) => {
            let topic = config.changelog_topic(&pipeline.name);
            log.ensure_topic(&topic, partitions)?;
            Some(topic.into())
        }
        None => None,
    };
    let sink = match &pipeline.sink_topic {
        Some(topic) => Some(SinkTopic {
            topic: topic.as_str().into(),
            partitions: log.partitions(topic)?,
        }),
        None => None,
    };
    let effective = config.effective_order(pipeline);
    Ok(PipelineRuntime {
        name: pipeline.name.as_str().into(),
        topic: pipeline.source_topic.as_str().into(),
        partitions,
        order: effective.order,
        threads_per_task: effective.threads_per_task,
        processor,
        processor_name: pipeline.processor.name().to_string(),
        store_kind: config.store_kind(pipeline),
        retry_policy: config.retry_policy(pipeline),
        retry_topic: retry_topic.into(),
        dead_letter_topic: dead_letter_topic.into(),
        changelog_topic,
        sink,
    })
}

/// Appends to a pipeline's source or retry partition wake the threads.
fn on_append(shared: &Shared, topic: &str, partition: u32) {
    let appended: Vec<_> = shared
        .pipelines
        .iter()
        .enumerate()
        .filter_map(|(p, pipeline)| {
            let source = *pipeline.topic == *topic;
            (source || *pipeline.retry_topic == *topic).then_some((p, partition, source))
        })
        .collect();
    if !appended.is_empty() {
        shared.notify_append(&appended);
    }
}
