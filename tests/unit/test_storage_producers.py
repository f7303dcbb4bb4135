"""Idempotent producers in storage (SPEC §10): the decision table row by row,
and the state in the engine: durable with the batch, carried by REPLICATE's
stamps, rolled back with a dropped excess, gone with the stream."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from sbp.batches import build_batch
from sbp.errors import (
    InvalidRequestError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    RangeNotFoundError,
    UnknownProducerError,
)
from storage import AppendItem, AppendOutcome, AppendResult, ReplicaBatch, StorageEngine
from storage.model import RangeInfo, ReplicaInfo
from storage.producers import (
    KEPT_BATCHES,
    ProducerStamp,
    ProducerState,
    SequenceEntry,
    decide,
    merge,
)

NOW = 1_000_000
EXPIRY = 60_000
PID = 7


def _state(*entries: tuple[int, int, int, int], last_ms: int = NOW) -> ProducerState:
    first, *rest = (SequenceEntry(*e) for e in entries)
    state = ProducerState.first(first, last_ms)
    for entry in rest:
        state = state.with_batch(entry, last_ms)
    return state


# -- the table, row by row --------------------------------------------------------


def test_an_older_epoch_is_fenced() -> None:
    with pytest.raises(ProducerFencedError, match="epoch 1 is fenced: epoch 2"):
        decide(_state((2, 0, 5, 100)), ProducerStamp(PID, 1, 5), 5, NOW, EXPIRY)


@pytest.mark.parametrize("state", [None, _state((1, 0, 5, 100))], ids=["no state", "older"])
def test_a_new_epoch_or_no_state_starts_at_sequence_0(state: ProducerState | None) -> None:
    assert decide(state, ProducerStamp(PID, 2, 0), 3, NOW, EXPIRY) is None


@pytest.mark.parametrize("state", [None, _state((1, 0, 5, 100))], ids=["no state", "older"])
def test_a_new_epoch_or_no_state_at_another_sequence_is_unknown(
    state: ProducerState | None,
) -> None:
    with pytest.raises(UnknownProducerError, match="must have sequence 0, not 4"):
        decide(state, ProducerStamp(PID, 2, 4), 3, NOW, EXPIRY)


def test_the_next_sequence_is_stored() -> None:
    state = _state((1, 0, 5, 100), (1, 5, 2, 105))
    assert decide(state, ProducerStamp(PID, 1, 7), 4, NOW, EXPIRY) is None


def test_a_batch_already_stored_is_answered_with_its_offset() -> None:
    state = _state((1, 0, 5, 100), (1, 5, 2, 105), (1, 7, 4, 200))
    assert decide(state, ProducerStamp(PID, 1, 5), 2, NOW, EXPIRY) == SequenceEntry(1, 5, 2, 105)
    assert decide(state, ProducerStamp(PID, 1, 7), 4, NOW, EXPIRY) == SequenceEntry(1, 7, 4, 200)


@pytest.mark.parametrize(
    ("base_sequence", "records"),
    [(12, 1), (5, 3), (3, 2)],
    ids=["a gap", "same start, other count", "inside a batch"],
)
def test_anything_else_is_out_of_order_with_the_next_sequence(
    base_sequence: int, records: int
) -> None:
    state = _state((1, 0, 5, 100), (1, 5, 2, 105))
    with pytest.raises(OutOfOrderSequenceError) as raised:
        decide(state, ProducerStamp(PID, 1, base_sequence), records, NOW, EXPIRY)
    assert raised.value.next_sequence == 7


def test_older_than_what_is_kept_is_out_of_order() -> None:
    entries = [(1, i, 1, 100 + i) for i in range(KEPT_BATCHES + 1)]
    state = _state(*entries)
    assert len(state.entries()) == KEPT_BATCHES
    assert decide(state, ProducerStamp(PID, 1, 1), 1, NOW, EXPIRY) is not None
    with pytest.raises(OutOfOrderSequenceError):
        decide(state, ProducerStamp(PID, 1, 0), 1, NOW, EXPIRY)


def test_an_expired_producer_is_unknown_unless_it_starts_again() -> None:
    state = _state((1, 0, 5, 100), last_ms=NOW - EXPIRY - 1)
    with pytest.raises(UnknownProducerError):
        decide(state, ProducerStamp(PID, 1, 5), 1, NOW, EXPIRY)
    assert decide(state, ProducerStamp(PID, 1, 0), 1, NOW, EXPIRY) is None


def test_the_state_as_of_an_offset_keeps_only_the_batches_below() -> None:
    state = _state((1, 0, 5, 100), (2, 0, 2, 105), (2, 2, 3, 107))
    assert state.below(107) == _state((1, 0, 5, 100), (2, 0, 2, 105))
    before = state.below(105)
    assert before is not None and before.last == SequenceEntry(1, 0, 5, 100)
    assert state.below(104) is None
    # as of 105 epoch 2 never appended: its batch at sequence 0 is new again
    assert decide(before, ProducerStamp(PID, 2, 0), 2, NOW, EXPIRY) is None


# -- in the engine ----------------------------------------------------------------


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[StorageEngine]:
    opened = StorageEngine(tmp_path / "data", map_size=64 << 20, clock=lambda: NOW)
    opened.sync_ranges(1, [RangeInfo(1, 0, 0)]).result()
    yield opened
    opened.close()


def _append(engine: StorageEngine, value: bytes, stamp: ProducerStamp | None) -> AppendOutcome:
    done: Future[AppendOutcome] = Future()
    batch = build_batch([value, value], base_timestamp=1)
    engine.submit([AppendItem(1, batch, stamp)], lambda outcomes: done.set_result(outcomes[0]))
    return done.result(10)


def test_a_resend_is_stored_once_and_answered_where_it_was(engine: StorageEngine) -> None:
    first = _append(engine, b"a", ProducerStamp(PID, 0, 0))
    second = _append(engine, b"b", ProducerStamp(PID, 0, 2))
    again = _append(engine, b"a", ProducerStamp(PID, 0, 0))
    assert first == AppendResult(0, 2, NOW)
    assert second == AppendResult(2, 2, NOW)
    assert again == AppendResult(0, 2, NOW, duplicate=True)
    assert engine.next_offset(1) == 4
    gap = _append(engine, b"c", ProducerStamp(PID, 0, 9))
    assert isinstance(gap, OutOfOrderSequenceError) and gap.next_sequence == 4
    assert engine.next_offset(1) == 4


def test_an_unstamped_batch_is_stored_every_time(engine: StorageEngine) -> None:
    assert _append(engine, b"a", None) == AppendResult(0, 2, NOW)
    assert _append(engine, b"a", None) == AppendResult(2, 2, NOW)
    assert engine.producers(1) == {}


def test_the_state_survives_a_reopen(tmp_path: Path) -> None:
    with StorageEngine(tmp_path / "data", map_size=64 << 20, clock=lambda: NOW) as engine:
        engine.sync_ranges(1, [RangeInfo(1, 0, 0)]).result()
        _append(engine, b"a", ProducerStamp(PID, 3, 0))
    with StorageEngine(tmp_path / "data", map_size=64 << 20, clock=lambda: NOW) as engine:
        assert _append(engine, b"a", ProducerStamp(PID, 3, 0)) == AppendResult(
            0, 2, NOW, duplicate=True
        )
        fenced = _append(engine, b"a", ProducerStamp(PID, 2, 0))
        assert isinstance(fenced, ProducerFencedError)
        assert engine.producer_stamps(1, 0, 10) == {0: ProducerStamp(PID, 3, 0)}
        assert engine.stats().producers == 1


def test_a_follower_keeps_the_stamps_and_drops_them_with_an_excess(tmp_path: Path) -> None:
    """REPLICATE's stamps make the follower's state the primary's; a seal
    below what it holds takes the excess's state back (state as of the end)."""
    replicas = (ReplicaInfo(1, "a:1", True), ReplicaInfo(2, "b:1", False))
    with StorageEngine(tmp_path / "data", map_size=64 << 20, node_id=2, clock=lambda: NOW) as f:
        f.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=replicas)]).result()
        offset = 0
        for sequence in range(3):
            batch = build_batch([b"x", b"y"], base_timestamp=1)
            stamp = ProducerStamp(PID, 0, sequence * 2)
            f.replicate([ReplicaBatch(1, 0, 0, offset, batch, 2, stamp)]).result()
            offset += 2
        assert f.producers(1)[PID].last == SequenceEntry(0, 4, 2, 4)
        # the PM seals the range at 4: the batch at 4 was never acknowledged
        f.sync_ranges(1, [RangeInfo(1, 0, 0, 4, replicas=replicas)]).result()
        assert f.producers(1)[PID].last == SequenceEntry(0, 2, 2, 2)
        assert sorted(f.producer_stamps(1, 0, 10)) == [0, 2]
    with StorageEngine(tmp_path / "data", map_size=64 << 20, node_id=2, clock=lambda: NOW) as f:
        assert f.producers(1)[PID].last == SequenceEntry(0, 2, 2, 2)


