//! `taskstream.v1.StreamsService`: metadata, record-outcome streams, interactive
//! queries, produce and topic reads. Each handler checks its request, calls `StreamsApp`
//! and translates the answer; errors go through `status::to_status`. A Query
//! about partitions another instance holds (Kafka mode) goes to it (`forward`).

use super::auth::{Role, role_of};
use super::convert::{self, PartitionRanges};
use super::forward::{self, Peers};
use super::outcomes::{self, PumpSettings, STREAM_CHANNEL_CAPACITY, StreamItem};
use super::request::{self, QueryArgs, StoreQuery};
use super::status::{self, ServiceError, to_status};
use crate::config::Config;
use crate::log::ProducerRecord;
use crate::metadata::{HostInfo, PartitionOwner};
use crate::runtime::echo;
use crate::runtime::{RangePage, RuntimeError, StreamsApp};
use std::collections::BTreeMap;
use std::sync::Arc;
use taskstream::v1 as pb;
use taskstream::v1::streams_service_server::StreamsService;
use tokio::sync::Semaphore;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::ClientTlsConfig;
use tonic::{Request, Response, Status, Streaming};

/// Serves `StreamsService` over one running `StreamsApp`.
#[derive(Clone)]
pub struct StreamsHandler {
    app: StreamsApp,
    /// One permit per open GetMetadataAsync stream (`max_subscribers`), held by its pump.
    subscribers: Arc<Semaphore>,
    /// The other instances, for queries about their partitions (Kafka mode).
    peers: Arc<Peers>,
}

/// Who answers a Query: this instance (`local`: the partitions to read, or
/// `None` when it has none of them) and the instances holding the rest.
struct QueryPlan {
    local: Option<Vec<u32>>,
    remote: Vec<(HostInfo, Vec<u32>)>,
}

impl StreamsHandler {
    /// A handler that forwards queries to other instances over plain HTTP/2.
    pub fn new(app: StreamsApp) -> Self {
        StreamsHandler::with_peer_tls(app, None)
    }

    /// A handler that forwards queries to other instances over TLS with `peer_tls`
    /// (`tls::peer_tls_config`), or over plain HTTP/2 without.
    pub fn with_peer_tls(app: StreamsApp, peer_tls: Option<ClientTlsConfig>) -> Self {
        let subscribers = Arc::new(Semaphore::new(app.config().max_subscribers));
        StreamsHandler {
            app,
            subscribers,
            peers: Arc::new(Peers::new(peer_tls)),
        }
    }

    fn produce_limits(&self) -> request::ProduceLimits {
        request::ProduceLimits::of(self.app.config())
    }

    /// The body of ProduceStream; `written` counts what reached the log before an error.
    async fn append_stream(
        &self,
        role: Role,
        mut batches: Streaming<pb::ProduceRequest>,
        written: &mut Written,
    ) -> Result<pb::ProduceResponse, Status> {
        let atomic = self.app.produce_is_atomic();
        let max_staged = self.app.config().max_produce_stream_bytes;
        let mut topic: Option<String> = None;
        let mut staged = Vec::new();
        let mut staged_bytes = 0usize;
        let mut ranges = PartitionRanges::default();
        let mut index = 0usize;
        while let Some(batch) = batches.next().await {
            let (batch_topic, records) =
                request::produce_batch(batch?, self.produce_limits()).map_err(to_status)?;
            match &topic {
                None => {
                    self.check_topic_access(role, &batch_topic, "ProduceStream to")?;
                    topic = Some(batch_topic.clone());
                }
                Some(first) if *first != batch_topic => {
                    return Err(to_status(RuntimeError::invalid_argument(
                        "topic",
                        format!(
                            "batch {index} names topic `{batch_topic}` but the stream started with `{first}`; \
                             one ProduceStream call appends to one topic"
                        ),
                    )));
                }
                Some(_) => {}
            }
            if atomic {
                staged_bytes = staged_bytes.saturating_add(records.iter().map(produced_bytes).sum());
                if staged_bytes > max_staged {
                    return Err(to_status(RuntimeError::limit_exceeded(
                        "max_produce_stream_bytes",
                        max_staged as u64,
                        format!(
                            "batch {index} takes the stream's keys, values and headers past \
                             {max_staged} bytes; nothing of this stream was written: send it as \
                             several ProduceStream calls"
                        ),
                    )));
                }
                staged.extend(records);
            } else {
                let app = self.app.clone();
                let count = records.len() as u64;
                let positions = blocking(move || app.produce(&batch_topic, records)).await?;
                ranges.add(&positions);
                written.batches += 1;
                written.records += count;
            }
            index += 1;
        }
        let Some(topic) = topic else {
            return Err(to_status(RuntimeError::invalid_argument(
                "topic",
                "the stream carried no batch; send at least one ProduceRequest naming the topic",
            )));
        };
        if atomic {
            let app = self.app.clone();
            let name = topic.clone();
            let positions = blocking(move || app.produce(&name, staged)).await?;
            ranges.add(&positions);
        }
        Ok(pb::ProduceResponse {
            topic,
            record_count: ranges.record_count(),
            positions: Vec::new(),
            partitions: ranges.to_proto(),
        })
    }

