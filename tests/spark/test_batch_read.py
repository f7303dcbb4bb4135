"""Batch reads through the ``sbp`` source against the real cluster."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import numpy as np
import pytest
import trio
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from client import DataNodeClient, PMClient, Producer
from sbp import messages
from sbp.key_hash import KeyMap

from ..eventually import eventually_blocking
from .streams import StreamOps, make_values


def read(spark: SparkSession, pm: str, **options: str) -> DataFrame:
    return spark.read.format("sbp").option("pm", pm).options(**options).load()


def test_reads_every_record_once_across_sealed_and_open_ranges(
    spark: SparkSession, ops: StreamOps
) -> None:
    # two replicas on the two nodes: the primary of each next range is the
    # node made primary fewer times, so the ranges' primaries alternate
    # whatever load the module's other tests left on either node
    stream = ops.create_stream(replicas=2)
    other = ops.create_stream(replicas=2)
    expected: list[bytes] = []
    timestamps: list[int] = []
    for part in range(4):
        values = make_values(f"s{part}", 25 + part)
        ts = 1_700_000_000_000 + part * 1000
        assert ops.append(stream, values, timestamp_ms=ts) == len(expected)
        expected += values
        timestamps += [ts] * len(values)
        if part < 3:
            ops.seal(stream)  # the next range's primary is the other data node
    other_values = make_values("o", 7)
    ops.append(other, other_values)
    ranges = ops.ranges(stream)
    assert [r.is_open for r in ranges] == [False, False, False, True]
    assert len(ops.hosts(stream)) == 2

    df = read(spark, ops.pm_address, streams=f"{stream},{other}", maxRecordsPerPartition="10")
    rows = df.orderBy("stream_id", "offset").collect()

    mine = [row for row in rows if row.stream_id == stream]
    assert [row.offset for row in mine] == list(range(len(expected)))
    assert [row.value for row in mine] == expected
    assert [int(row.timestamp.replace(tzinfo=UTC).timestamp() * 1000) for row in mine] == (
        timestamps
    )
    assert [row.value for row in rows if row.stream_id == other] == other_values
    # ranges of 25..28 records cut at 10: three pieces each, plus one for the other stream
    assert df.rdd.getNumPartitions() == 4 * 3 + 1


def test_count_and_bytes_match_what_was_appended(spark: SparkSession, ops: StreamOps) -> None:
    stream = ops.create_stream()
    values = make_values("count", 500)
    ops.append(stream, values[:300])
    ops.seal(stream)
    ops.append(stream, values[300:])
    result = (
        read(spark, ops.pm_address, streams=str(stream))
        .selectExpr("count(*) AS n", "sum(length(value)) AS bytes", "count(DISTINCT offset) AS d")
        .first()
    )
    assert result is not None
    assert (result.n, result.bytes, result.d) == (500, sum(map(len, values)), 500)


def test_starting_and_ending_offsets(spark: SparkSession, ops: StreamOps) -> None:
    stream = ops.create_stream()
    values = make_values("range", 60)
    ops.append(stream, values[:30])
    ops.seal(stream)
    ops.append(stream, values[30:])

    def offsets(**options: str) -> list[int]:
        df = read(spark, ops.pm_address, streams=str(stream), **options)
        return [row.offset for row in df.orderBy("offset").collect()]

    assert offsets() == list(range(60))
    # a window across the sealed range's end, starting and ending inside batches
    window = offsets(
        startingOffsets=json.dumps({str(stream): 25}), endingOffsets=json.dumps({str(stream): 41})
    )
    assert window == list(range(25, 41))
    assert offsets(startingOffsets="latest") == []
    assert offsets(endingOffsets="earliest") == []
    # -2 / -1 in the JSON are earliest / latest; beyond the end is clamped
    assert offsets(startingOffsets=json.dumps({str(stream): -2}), endingOffsets="latest") == list(
        range(60)
    )
    assert offsets(
        startingOffsets=json.dumps({str(stream): 55}), endingOffsets=json.dumps({str(stream): 999})
    ) == list(range(55, 60))


def test_starting_and_ending_by_append_time_across_a_seal(
    spark: SparkSession, ops: StreamOps
) -> None:
    stream = ops.create_stream()
    values = make_values("time", 60)
    ops.append(stream, values[:20])
    time.sleep(0.05)
    middle = int(time.time() * 1000)
    time.sleep(0.05)
    ops.append(stream, values[20:30])
    ops.seal(stream)
    ops.append(stream, values[30:45])
    time.sleep(0.05)
    late = int(time.time() * 1000)
    time.sleep(0.05)
    ops.append(stream, values[45:])
    ops.seal(stream)  # the newest range is empty: a time is looked up in the ones before

    def offsets(**options: str) -> list[int]:
        df = read(spark, ops.pm_address, streams=str(stream), **options)
        return [row.offset for row in df.orderBy("offset").collect()]

    assert offsets(startingTimestamp=str(middle)) == list(range(20, 60))
    assert offsets(startingTimestamp=str(middle), endingTimestamp=str(late)) == list(range(20, 45))
    by_stream = json.dumps({str(stream): late})
    assert offsets(startingOffsetsByTimestamp=by_stream) == list(range(45, 60))
    # one time for every stream wins over a time per stream, as in Kafka's source
    assert offsets(startingTimestamp=str(middle), startingOffsetsByTimestamp=by_stream) == list(
        range(20, 60)
    )
    assert offsets(startingTimestamp=str(late + 3_600_000)) == []


def test_records_appended_after_a_load_show_in_the_next_load(
    spark: SparkSession, ops: StreamOps
) -> None:
    stream = ops.create_stream()
    ops.append(stream, make_values("first", 5))
    before = read(spark, ops.pm_address, streams=str(stream))
    assert before.count() == 5
    ops.append(stream, make_values("second", 3))
    # a DataFrame keeps the partitions Spark planned for it; a new load plans anew
    assert before.count() == 5
    assert read(spark, ops.pm_address, streams=str(stream)).count() == 8


def test_all_streams(spark: SparkSession, ops: StreamOps) -> None:
    first, second = ops.create_stream(), ops.create_stream()
    ops.append(first, [b"a"])
    ops.append(second, [b"b", b"c"])
    rows = (
        read(spark, ops.pm_address, streams="all")
        .where(f"stream_id IN ({first}, {second})")
        .orderBy("stream_id", "offset")
    )
    assert [(r.stream_id, r.offset, r.value) for r in rows.collect()] == [
        (first, 0, b"a"),
        (second, 0, b"b"),
        (second, 1, b"c"),
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"streams": "1"}, "option 'pm' is required"),
        ({"pm": "127.0.0.1:1", "streams": "1", "group": "etl"}, "is for streaming reads"),
        ({"pm": "nohost", "streams": "1"}, "option 'pm' must be host:port"),
        ({"pm": "127.0.0.1:1", "streams": "one"}, "option 'streams': 'one' is not a stream id"),
        (
            {"pm": "127.0.0.1:1", "streams": "1", "startingOffsets": "first"},
            "option 'startingOffsets' must be 'earliest', 'latest' or a JSON object",
        ),
        (
            {"pm": "127.0.0.1:1", "streams": "1", "maxRecordsPerPartition": "0"},
            "option 'maxRecordsPerPartition' must be a positive integer",
        ),
        (
            {"pm": "127.0.0.1:1", "streams": "1", "maxRecordPerPartition": "5"},
            "(?i)unknown option 'maxRecordPerPartition'; did you mean 'maxRecordsPerPartition'",
        ),
    ],
)
def test_bad_options_are_named(spark: SparkSession, options: dict[str, str], message: str) -> None:
    with pytest.raises(PySparkException, match=message):
        spark.read.format("sbp").options(**options).load().collect()


def _last_line(error: BaseException) -> str:
    """The error's own line at the end of what Spark reports (before SQLSTATE)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-2] if lines[-1].strip().startswith("SQLSTATE") else lines[-1]


