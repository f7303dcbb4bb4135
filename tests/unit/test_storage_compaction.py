"""Compaction on a data node (SPEC §13): a sealed range rewritten by a map
of each key's latest offset keeps exactly each key's latest record (and
records without a key), at its own offset, with its headers and timestamp;
replicas rewrite alike; reads walk the removed offsets; a copy of a
compacted range is whole; all of it in one transaction."""

from __future__ import annotations

import random
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from sbp.batch_v2 import build_batch_v2, gap_marker, is_gap_marker
from sbp.batches import batch_spans, decode_batches, peek_header
from sbp.key_hash import KeyMap, key_hashes
from storage import (
    AppendItem,
    AppendOutcome,
    AppendResult,
    RangeInfo,
    ReplicaBatch,
    ReplicaInfo,
    StorageEngine,
)
from storage.compaction import rewrite_chunk, scan_keys

NODE = 1
MAP_SIZE = 64 * 1024 * 1024
STREAM = 1


def here() -> ReplicaInfo:
    return ReplicaInfo(NODE, "127.0.0.1:9001", True)


Record = tuple[int, bytes, bytes | None, int]  # offset, key, value (None: tombstone), timestamp


def keyed_batches(
    rng: random.Random, batches: int, per_batch: int, keys: int, tombstone_share: float = 0.1
) -> list[tuple[bytearray, list[tuple[bytes, bytes | None, int]]]]:
    """Batches of keyed records (some tombstones), each with what it holds."""
    made = []
    for b in range(batches):
        records = []
        for i in range(per_batch):
            key = b"key-%d" % rng.randrange(keys)
            value = (
                None if rng.random() < tombstone_share else b"v%d.%d|" % (b, i) * rng.randint(1, 5)
            )
            records.append((key, value, 1000 + b * 10 + i))
        batch = build_batch_v2(
            [v for _, v, _ in records],
            1000 + b * 10,
            keys=[k for k, _, _ in records],
            headers=[[("h", b"%d" % i)] for i in range(per_batch)],
            timestamps=[t for _, _, t in records],
        )
        made.append((batch, records))
    return made


def fill(
    engine: StorageEngine, made: list[tuple[bytearray, list]], per_append: int = 3
) -> list[Record]:
    """Append the batches (several per append, so chunks hold several) and
    return every record with its offset."""
    stored: list[Record] = []
    for at in range(0, len(made), per_append):
        group = made[at : at + per_append]
        done: Future[list[AppendOutcome]] = Future()
        engine.submit([AppendItem(STREAM, batch) for batch, _ in group], done.set_result)
        outcomes = done.result()
        for (_, records), outcome in zip(group, outcomes, strict=True):
            assert isinstance(outcome, AppendResult)
            stored.extend(
                (outcome.base_offset + i, key, value, ts)
                for i, (key, value, ts) in enumerate(records)
            )
    return stored


def seal_at(engine: StorageEngine, *ends: int) -> None:
    """The PM's view: ranges sealed at ``ends`` (the first from 0), the next open."""
    starts = [0, *ends]
    ranges = [
        RangeInfo(STREAM, i, starts[i], end, replicas=(here(),), epoch=1)
        for i, end in enumerate(ends)
    ]
    ranges.append(RangeInfo(STREAM, len(ends), ends[-1], replicas=(here(),), epoch=1))
    engine.sync_ranges(STREAM, ranges, cleanup_policy=1).result()


def new_engine(path: Path) -> StorageEngine:
    engine = StorageEngine(path, map_size=MAP_SIZE, node_id=NODE)
    engine.sync_ranges(
        STREAM, [RangeInfo(STREAM, 0, 0, replicas=(here(),), epoch=1)], cleanup_policy=1
    ).result()
    return engine


def stream_map(engine: StorageEngine, ranges: int) -> KeyMap:
    found = [engine.range_keys(STREAM, i).keys for i in range(ranges)]
    return KeyMap.latest(
        np.concatenate([m.hashes for m in found]), np.concatenate([m.offsets for m in found])
    )


def compact(engine: StorageEngine, ranges: int, drop_tombstones: bool = False) -> int:
    keys = stream_map(engine, ranges)
    freed = 0
    for i in range(ranges):
        rewrites = engine.compaction_rewrites(STREAM, i, keys, drop_tombstones)
        freed += engine.apply_compaction(STREAM, i, rewrites).result()
    return freed


