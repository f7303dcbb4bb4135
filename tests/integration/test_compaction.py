"""Compacted streams (SPEC §13) on real processes: a PM and three data nodes
compact a replicated stream's sealed ranges so that a reader from the start
sees each key once, with its latest value at its own offset; every replica
of a range holds the same bytes; a tombstone goes once the stream's
delete_retention_ms has passed; a range appended to within
min_compaction_lag_ms is left alone; a full open range is sealed to be
compacted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from client.consumer import Consumer
from client.producer import Producer
from sbp import messages
from sbp.batches import batch_spans, peek_header
from sbp.enums import ErrorCode

from ..eventually import eventually
from .pm_cluster import PMCluster, pm_cluster

pytestmark = [pytest.mark.integration, pytest.mark.deadline(240)]

KEYS = 1000
UPDATES = 200
SEAL_EVERY = 20  # rounds of updates per range: ten sealed ranges
PASS_MS = 300


async def create_compacted(cluster: PMCluster, **settings: int) -> int:
    [created] = await cluster.pm_client().create_streams(
        [messages.Stream(replica_nums=3, cleanup_policy=1, **settings)]
    )
    assert created.error_code == ErrorCode.NONE, created.error_message
    assert created.stream is not None
    return created.stream.stream_id


async def write_updates(
    cluster: PMCluster, stream_id: int, rounds: int, seal_every: int, padding: int = 0
) -> dict[bytes, tuple[int, bytes | None]]:
    """Each round updates every key once (in a random order; 10% of the
    updates are tombstones); the open range is sealed every ``seal_every``
    rounds. Each key's latest offset and value."""
    pm = cluster.pm_client()
    rng = random.Random(stream_id)
    latest: dict[bytes, tuple[int, bytes | None]] = {}
    offset = 0
    async with Producer(pm, stream_id, pool=cluster.pool) as producer:
        for round_index in range(rounds):
            keys = [b"user-%d" % k for k in range(KEYS)]
            rng.shuffle(keys)
            values = [
                None if rng.random() < 0.1 else b"%s=%d" % (key, round_index) + bytes(padding)
                for key in keys
            ]
            await producer.send_many(values, keys=keys)
            for key, value in zip(keys, values, strict=True):
                latest[key] = (offset, value)
                offset += 1
            if (round_index + 1) % seal_every == 0:
                await producer.flush()
                ranges = await pm.list_stream_ranges(stream_id)
                await pm.seal_range(stream_id, ranges[-1].range_index)
    return latest


async def read_records(cluster: PMCluster, stream_id: int) -> list[tuple[int, bytes, bytes | None]]:
    async with Consumer(cluster.pm_client(), stream_id, pool=cluster.pool) as consumer:
        return [
            (record.offset, record.key or b"", record.value) async for record in consumer.records()
        ]


async def replica_bytes(cluster: PMCluster, rng: messages.Range) -> list[bytes]:
    """What each replica of a sealed range serves of it, whole."""
    served = []
    for replica in rng.replica_nodes:
        node = cluster.node_client(replica.data_node.advertise_addr)
        data = b""
        offset = rng.start_offset
        while offset < rng.end_offset:
            info = messages.FetchInfo(
                stream_id=rng.stream_id, fetch_offset=offset, batch_max_bytes=1 << 20
            )
            async with node.fetch([info]) as results:
                got = b"".join([bytes(fetched.data) async for fetched in results])
            if not got:
                break
            data += got
            start, _ = batch_spans(got)[-1]
            offset = peek_header(got, start).next_offset
        served.append(data)
    return served


async def until_records(
    cluster: PMCluster, stream_id: int, count: int, timeout: float = 60
) -> list[tuple[int, bytes, bytes | None]]:
    """Read the stream from its start until it holds ``count`` records."""
    records: list[tuple[int, bytes, bytes | None]] = await eventually(
        lambda: read_records(cluster, stream_id),
        until=lambda records: len(records) == count,
        timeout=timeout,
        interval=PASS_MS / 1000,
        what=f"stream {stream_id} holding {count} records",
    )
    return records


