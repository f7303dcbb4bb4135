"""Running the fault-injection harness (``python -m bench chaos``) from the
chaos smoke tests, and what every passing run must show."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.chaos.checker import KINDS as CHECKS

#: a seed whose first minute has a fault of every kind
SEED = 20291641
#: a seed whose first 50 s with --tables --tiered have a fault of every
#: kind, and a kill of the object store among them
TIERED_SEED = 28497
TIERED_DURATION_S = 50
#: a kill-only seed whose kills land on primaries of replicated ranges
KILL_SEED = 18148120


def run_chaos(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", "chaos", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_passed_with_nothing_found(run: subprocess.CompletedProcess[str], out: Path) -> None:
    """The run passed, no check found anything, and no server logged a traceback."""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "chaos.json").read_text())
    assert report["verdict"] == "pass"
    assert report["violations"] == dict.fromkeys(CHECKS, 0)
    assert report["outcomes"]["ack"] > 3_000
    assert not any(report["server_tracebacks"].values())