def test_unknown_stream_fails_with_its_id_in_one_line(spark: SparkSession, ops: StreamOps) -> None:
    with pytest.raises(PySparkException) as failed:
        read(spark, ops.pm_address, streams="999999").collect()
    assert "ExceptionGroup" not in str(failed.value)
    assert _last_line(failed.value) == (
        f"spark_jobs.layout.SourceError: no such stream on the PM at {ops.pm_address}: "
        "no stream 999999"
    )


def test_unreachable_pm_fails_in_one_line(spark: SparkSession) -> None:
    with pytest.raises(PySparkException) as failed:
        spark.read.format("sbp").options(pm="127.0.0.1:1", streams="1").load().collect()
    assert "ExceptionGroup" not in str(failed.value)
    assert _last_line(failed.value).startswith(
        "spark_jobs.layout.SourceError: cannot reach the PM at 127.0.0.1:1"
    )


def test_starting_after_ending_is_an_error(spark: SparkSession, ops: StreamOps) -> None:
    stream = ops.create_stream()
    ops.append(stream, make_values("x", 10))
    with pytest.raises(
        PySparkException, match=r"startingOffsets \(8\) is after endingOffsets \(3\)"
    ):
        read(
            spark,
            ops.pm_address,
            streams=str(stream),
            startingOffsets=json.dumps({str(stream): 8}),
            endingOffsets=json.dumps({str(stream): 3}),
        ).collect()