def test_deleting_the_stream_forgets_its_producers(engine: StorageEngine) -> None:
    _append(engine, b"a", ProducerStamp(PID, 0, 0))
    engine.delete_stream(1).result()
    assert engine.producers(1) == {} and engine.stats().producers == 0


def test_a_replica_new_to_the_stream_takes_in_the_state_before_deciding(tmp_path: Path) -> None:
    """Range 1 on a node that held nothing of range 0: idempotent appends are
    refused (retriable) until the state as of range 1's start is taken in;
    then a resend of range 0's last batch is answered where range 0 holds it."""
    one = (ReplicaInfo(1, "a:1", True),)
    two = (ReplicaInfo(2, "b:1", True),)
    with StorageEngine(tmp_path / "one", map_size=64 << 20, node_id=1, clock=lambda: NOW) as old:
        old.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=one)]).result()
        for sequence in range(3):
            stamp = ProducerStamp(PID, 0, sequence * 2)
            old.submit([AppendItem(1, build_batch([b"x", b"y"], 1), stamp)], lambda _: None)
        old.sync_ranges(1, [RangeInfo(1, 0, 0, 6, replicas=one)]).result()
        snapshot = old.producer_snapshot(1, 6)
        assert snapshot[PID].last == SequenceEntry(0, 4, 2, 4)
        with pytest.raises(RangeNotFoundError, match="not whole up to 7"):
            old.producer_snapshot(1, 7)
    ranges = [RangeInfo(1, 0, 0, 6, replicas=one), RangeInfo(1, 1, 6, replicas=two)]
    with StorageEngine(tmp_path / "two", map_size=64 << 20, node_id=2, clock=lambda: NOW) as new:
        new.sync_ranges(1, ranges).result()
        assert not new.producers_ready(1)
        refused = _append(new, b"x", ProducerStamp(PID, 0, 4))
        assert isinstance(refused, RangeNotFoundError) and refused.code.retriable
        assert _append(new, b"plain", None) == AppendResult(6, 2, NOW)  # not idempotent: served
        assert new.take_in_producers(1, 6, snapshot).result()
        assert _append(new, b"x", ProducerStamp(PID, 0, 4)) == AppendResult(
            4, 2, NOW, duplicate=True
        )
        assert _append(new, b"z", ProducerStamp(PID, 0, 6)) == AppendResult(8, 2, NOW)
    with StorageEngine(tmp_path / "two", map_size=64 << 20, node_id=2, clock=lambda: NOW) as new:
        assert new.producers_ready(1)  # known whole across a restart


