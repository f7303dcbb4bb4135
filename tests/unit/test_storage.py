"""The storage engine: appends, reads, ranges, seals, trims, deletes, retention,
restart, a full map and group commit."""

from __future__ import annotations

import gc
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import lmdb
import pytest

from sbp.batches import batch_spans, build_batch, decode_batches, peek_header
from sbp.errors import (
    InvalidRecordBatchError,
    InvalidRequestError,
    NotPrimaryError,
    OffsetOutOfRangeError,
    ProtocolError,
    RangeNotFoundError,
    RangeSealedError,
    ShuttingDownError,
    StorageFullError,
    StreamDeletedError,
)
from storage import (
    AppendItem,
    AppendOutcome,
    AppendResult,
    RangeInfo,
    ReplicaInfo,
    StorageEngine,
    layout,
)

NODE = 1
OTHER = 2
MAP_SIZE = 64 * 1024 * 1024


def replica(node_id: int, primary: bool = True) -> ReplicaInfo:
    return ReplicaInfo(node_id, f"127.0.0.1:{9000 + node_id}", primary)


def open_range(stream_id: int, index: int = 0, start: int = 0, node: int = NODE) -> RangeInfo:
    return RangeInfo(stream_id, index, start, replicas=(replica(node),), epoch=1)


def sealed_range(stream_id: int, index: int, start: int, end: int, node: int = NODE) -> RangeInfo:
    return RangeInfo(stream_id, index, start, end, replicas=(replica(node),), epoch=1)


def batch(*values: bytes, timestamp: int = 1000) -> bytearray:
    return build_batch(list(values), timestamp)


