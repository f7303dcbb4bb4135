"""Where the new replicas of sealed ranges go when a drain (SPEC §12) or a
repair (§7) moves many at once, over records with range sizes faked: they
spread over the other nodes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import pytest
import trio
import trio.testing

import pm.drain
from pm.changes import PutRange, PutStream
from pm.manager import PlacementManager
from pm.metadata import MetadataStore
from pm.records import Holding, NodeRecord, RangeRecord, StreamRecord
from sbp.constants import OPEN_END_OFFSET
from sbp.enums import DataNodeState

from ..eventually import eventually
from .test_pm_rebalance import SizedNodes, _cluster, store

__all__ = ["store"]


def _on_nodes_1_and_2(count: int, end_offset: int = OPEN_END_OFFSET) -> list[PutStream | PutRange]:
    """Streams 1 to ``count`` of two replicas, each with its range 0 on
    nodes 1 and 2: sealed at ``end_offset``, or open."""
    changes: list[PutStream | PutRange] = []
    for stream_id in range(1, count + 1):
        changes.append(PutStream(StreamRecord(stream_id, 2)))
        changes.append(PutRange(RangeRecord(stream_id, 0, 0, (1, 2), end_offset)))
    return changes


def _replicas(manager: PlacementManager, stream_ids: Iterable[int]) -> list[tuple[int, ...]]:
    """The nodes of range 0 of each stream."""
    ranges = [manager.store.range(stream_id, 0) for stream_id in stream_ids]
    return [rng.nodes for rng in ranges if rng is not None]


async def test_a_drained_nodes_ranges_spread_over_the_others_by_bytes(
    store: MetadataStore,
) -> None:
    """Node 2 takes appends and node 3 none: placed as new ranges are, every
    copy went to node 3; a pass of the drain gives each half the bytes."""
    manager, _ = await _cluster(store, {1: list(range(1, 7))})
    manager.registry.report(
        NodeRecord(2, "127.0.0.1:9002"), {"network_append_rate": 5_000, "range_active_cnt": 4}
    )
    await manager.drain_nodes([1])
    await manager.move_ranges(10)
    added = Counter(n for nodes in _replicas(manager, range(1, 7)) for n in nodes if n != 1)
    assert added == {2: 3, 3: 3}


async def test_a_drain_copies_onto_the_node_that_writes_less_first(
    store: MetadataStore,
) -> None:
    """Node 2 writes 40 bytes/s of appends, 400 bytes over the 10 s a copy
    counts against it, and node 3 nothing: of six 100-byte ranges node 3
    takes the first four, after which both have 400 bytes to write."""
    manager, _ = await _cluster(store, {1: list(range(1, 7))})
    manager.registry.report(NodeRecord(2, "127.0.0.1:9002"), {"disk_in_rate": 40})
    await manager.drain_nodes([1])
    await manager.move_ranges(10)
    added = [n for nodes in _replicas(manager, range(1, 7)) for n in nodes if n != 1]
    assert added == [3, 3, 3, 3, 2, 3]


async def test_a_dead_nodes_ranges_are_repaired_onto_every_other_node(
    store: MetadataStore,
) -> None:
    """The same for the replacements of a dead node: node 4 takes appends,
    so by the placement of new ranges every copy went to node 3."""
    manager, _ = await _cluster(store, {4: []})
    await manager.commit(_on_nodes_1_and_2(6, end_offset=10))
    manager.registry.report(
        NodeRecord(4, "127.0.0.1:9004"), {"network_append_rate": 5_000, "range_active_cnt": 4}
    )
    assert await manager.upkeep.repair_node(1, 10) == 6
    added = Counter(
        n for nodes in _replicas(manager, range(1, 7)) for n in nodes if n not in (1, 2)
    )
    assert added == {3: 3, 4: 3}


class SilentNodes(SizedNodes):
    """``SizedNodes`` whose nodes in ``silent`` do not answer RANGE_HOLDINGS."""

    def __init__(self) -> None:
        super().__init__()
        self.silent: set[int] = set()

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        if node_id in self.silent:
            raise OSError("no answer")
        return await super().range_holdings(node_id, keys, skips)


async def test_a_range_no_replica_tells_the_size_of_is_not_copied_yet(
    store: MetadataStore,
) -> None:
    """Its share of the move budget is not known: taken as 0 bytes, every
    such range started at once, whatever --max-move-bytes-per-s says."""
    nodes = SilentNodes()
    manager, _ = await _cluster(
        store, {1: [1, 2, 3]}, size=5_000, nodes=nodes, max_move_bytes_per_s=1_000
    )
    nodes.silent.add(1)
    await manager.drain_nodes([1])
    await manager.move_ranges(10)
    assert _replicas(manager, (1, 2, 3)) == [(1,)] * 3
    nodes.silent.clear()
    await manager.move_ranges(10)
    # known now: one copy starts, the budget holds the others back
    assert sorted(map(len, _replicas(manager, (1, 2, 3)))) == [1, 1, 2]


async def test_a_move_counts_once_committed_not_once_the_nodes_are_told(
    store: MetadataStore,
) -> None:
    """DESCRIBE_CLUSTER shows a node drained as soon as its last range's
    move is committed: the moves counted must include it by then."""
    manager, nodes = await _cluster(store, {1: [1]})
    await manager.drain_nodes([1])
    await manager.move_ranges(10)  # the new replica is added
    told = trio.Event()
    slow_sync = nodes.sync_ranges

    async def sync_ranges(
        node_id: int, streams: Sequence[tuple[int, Sequence[RangeRecord]]]
    ) -> None:
        await told.wait()
        await slow_sync(node_id, streams)

    nodes.sync_ranges = sync_ranges  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(manager.move_ranges, 10)
        await eventually(lambda: manager.drains.state(1) == DataNodeState.DRAINED)
        assert manager.drains.moved == 1
        told.set()


class CountingNodes(SizedNodes):
    """``SizedNodes`` that count SYNC_RANGES calls, by node. With
    ``hold_first_until``, a node's first call is answered only once that
    holds and every other task waits (for this call, say), as a slow round
    trip would be: what comes meanwhile queues behind it, on any machine's
    timing."""

    def __init__(self, hold_first_until: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.sync_calls: Counter[int] = Counter()
        self.hold_first_until = hold_first_until

    async def sync_ranges(
        self, node_id: int, streams: Sequence[tuple[int, Sequence[RangeRecord]]]
    ) -> None:
        self.sync_calls[node_id] += 1
        if self.hold_first_until is not None and self.sync_calls[node_id] == 1:
            await eventually(self.hold_first_until, what="the condition holding the first call")
            await trio.testing.wait_all_tasks_blocked()
        await super().sync_ranges(node_id, streams)


async def test_a_pass_moves_many_ranges_in_one_commit_and_one_call_per_node(
    store: MetadataStore,
) -> None:
    """60 ranges: one pass gives each a new replica, the next moves them
    all off; each tells every node once, however many ranges it moved."""
    nodes = CountingNodes()
    manager, _ = await _cluster(store, {1: list(range(1, 61))}, nodes=nodes)
    await manager.drain_nodes([1])
    await manager.move_ranges(10)
    assert all(len(nodes) == 2 for nodes in _replicas(manager, range(1, 61)))
    assert nodes.sync_calls == {1: 1, 2: 1, 3: 1}
    nodes.sync_calls.clear()
    await manager.move_ranges(10)
    assert all(1 not in nodes for nodes in _replicas(manager, range(1, 61)))
    assert nodes.sync_calls == {1: 1, 2: 1, 3: 1}
    assert manager.drains.state(1) == DataNodeState.DRAINED
    assert manager.drains.moved == 60


async def test_a_pass_moves_the_ranges_copied_since_the_last_while_it_starts_others(
    store: MetadataStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for 4 ranges and 2 new copies a pass, 6 ranges leave in 4
    passes: each pass after the first moves the 2 copied since the last
    and starts 2 more."""
    monkeypatch.setattr(pm.drain, "MAX_RANGES_PER_PASS", 4)
    monkeypatch.setattr(pm.drain, "MAX_COPIES_PER_PASS", 2)
    manager, _ = await _cluster(store, {1: list(range(1, 7))})
    await manager.drain_nodes([1])
    seen = []
    for _ in range(4):
        await manager.move_ranges(10)
        seen.append([len(nodes) for nodes in _replicas(manager, range(1, 7))])
    # 2: a new replica beside node 1; 1: moved off it
    assert seen == [
        [2, 2, 1, 1, 1, 1],
        [1, 1, 2, 2, 1, 1],
        [1, 1, 1, 1, 2, 2],
        [1, 1, 1, 1, 1, 1],
    ]
    assert all(1 not in nodes for nodes in _replicas(manager, range(1, 7)))


