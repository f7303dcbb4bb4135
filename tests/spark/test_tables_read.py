"""``spark_jobs.read_stream`` (SPEC §16): a tabled stream's history from its
Iceberg table, the rest from the stream, as one DataFrame of the ``sbp``
source's schema; pyiceberg and Spark read the same rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import spark_jobs
from sbp.batch_v2 import build_batch_v2
from spark_jobs.tables import read_stream
from tables.catalog import load_or_create_table, open_catalog
from tables.writer import TableWriter

from .streams import StreamOps


def keyed_batch(first: int, count: int) -> bytearray:
    return build_batch_v2(
        [b"v%d" % i for i in range(first, first + count)],
        1_795_000_000_000 + first,
        keys=[b"k%d" % (i % 5) for i in range(first, first + count)],
        headers=[[("n", b"%d" % i)] for i in range(first, first + count)],
    )


def test_history_from_the_table_and_the_rest_from_the_stream(
    spark: SparkSession, ops: StreamOps, tmp_path: Path
) -> None:
    stream = ops.create_stream()
    client = ops._client
    with client.producer(stream) as producer:
        producer.send_batch(keyed_batch(0, 300))
        producer.flush()
    # the table holds the first 200 records (as sbp-tables would have committed them)
    catalog_uri, warehouse = f"sqlite:///{tmp_path}/catalog.db", str(tmp_path / "warehouse")
    catalog = open_catalog(catalog_uri, warehouse)
    writer = TableWriter(catalog, stream, interval_s=1)
    writer.open()
    with client.consumer(stream, 0) as consumer:
        for records in consumer.batches():
            writer.add(records)
    taken = writer.take()
    assert taken is not None
    writer.commit(taken)
    assert writer.end == 300
    # the table holds the whole stream: read from its files alone
    whole = read_stream(
        spark, pm=ops.pm_address, streams=[stream], catalog=catalog_uri, warehouse=warehouse
    )
    assert sorted(row.offset for row in whole.collect()) == list(range(300))
    with client.producer(stream) as producer:
        producer.send_batch(keyed_batch(300, 100))
        producer.flush()

    frame = read_stream(
        spark, pm=ops.pm_address, streams=[stream], catalog=catalog_uri, warehouse=warehouse,
        include_headers=True,
    )  # fmt: skip
    assert frame.columns == ["stream_id", "offset", "timestamp", "key", "value", "headers"]
    rows = frame.orderBy("offset").collect()
    assert [row.offset for row in rows] == list(range(400))
    assert [row.value for row in rows] == [b"v%d" % i for i in range(400)]
    assert [row.key for row in rows] == [b"k%d" % (i % 5) for i in range(400)]
    assert [row.headers for row in rows] == [{"n": b"%d" % i} for i in range(400)]
    # the record's own timestamp, from the table and from the stream alike
    first, last = rows[0].timestamp, rows[-1].timestamp
    assert int(first.timestamp() * 1000) == 1_795_000_000_000
    assert int(last.timestamp() * 1000) == 1_795_000_000_300
    # what pyiceberg reads is what Spark read of the table's part
    table = load_or_create_table(catalog, stream).scan().to_arrow()
    assert sorted(table.column("offset").to_pylist()) == list(range(300))
    assert table.column("value").to_pylist()[:3] == [r.value for r in rows[:3]]


def test_a_stream_without_a_table_is_read_whole_from_the_stream(
    spark: SparkSession, ops: StreamOps, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = ops.create_stream()
    ops.append(stream, [b"a", b"b"])
    # spark_jobs.read_stream, with the catalog from the environment
    monkeypatch.setenv("SBP_CATALOG", f"sqlite:///{tmp_path}/c.db")
    monkeypatch.setenv("SBP_WAREHOUSE", str(tmp_path / "wh"))
    frame = spark_jobs.read_stream(spark, pm=ops.pm_address, streams=[stream])
    assert [row.value for row in frame.orderBy("offset").collect()] == [b"a", b"b"]
    with pytest.raises(ValueError, match="catalog"):
        read_stream(spark, pm=ops.pm_address, streams=[stream], catalog="nope", warehouse="x")