    /// Routes a query by partition (see `StreamsApp::route`). Partitions of
    /// other instances with `forward_queries = false` are refused, naming
    /// the owner, so that the client asks it.
    fn plan(&self, args: &QueryArgs) -> Result<QueryPlan, RuntimeError> {
        let asked = match &args.query {
            StoreQuery::Range { partitions, .. } => partitions.clone(),
            StoreQuery::Key(key) => vec![self.app.key_partition(&args.store, key)?],
        };
        if args.local_only {
            return Ok(QueryPlan {
                local: Some(asked),
                remote: Vec::new(),
            });
        }
        // A later page: partitions before its token are done, wherever they are.
        let done = match &args.query {
            StoreQuery::Range {
                resume: Some(resume), ..
            } => resume.partition,
            _ => 0,
        };
        let mut local = Vec::new();
        let mut remote: BTreeMap<String, (HostInfo, Vec<u32>)> = BTreeMap::new();
        for (partition, owner) in self.app.route(&args.store, &asked)? {
            if partition < done {
                continue;
            }
            match owner {
                PartitionOwner::Local => local.push(partition),
                PartitionOwner::Remote(owner) if !self.app.config().forward_queries => {
                    return Err(RuntimeError::NotHosted {
                        store: args.store.clone(),
                        partition,
                        owner: Some(owner),
                    });
                }
                PartitionOwner::Remote(owner) => {
                    remote
                        .entry(owner.to_string())
                        .or_insert_with(|| (owner, Vec::new()))
                        .1
                        .push(partition);
                }
            }
        }
        Ok(QueryPlan {
            // An empty list would mean "every partition hosted here".
            local: (!local.is_empty()).then_some(local),
            remote: remote.into_values().collect(),
        })
    }

    /// Internal topics (retry, dead-letter, changelog, metadata) belong to the runtime:
    /// only `admin` may produce to or read them.
    fn check_topic_access(&self, role: Role, topic: &str, action: &str) -> Result<(), Status> {
        if role < Role::Admin && is_internal_topic(self.app.config(), topic) {
            return Err(to_status(ServiceError::PermissionDenied {
                needed: Role::Admin.as_str(),
                what: format!(
                    "{action} the internal topic `{}` (the runtime's; dead letters go back with \
                     RedriveDeadLetters)",
                    echo(topic)
                ),
            }));
        }
        Ok(())
    }
}

/// A topic of the runtime: a pipeline's retry or dead-letter topic, or a changelog or
/// metadata topic (`…-changelog`, `…-metadata`, as Kafka Streams names them).
pub fn is_internal_topic(config: &Config, topic: &str) -> bool {
    topic.ends_with("-changelog")
        || topic.ends_with("-metadata")
        || config
            .pipelines
            .iter()
            .any(|p| topic == config.retry_topic(&p.name) || topic == config.dead_letter_topic(&p.name))
}

