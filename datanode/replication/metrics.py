"""Replication on /metrics: follower lag, REPLICATE latency, and the ranges
this node knows to be missing a replica. Read at scrape time on the HTTP
thread (plain ints and a copied list: safe without locks)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from net.metrics import histogram_family

from .catchup import CatchUp
from .primary import Replicator

NAMESPACE: Final = "sbp_datanode"


class ReplicationCollector(Collector):
    def __init__(self, replicator: Replicator, catch_up: CatchUp) -> None:
        self._replicator = replicator
        self._catch_up = catch_up

    def collect(self) -> Iterator[Metric]:
        lag = self._replicator.follower_lag()
        records = GaugeMetricFamily(
            f"{NAMESPACE}_replication_lag_records",
            "records durable on this primary that a follower does not hold yet",
            labels=["follower"],
        )
        sent = GaugeMetricFamily(
            f"{NAMESPACE}_replication_in_flight_bytes",
            "batch bytes sent to a follower and not yet answered",
            labels=["follower"],
        )
        for node_id, (behind, unanswered) in sorted(lag.items()):
            records.add_metric([str(node_id)], behind)
            sent.add_metric([str(node_id)], unanswered)
        yield records
        yield sent
        yield GaugeMetricFamily(
            f"{NAMESPACE}_under_replicated_ranges",
            "ranges here missing a replica: led here with a follower behind, "
            "or sealed and not yet whole here",
            value=self._replicator.lagging_ranges() + len(self._catch_up.missing),
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_replication_pipelines",
            "open replicated ranges led here",
            value=len(self._replicator.pipelines),
        )
        yield histogram_family(
            f"{NAMESPACE}_replicate_seconds",
            "round trip of one REPLICATE to a follower",
            self._replicator.latency.snapshot(),
        )
