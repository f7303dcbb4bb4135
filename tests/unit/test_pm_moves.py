"""Moves of sealed ranges' replicas (``pm.moves``), whatever their cause,
over records with the data nodes faked: recorded with their cause, the old
replica kept until the new one holds the range, resumed by a PM that
restarts, and dropped when overtaken."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pm.changes import PutRange, PutStream
from pm.liveness import NodeRegistry
from pm.manager import PlacementManager
from pm.metadata import MetadataStore
from pm.metrics import ClusterCollector
from pm.records import Holding, MoveCause, MoveRecord, NodeRecord, RangeRecord, StreamRecord
from pm.stored_values import decode_move, encode_move

from .test_pm_rebalance import SizedNodes


class CopyingNodes(SizedNodes):
    """``SizedNodes`` whose nodes in ``copying`` hold none of a range yet."""

    def __init__(self) -> None:
        super().__init__()
        self.copying: set[int] = set()

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        if node_id in self.copying:
            return {key: Holding(-1, 0) for key in keys}
        return await super().range_holdings(node_id, keys, skips)


async def _manager(
    path: Path, nodes: SizedNodes, *, nodes_up: Sequence[int] = (1, 2, 3)
) -> tuple[PlacementManager, MetadataStore]:
    store = MetadataStore(path, map_size=64 << 20)
    registry = NodeRegistry(5.0)
    manager = PlacementManager(store, registry, nodes)
    for node_id in nodes_up:
        registry.heartbeat(NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"))
    return manager, store


async def _one_range_on_node_1(manager: PlacementManager, nodes: SizedNodes) -> RangeRecord:
    rng = RangeRecord(1, 0, 0, (1,), 10)
    await manager.commit([PutStream(StreamRecord(1, 1)), PutRange(rng)])
    nodes.sizes[rng.key] = 100
    return rng


async def _drain_node_1_while_it_copies(
    manager: PlacementManager, nodes: CopyingNodes
) -> MoveRecord:
    """Node 1's one range, drained while nodes 2 and 3 hold none of it yet:
    the move the first pass records."""
    await _one_range_on_node_1(manager, nodes)
    await manager.drain_nodes([1])
    nodes.copying = {2, 3}
    await manager.move_ranges(10)
    [move] = manager.store.moves()
    return move


def _moves_gauge(manager: PlacementManager) -> dict[str, float]:
    """``sbp_pm_range_moves`` by cause, as /metrics shows it."""
    [family] = [
        m for m in ClusterCollector(lambda: manager).collect() if m.name == "sbp_pm_range_moves"
    ]
    return {sample.labels["cause"]: sample.value for sample in family.samples}


def test_a_move_keeps_its_cause_and_a_rebalances_first_value_still_reads() -> None:
    move = MoveRecord(7, 3, 2, (4, 5), MoveCause.DRAIN)
    assert decode_move(7, 3, encode_move(move)) == move
    # a rebalance's move as first stored: from node, to node
    assert decode_move(7, 3, (2).to_bytes(4, "big") + (4).to_bytes(4, "big")) == MoveRecord(
        7, 3, 2, (4,), MoveCause.REBALANCE
    )


async def test_the_old_replica_stays_until_the_new_one_holds_the_range(tmp_path: Path) -> None:
    nodes = CopyingNodes()
    manager, store = await _manager(tmp_path / "pm", nodes)
    try:
        move = await _drain_node_1_while_it_copies(manager, nodes)
        assert (move.from_node, move.cause) == (1, MoveCause.DRAIN)
        assert _moves_gauge(manager) == {"drain": 1, "rebalance": 0, "repair": 0, "top_up": 0}
        rng = store.range(1, 0)
        assert rng is not None and rng.nodes == (1, move.to_node)
        for _ in range(3):  # the copy is not done: node 1 stays
            await manager.move_ranges(10)
            assert store.range(1, 0) == rng and store.moves() == [move]
        nodes.copying = set()
        await manager.move_ranges(10)
        assert store.moves() == []
        after = store.range(1, 0)
        assert after is not None and after.nodes == (move.to_node,)
        assert manager.drains.moved == 1 and manager.moves.finished[MoveCause.DRAIN] == 1
        assert _moves_gauge(manager)["drain"] == 0
    finally:
        store.close()


async def test_a_pm_that_restarts_ends_the_moves_it_recorded(tmp_path: Path) -> None:
    """A drain's move recorded by one PM is ended by the next, which never
    planned it: the drain mark and the move are in the metadata."""
    nodes = CopyingNodes()
    manager, store = await _manager(tmp_path / "pm", nodes)
    move = await _drain_node_1_while_it_copies(manager, nodes)
    store.close()

    nodes.copying = set()
    again, store = await _manager(tmp_path / "pm", nodes)
    try:
        assert store.moves() == [move]
        await again.move_ranges(10)
        rng = store.range(1, 0)
        assert rng is not None and rng.nodes == (move.to_node,) and store.moves() == []
        assert again.drains.moved == 1
    finally:
        store.close()


async def test_a_rebalance_move_whose_new_node_died_is_dropped(tmp_path: Path) -> None:
    nodes = CopyingNodes()
    manager, store = await _manager(tmp_path / "pm", nodes)
    try:
        rng = await _one_range_on_node_1(manager, nodes)
        await manager.moves.record([MoveRecord(*rng.key, 1, (3,), MoveCause.REBALANCE)])
        assert manager.rebalancer.pending() == 1
        manager.registry.forget(3)
        await manager.move_ranges(10)
        assert store.moves() == [] and store.range(1, 0) == rng
    finally:
        store.close()


async def test_a_repair_and_a_top_up_take_both_steps_in_one_commit(tmp_path: Path) -> None:
    """A repair replaces a node dead past the repair delay at once, and a
    top-up has nobody to drop: neither is recorded."""
    nodes = CopyingNodes()
    manager, store = await _manager(tmp_path / "pm", nodes, nodes_up=(1, 2, 3, 4))
    try:
        await manager.commit(
            [
                PutStream(StreamRecord(1, 2)),
                PutRange(RangeRecord(1, 0, 0, (1, 2), 10)),
                PutStream(StreamRecord(2, 3)),
                PutRange(RangeRecord(2, 0, 0, (3,), 10, replicas_wanted=3)),
            ]
        )
        nodes.copying = {1, 2, 3, 4}  # nothing is held whole: neither waits for it
        assert await manager.upkeep.repair_node(1, timeout=10) == 1
        repaired = store.range(1, 0)
        assert repaired is not None and repaired.nodes[0] == 2 and 1 not in repaired.nodes
        await manager.upkeep.find_short_handed()
        assert await manager.upkeep.restore_replication(timeout=10) == 1
        topped = store.range(2, 0)
        assert topped is not None and len(topped.nodes) == 3 and not topped.short_handed
        assert store.moves() == []
        assert manager.upkeep.repairs == 2
    finally:
        store.close()


async def test_a_top_up_goes_only_to_a_node_with_room_for_the_whole_range(
    tmp_path: Path,
) -> None:
    """A node that left a range for being full dropped what it held of it,
    and has room for a new replica again, but not for this range: the
    top-up waits for a node that has."""
    nodes = SizedNodes()
    manager, store = await _manager(tmp_path / "pm", nodes, nodes_up=(1, 2, 3))
    try:
        rng = RangeRecord(1, 0, 0, (1, 2), 1000, replicas_wanted=3)
        await manager.commit([PutStream(StreamRecord(1, 3)), PutRange(rng)])
        nodes.sizes[rng.key] = 5 << 20
        for node_id, free in ((1, 1 << 30), (2, 1 << 30), (3, 3 << 20)):
            manager.registry.report(
                NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"), {"disk_free_space": free}
            )
        await manager.upkeep.find_short_handed()
        assert await manager.upkeep.restore_replication(timeout=10) == 0
        assert store.range(1, 0) == rng
        manager.registry.heartbeat(NodeRecord(4, "127.0.0.1:9004"))
        manager.registry.report(NodeRecord(4, "127.0.0.1:9004"), {"disk_free_space": 1 << 30})
        assert await manager.upkeep.restore_replication(timeout=10) == 1
        topped = store.range(1, 0)
        assert topped is not None and topped.nodes == (1, 2, 4)
    finally:
        store.close()


async def test_a_cancelled_drain_keeps_the_old_and_the_new_replica(tmp_path: Path) -> None:
    nodes = CopyingNodes()
    manager, store = await _manager(tmp_path / "pm", nodes)
    try:
        move = await _drain_node_1_while_it_copies(manager, nodes)
        await manager.drain_nodes([1], cancel=True)
        nodes.copying = set()
        await manager.move_ranges(10)
        rng = store.range(1, 0)
        assert rng is not None and rng.nodes == (1, move.to_node)
        assert store.moves() == [] and manager.drains.moved == 0
    finally:
        store.close()
