//! The gRPC service: [`serve`] runs `StreamsService`, `AdminService`,
//! `grpc.health.v1` and server reflection (v1 and v1alpha) over one `StreamsApp`
//! (over TLS when `tls_cert` is set, see `tls`, which also secures the metrics
//! listener and forwarded queries),
//! and on shutdown drains the app and commits its watermarks. Handlers are a thin
//! translation (`request` in, `convert` out; `forward` asks the instance holding
//! a partition, in Kafka mode; `listener` accepts connections under their cap and
//! deadlines); `status::to_status` is the one place where
//! errors become `Status`. The service knows nothing of threads.

mod admin;
mod auth;
mod convert;
mod forward;
mod listener;
mod outcomes;
mod request;
mod status;
mod streams;
mod telemetry;
pub mod tls;
mod wire;

pub use admin::AdminHandler;
pub use auth::{Auth, AuthLayer, Caller, Role, Tokens, TokensError, required_role, role_of};
pub use listener::{AcceptBackoff, CallBody, CallsLayer, Connection, ConnectionLimits, CountCalls, Incoming};
pub use outcomes::STREAM_CHANNEL_CAPACITY;
pub use status::{
    ERROR_DOMAIN, MESSAGE_SIZE_SETTING, METADATA_OWNER, PRECONDITION_PROCESSING_ORDER, REASON_LIMIT_EXCEEDED,
    REASON_NOT_HOSTED, REASON_OFFSET_OUT_OF_RANGE, REASON_OFFSET_PAST_END, REASON_ROLE_REQUIRED,
    REASON_SUBSCRIBER_LAGGED, ServiceError, from_transport, to_status,
};
pub use streams::StreamsHandler;
pub use telemetry::{RpcTelemetry, RpcTelemetryLayer, code_name};
pub use wire::{WireStatus, WireStatusLayer};

use crate::health::StorageHealth;
use crate::runtime::{RuntimeError, StreamsApp};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;
use taskstream::v1::admin_service_server::AdminServiceServer;
use taskstream::v1::streams_service_server::StreamsServiceServer;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::server::NamedService;
use tonic::transport::Server;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// How long connections may stay open once the app has shut down. Streams of
/// record outcomes end by themselves then; what can remain is a client that
/// stopped reading or a health `Watch`, and neither should hold the exit.
const CONNECTION_GRACE: Duration = Duration::from_secs(5);

/// Health statuses kept by the server: overall ("") and each served service.
const HEALTH_SERVICES: [&str; 3] = [
    "",
    <StreamsServiceServer<StreamsHandler> as NamedService>::NAME,
    <AdminServiceServer<AdminHandler> as NamedService>::NAME,
];

/// The health statuses that follow storage health.
const HEALTH_SERVICES_NEEDING_STORAGE: [&str; 2] =
    ["", <StreamsServiceServer<StreamsHandler> as NamedService>::NAME];

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot build the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),

    #[error(transparent)]
    Tokens(#[from] TokensError),

    #[error(transparent)]
    Tls(#[from] tls::TlsError),

    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),

    /// Draining the runtime or committing its watermarks failed.
    #[error("the runtime did not shut down cleanly: {0}")]
    Shutdown(RuntimeError),
}