class Clock:
    def __init__(self, now_ms: int = 1_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engine(tmp_path: Path, clock: Clock) -> Iterator[StorageEngine]:
    with StorageEngine(tmp_path / "data", map_size=MAP_SIZE, node_id=NODE, clock=clock) as e:
        yield e


def reopen(engine: StorageEngine, clock: Clock | None = None) -> StorageEngine:
    engine.close()
    return StorageEngine(engine.path, map_size=MAP_SIZE, node_id=NODE, clock=clock or Clock())


def values_at(engine: StorageEngine, stream_id: int, offset: int, max_bytes: int = 1 << 20):
    decoded = decode_batches(engine.read(stream_id, offset, max_bytes))
    return list(zip(decoded.offsets.tolist(), decoded.to_list(), strict=True))


# -- appends and reads -----------------------------------------------------


def test_appends_get_dense_offsets_and_read_back_stamped(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    first = engine.append(1, batch(b"a", b"b", b"c")).result()
    second = engine.append(1, memoryview(batch(b"d"))).result()
    assert (first.base_offset, first.record_count) == (0, 3)
    assert (second.base_offset, second.record_count) == (3, 1)
    assert first.append_time_ms == 1_000_000
    assert engine.next_offset(1) == 4
    assert values_at(engine, 1, 0) == [(0, b"a"), (1, b"b"), (2, b"c"), (3, b"d")]
    payload = engine.read(1, 0, 1 << 20)
    assert peek_header(payload).base_offset == 0


def test_read_starts_at_the_batch_holding_the_offset(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    for i in range(5):
        engine.append(1, batch(bytes([i]) * 3, bytes([i]) * 2)).result()
    assert values_at(engine, 1, 5)[0] == (4, b"\x02\x02\x02")
    assert [o for o, _ in values_at(engine, 1, 9)] == [8, 9]


def test_read_respects_the_byte_budget_but_returns_one_batch_at_least(
    engine: StorageEngine,
) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    size = len(batch(b"x" * 100))
    for _ in range(10):
        engine.append(1, batch(b"x" * 100)).result()
    assert len(engine.read(1, 0, 1)) == size
    assert len(engine.read(1, 0, 3 * size)) == 3 * size
    assert len(engine.read(1, 0, 3 * size + size - 1)) == 3 * size
    assert len(engine.read(1, 2, 1 << 20)) == 8 * size


def test_borrowed_batches_are_what_read_copies(engine: StorageEngine) -> None:
    """``borrow`` leaves the batches in the map: written out in order, its
    buffers (each batch's stamped base offset, then the rest of it) are
    the bytes ``read`` returns, through chunks and the byte budget."""
    engine.sync_ranges(1, [open_range(1)]).result()
    items = [AppendItem(1, batch(bytes([i]) * 40, bytes([i]) * 9)) for i in range(5)]
    append_together(engine, items)
    engine.append(1, batch(b"own chunk")).result()
    size = len(items[0].batch)
    for offset, max_bytes in [(0, 1 << 20), (3, 1), (4, 2 * size), (10, 1 << 20)]:
        expected = engine.read(1, offset, max_bytes)
        with engine.borrow(1, offset, max_bytes) as found:
            assert found.size == len(expected)
            assert found.record_count == len(decode_batches(expected))
            buffers = found.buffers()
            assert len(buffers) == 2 * len(list(batch_spans(expected)))
            assert b"".join(buffers) == expected
            assert found.copy() == expected
            detached = found.detach()
        # a detached read outlives its transaction
        assert detached.buffers() == [expected]
        assert detached.copy() == expected
    with engine.borrow(1, 11, 1 << 20) as found:  # the open tail
        assert (found.size, found.buffers(), found.copy()) == (0, [], bytearray())


def append_together(engine: StorageEngine, items: list[AppendItem]) -> list[AppendOutcome]:
    """One request: its batches are applied in one transaction."""
    done: Future[list[AppendOutcome]] = Future()
    engine.submit(items, done.set_result)
    return done.result(timeout=10)


def test_a_group_stores_each_streams_batches_as_one_chunk(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    items = [AppendItem(1 + i % 2, batch(bytes([i]) * 50, bytes([i]) * 7)) for i in range(6)]
    outcomes = append_together(engine, items)
    assert [o.base_offset for o in outcomes] == [0, 0, 2, 2, 4, 4]  # type: ignore[union-attr]
    assert engine.stats().stored_batches == 6
    with engine._store.env.begin() as txn:  # one value per stream, not per batch
        assert txn.stat(engine._store.dbs[b"batches"])["entries"] == 2
    # every offset of the chunk reads from the batch holding it, stamped
    assert values_at(engine, 1, 0) == [
        (0, b"\x00" * 50), (1, b"\x00" * 7), (2, b"\x02" * 50), (3, b"\x02" * 7),
        (4, b"\x04" * 50), (5, b"\x04" * 7),
    ]  # fmt: skip
    assert values_at(engine, 2, 3) == [(2, b"\x03" * 50), (3, b"\x03" * 7), (4, b"\x05" * 50),
                                       (5, b"\x05" * 7)]  # fmt: skip
    # the byte budget cuts between the batches of a chunk
    size = len(items[0].batch)
    assert len(engine.read(1, 2, 1)) == size
    assert len(engine.read(1, 2, 2 * size - 1)) == size
    assert len(engine.read(1, 0, 2 * size)) == 2 * size
    assert [peek_header(engine.read(1, o, 1)).base_offset for o in range(6)] == [0, 0, 2, 2, 4, 4]
    # a later append opens a chunk of its own; a read runs across both
    engine.append(1, batch(b"next")).result()
    assert values_at(engine, 1, 5)[1:] == [(5, b"\x04" * 7), (6, b"next")]
    engine = reopen(engine)
    assert engine.next_offset(1) == 7
    assert engine.stats().stored_batches == 7
    assert values_at(engine, 1, 3)[:2] == [(2, b"\x02" * 50), (3, b"\x02" * 7)]
    engine.close()


def test_a_trim_frees_a_chunk_only_once_wholly_below(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    append_together(engine, [AppendItem(1, batch(bytes([i]))) for i in range(4)])  # 0..3
    engine.append(1, batch(b"tail")).result()  # 4
    assert engine.trim(1, 2).result() == 2
    assert engine.stats().stored_batches == 5  # the chunk straddles 2: kept whole
    with pytest.raises(OffsetOutOfRangeError):
        engine.read(1, 1, 100)
    assert values_at(engine, 1, 2) == [(2, b"\x02"), (3, b"\x03"), (4, b"tail")]
    assert engine.trim(1, 4).result() == 4
    assert engine.stats().stored_batches == 1
    assert engine.stats().stored_bytes == len(batch(b"tail"))
    assert values_at(engine, 1, 4) == [(4, b"tail")]


def test_a_command_sees_the_appends_submitted_before_it(engine: StorageEngine) -> None:
    """Appends and a trim that land in one group: the trim must find (and free)
    the appends' chunk, which is written before any command runs."""
    engine.sync_ranges(1, [open_range(1)]).result()
    release = threading.Event()
    engine._command(lambda _ctx: release.wait(10))  # holds the writer
    appended: Future[list[AppendOutcome]] = Future()
    engine.submit([AppendItem(1, batch(b"a")), AppendItem(1, batch(b"b"))], appended.set_result)
    trimmed = engine.trim(1, 2)
    later: Future[list[AppendOutcome]] = Future()
    engine.submit([AppendItem(1, batch(b"c"))], later.set_result)
    release.set()
    assert trimmed.result(timeout=10) == 2
    assert [o.base_offset for o in appended.result(timeout=10)] == [0, 1]  # type: ignore[union-attr]
    assert later.result(timeout=10)[0].base_offset == 2  # type: ignore[union-attr]
    assert engine.stats().stored_batches == 1
    assert values_at(engine, 1, 2) == [(2, b"c")]


def test_a_format_1_directory_is_read_and_upgraded(tmp_path: Path) -> None:
    """Format 1 stored one batch per value with a 16-byte index entry and no
    batch counter: it is a store of one-batch chunks."""
    path = tmp_path / "v1"
    with StorageEngine(path, map_size=MAP_SIZE, node_id=NODE) as engine:
        engine.sync_ranges(1, [open_range(1)]).result()
    env = lmdb.open(str(path), map_size=MAP_SIZE, max_dbs=len(layout.ALL_DBS))
    with env.begin(write=True) as txn:
        dbs = {name: env.open_db(name, txn=txn) for name in layout.ALL_DBS}
        for base, values in ((0, [b"a", b"b"]), (2, [b"c"])):
            b = batch(*values)
            key = layout.batch_key(1, base)
            txn.put(key, bytes(b), db=dbs[layout.BATCHES_DB])
            txn.put(key, struct.pack(">qii", 5, len(values), len(b)), db=dbs[layout.INDEX_DB])
        txn.put(layout.FORMAT_KEY, layout.COUNTER.pack(1), db=dbs[layout.META_DB])
        txn.delete(layout.STORED_BATCHES_KEY, db=dbs[layout.META_DB])
    env.close()
    with StorageEngine(path, map_size=MAP_SIZE, node_id=NODE) as engine:
        assert engine.next_offset(1) == 3
        assert engine.stats().stored_batches == 2
        assert values_at(engine, 1, 1) == [(0, b"a"), (1, b"b"), (2, b"c")]
        assert engine.append(1, batch(b"d")).result().base_offset == 3
        assert engine.trim(1, 2).result() == 2
        assert engine.stats().stored_batches == 2
    with StorageEngine(path, map_size=MAP_SIZE, node_id=NODE) as engine:
        with engine._store.env.begin() as txn:
            version = txn.get(layout.FORMAT_KEY, db=engine._store.dbs[layout.META_DB])
        assert layout.COUNTER.unpack(version)[0] == layout.FORMAT_VERSION
        assert values_at(engine, 1, 2) == [(2, b"c"), (3, b"d")]


def test_read_at_the_tail_is_empty_and_beyond_it_out_of_range(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.append(1, batch(b"a")).result()
    assert engine.read(1, 1, 100) == b""
    with pytest.raises(OffsetOutOfRangeError, match="above the next offset 1"):
        engine.read(1, 2, 100)
    with pytest.raises(OffsetOutOfRangeError, match="below the first offset"):
        engine.read(1, -1, 100)


def test_streams_are_independent(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    engine.append(2, batch(b"two")).result()
    engine.append(1, batch(b"one")).result()
    engine.append(2, batch(b"two again")).result()
    assert values_at(engine, 1, 0) == [(0, b"one")]
    assert values_at(engine, 2, 0) == [(0, b"two"), (1, b"two again")]


def test_a_bad_batch_fails_only_its_own_item(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    corrupt = batch(b"bad")
    corrupt[-1] ^= 0xFF
    outcomes: list[AppendOutcome] = []
    done = threading.Event()

    def on_done(results: list[AppendOutcome]) -> None:
        outcomes.extend(results)
        done.set()

    engine.submit(
        [AppendItem(1, batch(b"ok1")), AppendItem(1, corrupt), AppendItem(1, batch(b"ok2"))],
        on_done,
    )
    assert done.wait(10)
    assert isinstance(outcomes[0], AppendResult) and outcomes[0].base_offset == 0
    assert isinstance(outcomes[1], InvalidRecordBatchError)
    assert "CRC" in str(outcomes[1])
    assert isinstance(outcomes[2], AppendResult) and outcomes[2].base_offset == 1
    assert values_at(engine, 1, 0) == [(0, b"ok1"), (1, b"ok2")]


def test_a_truncated_batch_is_invalid(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    with pytest.raises(InvalidRecordBatchError, match="batch_length"):
        engine.append(1, batch(b"abcdef")[:-2]).result()


# -- which range -------------------------------------------------------------


def test_unknown_stream_is_range_not_found(engine: StorageEngine) -> None:
    with pytest.raises(RangeNotFoundError):
        engine.append(9, batch(b"x")).result()
    with pytest.raises(RangeNotFoundError):
        engine.read(9, 0, 100)
    assert engine.next_offset(9) is None


def test_append_to_a_range_led_elsewhere_is_not_primary(engine: StorageEngine) -> None:
    led_elsewhere = RangeInfo(1, 0, 0, replicas=(replica(OTHER), replica(NODE, primary=False)))
    engine.sync_ranges(1, [led_elsewhere]).result()
    with pytest.raises(NotPrimaryError, match="primary: 2"):
        engine.append(1, batch(b"x")).result()


def test_append_to_a_stream_hosted_elsewhere_is_range_not_found(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1, node=OTHER)]).result()
    with pytest.raises(RangeNotFoundError):
        engine.append(1, batch(b"x")).result()


def test_seal_stops_appends_and_fixes_the_end_offset(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.append(1, batch(b"a", b"b")).result()
    sealed = engine.seal_range(1, 0).result()
    assert (sealed.end_offset, sealed.next_offset, not sealed.is_open) == (2, 2, True)
    assert engine.seal_range(1, 0).result() == sealed  # idempotent
    with pytest.raises(RangeSealedError):
        engine.append(1, batch(b"c")).result()
    with pytest.raises(RangeNotFoundError):
        engine.seal_range(1, 5).result()


def test_offsets_continue_across_a_seal_into_the_next_range(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.append(1, batch(b"a", b"b")).result()
    sealed = engine.seal_range(1, 0).result()
    engine.sync_ranges(1, [sealed, open_range(1, index=1, start=sealed.end_offset)]).result()
    assert engine.append(1, batch(b"c")).result().base_offset == 2
    assert values_at(engine, 1, 0) == [(0, b"a"), (1, b"b")]  # a read stops at the range end
    assert values_at(engine, 1, 2) == [(2, b"c")]
    assert [(r.range_index, r.next_offset) for r in engine.list_ranges(1)] == [(0, 2), (1, 3)]
    assert engine.describe_range(1, 1).next_offset == 3


def test_next_range_on_another_node(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.append(1, batch(b"a")).result()
    sealed = engine.seal_range(1, 0).result()
    engine.sync_ranges(1, [sealed, open_range(1, index=1, start=1, node=OTHER)]).result()
    with pytest.raises(RangeSealedError, match="end of a sealed range"):
        engine.read(1, 1, 100)
    with pytest.raises(RangeSealedError, match="does not host"):
        engine.append(1, batch(b"b")).result()
    assert [r.range_index for r in engine.list_ranges(1)] == [0]


def test_read_of_a_range_hosted_elsewhere_is_range_not_found(engine: StorageEngine) -> None:
    engine.sync_ranges(
        1, [sealed_range(1, 0, 0, 10, node=OTHER), open_range(1, index=1, start=10)]
    ).result()
    engine.append(1, batch(b"x")).result()
    with pytest.raises(RangeNotFoundError, match="range 0"):
        engine.read(1, 3, 100)
    assert values_at(engine, 1, 10) == [(10, b"x")]


def test_sync_ranges_rejects_inconsistent_ranges(engine: StorageEngine) -> None:
    with pytest.raises(InvalidRequestError):
        engine.sync_ranges(1, [open_range(1), open_range(1)]).result()
    with pytest.raises(InvalidRequestError):
        engine.sync_ranges(1, [open_range(2)]).result()


def test_a_sealed_range_stays_sealed_under_a_stale_view(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.append(1, batch(b"a")).result()
    engine.seal_range(1, 0).result()
    [stale] = engine.sync_ranges(1, [open_range(1)]).result()
    assert stale.end_offset == 1


# -- trims, deletes, retention -----------------------------------------------


def test_trim_drops_whole_batches_below_and_raises_the_first_offset(
    engine: StorageEngine,
) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    for i in range(4):
        engine.append(1, batch(bytes([i]), bytes([i]))).result()  # offsets 2i, 2i+1
    before = engine.stats()
    assert engine.trim(1, 3).result() == 3
    assert engine.first_offset(1) == 3
    with pytest.raises(OffsetOutOfRangeError):
        engine.read(1, 2, 100)
    # the batch holding 2 and 3 straddles the trim point and stays whole
    assert values_at(engine, 1, 3)[:2] == [(2, b"\x01"), (3, b"\x01")]
    after = engine.stats()
    assert after.stored_batches == before.stored_batches - 1
    assert after.stored_bytes == before.stored_bytes - len(batch(b"x", b"y"))
    assert engine.trim(1, 1).result() == 3  # never lowers
    assert engine.trim(1, 100).result() == 8  # capped at the next offset
    assert engine.stats().stored_batches == 0
    assert engine.append(1, batch(b"z")).result().base_offset == 8


def test_trim_forgets_sealed_ranges_wholly_below(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.append(1, batch(b"a", b"b")).result()
    sealed = engine.seal_range(1, 0).result()
    engine.sync_ranges(1, [sealed, open_range(1, index=1, start=2)]).result()
    engine.append(1, batch(b"c")).result()
    engine.trim(1, 2).result()
    assert [r.range_index for r in engine.list_ranges(1)] == [1]


def test_sync_ranges_drops_ranges_the_pm_trimmed_with_their_data(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.append(1, batch(b"a")).result()
    sealed = engine.seal_range(1, 0).result()
    engine.sync_ranges(1, [sealed, open_range(1, index=1, start=1)]).result()
    engine.append(1, batch(b"b")).result()
    engine.sync_ranges(1, [open_range(1, index=1, start=1)]).result()
    assert engine.first_offset(1) == 1
    assert engine.stats().stored_batches == 1
    with pytest.raises(OffsetOutOfRangeError):
        engine.read(1, 0, 100)
    assert values_at(engine, 1, 1) == [(1, b"b")]


def test_delete_stream_rejects_writes_and_frees_data(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    engine.append(1, batch(b"a")).result()
    engine.append(2, batch(b"keep")).result()
    engine.delete_stream(1).result()
    engine.delete_stream(1).result()  # idempotent
    with pytest.raises(StreamDeletedError):
        engine.append(1, batch(b"b")).result()
    with pytest.raises(StreamDeletedError):
        engine.read(1, 0, 100)
    with pytest.raises(StreamDeletedError):
        engine.sync_ranges(1, [open_range(1)]).result()
    assert engine.stats().stored_batches == 1
    assert engine.list_ranges(1) == []
    assert values_at(engine, 2, 0) == [(0, b"keep")]


def retained(engine: StorageEngine) -> dict[int, int]:
    """Apply retention to every stream: the new first offset of each that lost batches."""
    return {done.stream_id: done.first_offset for done in engine.expire().result()}


def test_retention_drops_batches_by_append_time(engine: StorageEngine, clock: Clock) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    engine.set_retentions({1: 60_000}).result()
    engine.append(1, batch(b"old")).result()
    engine.append(2, batch(b"kept forever")).result()
    clock.now_ms += 30_000
    engine.append(1, batch(b"newer")).result()
    clock.now_ms += 40_000  # "old" is 70 s old, "newer" 40 s
    assert retained(engine) == {1: 1}
    assert values_at(engine, 1, 1) == [(1, b"newer")]
    assert retained(engine) == {}
    clock.now_ms += 30_000
    assert retained(engine) == {1: 2}
    assert engine.read(1, 2, 100) == b""
    assert values_at(engine, 2, 0) == [(0, b"kept forever")]


# -- restart -------------------------------------------------------------------


def test_everything_comes_back_after_reopen(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    engine.set_retentions({2: 5000}).result()
    engine.append(1, batch(b"a", b"b")).result()
    sealed = engine.seal_range(1, 0).result()
    engine.sync_ranges(1, [sealed, open_range(1, index=1, start=2)]).result()
    engine.append(1, batch(b"c")).result()
    engine.append(2, batch(b"x")).result()
    engine.append(2, batch(b"y")).result()
    engine.trim(2, 1).result()
    engine.sync_ranges(3, [open_range(3)]).result()
    engine.delete_stream(3).result()
    stats = engine.stats()

    engine = reopen(engine)
    try:
        assert engine.next_offset(1) == 3
        assert engine.next_offset(2) == 2
        assert engine.first_offset(2) == 1
        assert [(r.range_index, r.end_offset, r.next_offset) for r in engine.list_ranges(1)] == [
            (0, 2, 2),
            (1, -1, 3),
        ]
        assert values_at(engine, 1, 0) == [(0, b"a"), (1, b"b")]
        assert values_at(engine, 2, 1) == [(1, b"y")]
        with pytest.raises(StreamDeletedError):
            engine.append(3, batch(b"z")).result()
        assert engine.append(1, batch(b"d")).result().base_offset == 3
        assert engine.stats().stored_bytes == stats.stored_bytes + len(batch(b"d"))
    finally:
        engine.close()


def test_an_empty_open_range_recovers_its_start_offset(tmp_path: Path) -> None:
    engine = StorageEngine(tmp_path, map_size=MAP_SIZE, node_id=NODE)
    engine.sync_ranges(
        1, [sealed_range(1, 0, 0, 40, node=OTHER), open_range(1, 1, start=40)]
    ).result()
    engine = reopen(engine)
    try:
        assert engine.next_offset(1) == 40
        assert engine.append(1, batch(b"a")).result().base_offset == 40
    finally:
        engine.close()


def test_closed_engine_refuses_work(tmp_path: Path) -> None:
    engine = StorageEngine(tmp_path, map_size=MAP_SIZE)
    engine.close()
    engine.close()
    with pytest.raises(ShuttingDownError):
        engine.submit([AppendItem(1, batch(b"a"))], lambda _: None)


def test_sync_mode_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sync"):
        StorageEngine(tmp_path, map_size=MAP_SIZE, sync="sometimes")  # type: ignore[arg-type]


# -- a full map ---------------------------------------------------------------


def test_storage_full_is_a_clean_error_and_trims_make_room(tmp_path: Path) -> None:
    engine = StorageEngine(tmp_path, map_size=4 * 1024 * 1024, node_id=NODE)
    try:
        engine.sync_ranges(1, [open_range(1)]).result()
        engine.sync_ranges(2, [open_range(2)]).result()
        big = batch(b"v" * 64 * 1024)
        appended = 0
        with pytest.raises(StorageFullError, match="storage full"):
            for _ in range(1000):
                engine.append(1, big).result()
                appended += 1
        assert 30 < appended < 64
        assert engine.next_offset(1) == appended
        # small batches of another stream still fit in what is left
        assert engine.append(2, batch(b"small")).result().base_offset == 0
        # metadata changes still work, and a trim frees room for new appends
        engine.trim(1, appended - 2).result()
        for _ in range(10):
            engine.append(1, big).result()
        assert engine.next_offset(1) == appended + 10
        assert values_at(engine, 1, appended - 2, 1)[0][0] == appended - 2
        engine = reopen(engine)
        assert engine.next_offset(1) == appended + 10
    finally:
        engine.close()


def test_a_transaction_that_overflows_the_map_fails_only_what_does_not_fit(
    tmp_path: Path,
) -> None:
    # no reserve margin can cover a single batch larger than the map itself
    engine = StorageEngine(tmp_path, map_size=2 * 1024 * 1024, node_id=NODE)
    try:
        engine.sync_ranges(1, [open_range(1)]).result()
        with pytest.raises(StorageFullError):
            engine.append(1, batch(b"h" * 3 * 1024 * 1024)).result()
        assert engine.append(1, batch(b"fits")).result().base_offset == 0
    finally:
        engine.close()


# -- group commit ---------------------------------------------------------------


def test_group_commit_from_many_threads(tmp_path: Path) -> None:
    engine = StorageEngine(tmp_path, map_size=MAP_SIZE, node_id=NODE)
    streams = (1, 2, 3)
    for stream_id in streams:
        engine.sync_ranges(stream_id, [open_range(stream_id)]).result()
    per_thread = 40
    results: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    start = threading.Barrier(8)

    def submitter(worker: int) -> None:
        stream_id = streams[worker % len(streams)]
        pending: list[threading.Event] = []
        mine: list[tuple[int, bytes]] = []
        start.wait()
        for i in range(per_thread):
            value = f"w{worker}-{i}".encode()
            done = threading.Event()

            def on_done(outcomes: list[AppendOutcome], value: bytes = value, done=done) -> None:
                outcome = outcomes[0]
                assert isinstance(outcome, AppendResult)
                mine.append((outcome.base_offset, value))
                done.set()

            engine.submit([AppendItem(stream_id, batch(value))], on_done)
            pending.append(done)
        for done in pending:
            assert done.wait(20)
        results[(worker, stream_id)] = mine

    try:
        threads = [threading.Thread(target=submitter, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = engine.stats()
        assert stats.appends_total == 8 * per_thread
        assert stats.commits_total < stats.appends_total - 3  # the 3 syncs of sync_ranges
        assert stats.max_group_size > 1
        assert stats.appends_waiting == 0
        for stream_id in streams:
            stored = values_at(engine, stream_id, 0)
            # dense offsets from 0
            assert [o for o, _ in stored] == list(range(len(stored)))
            by_offset = dict(stored)
            for (_worker, s), mine in results.items():
                if s != stream_id:
                    continue
                # each submitter's appends landed in submission order, as acknowledged
                assert [o for o, _ in mine] == sorted(o for o, _ in mine)
                assert all(by_offset[o] == v for o, v in mine)
    finally:
        engine.close()


def test_a_failing_callback_does_not_stop_the_writer(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()

    def explode(_outcomes: list[AppendOutcome]) -> None:
        raise RuntimeError("callback bug")

    engine.submit([AppendItem(1, batch(b"a"))], explode)
    assert engine.append(1, batch(b"b")).result().base_offset == 1


def test_an_operation_submitted_from_the_writer_thread_completes(engine: StorageEngine) -> None:
    """Every operation is non-blocking, so a completion callback (which runs
    on the writer thread) may submit another without waiting on itself."""
    engine.sync_ranges(1, [open_range(1)]).result()
    nested: list[Future[AppendResult]] = []
    done = threading.Event()

    def again(_outcomes: list[AppendOutcome]) -> None:
        nested.append(engine.append(1, batch(b"again")))
        done.set()

    engine.submit([AppendItem(1, batch(b"a"))], again)
    assert done.wait(10)
    assert nested[0].result(timeout=10).base_offset == 1
    assert values_at(engine, 1, 0) == [(0, b"a"), (1, b"again")]


def test_stats_describe_the_store(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    b = batch(b"x" * 1000)
    engine.append(1, b).result()
    engine.append(1, b).result()
    stats = engine.stats()
    assert stats.stored_bytes == 2 * len(b)
    assert stats.stored_batches == 2
    assert stats.map_size == MAP_SIZE
    assert 0 < stats.used_bytes <= stats.file_bytes
    assert stats.appends_total == 2
    assert stats.commits_total == 3
    assert stats.commit_seconds_total > 0
    assert (stats.streams, stats.ranges) == (1, 1)


def test_errors_carry_their_wire_codes() -> None:
    assert all(
        isinstance(e, ProtocolError) and e.code == e.__class__.code
        for e in (StorageFullError(), NotPrimaryError(), RangeSealedError())
    )


def test_a_transaction_failure_is_isolated_to_its_operation(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    release = threading.Event()
    engine._command(lambda _ctx: release.wait(10))  # holds the writer

    def broken(_ctx: object) -> None:
        raise RuntimeError("unexpected failure inside the transaction")

    outcomes: list[AppendOutcome] = []
    engine.submit([AppendItem(1, batch(b"before"))], outcomes.extend)
    failing = engine._command(broken)
    engine.submit([AppendItem(1, batch(b"after"))], outcomes.extend)
    release.set()
    with pytest.raises(ProtocolError, match="storage write failed"):
        failing.result(10)
    assert engine.append(1, batch(b"last")).result().base_offset == 2
    assert [o.base_offset for o in outcomes if isinstance(o, AppendResult)] == [0, 1]
    assert values_at(engine, 1, 0) == [(0, b"before"), (1, b"after"), (2, b"last")]


def test_prefetch_chunks_reads_the_chunks_a_drop_frees(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    for value in (b"a", b"b", b"c", b"d"):
        engine.append(1, batch(value)).result()  # one transaction, so one chunk, each
    engine.append(2, batch(b"other")).result()
    # every chunk of the stream, and none of the next stream's
    assert engine.prefetch_chunks(1) == 4
    # as a trim to offset 2 would free them: the chunks ending at or below it
    assert engine.prefetch_chunks(1, lambda end, _entry: end > 2) == 2
    assert engine.prefetch_chunks(1, lambda _end, entry: entry.append_time_ms >= 0) == 0
    assert engine.prefetch_chunks(3) == 0
    assert engine.prefetch_chunks(1, budget_s=0.0) == 1  # stops once over its budget
    # reading changes nothing
    engine.delete_stream(1).result()
    assert engine.stats().stored_batches == 1
    # the deletion leaves its chunks to later transactions (see below)
    assert engine.prefetch_chunks(1) == 4


def chunks_of(engine: StorageEngine, stream_id: int) -> int:
    return engine.prefetch_chunks(stream_id)


def test_a_deletion_frees_about_as_much_as_each_later_transaction_stores(
    engine: StorageEngine,
) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    small = batch(b"x" * 1000)
    for _ in range(6):
        engine.append(1, small).result()  # one chunk each
    engine.append(2, batch(b"kept")).result()
    engine.delete_stream(1).result()
    # gone for readers, writers and the counters at once; the chunks stay
    with pytest.raises(StreamDeletedError):
        engine.read(1, 0, 100)
    assert engine.stats().stored_batches == 1
    assert engine.stats().stored_bytes == len(batch(b"kept"))
    assert chunks_of(engine, 1) == 6
    assert engine.stats().streams_freeing == 1
    engine.delete_stream(1).result()  # idempotent: nothing counted twice
    assert engine.stats().stored_bytes == len(batch(b"kept"))
    # a command stores nothing, so it frees nothing
    engine.set_retentions({2: 0}).result()
    assert chunks_of(engine, 1) == 6
    # each transaction frees about the bytes it stores, oldest chunks first
    engine.append(2, small).result()
    assert chunks_of(engine, 1) == 5
    engine.append(2, batch(b"y" * 2500)).result()
    assert chunks_of(engine, 1) == 2
    engine.append(2, batch(b"z" * 5000)).result()
    assert chunks_of(engine, 1) == 0
    assert engine.stats().streams_freeing == 0
    assert engine.stats().stored_batches == 4
    assert values_at(engine, 2, 0)[0] == (0, b"kept")


def test_deleted_streams_take_turns_to_free_their_oldest_chunk(engine: StorageEngine) -> None:
    """Chunks written together come free together: one oldest chunk per
    stream in turn, and the next transaction goes on after the last stream
    it freed from (docs/storage.md)."""
    small = batch(b"x" * 1000)
    for stream_id in (1, 2, 3, 9):
        engine.sync_ranges(stream_id, [open_range(stream_id)]).result()
    for _ in range(3):
        for stream_id in (1, 2, 3):
            engine.append(stream_id, small).result()  # one chunk each
    assert engine.trim(3, 1).result() == 1  # stream 3's first chunk is dropped, the rest kept
    for stream_id in (1, 2):
        engine.delete_stream(stream_id).result()
    assert [chunks_of(engine, s) for s in (1, 2, 3)] == [3, 3, 3]

    def freed_after_storing(nbytes: int) -> list[int]:
        engine.append(9, batch(b"y" * nbytes)).result()
        return [chunks_of(engine, s) for s in (1, 2, 3)]

    assert freed_after_storing(900) == [2, 3, 3]  # about one chunk: stream 1's
    assert freed_after_storing(900) == [2, 2, 3]  # then stream 2's
    assert freed_after_storing(900) == [2, 2, 2]  # then stream 3's only dropped one
    assert freed_after_storing(900) == [1, 2, 2]  # and round again
    assert engine.stats().streams_freeing == 3
    # about three chunks: stream 2's, none of stream 3's (it leaves the
    # turns), stream 1's, then stream 2's again
    assert freed_after_storing(2500) == [0, 0, 2]
    assert engine.stats().streams_freeing == 2
    assert freed_after_storing(900) == [0, 0, 2]  # streams 1 and 2 found empty
    assert engine.stats().streams_freeing == 0
    assert values_at(engine, 3, 1) == [(1, b"x" * 1000), (2, b"x" * 1000)]


def test_chunks_left_by_a_deletion_are_freed_after_a_restart(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    for _ in range(3):
        engine.append(1, batch(b"x" * 1000)).result()
    engine.delete_stream(1).result()
    engine = reopen(engine)
    try:
        assert chunks_of(engine, 1) == 3
        with pytest.raises(StreamDeletedError):
            engine.append(1, batch(b"b")).result()
        assert engine.stats().stored_batches == 0
        engine.append(2, batch(b"y" * 5000)).result()
        assert chunks_of(engine, 1) == 0
        assert engine.stats().stored_batches == 1
    finally:
        engine.close()


def test_a_trim_leaves_its_chunks_to_later_transactions(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    small = batch(b"x" * 1000)
    for _ in range(6):
        engine.append(1, small).result()  # one chunk each, offsets 0..5
    assert engine.trim(1, 4).result() == 4
    # below the first offset: gone for readers and the counters at once
    with pytest.raises(OffsetOutOfRangeError):
        engine.read(1, 3, 100)
    assert engine.stats().stored_batches == 2
    assert engine.stats().streams_freeing == 1
    assert chunks_of(engine, 1) == 6
    engine.append(2, batch(b"y" * 2500)).result()
    assert chunks_of(engine, 1) == 3
    # trimming further forgets only what the last trim had not
    assert engine.trim(1, 5).result() == 5
    assert engine.stats().stored_batches == 2  # stream 1's last chunk and stream 2's
    engine.append(2, batch(b"z" * 5000)).result()
    assert chunks_of(engine, 1) == 1  # the kept chunk, offset 5, and no more
    assert engine.stats().streams_freeing == 0
    assert values_at(engine, 1, 5) == [(5, b"x" * 1000)]
    # a deletion after a trim counts nothing twice
    engine.trim(1, 6).result()
    engine.delete_stream(1).result()
    assert engine.stats().stored_bytes == len(batch(b"y" * 2500)) + len(batch(b"z" * 5000))


def test_a_sync_that_moves_the_first_range_up_leaves_its_chunks_too(
    engine: StorageEngine,
) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    engine.sync_ranges(2, [open_range(2)]).result()
    for _ in range(4):
        engine.append(1, batch(b"x" * 1000)).result()
    sealed = engine.seal_range(1, 0).result()
    engine.sync_ranges(1, [sealed, open_range(1, index=1, start=4)]).result()
    engine.append(1, batch(b"kept")).result()
    engine.sync_ranges(1, [open_range(1, index=1, start=4)]).result()  # the PM trimmed range 0
    assert engine.first_offset(1) == 4
    assert engine.stats().stored_batches == 1
    assert chunks_of(engine, 1) == 5
    # forgetting the stream altogether frees at once, and counts nothing twice
    engine.sync_ranges(1, []).result()
    assert chunks_of(engine, 1) == 0
    assert engine.stats().stored_batches == 0
    assert engine.stats().stored_bytes == 0
    engine.append(2, batch(b"y")).result()
    assert engine.stats().streams_freeing == 0


def test_chunks_left_by_a_trim_are_freed_after_a_restart(engine: StorageEngine) -> None:
    engine.sync_ranges(1, [open_range(1)]).result()
    for _ in range(3):
        engine.append(1, batch(b"x" * 1000)).result()
    engine.trim(1, 2).result()
    engine = reopen(engine)
    try:
        assert engine.stats().streams_freeing == 1
        assert engine.stats().stored_batches == 1
        engine.append(1, batch(b"y" * 5000)).result()
        assert chunks_of(engine, 1) == 2  # offset 2's chunk and the new one
        assert engine.stats().streams_freeing == 0
        assert values_at(engine, 1, 2) == [(2, b"x" * 1000), (3, b"y" * 5000)]
    finally:
        engine.close()


def test_a_full_store_frees_every_deleted_stream_before_refusing(tmp_path: Path) -> None:
    engine = StorageEngine(tmp_path, map_size=MAP_SIZE, node_id=NODE)
    try:
        engine.sync_ranges(1, [open_range(1)]).result()
        engine.sync_ranges(2, [open_range(2)]).result()
        big = batch(b"x" * (1 << 20))
        with pytest.raises(StorageFullError):
            while True:
                engine.append(1, big).result()
        engine.delete_stream(1).result()
        filled = chunks_of(engine, 1)
        assert filled > 10
        # the first append finds no room, frees all of stream 1, and is stored
        assert engine.append(2, big).result().base_offset == 0
        assert chunks_of(engine, 1) == 0
        for _ in range(filled - 10):
            engine.append(2, big).result()
    finally:
        engine.close()


def test_the_streams_can_be_read_while_the_writer_publishes(engine: StorageEngine) -> None:
    """The event loop lists the streams (retention, LIST_RANGES, stats)
    while the writer thread publishes each commit's streams into the same
    dict. A garbage collection that runs Python code (a finalizer, a gc
    callback) in the middle of a listing lets the writer in: the listing
    must not fail with "dictionary changed size during iteration"."""
    # more streams than the 2,000 pairs CPython keeps for reuse: listing them
    # as (id, state) tuples allocates, and so collects
    for future in [engine.sync_ranges(s, [open_range(s)]) for s in range(1, 6001)]:
        future.result()
    stop = threading.Event()

    def churn() -> None:
        # streams come and go, each change a commit the writer publishes
        stream_id = 10_000
        while not stop.is_set():
            engine.sync_ranges(stream_id, [open_range(stream_id)]).result()
            engine.sync_ranges(stream_id, []).result()
            stream_id += 1

    def collection_lets_others_in(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            time.sleep(0.0002)

    gc.callbacks.append(collection_lets_others_in)
    threshold = gc.get_threshold()
    gc.set_threshold(100)
    churner = threading.Thread(target=churn)
    churner.start()
    try:
        for _ in range(10):
            assert len(engine.retention_periods()) >= 6000
            assert len(engine.list_ranges()) >= 6000
            assert len(engine.stream_ids()) >= 6000
            engine.stats()
    finally:
        stop.set()
        churner.join()
        gc.callbacks.remove(collection_lets_others_in)
        gc.set_threshold(*threshold)
