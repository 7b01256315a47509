//! Helpers shared by the end-to-end tests (grpcurl, python_grpcio, binary): an
//! in-process server on 127.0.0.1:0, a subprocess runner with a deadline, and
//! the tools the tests provision for themselves (`tools`), and the Apache Kafka
//! broker of the Kafka tests (`kafka`), and the tests' bearer tokens (`auth`).
//! Each test binary compiles this module on its own, hence the `dead_code` allows.

#[allow(dead_code)]
pub mod auth;
#[allow(dead_code)]
pub mod instance;
pub mod kafka;
#[allow(dead_code)]
pub mod tools;

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};
use taskstream_server::scratch::{TempDir, scratch_dir};
use taskstream_server::{Config, PipelineConfig, ProcessingOrder, ProcessorSpec, StreamsApp};

/// The embedded default (topic `events`, 8 partitions, store `counts`, N = 4,
/// T = 2, offset order) plus `ukeys` on the same topic, unordered with T = 2,
/// the store on which `in_order` must be refused.
#[allow(dead_code)]
pub fn config(addr: SocketAddr, application_id: &str) -> Config {
    let mut config = Config::embedded_default();
    config.application_id = application_id.into();
    config.application_server = addr.to_string();
    config.commit_interval_ms = 100;
    config.pipelines.push(PipelineConfig {
        name: "ukeys".into(),
        source_topic: "events".into(),
        partitions: None,
        processor: ProcessorSpec::Latest,
        num_threads_per_task: Some(2),
        processing_order: Some(ProcessingOrder::Unordered),
        store: None,
        retry_policy: None,
        sink_topic: None,
    });
    config
}

/// `service::serve` on its own runtime and thread; dropping it shuts the server
/// down (drain and commit) and joins the thread.
#[allow(dead_code)]
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

#[allow(dead_code)]
impl Server {
    /// Serves `config(addr, application_id)`.
    pub fn start(application_id: &str) -> Server {
        Server::start_with(application_id, |_| {})
    }

    /// Serves `config(addr, application_id)` as `change` leaves it.
    pub fn start_with(application_id: &str, change: impl FnOnce(&mut Config)) -> Server {
        // Bound before `serve` runs, so a client that connects early waits in
        // the backlog instead of being refused: no readiness race.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("non-blocking listener");
        let addr = listener.local_addr().expect("bound address");
        let mut config = config(addr, application_id);
        change(&mut config);
        let app = StreamsApp::start(config).expect("start the app");
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

    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Shuts down and asserts the server stopped cleanly.
    pub fn stop(mut self) {
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

/// What a finished subprocess left: its exit status and both outputs.
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn describe(&self) -> String {
        format!(
            "exit status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// Runs `command` to completion within `timeout`, killing it past the deadline.
pub fn run(mut command: Command, what: &str, timeout: Duration) -> Output {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
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

/// The server binary of this checkout (see [`workspace_binary`]).
#[allow(dead_code)]
pub fn server_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| workspace_binary("taskstream-server", "taskstream-server"))
}

/// The `taskstream` CLI of this checkout (see [`workspace_binary`]).
#[allow(dead_code)]
pub fn cli_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| workspace_binary("taskstream-client", "taskstream"))
}

/// The example `name` of the root package (`examples/<name>/main.rs`),
/// built as [`workspace_binary`] builds a binary.
#[allow(dead_code)]
pub fn example_binary(name: &str) -> PathBuf {
    build_next_to_tests("taskstream", &["--example", name], &format!("examples/{name}"))
}

#[allow(dead_code)]
/// A binary of this checkout, built next to the test executable: the root
/// package's tests do not build other packages' binaries, and a binary left
/// from an earlier build may be stale, so cargo is asked (a no-op when fresh).
fn workspace_binary(package: &str, bin: &str) -> PathBuf {
    build_next_to_tests(package, &["--bin", bin], bin)
}

/// Builds `what` (cargo's selection, e.g. `--bin NAME`) of `package` into
/// this test executable's target and profile; answers `<profile>/<path>`.
#[allow(dead_code)]
fn build_next_to_tests(package: &str, what: &[&str], path: &str) -> PathBuf {
    let bin = path;
    // <target>/<profile>/deps/<test>-HASH
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable lives in <target>/<profile>/deps");
    let target_dir = profile_dir.parent().expect("the target directory");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--quiet", "-p", package])
        .args(what)
        .arg("--target-dir")
        .arg(target_dir);
    match profile_dir.file_name().and_then(|name| name.to_str()) {
        Some("debug") => {}
        Some("release") => {
            build.arg("--release");
        }
        Some(profile) => {
            build.args(["--profile", profile]);
        }
        None => {}
    }
    let output = run(
        build,
        &format!("cargo build -p {package}"),
        Duration::from_secs(1800),
    );
    assert!(
        output.status.success(),
        "building {bin} failed:\n{}",
        output.describe()
    );
    let binary = profile_dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX));
    assert!(binary.is_file(), "no {bin} binary at {}", binary.display());
    binary
}

/// A fresh directory under the temp dir, removed on drop.
#[allow(dead_code)]
pub fn temp_dir(purpose: &str) -> TempDir {
    scratch_dir(purpose).unwrap_or_else(|e| panic!("cannot create a temp dir for {purpose}: {e}"))
}
