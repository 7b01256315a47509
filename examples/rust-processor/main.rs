//! A taskstream processor in Rust, built on the generated server trait
//! (`taskstream::v1::processor_service_server`): enriches each record and
//! counts records per key through state operations, like the Python example.
//!
//! ```sh
//! cargo run --release --example rust-processor -- 127.0.0.1:7000
//! ```

use bytes::Bytes;
use std::collections::HashMap;
use taskstream::v1 as pb;
use taskstream::v1::processor_service_server::{ProcessorService, ProcessorServiceServer};
use tonic::{Request, Response, Status};

struct Enricher;

#[tonic::async_trait]
impl ProcessorService for Enricher {
    async fn process(
        &self,
        request: Request<pb::ProcessRequest>,
    ) -> Result<Response<pb::ProcessResponse>, Status> {
        let request = request.into_inner();
        // The store's count of each key of this call (the pipeline sets
        // include_state = true), carried from one record to the next.
        let mut counts: HashMap<Bytes, u64> = request
            .state
            .into_iter()
            .map(|s| {
                let count = s
                    .value
                    .and_then(|v| std::str::from_utf8(&v).ok()?.parse().ok())
                    .unwrap_or(0);
                (s.key, count)
            })
            .collect();
        let results = request
            .records
            .into_iter()
            .map(|record| {
                use pb::record_result::Result as Answer;
                let Some(key) = record.key else {
                    return pb::RecordResult {
                        result: Some(Answer::Success(pb::RecordSuccess::default())),
                    };
                };
                let Ok(text) = std::str::from_utf8(&record.value) else {
                    // Retrying cannot help: straight to the dead-letter topic.
                    return pb::RecordResult {
                        result: Some(Answer::Failure(pb::RecordFailure {
                            kind: "NotUtf8".into(),
                            message: "value is not UTF-8".into(),
                            retryable: false,
                        })),
                    };
                };
                let count = counts.entry(key.clone()).or_default();
                *count += 1;
                let value = format!(
                    "{} (#{count} of {})",
                    text.to_uppercase(),
                    String::from_utf8_lossy(&key)
                );
                pb::RecordResult {
                    result: Some(Answer::Success(pb::RecordSuccess {
                        state_ops: vec![pb::StateOp {
                            key: key.clone(),
                            op: Some(pb::state_op::Op::Put(Bytes::from(count.to_string()))),
                        }],
                        outputs: vec![pb::OutputRecord {
                            key: Some(key),
                            value: Bytes::from(value),
                            headers: vec![pb::Header {
                                name: "source-offset".into(),
                                value: Bytes::from(record.offset.to_string()),
                            }],
                            ..Default::default()
                        }],
                    })),
                }
            })
            .collect();
        Ok(Response::new(pb::ProcessResponse { results }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:7000".into());
    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("processor listening on {}", listener.local_addr()?);
    tonic::transport::Server::builder()
        .add_service(ProcessorServiceServer::new(Enricher))
        // TCP_NODELAY on each connection: without it an answer can wait ~40 ms
        // for the client's delayed ACK.
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)))
        .await?;
    Ok(())
}
