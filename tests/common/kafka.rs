//! Apache Kafka for the tests: one real broker per test binary, in KRaft mode
//! (one process is broker and controller) on free loopback ports, started on
//! first use and killed when the test binary exits, even after a panic.
//!
//! The jars come from Maven Central through `tests/kafka/pom.xml`, copied once
//! (under a file lock, so parallel test binaries share one copy) into
//! `<cargo target dir>/kafka-broker/`. Only std is used, so both the root
//! package's tests (`mod common`) and the server's tests (a `#[path]` include)
//! compile this file. Tests skip, saying why, only when `java` or `mvn` is
//! missing; with `TASKSTREAM_REQUIRE_KAFKA=1` (set by `.ci/run`) that fails too.
//!
//! Every test of a binary shares the broker: give topics and groups names from
//! [`unique`]. The bench harness (`bench/src/broker.rs`) includes this file too
//! and starts brokers of its own with [`launch`], stopped with [`Broker::stop`].
#![allow(dead_code)]

use std::fs::{self, File};
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

/// The broker's settings beyond listeners and storage: a single node (every
/// replication factor 1), few threads for a 2-core machine, and group and
/// transaction timings short enough for tests that kill members.
const TEST_PROPERTIES: &[(&str, &str)] = &[
    ("num.partitions", "1"),
    ("default.replication.factor", "1"),
    ("min.insync.replicas", "1"),
    ("auto.create.topics.enable", "false"),
    ("offsets.topic.replication.factor", "1"),
    ("offsets.topic.num.partitions", "4"),
    ("transaction.state.log.replication.factor", "1"),
    ("transaction.state.log.min.isr", "1"),
    ("transaction.state.log.num.partitions", "4"),
    ("share.coordinator.state.topic.replication.factor", "1"),
    ("share.coordinator.state.topic.min.isr", "1"),
    ("num.network.threads", "2"),
    ("num.io.threads", "2"),
    ("background.threads", "2"),
    ("log.cleaner.threads", "1"),
    // Classic groups: no initial delay, and sessions as short as clients ask.
    ("group.initial.rebalance.delay.ms", "0"),
    ("group.min.session.timeout.ms", "1000"),
    // KIP-848 groups: members notice assignment changes and deaths quickly.
    ("group.consumer.min.session.timeout.ms", "2000"),
    ("group.consumer.session.timeout.ms", "6000"),
    ("group.consumer.min.heartbeat.interval.ms", "200"),
    ("group.consumer.heartbeat.interval.ms", "500"),
    // Transactions of a killed producer are aborted within seconds, so
    // read_committed readers are not held back for the default minute.
    (
        "transaction.abort.timed.out.transaction.cleanup.interval.ms",
        "1000",
    ),
    ("transaction.max.timeout.ms", "60000"),
    // Compaction runs soon after a test writes a compacted topic.
    ("log.cleaner.backoff.ms", "1000"),
];

/// JVM settings: a modest heap and the serial collector (no GC threads
/// competing for 2 cores).
const JVM_OPTIONS: &[&str] = &[
    "-Xms128m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-Djava.awt.headless=true",
];

/// How long the broker may take to answer after its JVM starts (it takes
/// seconds; far longer on a machine busy compiling).
const START_DEADLINE: Duration = Duration::from_secs(180);

/// A running broker, shared by every test of the binary.
pub struct Broker {
    /// `host:port` for `bootstrap.servers`.
    pub bootstrap: String,
    /// Kafka's StorageTool formatting the data dir (a JVM of its own).
    pub formatted_in: Duration,
    /// From the broker JVM's launch to the first answered request.
    pub started_in: Duration,
    pub pid: u32,
    /// The run directory: `server.properties`, `broker.log`, the data.
    pub dir: PathBuf,
    classpath: String,
    child: Mutex<Child>,
}

