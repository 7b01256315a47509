//! The `taskstream-server` binary as a process: invalid configurations exit
//! with code 2 naming the setting; file < environment < flags reach
//! DescribeRuntime; SIGTERM turns health NOT_SERVING, commits and exits 0.
//! The binary is built once per run (`cargo build -p taskstream-server`).

mod common;

use common::{Output, run, server_binary, temp_dir};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use taskstream_client::{StreamsClient, keyed_record, v1};
use taskstream_server::scratch::TempDir;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Bound on anything the server is expected to do promptly (start, answer, exit).
const DEADLINE: Duration = Duration::from_secs(30);

/// The binary with a clean environment: no inherited `TASKSTREAM_*` setting
/// may leak into what a test asserts.
fn server_command() -> Command {
    let mut command = Command::new(server_binary());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TASKSTREAM_") {
            command.env_remove(name);
        }
    }
    command.env("RUST_LOG", "info");
    // No data dir under the repository: these tests are about config and signals.
    command.arg("--in-memory");
    command
}

/// A TOML file (its path) in a temp dir of its own, removed on drop.
struct ConfigFile(PathBuf, #[allow(dead_code)] TempDir);

impl ConfigFile {
    fn new(name: &str, text: &str) -> ConfigFile {
        let dir = temp_dir(name);
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).expect("write the config file");
        ConfigFile(path, dir)
    }
}

/// Runs the binary expecting it to refuse its configuration.
fn expect_invalid_config(mut command: Command, case: &str) -> Output {
    // Port 0: should the config be wrongly accepted, the server starts without
    // clashing with anything, and the deadline kills it.
    command.args(["--listen", "127.0.0.1:0"]);
    let output = run(command, case, DEADLINE);
    assert_eq!(
        output.status.code(),
        Some(2),
        "{case}: expected exit code 2\n{}",
        output.describe()
    );
    assert!(
        !output.stdout.contains("listening on"),
        "{case}: it started\n{}",
        output.describe()
    );
    output
}

fn assert_names(output: &Output, case: &str, settings: &[&str]) {
    for setting in settings {
        assert!(
            output.stderr.contains(setting),
            "{case}: the message does not name `{setting}`\n{}",
            output.describe()
        );
    }
}

#[test]
fn fewer_stream_threads_than_threads_per_task_exits_2_naming_both() {
    let file = ConfigFile::new(
        "n-less-than-t",
        r#"
num_stream_threads = 2
num_threads_per_task = 4

[[pipelines]]
name = "counts"
source_topic = "events"
partitions = 8
processor = "count"
"#,
    );
    let mut command = server_command();
    command.arg("--config").arg(&file.0);
    let output = expect_invalid_config(command, "N = 2 < T = 4 in a file");
    assert_names(&output, "N < T", &["num_stream_threads", "num_threads_per_task"]);

    // The same mistake through the environment, over the embedded default (N = 4).
    let mut command = server_command();
    command.env("TASKSTREAM_NUM_THREADS_PER_TASK", "8");
    let output = expect_invalid_config(command, "T = 8 from the environment");
    assert_names(
        &output,
        "T from env",
        &["num_stream_threads", "num_threads_per_task"],
    );
}

