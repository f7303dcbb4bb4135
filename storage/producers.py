"""Idempotent producers' state per stream (SPEC §10), and the rule that
decides each of their batches.

A producer's state on a stream is its last ``KEPT_BATCHES`` batches, each
as (epoch, base sequence, record count, base offset), and when it last
appended. Everything else follows from them: the epoch in force and the
next sequence are the last batch's; a resend is a batch among them; the
state as of an offset (a range sealed below batches this replica holds) is
the batches below it. The state is kept exactly as LMDB stores it, one
bytes value per (stream, producer): compact in memory (10,000 producers
with full histories take about 16 MB) and written without re-encoding.

Each idempotent batch also leaves a ``ProducerStamp`` beside it in the log
(``layout.SEQUENCES_DB``), so that what a primary sends its followers, and
what a replica rebuilds after dropping an excess, carries the producer
fields the APPEND had.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, NamedTuple

from sbp.errors import (
    InvalidRequestError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    UnknownProducerError,
)
from sbp.producer_stamp import ProducerStamp

__all__ = ["ProducerStamp", "ProducerState", "SequenceEntry", "decide", "merge"]

#: batches kept per (stream, producer): SPEC §10 asks for at least 64
KEPT_BATCHES: Final = 64
#: the default producer expiry: state untouched this long is dropped
DEFAULT_EXPIRY_MS: Final = 7 * 24 * 3600 * 1000

_LAST_APPEND: Final = struct.Struct(">q")
_ENTRY: Final = struct.Struct(">iqiq")  # epoch, base sequence, record count, base offset
_STAMP: Final = struct.Struct(">qiq")  # producer id, epoch, base sequence


#: the largest producer id, epoch and sequence the stored keys and values hold
_MAX_ID: Final = (1 << 63) - 1
_MAX_EPOCH: Final = (1 << 31) - 1


def check_stamp(stamp: ProducerStamp) -> None:
    """Refuse producer fields no producer sends (``InvalidRequestError``),
    before they reach a key or a value of the store."""
    if not (
        0 < stamp.producer_id <= _MAX_ID
        and 0 <= stamp.epoch <= _MAX_EPOCH
        and 0 <= stamp.base_sequence <= _MAX_ID
    ):
        raise InvalidRequestError(
            f"producer fields out of range: id {stamp.producer_id}, epoch {stamp.epoch}, "
            f"base_sequence {stamp.base_sequence}"
        )


def encode_stamp(stamp: ProducerStamp) -> bytes:
    return _STAMP.pack(*stamp)


def decode_stamp(value: bytes) -> ProducerStamp:
    return ProducerStamp(*_STAMP.unpack(value))


class SequenceEntry(NamedTuple):
    epoch: int
    base_sequence: int
    record_count: int
    base_offset: int

    @property
    def next_sequence(self) -> int:
        return self.base_sequence + self.record_count

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.record_count


@dataclass(frozen=True, slots=True)
class ProducerState:
    """One producer on one stream: ``value`` is the stored bytes (when it
    last appended, then its kept batches, oldest first)."""

    value: bytes

    @classmethod
    def first(cls, entry: SequenceEntry, now_ms: int) -> ProducerState:
        return cls(_LAST_APPEND.pack(now_ms) + _ENTRY.pack(*entry))

    @classmethod
    def of(cls, entries: list[SequenceEntry], last_append_ms: int) -> ProducerState:
        """A state of ``entries`` (oldest first; the last ``KEPT_BATCHES`` kept)."""
        kept = entries[-KEPT_BATCHES:]
        return cls(_LAST_APPEND.pack(last_append_ms) + b"".join(_ENTRY.pack(*e) for e in kept))

    @property
    def last_append_ms(self) -> int:
        return int(_LAST_APPEND.unpack_from(self.value)[0])

    @property
    def last(self) -> SequenceEntry:
        return SequenceEntry(*_ENTRY.unpack_from(self.value, len(self.value) - _ENTRY.size))

    def entries(self) -> list[SequenceEntry]:
        return [SequenceEntry(*e) for e in _ENTRY.iter_unpack(self.value[_LAST_APPEND.size :])]

    def with_batch(self, entry: SequenceEntry, now_ms: int) -> ProducerState:
        """This state with ``entry`` stored after the others (the oldest
        dropped beyond ``KEPT_BATCHES``)."""
        kept = self.value[_LAST_APPEND.size :][-(KEPT_BATCHES - 1) * _ENTRY.size :]
        return ProducerState(_LAST_APPEND.pack(now_ms) + kept + _ENTRY.pack(*entry))

    def below(self, offset: int) -> ProducerState | None:
        """The state as of ``offset``: the batches that end at or below it
        (None when none does)."""
        kept = [e for e in self.entries() if e.end_offset <= offset]
        if not kept:
            return None
        head = self.value[: _LAST_APPEND.size]
        return ProducerState(head + b"".join(_ENTRY.pack(*e) for e in kept))

    def holds_above(self, offset: int) -> bool:
        return self.last.end_offset > offset


def merge(
    inherited: ProducerState | None, local: ProducerState | None, as_of: int
) -> ProducerState | None:
    """A producer's state once a replica takes in the state as of ``as_of``
    from another replica: the batches below ``as_of`` are the other's, those
    at and above it (this replica's own range, received by REPLICATE) stay."""
    entries = [e for e in inherited.entries() if e.end_offset <= as_of] if inherited else []
    entries += [e for e in local.entries() if e.base_offset >= as_of] if local else []
    if not entries:
        return None
    last_ms = max(state.last_append_ms for state in (inherited, local) if state is not None)
    return ProducerState.of(entries, last_ms)


def decide(
    state: ProducerState | None,
    stamp: ProducerStamp,
    record_count: int,
    now_ms: int,
    expiry_ms: int,
) -> SequenceEntry | None:
    """SPEC §10's table for one batch: None to store it, the stored batch it
    repeats (answered with that batch's offset, nothing written), or the
    refusal raised (``ProducerFencedError``, ``UnknownProducerError``,
    ``OutOfOrderSequenceError`` with the next sequence)."""
    if state is not None and now_ms - state.last_append_ms > expiry_ms:
        state = None  # expired: as if never seen
    if state is None or stamp.epoch > state.last.epoch:
        if stamp.base_sequence == 0:
            return None
        raise UnknownProducerError(
            f"producer {stamp.producer_id} has no state at epoch {stamp.epoch} on this stream "
            f"(never seen, or expired); its first batch must have sequence 0, "
            f"not {stamp.base_sequence}"
        )
    last = state.last
    if stamp.epoch < last.epoch:
        raise ProducerFencedError(
            f"producer {stamp.producer_id} epoch {stamp.epoch} is fenced: "
            f"epoch {last.epoch} has appended to this stream"
        )
    if stamp.base_sequence == last.next_sequence:
        return None
    for entry in state.entries():
        if (
            entry.epoch == stamp.epoch
            and entry.base_sequence == stamp.base_sequence
            and entry.record_count == record_count
        ):
            return entry
    raise OutOfOrderSequenceError(
        f"producer {stamp.producer_id} epoch {stamp.epoch}: sequence {stamp.base_sequence} "
        f"({record_count} records) is neither the next one ({last.next_sequence}) nor a "
        "batch this stream holds",
        next_sequence=last.next_sequence,
    )
