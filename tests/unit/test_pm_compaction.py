"""The PM's compaction passes (pm.compaction): which sealed ranges a pass
asks for keys and rewrites, with nodes that keep their records in memory:
the young ranges wait for min_compaction_lag_ms, a stream with more keys
than the map holds is compacted a prefix per pass, tombstones go once
delete_retention_ms has passed since their range was first compacted, a
failed replica keeps the clean end where it was, and a full open range is
sealed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from pm.changes import PutRange, PutStream
from pm.compaction import CompactionSettings, Compactor
from pm.liveness import NodeRegistry
from pm.metadata import MetadataStore
from pm.records import Holding, NodeRecord, RangeRecord, StreamRecord
from sbp import messages
from sbp.errors import ProtocolError
from sbp.key_hash import KeyMap, key_hashes

STREAM = 1


def hashes(keys: Sequence[bytes]) -> np.ndarray:
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return key_hashes(np.frombuffer(b"".join(keys), dtype=np.uint8), offsets)


class RecordNodes:
    """Replicas as lists of (offset, key, tombstone) per (node, range)."""

    def __init__(self) -> None:
        self.records: dict[tuple[int, int], list[tuple[int, bytes, bool]]] = {}
        self.appended_ms: dict[int, int] = {}
        self.failing: set[int] = set()
        self.keys_asked: list[int] = []
        self.open_size = 0

    def write(
        self,
        nodes: Sequence[int],
        range_index: int,
        records: list[tuple[int, bytes, bool]],
        at_ms: int,
    ) -> None:
        for node in nodes:
            self.records[(node, range_index)] = list(records)
        self.appended_ms[range_index] = at_ms

    def held(self, node_id: int, range_index: int) -> list[tuple[int, bytes, bool]]:
        return self.records[(node_id, range_index)]

    async def compaction_keys(
        self, node_id: int, stream_id: int, range_index: int
    ) -> tuple[KeyMap, int, int]:
        self.keys_asked.append(range_index)
        held = self.held(node_id, range_index)
        keys = KeyMap.latest(
            hashes([k for _, k, _ in held]), np.array([o for o, _, _ in held], dtype=np.int64)
        )
        return keys, 10 * len(held), self.appended_ms[range_index]

    async def compact_ranges(
        self, node_id: int, stream_id: int, ranges: Sequence[tuple[int, bool]], keys: KeyMap
    ) -> list[messages.CompactRangeResult]:
        if node_id in self.failing:
            raise ProtocolError(f"node {node_id} is unwell")
        results = []
        for range_index, drop_tombstones in ranges:
            held = self.held(node_id, range_index)
            latest = keys.latest_of(hashes([k for _, k, _ in held])) if held else []
            kept = [
                record
                for record, last in zip(held, latest, strict=True)
                if last <= record[0] and not (record[2] and drop_tombstones)
            ]
            self.records[(node_id, range_index)] = kept
            results.append(
                messages.CompactRangeResult(
                    range_index=range_index,
                    bytes_before=10 * len(held),
                    bytes_after=10 * len(kept),
                    records_removed=len(held) - len(kept),
                )
            )
        return results

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        return {key: Holding(0, self.open_size, 0) for key in keys}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    opened = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    yield opened
    opened.close()


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


async def setup(
    store: MetadataStore,
    ranges: list[list[tuple[bytes, bool]]],
    *,
    lag_ms: int = 0,
    delete_retention_ms: int = 1000,
    max_keys: int = 1000,
) -> tuple[Compactor, RecordNodes, Clock]:
    """A compacted stream on nodes 1 and 2 with these sealed ranges (keys,
    tombstone) and an open one; all appended at the clock's start."""
    nodes, clock = RecordNodes(), Clock()
    registry = NodeRegistry(5.0)
    for node_id in (1, 2):
        registry.heartbeat(NodeRecord(node_id, f"127.0.0.1:{9000 + node_id}"))
    stream = StreamRecord(
        STREAM,
        2,
        cleanup_policy=1,
        min_compaction_lag_ms=lag_ms,
        delete_retention_ms=delete_retention_ms,
    )
    records = [PutStream(stream)]
    offset = 0
    for index, keys in enumerate(ranges):
        rng = RangeRecord(STREAM, index, offset, (1, 2), offset + len(keys))
        nodes.write(
            (1, 2), index, [(offset + i, k, t) for i, (k, t) in enumerate(keys)], clock.now_ms
        )
        offset += len(keys)
        records.append(PutRange(rng))
    records.append(PutRange(RangeRecord(STREAM, len(ranges), offset, (1, 2))))
    await store.commit(records)

    sealed: list[tuple[int, int]] = []

    async def seal(stream_id: int, range_index: int) -> None:
        sealed.append((stream_id, range_index))

    compactor = Compactor(
        store, nodes, registry, seal, settings=CompactionSettings(max_keys=max_keys), clock_ms=clock
    )
    compactor.sealed = sealed  # type: ignore[attr-defined]
    return compactor, nodes, clock


