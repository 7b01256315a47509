//! What the server binary tells operators about its RPCs: with `--log-format json`
//! every line of its log is one JSON object, and with RUST_LOG at debug for the
//! service each call has an `rpc` span with its method, status code and
//! duration; with `--metrics-listen` a scrape counts calls by method and code
//! (`taskstream_rpc_requests_total`) and times them in a histogram
//! (`taskstream_rpc_duration_seconds`).

mod common;

use common::server_binary;
use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use taskstream_client::{ClientError, StreamsClient, keyed_record};

/// Bound on anything expected to happen promptly (start, answer, exit).
const DEADLINE: Duration = Duration::from_secs(30);
const PRODUCE: &str = "taskstream.v1.StreamsService/Produce";
const METADATA: &str = "taskstream.v1.StreamsService/ProcessMetadataForStore";

/// The binary, in memory, on port 0, with a clean environment and `args`; killed on drop.
struct Server {
    child: Child,
    addr: String,
    banner: Vec<String>,
    stdout: mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Server {
    fn start(args: &[&str], rust_log: &str) -> Server {
        let mut command = Command::new(server_binary());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("TASKSTREAM_") {
                command.env_remove(name);
            }
        }
        let mut child = command
            .env("RUST_LOG", rust_log)
            .args(["--in-memory", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the server binary");
        let stdout = child.stdout.take().expect("stdout");
        let mut stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let mut server = Server {
            child,
            addr: String::new(),
            banner: Vec::new(),
            stdout: lines,
            stderr: Some(stderr),
        };
        loop {
            match server.stdout.recv_timeout(DEADLINE) {
                Ok(line) => {
                    let addr = line.strip_prefix("taskstream listening on ").map(str::to_owned);
                    server.banner.push(line);
                    if let Some(addr) = addr {
                        server.addr = addr;
                        return server;
                    }
                }
                Err(_) => panic!("the server did not start: {:#?}", server.banner),
            }
        }
    }

    /// The metrics address from the banner's `metrics:` line.
    fn metrics_addr(&self) -> String {
        self.banner
            .iter()
            .find_map(|l| l.trim().strip_prefix("metrics:"))
            .and_then(|rest| rest.trim().strip_prefix("http://"))
            .and_then(|rest| rest.split('/').next())
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no metrics line in {:#?}", self.banner))
    }

    /// SIGTERM, then waits for the exit; answers the whole stderr.
    fn stop(mut self) -> String {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        // stdout closes when the process exits.
        let deadline = Instant::now() + DEADLINE;
        while self
            .stdout
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
        {}
        let status = self.child.wait().expect("wait for the server");
        let stderr = self
            .stderr
            .take()
            .and_then(|reader| reader.join().ok())
            .unwrap_or_default();
        assert_eq!(status.code(), Some(0), "{stderr}");
        stderr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `ok` Produce calls that succeed, `missing` to an unknown topic (NOT_FOUND), and `bad`
/// ProcessMetadataForStore calls with an empty store name (INVALID_ARGUMENT).
fn calls(addr: &str, ok: usize, missing: usize, bad: usize) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let client = tokio::time::timeout(DEADLINE, StreamsClient::connect(format!("http://{addr}")))
            .await
            .expect("connect timed out")
            .expect("connect");
        for i in 0..ok {
            client
                .produce("events", vec![keyed_record(format!("k{i}"), "1")])
                .await
                .expect("produce");
        }
        for _ in 0..missing {
            let error = client
                .produce("no-such-topic", vec![keyed_record("k", "1")])
                .await
                .expect_err("an unknown topic");
            assert!(matches!(error, ClientError::UnknownStore { .. }), "{error:?}");
        }
        for _ in 0..bad {
            let error = client
                .process_metadata_for_store("", false)
                .await
                .expect_err("an empty store name");
            assert!(matches!(error, ClientError::IllegalArgument { .. }), "{error:?}");
        }
    });
}

fn scrape(addr: &str) -> String {
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

/// The value of the series `name{labels}` in a scrape.
fn value(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn a_scrape_after_some_rpcs_counts_them_by_method_and_code_with_a_latency_histogram() {
    let server = Server::start(&["--metrics-listen", "127.0.0.1:0"], "info");
    let metrics = server.metrics_addr();
    calls(&server.addr, 7, 3, 2);
    let expected = [
        (PRODUCE, "OK", 7.0),
        (PRODUCE, "NOT_FOUND", 3.0),
        (METADATA, "INVALID_ARGUMENT", 2.0),
    ];
    // A call is recorded when its response has been sent, a moment after the client has it.
    let deadline = Instant::now() + DEADLINE;
    let text = loop {
        let text = scrape(&metrics);
        let done = expected.iter().all(|(method, code, count)| {
            value(
                &text,
                &format!(r#"taskstream_rpc_requests_total{{method="{method}",code="{code}"}}"#),
            ) == Some(*count)
        });
        if done {
            break text;
        }
        assert!(Instant::now() < deadline, "{text}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        text.contains("# TYPE taskstream_rpc_requests_total counter"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE taskstream_rpc_duration_seconds histogram"),
        "{text}"
    );
    for (method, code, count) in expected {
        let labels = format!(r#"method="{method}",code="{code}""#);
        assert_eq!(
            value(
                &text,
                &format!("taskstream_rpc_duration_seconds_count{{{labels}}}")
            ),
            Some(count),
            "{text}"
        );
        assert_eq!(
            value(
                &text,
                &format!(r#"taskstream_rpc_duration_seconds_bucket{{{labels},le="+Inf"}}"#)
            ),
            Some(count),
            "{text}"
        );
        let sum = value(&text, &format!("taskstream_rpc_duration_seconds_sum{{{labels}}}")).expect("a sum");
        assert!(sum > 0.0 && sum < count * DEADLINE.as_secs_f64(), "{sum}");
    }
    server.stop();
}

#[test]
fn log_format_json_writes_one_object_per_line_with_the_rpc_span_fields() {
    let server = Server::start(&["--log-format", "json"], "info,taskstream_server::service=debug");
    calls(&server.addr, 2, 1, 0);
    let stderr = server.stop();
    let mut objects = Vec::new();
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(value.is_object(), "not an object: {line}");
        objects.push(value);
    }
    assert!(
        objects.iter().any(|o| o["fields"]["message"] == "serving gRPC"),
        "{stderr}"
    );
    let finished: Vec<&serde_json::Value> = objects
        .iter()
        .filter(|o| o["fields"]["message"] == "rpc finished" && o["span"]["name"] == "rpc")
        .map(|o| &o["span"])
        .collect();
    let produced: Vec<&str> = finished
        .iter()
        .filter(|span| span["method"] == PRODUCE)
        .map(|span| {
            assert!(span["duration_ms"].as_f64().is_some_and(|ms| ms >= 0.0), "{span}");
            span["code"].as_str().expect("a code")
        })
        .collect();
    assert_eq!(produced, ["OK", "OK", "NOT_FOUND"], "{stderr}");
}

/// The sum of every series of `name` whose labels contain `label`.
fn sum_of(scrape: &str, name: &str, label: &str) -> f64 {
    scrape
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(label))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The largest value of any series of `name`.
fn max_of(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, f64::max)
}

/// Polls scrapes of `metrics` until `done` holds for one; answers it.
fn scrape_until(metrics: &str, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let text = scrape(metrics);
        if done(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "never saw {what} in:\n{text}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What each thread of each task is doing, after a known workload: records per
/// task add up to the records produced, a task is worked by T threads at once
/// under load, and the subscriber gauge follows streams opening and closing.
#[test]
fn per_task_and_per_thread_metrics_follow_a_known_workload() {
    let dir = taskstream_server::scratch::scratch_dir("telemetry").expect("scratch dir");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        r#"
application_id = "telemetry"
num_stream_threads = 4
num_threads_per_task = 2
commit_interval_ms = 20

[[topics]]
name = "events"
partitions = 4

[[pipelines]]
name = "counts"
source_topic = "events"
processor = { type = "simulate", latency_ms = 2 }
"#,
    )
    .expect("write the config");
    let server = Server::start(
        &[
            "--config",
            config.to_str().expect("utf-8 path"),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        "info",
    );
    let metrics = server.metrics_addr();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    const RECORDS: usize = 2_000;
    runtime.block_on(async {
        let client = StreamsClient::connect(format!("http://{}", server.addr))
            .await
            .expect("connect");
        let records = (0..RECORDS)
            .map(|i| keyed_record(format!("k{}", i % 50), "v"))
            .collect();
        client.produce("events", records).await.expect("produce");
    });
    // Under load, two threads are inside one task at a sample.
    scrape_until(&metrics, "a task worked by T = 2 threads", |text| {
        max_of(text, "taskstream_task_active_threads") >= 2.0
    });
    let text = scrape_until(&metrics, "every record processed, per task", |text| {
        sum_of(text, "taskstream_task_records_total", r#"outcome="processed""#) >= RECORDS as f64
    });
    assert_eq!(
        sum_of(&text, "taskstream_task_records_total", r#"outcome="processed""#),
        RECORDS as f64,
        "per-task counts add up to the records produced"
    );
    for partition in 0..4 {
        let task = format!(r#"task="counts_{partition}""#);
        assert!(
            sum_of(&text, "taskstream_task_records_total", &task) > 0.0,
            "{task}"
        );
        assert!(
            sum_of(&text, "taskstream_process_seconds_count", &task) > 0.0,
            "{task}"
        );
    }
    assert!(
        sum_of(
            &text,
            "taskstream_thread_busy_microseconds_total",
            r#"role="owner""#
        ) > 0.0
    );

    // 100 streams open, then all go away.
    runtime.block_on(async {
        let client = StreamsClient::connect(format!("http://{}", server.addr))
            .await
            .expect("connect");
        let handles: Vec<_> = (0..100)
            .map(|_| {
                client.get_metadata_async(
                    "counts",
                    taskstream_client::MetadataOptions::follow(),
                    |_: Result<taskstream_client::MetadataBatch, ClientError>| {},
                )
            })
            .collect();
        let metrics = metrics.clone();
        tokio::task::spawn_blocking(move || {
            scrape_until(&metrics, "100 subscribers", |text| {
                value(text, r#"taskstream_stream_subscribers{pipeline="counts"}"#) == Some(100.0)
            })
        })
        .await
        .expect("scrape");
        for handle in &handles {
            handle.cancel();
        }
        for handle in handles {
            handle.join().await;
        }
    });
    scrape_until(&metrics, "no subscriber left", |text| {
        value(text, r#"taskstream_stream_subscribers{pipeline="counts"}"#) == Some(0.0)
    });
    server.stop();
}