def read_all(engine: StorageEngine, end: int) -> tuple[bytearray, list[Record]]:
    """Every record from 0 to ``end``, walking reads as a consumer does."""
    payload = bytearray()
    offset = 0
    while offset < end:
        data = engine.read(STREAM, offset, 1 << 16)
        if not data:  # compacted away to the range's end: read on in the next
            holder = next(r for r in engine.list_ranges(STREAM) if r.holds(offset))
            assert not holder.is_open
            offset = holder.end_offset
            continue
        payload += data
        last_start, _ = batch_spans(data)[-1]
        offset = peek_header(data, last_start).next_offset
    decoded = decode_batches(payload)
    records = [
        (int(decoded.offsets[i]), decoded.key(i), decoded.value(i), int(decoded.timestamps[i]))
        for i in range(len(decoded))
    ]
    return payload, records


def latest_per_key(stored: list[Record]) -> dict[bytes, Record]:
    latest: dict[bytes, Record] = {}
    for record in stored:
        latest[record[1]] = record
    return latest


def test_a_compacted_range_keeps_each_keys_latest_record_at_its_offset(tmp_path: Path) -> None:
    rng = random.Random(1)
    with new_engine(tmp_path / "a") as engine:
        stored = fill(engine, keyed_batches(rng, 60, 20, keys=50))
        seal_at(engine, len(stored))
        freed = compact(engine, 1)
        payload, records = read_all(engine, len(stored))
    assert freed > 0
    expected = sorted(latest_per_key(stored).values())
    assert records == expected  # offsets, keys, values, timestamps; tombstones still there
    assert any(value is None for _, _, value, _ in records)
    assert not any(is_gap_marker(payload, start) for start, _ in batch_spans(payload))


def test_a_tombstone_goes_only_once_its_range_may_drop_it(tmp_path: Path) -> None:
    rng = random.Random(2)
    with new_engine(tmp_path / "a") as engine:
        stored = fill(engine, keyed_batches(rng, 40, 10, keys=30, tombstone_share=0.3))
        seal_at(engine, len(stored))
        compact(engine, 1)
        _, kept = read_all(engine, len(stored))
        compact(engine, 1, drop_tombstones=True)
        _, dropped = read_all(engine, len(stored))
    live = [r for r in sorted(latest_per_key(stored).values()) if r[2] is not None]
    assert len(kept) > len(live)
    assert dropped == live


def test_a_later_range_supersedes_records_of_an_earlier_one(tmp_path: Path) -> None:
    rng = random.Random(3)
    with new_engine(tmp_path / "a") as engine:
        first = fill(engine, keyed_batches(rng, 20, 10, keys=10))
        seal_at(engine, len(first))
        second = fill(engine, keyed_batches(rng, 20, 10, keys=10))
        seal_at(engine, len(first), len(first) + len(second))
        compact(engine, 2)
        _, records = read_all(engine, len(first) + len(second))
    assert records == sorted(latest_per_key(first + second).values())
    assert all(offset >= len(first) for offset, *_ in records)  # every key was written again


def test_a_read_at_a_removed_offset_answers_from_the_next_record_left(tmp_path: Path) -> None:
    with new_engine(tmp_path / "a") as engine:
        # key a at 0..9, then b at 10..19 and a again at 20: only 19 and 20 stay
        for key in (b"a", b"b"):
            engine.append(STREAM, build_batch_v2([b"x"] * 10, 1, keys=[key] * 10)).result()
        engine.append(STREAM, build_batch_v2([b"last"], 1, keys=[b"a"])).result()
        seal_at(engine, 21)
        compact(engine, 1)
        data = engine.read(STREAM, 3, 1 << 16)
        assert decode_batches(data).offsets.tolist() == [19, 20]
        assert peek_header(data, 0).base_offset == 10  # the batch keeps its base offset
        engine.append(STREAM, build_batch_v2([b"b", b"a"], 1, keys=[b"b", b"a"])).result()
        seal_at(engine, 21, 23)
        compact(engine, 2)
        # the whole first range is gone but its ends stay: nothing to read in it
        assert engine.read(STREAM, 0, 1 << 16) == bytearray()
        assert engine.read(STREAM, 20, 1 << 16) == bytearray()
        assert engine.describe_range(STREAM, 0).end_offset == 21


def test_records_without_keys_and_unnamed_keys_stay() -> None:
    keyless = build_batch_v2([b"k1", b"n1", b"k2"], 5, keys=[b"k", None, b"k"])
    chunk = bytearray(keyless)
    chunk[0:8] = (100).to_bytes(8, "big")
    keys = scan_keys([(100, chunk)]).keys
    assert keys.offsets.tolist() == [102]
    rewrite = rewrite_chunk(100, chunk, keys, drop_tombstones=True)
    assert rewrite.value is not None and rewrite.records_removed == 1
    decoded = decode_batches(rewrite.value)
    assert decoded.offsets.tolist() == [101, 102]
    assert decoded.to_list() == [b"n1", b"k2"]
    # a map that names none of its keys changes nothing
    other = KeyMap.latest(
        key_hashes(np.frombuffer(b"zz", np.uint8), np.array([0, 2])), np.array([999])
    )
    assert rewrite_chunk(100, chunk, other, drop_tombstones=True).value is None


