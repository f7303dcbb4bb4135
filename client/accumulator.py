"""The producer's accumulator: records gathered into batches, in the order
sent, until the sender takes them (the part of ``Producer`` that aiokafka
calls its record accumulator).

A batch is open while records go into it; it closes once it holds
``batch_records`` records or ``batch_bytes`` bytes, or ``linger`` seconds
after its first record, and is then encoded once (``sbp.batches``, numpy).
Closed batches, and batches the caller encoded, wait in sequence order for
the sender. ``buffer_bytes`` bounds the bytes not yet durable: beyond it,
adding waits (backpressure).

For an idempotent producer (SPEC §10) each batch gets its sequence when it
is queued the first time: the count of records queued before it. It keeps
that sequence for every retry.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import trio

from sbp.batch_v2 import MAX_TIMESTAMP_SPAN_MS, Header, encode_headers
from sbp.batches import BATCH_HEADER_SIZE, build_records, peek_header
from sbp.errors import SBPError

#: per-record bytes a batch adds to the values: the uint32 length
RECORD_OVERHEAD: Final = 4
#: what a record's key, headers or own timestamp add to it, besides their
#: bytes: a length (or delta) word each (SPEC §4, magic 2)
FIELD_OVERHEAD: Final = 4

#: room kept in a batch's span of timestamps for the time between adding a
#: record without one and the batch being made (its linger)
STAMP_MARGIN_MS: Final = 3_600_000

#: a record's headers as a caller gives them: pairs (names may repeat) or a mapping
Headers = Sequence[Header] | Mapping[str, bytes]


def header_block(headers: Headers | None) -> bytes:
    """A record's headers, checked and encoded as its batch holds them (b"":
    none)."""
    if not headers:
        return b""
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    for pair in pairs:
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or not isinstance(pair[1], bytes | bytearray | memoryview)
        ):
            raise TypeError(f"a header is a (str name, bytes value) pair, not {pair!r}")
    return encode_headers(pairs)


def header_blocks(headers: Sequence[Headers | None]) -> list[bytes]:
    """``header_block`` of each record's headers; the same headers object
    given for many records is encoded once."""
    if headers and all(item is headers[0] for item in headers):  # one object for all
        return [header_block(headers[0])] * len(headers)
    encoded: dict[int, bytes] = {}  # by id: the objects live as long as the call
    blocks = []
    for item in headers:
        block = encoded.get(id(item))
        if block is None:
            block = encoded[id(item)] = header_block(item)
        blocks.append(block)
    return blocks


def extra_bytes(key: bytes | None, block: bytes, timestamp: int | None) -> int:
    """What a record's key, encoded headers and own timestamp add to its batch."""
    size = 0
    if key is not None:
        size += len(key) + FIELD_OVERHEAD
    if block:
        size += FIELD_OVERHEAD + len(block)
    if timestamp is not None:
        size += FIELD_OVERHEAD
    return size


class ProducerClosedError(SBPError):
    """``send`` on a producer that is closed or closing."""