def test_trimmed_offsets_fail_unless_data_loss_is_allowed(
    spark: SparkSession, ops: StreamOps
) -> None:
    stream = ops.create_stream()
    ops.append(stream, make_values("t", 10))
    ops.trim(stream, 6)
    start = json.dumps({str(stream): 2})
    with pytest.raises(PySparkException, match=r"offset 2 of stream .* was trimmed away"):
        read(spark, ops.pm_address, streams=str(stream), startingOffsets=start).collect()
    rows = read(
        spark, ops.pm_address, streams=str(stream), startingOffsets=start, failOnDataLoss="false"
    ).collect()
    assert sorted(row.offset for row in rows) == [6, 7, 8, 9]


def test_timestamps_are_utc_instants(spark: SparkSession, ops: StreamOps) -> None:
    stream = ops.create_stream()
    ops.append(stream, [b"t"], timestamp_ms=1_700_000_000_123)
    row = (
        read(spark, ops.pm_address, streams=str(stream))
        .selectExpr("unix_millis(timestamp) AS ms")
        .first()
    )
    assert row is not None and row.ms == 1_700_000_000_123
    assert datetime.fromtimestamp(1_700_000_000.123, UTC).year == 2023


def test_a_compacted_stream_reads_each_kept_record_once(
    spark: SparkSession, ops: StreamOps
) -> None:
    """Compaction (SPEC §13) leaves range 0 with no record and range 1 with
    gaps: the read passes both by their offsets, each record left once."""

    async def compacted_stream() -> int:
        async with PMClient(ops.pm_address) as pm:
            [created] = await pm.create_streams([messages.Stream(replica_nums=1, cleanup_policy=1)])
            assert created.stream is not None
            stream_id = created.stream.stream_id
            for values, keys in (
                ([b"a1", b"b1"], [b"a", b"b"]),
                ([b"a2", b"c1", b"b2", b"c2"], [b"a", b"c", b"b", b"c"]),
            ):
                async with Producer(pm, stream_id) as producer:
                    await producer.send_many(values, keys=keys)
                ranges = await pm.list_stream_ranges(stream_id)
                await pm.seal_range(stream_id, ranges[-1].range_index)
            sealed = (await pm.list_stream_ranges(stream_id))[:2]
        # what the PM's pass does, asked of each range's one replica directly
        maps = []
        for rng in sealed:
            async with DataNodeClient(rng.nodes_primary_first()[0].advertise_addr) as node:
                _, payload = await node.compaction_keys(stream_id, rng.range_index)
                maps.append(KeyMap.decode(payload))
        merged = KeyMap.latest(
            np.concatenate([m.hashes for m in maps]), np.concatenate([m.offsets for m in maps])
        )
        for rng in sealed:
            async with DataNodeClient(rng.nodes_primary_first()[0].advertise_addr) as node:
                wanted = [messages.CompactRange(range_index=rng.range_index)]
                [done] = await node.compact_ranges(stream_id, wanted, merged.encode())
                assert done.error_code == 0, done.error_message
        return stream_id

    stream = trio.run(compacted_stream)
    rows = read(spark, ops.pm_address, streams=str(stream)).orderBy("offset").collect()
    assert [(row.offset, row.key, row.value) for row in rows] == [
        (2, b"a", b"a2"),
        (4, b"b", b"b2"),
        (5, b"c", b"c2"),
    ]


def test_a_tiered_stream_reads_from_the_object_store(spark: SparkSession, ops: StreamOps) -> None:
    """Ranges in the object store only (SPEC §14) read as any range."""
    stream = ops.create_stream()
    ops.tier(stream)
    values = make_values("tiered", 200)
    ops.append(stream, values[:120])
    ops.seal(stream)
    ops.append(stream, values[120:])

    def first_in_store() -> bool:
        return ops.ranges(stream)[0].object_state == 2

    eventually_blocking(first_in_store, timeout=30)
    rows = read(spark, ops.pm_address, streams=str(stream)).orderBy("offset").collect()
    assert [row.value for row in rows] == values
    assert [row.offset for row in rows] == list(range(200))
