//! The Python package (client/python) as a user gets it: its sdist is built
//! (setuptools, from the tests' venv), must carry the protos and the generator,
//! and is unpacked and installed with pip outside the repository; then the
//! package's own pytest suite, from the unpacked sdist, runs against that
//! install and the real server binary: the stubs match proto/ (and a changed
//! proto is caught), the client's RPCs, errors with decoded details, the
//! metadata callbacks, and sync and asyncio processors driving a pipeline.
//! `pip install ./client/python` (the README's command) is checked too.

mod common;

use common::tools::tools;
use common::{run, server_binary, temp_dir};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn python(dir: &Path) -> Command {
    let mut command = Command::new(&tools().python);
    command.arg("-u").current_dir(dir);
    command
}

fn pip_install_target(source: &Path, target: &Path, cwd: &Path) {
    let mut install = python(cwd);
    install
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
        .args(["--no-deps", "--no-build-isolation", "--target"])
        .arg(target)
        .arg(source)
        .env_remove("PIP_USER")
        .env_remove("PIP_TARGET")
        .env_remove("PIP_PREFIX");
    let installed = run(install, "pip install", Duration::from_secs(300));
    assert!(
        installed.status.success(),
        "pip install {} failed:\n{}",
        source.display(),
        installed.describe()
    );
    for stub in [
        "taskstream_pb2.py",
        "taskstream_pb2_grpc.py",
        "processor_pb2.py",
        "processor_pb2_grpc.py",
    ] {
        let path = target.join("taskstream/v1").join(stub);
        assert!(path.is_file(), "the install lacks {}", path.display());
    }
}

#[test]
fn python_package_builds_installs_and_passes_its_tests_on_the_server() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let package = root.join("client/python");
    let scratch = temp_dir("python-package");
    let dist = scratch.path().join("dist");

    // The sdist, with setuptools' PEP 517 hook (no download needed).
    let mut sdist = python(&package);
    sdist.arg("-c").arg(format!(
        "from setuptools import build_meta; print(build_meta.build_sdist({:?}))",
        dist.display().to_string()
    ));
    let built = run(sdist, "build the sdist", Duration::from_secs(300));
    assert!(
        built.status.success(),
        "building the sdist failed:\n{}",
        built.describe()
    );
    let name = built.stdout.lines().last().unwrap_or_default().trim().to_string();
    assert!(
        name.ends_with(".tar.gz"),
        "no sdist name in:\n{}",
        built.describe()
    );

    // Unpacked outside the repository; it must hold what it needs to build and check itself.
    let unpacked = scratch.path().join("src");
    let mut unpack = python(scratch.path());
    unpack.arg("-c").arg(format!(
        "import tarfile; t = tarfile.open({:?}); t.extractall({:?}, filter='data'); print(t.getnames()[0])",
        dist.join(&name).display().to_string(),
        unpacked.display().to_string()
    ));
    let unpacked_out = run(unpack, "unpack the sdist", Duration::from_secs(60));
    assert!(
        unpacked_out.status.success(),
        "unpacking failed:\n{}",
        unpacked_out.describe()
    );
    let top = unpacked.join(unpacked_out.stdout.trim());
    for file in [
        "proto/taskstream/v1/taskstream.proto",
        "proto/taskstream/v1/processor.proto",
        "generate.py",
        "tests/conftest.py",
    ] {
        let path = top.join(file);
        assert!(
            path.is_file() && !path.is_symlink(),
            "the sdist lacks {file} as a file"
        );
    }
    let vendored =
        std::fs::read(top.join("proto/taskstream/v1/taskstream.proto")).expect("read the vendored proto");
    let repo = std::fs::read(root.join("proto/taskstream/v1/taskstream.proto")).expect("read proto/");
    assert!(vendored == repo, "the sdist's proto differs from proto/");

    let installed = scratch.path().join("site");
    pip_install_target(&top, &installed, scratch.path());
    // The README's command, from the repository.
    pip_install_target(&package, &scratch.path().join("site-from-repo"), root);

    let mut pytest = python(&top);
    pytest
        .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"])
        .env("PYTHONPATH", &installed)
        .env("TASKSTREAM_SERVER_BINARY", server_binary())
        .env("TASKSTREAM_PROTO_DIR", top.join("proto"));
    let tested = run(pytest, "pytest of the Python package", Duration::from_secs(600));
    println!("{}", tested.stdout);
    assert!(
        tested.status.success(),
        "the Python package's tests failed:\n{}",
        tested.describe()
    );
    let summary = tested
        .stdout
        .lines()
        .rev()
        .find(|l| l.contains(" passed"))
        .unwrap_or_default();
    assert!(
        summary.contains("16 passed") && !summary.contains("failed") && !summary.contains("skipped"),
        "not every test of the package ran and passed: {summary}"
    );
}
