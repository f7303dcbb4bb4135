"""What the PM exposes on /metrics.

Cluster state (streams, ranges, data nodes, their heartbeats and load
reports) is read when scraped, by a collector, so it is never stale and costs
nothing between scrapes. The scrape runs on the HTTP server's thread: the
collector reads LMDB through its own read transaction and copies the node
states before iterating them, never holding anything the event loop needs.

Requests, frames and connections are counted by ``net.metrics.ServerMetrics``,
the connection observer both servers share.

To add a metric: a cluster gauge is one more ``yield`` in
``ClusterCollector.collect``; a request-level one goes on ``ServerMetrics``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from net.metrics import ServerMetrics, new_registry

from .manager import PlacementManager
from .wire import REPORT_FIELDS

NAMESPACE: Final = "sbp_pm"


class PMMetrics:
    """Every metric of one PM, in its own registry."""

    def __init__(self, manager: PlacementManager) -> None:
        self.registry = new_registry()
        self.registry.register(ClusterCollector(manager))
        self.connections = ServerMetrics(self.registry)


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
