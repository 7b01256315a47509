//! Python grpcio against a real server (in-process, port 0): stubs are generated
//! from proto/ at test time with grpc_tools.protoc, then tests/python/grpcio_client.py
//! produces, reads metadata, runs a bounded stream, checks the status codes and
//! decodes rich error details with grpcio-status, runs the follow recipe of
//! examples/python-follow/follow.py (written with the client/python package,
//! on PYTHONPATH; its dedupe and gap logic, and a stream per
//! partition from the owner the metadata names); a 1 MB store name, malformed protobuf
//! (raw bytes) and a 5 MiB request get their documented codes, with short messages.
//! Python and its packages come from the tests' own venv (`common::tools`),
//! provisioned on first use; if that fails the test fails, never skips.

mod common;

use common::tools::tools;
use common::{Server, run, temp_dir};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The venv's Python (`common::tools`), unbuffered so that a killed script
/// still shows how far it got.
fn python(root: &Path) -> Command {
    let mut command = Command::new(&tools().python);
    command.arg("-u").current_dir(root);
    command
}

#[test]
fn python_grpcio_client_end_to_end() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));

    let stubs = temp_dir("python-stubs");
    let mut protoc = python(root);
    protoc
        .args(["-m", "grpc_tools.protoc", "-I", "proto"])
        .arg(format!("--python_out={}", stubs.path().display()))
        .arg(format!("--grpc_python_out={}", stubs.path().display()))
        .arg("proto/taskstream/v1/taskstream.proto");
    let generated = run(protoc, "grpc_tools.protoc", Duration::from_secs(120));
    assert!(
        generated.status.success(),
        "stub generation failed:\n{}",
        generated.describe()
    );
    for stub in ["taskstream_pb2.py", "taskstream_pb2_grpc.py"] {
        let path = stubs.path().join("taskstream/v1").join(stub);
        assert!(path.is_file(), "protoc did not write {}", path.display());
    }

    let server = Server::start("python-test");
    let mut client = python(root);
    client
        // The follow recipe (examples/python-follow) is written with the package.
        .env("PYTHONPATH", root.join("client/python/src"))
        .arg("tests/python/grpcio_client.py")
        .arg(server.addr())
        .arg(stubs.path());
    let output = run(client, "tests/python/grpcio_client.py", Duration::from_secs(180));
    assert!(
        output.status.success(),
        "the Python client reported failures:\n{}",
        output.describe()
    );
    // Shown with --nocapture: what the Python client checked.
    println!("{}", output.stdout);
    assert!(
        output.stdout.contains("12/12 checks passed"),
        "the Python client did not run every check:\n{}",
        output.describe()
    );
    server.stop();
}
