//! Connections to the gRPC port (real server on port 0, raw TCP and a real client): an
//! idle connection is closed after `idle_timeout_ms` but not while a call is open; a
//! truncated HTTP/2 preface is closed after `handshake_timeout_ms` however slowly it
//! drips; keepalive PINGs close a peer that stopped answering, and answered PINGs do
//! not keep an idle connection; one connection over `max_connections` is closed at once while existing ones
//! keep working, and new ones work once others close; under a 64-fd limit (`prlimit`
//! on the binary) the server logs the failing accept, does not spin, and serves again
//! once the connections close.

mod common;

use common::{Server, server_binary};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Bound on anything expected to happen promptly.
const DEADLINE: Duration = Duration::from_secs(30);

/// How late past its deadline a close may come on a loaded machine; every timeout
/// tested is far from it (the idle one is 5 minutes unless a test sets it).
const SLACK: Duration = Duration::from_secs(5);

/// The HTTP/2 client preface and an empty SETTINGS frame: a handshake, as far as the
/// client's part goes.
fn client_preface() -> Vec<u8> {
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    bytes.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    bytes
}

/// Reads (and drops) what the server sends until it closes the connection; `Err` if it
/// is still open after `limit`.
async fn until_closed(stream: &mut TcpStream, limit: Duration) -> Result<(), tokio::time::error::Elapsed> {
    tokio::time::timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
}

/// One HTTP/2 frame: its type, flags and payload.
async fn frame(stream: &mut TcpStream) -> std::io::Result<(u8, u8, Vec<u8>)> {
    let mut header = [0u8; 9];
    stream.read_exact(&mut header).await?;
    let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let mut payload = vec![0; length];
    stream.read_exact(&mut payload).await?;
    Ok((header[3], header[4], payload))
}

const PING: u8 = 0x6;
const ACK: u8 = 0x1;

/// A raw connection that has sent its preface, once the server answered it (so the
/// server has accepted it and holds it).
async fn handshaken(addr: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(&client_preface())
        .await
        .expect("send the preface");
    let (kind, _, _) = tokio::time::timeout(DEADLINE, frame(&mut stream))
        .await
        .expect("the server's SETTINGS in time")
        .expect("the server's SETTINGS");
    assert_eq!(kind, 0x4, "the server's first frame is SETTINGS");
    stream
}

