"""Fixtures of the package's tests: a real taskstream server binary
(TASKSTREAM_SERVER_BINARY, which tests/python_package.rs sets to the one it
built) run on 127.0.0.1:0 with a TOML config written per test, in memory, and
stopped with SIGTERM at the end. Without the variable the tests fail, naming it.
"""

import os
import pathlib
import queue
import signal
import subprocess
import threading
import time

import pytest

READY_PREFIX = "taskstream listening on "
START_TIMEOUT_S = 60.0


class RunningServer:
    def __init__(self, process, address, lines):
        self.process = process
        self.address = address
        self.lines = lines

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@pytest.fixture(scope="session")
def server_binary():
    binary = os.environ.get("TASKSTREAM_SERVER_BINARY")
    if not binary:
        pytest.fail("TASKSTREAM_SERVER_BINARY is not set: point it at a built taskstream-server "
                    "(cargo build -p taskstream-server), or run these tests through cargo test")
    if not pathlib.Path(binary).is_file():
        pytest.fail(f"TASKSTREAM_SERVER_BINARY={binary} is not a file")
    return binary


@pytest.fixture
def start_server(server_binary, tmp_path):
    """start_server(toml_text) -> RunningServer, stopped after the test."""
    started = []

    def start(config_text):
        config = tmp_path / f"taskstream-{len(started)}.toml"
        config.write_text(config_text)
        process = subprocess.Popen(
            [server_binary, "--config", str(config), "--listen", "127.0.0.1:0", "--in-memory"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        lines = queue.Queue()

        def pump():
            for line in process.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        seen = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                process.kill()
                pytest.fail(f"the server did not start within {START_TIMEOUT_S} s:\n" + "\n".join(seen))
            if line is None:
                pytest.fail(f"the server exited with {process.wait()}:\n" + "\n".join(seen))
            seen.append(line)
            if line.startswith(READY_PREFIX):
                server = RunningServer(process, line[len(READY_PREFIX):].strip(), lines)
                started.append(server)
                return server

    yield start
    for server in started:
        server.stop()


def eventually(what, check, timeout=30.0):
    """Polls `check()` until it returns a true value; fails naming `what` past the timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
