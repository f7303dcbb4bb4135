"""The fault-injection harness at smoke size on streams of three replicas:
27 s of faults (the first five of the 60-second run's schedule, every
one over before its quiet end), and 25 s of kills alone (the same five
kills as in 30 s), must find no violation and leave every replica holding what
its stream holds. Longer runs are in docs/reliability.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from .chaos_runs import KILL_SEED, SEED, assert_passed_with_nothing_found, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_half_a_minute_of_faults_on_replicated_streams_loses_nothing(tmp_path: Path) -> None:
    """Streams of three replicas under the same faults: besides the checks
    above, every replica of every range holds what the stream holds (the
    ``replica`` check reads each one from its own node). No node has a small
    map here: a follower whose disk is full stays short of its ranges
    (under-replicated, as its metrics say), which that check counts."""
    run = run_chaos(
        "--duration", "27", "--seed", str(SEED), "--replicas", "3", "--small-map-node", "",
        "--out", str(tmp_path), timeout=300,
    )  # fmt: skip
    assert_passed_with_nothing_found(run, tmp_path)


def test_half_a_minute_of_kills_on_replicated_streams_keeps_the_replicas_equal(
    tmp_path: Path,
) -> None:
    """Kills alone, of the data nodes and the PM, each back before the PM
    counts it dead: a primary killed between sending batches to its
    followers and its own fsync comes back fenced, and no offset it gave
    out is given to another value (this seed once left two followers
    holding one value at an offset and their primary another)."""
    run = run_chaos(
        "--duration", "25", "--seed", str(KILL_SEED), "--faults", "kill", "--replicas", "3",
        "--small-map-node", "", "--out", str(tmp_path), timeout=300,
    )  # fmt: skip
    assert_passed_with_nothing_found(run, tmp_path)
