"""The drain's progress line (``sbp nodes drain --wait``): its rate is what
left the nodes lately, not since a first sample the PM gave before it knew
the sizes, and the ETA follows from it."""

from __future__ import annotations

from client.cli_nodes import LeftRate
from client.format import duration_text


def test_the_rate_follows_what_left_lately_and_gives_an_eta() -> None:
    rate = LeftRate(window=10)
    rate.note(0.0, 0)  # the PM has not sized the ranges yet
    assert rate.per_second == 0 and rate.eta_text() == "done"
    rate.note(1.0, 151 << 20)  # sizes known: the window starts again
    assert rate.per_second == 0 and rate.eta_text() == "ETA unknown"
    rate.note(2.0, 141 << 20)
    rate.note(3.0, 131 << 20)
    assert rate.per_second == 10 << 20
    assert rate.eta_text() == "ETA 13s"
    for second in range(4, 20):  # slower now: the old samples leave the window
        rate.note(float(second), (131 << 20) - (second - 3) * (1 << 20))
    assert rate.per_second == 1 << 20
    assert rate.eta_text() == "ETA 1m 55s"  # 115 MiB left


def test_durations_read_as_people_write_them() -> None:
    assert [duration_text(s) for s in (0.4, 45, 200, 7500)] == ["0s", "45s", "3m 20s", "2h 05m"]