def kept(nodes: RecordNodes, node_id: int, ranges: int) -> list[tuple[int, bytes, bool]]:
    return [r for index in range(ranges) for r in nodes.held(node_id, index)]


async def test_a_pass_keeps_each_keys_latest_record_on_every_replica(store: MetadataStore) -> None:
    compactor, nodes, _ = await setup(
        store, [[(b"a", False), (b"b", False)], [(b"a", False), (b"c", True)], [(b"b", False)]]
    )
    assert await compactor.compact(store.stream(STREAM))  # type: ignore[arg-type]
    for node_id in (1, 2):
        assert kept(nodes, node_id, 3) == [(2, b"a", False), (3, b"c", True), (4, b"b", False)]
    assert compactor.streams[STREAM].clean_end == 5
    # nothing new: the next pass asks nobody
    nodes.keys_asked.clear()
    assert not await compactor.compact(store.stream(STREAM))  # type: ignore[arg-type]
    assert nodes.keys_asked == []


async def test_young_ranges_wait_for_the_minimum_lag(store: MetadataStore) -> None:
    compactor, nodes, clock = await setup(store, [[(b"a", False)], [(b"a", False)]], lag_ms=60_000)
    assert not await compactor.compact(store.stream(STREAM))  # type: ignore[arg-type]
    assert kept(nodes, 1, 2) == [(0, b"a", False), (1, b"a", False)]
    clock.now_ms += 60_000
    assert await compactor.compact(store.stream(STREAM))  # type: ignore[arg-type]
    assert kept(nodes, 1, 2) == [(1, b"a", False)]


async def test_more_keys_than_the_map_holds_compact_a_prefix_per_pass(
    store: MetadataStore,
) -> None:
    ranges = [[(b"k%d" % (i % 4 + 4 * r), False) for i in range(8)] for r in range(3)]
    compactor, nodes, _ = await setup(store, ranges, max_keys=5)
    stream = store.stream(STREAM)
    assert stream is not None
    assert await compactor.compact(stream)
    assert compactor.streams[STREAM].clean_end == 8  # one range's 4 keys fit, two ranges' 8 not
    assert len(nodes.held(1, 0)) == 4 and len(nodes.held(1, 1)) == 8
    assert await compactor.compact(stream)
    assert compactor.streams[STREAM].clean_end == 16
    assert await compactor.compact(stream)
    assert compactor.streams[STREAM].clean_end == 24
    assert [len(nodes.held(1, i)) for i in range(3)] == [4, 4, 4]


async def test_tombstones_go_once_the_delete_retention_has_passed(store: MetadataStore) -> None:
    compactor, nodes, clock = await setup(
        store, [[(b"a", False), (b"a", True), (b"b", False)]], delete_retention_ms=1000
    )
    stream = store.stream(STREAM)
    assert stream is not None
    assert await compactor.compact(stream)
    assert kept(nodes, 1, 1) == [(1, b"a", True), (2, b"b", False)]
    clock.now_ms += 999
    assert not await compactor.compact(stream)
    clock.now_ms += 1
    assert await compactor.compact(stream)
    assert kept(nodes, 1, 1) == kept(nodes, 2, 1) == [(2, b"b", False)]


async def test_a_replica_that_fails_holds_the_clean_end_back(store: MetadataStore) -> None:
    compactor, nodes, _ = await setup(store, [[(b"a", False)], [(b"a", False)]])
    stream = store.stream(STREAM)
    assert stream is not None
    nodes.failing.add(2)
    assert not await compactor.compact(stream)
    assert compactor.streams[STREAM].clean_end == 0
    assert compactor.stats.failed_passes == 1
    nodes.failing.clear()
    assert await compactor.compact(stream)
    assert kept(nodes, 2, 2) == [(1, b"a", False)]
    assert compactor.streams[STREAM].clean_end == 2


async def test_an_open_range_is_sealed_once_it_holds_the_roll_size(store: MetadataStore) -> None:
    compactor, nodes, _ = await setup(store, [[(b"a", False)]])
    stream = store.stream(STREAM)
    assert stream is not None
    nodes.open_size = compactor.roll_bytes - 1
    await compactor.roll(stream)
    assert compactor.sealed == []  # type: ignore[attr-defined]
    nodes.open_size = compactor.roll_bytes
    await compactor.roll(stream)
    assert compactor.sealed == [(STREAM, 1)]  # type: ignore[attr-defined]
