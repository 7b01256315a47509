//! `taskstream`: the command line client of a taskstream server.
//!
//! `taskstream [--addr URL] [--token TOKEN] [--ca-cert FILE] [--json] <command>`;
//! run `taskstream help` for the commands. Exit codes: 0 success, 1 other
//! failure (and `get` of a missing key), 2 illegal argument or usage, 3 unknown
//! store or topic, 4 illegal state, 5 not available, 6 out of range, 7 lagged,
//! 8 transport, 9 over a server limit, 130 Ctrl-C.

mod cli;

use std::{io, path::PathBuf, process::ExitCode, time::Duration};

use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use taskstream_client::{ClientError, StreamsClient};

use crate::cli::{
    json, out, out_json_pretty, produce, read, render,
    watch::{self, WatchEnd},
};

/// Command line client of taskstream: produce records, inspect store
/// metadata, watch record outcomes, query stores, read topics (dead letters
/// included), manage stream threads.
#[derive(Debug, Parser)]
#[command(name = "taskstream", version, propagate_version = true, after_help = EXIT_CODES)]
struct Cli {
    /// Server address: `host:port` or a URL.
    #[arg(
        long,
        global = true,
        env = "TASKSTREAM_ADDR",
        default_value = "http://127.0.0.1:50051"
    )]
    addr: String,

    /// Bearer token sent with every call (`authorization: Bearer TOKEN`), for a server
    /// with `auth_tokens`. Never printed.
    #[arg(long, global = true, env = "TASKSTREAM_TOKEN", hide_env_values = true)]
    token: Option<Secret>,

    /// CA certificate (PEM) that signed the server's certificate: the connection is TLS
    /// (a bare host:port address means https://). No CA is trusted without it.
    #[arg(long, global = true, env = "TASKSTREAM_CA_CERT", value_name = "FILE")]
    ca_cert: Option<PathBuf>,

    /// Client certificate (PEM), for a server that requires one (`tls_client_ca`); needs
    /// --client-key.
    #[arg(
        long,
        global = true,
        env = "TASKSTREAM_CLIENT_CERT",
        value_name = "FILE",
        requires = "client_key"
    )]
    client_cert: Option<PathBuf>,

    /// Private key (PEM) of --client-cert.
    #[arg(
        long,
        global = true,
        env = "TASKSTREAM_CLIENT_KEY",
        value_name = "FILE",
        requires = "client_cert"
    )]
    client_key: Option<PathBuf>,

    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

/// A token from the command line or the environment; its `Debug` hides it.
#[derive(Clone)]
struct Secret(String);

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(Secret(text.to_owned()))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

const EXIT_CODES: &str = "Exit codes: 0 ok, 1 other error (or `get`: key not found), 2 illegal argument, \
3 unknown store or topic, 4 illegal state, 5 not available, 6 out of range, 7 lagged, 8 transport, 9 over a server limit, 130 interrupted.";

#[derive(Debug, Subcommand)]
enum Command {
    /// Append records to a topic: `key:value` lines from stdin, or VALUE arguments.
    Produce(ProduceArgs),

    /// Print the value of KEY in a store. An absent key prints nothing on stdout
    /// (with --json: `"found": false`), a message on stderr, and exits 1.
    Get {
        /// Store (= pipeline) name.
        #[arg(long)]
        store: String,
        key: String,
    },

    /// Instances and tasks of a store: threads, order, watermark, offsets, lag.
    Metadata {
        /// Store (= pipeline) name.
        #[arg(long)]
        store: String,
        /// Ask for offset order; refused (exit 4) when the store can't guarantee it.
        #[arg(long)]
        in_order: bool,
        /// Instead: the partition and hosts of this key.
        #[arg(long, conflicts_with = "in_order")]
        key: Option<String>,
    },

    /// Print record outcomes as the task threads complete them, one line per batch.
    Watch(WatchArgs),

    /// Print `key<TAB>value` lines of a store, keys in [FROM, TO] (inclusive; absent = open).
    Range {
        /// Store (= pipeline) name.
        #[arg(long)]
        store: String,
        from: Option<String>,
        to: Option<String>,
    },

    /// Print the records of one partition of any topic, headers included, e.g. a
    /// pipeline's dead-letter topic `<application_id>-<pipeline>-dlq`.
    Read(ReadArgs),

    /// The runtime: stream threads and their state, pipelines, tasks.
    Describe,

    /// Add or remove stream threads.
    Threads {
        #[command(subcommand)]
        command: ThreadsCommand,
    },
}

#[derive(Debug, Args)]
struct ProduceArgs {
    /// Topic to append to.
    #[arg(long)]
    topic: String,
    /// Key of every record; stdin lines are then whole values.
    #[arg(long)]
    key: Option<String>,
    /// Write to this partition instead of the key's.
    #[arg(long)]
    partition: Option<u32>,
    /// Don't show a progress bar for large inputs.
    #[arg(long)]
    no_progress: bool,
    /// Values to produce; without any, records are read from stdin.
    values: Vec<String>,
}