/// The broker's JVM for the run directory `dir`.
fn broker_command(dir: &Path, classpath: &str) -> Command {
    let mut java = Command::new("java");
    java.args(JVM_OPTIONS)
        .arg(format!(
            "-Dlog4j2.configurationFile={}",
            dir.join("log4j2.properties").display()
        ))
        .arg(format!("-Dkafka.logs.dir={}", dir.join("logs").display()))
        .args(["-cp", classpath, "kafka.Kafka"])
        .arg(dir.join("server.properties"));
    java
}

impl Broker {
    /// The broker's resident memory now (VmRSS), in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// Kills the broker and waits for it (a broker from [`launch`]; the
    /// shared one of [`broker`] dies with the process). Its run directory is
    /// removed.
    pub fn stop(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }

    /// Kills the broker (SIGKILL: no clean shutdown) and starts it again on
    /// the same ports and data; answers once it answers again, with how long
    /// it was gone. The ports stay free meanwhile only by luck of the
    /// kernel's ephemeral range, so a failed bind is reported, not retried.
    #[allow(dead_code)]
    pub fn restart(&self) -> Result<Duration, String> {
        let stopped = Instant::now();
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
        *child = spawn_tied_to_this_process(
            broker_command(&self.dir, &self.classpath),
            &self.dir.join("broker.log"),
        )?;
        let address: SocketAddr = self
            .bootstrap
            .parse()
            .map_err(|e| format!("the broker's address {}: {e}", self.bootstrap))?;
        while !answers_api_versions(address) {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "the restarted broker exited ({status}); its log ends with:\n{}",
                    log_tail(&self.dir.join("broker.log"))
                ));
            }
            if stopped.elapsed() > START_DEADLINE {
                return Err(format!(
                    "the restarted broker did not answer within {START_DEADLINE:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(stopped.elapsed())
    }

    /// Panics (with the end of the broker's log) if the broker has exited.
    pub fn assert_running(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the Kafka broker exited ({status}); its log ends with:\n{}",
                log_tail(&self.dir.join("broker.log"))
            );
        }
    }
}

enum State {
    Ready(Broker),
    /// java or mvn is missing: the reason, printed by each skipping test.
    Skip(String),
    Failed(String),
}

/// The broker of this test binary, started on first call; `None` when java or
/// mvn is missing (the reason is printed), so the test returns early.
pub fn broker() -> Option<&'static Broker> {
    static STATE: OnceLock<State> = OnceLock::new();
    match STATE.get_or_init(start) {
        State::Ready(broker) => {
            broker.assert_running();
            Some(broker)
        }
        State::Skip(reason) => {
            if std::env::var_os("TASKSTREAM_REQUIRE_KAFKA").is_some_and(|v| v != "0" && !v.is_empty()) {
                panic!("TASKSTREAM_REQUIRE_KAFKA is set but {reason}");
            }
            eprintln!("skipping: {reason}");
            None
        }
        State::Failed(message) => panic!("{message}"),
    }
}

/// A name no other test (of this or a concurrent run) uses: `<prefix>-<pid>-<n>`.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Why no broker can run here (`java` or `mvn` missing), or `None`.
pub fn missing_tool() -> Option<String> {
    for (tool, args) in [("java", ["-version"]), ("mvn", ["-v"])] {
        let found = Command::new(tool)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if found.is_err() {
            return Some(format!(
                "the Kafka tests need `{tool}` on PATH (Java 17+ and Maven run the Apache Kafka broker)"
            ));
        }
    }
    None
}

fn start() -> State {
    if let Some(reason) = missing_tool() {
        return State::Skip(reason);
    }
    match launch() {
        Ok(broker) => {
            eprintln!(
                "kafka broker: {} (pid {}): storage formatted in {:.1} s, answered {:.1} s after launch, \
                 RSS {} MiB; log: {}",
                broker.bootstrap,
                broker.pid,
                broker.formatted_in.as_secs_f64(),
                broker.started_in.as_secs_f64(),
                broker
                    .rss_kib()
                    .map_or("?".to_string(), |k| (k / 1024).to_string()),
                broker.dir.join("broker.log").display()
            );
            State::Ready(broker)
        }
        Err(message) => State::Failed(message),
    }
}

