"""Spark reading a stream through the ``sbp`` source against Spark reading the
same rows from a local Parquet file, in the same run and the same session.

A local cluster (PM + 2 data nodes) is started, one stream is filled with
records of 100 bytes (its open range sealed every quarter, so the reads plan
four ranges over both nodes), and the same rows are written to one Parquet
file with pyarrow. Each measurement runs ``count(*)`` and
``sum(length(value))`` (so every value is read), after three warm-up rounds
of each (the JVM keeps compiling for several queries); the kinds alternate
and the median of the repeats is reported. A third reader, a Python data
source that does no work (``bench/spark_ceiling.py``), gives the fastest any
Python source can be here. Then the stream is exported to Parquet files as
``spark_jobs/export_parquet.py`` does it, against reading the Parquet file
and writing it out again.

    .venv/bin/python -m bench.spark_read [--quick] [--records N] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from client.local_cluster import start_local_cluster
from client.sync import SyncClient
from sbp.batches import build_batch_from_arrays

VALUE_SIZE = 100
RECORDS_PER_BATCH = 10_000
RANGES = 4
SBP_READER = "sbp-spark-source"
PARQUET_READER = "spark-parquet"
#: a Python source that does no work (bench/spark_ceiling.py)
CEILING_READER = "python-source-ceiling"
#: a stream to Parquet files as spark_jobs/export_parquet.py does it, and the
#: same rows read from Parquet and written again
SBP_EXPORT = "sbp-export-parquet"
PARQUET_COPY = "parquet-to-parquet"
#: the sbp source's default cut (maxRecordsPerPartition): the ceiling gets as many partitions
PARTITION_RECORDS = 1_000_000


def fill_stream(pm: str, records: int) -> tuple[int, pa.Table]:
    """A new stream holding ``records`` values of VALUE_SIZE bytes; the same rows as Arrow."""
    rng = np.random.default_rng(7)
    values = rng.integers(0, 256, size=records * VALUE_SIZE, dtype=np.uint8)
    lengths = np.full(RECORDS_PER_BATCH, VALUE_SIZE, dtype=np.int64)
    timestamp = int(time.time() * 1000)
    with SyncClient(pm) as client:
        stream_id = int(client.create_stream(1).stream_id)
        per_range = -(-records // RANGES)
        for first in range(0, records, per_range):
            last = min(first + per_range, records)
            # one producer per range: the seal comes after its records are durable
            with client.producer(stream_id) as producer:
                for start in range(first, last, RECORDS_PER_BATCH):
                    count = min(RECORDS_PER_BATCH, last - start)
                    chunk = values[start * VALUE_SIZE : (start + count) * VALUE_SIZE]
                    producer.send_batch(build_batch_from_arrays(chunk, lengths[:count], timestamp))
            if last < records:
                client.seal(stream_id)
    positions = np.arange(0, (records + 1) * VALUE_SIZE, VALUE_SIZE, dtype=np.int32)
    table = pa.table(
        {
            "stream_id": pa.array(np.full(records, stream_id, dtype=np.int64)),
            "offset": pa.array(np.arange(records, dtype=np.int64)),
            "timestamp": pa.array(
                np.full(records, timestamp * 1000, dtype=np.int64), pa.timestamp("us", tz="UTC")
            ),
            "value": pa.Array.from_buffers(
                pa.binary(), records, [None, pa.py_buffer(positions), pa.py_buffer(values)]
            ),
        }
    )
    return stream_id, table


def timed(query: Callable[[], tuple[int, int]], expected: tuple[int, int]) -> float:
    started = time.perf_counter()
    result = query()
    elapsed = time.perf_counter() - started
    if result != expected:
        raise SystemExit(f"a query returned {result}, expected {expected}")
    return elapsed


WARMUPS = 3
REPEAT = 5
RECORDS = 10_000_000
#: ``--quick``: enough to check the harness, not to measure
QUICK_RECORDS = 100_000
#: ``--quick``'s records, repeat and warm-up rounds
QUICK = (QUICK_RECORDS, 1, 0)


def measure(records: int, repeat: int, warmups: int = WARMUPS) -> dict[str, list[float]]:
    """Seconds per query of each reader, ``repeat`` times each, alternating.

    A local cluster and a Spark session are started for the run and stopped
    after it. ``warmups`` rounds of both queries come first and are not
    counted: they start the Python workers and let the JVM compile both
    readers' code, which takes Spark several queries.
    """
    from bench.spark_ceiling import NAME as CEILING_NAME
    from bench.spark_ceiling import CeilingSource
    from spark_jobs.session import spark_session

    with tempfile.TemporaryDirectory(prefix="sbp-bench-spark-") as tmp:
        root = Path(tmp)
        cluster = start_local_cluster(
            root / "data", ["--nodes", "2", "--sync", "never", "--no-tables"]
        )
        pm = cluster.pm_address
        try:
            print(f"filling a stream with {records:,} records of {VALUE_SIZE} B …", flush=True)
            stream_id, table = fill_stream(pm, records)
            parquet_path = root / "rows.parquet"
            pq.write_table(table, parquet_path)
            # Parquet writes of 10 M rows, two tasks at a time, outgrow the default 1 GiB heap
            spark = spark_session("sbp-bench-spark-read", conf={"spark.driver.memory": "3g"})
            spark.dataSource.register(CeilingSource)
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

            partitions = max(RANGES, -(-records // PARTITION_RECORDS))

            def ceiling_query() -> tuple[int, int]:
                frame = spark.read.format(CEILING_NAME).option("rows", str(records))
                row = frame.option("partitions", str(partitions)).load().selectExpr(*aggregate)
                first = row.first()
                assert first is not None
                return int(first.n), int(first.bytes)

            exported = root / "exported"

            def written_rows() -> tuple[int, int]:
                rows = sum(pq.read_metadata(f).num_rows for f in exported.rglob("*.parquet"))
                return rows, rows * VALUE_SIZE  # every value is VALUE_SIZE bytes

            def sbp_export() -> tuple[int, int]:
                frame = spark.read.format("sbp").option("pm", pm).option("streams", str(stream_id))
                # as spark_jobs/export_parquet.py writes it
                frame.load().write.mode("overwrite").partitionBy("stream_id").parquet(str(exported))
                return written_rows()

            def parquet_copy() -> tuple[int, int]:
                frame = spark.read.parquet(str(parquet_path))
                frame.write.mode("overwrite").partitionBy("stream_id").parquet(str(exported))
                return written_rows()

            queries = {
                SBP_READER: sbp_query,
                PARQUET_READER: parquet_query,
                CEILING_READER: ceiling_query,
                SBP_EXPORT: sbp_export,
                PARQUET_COPY: parquet_copy,
            }
            times: dict[str, list[float]] = {name: [] for name in queries}
            for round_ in range(warmups + repeat):
                for name, query in queries.items():
                    seconds = timed(query, expected)
                    if round_ >= warmups:
                        times[name].append(seconds)
            spark.stop()
        finally:
            cluster.stop()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.spark_read", description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=RECORDS)
    parser.add_argument("--repeat", type=int, default=REPEAT)
    parser.add_argument(
        "--quick", action="store_true", help="100,000 records, one repeat, no warm-up"
    )
    args = parser.parse_args(argv)
    if args.quick:
        records, repeat, warmups = QUICK
    else:
        records, repeat, warmups = args.records, args.repeat, WARMUPS
    times = measure(records, repeat, warmups)
    sbp_s = statistics.median(times[SBP_READER])
    parquet_s = statistics.median(times[PARQUET_READER])
    ceiling_s = statistics.median(times[CEILING_READER])
    mb = records * VALUE_SIZE / 1e6
    print(f"\n{records:,} records of {VALUE_SIZE} B, median of {repeat} (cores: {os.cpu_count()})")
    print("| reader | seconds | records/s | MB/s of values |")
    print("|---|---:|---:|---:|")
    for name, seconds in (
        ("sbp source", sbp_s),
        ("Parquet file", parquet_s),
        ("Python source doing nothing", ceiling_s),
        ("export to Parquet (sbp source)", statistics.median(times[SBP_EXPORT])),
        ("Parquet to Parquet", statistics.median(times[PARQUET_COPY])),
    ):
        print(f"| {name} | {seconds:.2f} | {records / seconds / 1e6:.2f} M | {mb / seconds:.0f} |")
    print(f"\nsbp / Parquet rate: {parquet_s / sbp_s:.0%} (target: at least 100%)")
    print(f"sbp / the Python source ceiling: {ceiling_s / sbp_s:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
