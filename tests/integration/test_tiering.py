"""Tiered storage (SPEC §14) on real processes and a real S3 server (weed
mini): a tiered stream written past its nodes' map size reads back byte for
byte; with every node's disk wiped its offloaded ranges still read; with the
store paused, reads of offloaded ranges fail with the retriable error while
appends go on, and serve again once it is back; the objects go with the
stream."""

from __future__ import annotations

import hashlib
import shutil
import signal
from pathlib import Path

import psutil
import pytest
import trio

from client.consumer import Consumer
from client.pm_client import PMClient
from client.producer import Producer
from net.pool import ConnectionPool
from sbp import messages
from sbp.enums import ErrorCode
from tiering import layout

from ..eventually import eventually
from .etcd_cluster import etcd_cluster
from .object_store import client_for, running_object_store
from .pm_cluster import PMCluster, pm_cluster
from .procs import start_server
from .test_pm_ha import leader_of, start_pm

pytestmark = [pytest.mark.integration, pytest.mark.deadline(180)]

MAP_SIZE = "12MiB"
ROLL = "1MiB"
VALUE = 1000
#: about 3x a node's map size, through a stream of 2 replicas on 3 nodes
RECORDS = 36 * 1024


def value(offset: int) -> bytes:
    return hashlib.sha256(b"%d" % offset).digest() * (VALUE // 32) + b"%08d" % offset


async def create_tiered(cluster: PMCluster, local_retention_ms: int = 0) -> int:
    [created] = await cluster.pm_client().create_streams(
        [messages.Stream(replica_nums=2, local_retention_ms=local_retention_ms)]
    )
    assert created.error_code == ErrorCode.NONE, created.error_message
    assert created.stream is not None
    return created.stream.stream_id


async def ranges_of(cluster: PMCluster, stream_id: int) -> list[messages.Range]:
    return list(await cluster.pm_client().list_stream_ranges(stream_id))


async def write(cluster: PMCluster, stream_id: int, start: int, count: int) -> None:
    """``count`` records from ``start``, a MiB at a time at about 10 MiB/s,
    each once no more than three ranges are on the nodes: ranges leave the
    nodes as fast as they fill (the nodes' map is small on purpose)."""
    async with Producer(cluster.pm_client(), stream_id, pool=cluster.pool) as producer:
        for first in range(start, start + count, 1024):
            await eventually(lambda: _few_on_nodes(cluster, stream_id), timeout=60)
            await producer.send_many([value(o) for o in range(first, first + 1024)])
            await producer.flush()
            await trio.sleep(0.1)


async def _few_on_nodes(cluster: PMCluster, stream_id: int) -> bool:
    on_nodes = [r for r in await ranges_of(cluster, stream_id) if r.object_state != 2]
    return len(on_nodes) <= 3


async def read_all(cluster: PMCluster, stream_id: int, start: int, end: int) -> list[bytes]:
    found: list[bytes] = []
    async with Consumer(cluster.pm_client(), stream_id, start, pool=cluster.pool) as consumer:
        async for records in consumer:
            found.extend(records.value(i) for i in range(len(records)))
            if len(found) >= end - start:
                break
    return found[: end - start]


@pytest.fixture
async def store_and_cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    async with (
        running_object_store(tmp_path) as (store, store_args),
        pm_cluster(
            tmp_path,
            pm_args=[*store_args, "--tiering-interval-ms", "200", "--tiered-roll-bytes", ROLL],
            node_args=[*store_args, "--map-size", MAP_SIZE, "--object-store-timeout-ms", "1000"],
        ) as cluster,
    ):
        yield store, store_args, cluster


async def test_a_tiered_stream_outgrows_its_nodes_and_reads_back_byte_for_byte(
    store_and_cluster, tmp_path: Path
) -> None:
    _, store_args, cluster = store_and_cluster
    stream_id = await create_tiered(cluster)
    await write(cluster, stream_id, 0, RECORDS)
    ranges = await ranges_of(cluster, stream_id)
    offloaded = [r for r in ranges if r.object_state == 2]
    assert len(offloaded) >= 10
    for rng in offloaded:  # served from the store by live nodes, none of them primary
        assert rng.replica_nodes and not any(r.is_primary for r in rng.replica_nodes)
    assert await read_all(cluster, stream_id, 0, RECORDS) == [value(o) for o in range(RECORDS)]

    # every data node's disk wiped: the ranges in the store still read
    readable = offloaded[-1].end_offset
    for node_id in list(cluster.nodes):
        await cluster.nodes[node_id].kill()
        shutil.rmtree(tmp_path / f"node-{node_id}")
    await cluster.start_nodes(list(cluster.nodes), *store_args, "--map-size", MAP_SIZE)
    got = await read_all(cluster, stream_id, 0, readable)
    assert got == [value(o) for o in range(readable)]

    # the objects go with the stream, after the metadata stops naming them
    objects = client_for(store_args)
    assert await objects.run(objects.list, layout.stream_prefix(stream_id))
    [deleted] = await cluster.pm_client().delete_streams([stream_id])
    assert deleted.error_code == ErrorCode.NONE

    async def none_left() -> bool:
        return not await objects.run(objects.list, layout.stream_prefix(stream_id))

    await eventually(none_left, timeout=20)


async def test_a_paused_store_fails_reads_of_its_ranges_but_never_appends(
    store_and_cluster,
) -> None:
    store, _, cluster = store_and_cluster
    stream_id = await create_tiered(cluster)
    await write(cluster, stream_id, 0, 4 * 1024)

    async def offloaded() -> list[messages.Range]:
        return [r for r in await ranges_of(cluster, stream_id) if r.object_state == 2]

    await eventually(offloaded, timeout=30)
    first = (await offloaded())[0]
    reader = cluster.node_client(first.replica_nodes[0].data_node.advertise_addr, timeout=30)

    async def reader_knows() -> bool:
        described = await reader.describe_range(stream_id, first.range_index)
        return described.object_state == 2

    await eventually(reader_knows, timeout=10)
    assert store.process is not None
    # weed runs under client.with_parent: the signals go to weed itself
    [weed] = psutil.Process(store.process.pid).children()
    weed.send_signal(signal.SIGSTOP)
    try:
        # appends go on while the store does not answer
        with trio.fail_after(20):
            await write_unpaced(cluster, stream_id, 4 * 1024, 2 * 1024)
        # a read of a range in the store only says so, retriably
        info = messages.FetchInfo(
            stream_id=stream_id, fetch_offset=first.start_offset, batch_max_bytes=1 << 20
        )
        async with reader.fetch([info]) as results:
            answers = [fetched async for fetched in results]
        assert answers[0].result.error_code == ErrorCode.OBJECT_STORE_UNAVAILABLE
        assert ErrorCode.OBJECT_STORE_UNAVAILABLE.retriable
    finally:
        weed.send_signal(signal.SIGCONT)
    # back: every record reads, those written while it was away too
    total = 6 * 1024
    assert await read_all(cluster, stream_id, 0, total) == [value(o) for o in range(total)]


async def write_unpaced(cluster: PMCluster, stream_id: int, start: int, count: int) -> None:
    async with Producer(cluster.pm_client(), stream_id, pool=cluster.pool) as producer:
        await producer.send_many([value(o) for o in range(start, start + count)])


#: copies slow enough to be cut short: the pacer lets a second's worth
#: through at once, so the 2 MiB range takes 3 s to copy
SLOW_UPLOADS = ("--max-upload-bytes-per-s", "512KiB")
SLOW_RANGE = 2 * 1024


async def stored_objects(store_args: list[str], stream_id: int) -> list[str]:
    objects = client_for(store_args)
    return [key for key, _ in await objects.run(objects.list, layout.stream_prefix(stream_id))]


async def offloaded_end(cluster_pm: PMClient, stream_id: int) -> int:
    """The end of the stream's first range once it is in the store only; 0 before."""
    first = (await cluster_pm.list_stream_ranges(stream_id))[0]
    return first.end_offset if first.object_state == 2 else 0


async def test_a_node_killed_mid_upload_leaves_nothing_half_recorded(tmp_path: Path) -> None:
    async with (
        running_object_store(tmp_path) as (_, store_args),
        pm_cluster(
            tmp_path,
            pm_args=[*store_args, "--tiering-interval-ms", "200"],
            node_args=[*store_args, *SLOW_UPLOADS],
        ) as cluster,
    ):
        pm = cluster.pm_client()
        stream_id = await create_tiered(cluster)
        await write_unpaced(cluster, stream_id, 0, SLOW_RANGE)
        [rng] = await ranges_of(cluster, stream_id)
        await pm.seal_range(stream_id, rng.range_index)
        uploader = next(r.data_node.node_id for r in rng.replica_nodes if r.is_primary)
        await trio.sleep(1.0)  # the first live replica, the primary, is copying it
        await cluster.nodes[uploader].kill()
        # nothing recorded, and no object to read: a multipart upload not
        # completed is no object
        assert (await ranges_of(cluster, stream_id))[0].object_state == 0
        assert await stored_objects(store_args, stream_id) == []
        # the other replica copies it, once
        end = await eventually(lambda: offloaded_end(pm, stream_id), timeout=60)
        assert end == SLOW_RANGE
        assert await stored_objects(store_args, stream_id) == [
            layout.object_key(stream_id, 0, rng.epoch)
        ]
        assert await read_all(cluster, stream_id, 0, end) == [value(o) for o in range(end)]


async def test_a_pm_failover_on_etcd_while_uploads_run_records_each_copy_once(
    tmp_path: Path,
) -> None:
    async with (
        running_object_store(tmp_path) as (_, store_args),
        etcd_cluster(tmp_path) as etcd,
        ConnectionPool() as pool,
    ):
        pms = [await start_pm(tmp_path, f"pm-{i}", etcd.endpoints, *store_args) for i in (1, 2)]
        addresses = ",".join(p.address for p in pms)
        cluster = PMCluster(tmp_path, pool)
        cluster.pm = pms[0]
        nodes = []
        try:
            for node_id in (1, 2):
                nodes.append(
                    await start_server(
                        "datanode",
                        [
                            *("--listen", "127.0.0.1:0", "--node-id", str(node_id)),
                            *("--data-dir", str(tmp_path / f"node-{node_id}"), "--pm", addresses),
                            *("--heartbeat-interval-ms", "200", *store_args, *SLOW_UPLOADS),
                        ],
                        tmp_path / "logs",
                        name=f"node-{node_id}",
                    )
                )
            pm = PMClient(addresses, pool=pool, timeout=10)
            await eventually(
                pm.describe_cluster, until=lambda st: sum(s.alive for s in st) >= 2, timeout=20
            )
            [created] = await pm.create_streams(
                [messages.Stream(replica_nums=2, local_retention_ms=0)]
            )
            assert created.stream is not None and created.range is not None
            stream_id = created.stream.stream_id
            async with Producer(pm, stream_id, pool=pool) as producer:
                await producer.send_many([value(o) for o in range(SLOW_RANGE)])
            await pm.seal_range(stream_id, 0)
            await trio.sleep(0.8)  # the copy runs
            leader = await leader_of(pms, pool)
            await leader.kill()
            end = await eventually(lambda: offloaded_end(pm, stream_id), timeout=60)
            assert end == SLOW_RANGE
            assert await stored_objects(store_args, stream_id) == [
                layout.object_key(stream_id, 0, created.range.epoch)
            ]
            found: list[bytes] = []
            async with Consumer(pm, stream_id, 0, pool=pool) as consumer:
                async for records in consumer:
                    found.extend(records.value(i) for i in range(len(records)))
                    if len(found) >= end:
                        break
            assert found == [value(o) for o in range(end)]
        finally:
            with trio.CancelScope(shield=True):
                for process in [*nodes, *pms]:
                    await process.kill()
