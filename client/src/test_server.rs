//! A scripted `StreamsService` on a real TCP port, for the client's unit tests:
//! it checks the callback contract and the wire mapping without the runtime.
//! (End-to-end tests against the real server live in the workspace's tests/.)

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
};

use taskstream::v1::{self, streams_service_server::StreamsService};
use tokio::sync::{Notify, mpsc};
use tokio_stream::{StreamExt, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};

use crate::StreamsClient;

type Item = Result<v1::GetMetadataAsyncResponse, Status>;

#[derive(Default)]
pub(crate) struct Fake {
    /// What `GetMetadataAsync` sends, in order.
    pub stream: Vec<Item>,
    /// Refuse the call itself with this status.
    pub open_error: Option<Status>,
    /// Keep the stream open after `stream` (an open `end`) instead of completing it.
    pub hold_open: bool,
    /// The query results `Query` answers.
    pub results: Vec<v1::PartitionResult>,
    pub metadata_calls: AtomicUsize,
    pub last_request: Mutex<Option<v1::GetMetadataAsyncRequest>>,
    /// Signalled once the client dropped a held-open stream.
    pub gone: Arc<Gone>,
    pub produced: Mutex<Vec<v1::ProduceRequest>>,
    /// The instances `ProcessMetadataForStore` lists.
    pub instances: Mutex<Vec<v1::StreamsMetadata>>,
    /// Refuse a start offset below this as the server does: OUT_OF_RANGE
    /// with ErrorInfo `OFFSET_OUT_OF_RANGE` and the earliest it retains.
    pub earliest: Option<i64>,
}

#[derive(Default)]
pub(crate) struct Gone {
    pub flag: AtomicBool,
    pub notify: Notify,
}

impl Gone {
    /// Waits (at most 5 s) until the server saw the client drop the stream.
    pub async fn wait(&self) -> bool {
        let wait = async {
            while !self.flag.load(Ordering::SeqCst) {
                self.notify.notified().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), wait)
            .await
            .is_ok()
    }
}

pub(crate) fn batch(partition: u32, offsets: std::ops::RangeInclusive<i64>) -> Item {
    Ok(v1::GetMetadataAsyncResponse {
        event: Some(v1::get_metadata_async_response::Event::Batch(v1::MetadataBatch {
            task_id: format!("counts_{partition}"),
            store: "counts".into(),
            topic: "events".into(),
            partition,
            thread: "stream-thread-1".into(),
            first_offset: *offsets.start(),
            last_offset: *offsets.end(),
            reprocessed: false,
            records: offsets
                .map(|offset| v1::RecordMetadata {
                    offset,
                    outcome: v1::RecordOutcome::Processed as i32,
                    attempts: 1,
                    ..Default::default()
                })
                .collect(),
        })),
    })
}

pub(crate) fn lagged(missed_batches: u64) -> Item {
    Ok(v1::GetMetadataAsyncResponse {
        event: Some(v1::get_metadata_async_response::Event::Lagged(v1::Lagged {
            missed_batches,
        })),
    })
}