#[test]
fn other_invalid_configurations_exit_2_naming_the_setting() {
    // A misspelt key is an error, not silently ignored.
    let file = ConfigFile::new("unknown-key", "num_stream_thread = 3\n");
    let mut command = server_command();
    command.arg("--config").arg(&file.0);
    let output = expect_invalid_config(command, "unknown key");
    assert_names(
        &output,
        "unknown key",
        &["num_stream_thread", &file.0.display().to_string()],
    );

    let file = ConfigFile::new("bad-order", "processing_order = \"sideways\"\n");
    let mut command = server_command();
    command.arg("--config").arg(&file.0);
    let output = expect_invalid_config(command, "bad processing_order");
    assert_names(&output, "bad processing_order", &["sideways"]);

    let missing = temp_dir("no-config");
    let mut command = server_command();
    command
        .arg("--config")
        .arg(missing.path().join("taskstream-no-such-config.toml"));
    let output = expect_invalid_config(command, "missing config file");
    assert_names(
        &output,
        "missing config file",
        &["config", "taskstream-no-such-config.toml"],
    );

    let mut command = server_command();
    command.env("TASKSTREAM_MAX_BATCH_RECORDS", "0");
    let output = expect_invalid_config(command, "max_batch_records = 0");
    assert_names(&output, "max_batch_records = 0", &["max_batch_records"]);

    // Every setting has its variable, flag or not; bad values name the
    // setting, the variable and what is accepted.
    let mut command = server_command();
    command.env("TASKSTREAM_RETRY_MAX_ATTEMPTS", "0");
    let output = expect_invalid_config(command, "TASKSTREAM_RETRY_MAX_ATTEMPTS=0");
    assert_names(&output, "retry_max_attempts = 0", &["retry_max_attempts"]);
    let mut command = server_command();
    command.env("TASKSTREAM_SLOW_SUBSCRIBER", "bogus");
    let output = expect_invalid_config(command, "TASKSTREAM_SLOW_SUBSCRIBER=bogus");
    assert_names(
        &output,
        "slow_subscriber from env",
        &["slow_subscriber", "TASKSTREAM_SLOW_SUBSCRIBER", "notify, fail"],
    );

    // A bad value in the file names the setting's path and the accepted values.
    let file = ConfigFile::new("bad-policy", "slow_subscriber = \"bogus\"\n");
    let mut command = server_command();
    command.arg("--config").arg(&file.0);
    let output = expect_invalid_config(command, "bad slow_subscriber");
    assert_names(
        &output,
        "bad slow_subscriber",
        &["`slow_subscriber`", "notify, fail"],
    );
    let file = ConfigFile::new(
        "bad-latency",
        "[[pipelines]]\nname = \"p\"\nsource_topic = \"t\"\nprocessor = { type = \"simulate\", latency_ms = \"x\" }\n",
    );
    let mut command = server_command();
    command.arg("--config").arg(&file.0);
    let output = expect_invalid_config(command, "bad latency_ms");
    assert_names(
        &output,
        "bad latency_ms",
        &["pipelines[0].processor.latency_ms", "[low, high]"],
    );
    assert!(!output.stderr.contains("LatencySpec"), "{}", output.describe());
}

/// What the server's stdout delivers, line by line, to a waiting test.
enum Line {
    Text(String),
    Closed,
}

/// A running server process, killed on drop if a test leaves it running.
struct ServerProcess {
    child: Child,
    addr: String,
    banner: Vec<String>,
    lines: mpsc::Receiver<Line>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl ServerProcess {
    /// Starts the binary on port 0 and waits for `taskstream listening on ADDR`.
    fn start(mut command: Command) -> ServerProcess {
        command
            .args(["--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("start the server binary");
        let stdout = child.stdout.take().expect("stdout");
        let mut stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(Line::Text(line)).is_err() {
                    return;
                }
            }
            let _ = tx.send(Line::Closed);
        });
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let mut server = ServerProcess {
            child,
            addr: String::new(),
            banner: Vec::new(),
            lines,
            stderr: Some(stderr),
        };
        let deadline = Instant::now() + DEADLINE;
        loop {
            match server.next_line(deadline) {
                Some(line) => {
                    let addr = line.strip_prefix("taskstream listening on ").map(str::to_owned);
                    server.banner.push(line);
                    if let Some(addr) = addr {
                        server.addr = addr;
                        return server;
                    }
                }
                None => {
                    let status = server.child.try_wait().ok().flatten();
                    panic!(
                        "the server did not print `taskstream listening on` (exit: {status:?})\n\
                         stdout:\n{}\nstderr:\n{}",
                        server.banner.join("\n"),
                        server.stop_and_collect_stderr()
                    );
                }
            }
        }
    }

