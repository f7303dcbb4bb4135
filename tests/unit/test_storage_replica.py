"""Storage for a follower (SPEC §7): stamped batches at their offsets, the
accept rules of REPLICATE, dropping a sealed range's excess, and catch-up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sbp.batches import build_batch, decode_batches, stamp_base_offset
from sbp.errors import (
    EpochFencedError,
    OutOfOrderError,
    ProtocolError,
    RangeNotFoundError,
    RangeSealedError,
)
from storage import RangeInfo, ReplicaBatch, ReplicaInfo, StorageEngine

LEADER = 1
FOLLOWER = 2
STREAM = 7
EPOCH = 3


def replicas() -> tuple[ReplicaInfo, ...]:
    return (
        ReplicaInfo(LEADER, "127.0.0.1:9001", True),
        ReplicaInfo(FOLLOWER, "127.0.0.1:9002", False),
    )


def open_range(index: int = 0, start: int = 0) -> RangeInfo:
    return RangeInfo(STREAM, index, start, replicas=replicas(), epoch=EPOCH)


def sealed_range(index: int, start: int, end: int) -> RangeInfo:
    return RangeInfo(STREAM, index, start, end, replicas=replicas(), epoch=EPOCH)


def stamped(base_offset: int, *values: bytes) -> bytearray:
    out = build_batch(list(values), 1000)
    stamp_base_offset(out, base_offset)
    return out


def item(base_offset: int, *values: bytes, index: int = 0, epoch: int = EPOCH) -> ReplicaBatch:
    data = stamped(base_offset, *values) if values else bytearray()
    return ReplicaBatch(STREAM, index, epoch, base_offset, data, len(values))


@pytest.fixture
def follower(tmp_path: Path) -> Iterator[StorageEngine]:
    with StorageEngine(tmp_path / "node", node_id=FOLLOWER, map_size=64 << 20) as engine:
        engine.sync_ranges(STREAM, [open_range()]).result()
        yield engine


def replicate(engine: StorageEngine, *items: ReplicaBatch) -> list[int | ProtocolError]:
    return engine.replicate(items).result()


def values(engine: StorageEngine, offset: int = 0, limit: int | None = None) -> list[bytes]:
    data = engine.read(STREAM, offset, 1 << 20, limit)
    return [bytes(v) for v in decode_batches(data).to_list()] if data else []


def test_batches_at_the_next_offset_are_stored_with_their_offsets(
    follower: StorageEngine,
) -> None:
    assert replicate(follower, item(0, b"a", b"b"), item(2, b"c")) == [2, 3]
    assert follower.next_offset(STREAM) == 3
    assert values(follower) == [b"a", b"b", b"c"]
    assert values(follower, 2) == [b"c"]


def test_a_resent_batch_is_accepted_without_a_change(follower: StorageEngine) -> None:
    replicate(follower, item(0, b"a", b"b"), item(2, b"c"))
    assert replicate(follower, item(0, b"a", b"b")) == [3]
    assert values(follower) == [b"a", b"b", b"c"]


def test_a_gap_is_out_of_order_with_the_offset_to_resend_from(follower: StorageEngine) -> None:
    replicate(follower, item(0, b"a"))
    [outcome] = replicate(follower, item(5, b"x"))
    assert isinstance(outcome, OutOfOrderError) and outcome.next_offset == 1
    assert follower.next_offset(STREAM) == 1


def test_a_commit_only_item_answers_the_next_offset(follower: StorageEngine) -> None:
    replicate(follower, item(0, b"a"))
    assert replicate(follower, item(0)) == [1]


def test_epochs_and_sealed_ranges_are_refused(follower: StorageEngine) -> None:
    [older] = replicate(follower, item(0, b"a", epoch=EPOCH - 1))
    [newer] = replicate(follower, item(0, b"a", epoch=EPOCH + 1))
    assert isinstance(older, EpochFencedError)
    assert isinstance(newer, RangeNotFoundError)
    follower.seal_range(STREAM, 0).result()
    [refused] = replicate(follower, item(0, b"a"))
    assert isinstance(refused, RangeSealedError)


def test_reads_stop_at_the_limit(follower: StorageEngine) -> None:
    replicate(follower, item(0, b"a"), item(1, b"b"), item(2, b"c"))
    assert values(follower, 0, limit=2) == [b"a", b"b"]
    assert values(follower, 2, limit=2) == []


def test_a_seal_below_what_the_replica_holds_drops_the_excess(
    follower: StorageEngine, tmp_path: Path
) -> None:
    # the three batches went into one chunk; the end cuts it after the second
    replicate(follower, item(0, b"a"), item(1, b"b"), item(2, b"c", b"d"))
    follower.seal_range(STREAM, 0).result()  # the PM's SEAL_RANGES: this replica answers 4
    follower.sync_ranges(STREAM, [sealed_range(0, 0, 2), open_range(1, 2)]).result()
    assert follower.next_offset(STREAM) == 2
    assert values(follower) == [b"a", b"b"]
    # the next range's batches follow on from the sealed end
    assert replicate(follower, item(2, b"e", index=1)) == [3]
    assert values(follower) == [b"a", b"b"]  # a sealed range ends the read
    assert values(follower, 2) == [b"e"]
    stats = follower.stats()
    assert stats.stored_batches == 3


def test_a_short_replica_serves_what_it_holds_and_catches_up(follower: StorageEngine) -> None:
    replicate(follower, item(0, b"a"))
    follower.sync_ranges(STREAM, [sealed_range(0, 0, 4), open_range(1, 4)]).result()
    assert values(follower) == [b"a"]
    with pytest.raises(RangeNotFoundError, match="not held"):
        follower.read(STREAM, 1, 1 << 20)
    assert follower.held_end(STREAM, 0, 4) == 1
    # the next range is written at its own offsets meanwhile
    assert replicate(follower, item(4, b"e", index=1)) == [5]
    filled = follower.catch_up([item(0, b"a"), item(1, b"b", b"c"), item(3, b"d")]).result()
    assert filled == 4
    assert follower.held_end(STREAM, 0, 4) == 4
    assert values(follower) == [b"a", b"b", b"c", b"d"]
    assert values(follower, 4) == [b"e"]
    assert follower.next_offset(STREAM) == 5


def test_what_a_follower_stored_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "node"
    with StorageEngine(path, node_id=FOLLOWER, map_size=64 << 20) as engine:
        engine.sync_ranges(STREAM, [open_range()]).result()
        replicate(engine, item(0, b"a", b"b"))
    with StorageEngine(path, node_id=FOLLOWER, map_size=64 << 20) as engine:
        assert engine.next_offset(STREAM) == 2
        assert replicate(engine, item(2, b"c")) == [3]
        assert values(engine) == [b"a", b"b", b"c"]


def test_a_range_sealed_here_is_unsettled_until_the_pm_says_where_it_ends(
    follower: StorageEngine,
) -> None:
    replicate(follower, item(0, b"a"), item(1, b"b"), item(2, b"c"))
    unsettled = follower.unsettled_range(STREAM)
    assert unsettled is not None and unsettled.range_index == 0 and unsettled.is_open
    sealed = follower.seal_range(STREAM, 0).result()  # the PM's SEAL_RANGES: this replica answers 3
    assert (sealed.end_offset, sealed.sealed_here) == (3, True)
    # readers are held to what they know is committed (here: 1) until the PM's end is known
    assert follower.unsettled_range(STREAM) is not None
    assert values(follower, 0, limit=1) == [b"a"]
    with pytest.raises(RangeNotFoundError, match="has not said where that range ends"):
        follower.read(STREAM, 1, 1 << 20, 1)
    follower.sync_ranges(STREAM, [sealed_range(0, 0, 2), open_range(1, 2)]).result()
    settled = follower.list_ranges(STREAM)[0]
    assert (settled.end_offset, settled.sealed_here, settled.end_is_final) == (2, False, True)
    unsettled = follower.unsettled_range(STREAM)
    assert unsettled is not None and unsettled.range_index == 1
    assert values(follower) == [b"a", b"b"]


def test_the_highest_pm_term_is_recorded_and_survives_a_restart(tmp_path: Path) -> None:
    with StorageEngine(tmp_path / "node", node_id=FOLLOWER, map_size=64 << 20) as engine:
        assert engine.pm_term() == 0
        assert engine.raise_pm_term(7).result() == 7
        # an older term never lowers it
        assert engine.raise_pm_term(3).result() == 7
    with StorageEngine(tmp_path / "node", node_id=FOLLOWER, map_size=64 << 20) as engine:
        assert engine.pm_term() == 7


def test_range_holding_and_the_cut_that_drops_a_number_of_bytes(
    follower: StorageEngine,
) -> None:
    """RANGE_HOLDINGS' answers: how far a replica holds a range, the bytes of
    it, and where to cut it to drop its first bytes, at chunk boundaries."""
    for offset in range(4):  # four chunks of one batch each
        replicate(follower, item(offset, bytes(1000)))
    follower.sync_ranges(STREAM, [sealed_range(0, 0, 4), open_range(1, 4)]).result()
    held_end, size = follower.range_holding(STREAM, 0)
    chunk = size // 4
    assert held_end == 4 and size == 4 * chunk and chunk > 1000
    assert follower.range_holding(STREAM, 1) == (4, 0)  # the open range holds nothing yet
    assert follower.offset_after_bytes(STREAM, 0, 1) == 1  # the first chunk goes whole
    assert follower.offset_after_bytes(STREAM, 0, chunk) == 1
    assert follower.offset_after_bytes(STREAM, 0, chunk + 1) == 2
    assert follower.offset_after_bytes(STREAM, 0, 10 * size) == 4  # never past the end
    follower.sync_ranges(STREAM, [sealed_range(0, 2, 4), open_range(1, 4)]).result()  # trimmed
    assert follower.range_holding(STREAM, 0) == (4, 2 * chunk)
    assert follower.offset_after_bytes(STREAM, 0, 1) == 3


def moved(index: int, start: int, end: int, nodes: tuple[int, ...]) -> RangeInfo:
    """A sealed range on ``nodes``, the first of them its primary."""
    on = tuple(ReplicaInfo(n, f"127.0.0.1:{9000 + n}", n == nodes[0]) for n in nodes)
    return RangeInfo(STREAM, index, start, end, replicas=on, epoch=EPOCH)


def test_a_looked_up_view_older_than_the_one_synced_changes_nothing(
    follower: StorageEngine,
) -> None:
    """A drain placed this node on sealed range 0, and it copies it; the
    answer to a lookup the PM gave just before (range 0 not on this node)
    arrives after that SYNC_RANGES. Applied, it would take the node off the
    range and drop what it copied, and nothing would tell it again."""
    before = [moved(0, 0, 3, (LEADER, 3)), open_range(1, 3)]
    after = [moved(0, 0, 3, (LEADER, 3, FOLLOWER)), open_range(1, 3)]
    follower.sync_ranges(STREAM, after).result()
    assert follower.catch_up([item(0, b"a", b"b", b"c")]).result() == 3
    answer = follower.learn_ranges(STREAM, before).result()
    assert [r.replicas for r in answer] == [r.replicas for r in after]
    assert follower.range_holding(STREAM, 0)[0] == 3
    assert values(follower) == [b"a", b"b", b"c"]


def test_a_looked_up_view_is_applied_when_certainly_newer(tmp_path: Path) -> None:
    """A stream unknown here takes the answer whole; a known one takes it
    when it has a range above every one known here (ranges only ever come
    at the top): a range just placed here, its SYNC_RANGES still on the way."""
    with StorageEngine(tmp_path / "node", node_id=FOLLOWER, map_size=64 << 20) as engine:
        engine.learn_ranges(STREAM, [open_range()]).result()
        assert [r.range_index for r in engine.list_ranges(STREAM)] == [0]
        replicate(engine, item(0, b"a"))
        engine.learn_ranges(STREAM, [sealed_range(0, 0, 1), open_range(1, 1)]).result()
        assert [(r.range_index, r.end_offset) for r in engine.list_ranges(STREAM)] == [
            (0, 1),
            (1, -1),
        ]
        assert replicate(engine, item(1, b"b", index=1)) == [2]
        # the same view again, or an older one, is left alone
        engine.learn_ranges(STREAM, [open_range()]).result()
        assert [r.range_index for r in engine.list_ranges(STREAM)] == [0, 1]


def test_a_range_whose_start_a_trim_cut_mid_batch_is_caught_up(tmp_path: Path) -> None:
    """A trim at offset 3 left range 0 starting inside the batch [2, 5),
    which its replicas keep whole. A replica placed on the range later
    copies that batch whole too, and the rest after it: without it the copy
    never began, and the new replica held nothing of the range for ever."""
    with StorageEngine(tmp_path / "node", node_id=FOLLOWER, map_size=64 << 20) as engine:
        engine.sync_ranges(STREAM, [sealed_range(0, 3, 8), open_range(1, 8)]).result()
        assert engine.held_end(STREAM, 3, 8) == 3
        copied = [item(0, b"a", b"b"), item(2, b"c", b"d", b"e"), item(5, b"f", b"g", b"h")]
        assert engine.catch_up(copied).result() == 8
        assert engine.range_holding(STREAM, 0)[0] == 8
        assert values(engine, 3) == [b"c", b"d", b"e", b"f", b"g", b"h"]
