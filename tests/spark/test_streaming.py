"""Streaming reads: micro-batches bounded by the read limit, availableNow
runs that drain and stop, and restarts from a checkpoint with no gap and no
duplicate."""

from __future__ import annotations

import threading
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from .streams import StreamOps, make_values

QUERY_TIMEOUT_S = 120


def run_available_now(
    spark: SparkSession, pm: str, stream: int, checkpoint: Path, output: Path, **options: str
) -> StreamingQuery:
    query = (
        spark.readStream.format("sbp")
        .option("pm", pm)
        .option("streams", str(stream))
        .option("maxRecordsPerTrigger", "40")
        .options(**options)
        .load()
        .writeStream.format("parquet")
        .option("path", str(output))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(QUERY_TIMEOUT_S)
    assert query.exception() is None
    return query


def data_batches(query: StreamingQuery) -> list[int]:
    """Rows of each micro-batch that read something."""
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"] > 0]


def output_rows(spark: SparkSession, output: Path) -> list[tuple[int, bytes]]:
    rows = spark.read.parquet(str(output)).orderBy("offset").collect()
    return [(row.offset, row.value) for row in rows]


def test_available_now_drains_in_bounded_batches_and_resumes_from_checkpoint(
    spark: SparkSession, ops: StreamOps, tmp_path: Path
) -> None:
    stream = ops.create_stream()
    checkpoint, output = tmp_path / "checkpoint", tmp_path / "out"
    values = make_values("run1", 60)
    ops.append(stream, values)
    ops.seal(stream)
    values += make_values("run1b", 40)
    ops.append(stream, values[60:])

    first = run_available_now(spark, ops.pm_address, stream, checkpoint, output)
    assert data_batches(first) == [40, 40, 20]
    assert output_rows(spark, output) == list(enumerate(values))

    # appended between runs, across another seal: picked up by the restart
    values += make_values("run2", 30)
    ops.append(stream, values[100:])
    ops.seal(stream)
    values += make_values("run2b", 25)
    ops.append(stream, values[130:])

    second = run_available_now(spark, ops.pm_address, stream, checkpoint, output)
    assert data_batches(second) == [40, 15]
    assert output_rows(spark, output) == list(enumerate(values))


def test_records_appended_while_a_run_goes_are_read_once(
    spark: SparkSession, ops: StreamOps, tmp_path: Path
) -> None:
    stream = ops.create_stream()
    checkpoint, output = tmp_path / "checkpoint", tmp_path / "out"
    values = make_values("before", 200)
    ops.append(stream, values)
    late = [make_values(f"late{i}", 7) for i in range(5)]

    def append_late() -> None:
        for chunk in late:
            ops.append(stream, chunk)

    appender = threading.Thread(target=append_late)
    appender.start()
    run_available_now(spark, ops.pm_address, stream, checkpoint, output)
    appender.join()
    for chunk in late:
        values += chunk
    # what the run saw is a gap-free prefix; the next run reads the rest
    seen = output_rows(spark, output)
    assert len(seen) >= 200
    assert seen == list(enumerate(values))[: len(seen)]
    run_available_now(spark, ops.pm_address, stream, checkpoint, output)
    assert output_rows(spark, output) == list(enumerate(values))


def test_continuous_query_picks_up_new_records(
    spark: SparkSession, ops: StreamOps, tmp_path: Path
) -> None:
    first, second = ops.create_stream(), ops.create_stream()
    ops.append(first, [b"a0", b"a1"])
    query = (
        spark.readStream.format("sbp")
        .option("pm", ops.pm_address)
        .option("streams", f"{first},{second}")
        .load()
        .writeStream.format("memory")
        .queryName("sbp_continuous")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        query.processAllAvailable()
        ops.append(second, [b"b0"])
        ops.seal(first)
        ops.append(first, [b"a2"])
        query.processAllAvailable()
        rows = spark.sql(
            "SELECT stream_id, offset, value FROM sbp_continuous ORDER BY stream_id, offset"
        ).collect()
    finally:
        query.stop()
    assert [(r.stream_id, r.offset, r.value) for r in rows] == [
        (first, 0, b"a0"),
        (first, 1, b"a1"),
        (first, 2, b"a2"),
        (second, 0, b"b0"),
    ]


def test_a_micro_batch_run_again_after_a_restart_writes_nothing_twice(
    spark: SparkSession, ops: StreamOps, tmp_path: Path
) -> None:
    """The sbp sink: a query that wrote micro-batch 1 and died before Spark
    recorded its commit (its commit file removed here, as a driver killed at
    that moment leaves it) runs it again on restart, from the same input;
    the stream holds every row once."""
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    source.mkdir()
    stream = ops.create_stream()

    def run() -> None:
        query = (
            spark.readStream.format("text")
            .option("maxFilesPerTrigger", "1")
            .load(str(source))
            .writeStream.format("sbp")
            .option("pm", ops.pm_address)
            .option("stream", str(stream))
            .option("checkpointLocation", str(checkpoint))
            # hundreds of batches a micro-batch: more than a producer's 64 kept
            .option("batchMaxBytes", "50")
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None

    first = [f"a{i}" for i in range(3000)]
    second = [f"b{i}" for i in range(3000)]
    (source / "1.txt").write_text("\n".join(first) + "\n")
    (source / "2.txt").write_text("\n".join(second) + "\n")
    run()
    assert sorted(ops.read_all(stream)) == sorted(v.encode() for v in first + second)
    for name in ("1", ".1.crc"):  # micro-batch 1 written, not committed
        (checkpoint / "commits" / name).unlink(missing_ok=True)
    run()  # runs micro-batch 1 again, from its logged offsets
    third = [f"c{i}" for i in range(3000)]
    (source / "3.txt").write_text("\n".join(third) + "\n")
    run()
    stored = ops.read_all(stream)
    assert sorted(stored) == sorted(v.encode() for v in first + second + third)
    assert len(stored) == len(set(stored)) == 9000


def test_a_query_with_a_group_commits_its_ends_and_starts_from_them(
    spark: SparkSession, ops: StreamOps, tmp_path: Path
) -> None:
    stream = ops.create_stream()
    values = make_values("grouped", 90)
    ops.append(stream, values)

    run_available_now(
        spark, ops.pm_address, stream, tmp_path / "c1", tmp_path / "o1", group="spark-etl"
    )
    [position] = ops.group_positions("spark-etl")
    assert (position.stream_id, position.offset) == (stream, 90)  # lag 0: all processed
    # a new query (no checkpoint) of the same group starts where it stopped
    more = make_values("later", 10)
    ops.append(stream, more)
    run_available_now(
        spark, ops.pm_address, stream, tmp_path / "c2", tmp_path / "o2", group="spark-etl"
    )
    assert output_rows(spark, tmp_path / "o2") == [(90 + i, v) for i, v in enumerate(more)]
    assert ops.group_positions("spark-etl")[0].offset == 100