    /// The next stdout line, or None once stdout closed or the deadline passed.
    fn next_line(&self, deadline: Instant) -> Option<String> {
        match self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(Line::Text(line)) => Some(line),
            Ok(Line::Closed) | Err(_) => None,
        }
    }

    fn stop_and_collect_stderr(&mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr
            .take()
            .and_then(|reader| reader.join().ok())
            .unwrap_or_default()
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed: {status}");
    }

    /// Waits (bounded) for the process to exit; returns its status, the rest of
    /// its stdout and all of its stderr.
    fn wait_for_exit(&mut self, timeout: Duration) -> (ExitStatus, Vec<String>, String) {
        let deadline = Instant::now() + timeout;
        let mut rest = Vec::new();
        // stdout closes when the process exits: no polling needed.
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(Line::Text(line)) => rest.push(line),
                Ok(Line::Closed) => break,
                Err(_) => {
                    let stderr = self.stop_and_collect_stderr();
                    panic!(
                        "the server did not exit within {timeout:?}; killed it\nstdout:\n{}\nstderr:\n{stderr}",
                        rest.join("\n")
                    );
                }
            }
        }
        let status = self.child.wait().expect("wait for the server");
        let stderr = self
            .stderr
            .take()
            .and_then(|reader| reader.join().ok())
            .unwrap_or_default();
        (status, rest, stderr)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

async fn connect(addr: &str) -> StreamsClient {
    tokio::time::timeout(DEADLINE, StreamsClient::connect(addr))
        .await
        .expect("connect timed out")
        .expect("connect to the server")
}

