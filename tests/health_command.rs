//! `taskstream-server health`, the probe of the container image and the unit:
//! against the real binary serving on a free port it answers exit code 0 for
//! the server and a served service, 1 for a service the server does not know
//! and for a server that is gone, 2 for a malformed address.

mod common;

use common::{run, server_binary};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

fn health(args: &[&str]) -> common::Output {
    let mut command = Command::new(server_binary());
    command.arg("health").args(args);
    run(command, "taskstream-server health", Duration::from_secs(30))
}

#[test]
fn health_subcommand_asks_grpc_health_of_a_running_server() {
    let mut server = Command::new(server_binary())
        .args(["--listen", "127.0.0.1:0", "--in-memory"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start taskstream-server");
    let stdout = server.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut address = None;
    for line in lines.by_ref() {
        let line = line.expect("a line of the banner");
        if let Some(rest) = line.strip_prefix("taskstream listening on ") {
            address = Some(rest.trim().to_string());
            break;
        }
    }
    let address = address.expect("the server printed its address");
    // Read on, so its last line on shutdown does not meet a closed pipe.
    let rest = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());

    let up = health(&["--addr", &address]);
    assert_eq!(up.status.code(), Some(0), "{}", up.describe());
    assert!(up.stdout.contains("server SERVING"), "{}", up.describe());
    let streams = health(&["--addr", &address, "--service", "taskstream.v1.StreamsService"]);
    assert_eq!(streams.status.code(), Some(0), "{}", streams.describe());
    let unknown = health(&["--addr", &address, "--service", "no.such.Service"]);
    assert_eq!(unknown.status.code(), Some(1), "{}", unknown.describe());
    assert!(unknown.stderr.contains("not found"), "{}", unknown.describe());

    let stopped = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .expect("send SIGTERM");
    assert!(stopped.success());
    let exit = server.wait().expect("wait for the server");
    assert!(exit.success(), "the server did not stop cleanly: {exit}");
    let said = rest.join().expect("the reader thread");
    assert!(
        said.iter().any(|l| l.contains("watermarks committed")),
        "no clean stop in {said:?}"
    );
    let gone = health(&["--addr", &address, "--timeout-ms", "2000"]);
    assert_eq!(gone.status.code(), Some(1), "{}", gone.describe());
    assert!(gone.stderr.contains("cannot connect"), "{}", gone.describe());

    let malformed = health(&["--addr", "no-port"]);
    assert_eq!(malformed.status.code(), Some(2), "{}", malformed.describe());
    assert!(malformed.stderr.contains("host:port"), "{}", malformed.describe());
}
