"""Rate-limited warnings: the first of a kind, then one per interval with a count."""

from __future__ import annotations

import logging

import pytest

from net import ratelog
from net.ratelog import RateLimitedLog


def test_one_warning_per_interval_per_kind(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: clock[0])
    log = RateLimitedLog(logging.getLogger("t"), interval=10.0)
    with caplog.at_level(logging.WARNING):
        assert log.warning("full", "disk full on %s", "n1")
        assert not log.warning("full", "disk full on %s", "n1")
        assert not log.warning("full", "disk full on %s", "n1")
        assert log.warning("big", "frame too large")  # another kind is its own
        clock[0] += 10.0
        assert log.warning("full", "disk full on %s", "n1")
    assert [r.getMessage() for r in caplog.records] == [
        "disk full on n1",
        "frame too large",
        "disk full on n1 (2 more like it in the last 10 s)",
    ]