/// Serves `app` on `listener` until `shutdown` completes, then shuts down
/// gracefully: health goes NOT_SERVING, the app stops taking work (new calls get
/// UNAVAILABLE), drains what it has in hand and commits its watermarks, and the
/// server lets open calls finish (at most a few seconds) before returning.
///
/// The app is shut down whenever this returns, also when the server fails.
pub async fn serve(
    app: StreamsApp,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, ServingStatus::Serving).await;
    // While storage fails, the services that need it say so; until shutdown.
    let mut storage_follower = Some(tokio::spawn(follow_storage(health.clone(), app.storage_health())));
    // Each pipeline with a remote processor: NOT_SERVING while it waits for it.
    let processor_followers: Vec<_> = app
        .processor_waiting()
        .into_iter()
        .map(|(pipeline, waiting)| tokio::spawn(follow_processor(health.clone(), pipeline, waiting)))
        .collect();
    // Ended with the server; a pipeline's status means nothing after that.
    let _processor_followers = AbortOnDrop(processor_followers);

    // Both reflection versions: grpcurl 1.8.6 (PyPI) only speaks v1alpha. The
    // health and google.rpc descriptors let clients describe health and decode
    // error details without any .proto at hand.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(taskstream::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let (reflection_v1, reflection_v1alpha) = match app.config().reflection {
        true => (
            Some(reflection().build_v1()?),
            Some(reflection().build_v1alpha()?),
        ),
        false => (None, None),
    };
    // Read before serving: a tokens file that cannot be used stops the server.
    let tokens = match &app.config().auth_tokens {
        Some(path) => Some(Tokens::load(path)?),
        None => None,
    };
    if tokens.is_none() {
        tracing::warn!("no auth_tokens: every caller may call every RPC; serve on a trusted network only");
    }
    // Read before serving too: a certificate or key that cannot be used stops the server.
    let tls = tls::server_tls_config(app.config())?;
    let tls_mode = tls::TlsMode::of(app.config());
    if tls.is_none() && tokens.is_some() {
        tracing::warn!("auth_tokens without tls_cert: tokens cross the network in clear text");
    }
    // And how queries reach the other instances (Kafka): over TLS when this one serves it.
    let peer_tls = tls::peer_tls_config(app.config())?;
    let behind_tls = tls.is_some();
    let builder = match tls {
        Some(tls) => Server::builder().tls_config(tls)?,
        None => Server::builder(),
    };

    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, tls = ?tls_mode, "serving gRPC");
    }

    // Both directions: a request over it is refused, a response over it fails rather
    // than hold the whole of it in memory at once.
    let max_message = app.config().max_message_bytes;
    let max_streams = app.config().max_concurrent_streams;
    // Connection limits and deadlines (`listener`); keepalive pings find dead peers.
    let incoming = Incoming::new(listener, ConnectionLimits::from_config(app.config()));
    let incoming = if behind_tls {
        incoming.behind_tls()
    } else {
        incoming
    };
    let millis = |ms: u64| (ms > 0).then(|| Duration::from_millis(ms));
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let mut server = pin!(
        builder
            .max_concurrent_streams(max_streams)
            .http2_keepalive_interval(millis(app.config().http2_keepalive_interval_ms))
            .http2_keepalive_timeout(millis(app.config().http2_keepalive_timeout_ms))
            .layer(incoming.calls_layer())
            // Telemetry outside, so it counts the codes clients see.
            .layer(RpcTelemetryLayer)
            .layer(WireStatusLayer)
            .layer(AuthLayer::new(tokens))
            .add_service(health_service)
            .add_optional_service(reflection_v1)
            .add_optional_service(reflection_v1alpha)
            .add_service(
                StreamsServiceServer::new(StreamsHandler::with_peer_tls(app.clone(), peer_tls))
                    .max_decoding_message_size(max_message)
                    .max_encoding_message_size(max_message),
            )
            .add_service(
                AdminServiceServer::new(AdminHandler::new(app.clone()))
                    .max_decoding_message_size(max_message)
                    .max_encoding_message_size(max_message),
            )
            .serve_with_incoming_shutdown(incoming, async {
                // A dropped sender stops the server too, which is what an early return wants.
                let _ = stop_rx.await;
            })
    );

    let mut shutdown = pin!(shutdown);
    tokio::select! {
        result = &mut server => {
            // The server stopped without being asked (the listener failed):
            // still drain the app so no work in hand is lost.
            tracing::error!("gRPC server stopped unexpectedly; shutting the runtime down");
            stop_following(&mut storage_follower).await;
            let drained = drain(&app, &health).await;
            result?;
            return drained.map_err(ServeError::Shutdown);
        }
        () = &mut shutdown => {}
    }

    // Drain while the server still answers: clients get a retryable UNAVAILABLE
    // instead of a refused connection, and open outcome streams end with it.
    tracing::info!("shutting down: draining the runtime and committing watermarks");
    stop_following(&mut storage_follower).await;
    let drained = {
        let mut drain = pin!(drain(&app, &health));
        tokio::select! {
            drained = &mut drain => drained,
            result = &mut server => {
                let drained = drain.await;
                result?;
                return drained.map_err(ServeError::Shutdown);
            }
        }
    };

    match &drained {
        Ok(()) => tracing::info!("runtime drained and watermarks committed; closing connections"),
        Err(error) => tracing::error!(%error, "runtime shutdown failed; closing connections"),
    }
    let _ = stop_tx.send(());
    match tokio::time::timeout(CONNECTION_GRACE, &mut server).await {
        Ok(result) => result?,
        Err(_) => tracing::warn!(
            grace = ?CONNECTION_GRACE,
            "connections still open after the grace period; leaving them"
        ),
    }
    drained.map_err(ServeError::Shutdown)
}

/// Keeps the health of the services that need storage (StreamsService, and the server as a
/// whole) in step with it: NOT_SERVING while the log or a store fails, SERVING once all
/// recovered. AdminService does not need storage and stays SERVING.
async fn follow_storage(health: HealthReporter, storage: Arc<StorageHealth>) {
    let mut changes = storage.subscribe();
    loop {
        let status = if !storage.is_healthy() {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        };
        for service in HEALTH_SERVICES_NEEDING_STORAGE {
            health.set_service_status(service, status).await;
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// Aborts its tasks when dropped.
struct AbortOnDrop(Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// The health name of a pipeline: `taskstream.pipeline.<name>`.
pub fn pipeline_health_name(pipeline: &str) -> String {
    format!("taskstream.pipeline.{pipeline}")
}

/// Keeps the health of a pipeline with a remote processor: SERVING while the
/// processor answers, NOT_SERVING while the pipeline waits for it. Ends with the app.
async fn follow_processor(
    health: HealthReporter,
    pipeline: String,
    mut waiting: tokio::sync::watch::Receiver<bool>,
) {
    let name = pipeline_health_name(&pipeline);
    loop {
        let status = if *waiting.borrow_and_update() {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        };
        health.set_service_status(&name, status).await;
        if waiting.changed().await.is_err() {
            return;
        }
    }
}

/// Ends `follow_storage` before shutdown sets NOT_SERVING, so it cannot set SERVING after.
async fn stop_following(follower: &mut Option<tokio::task::JoinHandle<()>>) {
    if let Some(follower) = follower.take() {
        follower.abort();
        let _ = follower.await;
    }
}

async fn set_health(health: &HealthReporter, status: ServingStatus) {
    for service in HEALTH_SERVICES {
        health.set_service_status(service, status).await;
    }
}

/// Health NOT_SERVING, stop taking work, then the blocking drain and commit on
/// a blocking thread so the server keeps answering meanwhile.
async fn drain(app: &StreamsApp, health: &HealthReporter) -> Result<(), RuntimeError> {
    set_health(health, ServingStatus::NotServing).await;
    app.begin_shutdown();
    let app = app.clone();
    match tokio::task::spawn_blocking(move || app.shutdown()).await {
        Ok(result) => result,
        Err(join_error) => Err(RuntimeError::Internal(format!(
            "the runtime shutdown task failed: {join_error}"
        ))),
    }
}
