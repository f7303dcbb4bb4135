"""What the PM exposes on /metrics.

Cluster state (streams, ranges, data nodes, their heartbeats and load
reports) is read when scraped, by a collector, so it is never stale and costs
nothing between scrapes. The scrape runs on the HTTP server's thread: the
collector reads LMDB through its own read transaction and copies the node
states before iterating them, never holding anything the event loop needs.

Requests and frames are counted by ``PMConnectionMetrics``, the ``net``
connection observer, with label children created up front so that the hot
path is a dict lookup and an ``inc``.

To add a metric: a cluster gauge is one more ``yield`` in
``ClusterCollector.collect``; a request-level one goes on the observer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from net.observer import ConnectionObserver
from sbp.enums import ErrorCode, Opcode

from .manager import PlacementManager
from .wire import REPORT_FIELDS

NAMESPACE: Final = "sbp_pm"
#: PM requests span an in-memory read (~100 µs) to a seal waiting on a data node
LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class PMMetrics:
    """Every metric of one PM, in its own registry."""

    def __init__(self, manager: PlacementManager) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(ClusterCollector(manager))
        self.connections = PMConnectionMetrics(self.registry)


class ClusterCollector(Collector):
    """Streams, ranges and data nodes, computed at scrape time."""

    def __init__(self, manager: PlacementManager) -> None:
        self._manager = manager

    def collect(self) -> Iterator[Metric]:
        counts = self._manager.counts()
        yield GaugeMetricFamily(f"{NAMESPACE}_streams", "streams", value=counts.streams)
        # Every stream has exactly one open range, its last one.
        ranges = GaugeMetricFamily(f"{NAMESPACE}_ranges", "ranges by state", labels=["state"])
        ranges.add_metric(["open"], counts.streams)
        ranges.add_metric(["sealed"], max(counts.ranges - counts.streams, 0))
        yield ranges

        registry = self._manager.registry
        states = list(registry.states())
        by_state = GaugeMetricFamily(
            f"{NAMESPACE}_data_nodes", "data nodes by liveness", labels=["state"]
        )
        by_state.add_metric(["alive"], sum(1 for s in states if s.alive))
        by_state.add_metric(["dead"], sum(1 for s in states if not s.alive))
        yield by_state

        since = GaugeMetricFamily(
            f"{NAMESPACE}_data_node_seconds_since_heartbeat",
            "seconds since the data node's last HEARTBEAT or REPORT_METRICS",
            labels=["node"],
        )
        hosted = GaugeMetricFamily(
            f"{NAMESPACE}_data_node_ranges", "ranges hosted by the data node", labels=["node"]
        )
        alive = GaugeMetricFamily(
            f"{NAMESPACE}_data_node_alive", "1 while the data node is alive", labels=["node"]
        )
        reported = {
            name: GaugeMetricFamily(
                f"{NAMESPACE}_data_node_{name}",
                f"{name} from the data node's latest REPORT_METRICS",
                labels=["node"],
            )
            for name in REPORT_FIELDS
        }
        for state in states:
            node = str(state.node_id)
            since.add_metric([node], registry.seconds_since_seen(state))
            hosted.add_metric([node], state.hosted_ranges)
            alive.add_metric([node], 1 if state.alive else 0)
            for name, value in dict(state.metrics).items():
                family = reported.get(name)
                if family is not None:
                    family.add_metric([node], value)
        yield since
        yield hosted
        yield alive
        yield from reported.values()


class PMConnectionMetrics(ConnectionObserver):
    """The ``net`` connection observer: connections, frames and requests."""

    def __init__(self, registry: CollectorRegistry) -> None:
        prefix = f"{NAMESPACE}_server"
        self._open = Gauge(f"{prefix}_connections", "connections open", registry=registry)
        frames_in = Counter(
            f"{prefix}_frames_received", "frames received", ["opcode"], registry=registry
        )
        frames_out = Counter(f"{prefix}_frames_sent", "frames sent", ["opcode"], registry=registry)
        self._discarded = Counter(
            f"{prefix}_frames_discarded",
            "frames dropped or rejected (SPEC §1 bad-frame rules)",
            ["reason"],
            registry=registry,
        )
        requests = Counter(
            f"{prefix}_requests",
            "requests served, by opcode and SYSTEM_ERROR code (NONE: answered normally)",
            ["opcode", "code"],
            registry=registry,
        )
        latency = Histogram(
            f"{prefix}_request_seconds",
            "time to serve a request, by opcode",
            ["opcode"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._in_flight = Gauge(
            f"{prefix}_requests_in_flight", "requests being served", registry=registry
        )
        self._frames_in = {op.value: frames_in.labels(op.name) for op in Opcode}
        self._frames_out = {op.value: frames_out.labels(op.name) for op in Opcode}
        self._latency = {op.value: latency.labels(op.name) for op in Opcode}
        self._requests = {
            (op.value, code): requests.labels(op.name, code.name)
            for op in Opcode
            for code in ErrorCode
        }

    def connection_opened(self) -> None:
        self._open.inc()

    def connection_closed(self) -> None:
        self._open.dec()

    def frame_received(self, opcode: int, nbytes: int) -> None:
        child = self._frames_in.get(opcode)
        if child is not None:
            child.inc()

    def frame_sent(self, opcode: int, nbytes: int) -> None:
        child = self._frames_out.get(opcode)
        if child is not None:
            child.inc()

    def frame_discarded(self, reason: str) -> None:
        self._discarded.labels(reason).inc()

    def request_started(self, opcode: int) -> None:
        self._in_flight.inc()

    def request_finished(self, opcode: int, seconds: float, error_code: ErrorCode) -> None:
        self._in_flight.dec()
        child = self._requests.get((opcode, error_code))
        if child is not None:
            child.inc()
        latency = self._latency.get(opcode)
        if latency is not None:
            latency.observe(seconds)
