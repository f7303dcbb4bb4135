"""``sbp-cluster`` and ``sbp`` as a user runs them: real processes, blocking
calls, for the command-line tests (plain functions, no event loop needed)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from .procs import _child_env

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
CLI_TIMEOUT_S = 60.0


@dataclass
class LocalCluster:
    """A running ``sbp-cluster`` process."""

    process: subprocess.Popen[bytes]
    data_dir: Path
    pm_address: str
    log_path: Path

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C would; the launcher's exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_cluster(
    data_dir: Path, nodes: int = 2, extra: Sequence[str] = (), *, tables: bool = False
) -> LocalCluster:
    """Start ``python -m client.launcher`` on free ports and wait until it is
    up (with sbp-tables only when ``tables``: the other tests need none)."""
    ready = data_dir.parent / f"{data_dir.name}.ready"
    ready.unlink(missing_ok=True)
    log_path = data_dir.parent / f"{data_dir.name}.out"
    argv = [
        sys.executable,
        "-m",
        "client.launcher",
        "--port-base",
        "0",
        "--data-dir",
        str(data_dir),
        "--nodes",
        str(nodes),
        "--ready-file",
        str(ready),
        *([] if tables else ["--no-tables"]),
        *extra,
    ]
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_child_env()
        )
    cluster = LocalCluster(process, data_dir, "", log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().strip():
            cluster.pm_address = ready.read_text().strip()
            return cluster
        if process.poll() is not None:
            raise AssertionError(
                f"sbp-cluster exited with {process.returncode}:\n{cluster.output()}"
            )
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise AssertionError(f"sbp-cluster did not start in time:\n{cluster.output()}")


def sbp(
    pm: str, *args: str, stdin: bytes | None = None, timeout: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``sbp --pm PM ARGS…`` (``python -m client.cli``) and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "client.cli", "--pm", pm, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_child_env(),
        check=False,
    )


def sbp_json(pm: str, *args: str, stdin: bytes | None = None) -> Any:
    """``sbp --json …``, expected to succeed; its parsed output."""
    result = sbp(pm, "--json", *args, stdin=stdin)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def lines(*values: Sequence[str] | str) -> bytes:
    """Input for ``sbp append``: one value per line."""
    flat = [v for value in values for v in ([value] if isinstance(value, str) else value)]
    return ("\n".join(flat) + "\n").encode()


@contextlib.contextmanager
def running_cluster(data_dir: Path, nodes: int = 2) -> Iterator[LocalCluster]:
    """A cluster for a test module: started, and stopped cleanly at the end."""
    running = start_cluster(data_dir, nodes=nodes)
    try:
        yield running
    finally:
        assert running.stop() == 0, running.output()


def new_stream(pm: str, *flags: str) -> int:
    """``sbp streams create`` of one stream; its id."""
    created = sbp_json(pm, "streams", "create", *flags)
    assert created[0]["error_code"] == "NONE"
    return int(created[0]["stream"]["stream_id"])


def all_gone(processes: list[psutil.Process]) -> bool:
    """Whether every one of the processes has exited."""
    return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