/// Polls (bounded) until every task of `store` has completed every record.
async fn wait_until_caught_up(client: &StreamsClient, store: &str, records: i64) -> Vec<v1::TaskMetadata> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let response = client
            .process_metadata_for_store(store, true)
            .await
            .expect("ProcessMetadataForStore");
        let tasks: Vec<v1::TaskMetadata> = response.metadata.into_iter().flat_map(|m| m.tasks).collect();
        let end: i64 = tasks.iter().map(|t| t.end_offset).sum();
        if end == records && tasks.iter().all(|t| t.watermark == t.end_offset) {
            return tasks;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the tasks did not catch up within {DEADLINE:?}: {tasks:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn sigterm_turns_health_not_serving_commits_and_exits_0() {
    let mut command = server_command();
    // No periodic commit before the signal: what gets committed, the shutdown commits.
    command.env("TASKSTREAM_COMMIT_INTERVAL_MS", "3600000");
    let mut server = ServerProcess::start(command);
    assert!(
        server.banner.iter().any(|l| l.contains("embedded default")),
        "{:#?}",
        server.banner
    );

    let runtime = runtime();
    let pid_signalled = runtime.block_on(async {
        let client = connect(&server.addr).await;
        let records: Vec<v1::ProducerRecord> = (0..200)
            .map(|i| keyed_record(format!("key-{}", i % 17), i.to_string()))
            .collect();
        let produced = client.produce("events", records).await.expect("produce");
        assert_eq!(produced.record_count, 200);

        let tasks = wait_until_caught_up(&client, "counts", 200).await;
        assert_eq!(tasks.len(), 8, "{tasks:#?}");
        let uncommitted: i64 = tasks.iter().map(|t| t.watermark - t.committed_offset).sum();
        assert_eq!(
            uncommitted, 200,
            "nothing committed before the signal: {tasks:#?}"
        );

        // Opened before the signal, so the switch to NOT_SERVING is seen live.
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect for health");
        let mut health = HealthClient::new(channel);
        let mut watch = health
            .watch(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("health Watch")
            .into_inner();
        let first = watch.message().await.expect("health status").expect("a status");
        assert_eq!(first.status(), ServingStatus::Serving);

        server.signal("TERM");
        let signalled = Instant::now();
        // Health changes before the drain starts, while the server still answers.
        let next = tokio::time::timeout(DEADLINE, watch.message())
            .await
            .expect("no health change within the deadline after SIGTERM")
            .expect("the health Watch failed")
            .expect("the health Watch ended without a status");
        assert_eq!(next.status(), ServingStatus::NotServing);
        signalled
    });
    // Every connection closed, so nothing holds the server's exit.
    drop(runtime);

    let (status, rest, stderr) = server.wait_for_exit(DEADLINE);
    let took = pid_signalled.elapsed();
    assert_eq!(
        status.code(),
        Some(0),
        "exit status {status}\nstdout:\n{}\nstderr:\n{stderr}",
        rest.join("\n")
    );
    assert!(
        rest.iter()
            .any(|l| l == "taskstream stopped: watermarks committed"),
        "no `stopped` line\nstdout:\n{}\nstderr:\n{stderr}",
        rest.join("\n")
    );
    assert!(stderr.contains("SIGTERM received"), "{stderr}");
    println!("exited 0 {took:?} after SIGTERM");
}

#[test]
fn config_file_then_environment_then_flags_reach_describe_runtime() {
    let file = ConfigFile::new(
        "layers",
        r#"
application_id = "from-file"
num_stream_threads = 3
num_threads_per_task = 2
processing_order = "key"

[[topics]]
name = "orders"
partitions = 3

[[pipelines]]
name = "totals"
source_topic = "orders"
processor = "sum"
"#,
    );
    let mut command = server_command();
    command
        .arg("--config")
        .arg(&file.0)
        .env("TASKSTREAM_NUM_STREAM_THREADS", "5")
        .env("TASKSTREAM_APPLICATION_ID", "from-env")
        .args(["--application-id", "from-flag"]);
    let mut server = ServerProcess::start(command);
    assert!(
        server.banner.iter().any(|l| l.contains("N = 5 stream threads")),
        "{:#?}",
        server.banner
    );

    runtime().block_on(async {
        let client = connect(&server.addr).await;
        let runtime = client.describe_runtime().await.expect("DescribeRuntime");
        // The flag beats the environment, which beats the file.
        assert_eq!(runtime.application_id, "from-flag");
        assert_eq!(runtime.num_stream_threads, 5, "{runtime:#?}");
        assert_eq!(runtime.threads.len(), 5, "{runtime:#?}");
        assert_eq!(runtime.state(), v1::ServiceState::Running);
        let port: u32 = server
            .addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .expect("port");
        assert_eq!(runtime.host_info.as_ref().map(|h| h.port), Some(port));
        // Settings only the file gives.
        let pipelines: BTreeMap<&str, &v1::PipelineMetadata> =
            runtime.pipelines.iter().map(|p| (p.name.as_str(), p)).collect();
        assert_eq!(
            pipelines.keys().copied().collect::<Vec<_>>(),
            ["totals"],
            "{runtime:#?}"
        );
        let totals = pipelines["totals"];
        assert_eq!(totals.source_topic, "orders");
        assert_eq!(totals.partitions, 3);
        assert_eq!(totals.processor, "sum");
        assert_eq!(totals.processing_order(), v1::ProcessingOrder::Key);
        assert_eq!(totals.threads_per_task, 2);
        assert_eq!(runtime.tasks.len(), 3, "{runtime:#?}");
    });

    server.signal("TERM");
    let (status, rest, stderr) = server.wait_for_exit(DEADLINE);
    assert_eq!(status.code(), Some(0), "{}\n{stderr}", rest.join("\n"));
}

/// `server_command` without `--in-memory`: the embedded default (application
/// `taskstream`, store `counts` on 8 partitions) on `--data-dir DIR`.
fn server_command_on_data_dir(dir: &Path) -> Command {
    let mut command = Command::new(server_binary());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TASKSTREAM_") {
            command.env_remove(name);
        }
    }
    command.env("RUST_LOG", "info").arg("--data-dir").arg(dir);
    command
}

/// Bytes that are no redb database (deterministic, neither zeros nor text).
fn garbage(len: usize) -> Vec<u8> {
    let mut state: u32 = 0x2545_f491;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as u8
        })
        .collect()
}

/// Writes garbage at `file` inside a fresh data dir, runs the server on the
/// dir and expects exit 2 with the file named on stderr and left as it was.
fn expect_refused_data_file(dir: &TempDir, file: &Path, case: &str) {
    std::fs::create_dir_all(file.parent().expect("a parent")).expect("create the file's directory");
    let bytes = garbage(16 * 1024);
    std::fs::write(file, &bytes).expect("write the garbage file");
    let output = expect_invalid_config(server_command_on_data_dir(dir.path()), case);
    let shown = file.display().to_string();
    assert_names(&output, case, &[&shown]);
    assert!(
        output.stderr.contains("error:"),
        "{case}: no error line\n{}",
        output.describe()
    );
    let after = std::fs::read(file).expect("the garbage file is still there");
    assert!(
        after == bytes,
        "{case}: {shown} was changed ({} bytes, was {}): the data dir must never be reset",
        after.len(),
        bytes.len()
    );
}

