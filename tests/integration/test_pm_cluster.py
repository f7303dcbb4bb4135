"""The PM with real data nodes, all as processes on loopback."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio

from client.pm_client import PMClient
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch
from sbp.enums import ErrorCode, Opcode
from sbp.errors import StorageFullError, UnsupportedOperationError

from ..eventually import eventually
from .pm_cluster import PMCluster, append_values, pm_cluster, primary_address, read_stream

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.deadline(90)
async def test_replicas_append_seal_and_read_across_ranges(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path) as cluster:
        pm = cluster.pm_client()
        for replicas in (1, 2, 3):
            created = await pm.create_stream(replicas)
            assert created.stream is not None and created.range is not None
            stream_id = created.stream.stream_id
            first = created.range
            assert created.stream.replica_nums == replicas
            assert len({r.data_node.node_id for r in first.replica_nodes}) == replicas
            assert [r.is_primary for r in first.replica_nodes].count(True) == 1

            assert await append_values(cluster, first, [b"a", b"b"]) == 0
            assert await append_values(cluster, first, [b"c"]) == 2
            sealed = await pm.seal_range(stream_id, 0)
            old, new = sealed.ranges
            assert (old.range_index, old.start_offset, old.end_offset) == (0, 0, 3)
            assert (new.range_index, new.start_offset, new.end_offset) == (1, 3, -1)
            assert len(new.replica_nodes) == replicas

            assert await append_values(cluster, new, [b"d", b"e"]) == 3
            assert await read_stream(cluster, stream_id) == [b"a", b"b", b"c", b"d", b"e"]

            # LIST_RANGES by data node lists the range on each of its replicas.
            for replica in new.replica_nodes:
                hosted = await pm.list_node_ranges(replica.data_node)
                assert (stream_id, 1) in {(r.stream_id, r.range_index) for r in hosted}


@pytest.mark.deadline(90)
async def test_trim_and_delete_reach_the_data_nodes(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=(1,)) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(1)
        assert created.stream is not None and created.range is not None
        stream_id = created.stream.stream_id
        await append_values(cluster, created.range, [b"0", b"1", b"2"])
        _, second = (await pm.seal_range(stream_id, 0)).ranges
        await append_values(cluster, second, [b"3", b"4"])
        node = cluster.node_client(primary_address(second))

        trimmed = await pm.trim_stream(stream_id, 4)
        assert trimmed.range is not None
        assert (trimmed.range.range_index, trimmed.range.start_offset) == (1, 4)
        on_node = await node.list_stream_ranges(stream_id)
        assert [(r.range_index, r.start_offset) for r in on_node] == [(1, 4)]
        assert await read_stream(cluster, stream_id) == [b"4"]

        beyond = await pm.trim_streams([messages.TrimmedStream(stream_id=stream_id, trim_offset=9)])
        assert beyond[0].error_code == ErrorCode.OFFSET_OUT_OF_RANGE

        await pm.delete_stream(stream_id)
        [gone] = await pm.get_streams([stream_id])
        assert gone.error_code == ErrorCode.STREAM_NOT_FOUND
        # The node heard of the delete: it rejects writes to the stream.
        [refused] = await node.append([(stream_id, bytes(build_batch([b"z"], base_timestamp=1)))])
        assert refused.error_code == ErrorCode.STREAM_DELETED


@pytest.mark.deadline(90)
async def test_a_stopped_node_turns_dead_and_gets_no_new_ranges(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path) as cluster:
        pm = cluster.pm_client()
        await cluster.nodes[3].terminate()
        await cluster.wait_alive({1, 2}, dead={3})
        statuses = {s.data_node.node_id: s for s in await pm.describe_cluster()}
        assert [statuses[n].alive for n in (1, 2, 3)] == [True, True, False]
        assert statuses[1].metrics is not None

        results = await pm.create_streams([messages.Stream(replica_nums=1)] * 6)
        placed = {r.range.replica_nodes[0].data_node.node_id for r in results if r.range}
        assert placed == {1, 2}
        [refused] = await pm.create_streams([messages.Stream(replica_nums=3)])
        assert refused.error_code == ErrorCode.NO_AVAILABLE_DATA_NODE

        await cluster.start_node(3)
        await cluster.wait_alive({1, 2, 3})
        created = await pm.create_stream(3)
        assert created.range is not None and len(created.range.replica_nodes) == 3


@pytest.mark.deadline(90)
async def test_a_node_back_from_the_dead_hears_what_it_missed(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=(1, 2)) as cluster:
        pm = cluster.pm_client()
        # two replicas on two nodes: node 2 hosts every range
        doomed, trimmed, kept = [(await pm.create_stream(2)).range for _ in range(3)]
        assert doomed is not None and trimmed is not None and kept is not None
        await append_values(cluster, trimmed, [b"0", b"1", b"2"])
        _, second = (await pm.seal_range(trimmed.stream_id, 0)).ranges
        await append_values(cluster, second, [b"3"])

        await cluster.nodes[2].terminate()
        await cluster.wait_alive({1}, dead={2})
        # Both changes are committed; node 2 is dead, so it is not told.
        await pm.delete_stream(doomed.stream_id)
        await pm.trim_stream(trimmed.stream_id, 3)

        restarted = await cluster.start_node(2)
        await cluster.wait_alive({1, 2})
        me = messages.DataNode(node_id=2, advertise_addr=restarted.address)
        node = cluster.node_client(restarted.address)
        with trio.fail_after(20):
            while True:
                hosted = {
                    (r.stream_id, r.range_index, r.start_offset)
                    for r in await node.list_node_ranges(me)
                }
                if hosted == {(trimmed.stream_id, 1, 3), (kept.stream_id, 0, 0)}:
                    break
                await trio.sleep(0.1)
        # The deleted stream is deleted on the node too: writes are refused.
        [refused] = await node.append(
            [(doomed.stream_id, bytes(build_batch([b"z"], base_timestamp=1)))]
        )
        assert refused.error_code == ErrorCode.STREAM_DELETED
        assert await read_stream(cluster, trimmed.stream_id) == [b"3"]


async def test_a_node_out_of_step_is_set_right_without_a_failed_call(tmp_path: Path) -> None:
    """A node's view of a stream goes wrong while no call to it fails (here
    an old SYNC_RANGES, sent straight to it, places the stream's open range
    on another node): the PM's comparison of every live node with the
    metadata (--reconcile-interval-ms) sends it the stream's ranges again."""
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm("127.0.0.1:0", "--reconcile-interval-ms", "500")
            await cluster.start_nodes([1])
            created = (await cluster.pm_client().create_stream(1)).range
            assert created is not None
            assert await append_values(cluster, created, [b"a"]) == 0
            address = primary_address(created)
            node = cluster.node_client(address)
            other = messages.ReplicaNode(
                data_node=messages.DataNode(node_id=2, advertise_addr="127.0.0.1:1"),
                is_primary=True,
            )
            stale = replace(created, replica_nodes=(other,))
            [result] = await node.sync_ranges(
                [messages.StreamRanges(stream_id=created.stream_id, ranges=(stale,))]
            )
            assert result.error_code == ErrorCode.NONE
            assert [r.data_node.node_id for r in result.ranges[0].replica_nodes] == [2]
            me = messages.DataNode(node_id=1, advertise_addr=address)
            await eventually(
                lambda: node.list_node_ranges(me),
                until=lambda hosted: [r.stream_id for r in hosted] == [created.stream_id],
                timeout=10,
                what="the node hosts the stream's range again",
            )
            assert await append_values(cluster, created, [b"b"]) == 1
            assert await read_stream(cluster, created.stream_id) == [b"a", b"b"]
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


