"""Spark read: rows/s through the ``sbp`` data source, against Spark reading
the same rows from a local Parquet file in the same session.

Built from ``bench.spark_read``'s pieces (its local cluster of two data
nodes, its stream of 100-byte records over four ranges, its timing that
checks every answer); ``count(*)`` and ``sum(length(value))`` read every
value. When pyspark is not installed, the scenario reports that and
measures nothing.
"""

from __future__ import annotations

import importlib.util
import signal
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure

from bench.harness import Measurement, percentiles_ms
from bench.report import ScenarioResult, number, table
from bench.scenarios.options import Options

NAME = "spark"


def _measure(records: int, repeat: int) -> list[Measurement]:
    import pyarrow.parquet as pq

    from bench.spark_read import VALUE_SIZE, fill_stream, start_cluster, timed
    from spark_jobs.session import spark_session

    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp:
        root = Path(tmp)
        cluster, pm = start_cluster(root)
        try:
            stream_id, rows = fill_stream(pm, records)
            parquet_path = root / "rows.parquet"
            pq.write_table(rows, parquet_path)
            spark = spark_session("sbp-bench-suite")
            expected = (records, records * VALUE_SIZE)
            aggregate = ["count(*) AS n", "sum(length(value)) AS bytes"]

            def sbp_query() -> tuple[int, int]:
                frame = spark.read.format("sbp").option("pm", pm).option("streams", str(stream_id))
                row = frame.load().selectExpr(*aggregate).first()
                assert row is not None
                return int(row.n), int(row.bytes)

            def parquet_query() -> tuple[int, int]:
                row = spark.read.parquet(str(parquet_path)).selectExpr(*aggregate).first()
                assert row is not None
                return int(row.n), int(row.bytes)

            timed(sbp_query, expected)  # warm-up: the Python workers start
            timed(parquet_query, expected)
            times: dict[str, list[float]] = {"sbp-spark-source": [], "spark-parquet": []}
            for _ in range(repeat):
                times["sbp-spark-source"].append(timed(sbp_query, expected))
                times["spark-parquet"].append(timed(parquet_query, expected))
            spark.stop()
        finally:
            cluster.send_signal(signal.SIGTERM)
            cluster.wait(30)
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
    records, repeat = (200_000, 1) if options.quick else (1_000_000, 3)
    settings: dict[str, object] = options.as_settings() | {"records": records, "repeat": repeat}
    if importlib.util.find_spec("pyspark") is None:
        return ScenarioResult(
            name=NAME,
            title="Spark read",
            settings=settings,
            tables=["Spark is not installed (`pip install -e '.[spark]'`): nothing measured."],
            extra={"skipped": "pyspark is not installed"},
        )
    measurements = _measure(records, repeat)
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
