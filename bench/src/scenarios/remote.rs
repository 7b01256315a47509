//! remote: a pipeline whose processor is a remote `ProcessorService` — a Rust
//! tonic service in this process, on its own runtime, sleeping 2 ms per call —
//! with `max_records_per_call = 1`, 1 partition, T = 1…64 (N = T). The ideal is
//! min(T / 2 ms, the bare ceiling), where the bare ceiling is a plain tonic
//! client making the same calls with T in flight on one channel against the
//! same service, in the same run; target efficiency ≥ 0.9 at every T. Then the
//! price of the language boundary: records/s through a no-op remote processor
//! with `max_records_per_call = 100` against the in-process `count`.

use super::Ctx;
use crate::plot::{self, Chart, Series};
use crate::repeat::{self, Measured};
use crate::report::{ScenarioReport, Table, Verdict, group, rate, ratio};
use crate::workload::{self, Keys, deadline, run_fresh};
use bytes::Bytes;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use taskstream::v1 as pb;
use taskstream::v1::processor_service_client::ProcessorServiceClient;
use taskstream::v1::processor_service_server::{ProcessorService, ProcessorServiceServer};
use taskstream_server::{GrpcProcessorSpec, ProcessingOrder, ProcessorSpec};

const THREADS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
const LATENCY: Duration = Duration::from_millis(2);
const TARGET: f64 = 0.9;
const ROUNDS: usize = 3;

/// Answers success for every record after sleeping `sleep` (if any).
struct Sleeper {
    sleep: Duration,
}

#[tonic::async_trait]
impl ProcessorService for Sleeper {
    async fn process(
        &self,
        request: tonic::Request<pb::ProcessRequest>,
    ) -> Result<tonic::Response<pb::ProcessResponse>, tonic::Status> {
        if !self.sleep.is_zero() {
            tokio::time::sleep(self.sleep).await;
        }
        let records = request.into_inner().records.len();
        let success = pb::RecordResult {
            result: Some(pb::record_result::Result::Success(pb::RecordSuccess::default())),
        };
        Ok(tonic::Response::new(pb::ProcessResponse {
            results: vec![success; records],
        }))
    }
}

