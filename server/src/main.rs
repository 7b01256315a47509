//! The `taskstream-server` binary: reads the configuration (embedded default or
//! `--config FILE`, then `TASKSTREAM_*` environment, then flags), binds the
//! listen address, prints what it serves and runs `service::serve` until SIGINT
//! or SIGTERM. An invalid configuration exits with code 2.
//!
//! `taskstream-server health` is the container's and the unit's probe instead:
//! one `grpc.health.v1.Health/Check` of a running server (see [`health_check`]).

use anyhow::Context as _;
use clap::{CommandFactory as _, FromArgMatches as _, Parser};
use std::io::{IsTerminal as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use taskstream_server::config::LogFormat;
use taskstream_server::config::{SETTINGS, parse_host_port};
use taskstream_server::service;
use taskstream_server::service::tls::TlsMode;
use taskstream_server::{CommitMode, Config, ConfigError, RuntimeError, StreamsApp};
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// Exit code of a rejected configuration (as clap uses for bad flags).
const EXIT_INVALID_CONFIG: u8 = 2;

/// taskstream: stream tasks processed by several threads at once, with
/// interactive queries and record metadata over gRPC.
///
/// Settings come from the embedded default (or --config FILE), then the
/// TASKSTREAM_* environment, then these flags; later sources win.
#[derive(Debug, Parser)]
#[command(
    name = "taskstream-server",
    version,
    after_help = "Every setting of the TOML file also has an environment variable: TASKSTREAM_ and its \
                  name in capitals (TASKSTREAM_RETRY_MAX_ATTEMPTS=5). The flags above that are settings \
                  have one too.\n\n`taskstream-server health [--addr HOST:PORT] [--service NAME]` asks a running \
                  server's grpc.health.v1 once instead (exit code 0: SERVING; 1: not serving or not reachable)."
)]
struct Cli {
    /// Address to serve gRPC on (host:port; port 0 picks a free port).
    #[arg(
        long,
        env = "TASKSTREAM_LISTEN",
        default_value = "127.0.0.1:50051",
        value_name = "ADDR"
    )]
    listen: String,

    /// TOML configuration file; without it the embedded default runs
    /// (topic `events`, 8 partitions; store `counts`; N = 4, T = 2).
    #[arg(long, env = "TASKSTREAM_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,

    /// Keep the log and stores in memory only: everything is lost on exit.
    #[arg(long, env = "TASKSTREAM_IN_MEMORY", conflicts_with = "data_dir")]
    in_memory: bool,

    /// Serve Prometheus metrics over HTTP (HTTPS with --metrics-tls) on this
    /// address (host:port; port 0 picks a free port), e.g. 127.0.0.1:9464. Off
    /// when absent.
    #[arg(long, env = "TASKSTREAM_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<String>,

    /// Do not serve gRPC server reflection (the same as --reflection false).
    #[arg(long, conflicts_with = "reflection")]
    no_reflection: bool,
}

/// The binary's flags: `Cli` plus one flag per setting of `config::SETTINGS`
/// that has one. Their values are read as text and parsed by the table, like
/// the environment, so both accept exactly what the TOML file accepts.
fn command() -> clap::Command {
    SETTINGS
        .iter()
        .fold(Cli::command(), |command, setting| match setting.flag {
            Some(flag) => {
                let arg = clap::Arg::new(setting.name)
                    .long(flag)
                    .value_name(setting.value_name)
                    .help(format!("{} [env: {}]", setting.help, setting.env_var()));
                command.arg(match setting.is_switch() {
                    true => arg.num_args(0..=1).default_missing_value("true"),
                    false => arg,
                })
            }
            None => command,
        })
}

/// Where the embedded default keeps its data, under the working directory.
const DEFAULT_DATA_DIR: &str = "taskstream-data";

/// The configuration to run, and whether `application_server` was chosen by
/// the user (otherwise it becomes the bound listen address).
struct Settings {
    config: Config,
    application_server_set: bool,
    source: String,
}

