//! Servers in their own processes, so their peak RSS and restarts are their
//! own: the harness re-runs itself as `taskstream-bench __serve …`, either the
//! real `service::serve` over a `StreamsApp` or a bare tonic `StreamsService`
//! answering a canned `ProcessMetadataForStore` (with our server's HTTP/2
//! settings, so the two differ in what they do per call alone). The child
//! prints `ready ADDR` once it serves and stops gracefully when its stdin closes.

use crate::workload::{Keys, peak_rss, prefill};
use anyhow::{Context as _, anyhow, bail};
use prost::Message as _;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use taskstream::v1 as pb;
use taskstream::v1::streams_service_server::{StreamsService, StreamsServiceServer};
use taskstream_server::config::StoreKind;
use taskstream_server::metadata::TaskState;
use taskstream_server::{Config, PipelineConfig, ProcessorSpec, StreamsApp, TopicConfig};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

pub const TOPIC: &str = "events";
pub const STORE: &str = "counts";

/// What a child server runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// `app` (the real server) or `bare` (canned tonic server).
    pub bare: bool,
    pub partitions: u32,
    pub threads: usize,
    /// Records produced and processed in-process before `ready`.
    pub records: u64,
    pub keys: u32,
    pub value_bytes: usize,
    pub data_dir: Option<PathBuf>,
    pub store: Option<StoreKind>,
    /// The encoded response the bare server answers with.
    pub canned: Option<PathBuf>,
    /// On Apache Kafka: bootstrap servers, application id (the group) and
    /// group protocol (`consumer` or `classic`).
    pub kafka: Option<(String, String, String)>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            bare: false,
            partitions: 8,
            threads: 2,
            records: 0,
            keys: 10_000,
            value_bytes: 8,
            data_dir: None,
            store: None,
            canned: None,
            kafka: None,
        }
    }
}

impl ServeOptions {
    fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--mode".to_string(),
            if self.bare { "bare" } else { "app" }.to_string(),
            "--partitions".into(),
            self.partitions.to_string(),
            "--threads".into(),
            self.threads.to_string(),
            "--records".into(),
            self.records.to_string(),
            "--keys".into(),
            self.keys.to_string(),
            "--value-bytes".into(),
            self.value_bytes.to_string(),
        ];
        if let Some(dir) = &self.data_dir {
            args.extend(["--data-dir".into(), dir.display().to_string()]);
        }
        if let Some(store) = self.store {
            args.extend(["--store".into(), store.as_str().to_string()]);
        }
        if let Some(canned) = &self.canned {
            args.extend(["--canned".into(), canned.display().to_string()]);
        }
        if let Some((bootstrap, application, protocol)) = &self.kafka {
            args.extend(["--kafka".into(), format!("{bootstrap} {application} {protocol}")]);
        }
        args
    }

    fn from_args(args: &[String]) -> anyhow::Result<ServeOptions> {
        let mut options = ServeOptions::default();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().ok_or_else(|| anyhow!("{flag} needs a value"))?;
            match flag.as_str() {
                "--mode" => options.bare = value == "bare",
                "--partitions" => options.partitions = value.parse()?,
                "--threads" => options.threads = value.parse()?,
                "--records" => options.records = value.parse()?,
                "--keys" => options.keys = value.parse()?,
                "--value-bytes" => options.value_bytes = value.parse()?,
                "--data-dir" => options.data_dir = Some(PathBuf::from(value)),
                "--store" => {
                    options.store = Some(match value.as_str() {
                        "memory" => StoreKind::Memory,
                        "persistent" => StoreKind::Persistent,
                        other => bail!("unknown store kind `{other}`"),
                    })
                }
                "--canned" => options.canned = Some(PathBuf::from(value)),
                "--kafka" => {
                    let parts: Vec<&str> = value.split(' ').collect();
                    let [bootstrap, application, protocol] = parts[..] else {
                        bail!("--kafka needs `BOOTSTRAP APPLICATION PROTOCOL`");
                    };
                    options.kafka = Some((bootstrap.into(), application.into(), protocol.into()));
                }
                other => bail!("unknown flag `{other}`"),
            }
        }
        Ok(options)
    }

    /// The config of the real server: `count` per key on `events`, T = 1.
    pub fn config(&self, application_server: String) -> Config {
        let mut pipeline = PipelineConfig::new(STORE, TOPIC, ProcessorSpec::Count);
        pipeline.store = self.store;
        let per_task = self.records / self.partitions.max(1) as u64;
        let mut config = Config {
            application_id: "bench".into(),
            application_server,
            num_stream_threads: self.threads,
            num_threads_per_task: 1,
            commit_interval_ms: 200,
            // Every pre-processed outcome stays streamable from the earliest offset.
            outcome_retention_records: (per_task as usize * 2 + 10_000).max(100_000),
            data_dir: self.data_dir.clone(),
            topics: vec![TopicConfig::new(TOPIC, self.partitions)],
            pipelines: vec![pipeline],
            ..Config::default()
        };
        if let Some((bootstrap, application, protocol)) = &self.kafka {
            config.application_id = application.clone();
            config.bootstrap_servers = Some(bootstrap.clone());
            config.replication_factor = 1;
            config.outcome_retention_records = 100_000;
            if protocol == "classic" {
                config.group_protocol = taskstream_server::GroupProtocol::Classic;
                // The classic session is the client's; KIP-848's the broker's.
                config.kafka.insert("session.timeout.ms".into(), "6000".into());
                config.kafka.insert("heartbeat.interval.ms".into(), "500".into());
            }
        }
        config
    }
}

