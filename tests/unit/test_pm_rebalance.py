"""The rebalance plan (SPEC §12) over records, with range sizes faked: which
sealed ranges move where, and when nothing moves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from pm.changes import PutRange, PutStream
from pm.liveness import NodeRegistry
from pm.manager import PlacementManager
from pm.metadata import MetadataStore
from pm.records import Holding, NodeRecord, RangeRecord, StreamRecord

from .test_pm_manager import FakeDataNodes


class SizedNodes(FakeDataNodes):
    """Answers RANGE_HOLDINGS with the sizes set in ``sizes``."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[tuple[int, int], int] = {}

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        return {key: Holding(1 << 40, self.sizes.get(key, 0)) for key in keys}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    opened = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    yield opened
    opened.close()


async def _cluster(
    store: MetadataStore,
    placed: dict[int, list[int]],
    *,
    size: int = 100,
    open_on: int = 0,
    nodes: SizedNodes | None = None,
    max_move_bytes_per_s: int = 0,
) -> tuple[PlacementManager, SizedNodes]:
    """Nodes 1-3 (and any named in ``placed``), each holding one sealed
    range of ``size`` bytes per stream listed for it; ``open_on`` gets an
    open range of one more stream."""
    nodes = nodes or SizedNodes()
    registry = NodeRegistry(5.0)
    manager = PlacementManager(
        store,
        registry,
        nodes,
        rebalance_threshold=0.2,
        max_move_bytes_per_s=max_move_bytes_per_s,
    )
    for node_id in sorted({1, 2, 3, *placed}):
        registry.heartbeat(NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"))
    changes: list[PutStream | PutRange] = []
    for node_id, streams in placed.items():
        for stream_id in streams:
            changes.append(PutStream(StreamRecord(stream_id, 1)))
            changes.append(PutRange(RangeRecord(stream_id, 0, 0, (node_id,), 10)))
            nodes.sizes[(stream_id, 0)] = size
    if open_on:
        changes.append(PutStream(StreamRecord(99, 1)))
        changes.append(PutRange(RangeRecord(99, 0, 0, (open_on,))))
        nodes.sizes[(99, 0)] = 10 * size
    await manager.commit(changes)
    return manager, nodes


async def test_a_full_node_gives_ranges_to_the_empty_ones_until_they_are_even(
    store: MetadataStore,
) -> None:
    manager, _ = await _cluster(store, {1: list(range(1, 7))})
    plan = await manager.rebalancer.plan()
    assert {p.move.from_node for p in plan} == {1}
    assert Counter(p.move.to_node for p in plan) == {2: 2, 3: 2}
    assert sum(p.size for p in plan) == 400


async def test_open_ranges_stay_and_a_balanced_cluster_plans_nothing(
    store: MetadataStore,
) -> None:
    manager, _ = await _cluster(store, {1: [1, 2], 2: [3, 4], 3: [5, 6]}, open_on=1)
    # node 1 holds the open range's bytes too, but that range cannot move:
    # a move of a sealed one would leave it with fewer ranges and still most bytes
    plan = await manager.rebalancer.plan()
    assert all(p.move.stream_id != 99 for p in plan)
    manager, _ = await _cluster(store, {1: [11, 12], 2: [13, 14], 3: [15, 16]})
    assert await manager.rebalancer.plan() == []


async def test_draining_nodes_neither_give_nor_take(store: MetadataStore) -> None:
    manager, _ = await _cluster(store, {1: list(range(1, 7)), 4: []})
    await manager.drain_nodes([2])
    plan = await manager.rebalancer.plan()
    assert plan and {p.move.to_node for p in plan} == {3, 4}
    assert all(p.move.from_node == 1 for p in plan)


async def test_a_plan_is_kept_and_a_second_waits_for_it(store: MetadataStore) -> None:
    manager, _ = await _cluster(store, {1: list(range(1, 7))})
    started, pending = await manager.rebalance(dry_run=False)
    assert started and pending == 0
    assert [m.key for m in store.moves()] == sorted(p.move.key for p in started)
    again, pending = await manager.rebalance(dry_run=False)
    assert again == [] and pending == len(started)
    dry, _ = await _cluster(store, {})
    assert (await dry.rebalance(dry_run=True))[1] == len(started)  # the same metadata