class PendingBatch:
    """Records that travel together: filled while open, then encoded once.

    ``done`` is set when the batch is durable (``base_offset``) or has
    failed for good (``error``).
    """

    __slots__ = (
        "attempts",
        "base_offset",
        "base_sequence",
        "data",
        "deadline",
        "done",
        "error",
        "headers",
        "keys",
        "nbytes",
        "opened_at",
        "seq",
        "stamps",
        "timestamps",
        "values",
    )

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.values: list[bytes | None] = []
        #: per record, once a record of the batch has one (None until then)
        self.keys: list[bytes | None] | None = None
        #: each record's headers, encoded (b"": none)
        self.headers: list[bytes] | None = None
        self.timestamps: list[int | None] | None = None
        #: the earliest and latest record timestamps given (None: none given)
        self.stamps: tuple[int, int] | None = None
        self.nbytes = 0
        self.opened_at = 0.0
        self.data: bytearray | memoryview | None = None
        self.deadline = math.inf
        self.done = trio.Event()
        self.base_offset = -1
        self.error: BaseException | None = None
        #: APPEND requests that carried it (more than one: it was retried)
        self.attempts = 0
        #: an idempotent producer's sequence of its first record; -1: none
        self.base_sequence = -1

    def add(
        self,
        value: bytes | None,
        key: bytes | None,
        headers: bytes,
        timestamp: int | None,
    ) -> None:
        """One more record, with what it carries besides its value (its
        headers encoded)."""
        count = len(self.values)
        self.values.append(value)
        if key is not None or self.keys is not None:
            self.keys = self.keys if self.keys is not None else [None] * count
            self.keys.append(key)
        if headers or self.headers is not None:
            self.headers = self.headers if self.headers is not None else [b""] * count
            self.headers.append(headers)
        if timestamp is not None or self.timestamps is not None:
            self.timestamps = self.timestamps if self.timestamps is not None else [None] * count
            self.timestamps.append(timestamp)
        if timestamp is not None:
            self.note_stamps(timestamp, timestamp)

    def note_stamps(self, low: int, high: int) -> None:
        """Record timestamps from ``low`` to ``high`` are in the batch."""
        held = self.stamps
        self.stamps = (low, high) if held is None else (min(held[0], low), max(held[1], high))

    def stamp_range(self, now_ms: int) -> tuple[int, int] | None:
        """The earliest and latest timestamps of the batch's records (those
        without one of their own get about ``now_ms``); None when empty."""
        if not self.values:
            return None
        given = self.stamps
        unstamped = self.timestamps is None or any(t is None for t in self.timestamps)
        if given is None:
            return now_ms, now_ms
        if unstamped:
            return min(given[0], now_ms), max(given[1], now_ms)
        return given

    def takes_stamps(self, low: int, high: int, now_ms: int) -> bool:
        """Whether records stamped ``low`` .. ``high`` fit with the batch's:
        one batch spans at most ``MAX_TIMESTAMP_SPAN_MS``."""
        held = self.stamp_range(now_ms) or (low, high)
        return max(held[1], high) - min(held[0], low) <= MAX_TIMESTAMP_SPAN_MS - STAMP_MARGIN_MS

    def extend(
        self,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None,
        headers: Sequence[bytes] | None,
        timestamps: Sequence[int | None] | None,
    ) -> None:
        """Records in order; the columns besides the values, when given, are
        as long as ``values`` (the headers encoded)."""
        count, added = len(self.values), len(values)
        self.values.extend(values)
        for name, column, none in (
            ("keys", keys, None),
            ("headers", headers, b""),
            ("timestamps", timestamps, None),
        ):
            held = getattr(self, name)
            if column is None and held is None:
                continue
            if held is None:
                held = [none] * count
                setattr(self, name, held)
            held.extend([none] * added if column is None else column)

    def encode(self, base_timestamp: int) -> None:
        """Encode the records into the batch (magic 1 when they carry nothing
        but values) and let go of them."""
        self.data = build_records(
            self.values,
            base_timestamp,
            keys=self.keys,
            header_blocks=self.headers,
            timestamps=self.timestamps,
        )
        self.values, self.keys, self.headers, self.timestamps = [], None, None, None

    def size(self) -> int:
        """Bytes of the encoded batch."""
        return len(self.data) if self.data is not None else BATCH_HEADER_SIZE + self.nbytes

    def resolve(self, base_offset: int) -> None:
        self.base_offset = base_offset
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    async def wait(self) -> int:
        """The base offset once durable; raises the batch's error."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.base_offset


class Accumulator:
    """See the module docstring. ``wake_sender`` is called whenever a
    batch becomes ready."""

    def __init__(
        self,
        *,
        linger: float,
        batch_bytes: int,
        batch_records: int,
        buffer_bytes: int,
        delivery_timeout: float,
        wake_sender: Callable[[], None],
        idempotent: bool = False,
    ) -> None:
        self.linger = linger
        self.batch_bytes = batch_bytes
        self.batch_records = batch_records
        self.buffer_bytes = buffer_bytes
        self.delivery_timeout = delivery_timeout
        self._wake_sender = wake_sender
        self.idempotent = idempotent
        #: the sequence the next queued batch's first record gets
        self.next_sequence = 0
        #: why the sequences have a gap (a batch that carried one failed)
        self.sequence_broken: BaseException | None = None
        self._next_seq = 0
        self.open: PendingBatch | None = None
        #: closed batches waiting for the sender, oldest (lowest seq) first
        self.ready: list[PendingBatch] = []
        self._ready_seqs: list[int] = []
        #: every batch not yet durable or failed, by seq
        self.unfinished: dict[int, PendingBatch] = {}
        #: bytes of records not yet durable (waiting or in flight)
        self.buffered = 0
        self.closing = False
        self._wake_linger = trio.Event()
        self._space = trio.Event()

    def is_full(self, batch: PendingBatch) -> bool:
        return len(batch.values) >= self.batch_records or batch.nbytes >= self.batch_bytes

    def new_batch(self) -> PendingBatch:
        """A batch with the next sequence number, counted as unfinished."""
        if self.closing:
            raise ProducerClosedError("the producer is closed")
        batch = PendingBatch(self._next_seq)
        batch.opened_at = trio.current_time()
        self._next_seq += 1
        self.unfinished[batch.seq] = batch
        return batch

    def open_batch(self) -> PendingBatch:
        """The open batch; one is started (its linger clock with it) if none is."""
        if self.open is not None:
            return self.open
        batch = self.new_batch()
        self.open = batch
        self._wake_linger.set()
        return batch

    def close_open_batch(self) -> None:
        """Encode the open batch and queue it for the sender."""
        batch = self.open
        if batch is None:
            return
        self.open = None
        batch.encode(int(time.time() * 1000))
        self.enqueue_encoded(batch)

    def enqueue_encoded(self, batch: PendingBatch) -> None:
        """Count an encoded batch as buffered and queue it for the sender."""
        assert batch.data is not None
        batch.nbytes = len(batch.data)
        batch.deadline = trio.current_time() + self.delivery_timeout
        if self.idempotent:
            batch.base_sequence = self.next_sequence
            self.next_sequence += peek_header(batch.data).record_count
        self.buffered += batch.nbytes
        self.requeue(batch)

    def requeue(self, batch: PendingBatch) -> None:
        """Queue ``batch`` for the sender in its sequence place."""
        index = bisect.bisect_left(self._ready_seqs, batch.seq)
        self.ready.insert(index, batch)
        self._ready_seqs.insert(index, batch.seq)
        self._wake_sender()

    def take(self, max_bytes: int, window: int | None = None) -> list[PendingBatch]:
        """The oldest ready batches that fit ``max_bytes`` (at least one);
        with a ``window``, only batches fewer than that many places after
        the oldest batch not yet durable (what an idempotent producer may
        have unanswered, so that a resend is of a batch the stream still
        remembers)."""
        total = 0
        count = 0
        oldest = next(iter(self.unfinished), 0)
        for batch in self.ready:
            size = batch.size()
            if count and total + size > max_bytes:
                break
            if window is not None and batch.seq - oldest >= window:
                break
            total += size
            count += 1
        taken = self.ready[:count]
        del self.ready[:count]
        del self._ready_seqs[:count]
        return taken

    def finish(self, batch: PendingBatch) -> None:
        """The batch is durable or failed for good: its bytes are free."""
        self.unfinished.pop(batch.seq, None)
        self.buffered -= batch.nbytes
        if self.buffered < self.buffer_bytes:
            self._space.set()

    def failed(self, batch: PendingBatch, error: BaseException) -> None:
        """The batch failed for good. A batch that carried a sequence leaves
        a gap in the producer's sequences: ``sequence_broken`` says why."""
        self.finish(batch)
        batch.fail(error)
        if batch.base_sequence >= 0 and self.sequence_broken is None:
            self.sequence_broken = error

    def expire_ready(self, now: float, error: BaseException) -> None:
        """Fail the waiting batches whose delivery deadline has passed."""
        for batch in [b for b in self.ready if now >= b.deadline]:
            index = self.ready.index(batch)
            del self.ready[index]
            del self._ready_seqs[index]
            self.failed(batch, error)

    def fail_ready(self, error: BaseException) -> None:
        """Fail every batch waiting for the sender."""
        for batch in list(self.ready):
            self.failed(batch, error)
        self.ready.clear()
        self._ready_seqs.clear()

    def restart_sequences(self, error: BaseException) -> None:
        """After a gap (``sequence_broken``), for a new producer id or epoch:
        the waiting batches that were sent before fail with ``error`` (they
        may or may not be stored, and cannot go again under new sequences),
        and those never sent get new sequences from 0, in order."""
        for batch in [b for b in self.ready if b.attempts]:
            index = self.ready.index(batch)
            del self.ready[index]
            del self._ready_seqs[index]
            self.finish(batch)
            batch.fail(error)
        self.next_sequence = 0
        for batch in self.ready:
            assert batch.data is not None
            batch.base_sequence = self.next_sequence
            self.next_sequence += peek_header(batch.data).record_count
        self.sequence_broken = None

    def fail_unfinished(self, error: BaseException) -> None:
        """The producer closes: every batch not yet durable fails."""
        for batch in list(self.unfinished.values()):
            if not batch.done.is_set():
                batch.fail(error)
        self.unfinished.clear()
        self.ready.clear()
        self._ready_seqs.clear()
        self.open = None

    async def wait_for_space(self) -> None:
        while self.buffered >= self.buffer_bytes:
            if self.closing:
                raise ProducerClosedError("the producer is closed")
            self._space = trio.Event()
            await self._space.wait()

    async def linger_loop(self) -> None:
        """Close the open batch ``linger`` seconds after it was started."""
        while True:
            await self._wake_linger.wait()
            self._wake_linger = trio.Event()
            batch = self.open
            if batch is None:
                continue
            await trio.sleep_until(batch.opened_at + self.linger)
            if self.open is batch:
                self.close_open_batch()
