"""A data node that was away hears what it missed: streams deleted, ranges
trimmed or sealed, and nothing of streams this PM never created."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import trio

from pm import reconcile
from pm.liveness import NodeRegistry
from pm.manager import PlacementManager
from pm.metadata import MetadataStore
from pm.records import NodeRecord, RangeRecord, StreamRecord
from sbp.constants import OPEN_END_OFFSET

from .test_pm_manager import FakeDataNodes


def _range(stream_id: int, index: int, start: int, end: int = OPEN_END_OFFSET) -> RangeRecord:
    return RangeRecord(stream_id, index, start, (1,), end)


def test_plan_compares_the_node_with_the_metadata() -> None:
    on_node = [
        _range(1, 0, 0),  # the same on both sides
        _range(2, 0, 0, 10),  # trimmed away since
        _range(2, 1, 10),
        _range(3, 0, 0),  # deleted since
        _range(4, 0, 0),  # sealed since
        _range(90, 0, 0),  # an id this PM never handed out
    ]
    in_metadata = [_range(1, 0, 0), _range(2, 1, 12), _range(4, 0, 0, 7), _range(5, 0, 0)]
    known = {1, 2, 4, 5}
    todo = reconcile.plan(on_node, in_metadata, known.__contains__, next_stream_id=6)
    assert todo.delete == [3]
    assert todo.sync == [2, 4, 5]  # 5: created while the node was away
    assert todo.foreign == [90]
    assert not todo.empty


def test_plan_of_a_node_in_step_is_empty() -> None:
    ranges = [_range(1, 0, 0, 5), _range(1, 1, 5)]
    todo = reconcile.plan(ranges, ranges, lambda _: True, next_stream_id=2)
    assert todo.empty and not todo.foreign


def test_a_known_node_is_returning_when_unheard_since_start_or_silent_too_long() -> None:
    now = [100.0]
    registry = NodeRegistry(5.0, clock=lambda: now[0])
    node = NodeRecord(1, "127.0.0.1:9001")
    assert not registry.is_returning(1)  # never seen: a new node, nothing to catch up on
    registry.restore([node], {})
    assert registry.is_returning(1)  # known from the metadata, not heard since start
    registry.heartbeat(node)
    assert not registry.is_returning(1)
    now[0] += 4.9
    assert not registry.is_returning(1)
    now[0] += 0.2
    assert registry.is_returning(1)  # silent past the node timeout


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    opened = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    yield opened
    opened.close()


async def test_reconcile_deletes_and_syncs_what_the_node_missed(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    registry = NodeRegistry(5.0)
    manager = PlacementManager(store, registry, nodes)
    await manager.heartbeat(NodeRecord(1, "127.0.0.1:9001"))
    created = await manager.create_streams([StreamRecord(0, 1)] * 3, timeout=5)
    ranges = [r.value[1] for r in created if r.value is not None]
    kept, doomed, trimmed = (r.stream_id for r in ranges)
    nodes.next_offsets[trimmed] = 8
    await manager.seal_ranges([(trimmed, 0)], timeout=5)
    # What the node holds when it comes back: the state before these changes.
    nodes.hosted[1] = [*ranges, RangeRecord(77, 0, 0, (1,))]
    await manager.delete_streams([doomed], timeout=5)
    await manager.trim_streams([(trimmed, 8)], timeout=5)
    nodes.synced.clear()
    nodes.deleted.clear()

    todo = await manager.reconciler.reconcile_node(1)

    assert nodes.deleted == [(1, (doomed,))]
    assert [(n, sid) for n, sid, _ in nodes.synced] == [(1, trimmed)]
    [(_, _, sent)] = nodes.synced
    assert sent == tuple(store.ranges(trimmed))
    assert [(r.range_index, r.start_offset) for r in sent] == [(1, 8)]
    assert todo.foreign == [77]
    assert kept not in todo.sync + todo.delete


async def test_a_failed_reconcile_is_tried_again_later_and_later(
    store: MetadataStore, autojump_clock: trio.testing.MockClock
) -> None:
    nodes = FakeDataNodes()
    nodes.listings_failing = 2
    registry = NodeRegistry(5.0)
    manager = PlacementManager(store, registry, nodes, reconcile_interval=0)
    node = NodeRecord(1, "127.0.0.1:9001")
    registry.restore([node], {})  # known from the metadata, as after a PM restart
    async with trio.open_nursery() as nursery:
        nursery.start_soon(manager.reconciler.run)
        for _ in range(60):  # a heartbeat a second
            await manager.heartbeat(node)
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    # the first heartbeat, then a heartbeat 10 s and 20 s after each failure;
    # nothing more once it succeeded
    assert len(nodes.listed_at) == 3
    first, second, third = nodes.listed_at
    assert 10 <= second - first <= 11
    assert 20 <= third - second <= 21


class _SyncsLost(FakeDataNodes):
    """SYNC_RANGES sent before ``lost_until`` (trio time) go unanswered."""

    lost_until = -math.inf

    async def sync_ranges(
        self, node_id: int, streams: Sequence[tuple[int, Sequence[RangeRecord]]]
    ) -> None:
        if trio.current_time() < self.lost_until:
            await trio.sleep_forever()
        await super().sync_ranges(node_id, streams)


async def test_a_live_node_that_missed_a_sync_ranges_is_reconciled(
    store: MetadataStore, autojump_clock: trio.testing.MockClock
) -> None:
    """The node's heartbeats come, but the PM cannot reach it when it seals
    one of its ranges: the node would keep the range open, short of its end,
    with nobody to tell it. It is reconciled instead, again until it answers."""
    nodes = _SyncsLost()
    registry = NodeRegistry(5.0)
    # no comparison every interval: the mock clock jumps to its wake-ups
    # while a commit runs on a thread
    manager = PlacementManager(store, registry, nodes, reconcile_interval=0)
    node = NodeRecord(1, "127.0.0.1:9001")
    await manager.heartbeat(node)
    [created] = await manager.create_streams([StreamRecord(0, 1)], timeout=5)
    assert created.value is not None
    opened = created.value[1]
    nodes.hosted[1] = [opened]  # what the node holds: the range still open
    nodes.next_offsets[opened.stream_id] = 5
    async with trio.open_nursery() as nursery:
        nursery.start_soon(manager.reconciler.run)
        # the seal's own SYNC_RANGES
        nodes.lost_until = trio.current_time() + 5.0
        nodes.listings_failing = 1  # and the first reconcile's listing
        nodes.synced.clear()
        await manager.seal_ranges([(opened.stream_id, 0)], 2.0)
        assert nodes.synced == []
        for _ in range(30):  # a heartbeat a second
            await manager.heartbeat(node)
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    sent = [ranges for n, sid, ranges in nodes.synced if (n, sid) == (1, opened.stream_id)]
    assert sent, "the node was never told that its range was sealed"
    assert sent[-1] == tuple(store.ranges(opened.stream_id))
    assert sent[-1][0].end_offset == 5
    assert len(nodes.listed_at) == 2  # the failed reconcile, then the one that worked


async def test_no_new_stream_takes_the_id_of_a_stream_a_node_holds(store: MetadataStore) -> None:
    """A node holding streams another PM placed (PMs of another mode or
    cluster): a new stream with one of their ids would be handed their
    records, so the next id moves past them, durably."""
    nodes = FakeDataNodes()
    registry = NodeRegistry(5.0)
    manager = PlacementManager(store, registry, nodes)
    await manager.heartbeat(NodeRecord(1, "127.0.0.1:9001"))
    nodes.hosted[1] = [RangeRecord(1, 0, 0, (1,)), RangeRecord(3, 0, 0, (1,))]

    todo = await manager.reconciler.reconcile_node(1)

    assert todo.foreign == [1, 3]
    [created] = await manager.create_streams([StreamRecord(0, 1)], timeout=5)
    assert created.value is not None and created.value[0].stream_id == 4
    assert store.next_stream_id() == 5


async def test_every_live_node_is_compared_with_the_metadata_now_and_then(
    store: MetadataStore, autojump_clock: trio.testing.MockClock
) -> None:
    """A node that went out of step without any call failing (it lists no
    range of a stream the PM places on it) is sent the stream's ranges
    within a reconcile interval; a stream it holds that the PM deleted is
    not deleted by this comparison, only by the one when a node returns."""
    nodes = FakeDataNodes()
    registry = NodeRegistry(5.0)
    manager = PlacementManager(store, registry, nodes, reconcile_interval=60.0)
    node = NodeRecord(1, "127.0.0.1:9001")
    await manager.heartbeat(node)
    created = await manager.create_streams([StreamRecord(0, 1)] * 2, timeout=5)
    kept, doomed = (r.value[1] for r in created if r.value is not None)
    await manager.delete_streams([doomed.stream_id], timeout=5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(manager.reconciler.run)
        await trio.sleep(1)  # the reconcile of the node first heard of
        nodes.hosted[1] = [doomed]  # out of step: kept is missing, doomed still here
        nodes.synced.clear()
        nodes.deleted.clear()
        started = trio.current_time()
        for _ in range(130):  # a heartbeat a second
            await manager.heartbeat(node)
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    listed = [t - started for t in nodes.listed_at if t > started]
    assert len(listed) == 2 and 59 <= listed[0] <= 60 and 119 <= listed[1] <= 120
    assert [(n, sid) for n, sid, _ in nodes.synced] == [(1, kept.stream_id)] * 2
    assert nodes.deleted == []
    assert manager.reconciler.reconciled == {"periodic": 2}


async def test_streams_found_foreign_are_never_taken_for_deleted_ones(tmp_path: Path) -> None:
    """Once the next id has moved past a node's foreign streams, their ids
    are below it like those of deleted streams: a later reconcile, by this
    PM or by one started again on the metadata, must still leave them alone."""
    nodes = FakeDataNodes()
    nodes.hosted[1] = [RangeRecord(1, 0, 0, (1,)), RangeRecord(3, 0, 0, (1,))]
    for _ in range(2):  # the PM, then the PM started again
        store = MetadataStore(tmp_path / "pm", map_size=64 << 20)
        try:
            manager = PlacementManager(store, NodeRegistry(5.0), nodes, reconcile_interval=0)
            await manager.heartbeat(NodeRecord(1, "127.0.0.1:9001"))
            for _ in range(2):
                todo = await manager.reconciler.reconcile_node(1)
                assert (todo.foreign, todo.delete) == ([1, 3], [])
            assert store.foreign_streams() == {1, 3}
            assert store.next_stream_id() == 4
        finally:
            store.close()
    assert nodes.deleted == []