def test_replicas_compact_to_the_same_bytes_and_a_second_pass_changes_nothing(
    tmp_path: Path,
) -> None:
    made = keyed_batches(random.Random(4), 50, 16, keys=40)
    payloads = []
    for name, per_append in (("a", 1), ("b", 7)):  # chunked differently
        with new_engine(tmp_path / name) as engine:
            stored = fill(engine, made, per_append)
            seal_at(engine, len(stored))
            compact(engine, 1)
            payload, _ = read_all(engine, len(stored))
            keys = stream_map(engine, 1)
            assert engine.compaction_rewrites(STREAM, 0, keys, False) == []
            payloads.append(payload)
    assert payloads[0] == payloads[1]


def test_freed_bytes_leave_the_stored_counters_and_survive_a_restart(tmp_path: Path) -> None:
    rng = random.Random(5)
    path = tmp_path / "a"
    with new_engine(path) as engine:
        stored = fill(engine, keyed_batches(rng, 30, 20, keys=5))
        seal_at(engine, len(stored))
        before = engine.stats().stored_bytes
        freed = compact(engine, 1)
        payload, records = read_all(engine, len(stored))
        assert engine.stats().stored_bytes == before - freed
    with StorageEngine(path, map_size=MAP_SIZE, node_id=NODE) as engine:
        assert read_all(engine, len(stored)) == (payload, records)
        assert engine.range_holding(STREAM, 0)[0] == len(stored)


def test_a_copy_of_a_compacted_range_is_whole_with_its_gaps(tmp_path: Path) -> None:
    """Catch-up from a compacted replica: the offsets compaction removed
    count as held, so the copy ends at the range's end."""
    with new_engine(tmp_path / "a") as source:
        for key in (b"a", b"b", b"a", b"c", b"c"):
            source.append(STREAM, build_batch_v2([b"x"] * 4, 1, keys=[key] * 4)).result()
        seal_at(source, 20)
        compact(source, 1)
        served = source.read(STREAM, 0, 1 << 16)
    assert decode_batches(served).offsets.tolist() == [7, 11, 19]
    with StorageEngine(tmp_path / "b", map_size=MAP_SIZE, node_id=NODE) as copy:
        copy.sync_ranges(
            STREAM,
            [
                RangeInfo(STREAM, 0, 0, 20, replicas=(here(),), epoch=1),
                RangeInfo(STREAM, 1, 20, replicas=(here(),), epoch=1),
            ],
            cleanup_policy=1,
        ).result()
        items = [
            ReplicaBatch(
                STREAM,
                0,
                1,
                peek_header(served, s).base_offset,
                served[s:e],
                peek_header(served, s).span,
            )
            for s, e in batch_spans(served)
        ]
        assert copy.catch_up(items[:1]).result() == 8  # the leading gap, then the batch at 4
        assert copy.catch_up(items[1:]).result() == 20
        assert copy.read(STREAM, 0, 1 << 16) == served
        assert copy.range_holding(STREAM, 0)[0] == 20


def test_a_copy_whose_source_holds_nothing_more_fills_to_the_end(tmp_path: Path) -> None:
    with StorageEngine(tmp_path / "b", map_size=MAP_SIZE, node_id=NODE) as copy:
        copy.sync_ranges(
            STREAM,
            [
                RangeInfo(STREAM, 0, 0, 20, replicas=(here(),), epoch=1),
                RangeInfo(STREAM, 1, 20, replicas=(here(),), epoch=1),
            ],
        ).result()
        assert copy.catch_up([], 20, (STREAM, 0)).result() == 20
        assert copy.read(STREAM, 0, 1 << 16) == bytearray()
        assert copy.range_holding(STREAM, 0) == (20, len(gap_marker(20)))


def test_only_ranges_the_pm_sealed_are_compacted(tmp_path: Path) -> None:
    from sbp.errors import RangeNotFoundError

    with new_engine(tmp_path / "a") as engine:
        engine.append(STREAM, build_batch_v2([b"x"], 1, keys=[b"k"])).result()
        with pytest.raises(RangeNotFoundError):
            engine.range_keys(STREAM, 0)
