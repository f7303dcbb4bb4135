"""The PM's side of tiered storage (SPEC §14): ranges go 0 -> 1 -> 2, a copy
is recorded once, objects are deleted after the metadata stops naming them,
and a sweep deletes what no range names."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pm.changes import DeleteRange, DeleteStream, PutRange, PutStream
from pm.liveness import NodeRegistry
from pm.metadata import MetadataStore
from pm.range_log import RangeLog
from pm.range_sizes import RangeSizes
from pm.records import Holding, NodeRecord, Outcome, RangeRecord, StreamRecord
from pm.rolling import roll_if_full
from pm.stored_values import encode_range, range_from_value
from pm.tiering import Tiering, serving_nodes
from sbp.batches import build_batch, stamp_base_offset
from sbp.enums import ObjectState
from tiering import layout
from tiering.layout import RangeTrailer
from tiering.memory import MemoryObjectStore

STREAM = 1


def range_object(rng: RangeRecord, last_append_ms: int) -> bytes:
    """What a data node uploads for ``rng``: its batches, index and trailer."""
    data = bytearray()
    for offset in range(rng.start_offset, rng.end_offset, 10):
        batch = build_batch([b"r"] * min(10, rng.end_offset - offset), 0)
        stamp_base_offset(batch, offset)
        data += batch
    return layout.whole_object(
        rng.stream_id, rng.range_index, rng.epoch, rng.end_offset, data, last_append_ms
    )


class Nodes:
    """Data nodes that upload what they are asked to, as the real ones do."""

    def __init__(self, objects: MemoryObjectStore, clock: Clock) -> None:
        self.objects = objects
        self.clock = clock
        self.uploads: list[tuple[int, tuple[int, int]]] = []
        self.open_size = 0

    async def upload_range(self, node_id: int, rng: RangeRecord) -> None:
        self.uploads.append((node_id, rng.key))
        key = layout.object_key(rng.stream_id, rng.range_index, rng.epoch)
        self.objects.objects.setdefault(key, range_object(rng, self.clock.now_ms - 1000))

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        return {key: Holding(0, self.open_size) for key in keys}


class Clock:
    def __init__(self) -> None:
        self.now_ms = 10_000_000

    def __call__(self) -> int:
        return self.now_ms


class Harness:
    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self.clock = Clock()
        self.objects = MemoryObjectStore()
        self.nodes = Nodes(self.objects, self.clock)
        self.registry = NodeRegistry(5.0)
        for node_id in (1, 2, 3):
            self.registry.heartbeat(NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"))
        self.log = RangeLog(store)
        self.synced: list[tuple[list[int], list[int]]] = []
        self.trims: list[tuple[int, int]] = []
        self.sealed: list[tuple[int, int]] = []
        self.tiering = Tiering(
            store,
            self.registry,
            self.nodes,
            self.objects,
            self.log.commit,
            self.hold,
            self.sync,
            self.trim,
            self.seal,
            RangeSizes(self.registry, self.nodes),
            wall_ms=self.clock,
        )
        self.log.observe(self.tiering)

    def hold(self, stream_id: int) -> Any:
        return _NoLock()

    async def sync(self, stream_ids: Iterable[int], deadline: float, also: Iterable[int] = ()):
        self.synced.append((list(stream_ids), list(also)))

    async def trim(
        self, trims: Sequence[tuple[int, int]], timeout: float
    ) -> list[Outcome[tuple[StreamRecord, RangeRecord]]]:
        changes: list[Any] = []
        for stream_id, offset in trims:
            self.trims.append((stream_id, offset))
            for rng in self.store.ranges(stream_id):
                if not rng.is_open and rng.end_offset <= offset:
                    changes.append(DeleteRange(stream_id, rng.range_index))
        await self.log.commit(changes)
        return [Outcome() for _ in trims]

    async def seal(self, stream_id: int, range_index: int) -> None:
        self.sealed.append((stream_id, range_index))

    async def stream(self, sealed: int, **settings: Any) -> None:
        """A stream with ``sealed`` sealed ranges of 100 records on nodes 1
        and 2, and an open one."""
        changes: list[Any] = [PutStream(StreamRecord(STREAM, 2, **settings))]
        for index in range(sealed + 1):
            end = (index + 1) * 100 if index < sealed else -1
            changes.append(PutRange(RangeRecord(STREAM, index, index * 100, (1, 2), end)))
        await self.log.commit(changes)


class _NoLock:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    store = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    try:
        yield Harness(store)
    finally:
        store.close()


def states(store: MetadataStore) -> list[tuple[int, tuple[int, ...]]]:
    return [(r.object_state, r.nodes) for r in store.ranges(STREAM)]


async def test_a_sealed_range_is_copied_checked_and_recorded_once(harness: Harness) -> None:
    await harness.stream(2, local_retention_ms=60_000)
    assert await harness.tiering.copy(STREAM, 0)
    rng = harness.store.range(STREAM, 0)
    assert rng is not None and rng.object_state == ObjectState.IN_STORE_TOO
    assert rng.last_append_ms == harness.clock.now_ms - 1000
    whole = range_object(rng, 0)
    assert rng.object_bytes == RangeTrailer.decode(whole).data_bytes  # its batches' bytes
    assert harness.nodes.uploads == [(1, (STREAM, 0))]  # the first live replica
    # asked again (a PM that restarted mid-way): not recorded twice
    assert not await harness.tiering.copy(STREAM, 0)
    assert states(harness.store)[0] == (ObjectState.IN_STORE_TOO, (1, 2))
    assert harness.tiering.pending_copies() == 1  # range 1; the open range never


async def test_a_copy_that_is_not_whole_is_not_recorded(harness: Harness) -> None:
    await harness.stream(1, local_retention_ms=0)
    key = layout.object_key(STREAM, 0, 0)
    harness.objects.objects[key] = b"half an object"
    with pytest.raises(Exception, match="not a whole copy"):
        await harness.tiering.copy(STREAM, 0)
    assert states(harness.store)[0][0] == ObjectState.ON_NODES


async def test_a_copied_range_leaves_the_nodes_once_older_than_local_retention(
    harness: Harness,
) -> None:
    await harness.stream(1, local_retention_ms=5000)
    await harness.tiering.copy(STREAM, 0)
    assert not await harness.tiering.offload(STREAM, 0)  # appended 1 s ago: stays
    harness.clock.now_ms += 4000
    assert await harness.tiering.offload(STREAM, 0)
    assert states(harness.store)[0] == (ObjectState.IN_STORE_ONLY, ())
    # the old replicas are told, and drop their copies
    assert harness.synced == [([STREAM], [1, 2])]


async def test_nothing_leaves_the_nodes_before_it_is_in_the_store(harness: Harness) -> None:
    await harness.stream(1, local_retention_ms=0)
    harness.clock.now_ms += 10**9
    assert not await harness.tiering.offload(STREAM, 0)
    assert states(harness.store)[0] == (ObjectState.ON_NODES, (1, 2))


async def test_objects_go_with_their_stream_after_the_commit(harness: Harness) -> None:
    await harness.stream(2, local_retention_ms=0)
    await harness.tiering.copy(STREAM, 0)
    await harness.tiering.copy(STREAM, 1)
    assert len(harness.objects.objects) == 2
    await harness.log.commit([DeleteStream(STREAM)])
    await harness.tiering._delete_removed()
    assert harness.objects.objects == {}
    assert harness.tiering.deleted_objects == 2


async def test_a_delete_the_store_misses_is_tried_again(harness: Harness) -> None:
    await harness.stream(1, local_retention_ms=0)
    await harness.tiering.copy(STREAM, 0)
    await harness.log.commit([DeleteStream(STREAM)])
    harness.objects.down = True
    await harness.tiering._delete_removed()
    assert len(harness.objects.objects) == 1
    harness.objects.down = False
    await harness.tiering._delete_removed()
    assert harness.objects.objects == {}


async def test_the_sweep_deletes_objects_no_range_names(harness: Harness) -> None:
    await harness.stream(2, local_retention_ms=0)
    await harness.tiering.copy(STREAM, 0)
    named = layout.object_key(STREAM, 0, 0)
    uploading = layout.object_key(STREAM, 1, 0)  # state 0, its copy not yet recorded
    orphans = [layout.object_key(STREAM, 7, 0), layout.object_key(99, 0, 0)]
    other_epoch = layout.object_key(STREAM, 0, 5)
    for key in [uploading, *orphans, other_epoch]:
        harness.objects.objects[key] = b"x"
    assert await harness.tiering.sweep() == 3
    assert sorted(harness.objects.objects) == sorted([named, uploading])


async def test_switching_a_stream_to_tiered_copies_its_sealed_ranges(harness: Harness) -> None:
    await harness.stream(3)
    assert harness.tiering.pending_copies() == 0
    stream = harness.store.stream(STREAM)
    assert stream is not None
    await harness.log.commit([PutStream(replace(stream, local_retention_ms=0))])
    assert harness.tiering.pending_copies() == 3


async def test_ranges_in_the_store_only_expire_with_the_stream_s_retention(
    harness: Harness,
) -> None:
    await harness.stream(3, local_retention_ms=0, retention_period_ms=60_000)
    for index in range(3):
        await harness.tiering.copy(STREAM, index)
        await harness.tiering.offload(STREAM, index)
    await harness.tiering._expire_due()
    assert harness.trims == []
    harness.clock.now_ms += 60_000
    await harness.tiering._expire_due()
    assert harness.trims == [(STREAM, 300)]
    await harness.tiering._delete_removed()
    assert harness.objects.objects == {}


async def test_a_tiered_stream_s_open_range_rolls_at_the_roll_size(harness: Harness) -> None:
    await harness.stream(0, local_retention_ms=0)
    harness.nodes.open_size = 99
    assert not await roll_if_full(harness.store, harness.nodes, harness.seal, STREAM, 100)
    harness.nodes.open_size = 100
    assert await roll_if_full(harness.store, harness.nodes, harness.seal, STREAM, 100)
    assert harness.sealed == [(STREAM, 0)]


def test_a_range_in_the_store_is_served_by_the_same_live_nodes() -> None:
    rng = RangeRecord(STREAM, 4, 0, (), 100, object_state=ObjectState.IN_STORE_ONLY)
    live = [1, 2, 3, 4]
    chosen = serving_nodes(rng, live)
    assert len(chosen) == 2 and set(chosen) <= set(live)
    assert serving_nodes(rng, live) == chosen
    spread = {serving_nodes(RangeRecord(STREAM, i, 0, (), 1), live) for i in range(20)}
    assert len(spread) == 4
    assert serving_nodes(rng, [3]) == (3,)
    assert serving_nodes(rng, []) == ()


def test_a_copied_range_round_trips_through_the_metadata_encoding() -> None:
    rng = RangeRecord(STREAM, 3, 0, (), 100, 2, 0, ObjectState.IN_STORE_ONLY, 123, 4567)
    assert range_from_value(STREAM, 3, encode_range(rng)) == rng
    plain = RangeRecord(STREAM, 3, 0, (1, 2), 100, 2, 3)
    assert range_from_value(STREAM, 3, encode_range(plain)) == plain


async def test_a_stream_no_longer_tiered_is_not_copied(harness: Harness) -> None:
    await harness.stream(2, local_retention_ms=0)
    stream = harness.store.stream(STREAM)
    assert stream is not None
    await harness.log.commit([PutStream(replace(stream, local_retention_ms=-1))])
    assert not await harness.tiering.copy(STREAM, 0)
    assert harness.nodes.uploads == [] and harness.tiering.pending_copies() == 1
    assert states(harness.store)[0] == (ObjectState.ON_NODES, (1, 2))
