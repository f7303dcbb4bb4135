"""``sbp-cluster`` and ``sbp`` as a user runs them: real processes, blocking
calls, for the command-line tests (plain functions, no event loop needed)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from client.local_cluster import LocalCluster, start_local_cluster

from .procs import _child_env

CLI_TIMEOUT_S = 60.0


def start_cluster(
    data_dir: Path, nodes: int = 2, extra: Sequence[str] = (), *, tables: bool = False
) -> LocalCluster:
    """``sbp-cluster`` on free ports, once it is up (with sbp-tables only
    when ``tables``: the other tests need none)."""
    return start_local_cluster(
        data_dir, ["--nodes", str(nodes), *([] if tables else ["--no-tables"]), *extra]
    )


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
