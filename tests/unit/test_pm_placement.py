"""Placement: least loaded first, even spread on ties, primaries rotate; and the
liveness registry that feeds it."""

from __future__ import annotations

from collections import Counter

import pytest

from pm.liveness import NodeRegistry, NodeState
from pm.placement import NodeLoad, place, place_copies
from pm.records import NodeRecord
from sbp.errors import InvalidRequestError, NoAvailableDataNodeError


def test_least_loaded_node_first() -> None:
    nodes = [
        NodeLoad(1, active_ranges=10, append_rate=100, disk_free_space=100 << 30),
        NodeLoad(2, active_ranges=2, append_rate=10, disk_free_space=100 << 30),
        NodeLoad(3, active_ranges=5, append_rate=50, disk_free_space=100 << 30),
    ]
    assert place(nodes, 1) == (2,)
    assert set(place(nodes, 2)) == {2, 3}
    assert place(nodes, 2)[0] == 2


def test_low_free_disk_counts_as_load() -> None:
    nodes = [
        NodeLoad(1, disk_free_space=1 << 30),
        NodeLoad(2, disk_free_space=500 << 30),
    ]
    assert place(nodes, 1) == (2,)


def test_nodes_below_min_free_space_are_not_eligible() -> None:
    nodes = [NodeLoad(1, disk_free_space=10), NodeLoad(2, disk_free_space=0), NodeLoad(3)]
    assert place(nodes, 1, min_free_space=100) == (3,)
    with pytest.raises(NoAvailableDataNodeError):
        place(nodes, 2, min_free_space=100)


def test_ties_spread_by_hosted_ranges_then_node_id() -> None:
    nodes = [NodeLoad(1, hosted_ranges=4), NodeLoad(2, hosted_ranges=1), NodeLoad(3)]
    assert place(nodes, 1) == (3,)
    assert place(nodes, 2) == (3, 2)
    assert place([NodeLoad(5), NodeLoad(4)], 1) == (4,)


def test_primary_is_the_chosen_node_least_often_primary() -> None:
    nodes = [NodeLoad(1, primaries=3), NodeLoad(2, primaries=1), NodeLoad(3, primaries=2)]
    assert place(nodes, 3) == (2, 1, 3)


