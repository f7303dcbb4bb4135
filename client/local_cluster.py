"""``sbp-cluster`` as a child process, for scripts, benchmarks and tests
that need a whole local cluster (blocking calls, no event loop).

``start_local_cluster`` runs ``python -m client.launcher`` with
``--ready-file`` and returns once the launcher has written the PM's address
there; ``LocalCluster.stop`` sends SIGTERM, as Ctrl-C would, and waits.
The servers inside are started by the launcher (``client.children``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: how long the launcher gets to start its PM and data nodes
READY_TIMEOUT_S = 60.0
#: how long it gets to stop them after SIGTERM before it is killed
STOP_TIMEOUT_S = 30.0
_POLL_S = 0.1


class LocalClusterError(RuntimeError):
    """The launcher exited or did not get ready; the message ends with its output."""


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
        """What the launcher printed (its log file)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start_local_cluster(
    data_dir: Path,
    args: Sequence[str] = (),
    *,
    log_path: Path | None = None,
    timeout: float = READY_TIMEOUT_S,
) -> LocalCluster:
    """``python -m client.launcher --data-dir DATA_DIR --port-base 0 ARGS``
    (free ports unless ARGS say otherwise), once it is ready. Its output
    goes to ``log_path`` (default: ``DATA_DIR.out`` beside the data
    directory). Raises ``LocalClusterError`` if it exits or is not ready
    within ``timeout`` (it is killed then)."""
    ready = data_dir.parent / f"{data_dir.name}.ready"
    ready.unlink(missing_ok=True)
    log_path = log_path or data_dir.parent / f"{data_dir.name}.out"
    argv = [
        *(sys.executable, "-m", "client.launcher"),
        *("--data-dir", str(data_dir), "--port-base", "0", "--ready-file", str(ready)),
        *args,
    ]
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    cluster = LocalCluster(process, data_dir, "", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        address = ready.read_text().strip() if ready.exists() else ""
        if address:
            cluster.pm_address = address
            return cluster
        if process.poll() is not None:
            raise LocalClusterError(
                f"sbp-cluster exited with {process.returncode}:\n{cluster.output()[-4000:]}"
            )
        time.sleep(_POLL_S)
    process.kill()
    process.wait()
    raise LocalClusterError(f"sbp-cluster did not start in time:\n{cluster.output()[-4000:]}")
