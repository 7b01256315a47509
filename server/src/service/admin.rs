//! `taskstream.v1.AdminService`: describe the runtime, add and remove stream
//! threads (as Kafka Streams KIP-663). Thin translation over `StreamsApp`.

use super::convert;
use super::status::to_status;
use crate::runtime::{Redrive, RuntimeError, StreamsApp};
use taskstream::v1 as pb;
use taskstream::v1::admin_service_server::AdminService;
use tonic::{Request, Response, Status};

/// Serves `AdminService` over one running `StreamsApp`.
#[derive(Clone)]
pub struct AdminHandler {
    app: StreamsApp,
}

impl AdminHandler {
    pub fn new(app: StreamsApp) -> Self {
        AdminHandler { app }
    }
}

#[tonic::async_trait]
impl AdminService for AdminHandler {
    async fn describe_runtime(
        &self,
        _request: Request<pb::DescribeRuntimeRequest>,
    ) -> Result<Response<pb::DescribeRuntimeResponse>, Status> {
        Ok(Response::new(convert::runtime_description(self.app.describe())))
    }

    async fn add_stream_thread(
        &self,
        _request: Request<pb::AddStreamThreadRequest>,
    ) -> Result<Response<pb::AddStreamThreadResponse>, Status> {
        let thread_name = self.app.add_stream_thread().map_err(to_status)?;
        // The count after the change, as the caller will see it in DescribeRuntime.
        let num_stream_threads = self.app.describe().num_stream_threads;
        tracing::info!(thread = %thread_name, num_stream_threads, "stream thread added");
        Ok(Response::new(pb::AddStreamThreadResponse {
            thread_name,
            num_stream_threads,
        }))
    }

    async fn remove_stream_thread(
        &self,
        request: Request<pb::RemoveStreamThreadRequest>,
    ) -> Result<Response<pb::RemoveStreamThreadResponse>, Status> {
        let request = request.into_inner();
        let name = Some(request.thread_name.as_str()).filter(|name| !name.is_empty());
        let thread_name = self.app.remove_stream_thread(name).map_err(to_status)?;
        let num_stream_threads = self.app.describe().num_stream_threads;
        tracing::info!(thread = %thread_name, num_stream_threads, "stream thread removed");
        Ok(Response::new(pb::RemoveStreamThreadResponse {
            thread_name,
            num_stream_threads,
        }))
    }

    async fn redrive_dead_letters(
        &self,
        request: Request<pb::RedriveDeadLettersRequest>,
    ) -> Result<Response<pb::RedriveDeadLettersResponse>, Status> {
        let request = request.into_inner();
        super::request::check_name("pipeline", &request.pipeline).map_err(to_status)?;
        let which = match (request.all, request.offsets.is_empty()) {
            (true, true) => Redrive::All,
            (true, false) => {
                return Err(to_status(RuntimeError::invalid_argument(
                    "offsets",
                    "give offsets or set `all`, not both",
                )));
            }
            (false, _) => Redrive::Offsets(
                request
                    .offsets
                    .iter()
                    .enumerate()
                    .map(|(i, &offset)| {
                        u64::try_from(offset).map_err(|_| {
                            to_status(RuntimeError::invalid_argument(
                                format!("offsets[{i}]"),
                                format!("{offset} is negative; offsets start at 0"),
                            ))
                        })
                    })
                    .collect::<Result<_, _>>()?,
            ),
        };
        let app = self.app.clone();
        let pipeline = request.pipeline.clone();
        let partition = request.partition;
        // Reads and appends to the log: off the async workers.
        let positions =
            tokio::task::spawn_blocking(move || app.redrive_dead_letters(&pipeline, partition, &which))
                .await
                .map_err(|e| to_status(RuntimeError::Internal(format!("redrive task failed: {e}"))))?
                .map_err(to_status)?;
        tracing::info!(
            pipeline = %request.pipeline,
            partition,
            redriven = positions.len(),
            "dead letters redriven"
        );
        Ok(Response::new(pb::RedriveDeadLettersResponse {
            redriven: positions.len() as u64,
            retry_positions: positions.iter().map(convert::record_position).collect(),
        }))
    }
}
