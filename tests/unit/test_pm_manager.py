"""The PM's request logic over records, with the data nodes faked in memory."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import trio

from pm.liveness import NodeRegistry
from pm.manager import PlacementManager
from pm.metadata import MetadataStore
from pm.records import Holding, NodeRecord, RangeRecord, StreamRecord
from sbp.enums import ErrorCode
from sbp.errors import DataNodeNotFoundError, InvalidRequestError, StreamNotFoundError


class FakeDataNodes:
    """Records what the PM tells the data nodes; answers seals with the
    offsets set in ``next_offsets`` (0 by default)."""

    def __init__(self) -> None:
        self.synced: list[tuple[int, int, tuple[RangeRecord, ...]]] = []
        self.deleted: list[tuple[int, tuple[int, ...]]] = []
        self.sealed: list[RangeRecord] = []
        self.next_offsets: dict[int, int] = {}
        #: a replica's own answer to a seal, by (stream id, node id)
        self.replica_offsets: dict[tuple[int, int], int] = {}
        self.seal_delay = 0.0
        self.unreachable: set[int] = set()
        self.unreachable_addresses: set[str] = set()
        #: what each node lists as its own ranges (LIST_RANGES by data node)
        self.hosted: dict[int, list[RangeRecord]] = {}
        #: when each listing was asked for (trio time), and how many more fail
        self.listed_at: list[float] = []
        self.listings_failing = 0
        #: record timestamps by (stream id, offset), and how often each was read
        self.record_times: dict[tuple[int, int], int] = {}
        self.times_read: list[tuple[int, int, int]] = []

    async def sync_ranges(
        self, node_id: int, streams: Sequence[tuple[int, Sequence[RangeRecord]]]
    ) -> None:
        if node_id in self.unreachable:
            await trio.sleep_forever()
        for stream_id, ranges in streams:
            self.synced.append((node_id, stream_id, tuple(ranges)))

    async def seal_replica(self, rng: RangeRecord, node_id: int) -> int:
        if node_id in self.unreachable:
            await trio.sleep_forever()
        await trio.sleep(self.seal_delay)
        if node_id == rng.primary:
            self.sealed.append(rng)
        default = self.next_offsets.get(rng.stream_id, 0)
        return self.replica_offsets.get((rng.stream_id, node_id), default)

    async def next_offset(self, rng: RangeRecord) -> int:
        return self.next_offsets.get(rng.stream_id, 0)

    async def ends_of_open_ranges(
        self, node_id: int, ranges: Sequence[RangeRecord]
    ) -> dict[int, int]:
        if node_id in self.unreachable:
            raise OSError("connection refused")
        return {r.stream_id: self.next_offsets.get(r.stream_id, 0) for r in ranges}

    async def record_timestamp(self, node_id: int, stream_id: int, offset: int) -> int | None:
        if node_id in self.unreachable:
            raise OSError("connection refused")
        self.times_read.append((node_id, stream_id, offset))
        return self.record_times.get((stream_id, offset))

    async def delete_streams(self, node_id: int, stream_ids: Sequence[int]) -> None:
        self.deleted.append((node_id, tuple(stream_ids)))

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        return {}

    async def reachable(self, address: str) -> bool:
        return address not in self.unreachable_addresses

    async def hosted_ranges(self, node_id: int) -> list[RangeRecord]:
        self.listed_at.append(trio.current_time())
        if self.listings_failing:
            self.listings_failing -= 1
            raise OSError("connection refused")
        return list(self.hosted.get(node_id, []))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    opened = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    yield opened
    opened.close()


def _manager(store: MetadataStore, nodes: FakeDataNodes, count: int = 3) -> PlacementManager:
    registry = NodeRegistry(5.0)
    manager = PlacementManager(store, registry, nodes)
    for node_id in range(1, count + 1):
        registry.heartbeat(NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"))
    return manager


async def test_create_assigns_ids_places_and_syncs(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes)
    results = await manager.create_streams(
        [StreamRecord(0, 1), StreamRecord(0, 3, 60_000), StreamRecord(0, 4), StreamRecord(0, 0)],
        timeout=5,
    )
    assert [r.error.code if r.error else None for r in results] == [
        None,
        None,
        ErrorCode.NO_AVAILABLE_DATA_NODE,
        ErrorCode.INVALID_REQUEST,
    ]
    (s1, r1), (s2, r2) = results[0].value, results[1].value  # type: ignore[misc]
    assert (s1.stream_id, s2.stream_id) == (1, 2)
    assert s2 == StreamRecord(2, 3, 60_000, 0)
    assert r1 == RangeRecord(1, 0, 0, r1.nodes)
    assert len(r1.nodes) == 1 and sorted(r2.nodes) == [1, 2, 3]
    assert store.stream(2) == s2 and store.ranges(2) == [r2]
    assert store.next_stream_id() == 3
    assert sorted((n, sid) for n, sid, _ in nodes.synced) == sorted(
        [(r1.primary, 1), (1, 2), (2, 2), (3, 2)]
    )


async def test_a_thousand_streams_in_one_call(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes)
    results = await manager.create_streams([StreamRecord(0, 2)] * 1000, timeout=10)
    assert all(r.error is None for r in results)
    assert store.counts().streams == 1000
    assert [s.hosted_ranges for s in manager.cluster()] == [667, 667, 666]


async def test_seal_and_new_then_idempotent_retry(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes)
    [created] = await manager.create_streams([StreamRecord(0, 2)], timeout=5)
    stream, first = created.value  # type: ignore[misc]
    nodes.next_offsets[stream.stream_id] = 42
    [sealed] = await manager.seal_ranges([(stream.stream_id, 0)], timeout=5)
    old, new = sealed.value  # type: ignore[misc]
    assert old == RangeRecord(stream.stream_id, 0, 0, first.nodes, 42)
    assert (new.range_index, new.start_offset, new.is_open) == (1, 42, True)
    assert nodes.sealed == [first]
    # The stream's whole range list goes to every node that hosts any of it.
    hosts = {n for r in (old, new) for n in r.nodes}
    assert {(n, rs) for n, _, rs in nodes.synced[-len(hosts) :]} == {(n, (old, new)) for n in hosts}

    [again] = await manager.seal_ranges([(stream.stream_id, 0)], timeout=5)
    assert again.value == [old, new]
    assert len(nodes.sealed) == 1


@pytest.mark.parametrize(("acks", "end"), [(1, 10), (2, 7), (3, 4), (0, 7)])
async def test_a_replicated_seal_ends_by_the_rule_of_r_minus_a(
    store: MetadataStore, acks: int, end: int
) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes)
    [created] = await manager.create_streams([StreamRecord(0, 3, ack_nums=acks)], timeout=5)
    stream, first = created.value  # type: ignore[misc]
    for node_id, offset in zip(first.nodes, (10, 7, 4), strict=True):
        nodes.replica_offsets[(stream.stream_id, node_id)] = offset
    [sealed] = await manager.seal_ranges([(stream.stream_id, 0)], timeout=5)
    old, new = sealed.value  # type: ignore[misc]
    assert (old.end_offset, new.start_offset) == (end, end)
    assert manager.seals["request"] == 1


async def test_a_seal_goes_on_without_a_silent_replica_when_enough_answer(
    store: MetadataStore,
) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=4)
    created, strict = await manager.create_streams(
        [StreamRecord(0, 3, ack_nums=2), StreamRecord(0, 3, ack_nums=1)], timeout=5
    )
    stream, first = created.value  # type: ignore[misc]
    primary, *followers = first.nodes
    nodes.unreachable.add(primary)
    nodes.unreachable.add(strict.value[1].primary)  # type: ignore[index]
    for node_id, offset in zip(followers, (5, 3), strict=True):
        nodes.replica_offsets[(stream.stream_id, node_id)] = offset
    sealed, refused = await manager.seal_ranges(
        [(stream.stream_id, 0), (strict.value[0].stream_id, 0)],  # type: ignore[index]
        timeout=1,
    )
    old, _new = sealed.value  # type: ignore[misc]
    assert old.end_offset == 5  # index R - A = 1 of the answers [3, 5]
    # With A = 1 a record may live on one replica only: every replica must
    # answer, and one silent replica stops the seal.
    assert refused.error is not None and refused.error.code == ErrorCode.TIMEOUT


async def test_ack_nums_are_checked_and_kept(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes)
    results = await manager.create_streams(
        [StreamRecord(0, 2, ack_nums=3), StreamRecord(0, 3, ack_nums=3)], timeout=5
    )
    assert results[0].error is not None and results[0].error.code == ErrorCode.INVALID_REQUEST
    stream = results[1].value[0]  # type: ignore[index]
    assert store.stream(stream.stream_id) == stream and stream.ack_nums == 3
    # replica_nums below the kept ack_nums is refused; both together are taken
    [refused] = await manager.update_streams([StreamRecord(stream.stream_id, 2)], timeout=5)
    assert refused.error is not None and "ack_nums" in refused.error.message
    [taken] = await manager.update_streams(
        [StreamRecord(stream.stream_id, 2, ack_nums=1)], timeout=5
    )
    assert taken.value == StreamRecord(stream.stream_id, 2, 0, 0, 1)


async def test_racing_seals_produce_one_next_range(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    nodes.seal_delay = 0.05
    manager = _manager(store, nodes)
    [created] = await manager.create_streams([StreamRecord(0, 1)], timeout=5)
    stream_id = created.value[0].stream_id  # type: ignore[index]
    outcomes = []

    async def seal() -> None:
        outcomes.extend(await manager.seal_ranges([(stream_id, 0)], timeout=5))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(seal)
    assert len(nodes.sealed) == 1
    assert len(store.ranges(stream_id)) == 2
    assert all(o.value == store.ranges(stream_id) for o in outcomes)


async def test_seal_errors_are_per_item(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=1)
    await manager.create_streams([StreamRecord(0, 1)], timeout=5)
    results = await manager.seal_ranges([(99, 0), (1, 5), (1, 0)], timeout=5)
    assert results[0].error is not None and results[0].error.code == ErrorCode.STREAM_NOT_FOUND
    assert results[1].error is not None and results[1].error.code == ErrorCode.RANGE_NOT_FOUND
    assert results[2].error is None


async def test_seal_times_out_when_the_primary_does_not_answer(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=1)
    await manager.create_streams([StreamRecord(0, 1)], timeout=5)
    nodes.unreachable.add(1)
    [result] = await manager.seal_ranges([(1, 0)], timeout=0.2)
    assert result.error is not None and result.error.code == ErrorCode.TIMEOUT
    assert store.range(1, 0) == RangeRecord(1, 0, 0, (1,))  # still open, nothing half done


async def test_trim_drops_ranges_below_and_raises_the_first_start(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes, count=2)
    await manager.create_streams([StreamRecord(0, 1)], timeout=5)
    for end in (10, 20):
        nodes.next_offsets[1] = end
        rng = store.last_range(1)
        assert rng is not None
        await manager.seal_ranges([(1, rng.range_index)], timeout=5)
    nodes.next_offsets[1] = 25
    assert [(r.start_offset, r.end_offset) for r in store.ranges(1)] == [
        (0, 10),
        (10, 20),
        (20, -1),
    ]

    [trimmed] = await manager.trim_streams([(1, 15)], timeout=5)
    stream, first = trimmed.value  # type: ignore[misc]
    assert stream.stream_id == 1
    assert (first.range_index, first.start_offset, first.end_offset) == (1, 15, 20)
    assert [r.range_index for r in store.ranges(1)] == [1, 2]
    [into_open] = await manager.trim_streams([(1, 22)], timeout=5)
    assert into_open.value[1] == RangeRecord(1, 2, 22, store.ranges(1)[0].nodes)  # type: ignore[index]
    results = await manager.trim_streams([(1, 26), (1, 3), (7, 1), (1, -1)], timeout=5)
    assert [r.error.code if r.error else None for r in results] == [
        ErrorCode.OFFSET_OUT_OF_RANGE,
        None,
        ErrorCode.STREAM_NOT_FOUND,
        ErrorCode.INVALID_REQUEST,
    ]
    assert results[1].value[1].start_offset == 22  # type: ignore[index]
    assert sum(s.hosted_ranges for s in manager.cluster()) == 1


async def test_delete_removes_everything_and_tells_each_host_once(store: MetadataStore) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes)
    await manager.create_streams([StreamRecord(0, 3), StreamRecord(0, 1)], timeout=5)
    results = await manager.delete_streams([1, 2, 3], timeout=5)
    assert [r.value.stream_id if r.value else None for r in results] == [1, 2, None]
    assert results[2].error is not None and results[2].error.code == ErrorCode.STREAM_NOT_FOUND
    assert store.counts().streams == 0 and store.counts().ranges == 0
    told = {(node, sid) for node, ids in nodes.deleted for sid in ids}
    assert {sid for _, sid in told} == {1, 2}
    assert len([t for t in told if t[1] == 1]) == 3
    assert sum(s.hosted_ranges for s in manager.cluster()) == 0


async def test_update_and_get_streams(store: MetadataStore) -> None:
    manager = _manager(store, FakeDataNodes())
    await manager.create_streams([StreamRecord(0, 1, 1000)], timeout=5)
    results = await manager.update_streams(
        [StreamRecord(1, 0, -1, 3), StreamRecord(1, 2, 0, 1), StreamRecord(5, 1)], timeout=5
    )
    assert results[0].value == StreamRecord(1, 1, 1000, 3)
    assert results[1].error is not None and results[1].error.code == ErrorCode.EPOCH_FENCED
    assert results[2].error is not None and results[2].error.code == ErrorCode.STREAM_NOT_FOUND
    [got, missing] = manager.get_streams([1, 2])
    assert got.value == StreamRecord(1, 1, 1000, 3)
    assert missing.error is not None and missing.error.code == ErrorCode.STREAM_NOT_FOUND


async def test_listing_and_lookups(store: MetadataStore) -> None:
    manager = _manager(store, FakeDataNodes(), count=2)
    await manager.create_streams([StreamRecord(0, 1)] * 5, timeout=5)
    assert [s.stream_id for s in manager.list_streams(0, 2)] == [1, 2]
    assert [s.stream_id for s in manager.list_streams(2, 0)] == [3, 4, 5]
    on_1 = manager.node_ranges(1)
    on_2 = manager.node_ranges(2)
    assert sorted(r.stream_id for r in on_1 + on_2) == [1, 2, 3, 4, 5]
    assert manager.stream_ranges(3) == store.ranges(3)
    with pytest.raises(StreamNotFoundError):
        manager.stream_ranges(9)
    with pytest.raises(DataNodeNotFoundError):
        manager.node_ranges(9)
    described = manager.describe_ranges([(1, 0), (1, 1), (9, 0)])
    assert described[0].value == store.range(1, 0)
    assert [d.error.code if d.error else None for d in described] == [
        None,
        ErrorCode.RANGE_NOT_FOUND,
        ErrorCode.STREAM_NOT_FOUND,
    ]


async def test_nodes_persist_and_restart_resumes_ids(tmp_path: Path) -> None:
    path = tmp_path / "pm"
    first_store = MetadataStore(path, map_size=64 << 20)
    first = PlacementManager(first_store, NodeRegistry(5.0), FakeDataNodes())
    await first.heartbeat(NodeRecord(4, "127.0.0.1:9004"))
    await first.create_streams([StreamRecord(0, 1)] * 3, timeout=5)
    first_store.close()

    again_store = MetadataStore(path, map_size=64 << 20)
    try:
        again = PlacementManager(again_store, NodeRegistry(5.0), FakeDataNodes())
        assert [(s.node_id, s.alive, s.hosted_ranges) for s in again.cluster()] == [(4, True, 3)]
        [created] = await again.create_streams([StreamRecord(0, 1)], timeout=5)
        assert created.value is not None and created.value[0].stream_id == 4
    finally:
        again_store.close()


async def test_a_node_is_registered_only_if_its_address_answers_ping(
    store: MetadataStore,
) -> None:
    nodes = FakeDataNodes()
    manager = _manager(store, nodes)
    nodes.unreachable_addresses.add("10.9.9.9:7401")
    with pytest.raises(InvalidRequestError, match=r"10\.9\.9\.9:7401, which does not answer PING"):
        await manager.heartbeat(NodeRecord(9, "10.9.9.9:7401"))
    with pytest.raises(InvalidRequestError, match="does not answer PING"):
        await manager.report_metrics(NodeRecord(9, "10.9.9.9:7401"), {"disk_free_space": 1})
    assert manager.registry.get(9) is None and 9 not in {n.node_id for n in store.nodes()}
    # No range goes there: three real nodes, three replicas wanted at most.
    results = await manager.create_streams([StreamRecord(0, 3)] * 5, timeout=5)
    assert all(9 not in r.value[1].nodes for r in results if r.value is not None)
    # A known node moving to an address that does not answer is refused too,
    # and keeps its old one.
    nodes.unreachable_addresses.add("10.9.9.9:7402")
    with pytest.raises(InvalidRequestError):
        await manager.heartbeat(NodeRecord(1, "10.9.9.9:7402"))
    state = manager.registry.get(1)
    assert state is not None and state.node.address == "127.0.0.1:9001"
    await manager.heartbeat(NodeRecord(9, "127.0.0.1:9009"))  # answers: registered
    assert manager.registry.get(9) is not None
