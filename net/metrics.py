"""Prometheus metrics of an SBP server's connections, shared by the data node
and the PM: one set of names (``sbp_*``) for both, told apart by the scrape
target (its ``job`` and ``instance`` labels), never by the metric name.

``ServerMetrics`` is the ``ConnectionObserver`` a ``net.Server`` reports to.
It is on the hot path (a few calls per frame), so it only bumps plain ints
and per-opcode bucket counts on the event-loop thread; a collector turns
them into Prometheus families when /metrics is scraped (on the HTTP thread:
it copies each dict before reading it). No prometheus-client object, and so
no lock, is touched per request.
"""

from __future__ import annotations

import itertools
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from sbp.enums import ErrorCode, Opcode
from sbp.observer import ConnectionObserver
from sbp.stats import BucketCounts, Buckets

#: request times span a loopback PING to a long-polling FETCH (seconds)
REQUEST_SECONDS_BOUNDS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


def new_registry() -> CollectorRegistry:
    """A registry of one server, with the process metrics (``process_*``)."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    return registry


def histogram_family(name: str, text: str, buckets: BucketCounts) -> HistogramMetricFamily:
    """A Prometheus histogram (unlabelled) from per-bucket counts."""
    family = HistogramMetricFamily(name, text, labels=[])
    _add_histogram(family, [], buckets)
    return family


def _add_histogram(family: HistogramMetricFamily, labels: list[str], buckets: BucketCounts) -> None:
    cumulative = itertools.accumulate(buckets.counts)
    bounds = [*(f"{bound:g}" for bound in buckets.bounds), "+Inf"]
    family.add_metric(
        labels, buckets=list(zip(bounds, cumulative, strict=True)), sum_value=buckets.total
    )


def _name(opcode: int) -> str:
    try:
        return Opcode(opcode).name
    except ValueError:
        return str(opcode)


def _code_name(code: int) -> str:
    coerced = ErrorCode.coerce(code)
    return coerced.name if isinstance(coerced, ErrorCode) else str(code)


class ServerMetrics(ConnectionObserver):
    """Connections, frames, bytes and requests of one server, by opcode."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.connections_open = 0
        self.connections_opened = 0
        self.requests_in_flight = 0
        self.frames_received: Tally[int] = Tally()
        self.bytes_received: Tally[int] = Tally()
        self.frames_sent: Tally[int] = Tally()
        self.bytes_sent: Tally[int] = Tally()
        self.frames_discarded: Tally[str] = Tally()
        # Every opcode answered normally shows from the first scrape on, so
        # that rate() over it has data before the first request of a kind;
        # an error code appears once it has been answered.
        self.requests: Tally[tuple[int, int]] = Tally(
            {(op.value, ErrorCode.NONE.value): 0 for op in Opcode}
        )
        self.request_seconds = {op.value: Buckets(REQUEST_SECONDS_BOUNDS) for op in Opcode}
        registry.register(_ServerCollector(self))

    def connection_opened(self) -> None:
        self.connections_open += 1
        self.connections_opened += 1

    def connection_closed(self) -> None:
        self.connections_open -= 1

    def frame_received(self, opcode: int, nbytes: int) -> None:
        self.frames_received[opcode] += 1
        self.bytes_received[opcode] += nbytes

    def frame_sent(self, opcode: int, nbytes: int) -> None:
        self.frames_sent[opcode] += 1
        self.bytes_sent[opcode] += nbytes

    def frame_discarded(self, reason: str) -> None:
        self.frames_discarded[reason] += 1

    def request_started(self, opcode: int) -> None:
        self.requests_in_flight += 1

    def request_finished(self, opcode: int, seconds: float, error_code: ErrorCode) -> None:
        self.requests_in_flight -= 1
        self.requests[(opcode, int(error_code))] += 1
        buckets = self.request_seconds.get(opcode)
        if buckets is not None:
            buckets.observe(seconds)


class _ServerCollector(Collector):
    """``ServerMetrics`` as Prometheus families, built at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        yield GaugeMetricFamily("sbp_connections", "connections open", value=m.connections_open)
        yield CounterMetricFamily(
            "sbp_connections_opened", "connections opened since start", value=m.connections_opened
        )
        yield GaugeMetricFamily(
            "sbp_requests_in_flight", "requests being served", value=m.requests_in_flight
        )
        for name, text, tally in (
            ("sbp_frames_received", "well-formed frames received", m.frames_received),
            ("sbp_received_bytes", "bytes received in frames", m.bytes_received),
            ("sbp_frames_sent", "frames sent", m.frames_sent),
            ("sbp_sent_bytes", "bytes sent in frames", m.bytes_sent),
        ):
            family = CounterMetricFamily(name, text, labels=["opcode"])
            for opcode, value in sorted(dict(tally).items()):
                family.add_metric([_name(opcode)], value)
            yield family
        discarded = CounterMetricFamily(
            "sbp_frames_discarded",
            "frames dropped or rejected by the bad-frame rules (SPEC §1), by reason",
            labels=["reason"],
        )
        for reason, value in sorted(dict(m.frames_discarded).items()):
            discarded.add_metric([reason], value)
        yield discarded
        requests = CounterMetricFamily(
            "sbp_requests",
            "requests served, by opcode and the SYSTEM_ERROR code answered (NONE: answered)",
            labels=["opcode", "code"],
        )
        for (opcode, code), value in sorted(dict(m.requests).items()):
            requests.add_metric([_name(opcode), _code_name(code)], value)
        yield requests
        seconds = HistogramMetricFamily(
            "sbp_request_duration_seconds",
            "time to serve a request, from its frame to its last response frame",
            labels=["opcode"],
        )
        for opcode, buckets in m.request_seconds.items():
            _add_histogram(seconds, [_name(opcode)], buckets.snapshot())
        yield seconds