async fn channel(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("a valid URI")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

async fn serving(channel: Channel) -> Result<(), tonic::Status> {
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await?
        .into_inner()
        .status;
    assert_eq!(status, ServingStatus::Serving as i32);
    Ok(())
}

/// A health check on a new connection, retried until it succeeds (bounded): the
/// server frees a connection's place when it notices the close, which a client
/// cannot await.
async fn serves_new_clients(addr: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let error = match channel(addr).await {
            Ok(channel) => match serving(channel).await {
                Ok(()) => return,
                Err(status) => status.to_string(),
            },
            Err(error) => error.to_string(),
        };
        assert!(
            Instant::now() < deadline,
            "no new client served within {DEADLINE:?}: {error}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// Two workers: `Server::stop` blocks one while the other lets the client's connection
// answer the server's GOAWAY (else shutdown waits out its grace period).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_after_the_idle_timeout_but_not_while_a_call_is_open() {
    let idle = Duration::from_millis(400);
    let server = Server::start_with("conn-idle", |config| {
        config.idle_timeout_ms = idle.as_millis() as u64;
    });
    let addr = server.addr();

    // No call at all: closed one idle timeout after the handshake.
    let started = Instant::now();
    let mut stream = handshaken(&addr).await;
    until_closed(&mut stream, DEADLINE)
        .await
        .expect("the idle connection closed");
    let lasted = started.elapsed();
    assert!(lasted >= idle, "closed after {lasted:?}, before the idle timeout");
    // Generous: the machine may be loaded; what matters is that it closes at all.
    assert!(lasted < idle + SLACK, "closed only after {lasted:?}");

    // A call open (a health Watch) keeps its connection, however long it is quiet.
    let channel = channel(&addr).await.expect("connect");
    let mut watch = HealthClient::new(channel.clone())
        .watch(HealthCheckRequest::default())
        .await
        .expect("watch")
        .into_inner();
    let first = watch.message().await.expect("the current status");
    assert_eq!(first.map(|m| m.status), Some(ServingStatus::Serving as i32));
    match tokio::time::timeout(idle * 4, watch.message()).await {
        Err(_elapsed) => {}
        Ok(ended) => panic!("the watch ended while its call was open: {ended:?}"),
    }
    // And the connection still answers calls.
    serving(channel).await.expect("a call on the watched connection");
    drop(watch);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_preface_is_closed_after_the_handshake_timeout_however_slowly_it_drips() {
    let handshake = Duration::from_millis(500);
    let server = Server::start_with("conn-handshake", |config| {
        config.handshake_timeout_ms = handshake.as_millis() as u64;
    });
    let addr = server.addr();

    // One byte every 50 ms: traffic, but never a whole preface in time.
    let started = Instant::now();
    let stream = TcpStream::connect(&addr).await.expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    let drip = tokio::spawn(async move {
        for byte in &client_preface()[..20] {
            if writer.write_all(&[*byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Then nothing more, with the connection left open.
        std::future::pending::<()>().await;
    });
    tokio::time::timeout(DEADLINE, async {
        let mut buf = [0u8; 4096];
        while let Ok(read) = reader.read(&mut buf).await
            && read > 0
        {}
    })
    .await
    .expect("the half-open connection closed");
    let lasted = started.elapsed();
    drip.abort();
    assert!(
        lasted >= handshake,
        "closed after {lasted:?}, before the handshake timeout"
    );
    assert!(lasted < handshake + SLACK, "closed only after {lasted:?}");

    // A whole preface is not held to the handshake timeout (and idling is 5 minutes).
    let mut stream = handshaken(&addr).await;
    assert!(
        until_closed(&mut stream, handshake * 3).await.is_err(),
        "a connection that completed its handshake was closed"
    );
    drop(stream);
    serves_new_clients(&addr).await;
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_over_the_cap_is_closed_at_once_and_new_ones_work_once_others_close() {
    let server = Server::start_with("conn-cap", |config| {
        config.max_connections = 3;
    });
    let addr = server.addr();

    // One client and two raw connections: the cap.
    let client = channel(&addr).await.expect("connect");
    serving(client.clone()).await.expect("the first client is served");
    let held = vec![handshaken(&addr).await, handshaken(&addr).await];

    // The fourth is accepted and closed before it says anything.
    let mut refused = TcpStream::connect(&addr).await.expect("TCP connect");
    until_closed(&mut refused, DEADLINE)
        .await
        .expect("the connection over the cap closed at once");
    // A client over the cap fails rather than hangs.
    let over = match channel(&addr).await {
        Ok(channel) => serving(channel).await.err().map(|status| status.to_string()),
        Err(error) => Some(error.to_string()),
    };
    assert!(over.is_some(), "a client over max_connections was served");

    // Connections in place keep working.
    serving(client.clone())
        .await
        .expect("the first client still served");

    // Once others close, new clients are served again.
    drop(held);
    serves_new_clients(&addr).await;
    drop(client);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_pings_close_a_silent_peer_and_answered_pings_do_not_keep_an_idle_connection() {
    // A peer that stops answering: pinged, then closed one keepalive timeout later.
    let (interval, timeout) = (Duration::from_millis(200), Duration::from_millis(300));
    let server = Server::start_with("conn-keepalive", |config| {
        config.http2_keepalive_interval_ms = interval.as_millis() as u64;
        config.http2_keepalive_timeout_ms = timeout.as_millis() as u64;
        config.idle_timeout_ms = 0;
    });
    let started = Instant::now();
    let mut stream = handshaken(&server.addr()).await;
    tokio::time::timeout(DEADLINE, async {
        while let Ok((kind, flags, _)) = frame(&mut stream).await {
            if kind == PING && flags & ACK == 0 {
                return;
            }
        }
        panic!("closed before any PING");
    })
    .await
    .expect("a keepalive PING");
    until_closed(&mut stream, DEADLINE)
        .await
        .expect("the silent peer's connection closed");
    let lasted = started.elapsed();
    assert!(lasted >= interval + timeout, "closed after {lasted:?}");
    server.stop();

    // A peer that answers every PING but makes no call is still idle.
    let idle = Duration::from_millis(600);
    let server = Server::start_with("conn-keepalive-idle", |config| {
        config.http2_keepalive_interval_ms = 100;
        config.http2_keepalive_timeout_ms = 1000;
        config.idle_timeout_ms = idle.as_millis() as u64;
    });
    let started = Instant::now();
    let mut stream = handshaken(&server.addr()).await;
    let mut answered = 0;
    tokio::time::timeout(DEADLINE, async {
        while let Ok((kind, flags, payload)) = frame(&mut stream).await {
            if kind == PING && flags & ACK == 0 {
                let mut ack = vec![0, 0, 8, PING, ACK, 0, 0, 0, 0];
                ack.extend_from_slice(&payload);
                if stream.write_all(&ack).await.is_err() {
                    return;
                }
                answered += 1;
            }
        }
    })
    .await
    .expect("the idle connection closed");
    let lasted = started.elapsed();
    assert!(answered >= 2, "only {answered} PINGs in {lasted:?}");
    assert!(lasted >= idle, "closed after {lasted:?}, before the idle timeout");
    assert!(
        lasted < idle + SLACK,
        "answered PINGs kept an idle connection for {lasted:?}"
    );
    server.stop();
}

/// The server binary under `prlimit`, with its stdout banner read and its stderr lines
/// forwarded as they come.
struct LimitedServer {
    child: Child,
    grpc: String,
    metrics: String,
    stderr: mpsc::Receiver<String>,
}

impl LimitedServer {
    fn start(nofile: u32) -> LimitedServer {
        let mut command =
            Command::new(system_tool("prlimit").unwrap_or_else(|| {
                panic!("`prlimit` (util-linux) is needed by this test and was not found")
            }));
        command
            .arg(format!("--nofile={nofile}:{nofile}"))
            .arg(server_binary());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("TASKSTREAM_") {
                command.env_remove(name);
            }
        }
        command
            .env("RUST_LOG", "info")
            // The connections this test opens stay without a preface.
            .env("TASKSTREAM_HANDSHAKE_TIMEOUT_MS", "0")
            .args([
                "--in-memory",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .expect("run prlimit (util-linux) with the server binary");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stderr.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let (banner_tx, banner) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if banner_tx.send(line).is_err() {
                    return;
                }
            }
        });
        // Killed and reaped on drop, also when it does not start.
        let mut server = LimitedServer {
            child,
            grpc: String::new(),
            metrics: String::new(),
            stderr: lines,
        };
        let deadline = Instant::now() + DEADLINE;
        loop {
            let Ok(line) = banner.recv_timeout(deadline.saturating_duration_since(Instant::now())) else {
                let _ = server.child.kill();
                let stderr: Vec<String> = server.stderr.try_iter().collect();
                panic!("the server did not start:\n{}", stderr.join("\n"));
            };
            if let Some(rest) = line.trim().strip_prefix("metrics:") {
                let url = rest.split_whitespace().next().unwrap_or_default();
                server.metrics = url
                    .trim_start_matches("http://")
                    .trim_end_matches("/metrics")
                    .to_string();
            }
            if let Some(addr) = line.strip_prefix("taskstream listening on ") {
                server.grpc = addr.trim().to_string();
                assert!(
                    !server.metrics.is_empty(),
                    "the banner names the metrics address first"
                );
                return server;
            }
        }
    }

    /// Waits (bounded) for a stderr line with every one of `words`.
    fn expect_log(&self, words: &[&str]) -> String {
        let deadline = Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            match self
                .stderr
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) if words.iter().all(|word| line.contains(word)) => return line,
                Ok(line) => seen.push(line),
                Err(_) => panic!(
                    "no log line with {words:?}; the server logged:\n{}",
                    seen.join("\n")
                ),
            }
        }
    }

    /// User + system CPU time of the process so far.
    fn cpu_time(&self) -> Duration {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).expect("read /proc/PID/stat");
        // Fields after the command (which may hold spaces) start at the state, field 3.
        let fields: Vec<&str> = stat[stat.rfind(')').expect("(comm)") + 2..].split(' ').collect();
        let ticks: u64 =
            fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
        Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second())
    }
}

impl Drop for LimitedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A system tool, on PATH or where Debian puts it (CI's test PATH may leave out a
/// directory for another reason).
fn system_tool(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin", "/bin", "/usr/sbin", "/sbin"].map(std::path::PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The unit of /proc's CPU times: USER_HZ, 100 unless getconf says otherwise.
fn clock_ticks_per_second() -> f64 {
    system_tool("getconf")
        .and_then(|getconf| Command::new(getconf).arg("CLK_TCK").output().ok())
        .and_then(|output| String::from_utf8_lossy(&output.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

#[test]
fn out_of_file_descriptors_the_server_logs_waits_without_spinning_and_serves_again() {
    let server = LimitedServer::start(64);

    // More connections than the process has fds: the gRPC listener accepts until it has
    // none left; the rest wait in the backlog. One more to the metrics port fails too.
    let mut held: Vec<std::net::TcpStream> = (0..100)
        .map(|_| std::net::TcpStream::connect(&server.grpc).expect("TCP connect (backlog)"))
        .collect();
    let line = server.expect_log(&["cannot accept connections", "Too many open files", "grpc"]);
    eprintln!("logged: {line}");
    held.push(std::net::TcpStream::connect(&server.metrics).expect("TCP connect to metrics (backlog)"));
    let line = server.expect_log(&["cannot accept connections", "Too many open files", "metrics"]);
    eprintln!("logged: {line}");

    // Still out of fds: the accept loops wait instead of spinning a core.
    let window = Duration::from_secs(2);
    let before = server.cpu_time();
    std::thread::sleep(window);
    let used = server.cpu_time().saturating_sub(before);
    eprintln!("CPU time over {window:?} out of fds: {used:?}");
    assert!(
        used < window / 5,
        "the server used {used:?} of CPU in {window:?} out of fds"
    );

    // The clients go; the server serves again.
    drop(held);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(serves_new_clients(&server.grpc));
    let metrics = scrape_when_served(&server.metrics);
    assert!(
        metrics.contains("taskstream_accept_errors_total{listener=\"grpc\"}")
            && metrics.contains("taskstream_accept_errors_total{listener=\"metrics\"}"),
        "the failed accepts are counted:\n{metrics}"
    );
}

/// `GET /metrics`, retried (bounded) until the metrics listener answers.
fn scrape_when_served(addr: &str) -> String {
    use std::io::{Read as _, Write as _};
    let deadline = Instant::now() + DEADLINE;
    loop {
        let answer = std::net::TcpStream::connect(addr).and_then(|mut stream| {
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            stream.write_all(b"GET /metrics HTTP/1.1\r\nhost: test\r\n\r\n")?;
            let mut text = String::new();
            stream.read_to_string(&mut text)?;
            Ok(text)
        });
        match answer {
            Ok(text) if text.starts_with("HTTP/1.1 200") => return text,
            other => assert!(Instant::now() < deadline, "metrics not served again: {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