@pytest.mark.deadline(90)
async def test_pm_killed_and_restarted_keeps_everything(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path) as cluster:
        pm = cluster.pm_client()
        results = await pm.create_streams([messages.Stream(replica_nums=2)] * 20)
        ids = [r.stream.stream_id for r in results if r.stream]
        sealed = await pm.seal_range(ids[0], 0)
        before = {i: await pm.list_stream_ranges(i) for i in ids}

        assert cluster.pm is not None
        address = cluster.pm.address
        await cluster.pm.kill()
        await cluster.start_pm(address)
        await cluster.wait_alive({1, 2, 3})

        pm = cluster.pm_client()
        listed = [s.stream_id async for s in pm.list_streams(page_size=7)]
        assert listed == ids
        assert {i: await pm.list_stream_ranges(i) for i in ids} == before
        assert (await pm.seal_range(ids[0], 0)).ranges == sealed.ranges
        again = await pm.create_stream(2)
        assert again.stream is not None and again.stream.stream_id == ids[-1] + 1
        assert again.range is not None
        assert await append_values(cluster, again.range, [b"x"]) == 0


@pytest.mark.deadline(60)
async def test_racing_seals_produce_exactly_one_next_range(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=(1, 2)) as cluster:
        created = await cluster.pm_client().create_stream(1)
        assert created.stream is not None
        stream_id = created.stream.stream_id
        answers: list[tuple[messages.Range, ...]] = []

        async def seal() -> None:
            # Separate PM clients with separate pools: separate connections.
            async with PMClient(cluster.pm_address, timeout=10) as own:
                answers.append((await own.seal_range(stream_id, 0)).ranges)

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(seal)
        ranges = await cluster.pm_client().list_stream_ranges(stream_id)
        assert [r.range_index for r in ranges] == [0, 1]
        assert all(answer == ranges for answer in answers)


