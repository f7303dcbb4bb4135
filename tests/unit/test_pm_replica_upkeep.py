"""Ranges kept on as many nodes as they want: writes moved off full nodes, a
full replica that is short of a sealed range leaving it, and short-handed
ranges topped up once nodes with room are there (the data nodes faked)."""

from __future__ import annotations

from pathlib import Path

from pm.liveness import NodeRegistry
from pm.manager import PlacementManager
from pm.metadata import MetadataStore
from pm.records import NodeRecord, RangeRecord, StreamRecord
from pm.stored_values import encode_range, range_from_value

from .test_pm_manager import FakeDataNodes, store  # noqa: F401 (a fixture)

MIN_FREE = 1 << 20


def _manager(
    store: MetadataStore,  # noqa: F811
    nodes: FakeDataNodes,
    count: int,
) -> PlacementManager:
    registry = NodeRegistry(5.0)
    manager = PlacementManager(store, registry, nodes, min_free_space=MIN_FREE)
    for node_id in range(1, count + 1):
        registry.heartbeat(NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"))
    return manager


def _report_free(manager: PlacementManager, node_id: int, free: int) -> None:
    manager.registry.report(
        NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"), {"disk_free_space": free}
    )


async def _stream(
    manager: PlacementManager, replicas: int = 3, acks: int = 0
) -> tuple[int, RangeRecord]:
    [created] = await manager.create_streams([StreamRecord(0, replicas, ack_nums=acks)], timeout=5)
    stream, first = created.value  # type: ignore[misc]
    return stream.stream_id, first


def test_a_short_handed_range_keeps_what_it_wants_in_both_stores_values() -> None:
    whole = RangeRecord(7, 2, 100, (1, 2, 3), 200, epoch=4)
    short = RangeRecord(7, 2, 100, (1, 2), 200, epoch=4, replicas_wanted=3)
    assert range_from_value(7, 2, encode_range(short)) == short
    # A whole range is stored as before the field existed, and such a value
    # decodes with nothing wanted.
    assert len(encode_range(whole)) == 8 * 3 + 1 + 4 * 3
    assert range_from_value(7, 2, encode_range(whole)) == whole
    assert not range_from_value(7, 2, encode_range(whole)).short_handed


async def test_a_full_replica_short_of_the_end_leaves_the_sealed_range(
    store: MetadataStore,  # noqa: F811
) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=3)
    stream_id, first = await _stream(manager)
    primary, full, other = first.nodes
    for node_id, offset in ((primary, 50), (full, 30), (other, 50)):
        nodes.replica_offsets[(stream_id, node_id)] = offset
    for node_id in first.nodes:
        _report_free(manager, node_id, 0 if node_id == full else 1 << 30)
    [sealed] = await manager.seal_ranges([(stream_id, 0)], timeout=5)
    old, new = sealed.value  # type: ignore[misc]
    assert old.end_offset == 50
    assert old.nodes == (primary, other) and old.replicas_wanted == 3 and old.short_handed
    # the next range goes on the two nodes with room: degraded, and it knows it
    assert sorted(new.nodes) == sorted((primary, other)) and new.replicas_wanted == 3
    assert store.range(stream_id, 0) == old
    # the node that left hears of it, so it stops trying to copy the range
    assert full in {node_id for node_id, _, _ in nodes.synced[-3:]}
    assert manager.upkeep.under_replicated() == 0  # not yet looked for: no pass has run
    await manager.upkeep.find_short_handed()
    assert manager.upkeep.under_replicated() == 2


async def test_a_short_replica_with_room_stays_and_catches_up(
    store: MetadataStore,  # noqa: F811
) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=3)
    stream_id, first = await _stream(manager)
    for node_id, offset in zip(first.nodes, (50, 30, 50), strict=True):
        nodes.replica_offsets[(stream_id, node_id)] = offset
        _report_free(manager, node_id, 1 << 30)
    [sealed] = await manager.seal_ranges([(stream_id, 0)], timeout=5)
    old, new = sealed.value  # type: ignore[misc]
    assert old.nodes == first.nodes and not old.short_handed
    assert len(new.nodes) == 3 and not new.short_handed


