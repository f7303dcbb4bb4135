"""Quota files and the throttle they give (SPEC §12), on a clock of our own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datanode.quotas import MAX_THROTTLE_MS, QuotaError, Quotas, load_quotas


def _file(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "quotas.json"
    path.write_text(json.dumps(document) if not isinstance(document, str) else document)
    return path


def test_a_principal_over_its_rate_is_told_to_wait_until_it_is_back_under(tmp_path: Path) -> None:
    now = [0.0]
    path = _file(tmp_path, {"quotas": [{"principal": "etl", "append_bytes_per_s": "1MiB"}]})
    quotas = Quotas(path, clock=lambda: now[0])
    rate = 1 << 20
    assert quotas.charge("etl", "append", rate) == 0  # a second's worth at once
    assert quotas.charge("etl", "append", rate // 2) == 500  # half a second in debt
    now[0] = 0.5
    assert quotas.charge("etl", "append", rate // 4) == 250
    assert quotas.charge("etl", "fetch", 10 * rate) == 0  # fetch is not limited
    assert quotas.charge("other", "append", 10 * rate) == 0  # no * entry
    assert quotas.charge("datanode", "append", 10 * rate) == 0  # the cluster's own
    assert quotas.charge("etl", "append", 100 * rate) == MAX_THROTTLE_MS
    assert quotas.throttled_seconds[("etl", "append")] == pytest.approx(0.75 + 30)


def test_star_limits_every_other_principal_on_its_own(tmp_path: Path) -> None:
    path = _file(tmp_path, {"quotas": [{"principal": "*", "fetch_bytes_per_s": 1000}]})
    quotas = Quotas(path, clock=lambda: 0.0)
    assert quotas.charge("a", "fetch", 1000) == 0
    assert quotas.charge("b", "fetch", 1000) == 0  # b has its own allowance
    assert quotas.charge("a", "fetch", 100) == 100


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("{not json", "quotas.json"),
        ({"quota": []}, "expected"),
        ({"quotas": [{"principal": "a", "append_bytes_per_s": 0}]}, "positive byte count"),
        ({"quotas": [{"principal": "a", "append_bytes_per_s": "lots"}]}, "not a size"),
        ({"quotas": [{"principal": "a", "write_bytes_per_s": 1}]}, "keys are"),
        ({"quotas": [{"principal": ""}]}, "principal name"),
        ({"quotas": [{"principal": "a"}, {"principal": "a"}]}, "has a quota already"),
    ],
)
def test_a_bad_file_is_refused_saying_where(tmp_path: Path, document: object, problem: str) -> None:
    with pytest.raises(QuotaError, match=problem):
        load_quotas(_file(tmp_path, document))


def test_a_bad_file_on_reload_keeps_the_quotas_in_force(tmp_path: Path) -> None:
    path = _file(tmp_path, {"quotas": [{"principal": "a", "append_bytes_per_s": 10}]})
    quotas = Quotas(path, clock=lambda: 0.0)
    path.write_text("[]")
    assert not quotas.reload()
    assert quotas.principals == 1 and quotas.charge("a", "append", 20) == 1000
