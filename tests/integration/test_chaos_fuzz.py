"""The fault-injection harness's fuzz mode at smoke size: 50,000 mutated
frames (the first half a warm-up before memory is measured) must leave
the servers serving, with their records and memory intact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .chaos_runs import run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_mutated_frames_leave_the_servers_serving(tmp_path: Path) -> None:
    run = run_chaos(
        "--mode",
        "fuzz",
        "--frames",
        "50000",
        "--seed",
        "7",
        # a short run's memory is noisy: the 10 % bound is for 1,000,000 frames
        "--memory-tolerance",
        "50",
        "--out",
        str(tmp_path),
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "fuzz.json").read_text())
    assert report["verdict"] == "pass" and report["failures"] == []
    assert report["frames"] >= 50_000
    # memory was measured after the warm-up and again after the rest
    assert [step["frames"] for step in report["memory_mb_by_frames"]] == [50_000]
    assert set(report["by_mutation"]) == {"flip", "truncate", "fields", "header", "vector"}
    assert not any(report["server_tracebacks"].values())