/// A processor service on its own 2-worker runtime, until dropped.
struct Served {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Served {
    fn start(sleep: Duration) -> anyhow::Result<Served> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bench-processor")
            .enable_all()
            .build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(ProcessorServiceServer::new(Sleeper { sleep }))
                // TCP_NODELAY on every accepted connection: an answer must not
                // wait for the client's delayed ACK.
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async {
                        let _ = stopped.await;
                    },
                ),
        );
        Ok(Served {
            addr,
            stop: Some(stop),
            runtime: Some(runtime),
        })
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// `calls` calls of one record each, `in_flight` at a time, over one channel
/// (one HTTP/2 connection, as the runtime uses): the bare ceiling.
fn bare_client(endpoint: &str, in_flight: usize, calls: u64) -> anyhow::Result<Measured> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-bare-client")
        .enable_all()
        .build()?;
    let load = repeat::load_average();
    let cpu = repeat::cpu_seconds();
    let seconds = runtime.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())?
            .tcp_nodelay(true)
            .connect()
            .await?;
        let client = ProcessorServiceClient::new(channel);
        let request = pb::ProcessRequest {
            pipeline: workload::STORE.into(),
            task: format!("{}_0", workload::STORE),
            source_topic: workload::TOPIC.into(),
            partition: 0,
            attempt: 1,
            deadline_ms: 0,
            records: vec![pb::ProcessRecord {
                offset: 0,
                timestamp_ms: 0,
                key: Some(Bytes::from_static(b"key-0000001")),
                value: Bytes::from_static(b"vvvvvvvv"),
                headers: vec![],
            }],
            state: vec![],
        };
        let started = Instant::now();
        let mut tasks = Vec::with_capacity(in_flight);
        for worker in 0..in_flight as u64 {
            let mut client = client.clone();
            let request = request.clone();
            // Calls split evenly; the first workers take the remainder.
            let mine = calls / in_flight as u64 + u64::from(worker < calls % in_flight as u64);
            tasks.push(tokio::spawn(async move {
                for _ in 0..mine {
                    client.process(request.clone()).await?;
                }
                Ok::<_, tonic::Status>(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        anyhow::Ok(started.elapsed().as_secs_f64())
    })?;
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(Measured {
        seconds,
        records: calls,
        cpu_seconds: repeat::cpu_seconds() - cpu,
        load,
        finished: true,
    })
}

fn remote_spec(endpoint: &str, max_records_per_call: usize) -> ProcessorSpec {
    let mut spec = GrpcProcessorSpec::new(endpoint);
    spec.max_records_per_call = max_records_per_call;
    ProcessorSpec::Grpc(spec)
}

pub fn run(ctx: &Ctx) -> anyhow::Result<ScenarioReport> {
    let seconds = ctx.variant_seconds();
    let rounds = ctx.pick(ROUNDS, 1);
    let keys = Keys::Uniform { count: 1000, seed: 3 };
    let latency_ms = LATENCY.as_secs_f64() * 1000.0;
    let mut report = ScenarioReport::new(
        "remote",
        "remote processors: T calls in flight per task, and the price of the language boundary",
        format!(
            "A Rust `ProcessorService` (tonic, in this process, on its own 2-worker runtime) that \
             sleeps {latency_ms} ms per call and answers success. Pipeline: `processor = {{ type = \
             \"grpc\", max_records_per_call = 1 }}`, 1 partition, {}, N = T stream threads, `offset` \
             order, prefilled with about {seconds} s of ideal work and timed from `start()` until the \
             watermark reaches the end. Bare ceiling = a plain tonic client making the same calls \
             (one record each) with T in flight over one channel against the same service, in the \
             same run. Ideal = min(T / {latency_ms} ms, bare ceiling); efficiency = ours / ideal. \
             CPU is this process's (runtime, client and the service together). \
             Every variant runs {rounds} times, alternating; medians and min–max. Boundary: records/s \
             through a no-op remote service (no sleep) with `max_records_per_call = 100` against the \
             in-process `count`, N = T = 1, 1 partition.",
            keys.describe()
        ),
    );
    let sleeper = Served::start(LATENCY)?;
    let records_for =
        |t: usize| ((seconds * t as f64 / LATENCY.as_secs_f64()).round() as u64).max(20 * t as u64);

    #[derive(Clone, Copy)]
    enum Job {
        Ours(usize),
        Bare(usize),
    }
    let jobs: Vec<Job> = THREADS
        .iter()
        .flat_map(|&t| [Job::Ours(t), Job::Bare(t)])
        .collect();
    let samples = repeat::alternate(&jobs, rounds, |job| match *job {
        Job::Ours(t) => {
            let config = workload::config(
                1,
                t,
                t,
                ProcessingOrder::Offset,
                remote_spec(&sleeper.endpoint(), 1),
            );
            Ok(run_fresh(config, records_for(t), keys, vec![], deadline(seconds))?.measured())
        }
        Job::Bare(t) => bare_client(&sleeper.endpoint(), t, records_for(t)),
    })?;
    let bare = |t: usize| {
        jobs.iter()
            .position(|j| matches!(j, Job::Bare(b) if *b == t))
            .map(|p| &samples[p])
    };
    let bare_rate = |t: usize| bare(t).map_or(0.0, repeat::Samples::median_rate);

    let mut table = Table::new(
        "T calls in flight (2 ms per call, one record per call)",
        &[
            "T",
            "records",
            "seconds (median)",
            "min–max",
            "records/s",
            "bare client calls/s",
            "T / latency",
            "ideal",
            "efficiency",
            "CPU µs/record",
            "bare CPU µs/call",
            "load",
            "target",
            "pass/miss",
        ],
    );
    let mut ours_line = Vec::new();
    let mut overloaded = false;
    for (job, runs) in jobs.iter().zip(&samples) {
        let Job::Ours(t) = *job else { continue };
        overloaded |= runs.overloaded();
        let absolute = t as f64 / LATENCY.as_secs_f64();
        let ideal = absolute.min(bare_rate(t));
        let efficiency = runs.median_rate() / ideal.max(1e-9);
        ours_line.push((t as f64, runs.median_rate()));
        table.row(vec![
            t.to_string(),
            group(records_for(t)),
            runs.median_seconds_cell(),
            runs.seconds_spread(),
            rate(runs.median_rate()),
            rate(bare_rate(t)),
            rate(absolute),
            rate(ideal),
            ratio(efficiency),
            format!("{:.1}", runs.cpu_us_per_record()),
            format!("{:.1}", bare(t).map_or(0.0, repeat::Samples::cpu_us_per_record)),
            runs.load_cell(),
            format!("≥ {TARGET}"),
            Verdict::of(runs.all_finished() && efficiency >= TARGET)
                .as_str()
                .into(),
        ]);
    }
    report.tables.push(table);
    drop(sleeper);

    // The language boundary: no-op remote, 100 records per call, vs in-process count.
    let noop = Served::start(Duration::ZERO)?;
    let records = ctx.pick(300_000u64, 20_000);
    let boundary_jobs = [false, true];
    let boundary = repeat::alternate(&boundary_jobs, rounds, |&remote| {
        let processor = if remote {
            remote_spec(&noop.endpoint(), 100)
        } else {
            ProcessorSpec::Count
        };
        let config = workload::config(1, 1, 1, ProcessingOrder::Offset, processor);
        Ok(run_fresh(config, records, keys, vec![], deadline(records as f64 / 20_000.0))?.measured())
    })?;
    let (count, remote) = (&boundary[0], &boundary[1]);
    let mut table = Table::new(
        "The language boundary (N = T = 1, 1 partition)",
        &[
            "processor",
            "records",
            "seconds (median)",
            "min–max",
            "records/s",
            "vs in-process count",
            "CPU µs/record",
            "load",
        ],
    );
    for (name, runs) in [
        ("in-process `count`", count),
        ("no-op remote, 100 records per call", remote),
    ] {
        overloaded |= runs.overloaded();
        table.row(vec![
            name.into(),
            group(records),
            runs.median_seconds_cell(),
            runs.seconds_spread(),
            rate(runs.median_rate()),
            ratio(runs.median_rate() / count.median_rate().max(1e-9)),
            format!("{:.1}", runs.cpu_us_per_record()),
            runs.load_cell(),
        ]);
    }
    report.tables.push(table);
    drop(noop);
    if overloaded {
        report.notes.push(
            "Some runs started with the load average above the core count: another process \
             shared the CPU."
                .into(),
        );
    }

    plot::draw(
        &ctx.plot_path("remote"),
        &Chart {
            title: format!("remote: ProcessorService sleeping {latency_ms} ms per call, 1 partition"),
            x_label: "threads per task T (N = T)".into(),
            y_label: "records/s".into(),
            log_x: true,
            series: vec![
                Series::line("ours (remote processor)", ours_line),
                Series::reference(
                    "bare tonic client, T in flight",
                    THREADS.iter().map(|&t| (t as f64, bare_rate(t))).collect(),
                ),
                Series::reference(
                    "T / latency",
                    THREADS
                        .iter()
                        .map(|&t| (t as f64, t as f64 / LATENCY.as_secs_f64()))
                        .collect(),
                ),
            ],
        },
    )?;
    report.plots.push("remote.png".into());
    Ok(report)
}