def test_a_range_copied_without_stamps_is_whole_once_its_end_is_taken_in(
    tmp_path: Path,
) -> None:
    """A replica that copied sealed range 0 (catch-up carries no producer
    fields) cannot give the state as of its end until it takes it in from
    a replica that can; taking in never moves its table back."""
    one = (ReplicaInfo(1, "a:1", True), ReplicaInfo(2, "b:1", False))
    with StorageEngine(tmp_path / "one", map_size=64 << 20, node_id=1, clock=lambda: NOW) as old:
        old.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=one)]).result()
        batches = []
        for sequence in range(3):
            batch = build_batch([b"x", b"y"], 1)
            batches.append(batch)
            old.submit([AppendItem(1, batch, ProducerStamp(PID, 0, sequence * 2))], lambda _: None)
        old.sync_ranges(1, [RangeInfo(1, 0, 0, 6, replicas=one)]).result()
        snapshot = old.producer_snapshot(1, 6)
    sealed = [RangeInfo(1, 0, 0, 6, replicas=one)]
    with StorageEngine(tmp_path / "two", map_size=64 << 20, node_id=2, clock=lambda: NOW) as copy:
        copy.sync_ranges(1, sealed).result()
        items = [ReplicaBatch(1, 0, 0, i * 2, batch, 2) for i, batch in enumerate(batches)]
        assert copy.catch_up(items).result() == 6
        assert not copy.producers_whole_at(1, 6)
        with pytest.raises(RangeNotFoundError, match="not whole up to 6"):
            copy.producer_snapshot(1, 6)
        copy.take_in_producers(1, 6, snapshot).result()
        assert copy.producers_whole_at(1, 6)
        assert copy.producer_snapshot(1, 6) == snapshot
        # an older state offered later changes nothing
        copy.take_in_producers(1, 2, {}).result()
        assert copy.producer_snapshot(1, 6) == snapshot