/// The child's entry point (`taskstream-bench __serve …`).
pub fn serve_main(args: &[String]) -> anyhow::Result<()> {
    let options = ServeOptions::from_args(args)?;
    let started = Instant::now();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("bind 127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("build the tokio runtime")?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // The parent closes our stdin to stop us (or dies, which closes it too).
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        let _ = stop_tx.send(());
    });
    let shutdown = async {
        let _ = stop_rx.await;
    };

    if options.bare {
        let path = options
            .canned
            .as_ref()
            .ok_or_else(|| anyhow!("--canned is required"))?;
        let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
        let canned = pb::ProcessMetadataForStoreResponse::decode(bytes.as_slice())?;
        announce(addr, started)?;
        // The HTTP/2 settings `service::serve` gives our server from the same config.
        // Keepalive matters most: with it hyper locks a per-connection mutex for every
        // frame (to know when the peer was last heard), which tonic's defaults skip.
        let config = options.config(addr.to_string());
        let millis = |ms: u64| (ms > 0).then(|| Duration::from_millis(ms));
        return runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            // As `service::serve` does (and `Server::serve(addr)` by default): TCP_NODELAY.
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            tonic::transport::Server::builder()
                .max_concurrent_streams(config.max_concurrent_streams)
                .http2_keepalive_interval(millis(config.http2_keepalive_interval_ms))
                .http2_keepalive_timeout(millis(config.http2_keepalive_timeout_ms))
                .add_service(
                    StreamsServiceServer::new(Bare { canned })
                        .max_decoding_message_size(config.max_message_bytes)
                        .max_encoding_message_size(config.max_message_bytes),
                )
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
                .context("bare server")
        });
    }

    let app = StreamsApp::start(options.config(addr.to_string())).context("start the app")?;
    if options.records > 0 {
        let log = app.log();
        prefill(
            log.as_ref(),
            TOPIC,
            options.partitions,
            options.records,
            Keys::Uniform {
                count: options.keys,
                seed: 7,
            },
            options.value_bytes,
        )?;
    }
    wait_restored(&app, Duration::from_secs(600))?;
    announce(addr, started)?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        taskstream_server::service::serve(app, listener, shutdown)
            .await
            .context("serve")
    })
}