async def test_a_compacted_stream_keeps_each_keys_latest_record_on_every_replica(
    tmp_path: Path,
) -> None:
    async with pm_cluster(
        tmp_path, (1, 2, 3), pm_args=("--compaction-interval-ms", str(PASS_MS))
    ) as cluster:
        stream_id = await create_compacted(cluster, delete_retention_ms=3_600_000)
        young = await create_compacted(cluster, min_compaction_lag_ms=3_600_000)
        latest = await write_updates(cluster, stream_id, UPDATES, SEAL_EVERY)
        await write_updates(cluster, young, 5, 5)

        records = await until_records(cluster, stream_id, KEYS)
        # each key once: its latest record, at its own offset, tombstones still there
        assert {key: (offset, value) for offset, key, value in records} == latest
        assert [offset for offset, *_ in records] == sorted(latest[k][0] for k in latest)
        assert any(value is None for *_, value in records)
        ranges = await cluster.pm_client().list_stream_ranges(stream_id)
        assert len(ranges) == UPDATES // SEAL_EVERY + 1
        for rng in ranges[:-1]:
            served = await replica_bytes(cluster, rng)
            assert len(served) == 3 and served[0] == served[1] == served[2], rng.range_index
        # appended to within min_compaction_lag_ms: left alone
        assert len(await read_records(cluster, young)) == 5 * KEYS

        # once tombstones may go, they go; the keys they deleted are gone
        await cluster.pm_client().update_stream(
            messages.Stream(
                stream_id=stream_id, replica_nums=3, cleanup_policy=1, delete_retention_ms=200
            )
        )
        live = {key: entry for key, entry in latest.items() if entry[1] is not None}
        records = await until_records(cluster, stream_id, len(live))
        assert {key: (offset, value) for offset, key, value in records} == live


async def test_a_full_open_range_of_a_compacted_stream_is_sealed_and_compacted(
    tmp_path: Path,
) -> None:
    async with pm_cluster(
        tmp_path,
        (1, 2, 3),
        pm_args=(
            "--compaction-interval-ms",
            str(PASS_MS),
            "--compaction-roll-bytes",
            "64KiB",
        ),
    ) as cluster:
        stream_id = await create_compacted(cluster)
        latest = await write_updates(cluster, stream_id, 12, seal_every=1_000)
        await eventually(
            lambda: cluster.pm_client().list_stream_ranges(stream_id),
            until=lambda ranges: len(ranges) > 1,
            timeout=60,
            interval=PASS_MS / 1000,
            what="the compacted stream's range rolled",
        )
        # the rolled range is compacted: fewer records than were written
        records = await eventually(
            lambda: read_records(cluster, stream_id),
            until=lambda records: len(records) < 12 * KEYS,
            timeout=60,
            interval=PASS_MS / 1000,
            what="the rolled range compacted",
        )
        by_key: dict[bytes, tuple[int, bytes | None]] = {}
        for offset, key, value in records:
            by_key[key] = (offset, value)
        assert by_key == latest


async def test_nodes_killed_during_compaction_lose_no_key(tmp_path: Path) -> None:
    """Each node in turn is killed (SIGKILL) while passes rewrite its ranges
    (slowed to 3 MiB/s so that they take seconds) and started again: every
    key's latest record survives, on every replica."""
    node_args = ("--compaction-bytes-per-s", "3MiB")
    async with pm_cluster(
        tmp_path, (1, 2, 3), pm_args=("--compaction-interval-ms", "100"), node_args=node_args
    ) as cluster:
        # the ranges become eligible together, once written: one long pass
        stream_id = await create_compacted(
            cluster, delete_retention_ms=3_600_000, min_compaction_lag_ms=1500
        )
        latest = await write_updates(cluster, stream_id, 30, seal_every=3, padding=300)
        rng = random.Random(59)
        await trio.sleep(1.5)
        for node_id in (1, 2, 3, 2):
            await trio.sleep(rng.uniform(0.3, 1.2))
            await cluster.nodes[node_id].kill()
            await cluster.start_node(node_id, *node_args)
            await cluster.wait_alive({1, 2, 3})
        records = await until_records(cluster, stream_id, KEYS, timeout=120)
        assert {key: (offset, value) for offset, key, value in records} == latest
        ranges = await cluster.pm_client().list_stream_ranges(stream_id)
        for rng_ in ranges[:-1]:
            served = await replica_bytes(cluster, rng_)
            assert served[0] == served[1] == served[2], rng_.range_index