#[tonic::async_trait]
impl StreamsService for StreamsHandler {
    async fn process_metadata_for_store(
        &self,
        request: Request<pb::ProcessMetadataForStoreRequest>,
    ) -> Result<Response<pb::ProcessMetadataForStoreResponse>, Status> {
        let request = request.into_inner();
        request::check_store(&request.store).map_err(to_status)?;
        let metadata = self
            .app
            .process_metadata_for_store(&request.store, request.in_order)
            .map_err(to_status)?;
        Ok(Response::new(convert::store_metadata(metadata)))
    }

    type GetMetadataAsyncStream = ReceiverStream<StreamItem>;

    async fn get_metadata_async(
        &self,
        request: Request<pb::GetMetadataAsyncRequest>,
    ) -> Result<Response<Self::GetMetadataAsyncStream>, Status> {
        let stream = request::metadata_stream(request.into_inner()).map_err(to_status)?;
        let max = self.app.config().max_subscribers;
        let permit = Arc::clone(&self.subscribers).try_acquire_owned().map_err(|_| {
            to_status(RuntimeError::limit_exceeded(
                "max_subscribers",
                max as u64,
                format!("the server already serves {max} GetMetadataAsync streams; close one or retry later"),
            ))
        })?;
        // Subscribing first means a refused request (in_order, unknown store,
        // offsets out of range) fails the call itself, before any message.
        let subscription = self
            .app
            .subscribe(&stream.store, stream.subscribe)
            .map_err(to_status)?;
        let config = self.app.config();
        let settings = PumpSettings {
            store: stream.store,
            max_batch_records: stream.max_batch_records,
            slow_subscriber: config.slow_subscriber,
            subscriber_buffer_batches: config.subscriber_buffer_batches,
        };
        tracing::debug!(store = %settings.store, "GetMetadataAsync stream opened");
        let (tx, rx) = mpsc::channel(STREAM_CHANNEL_CAPACITY);
        tokio::spawn(async move {
            outcomes::pump(subscription, tx, settings).await;
            drop(permit);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn metadata_for_key(
        &self,
        request: Request<pb::MetadataForKeyRequest>,
    ) -> Result<Response<pb::MetadataForKeyResponse>, Status> {
        let request = request.into_inner();
        request::check_store(&request.store).map_err(to_status)?;
        let metadata = self
            .app
            .metadata_for_key(&request.store, &request.key)
            .map_err(to_status)?;
        Ok(Response::new(convert::key_metadata(&metadata)))
    }

    /// Answers from this instance's partitions and, unless `local_only`,
    /// asks the instances holding the others (Kafka mode), all at once; the
    /// answers merge by partition into one page (`forward::merge_pages`),
    /// each partition naming the host that answered.
    async fn query(&self, request: Request<pb::QueryRequest>) -> Result<Response<pb::QueryResponse>, Status> {
        // The owner checks the caller's token as this instance did.
        let authorization = request.metadata().get("authorization").cloned();
        let request = request.into_inner();
        let args = request::store_query(request.clone()).map_err(to_status)?;
        let plan = self.plan(&args).map_err(to_status)?;
        let mut remote = Vec::with_capacity(plan.remote.len());
        for (owner, partitions) in plan.remote {
            let peers = self.peers.clone();
            // The same page token: an owner skips what lies before it.
            let request = pb::QueryRequest {
                partitions,
                ..request.clone()
            };
            let authorization = authorization.clone();
            remote.push(tokio::spawn(async move {
                peers.query(&owner, request, authorization).await
            }));
        }
        let app = self.app.clone();
        let store = args.store.clone();
        let max_bytes = self.app.config().max_response_bytes;
        // A persistent store is read from disk: off the async workers.
        let local = match plan.local {
            None => None,
            Some(partitions) => Some(
                blocking(move || match args.query {
                    StoreQuery::Key(key) => Ok(RangePage {
                        results: vec![app.query_key(&store, &key)?],
                        next: None,
                    }),
                    StoreQuery::Range {
                        from,
                        to,
                        limit,
                        resume,
                        ..
                    } => app.query_range_page(
                        &store,
                        from.as_deref(),
                        to.as_deref(),
                        &partitions,
                        limit,
                        max_bytes,
                        resume.as_ref(),
                    ),
                })
                .await?,
            ),
        };
        let mut pages: Vec<forward::Page> = Vec::with_capacity(remote.len() + 1);
        if let Some(page) = local {
            let host = self.app.host_info();
            pages.push(forward::Page {
                results: page
                    .results
                    .into_iter()
                    .map(|result| convert::partition_result(result, &host))
                    .collect(),
                next: page.next,
            });
        }
        for answer in remote {
            let answer = answer
                .await
                .map_err(|e| to_status(RuntimeError::Internal(format!("forwarded query failed: {e}"))))?;
            pages.push(answer.map_err(to_status)?);
        }
        let page = forward::merge_pages(pages, max_bytes);
        Ok(Response::new(pb::QueryResponse {
            store: args.store,
            results: page.results,
            next_page_token: page.next.as_ref().map(request::page_token).unwrap_or_default(),
        }))
    }

    async fn produce(
        &self,
        request: Request<pb::ProduceRequest>,
    ) -> Result<Response<pb::ProduceResponse>, Status> {
        let role = role_of(&request);
        let (topic, records) =
            request::produce_batch(request.into_inner(), self.produce_limits()).map_err(to_status)?;
        self.check_topic_access(role, &topic, "Produce to")?;
        let app = self.app.clone();
        let name = topic.clone();
        // A durable log answers once the records are on disk: off the async workers.
        let positions = blocking(move || app.produce(&name, records)).await?;
        let mut ranges = PartitionRanges::default();
        ranges.add(&positions);
        Ok(Response::new(pb::ProduceResponse {
            topic,
            record_count: ranges.record_count(),
            positions: positions.iter().map(convert::record_position).collect(),
            partitions: ranges.to_proto(),
        }))
    }

    async fn read_topic(
        &self,
        request: Request<pb::ReadTopicRequest>,
    ) -> Result<Response<pb::ReadTopicResponse>, Status> {
        let role = role_of(&request);
        let request::TopicReadArgs {
            topic,
            partition,
            offset,
            max_records,
        } = request::topic_read(request.into_inner()).map_err(to_status)?;
        self.check_topic_access(role, &topic, "ReadTopic of")?;
        let app = self.app.clone();
        let name = topic.clone();
        // A durable log is read from disk: off the async workers.
        let max_bytes = self.app.config().max_response_bytes;
        let read =
            blocking(move || app.read_topic_page(&name, partition, offset, max_records, max_bytes)).await?;
        Ok(Response::new(convert::topic_read(topic, partition, read)))
    }

    /// One call is all or nothing where the log can append it so (the embedded
    /// log): batches are checked as they arrive, held (up to
    /// `max_produce_stream_bytes`) and appended at once when the stream ends, so
    /// an error anywhere writes nothing. On Kafka each batch is appended as it
    /// arrives and an error says how many were written before it.
    async fn produce_stream(
        &self,
        request: Request<Streaming<pb::ProduceRequest>>,
    ) -> Result<Response<pb::ProduceResponse>, Status> {
        let role = role_of(&request);
        let mut written = Written::default();
        self.append_stream(role, request.into_inner(), &mut written)
            .await
            .map(Response::new)
            .map_err(|error| status::partly_written(error, written.batches, written.records))
    }
}

/// What a ProduceStream appended before it failed (Kafka only: the embedded
/// log writes a stream at its end).
#[derive(Default)]
struct Written {
    batches: u64,
    records: u64,
}

/// What a produced record holds in memory: its key, value and headers.
fn produced_bytes(record: &ProducerRecord) -> usize {
    crate::log::payload_bytes(record.key.as_deref(), &record.value, &record.headers)
}

/// Runs a blocking runtime call on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    call: impl FnOnce() -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(call)
        .await
        .map_err(|e| to_status(RuntimeError::Internal(format!("blocking call failed: {e}"))))?
        .map_err(to_status)
}
