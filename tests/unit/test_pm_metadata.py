"""The PM's LMDB metadata store: round trips, indexes, durability across reopen."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from pm.changes import (
    DeleteMove,
    DeleteNode,
    DeleteRange,
    DeleteStream,
    MarkForeignStream,
    Metadata,
    PutMove,
    PutNode,
    PutRange,
    PutStream,
    RaiseNextStreamId,
    SetDraining,
)
from pm.metadata import FIRST_STREAM_ID, MetadataError, MetadataStore
from pm.migrate import _everything
from pm.records import MoveRecord, NodeRecord, RangeRecord, StreamRecord


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    opened = MetadataStore(tmp_path / "meta", map_size=64 << 20)
    yield opened
    opened.close()


def test_empty_store(store: MetadataStore) -> None:
    assert store.stream(1) is None
    assert store.streams(limit=10) == []
    assert store.ranges(1) == []
    assert store.last_range(1) is None
    assert store.nodes() == []
    assert store.next_stream_id() == FIRST_STREAM_ID
    assert store.foreign_streams() == frozenset()
    counts = store.counts()
    assert (counts.streams, counts.ranges, counts.nodes) == (0, 0, 0)


def test_stream_and_range_round_trip(store: MetadataStore) -> None:
    stream = StreamRecord(7, replica_nums=3, retention_period_ms=86_400_000, epoch=2)
    sealed = RangeRecord(7, 0, start_offset=0, nodes=(3, 1, 2), end_offset=100, epoch=2)
    open_ = RangeRecord(7, 1, start_offset=100, nodes=(2, 3, 1), epoch=2)
    store.apply([PutStream(stream), PutRange(sealed), PutRange(open_)])

    assert store.stream(7) == stream
    assert store.ranges(7) == [sealed, open_]
    assert store.range(7, 0) == sealed
    assert store.range(7, 2) is None
    assert store.last_range(7) == open_
    assert open_.is_open and not sealed.is_open
    assert open_.primary == 2


def test_last_range_does_not_cross_streams(store: MetadataStore) -> None:
    store.apply(
        [
            PutRange(RangeRecord(1, 0, 0, (1,), 10)),
            PutRange(RangeRecord(1, 1, 10, (1,))),
            PutRange(RangeRecord(3, 0, 0, (1,))),
        ]
    )
    assert store.last_range(1) == RangeRecord(1, 1, 10, (1,))
    assert store.last_range(2) is None
    assert store.last_range(3) == RangeRecord(3, 0, 0, (1,))
    assert store.last_range(4) is None


def test_paged_stream_listing(store: MetadataStore) -> None:
    store.apply([PutStream(StreamRecord(i, 1)) for i in range(1, 26)])
    first = store.streams(limit=10)
    assert [s.stream_id for s in first] == list(range(1, 11))
    second = store.streams(start_after=10, limit=10)
    assert [s.stream_id for s in second] == list(range(11, 21))
    last = store.streams(start_after=20, limit=10)
    assert [s.stream_id for s in last] == list(range(21, 26))
    assert store.streams(start_after=25, limit=10) == []
    assert store.streams(limit=0) == []


def test_ranges_by_node_index_follows_puts_and_deletes(store: MetadataStore) -> None:
    a = RangeRecord(1, 0, 0, (1, 2), 50)
    b = RangeRecord(1, 1, 50, (2, 3))
    c = RangeRecord(2, 0, 0, (3,))
    store.apply([PutStream(StreamRecord(1, 2)), PutStream(StreamRecord(2, 1))])
    store.apply([PutRange(a), PutRange(b), PutRange(c)])
    assert store.ranges_on_node(1) == [a]
    assert store.ranges_on_node(2) == [a, b]
    assert store.ranges_on_node(3) == [b, c]
    assert store.range_counts_by_node() == {1: 1, 2: 2, 3: 2}

    # Re-placing a range moves its index entries.
    moved = RangeRecord(1, 1, 50, (3, 4))
    store.apply([PutRange(moved)])
    assert store.ranges_on_node(2) == [a]
    assert store.ranges_on_node(4) == [moved]

    store.apply([DeleteRange(1, 0)])
    assert store.ranges_on_node(1) == []
    assert store.ranges(1) == [moved]

    store.apply([DeleteStream(1)])
    assert store.stream(1) is None
    assert store.ranges(1) == []
    assert store.ranges_on_node(3) == [c]
    assert store.range_counts_by_node() == {3: 1}
    assert store.counts().ranges == 1


def test_next_stream_id_only_rises(store: MetadataStore) -> None:
    store.apply([RaiseNextStreamId(1001)])
    assert store.next_stream_id() == 1001
    store.apply([RaiseNextStreamId(500)])
    assert store.next_stream_id() == 1001


def test_nodes(store: MetadataStore) -> None:
    store.apply([PutNode(NodeRecord(2, "127.0.0.1:9002")), PutNode(NodeRecord(1, "h:1"))])
    store.apply([PutNode(NodeRecord(2, "127.0.0.1:9999"))])
    assert store.nodes() == [NodeRecord(1, "h:1"), NodeRecord(2, "127.0.0.1:9999")]
    assert store.counts().nodes == 2


async def check_draining_store(store: Metadata) -> None:
    """Draining marks (SPEC §12) follow their changes, and forgetting a node
    forgets its mark; either store."""
    await store.commit([PutNode(NodeRecord(1, "h:1")), PutNode(NodeRecord(2, "h:2"))])
    await store.commit([SetDraining(1, True), SetDraining(2, True)])
    assert store.draining_nodes() == {1, 2}
    await store.commit([SetDraining(2, False), SetDraining(2, False)])
    assert store.draining_nodes() == {1}
    await store.commit([DeleteNode(1)])
    assert store.draining_nodes() == set()
    assert store.nodes() == [NodeRecord(2, "h:2")]
    await store.commit([SetDraining(2, True)])
    # a rebalance's moves: kept until done, and gone with their range or stream
    await store.commit([PutStream(StreamRecord(7, 1)), PutRange(RangeRecord(7, 0, 0, (2,), 10))])
    await store.commit([PutRange(RangeRecord(7, 1, 10, (2,), 20))])
    await store.commit([PutMove(MoveRecord(7, 0, 2, (3,))), PutMove(MoveRecord(7, 1, 2, (4,)))])
    assert store.moves() == [MoveRecord(7, 0, 2, (3,)), MoveRecord(7, 1, 2, (4,))]
    await store.commit([DeleteMove(7, 0)])
    assert store.moves() == [MoveRecord(7, 1, 2, (4,))]
    await store.commit([DeleteRange(7, 1), PutMove(MoveRecord(7, 0, 2, (3,)))])
    assert store.moves() == [MoveRecord(7, 0, 2, (3,))]
    await store.commit([DeleteStream(7)])
    assert store.moves() == []
    await store.commit([PutMove(MoveRecord(8, 0, 1, (2,)))])


async def test_draining_marks(tmp_path: Path) -> None:
    path = tmp_path / "meta"
    first = MetadataStore(path, map_size=64 << 20)
    await check_draining_store(first)
    first.close()
    again = MetadataStore(path, map_size=64 << 20)
    assert again.draining_nodes() == {2}
    assert again.moves() == [MoveRecord(8, 0, 1, (2,))]
    again.close()


def test_everything_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "meta"
    first = MetadataStore(path, map_size=64 << 20)
    first.apply(
        [
            PutStream(StreamRecord(1, 2)),
            PutRange(RangeRecord(1, 0, 0, (1, 2))),
            PutNode(NodeRecord(1, "a:1")),
            RaiseNextStreamId(2),
        ]
    )
    first.close()
    again = MetadataStore(path, map_size=64 << 20)
    try:
        assert again.stream(1) == StreamRecord(1, 2)
        assert again.ranges_on_node(2) == [RangeRecord(1, 0, 0, (1, 2))]
        assert again.nodes() == [NodeRecord(1, "a:1")]
        assert again.next_stream_id() == 2
    finally:
        again.close()


def test_foreign_streams_are_kept_and_migrated(store: MetadataStore) -> None:
    store.apply([MarkForeignStream(7), MarkForeignStream(3), MarkForeignStream(7)])
    assert store.foreign_streams() == {3, 7}
    moved = _everything(store)
    assert [c for c in moved if isinstance(c, MarkForeignStream)] == [
        MarkForeignStream(3),
        MarkForeignStream(7),
    ]


async def test_commit_runs_one_transaction_off_the_loop(store: MetadataStore) -> None:
    await store.commit([PutStream(StreamRecord(i, 1)) for i in range(1, 1001)])
    assert store.counts().streams == 1000
    await store.commit([])
    assert store.counts().streams == 1000


def _stream_with_range(stream_id: int, node_id: int = 1) -> list[PutStream | PutRange]:
    return [
        PutStream(StreamRecord(stream_id, 1)),
        PutRange(RangeRecord(stream_id, 0, 0, (node_id,))),
    ]


async def test_commits_made_meanwhile_share_one_transaction(store: MetadataStore) -> None:
    """50 commits at once are written together (or the first alone, if
    its thread starts before the others queue): one sync for all of them."""
    before = store._env.info()["last_txnid"]
    async with trio.open_nursery() as nursery:
        for stream_id in range(1, 51):
            nursery.start_soon(store.commit, _stream_with_range(stream_id))
    assert store.counts().streams == 50
    assert [rng.stream_id for rng in store.ranges_on_node(1)] == list(range(1, 51))
    assert store._env.info()["last_txnid"] - before <= 2


async def test_a_commit_that_fails_in_a_shared_transaction_fails_alone(
    store: MetadataStore,
) -> None:
    """A node id no range value can hold fails its commit; the others
    waiting with it are written all the same."""
    failed: list[int] = []

    async def commit(stream_id: int, node_id: int) -> None:
        try:
            await store.commit(_stream_with_range(stream_id, node_id))
        except struct.error:
            failed.append(stream_id)

    async with trio.open_nursery() as nursery:
        for stream_id in range(1, 21):
            nursery.start_soon(commit, stream_id, 1 << 40 if stream_id == 7 else 1)
    assert failed == [7]
    assert store.stream(7) is None
    assert [s.stream_id for s in store.streams(limit=100)] == [i for i in range(1, 21) if i != 7]


def test_unusable_directory_is_a_clear_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(MetadataError, match="cannot open metadata"):
        MetadataStore(not_a_dir)
