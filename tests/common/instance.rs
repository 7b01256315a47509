//! The server binary as a test's instance: started on port 0 with a config
//! file, waited for until it prints `taskstream listening on ADDR`, signalled
//! (SIGKILL, SIGTERM, SIGSTOP/SIGCONT) and killed on drop. The Kafka tests
//! start several of one application; what they ask of a running instance
//! over gRPC (its own partitions and tasks, its counts) is here too.

use super::server_binary;
use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use taskstream_client::StreamsClient;
use taskstream_client::v1;

/// How long an instance may take to print its address (a busy machine
/// compiling beside the tests is slow to start a binary).
const START_DEADLINE: Duration = Duration::from_secs(60);

/// How an instance is started.
pub struct Launch<'a> {
    pub config: &'a Path,
    /// Kafka's `bootstrap.servers`; None for the embedded log.
    pub bootstrap: Option<&'a str>,
    /// Persistent stores (and, embedded, the log) in this dir; None: `--in-memory`.
    pub data_dir: Option<&'a Path>,
    /// `RUST_LOG` of the instance.
    pub log_filter: &'a str,
    /// Where its stderr (its log) goes: appended to this file, or inherited.
    pub log_file: Option<PathBuf>,
    pub env: Vec<(String, String)>,
}

impl<'a> Launch<'a> {
    /// An instance of `config` on Kafka at `bootstrap`, memory stores, log at info.
    pub fn kafka(config: &'a Path, bootstrap: &'a str) -> Launch<'a> {
        Launch {
            config,
            bootstrap: Some(bootstrap),
            data_dir: None,
            log_filter: "info",
            log_file: None,
            env: Vec::new(),
        }
    }

    pub fn data_dir(mut self, dir: Option<&'a Path>) -> Launch<'a> {
        self.data_dir = dir;
        self
    }

    pub fn log_filter(mut self, filter: &'a str) -> Launch<'a> {
        self.log_filter = filter;
        self
    }

    pub fn log_file(mut self, file: impl Into<PathBuf>) -> Launch<'a> {
        self.log_file = Some(file.into());
        self
    }

    pub fn env(mut self, name: &str, value: &str) -> Launch<'a> {
        self.env.push((name.to_string(), value.to_string()));
        self
    }

    pub fn start(&self) -> Instance {
        Instance::start(self)
    }
}

/// A running server binary, killed on drop.
pub struct Instance {
    child: Child,
    /// `host:port` it answers on (and advertises as `application_server`).
    pub address: String,
    /// `http://host:port`, for clients.
    pub addr: String,
    pub stdout: Vec<String>,
}