def test_taking_in_keeps_the_batches_this_replica_holds_above_the_start() -> None:
    inherited = _state((0, 0, 5, 0), (0, 5, 5, 5))
    local = _state((0, 5, 5, 5), (0, 10, 2, 10))  # its own range starts at 10
    merged = merge(inherited, local, 10)
    assert merged is not None
    assert merged.entries() == [
        SequenceEntry(0, 0, 5, 0),
        SequenceEntry(0, 5, 5, 5),
        SequenceEntry(0, 10, 2, 10),
    ]
    assert merge(None, None, 10) is None


@pytest.mark.parametrize(
    "stamp",
    [ProducerStamp(-1, 0, 0), ProducerStamp(PID, -1, 0), ProducerStamp(PID, 0, -5)],
    ids=["negative id", "negative epoch", "negative sequence"],
)
def test_producer_fields_out_of_range_fail_their_item_alone(
    engine: StorageEngine, stamp: ProducerStamp
) -> None:
    """Checked before the writer: the other items of the group still commit."""
    done: Future[list[AppendOutcome]] = Future()
    good = build_batch([b"fine"], base_timestamp=1)
    engine.submit(
        [AppendItem(1, build_batch([b"bad"], 1), stamp), AppendItem(1, good)], done.set_result
    )
    bad, fine = done.result(10)
    assert isinstance(bad, InvalidRequestError) and "out of range" in bad.message
    assert fine == AppendResult(0, 1, NOW)


def test_producers_silent_past_the_expiry_are_forgotten(tmp_path: Path) -> None:
    now = [NOW]
    with StorageEngine(
        tmp_path / "data", map_size=64 << 20, clock=lambda: now[0], producer_expiry_ms=EXPIRY
    ) as engine:
        engine.sync_ranges(1, [RangeInfo(1, 0, 0)]).result()
        _append(engine, b"a", ProducerStamp(PID, 0, 0))
        _append(engine, b"b", ProducerStamp(PID + 1, 0, 0))
        now[0] += EXPIRY // 2
        _append(engine, b"c", ProducerStamp(PID + 1, 0, 2))  # this one goes on
        now[0] += EXPIRY // 2 + 1
        assert engine.forget_idle_producers().result() == 1
        assert list(engine.producers(1)) == [PID + 1]
        # the forgotten one starts again at 0, as SPEC §10 says
        assert isinstance(_append(engine, b"d", ProducerStamp(PID, 0, 2)), UnknownProducerError)
    with StorageEngine(tmp_path / "data", map_size=64 << 20, clock=lambda: now[0]) as engine:
        assert list(engine.producers(1)) == [PID + 1]  # forgotten on disk too
