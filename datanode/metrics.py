"""What the data node measures, for /metrics and for REPORT_METRICS.

The hot path bumps plain integers on ``NodeCounters`` (a few tens of
nanoseconds each); prometheus sees them through a collector that reads them
at scrape time, and the PM link turns their differences over time into the
rates of REPORT_METRICS. Storage figures, the writer's histograms (group
size, commit and sync time) included, are read from the engine when scraped,
never pushed. Requests, frames and connections are counted by
``net.metrics.ServerMetrics``, shared with the PM.

To add a metric: a counter goes on ``NodeCounters`` plus one line in
``_CountersCollector.collect``.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from net.metrics import ServerMetrics, histogram_family, new_registry
from storage.model import RangeInfo, StorageStats

NAMESPACE: Final = "sbp_datanode"


@dataclass(slots=True)
class NodeCounters:
    """Monotonic totals since start-up, bumped on the trio thread."""

    append_requests: int = 0
    append_items: int = 0
    append_items_failed: int = 0
    append_seconds: float = 0.0
    appended_records: int = 0
    appended_bytes: int = 0
    fetch_requests: int = 0
    fetch_items: int = 0
    fetch_items_failed: int = 0
    fetch_seconds: float = 0.0
    fetched_records: int = 0
    fetched_bytes: int = 0
    retention_runs: int = 0
    retention_freed_records: int = 0
    retention_freed_bytes: int = 0
    #: idempotent producers' resends answered with their first offset (SPEC §10)
    duplicates_answered: int = 0
    producers_fenced: int = 0
    out_of_order_sequences: int = 0
    unknown_producers: int = 0

    def snapshot(self) -> NodeCounters:
        return NodeCounters(*(getattr(self, f.name) for f in fields(self)))


def memory_used() -> int:
    """Resident set size of this process in bytes (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class DataNodeMetrics:
    """Every metric of one data node, in its own registry."""

    def __init__(
        self,
        storage_stats: Callable[[], StorageStats],
        waiting_fetches: Callable[[], int],
        hosted_ranges: Callable[[], list[RangeInfo]],
    ) -> None:
        self.registry = new_registry()
        self.counters = NodeCounters()
        self.started_at = time.monotonic()
        self.registry.register(
            _CountersCollector(self.counters, storage_stats, waiting_fetches, hosted_ranges)
        )
        self.connections = ServerMetrics(self.registry)


class _CountersCollector(Collector):
    """Exposes ``NodeCounters`` and the storage figures at scrape time (the
    scrape runs on the HTTP thread; reading ints there is safe)."""

    def __init__(
        self,
        counters: NodeCounters,
        storage_stats: Callable[[], StorageStats],
        waiting_fetches: Callable[[], int],
        hosted_ranges: Callable[[], list[RangeInfo]],
    ) -> None:
        self._counters = counters
        self._storage = storage_stats
        self._waiting = waiting_fetches
        self._ranges = hosted_ranges

    def collect(self) -> Iterator[Metric]:
        c = self._counters
        for name, text, value in (
            ("appended_records", "records appended (durable)", c.appended_records),
            ("appended_bytes", "record batch bytes appended (durable)", c.appended_bytes),
            ("append_requests", "APPEND requests served", c.append_requests),
            ("append_items_failed", "APPEND items answered with an error", c.append_items_failed),
            ("fetched_records", "records returned by FETCH", c.fetched_records),
            ("fetched_bytes", "record batch bytes returned by FETCH", c.fetched_bytes),
            ("fetch_requests", "FETCH requests served", c.fetch_requests),
            ("fetch_items_failed", "FETCH items answered with an error", c.fetch_items_failed),
            ("retention_runs", "passes applying the streams' retention periods", c.retention_runs),
            ("retention_freed_records", "records dropped by retention", c.retention_freed_records),
            ("retention_freed_bytes", "stored bytes freed by retention", c.retention_freed_bytes),
            ("duplicates_answered",
             "idempotent resends answered with the offset they were stored at, not stored again",
             c.duplicates_answered),
            ("producers_fenced", "APPEND items refused PRODUCER_FENCED", c.producers_fenced),
            ("out_of_order_sequences", "APPEND items refused OUT_OF_ORDER_SEQUENCE",
             c.out_of_order_sequences),
            ("unknown_producers", "APPEND items refused UNKNOWN_PRODUCER", c.unknown_producers),
        ):  # fmt: skip
            yield CounterMetricFamily(f"{NAMESPACE}_{name}", text, value=value)
        storage = self._storage()
        yield CounterMetricFamily(
            f"{NAMESPACE}_committed_appends",
            "appends committed by the storage writer",
            value=storage.appends_total,
        )
        for name, text, gauge in (
            ("waiting_fetches", "FETCH requests waiting for data", self._waiting()),
            ("storage_stored_bytes", "record batch bytes stored", storage.stored_bytes),
            ("storage_used_bytes", "bytes of the LMDB map in use", storage.used_bytes),
            ("storage_map_size_bytes", "LMDB map size (the largest the data can grow)",
             storage.map_size),
            ("storage_file_bytes", "size of the LMDB data file", storage.file_bytes),
            ("storage_last_group_appends", "appends in the latest group commit",
             storage.last_group_size),
            ("storage_max_group_appends", "most appends in one group commit so far",
             storage.max_group_size),
            ("storage_last_commit_seconds", "duration of the latest group commit",
             storage.last_commit_seconds),
            ("storage_pending_appends", "appends waiting for the next group commit",
             storage.appends_waiting),
            ("storage_streams", "streams known to the storage engine", storage.streams),
            ("producers", "idempotent producers tracked, counted once per stream they append to",
             storage.producers),
            ("storage_streams_freeing",
             "streams with deleted or trimmed chunks that later appends have not all freed",
             storage.streams_freeing),
        ):  # fmt: skip
            yield GaugeMetricFamily(f"{NAMESPACE}_{name}", text, value=gauge)
        ranges = GaugeMetricFamily(
            f"{NAMESPACE}_ranges", "ranges hosted, by state", labels=["state"]
        )
        hosted = self._ranges()
        sealed = sum(1 for info in hosted if not info.is_open)
        ranges.add_metric(["open"], len(hosted) - sealed)
        ranges.add_metric(["sealed"], sealed)
        yield ranges
        for name, text, buckets in (
            ("group_commit_appends", "appends per group commit", storage.group_sizes),
            ("group_commit_duration_seconds",
             "time to write and commit one group (the fsync included)", storage.commit_seconds),
            ("sync_duration_seconds",
             "time of the commit call alone: with sync always, the fsyncs", storage.sync_seconds),
        ):  # fmt: skip
            yield histogram_family(f"{NAMESPACE}_{name}", text, buckets)
