"""A data node's lookups of streams on the PM (LIST_RANGES), in its own
process: an answer that a SYNC_RANGES overtook on the way is not applied
over it."""

from __future__ import annotations

from pathlib import Path

import trio

from datanode.convert import info_to_range
from datanode.items import wait_future
from datanode.pm_link import PMLink
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch, stamp_base_offset
from sbp.enums import ErrorCode, ObjectState, Opcode
from storage import RangeInfo, ReplicaBatch, ReplicaInfo, StorageEngine

from .test_datanode_append import MAP_SIZE, NODE, node_connection

STREAM, EPOCH = 9, 1


def on(index: int, start: int, end: int, nodes: tuple[int, ...]) -> messages.Range:
    """Range ``index`` of the stream on ``nodes``, the first its primary."""
    replicas = tuple(ReplicaInfo(n, f"127.0.0.1:{9000 + n}", n == nodes[0]) for n in nodes)
    return info_to_range(RangeInfo(STREAM, index, start, end, replicas=replicas, epoch=EPOCH))


class AnswerInFlight:
    """The PM's side of the lookup: it answers at once with the ranges as
    they are then, and the answer reaches the node when ``arrive`` is set."""

    def __init__(self, answer: list[messages.Range]) -> None:
        self.answer = answer
        self.asked = trio.Event()
        self.arrive = trio.Event()

    async def list_stream_ranges(self, stream_id: int) -> list[messages.Range]:
        assert stream_id == STREAM
        self.asked.set()
        await self.arrive.wait()
        return self.answer


async def test_a_lookup_answer_overtaken_by_sync_ranges_is_not_applied(tmp_path: Path) -> None:
    """A reader asks this node about a stream it does not know, and it
    looks the stream up: range 0 is sealed on nodes 2 and 3. Before the
    answer arrives, a drain of node 2 places this node on range 0 and the
    PM's SYNC_RANGES says so; this node copies the range. The late answer
    must not take it off the range again: the PM would wait for its copy
    for ever, and count it as a replica that holds nothing."""
    before = [on(0, 0, 3, (2, 3)), on(1, 3, -1, (2, 3))]
    after = [on(0, 0, 3, (3, 2, NODE)), on(1, 3, -1, (3, 2, NODE))]
    pm = AnswerInFlight(before)
    with StorageEngine(tmp_path / "node", map_size=MAP_SIZE, node_id=NODE) as engine:
        async with ConnectionPool() as pool, node_connection(engine) as (node, client, _):
            link = PMLink(
                "127.0.0.1:1",
                pool,
                node.identity,
                messages.ReportMetricsRequest,
                node.install_ranges,
                heartbeat_interval=60.0,
                metrics_interval=60.0,
            )
            link._pm = pm  # type: ignore[assignment]
            node.pm = link
            described: list[messages.DescribeRangeResult] = []

            async def describe() -> None:
                request = messages.DescribeRangesRequest(
                    ranges=(messages.RangeId(stream_id=STREAM, range_index=0),)
                )
                answer = (await client.request(Opcode.DESCRIBE_RANGES, request, timeout=5)).header
                described.extend(answer.describe_responses)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(describe)
                await pm.asked.wait()
                sync = messages.SyncRangesRequest(
                    timeout_ms=5000,
                    stream_ranges=(messages.StreamRanges(stream_id=STREAM, ranges=tuple(after)),),
                )
                synced = (await client.request(Opcode.SYNC_RANGES, sync, timeout=5)).header
                assert [r.error_code for r in synced.sync_responses] == [ErrorCode.NONE]
                copy = build_batch([b"a", b"b", b"c"], 1000)
                stamp_base_offset(copy, 0)
                caught_up = engine.catch_up([ReplicaBatch(STREAM, 0, EPOCH, 0, copy, 3)])
                assert await wait_future(caught_up) == 3
                pm.arrive.set()
            [result] = described
            assert result.error_code == ErrorCode.NONE
            assert result.range is not None
            assert [r.data_node.node_id for r in result.range.replica_nodes] == [3, 2, NODE]
            assert engine.range_holding(STREAM, 0)[0] == 3
            assert [r.range_index for r in engine.list_ranges(STREAM)] == [0, 1]


async def test_a_lookup_takes_no_serving_node_of_a_range_in_the_store_for_its_replica(
    tmp_path: Path,
) -> None:
    """LIST_RANGES names, for a range in the object store only, two nodes
    that serve it from there (SPEC §14), this one among them. Learned by a
    lookup, the range has no replica here: catch-up must not copy it back
    onto the disk it left."""
    in_store = info_to_range(
        RangeInfo(
            STREAM,
            0,
            0,
            3,
            replicas=(
                ReplicaInfo(NODE, f"127.0.0.1:{9000 + NODE}", False),
                ReplicaInfo(3, "127.0.0.1:9003", False),
            ),
            epoch=EPOCH,
            object_state=ObjectState.IN_STORE_ONLY,
        )
    )
    with StorageEngine(tmp_path / "node", map_size=MAP_SIZE, node_id=NODE) as engine:
        async with node_connection(engine) as (node, _, _):
            await node.install_ranges(STREAM, [in_store, on(1, 3, -1, (2, 3))])
            range0 = engine.range_at(STREAM, 0)
            assert range0 is not None and range0.object_state == ObjectState.IN_STORE_ONLY
            assert range0.replicas == ()
            assert engine.list_ranges(STREAM) == []  # it holds none of the stream's ranges