impl Instance {
    fn start(launch: &Launch<'_>) -> Instance {
        let mut command = Command::new(server_binary());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("TASKSTREAM_") {
                command.env_remove(name);
            }
        }
        command
            .envs(launch.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("RUST_LOG", launch.log_filter)
            .arg("--config")
            .arg(launch.config)
            .args(["--listen", "127.0.0.1:0"]);
        if let Some(bootstrap) = launch.bootstrap {
            command.args(["--bootstrap-servers", bootstrap]);
        }
        match launch.data_dir {
            Some(dir) => command.arg("--data-dir").arg(dir),
            None => command.arg("--in-memory"),
        };
        let stderr = match &launch.log_file {
            Some(path) => Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .unwrap_or_else(|e| panic!("open the log file {}: {e}", path.display())),
            ),
            None => Stdio::inherit(),
        };
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(stderr);
        let mut child = command.spawn().expect("start the server binary");
        let stdout = child.stdout.take().expect("stdout");
        let (lines, received) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    return;
                }
            }
        });
        let mut instance = Instance {
            child,
            address: String::new(),
            addr: String::new(),
            stdout: Vec::new(),
        };
        let deadline = Instant::now() + START_DEADLINE;
        while let Ok(line) = received.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            let address = line.strip_prefix("taskstream listening on ").map(str::to_owned);
            instance.stdout.push(line);
            if let Some(address) = address {
                instance.addr = format!("http://{address}");
                instance.address = address;
                return instance;
            }
        }
        let status = instance.child.try_wait().ok().flatten();
        panic!(
            "the server did not print `taskstream listening on` (exit: {status:?}); stdout:\n{}",
            instance.stdout.join("\n")
        );
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The port it listens on (and advertises as `application_server`).
    pub fn port(&self) -> u32 {
        self.address
            .rsplit(':')
            .next()
            .and_then(|port| port.parse().ok())
            .expect("a port in the address")
    }

    /// Sends `signal` (a name `kill` knows: TERM, STOP, CONT, …).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed: {status}");
    }

    /// SIGKILL: no drain, no commit, no leaving the group.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits (bounded) for the exit; answers whether it was clean.
    pub fn terminate(&mut self) -> bool {
        self.signal("TERM");
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the server") {
                return status.success();
            }
            assert!(
                Instant::now() < deadline,
                "the server did not exit within {START_DEADLINE:?} of SIGTERM"
            );
            // Polling the process: it drains and commits first.
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What an instance says of itself for `store` (its own entry of
/// ProcessMetadataForStore); `None` while it cannot answer.
pub async fn own_metadata(instance: &Instance, store: &str) -> Option<v1::StreamsMetadata> {
    let client = StreamsClient::connect(instance.addr.as_str()).await.ok()?;
    let metadata = client.process_metadata_for_store(store, false).await.ok()?;
    metadata
        .metadata
        .into_iter()
        .find(|m| m.host_info.as_ref().is_some_and(|h| h.port == instance.port()))
}

/// The partitions of `store` an instance says it hosts itself; `None` while it cannot answer.
pub async fn own_partitions(instance: &Instance, store: &str) -> Option<Vec<u32>> {
    let own = own_metadata(instance, store).await?;
    let mut partitions: Vec<u32> = own.topic_partitions.iter().map(|tp| tp.partition).collect();
    partitions.sort_unstable();
    Some(partitions)
}

/// Whether `instances` host disjoint shares of the `partitions` of `store`,
/// each at least one, covering all.
pub async fn share_all(instances: &[&Instance], store: &str, partitions: u32) -> bool {
    let mut all = Vec::new();
    for instance in instances {
        match own_partitions(instance, store).await {
            Some(own) if !own.is_empty() => all.extend(own),
            _ => return false,
        }
    }
    all.sort_unstable();
    all == (0..partitions).collect::<Vec<_>>()
}

/// The counts (decimal values) of `instances`' own partitions of `store`,
/// summed per key; `None` while one cannot answer.
pub async fn counts_of(instances: &[&Instance], store: &str) -> Option<BTreeMap<String, u64>> {
    let mut counts = BTreeMap::new();
    for instance in instances {
        let partitions = own_partitions(instance, store).await?;
        let client = StreamsClient::connect(instance.addr.as_str()).await.ok()?;
        let request = v1::QueryRequest {
            store: store.into(),
            query: Some(v1::query_request::Query::Range(v1::RangeQuery::default())),
            partitions,
            ..Default::default()
        };
        let response = client.query(request).await.ok()?;
        for entry in response.results.into_iter().flat_map(|r| r.entries) {
            let count: u64 = String::from_utf8_lossy(&entry.value).parse().ok()?;
            *counts
                .entry(String::from_utf8_lossy(&entry.key).into_owned())
                .or_default() += count;
        }
    }
    Some(counts)
}

/// Per-key sum of two counts.
pub fn add(a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    let mut sum = a.clone();
    for (key, n) in b {
        *sum.entry(key.clone()).or_default() += n;
    }
    sum
}

/// A small multi-threaded tokio runtime for a test's gRPC calls.
#[allow(dead_code)]
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Polls `condition` until it holds or `deadline` passes, then panics with
/// the last lines of the instances' `logs`; answers how long it took.
#[allow(dead_code)]
pub fn eventually_within(
    deadline: Duration,
    what: &str,
    logs: &[PathBuf],
    mut condition: impl FnMut() -> bool,
) -> Duration {
    let started = Instant::now();
    while !condition() {
        if started.elapsed() > deadline {
            for log in logs {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(30).collect();
                eprintln!("--- last lines of {}:", log.display());
                for line in tail.into_iter().rev() {
                    eprintln!("{line}");
                }
            }
            panic!("not within {deadline:?}: {what}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    started.elapsed()
}
