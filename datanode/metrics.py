"""What the data node measures, for /metrics and for REPORT_METRICS.

The hot path bumps plain integers on ``NodeCounters`` (a few tens of
nanoseconds each) and observes two histograms; prometheus sees the counters
through a collector that reads them at scrape time, and the PM link turns
their differences over time into the rates of REPORT_METRICS. Storage figures
are read from the engine when scraped, never pushed.

To add a metric: a counter goes on ``NodeCounters`` plus one line in
``_CountersCollector.collect``; anything labelled caches its children up
front (``ConnectionMetrics`` shows how).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from net.observer import ConnectionObserver
from sbp.enums import ErrorCode, Opcode
from storage.model import StorageStats

NAMESPACE: Final = "sbp_datanode"
#: request latencies span a loopback fetch (~100 µs) to a slow synced commit
LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


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
        active_ranges: Callable[[], int],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.counters = NodeCounters()
        self.started_at = time.monotonic()
        self.append_latency = Histogram(
            f"{NAMESPACE}_append_latency_seconds",
            "APPEND request time, from receipt to the last result (durable)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.fetch_latency = Histogram(
            f"{NAMESPACE}_fetch_latency_seconds",
            "FETCH request time, from receipt to the last response frame (long polls included)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(
            _CountersCollector(self.counters, storage_stats, waiting_fetches, active_ranges)
        )
        self.connections = ConnectionMetrics(self.registry)


class _CountersCollector(Collector):
    """Exposes ``NodeCounters`` and the storage figures at scrape time (the
    scrape runs on the HTTP thread; reading ints there is safe)."""

    def __init__(
        self,
        counters: NodeCounters,
        storage_stats: Callable[[], StorageStats],
        waiting_fetches: Callable[[], int],
        active_ranges: Callable[[], int],
    ) -> None:
        self._counters = counters
        self._storage = storage_stats
        self._waiting = waiting_fetches
        self._ranges = active_ranges

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
        ):
            yield CounterMetricFamily(f"{NAMESPACE}_{name}", text, value=value)
        storage = self._storage()
        for name, text, total in (
            ("group_commits", "LMDB transactions committed (each one sync)", storage.commits_total),
            ("group_commit_seconds", "time spent writing and committing groups",
             storage.commit_seconds_total),
            ("committed_appends", "appends committed by the storage writer", storage.appends_total),
        ):  # fmt: skip
            yield CounterMetricFamily(f"{NAMESPACE}_{name}", text, value=total)
        for name, text, gauge in (
            ("waiting_fetches", "FETCH requests waiting for data", self._waiting()),
            ("active_ranges", "open (writable) ranges hosted", self._ranges()),
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
            ("memory_used_bytes", "resident set size", memory_used()),
        ):  # fmt: skip
            yield GaugeMetricFamily(f"{NAMESPACE}_{name}", text, value=gauge)


class ConnectionMetrics(ConnectionObserver):
    """The ``net`` connection observer: frames, bytes and requests by opcode.

    Label children are created once for every opcode, so the hot path is a
    dict lookup and an ``inc``.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        prefix = "sbp_server"
        self._open = Gauge(f"{prefix}_connections", "connections open", registry=registry)
        self._accepted = Counter(
            f"{prefix}_connections_accepted", "connections accepted", registry=registry
        )
        frames_in = Counter(
            f"{prefix}_frames_received", "frames received", ["opcode"], registry=registry
        )
        bytes_in = Counter(
            f"{prefix}_received_bytes", "bytes received in frames", ["opcode"], registry=registry
        )
        frames_out = Counter(f"{prefix}_frames_sent", "frames sent", ["opcode"], registry=registry)
        bytes_out = Counter(
            f"{prefix}_sent_bytes", "bytes sent in frames", ["opcode"], registry=registry
        )
        self._discarded = Counter(
            f"{prefix}_frames_discarded",
            "frames dropped or rejected (SPEC §1 bad-frame rules)",
            ["reason"],
            registry=registry,
        )
        self._requests = Counter(
            f"{prefix}_requests",
            "requests served, by opcode and SYSTEM_ERROR code (NONE: answered normally)",
            ["opcode", "code"],
            registry=registry,
        )
        self._in_flight = Gauge(
            f"{prefix}_requests_in_flight", "requests being served", registry=registry
        )
        self._frames_in = {op.value: frames_in.labels(op.name) for op in Opcode}
        self._bytes_in = {op.value: bytes_in.labels(op.name) for op in Opcode}
        self._frames_out = {op.value: frames_out.labels(op.name) for op in Opcode}
        self._bytes_out = {op.value: bytes_out.labels(op.name) for op in Opcode}
        self._requests_by = {
            (op.value, code): self._requests.labels(op.name, code.name)
            for op in Opcode
            for code in ErrorCode
        }

    def connection_opened(self) -> None:
        self._open.inc()
        self._accepted.inc()

    def connection_closed(self) -> None:
        self._open.dec()

    def frame_received(self, opcode: int, nbytes: int) -> None:
        frames = self._frames_in.get(opcode)
        if frames is not None:
            frames.inc()
            self._bytes_in[opcode].inc(nbytes)

    def frame_sent(self, opcode: int, nbytes: int) -> None:
        frames = self._frames_out.get(opcode)
        if frames is not None:
            frames.inc()
            self._bytes_out[opcode].inc(nbytes)

    def frame_discarded(self, reason: str) -> None:
        # Reasons are a small fixed set (see ConnectionObserver); rare, so no cache.
        self._discarded.labels(reason).inc()

    def request_started(self, opcode: int) -> None:
        self._in_flight.inc()

    def request_finished(self, opcode: int, seconds: float, error_code: ErrorCode) -> None:
        self._in_flight.dec()
        child = self._requests_by.get((opcode, error_code))
        if child is not None:
            child.inc()
