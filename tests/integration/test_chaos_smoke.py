"""The fault-injection harness as a user runs it, at smoke size: a 50-second
run of every fault kind against a PM, three data nodes and an object store,
on tiered streams of one replica kept as Iceberg tables by sbp-tables, must
find no violation in the streams or their tables (replicated streams:
test_chaos_replicated.py; mutated frames: test_chaos_fuzz.py, each a file
of its own so that the long runs go to different test workers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos.checker import KINDS as CHECKS
from bench.chaos.faults import KINDS as FAULTS

from .chaos_runs import TIERED_DURATION_S, TIERED_SEED, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fifty_seconds_of_faults_lose_nothing_acknowledged(tmp_path: Path) -> None:
    run = run_chaos(
        "--duration", str(TIERED_DURATION_S), "--seed", str(TIERED_SEED), "--tables", "--tiered",
        "--out", str(tmp_path), timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # the schedule is printed before the run, so that it can be replayed
    replay = (
        f"replay with: python -m bench chaos --seed {TIERED_SEED} --duration {TIERED_DURATION_S} "
        "--tables --tiered"
    )
    assert replay in run.stdout
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert report["verdict"] == "pass"
    assert report["violations"] == dict.fromkeys(CHECKS, 0)
    assert {f["kind"] for f in report["faults"]} == set(FAULTS)
    assert report["outcomes"]["ack"] > 5_000
    assert report["stored_records"] > 0 and report["observed_by_consumers"] > 0
    # every stored record is in its table once ("table" above); trimmed ones may be too
    assert report["table_rows"] >= report["stored_records"]
    # sealed ranges went to the object store and were read back from there
    assert report["offloaded_ranges"] > 0
    assert not any(report["server_tracebacks"].values())
    for name in ("chaos.md", "chaos.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "# Chaos run: pass" in (tmp_path / "chaos.md").read_text()


def test_a_bad_fault_kind_is_a_usage_error(tmp_path: Path) -> None:
    run = run_chaos("--faults", "kill,meteor", "--out", str(tmp_path), timeout=60)
    assert run.returncode == 2
    assert "unknown fault kind 'meteor'" in run.stderr