#[test]
fn a_garbage_log_file_exits_2_naming_it_and_is_left_untouched() {
    let dir = temp_dir("garbage-log");
    let log = dir.path().join("log.redb");
    expect_refused_data_file(&dir, &log, "garbage log.redb");
    // Refused before anything else was set up.
    assert!(
        !dir.path().join("stores").exists(),
        "stores were created next to a log that could not be opened"
    );
}

#[test]
fn a_garbage_store_file_exits_2_naming_it_and_is_left_untouched() {
    let dir = temp_dir("garbage-store");
    // A data dir in use (log, identity, stores), then one store replaced by garbage:
    // stores/<application_id>/<pipeline>_<partition>.redb.
    let mut config = taskstream_server::Config::embedded_default();
    config.data_dir = Some(dir.path().to_path_buf());
    drop(taskstream_server::datadir::open(&config).expect("prepare the data dir"));
    let store = dir.path().join("stores").join("taskstream").join("counts_5.redb");
    expect_refused_data_file(&dir, &store, "garbage stores/taskstream/counts_5.redb");
    assert!(
        dir.path().join("log.redb").is_file(),
        "the log should have been opened first"
    );
}

/// `GET /metrics` on the metrics address, as Prometheus scrapes it.
fn scrape(addr: &str) -> String {
    use std::io::Write as _;
    let mut socket = std::net::TcpStream::connect(addr).expect("connect to the metrics address");
    socket.set_read_timeout(Some(DEADLINE)).expect("read timeout");
    socket
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .expect("send the request");
    let mut response = String::new();
    socket.read_to_string(&mut response).expect("read the response");
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    response
}

#[test]
fn metrics_listen_serves_record_outcomes_retry_backlog_and_thread_states_to_prometheus() {
    let mut command = server_command();
    command
        .args(["--metrics-listen", "127.0.0.1:0"])
        .env("TASKSTREAM_COMMIT_INTERVAL_MS", "20");
    let mut server = ServerProcess::start(command);
    let metrics_addr = server
        .banner
        .iter()
        .find_map(|l| l.trim().strip_prefix("metrics:"))
        .and_then(|rest| rest.trim().strip_prefix("http://"))
        .and_then(|rest| rest.split('/').next())
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no metrics line in {:#?}", server.banner));

    runtime().block_on(async {
        let client = connect(&server.addr).await;
        let records: Vec<v1::ProducerRecord> = (0..300)
            .map(|i| keyed_record(format!("key-{}", i % 7), i.to_string()))
            .collect();
        client.produce("events", records).await.expect("produce");
        wait_until_caught_up(&client, "counts", 300).await;
    });
    let processed = r#"taskstream_records_total{pipeline="counts",outcome="processed"} 300"#;
    let deadline = Instant::now() + DEADLINE;
    let text = loop {
        let text = scrape(&metrics_addr);
        // Gauges are refreshed at each commit round: wait for one after the work.
        if text.contains(processed) && text.contains(r#"taskstream_lag_records{pipeline="counts"} 0"#) {
            break text;
        }
        assert!(Instant::now() < deadline, "{text}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(text.contains("# TYPE taskstream_records_total counter"), "{text}");
    assert!(
        text.contains(r#"taskstream_retry_backlog_records{pipeline="counts"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"taskstream_dead_letter_records{pipeline="counts"} 0"#),
        "{text}"
    );
    let threads: u32 = text
        .lines()
        .filter(|l| l.starts_with("taskstream_stream_threads{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u32>().ok())
        .sum();
    assert_eq!(threads, 4, "every stream thread is in one state: {text}");

    server.signal("TERM");
    let (status, rest, stderr) = server.wait_for_exit(DEADLINE);
    assert_eq!(status.code(), Some(0), "{}\n{stderr}", rest.join("\n"));
}