#[derive(Debug, Args)]
struct WatchArgs {
    /// Store (= pipeline) name.
    #[arg(long)]
    store: String,
    /// Offset order per partition; refused (exit 4) when the store can't guarantee it.
    #[arg(long)]
    in_order: bool,
    /// Stop at the end offsets of now and exit 0 once every record up to them completed.
    #[arg(long)]
    until_end: bool,
    /// Start at the oldest outcome the server retains instead of the current watermark.
    #[arg(long)]
    from_earliest: bool,
    /// Only this partition (repeat for several).
    #[arg(long = "partition")]
    partitions: Vec<u32>,
    /// At most this many records per batch (0 = as completed).
    #[arg(long, default_value_t = 0)]
    max_batch_records: u32,
    /// When a partition moves to another instance (a rebalance, an instance that
    /// died), look for its new owner for up to this many seconds and resume there
    /// after the last offset printed; 0 = stop with the error instead.
    #[arg(long, default_value_t = 120, value_name = "SECS")]
    follow_timeout: u64,
}

#[derive(Debug, Args)]
struct ReadArgs {
    /// Topic to read: a source topic, or `<application_id>-<pipeline>-retry` / `-dlq`.
    #[arg(long)]
    topic: String,
    /// Partition to read (default: every partition, one after the other).
    #[arg(long)]
    partition: Option<u32>,
    /// First offset to read in each partition (default: the oldest retained).
    #[arg(long, allow_negative_numbers = true)]
    from: Option<i64>,
    /// At most this many records (0 = the server's default, 500; at most 10,000).
    #[arg(long, default_value_t = 0)]
    max: u32,
}

#[derive(Debug, Subcommand)]
enum ThreadsCommand {
    /// Start one more stream thread.
    Add,
    /// Stop a stream thread (default: the most recently started one).
    Remove { name: Option<String> },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // The client's own log (a followed partition, offsets lost in a move) on
    // stderr, apart from the output; `RUST_LOG=info` shows every follow.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(io::stderr)
        .with_ansi(io::IsTerminal::is_terminal(&io::stderr()))
        .init();
    match run(cli).await {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            if is_broken_pipe(&error) {
                // The reader of our stdout left (`| head`): not an error.
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {error:#}");
            let code = error
                .downcast_ref::<ClientError>()
                .map_or(1, ClientError::exit_code);
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
    }
}

fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|e| {
        e.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    })
}

/// The client of `--addr` with the token and TLS files of the command line.
async fn connect(cli: &Cli) -> Result<StreamsClient, ClientError> {
    let mut builder = StreamsClient::builder(cli.addr.clone());
    if let Some(token) = &cli.token {
        builder = builder.token(token.0.clone());
    }
    if let Some(path) = &cli.ca_cert {
        builder = builder.ca_cert_pem(read_file("--ca-cert", path)?);
    }
    if let (Some(cert), Some(key)) = (&cli.client_cert, &cli.client_key) {
        builder = builder.client_identity(read_file("--client-cert", cert)?, read_file("--client-key", key)?);
    }
    builder.connect().await
}

/// A file named by a flag; an unreadable one is an illegal argument (exit 2).
fn read_file(flag: &str, path: &std::path::Path) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path).map_err(|e| ClientError::IllegalArgument {
        message: format!("{flag}: cannot read `{}`: {e}", path.display()),
        field_violations: vec![],
    })
}