async def test_a_dead_nodes_ranges_are_replaced_in_one_commit_and_one_call_per_node(
    store: MetadataStore,
) -> None:
    nodes = CountingNodes()
    manager, _ = await _cluster(store, {4: []}, nodes=nodes)
    await manager.commit(_on_nodes_1_and_2(60, end_offset=10))
    assert await manager.upkeep.repair_node(1, 10) == 60
    assert all(1 not in nodes and len(nodes) == 2 for nodes in _replicas(manager, range(1, 61)))
    assert nodes.sync_calls == {1: 1, 2: 1, 3: 1, 4: 1}


async def test_short_handed_ranges_are_topped_up_in_one_commit_and_one_call_per_node(
    store: MetadataStore,
) -> None:
    """60 sealed ranges on two nodes that want three, and 60 open ones
    whose next range fits on three nodes now: the open ones are sealed,
    then all 120 get node 3, with one SYNC_RANGES per node."""

    def seals_done() -> bool:
        return all(not store.ranges(stream_id)[1].is_open for stream_id in range(1, 61))

    nodes = CountingNodes(hold_first_until=seals_done)
    manager, _ = await _cluster(store, {}, nodes=nodes)
    changes: list[PutStream | PutRange] = []
    for stream_id in range(1, 61):
        changes.append(PutStream(StreamRecord(stream_id, 3)))
        changes.append(PutRange(RangeRecord(stream_id, 0, 0, (1, 2), 10, replicas_wanted=3)))
        changes.append(PutRange(RangeRecord(stream_id, 1, 10, (1, 2), replicas_wanted=3)))
    await manager.commit(changes)
    await manager.upkeep.find_short_handed()
    assert manager.upkeep.under_replicated() == 120
    assert await manager.upkeep.restore_replication(10) == 120
    assert manager.upkeep.under_replicated() == 0
    assert manager.seals["under_replicated"] == 60
    for stream_id in range(1, 61):
        first, second, last = store.ranges(stream_id)
        assert first.nodes == second.nodes == (1, 2, 3)
        assert last.is_open and sorted(last.nodes) == [1, 2, 3]
    # the 60 seals' SYNC_RANGES go to each node in two calls (pm.node_syncs),
    # the top-ups' in one
    assert all(calls <= 3 for calls in nodes.sync_calls.values()), nodes.sync_calls


