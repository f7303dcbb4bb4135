"""Histograms kept as plain counts: cheap enough for any hot path and free
of any metrics library, so that ``storage`` (no dependencies) and ``net``
(a few calls per frame) can both keep them; the servers turn snapshots into
Prometheus histograms when scraped."""

from __future__ import annotations

import bisect
from typing import NamedTuple


class BucketCounts(NamedTuple):
    """A copy of ``Buckets``: per-bucket (not cumulative) counts and the sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float


class Buckets:
    """Observations counted by the first upper bound they do not exceed
    (the last bucket is +Inf). Filled by one thread; a snapshot may be
    taken from another (each field is read whole under the GIL)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> BucketCounts:
        return BucketCounts(self.bounds, tuple(self.counts), self.total)
