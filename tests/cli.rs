//! The `taskstream` CLI as a user runs it: the binary of this checkout against
//! a real server (in-process, port 0) — reading every partition of a topic by
//! default, and the empty key through `produce --key ""` and `get`.

mod common;

use common::{Output, Server, cli_binary, run};
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

/// Bound of one CLI call, and of waiting for processing to catch up.
const WAIT: Duration = Duration::from_secs(60);

fn taskstream(server: &Server, args: &[&str]) -> Output {
    let mut command = Command::new(cli_binary());
    command
        .env_remove("TASKSTREAM_ADDR")
        .arg("--addr")
        .arg(format!("http://{}", server.addr()))
        .args(args);
    let output = run(command, &format!("taskstream {}", args.join(" ")), WAIT);
    assert!(
        output.status.success(),
        "taskstream {args:?} failed:\n{}",
        output.describe()
    );
    output
}

#[test]
fn read_without_partition_reads_every_partition_with_its_offsets() {
    let server = Server::start("cli-read");
    // The embedded default: topic `events` with 8 partitions. Records on 0, 1
    // (two) and 5 only; a reader of partition 0 alone would miss most.
    for (partition, value) in [("0", "v0"), ("1", "v1a"), ("1", "v1b"), ("5", "v5")] {
        taskstream(
            &server,
            &[
                "produce",
                "--topic",
                "events",
                "--partition",
                partition,
                "--no-progress",
                value,
            ],
        );
    }

    let text = taskstream(&server, &["read", "--topic", "events"]).stdout;
    for line in ["0/0  -  v0", "1/0  -  v1a", "1/1  -  v1b", "5/0  -  v5"] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
    }
    for partition in 0..8 {
        let (count, end) = match partition {
            0 | 5 => ("1 record", 1),
            1 => ("2 records", 2),
            _ => ("0 records", 0),
        };
        let summary = format!("events-{partition}: {count}; start offset 0, end offset {end}");
        assert!(text.lines().any(|l| l == summary), "no `{summary}` in:\n{text}");
    }

    // `--partition` still reads one.
    let one = taskstream(&server, &["read", "--topic", "events", "--partition", "1"]).stdout;
    assert!(one.contains("events-1: 2 records"), "{one}");
    assert!(!one.contains("events-0"), "{one}");

    let json: Value =
        serde_json::from_str(&taskstream(&server, &["--json", "read", "--topic", "events"]).stdout)
            .expect("--json prints JSON");
    assert_eq!(json["topic"], "events");
    let partitions = json["partitions"].as_array().expect("one entry per partition");
    assert_eq!(partitions.len(), 8, "{json:#}");
    for (i, partition) in partitions.iter().enumerate() {
        assert_eq!(partition["partition"], i, "{json:#}");
        assert!(partition["start_offset"].is_i64(), "{json:#}");
        assert!(partition["end_offset"].is_i64(), "{json:#}");
    }
    assert_eq!(partitions[1]["records"].as_array().map(Vec::len), Some(2));
    server.stop();
}

#[test]
fn the_empty_key_is_produced_counted_and_found_by_get() {
    let server = Server::start("cli-empty-key");
    taskstream(
        &server,
        &[
            "produce",
            "--topic",
            "events",
            "--key",
            "",
            "--no-progress",
            "a",
            "b",
            "c",
        ],
    );
    // Processing is asynchronous: poll `get` until the count arrives.
    let deadline = Instant::now() + WAIT;
    loop {
        let mut command = Command::new(cli_binary());
        command
            .arg("--addr")
            .arg(format!("http://{}", server.addr()))
            .args(["get", "--store", "counts", ""]);
        let output = run(command, "taskstream get --store counts ''", WAIT);
        if output.status.success() && output.stdout.trim() == "3" {
            break;
        }
        assert!(
            output.status.success() || output.status.code() == Some(1),
            "`get` of the empty key failed:\n{}",
            output.describe()
        );
        assert!(
            Instant::now() < deadline,
            "the count of the empty key never reached 3:\n{}",
            output.describe()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    server.stop();
}

#[test]
fn watch_goes_through_the_fan_in_on_one_server_and_prints_every_record_once() {
    // On the embedded log the fan-in finds this one instance (its
    // application_server) and streams every partition from it.
    let server = Server::start("cli-watch");
    for (partition, value) in [("0", "a"), ("0", "b"), ("3", "c"), ("7", "d")] {
        taskstream(
            &server,
            &[
                "produce",
                "--topic",
                "events",
                "--partition",
                partition,
                "--no-progress",
                value,
            ],
        );
    }
    for follow in ["120", "0"] {
        let text = taskstream(
            &server,
            &[
                "--json",
                "watch",
                "--store",
                "counts",
                "--in-order",
                "--from-earliest",
                "--until-end",
                "--follow-timeout",
                follow,
            ],
        )
        .stdout;
        let mut seen: Vec<(u64, u64)> = text
            .lines()
            .map(|line| serde_json::from_str::<Value>(line).expect("one JSON batch per line"))
            .flat_map(|batch| batch["records"].as_array().cloned().unwrap_or_default())
            .map(|r| {
                (
                    r["partition"].as_u64().unwrap_or(99),
                    r["offset"].as_u64().unwrap_or(99),
                )
            })
            .collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            vec![(0, 0), (0, 1), (3, 0), (7, 0)],
            "--follow-timeout {follow}:\n{text}"
        );
    }
    server.stop();
}
