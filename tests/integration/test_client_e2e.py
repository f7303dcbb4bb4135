"""The producer and the consumer against a real PM and data nodes: ranges
sealed under a running producer, and a data node killed and restarted."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import trio

from client.consumer import Consumer
from client.pm_client import PMClient
from client.producer import Producer, RecordsHandle
from sbp.errors import SBPError

from .pm_cluster import PMCluster, pm_cluster

pytestmark = pytest.mark.integration


def value_of(stream_id: int, index: int) -> bytes:
    """Record ``index`` of a stream: unique, checkable, 16 to 60 bytes."""
    head = b"%d:%d:" % (stream_id, index)
    return head + b"x" * (10 + (index * 7919 + stream_id) % 40)


def values_of(stream_id: int, start: int, stop: int) -> list[bytes]:
    return [value_of(stream_id, i) for i in range(start, stop)]


async def create_streams(pm: PMClient, count: int) -> list[int]:
    stream_ids = []
    for _ in range(count):
        stream = (await pm.create_stream(1)).stream
        assert stream is not None
        stream_ids.append(stream.stream_id)
    return stream_ids


async def read_all(cluster: PMCluster, stream_id: int) -> tuple[np.ndarray, list[bytes]]:
    """Every record of a stream from offset 0: offsets and values."""
    offsets: list[np.ndarray] = []
    values: list[bytes] = []
    async with Consumer(cluster.pm_client(), stream_id, 0, pool=cluster.pool) as consumer:
        async for records in consumer:
            offsets.append(records.offsets)
            values.extend(records.to_list())
    return (np.concatenate(offsets) if offsets else np.empty(0, np.int64)), values


async def seal_periodically(
    pm: PMClient, stream_ids: Sequence[int], interval: float, sealed: list[int]
) -> None:
    """Seal the open range of one stream after another, forever. A seal that
    fails (its primary is down) is skipped: the test is about the clients."""
    while True:
        for stream_id in stream_ids:
            await trio.sleep(interval)
            try:
                ranges = await pm.list_stream_ranges(stream_id)
                await pm.seal_range(stream_id, ranges[-1].range_index, timeout=5)
            except SBPError:
                continue
            sealed.append(stream_id)


async def produce_paced(
    cluster: PMCluster,
    stream_id: int,
    total: int,
    chunk: int,
    pause: float,
    handles: list[RecordsHandle] | None = None,
) -> None:
    """Send ``total`` records in chunks with a pause between them, so that
    the writing lasts long enough for seals (or a crash) to land in it."""
    async with Producer(cluster.pm_client(), stream_id, pool=cluster.pool) as producer:
        for start in range(0, total, chunk):
            handle = await producer.send_many(values_of(stream_id, start, start + chunk))
            if handles is not None:
                handles.append(handle)
            await trio.sleep(pause)
        await producer.flush()


@pytest.mark.deadline(300)
async def test_a_million_records_across_seals_arrive_once_and_in_order(tmp_path: Path) -> None:
    streams, per_stream, chunk = 10, 100_000, 1_000
    async with pm_cluster(tmp_path, (1, 2, 3)) as cluster:
        pm = cluster.pm_client()
        stream_ids = await create_streams(pm, streams)
        sealed: list[int] = []
        async with trio.open_nursery() as sealer:
            sealer.start_soon(seal_periodically, pm, stream_ids, 0.03, sealed)
            async with trio.open_nursery() as producers:
                for stream_id in stream_ids:
                    producers.start_soon(produce_paced, cluster, stream_id, per_stream, chunk, 0.01)
            sealer.cancel_scope.cancel()

        assert len(sealed) >= 2 * streams, f"only {len(sealed)} seals landed during the writes"
        for stream_id in stream_ids:
            ranges = await pm.list_stream_ranges(stream_id)
            assert len(ranges) >= 2
            offsets, values = await read_all(cluster, stream_id)
            np.testing.assert_array_equal(offsets, np.arange(per_stream))
            assert values == values_of(stream_id, 0, per_stream)


@pytest.mark.deadline(240)
async def test_a_killed_data_node_loses_no_acknowledged_record(tmp_path: Path) -> None:
    streams, per_stream, chunk = 4, 40_000, 500
    async with pm_cluster(tmp_path, (1, 2)) as cluster:
        pm = cluster.pm_client()
        stream_ids = await create_streams(pm, streams)
        handles: dict[int, list[RecordsHandle]] = {stream_id: [] for stream_id in stream_ids}
        sealed: list[int] = []

        async def crash_and_restart() -> None:
            await trio.sleep(0.5)
            assert all(len(handles[s]) < per_stream // chunk for s in stream_ids), "too late"
            victim = random.choice(sorted(cluster.nodes))
            await cluster.nodes[victim].kill()  # SIGKILL: nothing flushed on the way out
            await trio.sleep(0.5)
            await cluster.start_node(victim)  # same data directory, a new port

        async with trio.open_nursery() as background:
            background.start_soon(seal_periodically, pm, stream_ids, 0.1, sealed)
            async with trio.open_nursery() as producers:
                producers.start_soon(crash_and_restart)
                for stream_id in stream_ids:
                    producers.start_soon(
                        produce_paced,
                        cluster,
                        stream_id,
                        per_stream,
                        chunk,
                        0.01,
                        handles[stream_id],
                    )
            background.cancel_scope.cancel()

        for stream_id in stream_ids:
            acknowledged = np.concatenate([await handle.offsets() for handle in handles[stream_id]])
            assert len(acknowledged) == per_stream
            offsets, values = await read_all(cluster, stream_id)
            # At-least-once: a batch whose answer the crash lost may be stored
            # twice, but every acknowledged record is where it was acknowledged.
            position = {int(offset): i for i, offset in enumerate(offsets)}
            expected = values_of(stream_id, 0, per_stream)
            for index, offset in enumerate(acknowledged.tolist()):
                assert values[position[offset]] == expected[index]
            assert set(values) == set(expected)


async def test_sync_client_trims_updates_and_reads_from_the_first_stored_offset(
    tmp_path: Path,
) -> None:
    from client import RecordTooLargeError, SyncClient

    async with pm_cluster(tmp_path, node_ids=(1, 2)) as cluster:

        def scenario() -> None:
            with SyncClient(cluster.pm_address) as client:
                stream = client.create_stream().stream_id
                with client.producer(stream) as producer:
                    producer.send_many([b"%d" % i for i in range(10)]).wait()
                    with pytest.raises(RecordTooLargeError, match="8,388,573 bytes"):
                        producer.send(b"x" * (9 << 20))
                assert client.trim(stream, 4) == 4
                assert client.trim(stream, 2) == 4  # below the first offset: nothing changes
                # The default start is the first stored record, not offset 0.
                with client.consumer(stream) as consumer:
                    first = next(iter(consumer))
                assert (first.offset, first.value) == (4, b"4")
                updated = client.update_stream(stream, retention_period_ms=60_000)
                assert (updated.retention_period_ms, updated.replica_nums) == (60_000, 1)
                assert client.update_stream(stream, replica_nums=2).retention_period_ms == 60_000
                # a change of one setting keeps the others, the §13-§16 ones too
                client.update_stream(stream, min_compaction_lag_ms=1_000, table_interval_ms=5_000)
                kept = client.update_stream(stream, replica_nums=1)
                assert (kept.min_compaction_lag_ms, kept.table_interval_ms) == (1_000, 5_000)

        await trio.to_thread.run_sync(scenario)
