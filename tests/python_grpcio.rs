//! Python grpcio against a real server (in-process, port 0): stubs are generated
//! from proto/ at test time with grpc_tools.protoc, then tests/python/grpcio_client.py
//! produces, reads metadata, runs a bounded stream and checks the status codes.
//! Missing Python modules fail the test; they never skip it.

mod common;

use common::{INSTALL_HINT, Server, run};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// How a failure to start python3 leads into [`INSTALL_HINT`].
const INSTALL: Option<&str> = Some("install what the tests need with");

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!("{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create a temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn python3(root: &Path) -> Command {
    let mut command = Command::new("python3");
    // Unbuffered, so a killed script still shows how far it got.
    command.arg("-u").current_dir(root);
    command
}

#[test]
fn python_grpcio_client_end_to_end() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));

    let mut probe = python3(root);
    probe.args(["-c", "import grpc, grpc_tools.protoc"]);
    let probe = run(probe, "python3", Duration::from_secs(60), INSTALL);
    assert!(
        probe.status.success(),
        "python3 with the grpc and grpc_tools modules is required; install them with: {INSTALL_HINT}\n{}",
        probe.describe()
    );

    let stubs = TempDir::new("taskstream-python-stubs");
    let mut protoc = python3(root);
    protoc
        .args(["-m", "grpc_tools.protoc", "-I", "proto"])
        .arg(format!("--python_out={}", stubs.0.display()))
        .arg(format!("--grpc_python_out={}", stubs.0.display()))
        .arg("proto/taskstream/v1/taskstream.proto");
    let generated = run(protoc, "grpc_tools.protoc", Duration::from_secs(120), INSTALL);
    assert!(
        generated.status.success(),
        "stub generation failed:\n{}",
        generated.describe()
    );
    for stub in ["taskstream_pb2.py", "taskstream_pb2_grpc.py"] {
        let path = stubs.0.join("taskstream/v1").join(stub);
        assert!(path.is_file(), "protoc did not write {}", path.display());
    }

    let server = Server::start("python-test");
    let mut client = python3(root);
    client
        .arg("tests/python/grpcio_client.py")
        .arg(server.addr())
        .arg(&stubs.0);
    let output = run(
        client,
        "tests/python/grpcio_client.py",
        Duration::from_secs(180),
        INSTALL,
    );
    assert!(
        output.status.success(),
        "the Python client reported failures:\n{}",
        output.describe()
    );
    // Shown with --nocapture: what the Python client checked.
    println!("{}", output.stdout);
    assert!(
        output.stdout.contains("6/6 checks passed"),
        "the Python client did not run every check:\n{}",
        output.describe()
    );
    server.stop();
}