/// Starts a new broker (formatting its storage first) in a run directory of
/// its own, `<target>/kafka-broker/run-<pid>-<n>`, and waits until it answers.
/// It dies with this process; [`Broker::stop`] ends it sooner.
pub fn launch() -> Result<Broker, String> {
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let base = target_dir()?.join("kafka-broker");
    fs::create_dir_all(&base).map_err(|e| format!("create {}: {e}", base.display()))?;
    let libs = fetch_jars(&base)?;
    remove_stale_runs(&base);
    let dir = base.join(format!(
        "run-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    fs::write(dir.join("log4j2.properties"), LOG4J2).map_err(|e| format!("write log4j2.properties: {e}"))?;
    let classpath = format!("{}/*", libs.display());

    // Free ports are found by binding port 0; another process may take one
    // before the broker binds it, so a bind failure is retried on new ports.
    let mut last_error = String::new();
    for _ in 0..3 {
        let [broker_port, controller_port] = free_ports()?;
        let properties = server_properties(&dir, broker_port, controller_port);
        fs::write(dir.join("server.properties"), properties)
            .map_err(|e| format!("write server.properties: {e}"))?;
        let _ = fs::remove_dir_all(dir.join("data"));
        let formatting = Instant::now();
        format_storage(&dir, &classpath)?;
        let formatted_in = formatting.elapsed();
        let launched = Instant::now();
        let child = spawn_tied_to_this_process(broker_command(&dir, &classpath), &dir.join("broker.log"))?;
        let pid = child.id();
        let broker = Broker {
            bootstrap: format!("127.0.0.1:{broker_port}"),
            formatted_in,
            started_in: Duration::ZERO,
            pid,
            dir: dir.clone(),
            classpath: classpath.clone(),
            child: Mutex::new(child),
        };
        let address = SocketAddr::from(([127, 0, 0, 1], broker_port));
        loop {
            if answers_api_versions(address) {
                return Ok(Broker {
                    started_in: launched.elapsed(),
                    ..broker
                });
            }
            let exited = broker
                .child
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .try_wait()
                .ok()
                .flatten();
            if let Some(status) = exited {
                let tail = log_tail(&dir.join("broker.log"));
                last_error = format!(
                    "the Kafka broker exited ({status}) before answering; its log ends with:\n{tail}"
                );
                if tail.contains("Address already in use") {
                    break;
                }
                return Err(last_error);
            }
            if launched.elapsed() > START_DEADLINE {
                let _ = broker.child.lock().unwrap_or_else(|e| e.into_inner()).kill();
                return Err(format!(
                    "the Kafka broker did not answer within {START_DEADLINE:?}; its log ends with:\n{}",
                    log_tail(&dir.join("broker.log"))
                ));
            }
            // Polling the broker's port: it takes seconds to come up.
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Err(last_error)
}

/// `<target>` from the executable's path: a test's `<target>/<profile>/deps/<test>`,
/// or the bench's `<target>/<profile>/taskstream-bench` (cargo marks `<target>`
/// with a `CACHEDIR.TAG`).
fn target_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("the test executable's path: {e}"))?;
    exe.ancestors()
        .skip(1)
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .or_else(|| exe.ancestors().nth(3))
        .map(Path::to_path_buf)
        .ok_or_else(|| format!("{} is not in <target>/<profile>/deps", exe.display()))
}

/// The repository's `tests/kafka/pom.xml`, found from the including package's
/// manifest dir (the root package or `server/`).
fn pom() -> Result<PathBuf, String> {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|dir| dir.join("tests/kafka/pom.xml"))
        .find(|pom| pom.is_file())
        .ok_or_else(|| "tests/kafka/pom.xml not found above the package".to_string())
}

/// Copies the broker's jars once per pom version, under a lock shared by
/// concurrent test binaries; later runs reuse them.
fn fetch_jars(base: &Path) -> Result<PathBuf, String> {
    let pom = pom()?;
    let text = fs::read(&pom).map_err(|e| format!("read {}: {e}", pom.display()))?;
    let libs = base.join(format!("jars-{:016x}", fnv1a(&text)));
    let lock_path = base.join("jars.lock");
    let lock = File::create(&lock_path).map_err(|e| format!("create {}: {e}", lock_path.display()))?;
    lock.lock()
        .map_err(|e| format!("lock {}: {e}", lock_path.display()))?;
    if libs.join(".complete").is_file() {
        return Ok(libs);
    }
    let partial = base.join("jars.partial");
    let _ = fs::remove_dir_all(&partial);
    let started = Instant::now();
    let output = Command::new("mvn")
        .args(["-B", "-q", "-f"])
        .arg(&pom)
        .args(["dependency:copy-dependencies", "-DincludeScope=runtime"])
        .arg(format!("-DoutputDirectory={}", partial.display()))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("run mvn: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "mvn could not fetch the Kafka broker ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    File::create(partial.join(".complete")).map_err(|e| format!("mark the jars complete: {e}"))?;
    let _ = fs::remove_dir_all(&libs);
    fs::rename(&partial, &libs).map_err(|e| format!("move the jars into {}: {e}", libs.display()))?;
    eprintln!(
        "kafka broker: fetched the jars with Maven in {:.1} s into {}",
        started.elapsed().as_secs_f64(),
        libs.display()
    );
    Ok(libs)
}

/// Run directories of test binaries that are gone (a killed run leaves one).
fn remove_stale_runs(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        // `run-<pid>-<n>` (older runs: `run-<pid>`).
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("run-"))
            .and_then(|n| n.split('-').next())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

fn server_properties(dir: &Path, broker_port: u16, controller_port: u16) -> String {
    let mut text = format!(
        "process.roles=broker,controller\n\
         node.id=1\n\
         controller.quorum.voters=1@127.0.0.1:{controller_port}\n\
         listeners=PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}\n\
         advertised.listeners=PLAINTEXT://127.0.0.1:{broker_port}\n\
         controller.listener.names=CONTROLLER\n\
         inter.broker.listener.name=PLAINTEXT\n\
         listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
         log.dirs={}\n",
        dir.join("data").display()
    );
    for (key, value) in TEST_PROPERTIES {
        text.push_str(&format!("{key}={value}\n"));
    }
    text
}

/// Kafka's StorageTool writes the KRaft metadata of a new cluster into the
/// data dir; the broker refuses to start on an unformatted one.
fn format_storage(dir: &Path, classpath: &str) -> Result<(), String> {
    let output = Command::new("java")
        .args(["-Xmx256m", "-XX:+UseSerialGC"])
        .arg(format!(
            "-Dlog4j2.configurationFile={}",
            dir.join("log4j2.properties").display()
        ))
        .args(["-cp", classpath, "kafka.tools.StorageTool", "format"])
        // `=`: a generated id may start with `-`, which would read as an option.
        .arg(format!("--cluster-id={}", cluster_id()))
        .arg(format!("--config={}", dir.join("server.properties").display()))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("run java: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "Kafka's StorageTool failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// A Kafka cluster id: 16 bytes in URL-safe base64 without padding.
fn cluster_id() -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let seed = nanos ^ (u128::from(std::process::id()) << 64);
    let bytes = seed.to_le_bytes();
    let mut bits = 0u32;
    let mut count = 0;
    let mut id = String::new();
    for byte in bytes {
        bits = (bits << 8) | u32::from(byte);
        count += 8;
        while count >= 6 {
            count -= 6;
            id.push(ALPHABET[((bits >> count) & 63) as usize] as char);
        }
    }
    if count > 0 {
        id.push(ALPHABET[((bits << (6 - count)) & 63) as usize] as char);
    }
    id
}

/// Spawns `command` so that it dies with this test process: a dedicated
/// thread that lives as long as the process spawns it through
/// `setpriv --pdeathsig KILL`, and Linux kills it when that thread ends —
/// at a normal exit, a panic, or SIGKILL of the test binary alike. (The
/// parent-death signal follows the spawning *thread*, hence the keeper.)
fn spawn_tied_to_this_process(command: Command, log: &Path) -> Result<Child, String> {
    type Request = (Command, PathBuf, mpsc::Sender<Result<Child, String>>);
    static KEEPER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    let keeper = KEEPER.get_or_init(|| {
        let (sender, requests) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("kafka-broker-keeper".into())
            .spawn(move || {
                // Never returns while the process lives: the sender is in a static.
                for (command, log, reply) in requests {
                    let _ = reply.send(spawn_with_pdeathsig(command, &log));
                }
            })
            .expect("spawn the broker keeper thread");
        Mutex::new(sender)
    });
    let (reply, answer) = mpsc::channel();
    keeper
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, log.to_path_buf(), reply))
        .map_err(|_| "the broker keeper thread is gone".to_string())?;
    answer
        .recv()
        .map_err(|_| "the broker keeper thread is gone".to_string())?
}

fn spawn_with_pdeathsig(command: Command, log: &Path) -> Result<Child, String> {
    // Appended to: a restarted broker's log follows its first life's.
    let out = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("open {}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| format!("{}: {e}", log.display()))?;
    let mut wrapped = Command::new("setpriv");
    wrapped
        .args(["--pdeathsig", "KILL", "--"])
        .arg(command.get_program())
        .args(command.get_args())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    wrapped.spawn().map_err(|e| {
        format!("cannot start the broker through `setpriv --pdeathsig` (util-linux), which ties it to the tests: {e}")
    })
}

/// Two free ports, distinct: both stay bound until both are known (one bound
/// and released, then another, could give the same port twice, which Kafka
/// refuses for its two listeners).
fn free_ports() -> Result<[u16; 2], String> {
    let bind = || TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind 127.0.0.1:0: {e}"));
    let listeners = [bind()?, bind()?];
    let port = |listener: &TcpListener| {
        listener
            .local_addr()
            .map(|a| a.port())
            .map_err(|e| format!("the bound port: {e}"))
    };
    Ok([port(&listeners[0])?, port(&listeners[1])?])
}

/// Whether the broker answers an ApiVersions request (v0) without error:
/// Kafka accepts connections before it serves requests, so a connect alone
/// proves little.
fn answers_api_versions(address: SocketAddr) -> bool {
    let attempt = || -> std::io::Result<bool> {
        let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(1))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let client_id = b"taskstream-tests";
        let correlation_id: i32 = 0x7473;
        let mut request = Vec::new();
        request.extend_from_slice(&18i16.to_be_bytes()); // ApiVersions
        request.extend_from_slice(&0i16.to_be_bytes()); // version 0
        request.extend_from_slice(&correlation_id.to_be_bytes());
        request.extend_from_slice(&(client_id.len() as i16).to_be_bytes());
        request.extend_from_slice(client_id);
        let mut frame = (request.len() as i32).to_be_bytes().to_vec();
        frame.extend_from_slice(&request);
        stream.write_all(&frame)?;
        let mut size = [0u8; 4];
        stream.read_exact(&mut size)?;
        let size = i32::from_be_bytes(size);
        if !(6..1 << 20).contains(&size) {
            return Ok(false);
        }
        let mut response = vec![0u8; size as usize];
        stream.read_exact(&mut response)?;
        let answered_id = i32::from_be_bytes([response[0], response[1], response[2], response[3]]);
        let error_code = i16::from_be_bytes([response[4], response[5]]);
        Ok(answered_id == correlation_id && error_code == 0)
    };
    attempt().unwrap_or(false)
}

fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The broker logs at INFO to stdout, which the harness sends to `broker.log`.
const LOG4J2: &str = "\
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.apache.name = org.apache.kafka
logger.apache.level = INFO
";