fn load_settings(cli: &Cli, flags: &clap::ArgMatches) -> Result<Settings, ConfigError> {
    let (mut config, set_in_file, source) = match &cli.config {
        None => {
            let mut config = Config::embedded_default();
            config.data_dir = Some(PathBuf::from(DEFAULT_DATA_DIR));
            (config, false, "embedded default".to_string())
        }
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError::new("config", format!("cannot read `{}`: {e}", path.display())))?;
            let config = Config::from_toml_str(&text).map_err(|e| {
                ConfigError::new(e.setting, format!("{} (in `{}`)", e.message, path.display()))
            })?;
            // `Config` fills missing keys with defaults, so presence is read from the table.
            let set_in_file = text
                .parse::<toml::Table>()
                .map(|table| table.contains_key("application_server"))
                .unwrap_or(false);
            (config, set_in_file, path.display().to_string())
        }
    };
    let server_var = SETTINGS
        .iter()
        .find(|s| s.name == "application_server")
        .map(|s| s.env_var());
    let application_server_set = set_in_file
        || server_var.is_some_and(|var| std::env::var_os(var).is_some_and(|v| !v.is_empty()))
        || flags.contains_id("application_server");
    config.apply_env(|var| std::env::var(var).ok())?;
    for setting in SETTINGS {
        // Only settings with a flag have an argument to ask about.
        if let Some(flag) = setting.flag
            && let Some(text) = flags.get_one::<String>(setting.name)
        {
            setting.apply(&mut config, text, &format!("--{flag}"))?;
        }
    }
    if cli.in_memory {
        config.data_dir = None;
        for pipeline in &mut config.pipelines {
            pipeline.store = None;
        }
    }
    if cli.no_reflection {
        config.reflection = false;
    }
    parse_host_port(&cli.listen).map_err(|m| {
        ConfigError::new(
            "listen",
            format!("{m}; write it as host:port, e.g. 127.0.0.1:50051"),
        )
    })?;
    config.validate()?;
    // Read now, so that a tokens file that cannot be used stops the start with exit code 2.
    if let Some(path) = &config.auth_tokens {
        service::Tokens::load(path).map_err(|e| ConfigError::new("auth_tokens", e.to_string()))?;
    }
    // Likewise the TLS files: unreadable or not PEM is exit code 2, not a failed handshake later.
    service::tls::server_tls_config(&config).map_err(|e| ConfigError::new(e.setting, e.message))?;
    service::tls::metrics_tls(&config).map_err(|e| ConfigError::new(e.setting, e.message))?;
    service::tls::peer_tls_config(&config).map_err(|e| ConfigError::new(e.setting, e.message))?;
    Ok(Settings {
        config,
        application_server_set,
        source,
    })
}

/// `taskstream-server health`: asks a running server's `grpc.health.v1` once.
/// Exit code 0 when it answers SERVING, 1 when it answers anything else or
/// cannot be reached in time, 2 for bad flags. Plain HTTP/2 only (as the
/// probes of Kubernetes): a server with TLS is probed on its plaintext peer or
/// with grpcurl.
#[derive(Debug, Parser)]
#[command(name = "taskstream-server health")]
struct HealthCli {
    /// The server to ask (host:port).
    #[arg(
        long,
        env = "TASKSTREAM_HEALTH_ADDR",
        default_value = "127.0.0.1:50051",
        value_name = "ADDR"
    )]
    addr: String,

    /// The service to ask about; empty: the server as a whole. E.g.
    /// taskstream.v1.StreamsService, or taskstream.pipeline.NAME.
    #[arg(long, default_value = "", value_name = "NAME")]
    service: String,

    /// Give up after this many milliseconds (connecting and answering).
    #[arg(long, default_value_t = 5000, value_name = "MS")]
    timeout_ms: u64,
}

