"""Spark read: rows/s through the ``sbp`` data source, against Spark reading
the same rows from a local Parquet file in the same session.

Measured by ``bench.spark_read.measure`` (a local cluster of two data
nodes, one stream of 100-byte records over four ranges, warm-up rounds, a
check of every answer); ``count(*)`` and ``sum(length(value))`` read every
value. When pyspark is not installed, the scenario reports that and
measures nothing.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable

from matplotlib.figure import Figure

from bench.harness import Measurement, percentiles_ms
from bench.report import ScenarioResult, number, table
from bench.scenarios.options import Options

NAME = "spark"


def _measure(records: int, repeat: int, warmups: int) -> list[Measurement]:
    from bench.spark_read import VALUE_SIZE, measure

    times = measure(records, repeat, warmups)
    return [
        Measurement(
            system=system,
            workload=f"{records:,} x {VALUE_SIZE} B",
            durability="n/a (read)",
            in_flight=1,
            seconds=round(statistics.median(samples), 4),
            requests=1,
            bytes=records * VALUE_SIZE,
            records=records,
            latency_ms=percentiles_ms([]),
            extra={"runs_s": [round(s, 4) for s in samples]},
        )
        for system, samples in times.items()
    ]


def _plot(ms: list[Measurement]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        axes = figure.subplots()
        axes.bar([m.system for m in ms], [m.records_per_s / 1e6 for m in ms])
        axes.set_ylabel("million rows/s")
        axes.set_title("Spark count + sum(length(value)) over 100-byte records")

    return draw


def run(options: Options) -> ScenarioResult:
    from bench.spark_read import REPEAT, WARMUPS

    records, repeat, warmups = (200_000, 1, 1) if options.quick else (1_000_000, REPEAT, WARMUPS)
    settings: dict[str, object] = options.as_settings() | {
        "records": records,
        "warm-up rounds": warmups,
        "repeat": repeat,
    }
    if importlib.util.find_spec("pyspark") is None:
        return ScenarioResult(
            name=NAME,
            title="Spark read",
            settings=settings,
            tables=["Spark is not installed (`pip install -e '.[spark]'`): nothing measured."],
            extra={"skipped": "pyspark is not installed"},
        )
    measurements = _measure(records, repeat, warmups)
    rows = [
        (m.system, number(m.seconds, 2), number(m.records_per_s), number(m.mb_per_s))
        for m in measurements
    ]
    return ScenarioResult(
        name=NAME,
        title="Spark read",
        settings=settings,
        measurements=measurements,
        tables=[
            "## Rows per second (median of the repeats)\n\n"
            + table(["reader", "seconds", "rows/s", "MB/s of values"], rows)
        ],
        plot=_plot(measurements),
    )