@pytest.mark.deadline(60)
async def test_a_thousand_streams_in_one_frame(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path) as cluster:
        pm = cluster.pm_client(timeout=30)
        results = await pm.create_streams([messages.Stream(replica_nums=1)] * 1000)
        assert [r.error_code for r in results] == [ErrorCode.NONE] * 1000
        ids = [r.stream.stream_id for r in results if r.stream]
        assert ids == list(range(ids[0], ids[0] + 1000))
        per_node = {n: 0 for n in (1, 2, 3)}
        for r in results:
            assert r.range is not None
            per_node[r.range.replica_nodes[0].data_node.node_id] += 1
        assert sorted(per_node.values()) == [333, 333, 334]
        # Every node heard of its streams from SYNC_RANGES before the answer.
        for node_id, process in cluster.nodes.items():
            hosted = await cluster.node_client(process.address).list_node_ranges(
                messages.DataNode(node_id=node_id)
            )
            assert len(hosted) == per_node[node_id]


@pytest.mark.deadline(90)
async def test_a_node_with_more_ranges_than_a_frame_holds_is_listed_whole(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=(1,)) as cluster:
        pm = cluster.pm_client(timeout=60)
        count = 30_000  # ~5 MB of ranges: over the 4 MiB of ranges a frame is given
        for _ in range(0, count, 3_000):
            results = await pm.create_streams([messages.Stream(replica_nums=1)] * 3_000)
            assert {r.error_code for r in results} == {ErrorCode.NONE}
        node = messages.DataNode(node_id=1)
        request = messages.ListRangesRequest(range_owners=(messages.RangeOwner(data_node=node),))
        answer = await pm.call(Opcode.LIST_RANGES, request)
        assert answer.frames >= 2
        ranges = await pm.list_node_ranges(node)
        assert len({r.stream_id for r in ranges}) == count
        # and the node's own listing, which the PM's reconcile asks for
        hosted = await cluster.node_client(cluster.nodes[1].address, 60).list_node_ranges(node)
        assert sorted(r.stream_id for r in hosted) == sorted(r.stream_id for r in ranges)


async def test_the_pm_does_not_serve_append(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=()) as cluster:
        connection = await cluster.pool.get(cluster.pm_address)
        request = messages.AppendRequest(timeout_ms=1000, append_requests=())
        with pytest.raises(UnsupportedOperationError):
            await connection.request(Opcode.APPEND, request, timeout=5)


async def test_a_node_whose_map_is_full_gets_no_new_ranges(tmp_path: Path) -> None:
    """A node reports the room left in its LMDB map when that is less than
    the free disk: once its map is full, new streams go to the others
    (before, it reported the disk's free space and kept getting ranges whose
    appends all failed with STORAGE_FULL), and its open ranges are sealed so
    that their streams go on elsewhere."""
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm()
            await cluster.start_node(1)
            await cluster.start_node(2, "--map-size", "3MiB")
            await cluster.wait_alive({1, 2})
            pm = cluster.pm_client()
            # fill node 2 through a stream placed on it
            full = None
            for created in await pm.create_streams([messages.Stream(replica_nums=1)] * 4):
                assert created.range is not None
                if created.range.replica_nodes[0].data_node.node_id == 2:
                    full = created.range
            assert full is not None
            node = cluster.node_client(primary_address(full))
            batch = bytes(build_batch([b"x" * 60_000] * 4, base_timestamp=1))
            with pytest.raises(StorageFullError):
                for _ in range(100):
                    await node.append_batch(full.stream_id, batch)
            # its next report shows it full: no new range is placed on it
            with trio.fail_after(10):
                while True:
                    statuses = {s.data_node.node_id: s for s in await pm.describe_cluster()}
                    metrics = statuses[2].metrics
                    if metrics is not None and metrics.disk_free_space < 1 << 20:
                        break
                    await trio.sleep(0.1)
            results = await pm.create_streams([messages.Stream(replica_nums=1)] * 8)
            placed = {r.range.replica_nodes[0].data_node.node_id for r in results if r.range}
            assert placed == {1}
            # and the stream that filled it is sealed there: it goes on in a
            # range on node 1, which takes the appends node 2 refused
            ranges = await eventually(
                lambda: pm.list_stream_ranges(full.stream_id),
                until=lambda listed: len(listed) >= 2,
                timeout=10,
            )
            sealed, following = ranges
            assert sealed.end_offset > 0
            assert [n.data_node.node_id for n in following.replica_nodes] == [1]
            moved = cluster.node_client(primary_address(following))
            assert (await moved.append_batch(full.stream_id, batch)).base_offset == (
                sealed.end_offset
            )
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()
