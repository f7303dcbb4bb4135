"""Batch writes: the ``value`` column appended to a stream, then read back."""

from __future__ import annotations

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from .streams import StreamOps, make_values


def write(df: DataFrame, pm: str, stream: int, **options: str) -> None:
    (
        df.write.format("sbp")
        .mode("append")
        .option("pm", pm)
        .option("stream", str(stream))
        .options(**options)
        .save()
    )


def test_string_values_round_trip_in_order(spark: SparkSession, ops: StreamOps) -> None:
    stream = ops.create_stream()
    lines = [f"line {i} " + "y" * (i % 13) for i in range(1000)]
    df = spark.createDataFrame([(line,) for line in lines], "value string").coalesce(1)
    # small batches: many appends, cut inside the Arrow batches Spark hands over
    write(df, ops.pm_address, stream, batchMaxBytes="2000")
    assert ops.read_all(stream) == [line.encode() for line in lines]
    read_back = (
        spark.read.format("sbp")
        .option("pm", ops.pm_address)
        .option("streams", str(stream))
        .load()
        .orderBy("offset")
        .collect()
    )
    assert [row.value.decode() for row in read_back] == lines
    assert [row.offset for row in read_back] == list(range(1000))


def test_binary_values_from_several_tasks(spark: SparkSession, ops: StreamOps) -> None:
    stream = ops.create_stream()
    values = [*make_values("bin", 300), b"", b"\x00\xff" * 50]
    df = spark.createDataFrame([(v, i) for i, v in enumerate(values)], "value binary, n int")
    write(df.repartition(3), ops.pm_address, stream)
    # tasks append concurrently: every record once, order only within a task
    assert sorted(ops.read_all(stream)) == sorted(values)


def test_write_after_a_seal_goes_to_the_new_range(spark: SparkSession, ops: StreamOps) -> None:
    stream = ops.create_stream()
    ops.append(stream, [b"old"])
    ops.seal(stream)
    write(spark.createDataFrame([("new",)], "value string"), ops.pm_address, stream)
    assert ops.read_all(stream) == [b"old", b"new"]
    assert ops.layout(stream).next_offset == 2


def test_overwrite_is_refused(spark: SparkSession, ops: StreamOps) -> None:
    stream = ops.create_stream()
    df = spark.createDataFrame([("x",)], "value string")
    with pytest.raises(PySparkException, match="append-only"):
        (
            df.write.format("sbp")
            .mode("overwrite")
            .option("pm", ops.pm_address)
            .option("stream", str(stream))
            .save()
        )


def test_a_value_column_is_required(spark: SparkSession, ops: StreamOps) -> None:
    df = spark.createDataFrame([(1,)], "n int")
    with pytest.raises(PySparkException, match="needs a column 'value'"):
        write(df, ops.pm_address, ops.create_stream())


def test_null_values_are_refused(spark: SparkSession, ops: StreamOps) -> None:
    df = spark.createDataFrame([("a",), (None,)], "value string")
    with pytest.raises(PySparkException, match="null values"):
        write(df.coalesce(1), ops.pm_address, ops.create_stream())


def test_stream_option_is_checked(spark: SparkSession, ops: StreamOps) -> None:
    df = spark.createDataFrame([("a",)], "value string")
    with pytest.raises(PySparkException, match="option 'stream' is required"):
        df.write.format("sbp").mode("append").option("pm", ops.pm_address).save()


def test_tasks_that_fail_once_each_store_every_row_once(
    spark: SparkSession, ops: StreamOps
) -> None:
    """Each task's first attempt dies part way, after hundreds of its batches
    are stored (more than the 64 a producer's state keeps, so resending them
    is not enough); the retry skips what the stream holds from the task's
    producer and stores the rest: every row once."""
    from collections.abc import Iterator

    from pyspark import TaskContext

    def fail_first_attempt(rows: Iterator[tuple[str]]) -> Iterator[tuple[str]]:
        context = TaskContext.get()
        for position, row in enumerate(rows):
            if context is not None and context.attemptNumber() == 0 and position == 15_000:
                raise RuntimeError("the first attempt dies here")
            yield row

    # small Arrow batches reach the writer while the first attempt still runs
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "50")
    try:
        stream = ops.create_stream()
        rows = [(f"{task}:{i:05d}",) for task in range(2) for i in range(20_000)]
        failing = spark.sparkContext.parallelize(rows, 2).mapPartitions(fail_first_attempt)
        write(spark.createDataFrame(failing, "value string"), ops.pm_address, stream,
              batchMaxBytes="200")  # fmt: skip
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    stored = [v.decode() for v in ops.read_all(stream)]
    assert sorted(stored) == sorted(v for (v,) in rows)  # every row, once
    assert len(stored) == len(set(stored)) == 40_000


def test_keys_and_headers_are_written_and_read_with_the_records_own_time(
    spark: SparkSession, ops: StreamOps
) -> None:
    """The writer takes optional ``key`` and ``headers`` columns (SPEC §13);
    the source gives ``key`` always and ``headers`` with ``includeHeaders``,
    as Kafka's does, and ``timestamp`` is each record's own."""
    stream = ops.create_stream()
    rows = [
        ("v0", b"k0", {"trace": b"t0"}),
        ("v1", None, None),
        (None, b"gone", {}),  # a tombstone: a null value with a key
    ]
    df = spark.createDataFrame(rows, "value string, key binary, headers map<string,binary>")
    write(df.coalesce(1), ops.pm_address, stream)
    loaded = (
        spark.read.format("sbp")
        .option("pm", ops.pm_address)
        .option("streams", str(stream))
        .option("includeHeaders", "true")
        .load()
        .orderBy("offset")
    )
    assert loaded.columns == ["stream_id", "offset", "timestamp", "key", "value", "headers"]
    got = [(r.key, r.value, r.headers) for r in loaded.collect()]
    assert got == [
        (b"k0", b"v0", {"trace": b"t0"}),
        (None, b"v1", {}),
        (b"gone", None, {}),
    ]
    plain = spark.read.format("sbp").option("pm", ops.pm_address).option("streams", str(stream))
    assert plain.load().columns == ["stream_id", "offset", "timestamp", "key", "value"]

    keyless_tombstone = spark.createDataFrame([(None, None)], "value string, key binary")
    with pytest.raises(PySparkException, match="needs a key"):
        write(keyless_tombstone.coalesce(1), ops.pm_address, stream)