fn health_check(args: impl Iterator<Item = std::ffi::OsString>) -> ExitCode {
    let cli = HealthCli::parse_from(args);
    if cli.timeout_ms == 0 {
        eprintln!("error: --timeout-ms must be more than 0");
        return ExitCode::from(EXIT_INVALID_CONFIG);
    }
    if let Err(message) = parse_host_port(&cli.addr) {
        eprintln!("error: --addr: {message}; write it as host:port, e.g. 127.0.0.1:50051");
        return ExitCode::from(EXIT_INVALID_CONFIG);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let timeout = std::time::Duration::from_millis(cli.timeout_ms);
    let service = cli.service.clone();
    let uri = format!("http://{}", cli.addr);
    let asked = runtime.block_on(async move {
        let endpoint = tonic::transport::Endpoint::from_shared(uri)
            .context("not a valid address")?
            .connect_timeout(timeout)
            .timeout(timeout);
        let channel = tokio::time::timeout(timeout, endpoint.connect())
            .await
            .context("no connection within the timeout")?
            .context("cannot connect")?;
        let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
        let request = tonic_health::pb::HealthCheckRequest { service };
        let answer = client
            .check(request)
            .await
            .map_err(|status| anyhow::anyhow!("{}: {}", status.code().description(), status.message()))?;
        anyhow::Ok(answer.into_inner().status())
    });
    let label = if cli.service.is_empty() {
        "server"
    } else {
        cli.service.as_str()
    };
    match asked {
        Ok(tonic_health::pb::health_check_response::ServingStatus::Serving) => {
            println!("{}: {label} SERVING", cli.addr);
            ExitCode::SUCCESS
        }
        Ok(status) => {
            println!("{}: {label} {}", cli.addr, status.as_str_name());
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("error: {}: {error:#}", cli.addr);
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    if std::env::args_os().nth(1).is_some_and(|first| first == "health") {
        let program = args.next().unwrap_or_default();
        // `health` and its own flags; the server's flags do not apply.
        return health_check(std::iter::once(program).chain(args.skip(1)));
    }
    // Bad flags: clap prints the error and exits with 2.
    let flags = command().get_matches();
    let cli = Cli::from_arg_matches(&flags).unwrap_or_else(|e| e.exit());
    let settings = match load_settings(&cli, &flags) {
        Ok(settings) => settings,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(EXIT_INVALID_CONFIG);
        }
    };
    init_logging(settings.config.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.listen, cli.metrics_listen, settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            // The runtime validates again at start; a config it rejects is still a
            // config error, and so is a data dir it cannot use: fix it, then restart.
            match error.downcast_ref::<RuntimeError>() {
                Some(RuntimeError::InvalidConfig(_) | RuntimeError::Storage { .. }) => {
                    ExitCode::from(EXIT_INVALID_CONFIG)
                }
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// The log on stderr, in `format`; RUST_LOG chooses what is logged (default `info`; e.g.
/// `RUST_LOG=info,taskstream_server::service=debug` adds a span per RPC).
fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match format {
        // Colour codes only for a person at a terminal, not in captured logs.
        LogFormat::Pretty => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(true).init(),
    }
}

async fn run(listen: String, metrics_listen: Option<String>, settings: Settings) -> anyhow::Result<()> {
    let Settings {
        mut config,
        application_server_set,
        source,
    } = settings;
    let listener = TcpListener::bind(&listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let address = listener.local_addr().context("cannot read the bound address")?;
    if !application_server_set {
        // After binding, so that `--listen 127.0.0.1:0` advertises the real port.
        config.application_server = address.to_string();
        if address.ip().is_unspecified() {
            tracing::warn!(
                %address,
                "advertising an unspecified address; set --application-server to a reachable host:port"
            );
        }
    }

    let metrics_address = match metrics_listen {
        Some(metrics_listen) => {
            let listener = TcpListener::bind(&metrics_listen)
                .await
                .with_context(|| format!("cannot serve metrics on {metrics_listen}"))?;
            let address = listener.local_addr().context("cannot read the metrics address")?;
            let handle = taskstream_server::metrics::install().map_err(anyhow::Error::msg)?;
            // Checked by load_settings already; read again here, where it is used.
            let tls = service::tls::metrics_tls(&config)?;
            tokio::spawn(taskstream_server::metrics::serve(listener, handle, tls));
            Some(address)
        }
        None => {
            if config.metrics_tls {
                tracing::warn!("metrics_tls is set but --metrics-listen is not: no metrics are served");
            }
            None
        }
    };

    // Handlers first, so a signal right after the "listening" line is not lost.
    let mut sigterm = signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = sigterm.recv() => tracing::info!("SIGTERM received"),
            _ = sigint.recv() => tracing::info!("SIGINT received"),
        }
    };

    // Opening the data dir may take a while after a crash (redb repairs it);
    // connecting to Kafka waits for the cluster to answer.
    let app = tokio::task::spawn_blocking(move || -> anyhow::Result<StreamsApp> {
        let servers = config.bootstrap_servers.clone();
        let started = StreamsApp::builder(config).start();
        Ok(match servers {
            Some(servers) => started.with_context(|| format!("cannot run on Kafka at {servers}"))?,
            None => started?,
        })
    })
    .await
    .context("the runtime failed to start")??;
    print_banner(&app, address, metrics_address, &source)?;

    service::serve(app, listener, shutdown).await?;
    println!("taskstream stopped: watermarks committed");
    std::io::stdout().flush()?;
    Ok(())
}

/// What runs and how to reach it, on stdout. The last line is the one scripts
/// and tests wait for.
fn print_banner(
    app: &StreamsApp,
    address: SocketAddr,
    metrics: Option<SocketAddr>,
    source: &str,
) -> std::io::Result<()> {
    let config = app.config();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "taskstream {} — application `{}` ({source})",
        env!("CARGO_PKG_VERSION"),
        config.application_id
    )?;
    writeln!(
        out,
        "  listen:      {address} (advertised as {})",
        config.application_server
    )?;
    writeln!(
        out,
        "  threads:     N = {} stream threads, T = {} threads per task, {} order, commit every {} ms ({})",
        config.num_stream_threads,
        config.num_threads_per_task,
        config.processing_order,
        config.commit_interval_ms,
        match config.commit_mode {
            CommitMode::Sync => "sync",
            CommitMode::Async => "async",
        }
    )?;
    // Validation already checked the topics, so this only fails on a config it rejected.
    let topics = config.topic_partitions().unwrap_or_default();
    let topics: Vec<String> = topics
        .iter()
        .map(|(name, partitions)| format!("{name} ({partitions} partitions)"))
        .collect();
    writeln!(out, "  topics:      {}", topics.join(", "))?;
    let tls_mode = TlsMode::of(config);
    match (tls_mode, &config.tls_cert, &config.tls_client_ca) {
        (TlsMode::Plaintext, _, _) => writeln!(out, "  tls:         off (plain HTTP/2)")?,
        (_, Some(cert), None) => writeln!(out, "  tls:         on, certificate {}", cert.display())?,
        (_, Some(cert), Some(ca)) => writeln!(
            out,
            "  tls:         on, certificate {}; client certificates signed by {} required",
            cert.display(),
            ca.display()
        )?,
        (_, None, _) => {}
    }
    if let Some(metrics) = metrics {
        match (config.metrics_tls, &config.tls_client_ca) {
            // Plain HTTP even with TLS on: keep it on loopback or a trusted network.
            (false, _) => writeln!(out, "  metrics:     http://{metrics}/metrics (Prometheus)")?,
            (true, None) => writeln!(out, "  metrics:     https://{metrics}/metrics (Prometheus)")?,
            (true, Some(_)) => writeln!(
                out,
                "  metrics:     https://{metrics}/metrics (Prometheus; client certificate required)"
            )?,
        }
    }
    if config.bootstrap_servers.is_some() && config.forward_queries {
        match &config.tls_peer_ca {
            Some(ca) if config.tls_cert.is_some() => writeln!(
                out,
                "  forwarding:  queries to other instances over TLS, their certificates signed by {}",
                ca.display()
            )?,
            _ => writeln!(out, "  forwarding:  queries to other instances over plain HTTP/2")?,
        }
    }
    match (&config.bootstrap_servers, &config.data_dir) {
        (Some(servers), dir) => {
            writeln!(out, "  log:         Apache Kafka at {servers}")?;
            match dir {
                Some(dir) => writeln!(out, "  data dir:    {} (persistent stores)", dir.display())?,
                None => writeln!(out, "  data dir:    none: stores in memory")?,
            }
        }
        (None, Some(dir)) => writeln!(
            out,
            "  data dir:    {} (log and persistent stores)",
            dir.display()
        )?,
        (None, None) => writeln!(out, "  data dir:    none: log and stores in memory, lost on exit")?,
    }
    for pipeline in &config.pipelines {
        let effective = config.effective_order(pipeline);
        writeln!(
            out,
            "  pipeline:    {name}: {topic} → {processor} → {kind} store `{name}` (T = {t}, {order} order)",
            kind = config.store_kind(pipeline).as_str(),
            name = pipeline.name,
            topic = pipeline.source_topic,
            processor = pipeline.processor.name(),
            t = effective.threads_per_task,
            order = effective.order,
        )?;
    }
    let store = config
        .pipelines
        .first()
        .map(|p| p.name.as_str())
        .unwrap_or("STORE");
    let topic = config
        .pipelines
        .first()
        .map(|p| p.source_topic.as_str())
        .unwrap_or("TOPIC");
    // With TLS the examples name the CA that signed the server's certificate (CA.pem) and,
    // with tokens, one token (TOKEN): the server cannot know either.
    let (grpcurl, cli) = match (tls_mode, config.auth_tokens.is_some()) {
        (TlsMode::Plaintext, false) => ("-plaintext".to_string(), format!("--addr http://{address}")),
        (TlsMode::Plaintext, true) => (
            "-plaintext -H 'authorization: Bearer TOKEN'".to_string(),
            format!("--addr http://{address} --token TOKEN"),
        ),
        (_, tokens) => {
            let client_cert = match tls_mode {
                TlsMode::Mutual => " -cert CLIENT.pem -key CLIENT.key",
                _ => "",
            };
            let header = if tokens {
                " -H 'authorization: Bearer TOKEN'"
            } else {
                ""
            };
            let token = if tokens { " --token TOKEN" } else { "" };
            (
                format!("-cacert CA.pem{client_cert}{header}"),
                format!("--addr https://{address} --ca-cert CA.pem{token}"),
            )
        }
    };
    writeln!(out, "try:")?;
    writeln!(out, "  grpcurl {grpcurl} {address} list")?;
    writeln!(
        out,
        "  grpcurl {grpcurl} -d '{{\"store\":\"{store}\",\"in_order\":true}}' {address} \
         taskstream.v1.StreamsService/ProcessMetadataForStore"
    )?;
    writeln!(
        out,
        "  echo 'k1:hello' | taskstream {cli} produce --topic {topic}"
    )?;
    writeln!(out, "  taskstream {cli} metadata --store {store} --in-order")?;
    writeln!(out, "  taskstream {cli} watch --store {store}")?;
    writeln!(out, "taskstream listening on {address}")?;
    out.flush()
}