def test_too_few_nodes() -> None:
    with pytest.raises(NoAvailableDataNodeError, match="3 replicas wanted, 2 live"):
        place([NodeLoad(1), NodeLoad(2)], 3)
    with pytest.raises(NoAvailableDataNodeError):
        place([], 1)
    with pytest.raises(InvalidRequestError):
        place([NodeLoad(1)], 0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _registry(clock: FakeClock, count: int = 3, timeout: float = 5.0) -> NodeRegistry:
    registry = NodeRegistry(timeout, clock=clock, wall_ms=lambda: 1_700_000_000_000)
    for node_id in range(1, count + 1):
        assert registry.heartbeat(NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"))
    return registry


def _place_many(registry: NodeRegistry, count: int, replicas: int) -> list[tuple[int, ...]]:
    placed = []
    for _ in range(count):
        nodes = place(registry.loads(), replicas)
        registry.note_placed(nodes)
        registry.note_hosted(nodes)
        placed.append(nodes)
    return placed


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_repeated_placement_spreads_ranges_and_primaries_evenly(replicas: int) -> None:
    registry = _registry(FakeClock())
    placed = _place_many(registry, 300, replicas)
    assert all(len(set(nodes)) == replicas for nodes in placed)
    primaries = Counter(nodes[0] for nodes in placed)
    assert primaries == {1: 100, 2: 100, 3: 100}
    hosted = Counter(node for nodes in placed for node in nodes)
    assert hosted == {1: 100 * replicas, 2: 100 * replicas, 3: 100 * replicas}


def test_report_resets_the_placed_since_report_count() -> None:
    registry = _registry(FakeClock(), count=2)
    _place_many(registry, 4, 1)
    registry.report(NodeRecord(1, "127.0.0.1:9001"), {"range_active_cnt": 50})
    registry.report(NodeRecord(2, "127.0.0.1:9002"), {"range_active_cnt": 0})
    loads = {load.node_id: load for load in registry.loads()}
    assert loads[1].active_ranges == 50
    assert loads[2].active_ranges == 0
    # Node 2 reported itself idle: it takes the next ranges until loads even out.
    assert {nodes[0] for nodes in _place_many(registry, 10, 1)} == {2}


def test_heartbeat_registers_and_reports_changes() -> None:
    clock = FakeClock()
    registry = _registry(clock, count=1)
    assert not registry.heartbeat(NodeRecord(1, "127.0.0.1:9001"))
    assert registry.heartbeat(NodeRecord(1, "127.0.0.1:7777"))
    assert registry.address(1) == "127.0.0.1:7777"
    assert registry.address(9) == ""


def test_node_missing_heartbeats_turns_dead_and_back() -> None:
    clock = FakeClock()
    registry = _registry(clock, count=3, timeout=5.0)
    clock.now += 3
    registry.heartbeat(NodeRecord(1, "127.0.0.1:9001"))
    registry.heartbeat(NodeRecord(2, "127.0.0.1:9002"))
    clock.now += 3  # node 3 silent for 6 s > 5 s
    assert registry.is_alive(1) and not registry.is_alive(3)
    flipped = registry.sweep()
    assert [s.node_id for s in flipped] == [3]
    assert [s.alive for s in registry.states()] == [True, True, False]
    assert {load.node_id for load in registry.loads()} == {1, 2}
    assert registry.seconds_since_seen(registry.states()[2]) == pytest.approx(6.0)
    # Only two live nodes: three replicas cannot be placed.
    with pytest.raises(NoAvailableDataNodeError):
        place(registry.loads(), 3)

    registry.heartbeat(NodeRecord(3, "127.0.0.1:9003"))
    assert registry.is_alive(3)
    assert [s.node_id for s in registry.sweep()] == [3]
    assert registry.sweep() == []
    assert place(registry.loads(), 3)


def test_restored_nodes_start_alive_with_their_range_counts() -> None:
    clock = FakeClock()
    registry = NodeRegistry(5.0, clock=clock)
    registry.restore([NodeRecord(1, "a:1"), NodeRecord(2, "b:2")], {1: 7})
    assert [s.hosted_ranges for s in registry.states()] == [7, 0]
    assert registry.is_alive(1)
    clock.now += 6
    assert not registry.is_alive(1)
    registry.note_removed([1, 1, 2])
    assert [s.hosted_ranges for s in registry.states()] == [5, 0]


@pytest.mark.parametrize(
    ("free", "rate", "near", "seconds"),
    [
        (None, 0, False, None),  # not reported yet
        (50 << 20, 0, False, None),  # plenty, not writing
        (15 << 20, 0, True, None),  # under twice the 10 MiB floor
        (5 << 20, 0, False, None),  # full already: not "near"
        (1000 << 20, 1 << 20, True, 990.0),  # full in 16.5 minutes at 1 MiB/s
        (10_000 << 20, 1 << 20, False, 9990.0),  # in 2.8 hours
    ],
)
def test_a_node_near_full_is_seen_before_it_is_full(
    free: int | None, rate: int, near: bool, seconds: float | None
) -> None:
    state = NodeState(NodeRecord(1, "a:1"), last_seen=0.0)
    if free is not None:
        state.metrics = {"disk_free_space": free, "disk_in_rate": rate}
    assert state.is_near_full(10 << 20) is near
    assert state.seconds_to_full(10 << 20) == seconds


def test_copies_of_sealed_ranges_spread_by_bytes_not_by_appends() -> None:
    """A drain's ranges spread by the bytes already headed to each node:
    node 2 takes producers' appends and node 3 none, which made every range
    of a drained node go to node 3."""
    nodes = [
        NodeLoad(2, active_ranges=4, append_rate=2_000, disk_free_space=10_000),
        NodeLoad(3, active_ranges=0, append_rate=0, disk_free_space=10_200),
    ]
    incoming: dict[int, int] = {}
    chosen = []
    for _ in range(6):
        [target] = place_copies(nodes, 1, 1_000, incoming)
        incoming[target] = incoming.get(target, 0) + 1_000
        chosen.append(target)
    assert chosen == [3, 2, 3, 2, 3, 2]


def test_copies_count_against_a_node_what_its_appends_write_over_the_horizon() -> None:
    """Node 2 writes a producer's 100 bytes/s and node 3 nothing: with a
    10 s horizon, node 3 takes copies until more than 1,000 bytes are headed
    its way, and from then on they alternate, as for nodes writing the same."""
    nodes = [
        NodeLoad(2, write_rate=100, disk_free_space=100_000),
        NodeLoad(3, write_rate=0, disk_free_space=100_000),
    ]
    incoming: dict[int, int] = {}
    chosen = []
    for _ in range(8):
        [target] = place_copies(nodes, 1, 300, incoming, write_horizon_s=10.0)
        incoming[target] = incoming.get(target, 0) + 300
        chosen.append(target)
    assert chosen == [3, 3, 3, 3, 2, 3, 2, 3]
    # without a horizon (a repair, which counts ranges) the rate plays no part
    assert place_copies(nodes, 1, 0, {2: 1, 3: 2}) == (2,)


def test_a_nodes_write_rate_is_its_reported_disk_in_rate() -> None:
    state = NodeState(NodeRecord(1, "a:1"), last_seen=0.0)
    assert state.load().write_rate == 0
    state.metrics = {"disk_in_rate": 5_000_000}
    assert state.load().write_rate == 5_000_000


def test_copies_go_only_where_they_leave_room_and_as_many_as_there_are() -> None:
    nodes = [
        NodeLoad(1, disk_free_space=1_500),
        NodeLoad(2, disk_free_space=5_000),
        NodeLoad(3, disk_free_space=9_000),
        NodeLoad(4),  # not heard from yet: counts as having room
    ]
    assert place_copies(nodes, 4, 1_000, {}, min_free_space=1_000) == (3, 2, 4)
    assert place_copies(nodes, 2, 1_000, {3: 7_500}, min_free_space=1_000) == (2, 4)
    with pytest.raises(NoAvailableDataNodeError):
        place_copies(nodes[:1], 1, 1_000, {}, min_free_space=1_000)
