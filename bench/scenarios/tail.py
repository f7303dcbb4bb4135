"""Tail latency: from an append's acknowledgement to a long-polling consumer
holding the record, at a fixed rate: half of SBP's peak, for every system
(or half of a peer's own peak when that is lower).

Each system's peak is measured first (64 KiB batches, one stream,
``DEFAULT_IN_FLIGHT`` in flight, durable settings; SBP's on a cluster of its
own, whose filled streams are deleted after it). One rate for all keeps
the client's share of the two cores the same: at half of JetStream's own
peak this process could not publish and consume fast enough, and the acks
came back seconds after the messages reached the consumer. Then one append is sent
every 1/rate seconds, each on its own task, while a consumer in a process of its
own (``bench.tail_consumer``) waits at the tail: SBP's ``Consumer``
(long-polling FETCH), Redis's XREAD BLOCK, a JetStream ordered push
consumer. Both processes read the machine's monotonic clock. A latency can
be negative: the server may deliver to the consumer before the producer has
read its answer. The first ``TAIL_WARMUP_S`` of appends are not counted.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from matplotlib.figure import Figure

from bench.harness import (
    Load,
    Measurement,
    Workload,
    local_cluster,
    percentiles_ms,
)
from bench.peers import nats_jetstream, redis_streams, sbp
from bench.report import ScenarioResult, Target, number, table
from bench.scenarios.options import Options

NAME = "tail"
P99_GOAL_MS = 5.0
P999_GOAL_MS = 10.0


#: appends at the rate before the counted ones: the consumer catches up
#: with its own start, and every server has its files open and warm
TAIL_WARMUP_S = 1.0


def _tail_load(options: Options) -> Load:
    return Load(0, 1.0 if options.quick else 6.0, TAIL_WARMUP_S)


def _as_measurement(
    system: str,
    durability: str,
    workload: Workload,
    peak: Measurement,
    rate: float,
    latencies: list[float],
    sent: int,
) -> Measurement:
    return Measurement(
        system=system,
        workload=workload.key,
        durability=durability,
        in_flight=0,
        seconds=round(sent / rate, 4),
        requests=len(latencies),
        bytes=len(latencies) * len(workload.batch),
        records=len(latencies) * workload.records_per_batch,
        latency_ms=percentiles_ms(latencies),
        extra={
            "peak_mb_per_s": round(peak.mb_per_s, 3),
            "rate_per_s": round(rate, 1),
            "rate_mb_per_s": round(rate * len(workload.batch) / 1e6, 3),
            "sent": sent,
            "received": len(latencies),
            "latencies_ms": sorted(round(x * 1e3, 4) for x in latencies),
        },
    )


async def _sbp(options: Options, workload: Workload) -> Measurement:
    # The peak on a cluster of its own: the streams it fills are deleted after
    # it, and the tail is measured on a store that is not freeing them.
    async with local_cluster("always", options.scratch) as cluster:
        peak = await sbp.measure_appends(cluster, "always", workload, options.load())
    rate = peak.requests_per_s / 2
    async with local_cluster("always", options.scratch) as cluster:
        latencies, sent = await sbp.measure_tail(cluster, workload, rate, _tail_load(options))
    return _as_measurement(sbp.SYSTEM, "sync always", workload, peak, rate, latencies, sent)


def _peer_rate(peak: Measurement, sbp_rate: float) -> float:
    """SBP's rate, or half the peer's own peak when that is lower."""
    return min(sbp_rate, peak.requests_per_s / 2)


def _redis(options: Options, workload: Workload, sbp_rate: float) -> Measurement:
    with redis_streams.redis_server(options.scratch) as server:
        peak = redis_streams.measure_appends(server, workload, "always", options.load())
        rate = _peer_rate(peak, sbp_rate)
        latencies, sent = redis_streams.measure_tail(
            server, workload, "always", rate, _tail_load(options)
        )
    return _as_measurement(
        redis_streams.SYSTEM, "aof always", workload, peak, rate, latencies, sent
    )


def _nats(options: Options, workload: Workload, sbp_rate: float) -> Measurement:
    with nats_jetstream.nats_server(options.scratch, nats_jetstream.SYNC_ALWAYS) as server:
        peak = nats_jetstream.measure_appends(server, workload, options.load())
        rate = _peer_rate(peak, sbp_rate)
        latencies, sent = nats_jetstream.measure_tail(server, workload, rate, _tail_load(options))
    return _as_measurement(
        nats_jetstream.SYSTEM, server.label, workload, peak, rate, latencies, sent
    )


def _plot(ms: list[Measurement]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        axes = figure.subplots()
        for m in ms:
            values = m.extra["latencies_ms"]
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                axes.plot(values, fractions, label=f"{m.system} ({m.durability})")
        axes.axvline(P99_GOAL_MS, linestyle="--", color="gray", linewidth=0.8)
        axes.set_xscale("symlog", linthresh=1.0)
        axes.set_xlabel("append acknowledged -> consumer holds the batch (ms)")
        axes.set_ylabel("fraction of batches")
        axes.set_title("Tail latency at half of SBP's peak, 64 KiB batches")
        axes.legend(fontsize=8)

    return draw


def run(options: Options) -> ScenarioResult:
    from bench.harness import one_stream_64k

    workload = one_stream_64k()
    ours = trio.run(_sbp, options, workload)
    sbp_rate = ours.extra["rate_per_s"]
    measurements = [ours, _redis(options, workload, sbp_rate), _nats(options, workload, sbp_rate)]
    rows = [
        (
            m.system,
            m.durability,
            number(m.extra["peak_mb_per_s"]),
            number(m.extra["rate_per_s"]),
            number(m.extra["rate_mb_per_s"]),
            f"{m.extra['received']:,} / {m.extra['sent']:,}",
            number(m.latency_ms["p50"], 2),
            number(m.latency_ms["p95"], 2),
            number(m.latency_ms["p99"], 2),
            number(m.latency_ms["p99.9"], 2),
            number(m.latency_ms["max"], 2),
        )
        for m in measurements
    ]
    ours = measurements[0]
    return ScenarioResult(
        name=NAME,
        title="Tail latency: append acknowledged to consumer",
        settings=options.as_settings()
        | {
            "batch_bytes": len(workload.batch),
            "tail_seconds": _tail_load(options).seconds,
            "tail_warmup_s": TAIL_WARMUP_S,
            "rate": "half of SBP's peak at the default in-flight (at most half of a peer's own)",
        },
        measurements=measurements,
        targets=[
            Target(
                "tail latency p99 at half of peak (SBP, sync always)",
                ours.latency_ms["p99"],
                P99_GOAL_MS,
                "ms",
                higher_is_better=False,
                note=f"at {ours.extra['rate_mb_per_s']:,.0f} MB/s",
            ),
            Target(
                "tail latency p99.9 at half of peak (SBP, sync always)",
                ours.latency_ms["p99.9"],
                P999_GOAL_MS,
                "ms",
                higher_is_better=False,
            ),
        ],
        tables=[
            "## Latency from acknowledgement to consumer\n\n"
            + table(
                [
                    "system",
                    "durability",
                    "peak MB/s",
                    "rate (batches/s)",
                    "rate MB/s",
                    "received / sent",
                    "p50 ms",
                    "p95 ms",
                    "p99 ms",
                    "p99.9 ms",
                    "max ms",
                ],
                rows,
                "ll" + "r" * 9,
            )
        ],
        plot=_plot(measurements),
    )