/// Runs one command; `Ok` carries the exit code of an outcome that is not an error.
async fn run(cli: Cli) -> anyhow::Result<u8> {
    let client = connect(&cli).await?;
    let as_json = cli.json;
    match cli.command {
        Command::Produce(args) => {
            let input = produce::ProduceInput {
                topic: args.topic.clone(),
                key: args.key,
                partition: args.partition,
                values: args.values,
                progress: !args.no_progress,
            };
            match produce::run(&client, input).await? {
                Some(response) if as_json => out_json_pretty(&json::produce(&response))?,
                Some(response) => out(&render::produce(&response))?,
                None if as_json => out_json_pretty(&json!({
                    "topic": args.topic, "record_count": 0, "partitions": [], "positions": [],
                }))?,
                None => eprintln!("no records on stdin; nothing produced"),
            }
        }
        Command::Get { store, key } => {
            let value = client.get(&store, Bytes::from(key.clone())).await?;
            if as_json {
                out_json_pretty(&json!({
                    "store": store, "key": key, "found": value.is_some(),
                    "value": json::opt_bytes(value.as_ref()),
                }))?;
            }
            match value {
                Some(value) if !as_json => out(&(cli::text(&value) + "\n"))?,
                Some(_) => {}
                None => {
                    // Exit 1 like `grep` without a match; stdout stays empty for `$(…)`.
                    eprintln!("error: key `{key}` not found in store `{store}`");
                    return Ok(1);
                }
            }
        }
        Command::Metadata {
            store,
            key: Some(key),
            ..
        } => {
            let response = client.metadata_for_key(&store, Bytes::from(key.clone())).await?;
            if as_json {
                out_json_pretty(&json::key_metadata(&key, &response))?;
            } else {
                out(&render::key_metadata(&key, &response))?;
            }
        }
        Command::Metadata {
            store,
            in_order,
            key: None,
        } => {
            let response = client.process_metadata_for_store(&store, in_order).await?;
            if as_json {
                out_json_pretty(&json::store_metadata(&store, &response))?;
            } else {
                out(&render::store_metadata(&store, &response))?;
            }
        }
        Command::Watch(args) => {
            let input = watch::WatchInput {
                store: args.store,
                in_order: args.in_order,
                until_end: args.until_end,
                from_earliest: args.from_earliest,
                partitions: args.partitions,
                max_batch_records: args.max_batch_records,
                follow_timeout: (args.follow_timeout > 0).then(|| Duration::from_secs(args.follow_timeout)),
                json: as_json,
            };
            if watch::run(&client, input).await? == WatchEnd::Interrupted {
                return Ok(130);
            }
        }
        Command::Range { store, from, to } => {
            let entries = client
                .range(&store, from.map(Bytes::from), to.map(Bytes::from))
                .await?;
            if as_json {
                let entries: Vec<_> = entries
                    .iter()
                    .map(|(k, v)| json!({ "key": json::bytes(k), "value": json::bytes(v) }))
                    .collect();
                out_json_pretty(&json!({ "store": store, "entries": entries }))?;
            } else {
                let mut text = String::new();
                for (key, value) in &entries {
                    text.push_str(&format!("{}\t{}\n", cli::text(key), cli::text(value)));
                }
                out(&text)?;
            }
        }
        Command::Read(args) => {
            let input = read::ReadInput {
                topic: args.topic,
                partition: args.partition,
                from: args.from,
                max_records: args.max,
            };
            let answers = read::run(&client, input).await?;
            if as_json {
                out_json_pretty(&json::topic_reads(&answers))?;
            } else {
                out(&answers.iter().map(render::topic_read).collect::<String>())?;
            }
        }
        Command::Describe => {
            let response = client.describe_runtime().await?;
            if as_json {
                out_json_pretty(&json::describe(&response))?;
            } else {
                out(&render::describe(&response))?;
            }
        }
        Command::Threads {
            command: ThreadsCommand::Add,
        } => {
            let response = client.add_stream_thread().await?;
            if as_json {
                out_json_pretty(&json!({
                    "thread_name": response.thread_name, "num_stream_threads": response.num_stream_threads,
                }))?;
            } else {
                out(&format!(
                    "started stream thread {} ({} stream threads)\n",
                    response.thread_name, response.num_stream_threads
                ))?;
            }
        }
        Command::Threads {
            command: ThreadsCommand::Remove { name },
        } => {
            let response = client.remove_stream_thread(name.as_deref()).await?;
            if as_json {
                out_json_pretty(&json!({
                    "thread_name": response.thread_name, "num_stream_threads": response.num_stream_threads,
                }))?;
            } else {
                out(&format!(
                    "stopping stream thread {} ({} stream threads remain)\n",
                    response.thread_name, response.num_stream_threads
                ))?;
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_parse_anywhere() {
        let cli = Cli::try_parse_from([
            "taskstream",
            "watch",
            "--store",
            "counts",
            "--until-end",
            "--json",
        ])
        .expect("parses");
        assert!(cli.json);
        let Command::Watch(args) = cli.command else {
            panic!("watch")
        };
        assert!(args.until_end && !args.in_order && !args.from_earliest);

        let cli = Cli::try_parse_from([
            "taskstream",
            "--addr",
            "127.0.0.1:1",
            "produce",
            "--topic",
            "t",
            "a",
            "b",
        ])
        .expect("parses");
        assert_eq!(cli.addr, "127.0.0.1:1");
        let Command::Produce(args) = cli.command else {
            panic!("produce")
        };
        assert_eq!(args.values, vec!["a", "b"]);

        let cli =
            Cli::try_parse_from(["taskstream", "threads", "remove", "stream-thread-3"]).expect("parses");
        assert!(matches!(
            cli.command,
            Command::Threads {
                command: ThreadsCommand::Remove { name: Some(_) }
            }
        ));
        let cli = Cli::try_parse_from(["taskstream", "read", "--topic", "app-counts-dlq"]).expect("parses");
        let Command::Read(args) = cli.command else {
            panic!("read")
        };
        assert_eq!((args.partition, args.from, args.max), (None, None, 0));
        let cli = Cli::try_parse_from([
            "taskstream",
            "read",
            "--topic",
            "t",
            "--partition",
            "3",
            "--from",
            "-1",
            "--max",
            "10",
        ])
        .expect("parses");
        let Command::Read(args) = cli.command else {
            panic!("read")
        };
        // A negative offset reaches the server, which names the field.
        assert_eq!((args.partition, args.from, args.max), (Some(3), Some(-1), 10));

        let cli = Cli::try_parse_from(["taskstream", "range", "--store", "s", "a"]).expect("parses");
        assert!(matches!(
            cli.command,
            Command::Range {
                from: Some(_),
                to: None,
                ..
            }
        ));
    }
}