async def test_a_full_node_is_drained_when_others_have_room(
    store: MetadataStore,  # noqa: F811
) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=2)
    one, _ = await _stream(manager, replicas=1)
    two, _ = await _stream(manager, replicas=1)
    on_node = {node_id: store.ranges_on_node(node_id) for node_id in (1, 2)}
    assert all(len(ranges) == 1 for ranges in on_node.values())
    _report_free(manager, 1, MIN_FREE - 1)
    _report_free(manager, 2, 1 << 30)
    assert await manager.upkeep.drain_full_node(1, timeout=5) == 1
    [moved] = on_node[1]
    sealed, following = store.ranges(moved.stream_id)
    assert not sealed.is_open and sealed.nodes == (1,)
    assert following.is_open and following.nodes == (2,)
    assert manager.seals["full_node"] == 1
    # nothing is open there any more; the other stream was never on it
    assert await manager.upkeep.drain_full_node(1, timeout=5) == 0
    assert len(store.ranges(one if moved.stream_id == two else two)) == 1


async def test_a_full_node_keeps_its_open_ranges_when_no_other_has_room(
    store: MetadataStore,  # noqa: F811
) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=1)
    stream_id, first = await _stream(manager, replicas=1)
    _report_free(manager, 1, 0)
    assert await manager.upkeep.drain_full_node(1, timeout=5) == 0
    assert store.ranges(stream_id) == [first]


async def test_short_handed_ranges_are_topped_up_once_nodes_have_room(
    store: MetadataStore,  # noqa: F811
) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=3)
    manager.upkeep._short_handed = set()  # as after the first pass of watch_nodes
    stream_id, first = await _stream(manager)
    primary, full, other = first.nodes
    for node_id, offset in ((primary, 50), (full, 30), (other, 50)):
        nodes.replica_offsets[(stream_id, node_id)] = offset
    _report_free(manager, full, 0)
    await manager.seal_ranges([(stream_id, 0)], timeout=5)
    assert manager.upkeep.under_replicated() == 2
    # no node with room outside the ranges: nothing changes
    assert await manager.upkeep.restore_replication(timeout=5) == 0
    assert manager.upkeep.under_replicated() == 2

    # a fourth node arrives: the sealed range gets it at once; the open one
    # is sealed (its next range now fits on three nodes), then topped up too
    manager.registry.heartbeat(NodeRecord(4, "127.0.0.1:9004"))
    assert await manager.upkeep.restore_replication(timeout=5) == 2
    sealed_first, sealed_second, last = store.ranges(stream_id)
    assert sealed_first.nodes == (primary, other, 4) and not sealed_first.short_handed
    assert sorted(sealed_second.nodes) == sorted((primary, other, 4))
    assert not sealed_second.short_handed and not sealed_second.is_open
    assert last.is_open and len(last.nodes) == 3 and full not in last.nodes
    assert manager.seals["under_replicated"] == 1 and manager.upkeep.repairs == 2
    assert manager.upkeep.under_replicated() == 0
    # the new replica was told of the range, and copies it from the others
    assert any(node_id == 4 for node_id, _, _ in nodes.synced)
    # each node's range count followed every commit: the metadata agrees
    hosted = {s.node_id: s.hosted_ranges for s in manager.cluster()}
    assert hosted == {
        node_id: len(store.ranges_on_node(node_id)) for node_id in (primary, full, other, 4)
    }
    assert hosted[full] == 0 and hosted[4] == 3


async def test_a_restarted_pm_finds_its_short_handed_ranges(tmp_path: Path) -> None:
    path = tmp_path / "pm"
    first = MetadataStore(path, map_size=64 << 20)
    nodes = FakeDataNodes()
    manager = _manager(first, nodes, count=2)
    stream_id, _ = await _stream(manager, replicas=2, acks=1)
    manager.registry.heartbeat(NodeRecord(3, "127.0.0.1:9003"))
    _report_free(manager, 2, 0)
    _report_free(manager, 1, 1 << 30)
    nodes.replica_offsets[(stream_id, 2)] = 0
    nodes.next_offsets[stream_id] = 9
    await manager.seal_ranges([(stream_id, 0)], timeout=5)
    first.close()
    again = MetadataStore(path, map_size=64 << 20)
    try:
        restarted = _manager(again, FakeDataNodes(), count=3)
        await restarted.upkeep.find_short_handed()
        assert restarted.upkeep._short_handed == {(stream_id, 0)}
        [range0, _open] = again.ranges(stream_id)
        assert range0.nodes == (1,) and range0.replicas_wanted == 2
    finally:
        again.close()
