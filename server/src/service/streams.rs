//! `taskstream.v1.StreamsService`: metadata, record-outcome streams, interactive
//! queries, produce and topic reads. Each handler checks its request, calls `StreamsApp`
//! and translates the answer; errors go through `status::to_status`.

use super::convert::{self, PartitionRanges};
use super::outcomes::{self, PumpSettings, STREAM_CHANNEL_CAPACITY, StreamItem};
use super::request::{self, StoreQuery};
use super::status::to_status;
use crate::runtime::{RuntimeError, StreamsApp};
use taskstream::v1 as pb;
use taskstream::v1::streams_service_server::StreamsService;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Serves `StreamsService` over one running `StreamsApp`.
#[derive(Clone)]
pub struct StreamsHandler {
    app: StreamsApp,
}

impl StreamsHandler {
    pub fn new(app: StreamsApp) -> Self {
        StreamsHandler { app }
    }
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
        Ok(Response::new(convert::store_metadata(&metadata)))
    }

    type GetMetadataAsyncStream = ReceiverStream<StreamItem>;

    async fn get_metadata_async(
        &self,
        request: Request<pb::GetMetadataAsyncRequest>,
    ) -> Result<Response<Self::GetMetadataAsyncStream>, Status> {
        let stream = request::metadata_stream(request.into_inner()).map_err(to_status)?;
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
        tokio::spawn(outcomes::pump(subscription, tx, settings));
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

    async fn query(&self, request: Request<pb::QueryRequest>) -> Result<Response<pb::QueryResponse>, Status> {
        let (store, query) = request::store_query(request.into_inner()).map_err(to_status)?;
        let app = self.app.clone();
        let name = store.clone();
        // A persistent store is read from disk: off the async workers.
        let results = blocking(move || match query {
            StoreQuery::Key(key) => Ok(vec![app.query_key(&name, &key)?]),
            StoreQuery::Range {
                from,
                to,
                partitions,
                limit,
            } => app.query_range(&name, from.as_deref(), to.as_deref(), &partitions, limit),
        })
        .await?;
        Ok(Response::new(pb::QueryResponse {
            store,
            results: results.into_iter().map(convert::partition_result).collect(),
        }))
    }

    async fn produce(
        &self,
        request: Request<pb::ProduceRequest>,
    ) -> Result<Response<pb::ProduceResponse>, Status> {
        let (topic, records) = request::produce_batch(request.into_inner()).map_err(to_status)?;
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
        let request::TopicReadArgs {
            topic,
            partition,
            offset,
            max_records,
        } = request::topic_read(request.into_inner()).map_err(to_status)?;
        let app = self.app.clone();
        let name = topic.clone();
        // A durable log is read from disk: off the async workers.
        let read = blocking(move || app.read_topic(&name, partition, offset, max_records)).await?;
        Ok(Response::new(convert::topic_read(topic, partition, read)))
    }

    /// Appends each batch as it arrives, so memory stays at one batch however
    /// long the stream. Batches appended before an error stay appended (as with
    /// a Kafka producer); the error says which batch failed.
    async fn produce_stream(
        &self,
        request: Request<Streaming<pb::ProduceRequest>>,
    ) -> Result<Response<pb::ProduceResponse>, Status> {
        let mut batches = request.into_inner();
        let mut topic: Option<String> = None;
        let mut ranges = PartitionRanges::default();
        let mut index = 0usize;
        while let Some(batch) = batches.next().await {
            let (batch_topic, records) = request::produce_batch(batch?).map_err(to_status)?;
            match &topic {
                None => topic = Some(batch_topic.clone()),
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
            let app = self.app.clone();
            let positions = blocking(move || app.produce(&batch_topic, records)).await?;
            ranges.add(&positions);
            index += 1;
        }
        let Some(topic) = topic else {
            return Err(to_status(RuntimeError::invalid_argument(
                "topic",
                "the stream carried no batch; send at least one ProduceRequest naming the topic",
            )));
        };
        Ok(Response::new(pb::ProduceResponse {
            topic,
            record_count: ranges.record_count(),
            positions: Vec::new(),
            partitions: ranges.to_proto(),
        }))
    }
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
