"""Catch-up read: MB/s reading back, from the start, what was just written.

Each system first takes the same bytes (64 KiB batches into one stream, or
100-byte records in batches of 1,000), then one reader reads them all back
in order, about 1 MiB per request: SBP's ``Consumer`` (FETCH of 1 MiB with
prefetch, every batch CRC-checked and decoded to columns), Redis XRANGE of
16 entries, a JetStream pull consumer fetching 16 messages. The data is
warm in the page cache (just written), as for a consumer that fell behind
by minutes, not days.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from matplotlib.figure import Figure

from bench.harness import Measurement, Workload, local_cluster, standard_workloads
from bench.peers import nats_jetstream, redis_streams, sbp
from bench.report import ScenarioResult, number, percent, table
from bench.scenarios.options import DEFAULT_IN_FLIGHT, Options

NAME = "catch_up"


def _total_bytes(options: Options) -> int:
    return (16 if options.quick else 256) * 1024 * 1024


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
        )
        for m in measurements
    ]
    return ScenarioResult(
        name=NAME,
        title="Catch-up read",
        settings=options.as_settings() | {"bytes_written": total, "read_request": "~1 MiB"},
        measurements=measurements,
        tables=[
            "## Reading back from the start\n\n"
            + table(
                ["workload", "system", "MB read", "MB/s", "records/s", "server CPU", "client CPU"],
                rows,
                "llrrrrr",
            )
        ],
        plot=_plot(measurements, workloads),
    )