/// Ready means serving with every task running and caught up: after a
/// restart, the store is restored (or rebuilt) up to the end of the log.
fn wait_restored(app: &StreamsApp, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(metadata) = app.process_metadata_for_store(STORE, false) {
            let ready = metadata
                .instances
                .iter()
                .flat_map(|i| &i.tasks)
                .all(|t| t.state == TaskState::Running && t.lag == 0);
            if ready {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            bail!("the app did not catch up within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn announce(addr: std::net::SocketAddr, started: Instant) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready {addr} {:.3}", started.elapsed().as_secs_f64())?;
    out.flush()?;
    Ok(())
}

/// A bare tonic server: the same generated service and HTTP/2 settings, a canned answer,
/// no runtime behind it.
struct Bare {
    canned: pb::ProcessMetadataForStoreResponse,
}

type EmptyStream = tokio_stream::Empty<Result<pb::GetMetadataAsyncResponse, Status>>;

#[tonic::async_trait]
impl StreamsService for Bare {
    async fn process_metadata_for_store(
        &self,
        _request: Request<pb::ProcessMetadataForStoreRequest>,
    ) -> Result<Response<pb::ProcessMetadataForStoreResponse>, Status> {
        Ok(Response::new(self.canned.clone()))
    }

    type GetMetadataAsyncStream = EmptyStream;

    async fn get_metadata_async(
        &self,
        _request: Request<pb::GetMetadataAsyncRequest>,
    ) -> Result<Response<EmptyStream>, Status> {
        Err(Status::unimplemented("bare benchmark server"))
    }

    async fn metadata_for_key(
        &self,
        _request: Request<pb::MetadataForKeyRequest>,
    ) -> Result<Response<pb::MetadataForKeyResponse>, Status> {
        Err(Status::unimplemented("bare benchmark server"))
    }

    async fn query(
        &self,
        _request: Request<pb::QueryRequest>,
    ) -> Result<Response<pb::QueryResponse>, Status> {
        Err(Status::unimplemented("bare benchmark server"))
    }

    async fn produce(
        &self,
        _request: Request<pb::ProduceRequest>,
    ) -> Result<Response<pb::ProduceResponse>, Status> {
        Err(Status::unimplemented("bare benchmark server"))
    }

    async fn produce_stream(
        &self,
        _request: Request<tonic::Streaming<pb::ProduceRequest>>,
    ) -> Result<Response<pb::ProduceResponse>, Status> {
        Err(Status::unimplemented("bare benchmark server"))
    }

    async fn read_topic(
        &self,
        _request: Request<pb::ReadTopicRequest>,
    ) -> Result<Response<pb::ReadTopicResponse>, Status> {
        Err(Status::unimplemented("bare benchmark server"))
    }
}

/// A child server process, seen from the harness.
pub struct ServerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    pub addr: String,
    /// From spawning the process until it printed `ready`.
    pub ready_after: Duration,
}

impl ServerProcess {
    /// Spawns `taskstream-bench __serve …` and waits (at most `timeout`) until it serves.
    pub fn spawn(options: &ServeOptions, timeout: Duration) -> anyhow::Result<ServerProcess> {
        let exe = std::env::current_exe().context("find the harness binary")?;
        let started = Instant::now();
        let mut child = Command::new(exe)
            .arg("__serve")
            .args(options.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawn the server process")?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        let mut server = ServerProcess {
            child,
            stdin,
            addr: String::new(),
            ready_after: Duration::ZERO,
        };
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("ready ") {
                        server.ready_after = started.elapsed();
                        server.addr = rest.split_whitespace().next().unwrap_or_default().to_string();
                        return Ok(server);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    bail!("the server process was not ready within {timeout:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = server.child.wait()?;
                    bail!("the server process exited before it was ready ({status})")
                }
            }
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Peak RSS of the server process so far.
    pub fn peak_rss(&self) -> Option<u64> {
        peak_rss(Some(self.child.id()))
    }

    /// CPU time (user + system) the server process has used so far, in seconds.
    pub fn cpu_seconds(&self) -> f64 {
        crate::repeat::cpu_seconds_of(Some(self.child.id()))
    }

    /// SIGKILL: no drain, no commit.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Closes stdin (graceful shutdown: drain and commit) and waits for the exit.
    pub fn stop(mut self, timeout: Duration) -> anyhow::Result<()> {
        drop(self.stdin.take());
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                if !status.success() {
                    bail!("the server process exited with {status}");
                }
                return Ok(());
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("the server process did not stop within {timeout:?}; killed it");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