async def test_the_seals_after_a_primary_dies_tell_each_node_in_a_few_calls(
    store: MetadataStore,
) -> None:
    """60 open ranges led by node 1, sealed at once: each seal tells the
    stream's nodes of the next range, but a node hears of them in two
    SYNC_RANGES (the first seals', and all the others' queued behind it
    while it is under way), not 60 at the same moment."""

    def all_sealed() -> bool:
        return all(not store.ranges(stream_id)[0].is_open for stream_id in range(1, 61))

    nodes = CountingNodes(hold_first_until=all_sealed)
    manager, _ = await _cluster(store, {}, nodes=nodes)
    await manager.commit(_on_nodes_1_and_2(60))
    assert await manager.upkeep.seal_after_failure(1, 10) == 60
    for stream_id in range(1, 61):
        sealed, following = store.ranges(stream_id)
        assert not sealed.is_open and following.is_open
    told = {node_id for node_id, _, _ in nodes.synced}
    assert told == {1, 2, 3}
    assert all(1 <= calls <= 2 for calls in nodes.sync_calls.values()), nodes.sync_calls
    # and every stream's last call to a node carried its sealed range and the next
    last = {(node_id, stream_id): ranges for node_id, stream_id, ranges in nodes.synced}
    for stream_id in range(1, 61):
        for node_id in {n for rng in store.ranges(stream_id) for n in rng.nodes}:
            assert last[(node_id, stream_id)] == tuple(store.ranges(stream_id))
