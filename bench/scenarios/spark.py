"""Spark read: rows/s through the ``sbp`` data source, against Spark reading
the same rows from a local Parquet file in the same session.

Measured by ``bench.spark_read.measure`` (a local cluster of two data
nodes, one stream of 100-byte records over four ranges, warm-up rounds, a
check of every answer); ``count(*)`` and ``sum(length(value))`` read every
value. A third reader, a Python data source doing no work, shows the fastest
any Python source can be on the machine. When pyspark is not installed, the
scenario reports that and measures nothing.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable

from matplotlib.figure import Figure

from bench.harness import Measurement, percentiles_ms
from bench.report import ScenarioResult, Target, number, table
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
    from bench.spark_read import (
        CEILING_READER,
        PARQUET_COPY,
        PARQUET_READER,
        QUICK,
        RECORDS,
        REPEAT,
        SBP_EXPORT,
        SBP_READER,
        WARMUPS,
    )

    records, repeat, warmups = QUICK if options.quick else (RECORDS, REPEAT, WARMUPS)
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
    by_reader = {m.system: m for m in measurements}
    ours, parquet = by_reader[SBP_READER], by_reader[PARQUET_READER]
    ceiling = by_reader[CEILING_READER]
    return ScenarioResult(
        name=NAME,
        title="Spark read",
        settings=settings,
        measurements=measurements,
        targets=[
            Target(
                "rows/s: sbp source / Spark's Parquet reader",
                ours.records_per_s / parquet.records_per_s,
                1.0,
                "x",
                note=f"a Python source doing nothing: "
                f"{ceiling.records_per_s / parquet.records_per_s:.2f}x",
            ),
        ],
        tables=[
            "## Rows per second (median of the repeats)\n\n"
            f"`{SBP_EXPORT}`: the stream read through the sbp source and written to Parquet "
            f"files partitioned by stream, as `spark_jobs/export_parquet.py` does; "
            f"`{PARQUET_COPY}`: the same rows read from the Parquet file and written the "
            "same way.\n\n" + table(["reader or job", "seconds", "rows/s", "MB/s of values"], rows)
        ],
        plot=_plot(measurements),
    )