/// Serves `fake` on 127.0.0.1:0 and connects a client to it.
pub(crate) async fn serve(fake: Fake) -> (StreamsClient, Arc<Fake>, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let fake = Arc::new(fake);
    let service = v1::streams_service_server::StreamsServiceServer::from_arc(fake.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let client = StreamsClient::connect(addr.to_string()).await.expect("connect");
    (client, fake, addr)
}

#[tonic::async_trait]
impl StreamsService for Fake {
    type GetMetadataAsyncStream = ReceiverStream<Item>;

    async fn process_metadata_for_store(
        &self,
        request: Request<v1::ProcessMetadataForStoreRequest>,
    ) -> Result<Response<v1::ProcessMetadataForStoreResponse>, Status> {
        Ok(Response::new(v1::ProcessMetadataForStoreResponse {
            in_order: request.into_inner().in_order,
            metadata: self.instances.lock().expect("lock").clone(),
            ..Default::default()
        }))
    }

    async fn get_metadata_async(
        &self,
        request: Request<v1::GetMetadataAsyncRequest>,
    ) -> Result<Response<Self::GetMetadataAsyncStream>, Status> {
        self.metadata_calls.fetch_add(1, Ordering::SeqCst);
        let request = request.into_inner();
        if let Some(earliest) = self.earliest
            && let Some((&partition, &start)) = request.start_offsets.iter().find(|(_, s)| **s < earliest)
        {
            use tonic_types::{ErrorDetails, StatusExt};
            return Err(Status::with_error_details(
                tonic::Code::OutOfRange,
                format!("offset {start} of partition {partition} is no longer retained"),
                ErrorDetails::with_error_info(
                    "OFFSET_OUT_OF_RANGE",
                    "taskstream",
                    std::collections::HashMap::from([
                        ("partition".to_string(), partition.to_string()),
                        ("requested".to_string(), start.to_string()),
                        ("earliest".to_string(), earliest.to_string()),
                    ]),
                ),
            ));
        }
        *self.last_request.lock().expect("lock") = Some(request);
        if let Some(status) = &self.open_error {
            return Err(Status::with_details_and_metadata(
                status.code(),
                status.message(),
                status.details().to_vec().into(),
                status.metadata().clone(),
            ));
        }
        let (tx, rx) = mpsc::channel(4);
        let items: Vec<Item> = self
            .stream
            .iter()
            .map(|item| match item {
                Ok(response) => Ok(response.clone()),
                Err(status) => Err(Status::with_details(
                    status.code(),
                    status.message(),
                    status.details().to_vec().into(),
                )),
            })
            .collect();
        let hold_open = self.hold_open;
        let gone = self.gone.clone();
        tokio::spawn(async move {
            for item in items {
                if tx.send(item).await.is_err() {
                    break;
                }
            }
            if hold_open {
                tx.closed().await;
                gone.flag.store(true, Ordering::SeqCst);
                gone.notify.notify_one();
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn metadata_for_key(
        &self,
        _request: Request<v1::MetadataForKeyRequest>,
    ) -> Result<Response<v1::MetadataForKeyResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn query(&self, request: Request<v1::QueryRequest>) -> Result<Response<v1::QueryResponse>, Status> {
        let request = request.into_inner();
        if request.store != "counts" {
            return Err(Status::not_found(format!("unknown store `{}`", request.store)));
        }
        Ok(Response::new(v1::QueryResponse {
            store: request.store,
            results: self.results.clone(),
            next_page_token: Default::default(),
        }))
    }

    async fn produce(
        &self,
        request: Request<v1::ProduceRequest>,
    ) -> Result<Response<v1::ProduceResponse>, Status> {
        let request = request.into_inner();
        let count = request.records.len() as u64;
        let topic = request.topic.clone();
        self.produced.lock().expect("lock").push(request);
        Ok(Response::new(v1::ProduceResponse {
            topic,
            record_count: count,
            ..Default::default()
        }))
    }

    async fn produce_stream(
        &self,
        request: Request<tonic::Streaming<v1::ProduceRequest>>,
    ) -> Result<Response<v1::ProduceResponse>, Status> {
        let mut stream = request.into_inner();
        let mut response = v1::ProduceResponse::default();
        while let Some(request) = stream.next().await {
            let request = request?;
            response.topic = request.topic.clone();
            response.record_count += request.records.len() as u64;
            self.produced.lock().expect("lock").push(request);
        }
        Ok(Response::new(response))
    }

    /// Echoes the request: one record at the requested offset, headers with a
    /// repeated name, and `end_offset` one past it; topic `nope` is NOT_FOUND.
    async fn read_topic(
        &self,
        request: Request<v1::ReadTopicRequest>,
    ) -> Result<Response<v1::ReadTopicResponse>, Status> {
        let request = request.into_inner();
        if request.topic == "nope" {
            return Err(Status::not_found(format!("unknown topic `{}`", request.topic)));
        }
        let header = |name: &str, value: &'static str| v1::Header {
            name: name.into(),
            value: value.into(),
        };
        Ok(Response::new(v1::ReadTopicResponse {
            topic: request.topic,
            partition: request.partition,
            records: vec![v1::TopicRecord {
                partition: request.partition,
                offset: request.offset,
                timestamp_ms: 1_000,
                key: Some("k".into()),
                value: format!("max {}", request.max_records).into(),
                headers: vec![header("h", "1"), header("h", "2")],
            }],
            start_offset: 0,
            end_offset: request.offset + 1,
            partitions: 4,
        }))
    }
}
