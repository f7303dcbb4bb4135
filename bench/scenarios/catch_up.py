"""Catch-up read: MB/s reading back, from the start, what was just written.

Each system first takes the same bytes (64 KiB batches into one stream, or
100-byte records in batches of 1,000), then one reader reads them all back
in order, every system in requests of the same size (the ``Consumer``'s
``fetch_bytes``, 2 MiB): SBP's ``Consumer`` (reading ahead, every batch
CRC-checked and decoded to columns), Redis XRANGE and a JetStream pull
consumer asking for as many entries as make that many bytes. Each reads
it ``READ_REPEATS`` times and the median counts. The data is warm in the
page cache (just written), as for a consumer that fell behind by minutes,
not days. The reading client is this process, for every system.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from matplotlib.figure import Figure

from bench.harness import (
    READ_REPEATS,
    Measurement,
    Workload,
    local_cluster,
    standard_workloads,
)
from bench.peers import nats_jetstream, redis_streams, sbp
from bench.report import ScenarioResult, Target, number, percent, table
from bench.scenarios.options import DEFAULT_IN_FLIGHT, Options
from client.consumer import DEFAULT_FETCH_BYTES

NAME = "catch_up"


def _total_bytes(options: Options) -> int:
    return (16 if options.quick else 1024) * 1024 * 1024


def _workloads() -> list[Workload]:
    return [w for w in standard_workloads() if w.streams == 1]


async def _sbp(options: Options, workloads: list[Workload]) -> list[Measurement]:
    # sync never only makes the writing phase short; reads do not depend on it
    async with local_cluster("never", options.scratch) as cluster:
        return [
            await sbp.measure_catch_up(cluster, w, _total_bytes(options), DEFAULT_IN_FLIGHT)
            for w in workloads
        ]


def _plot(ms: list[Measurement], workloads: list[Workload]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        axes = figure.subplots()
        systems = sorted({m.system for m in ms})
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            values = [
                next((m.mb_per_s for m in ms if m.system == system and m.workload == w.key), 0.0)
                for w in workloads
            ]
            axes.bar([x + i * width for x in range(len(workloads))], values, width, label=system)
        axes.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(workloads))], [w.label for w in workloads]
        )
        axes.set_ylabel("MB/s")
        axes.set_title("Catch-up read from offset 0")
        axes.legend(fontsize=8)

    return draw


def _targets(ms: list[Measurement]) -> list[Target]:
    found = {(m.system, m.workload): m for m in ms}
    ours, redis = found[("sbp", "64k-1")], found[("redis-streams", "64k-1")]
    small, small_redis = found[("sbp", "100b-1")], found[("redis-streams", "100b-1")]
    return [
        Target("64 KiB batches: SBP catch-up read", ours.mb_per_s, 1000, "MB/s"),
        Target(
            "64 KiB batches: SBP / Redis Streams",
            ours.mb_per_s / redis.mb_per_s,
            1.0,
            "x",
            note=f"{ours.mb_per_s:,.0f} vs {redis.mb_per_s:,.0f} MB/s",
        ),
        Target(
            "100 B records: SBP / Redis Streams, records/s",
            small.records_per_s / small_redis.records_per_s,
            1.5,
            "x",
            note=f"{small.records_per_s / 1e6:,.1f} M vs {small_redis.records_per_s / 1e6:,.1f} M",
        ),
    ]


def run(options: Options) -> ScenarioResult:
    workloads = _workloads()
    total = _total_bytes(options)
    measurements = trio.run(_sbp, options, workloads)
    with redis_streams.redis_server(options.scratch) as server:
        measurements += [
            redis_streams.measure_catch_up(server, w, total, DEFAULT_IN_FLIGHT) for w in workloads
        ]
    with nats_jetstream.nats_server(options.scratch) as server:
        measurements += [
            nats_jetstream.measure_catch_up(server, w, total, DEFAULT_IN_FLIGHT) for w in workloads
        ]
    labels = {w.key: w.label for w in workloads}
    rows = [
        (
            labels[m.workload],
            m.system,
            number(m.bytes / 1e6),
            number(m.mb_per_s),
            number(m.records_per_s),
            percent(m.server_cpu),
            percent(m.client_cpu),
            ", ".join(f"{x:,.0f}" for x in m.extra.get("runs_mb_per_s", [])),
        )
        for m in measurements
    ]
    return ScenarioResult(
        name=NAME,
        title="Catch-up read",
        settings=options.as_settings()
        | {
            "bytes_written": total,
            "read_request_bytes": DEFAULT_FETCH_BYTES,
            "read_repeats": READ_REPEATS,
        },
        measurements=measurements,
        targets=_targets(measurements),
        tables=[
            "## Reading back from the start\n\n"
            + table(
                [
                    "workload",
                    "system",
                    "MB read",
                    "MB/s",
                    "records/s",
                    "server CPU",
                    "client CPU",
                    "each read, MB/s",
                ],
                rows,
                "llrrrrrr",
            )
        ],
        plot=_plot(measurements, workloads),
    )
