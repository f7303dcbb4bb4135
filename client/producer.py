"""``Producer``: appends records to one stream, in batches, with retries.

It is three parts, as aiokafka's producer is: this API, the accumulator
that gathers records into batches (``client.accumulator``: batching knobs,
linger, backpressure) and the sender that takes them to the stream's
primary and retries what fails (``client.sender``: requests in flight,
failure handling, at-least-once delivery).

Delivery: idempotent by default (SPEC §10). The producer gets an id from
the PM (INIT_PRODUCER) and numbers its records; every batch is stored once
however often it is sent, across lost answers, retries, seals, failovers and
restarts of the servers, and the records are stored in the order sent with
``max_in_flight`` requests in flight (5 by default). ``name=`` gives a
service a stable producer id: starting it again fences the instance before
it, whose next append fails ``ProducerFencedError``. ``idempotent=False``
gives at-least-once delivery: a batch whose answer was lost may be stored
twice, and records keep their order only with ``max_in_flight=1`` (its
default then).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Final, Self

import numpy as np
import numpy.typing as npt
import trio

from net.pool import ConnectionPool
from sbp.batch_v2 import MAX_TIMESTAMP_SPAN_MS, entry_lengths
from sbp.batches import BATCH_HEADER_SIZE, Buffer, build_batch, validate_batch
from sbp.enums import ErrorCode
from sbp.errors import RangeNotFoundError, SBPError, error_for
from sbp.producer_stamp import ProducerStamp

from ._routing import ClientContext, StreamRoutes, primary_of
from .accumulator import (
    FIELD_OVERHEAD,
    RECORD_OVERHEAD,
    STAMP_MARGIN_MS,
    Accumulator,
    Headers,
    PendingBatch,
    ProducerClosedError,
    extra_bytes,
    header_block,
    header_blocks,
)
from .pm_client import PMClient
from .retry import until_deadline
from .sender import Sender

__all__ = [
    "Producer",
    "ProducerClosedError",
    "RecordHandle",
    "RecordTooLargeError",
    "RecordsHandle",
]

#: defaults of the batching knobs (see ``Producer``)
DEFAULT_LINGER: Final = 0.005
DEFAULT_BATCH_BYTES: Final = 1 << 20
DEFAULT_BATCH_RECORDS: Final = 10_000
#: an APPEND frame stays well under the 16 MiB frame limit of the servers
DEFAULT_MAX_REQUEST_BYTES: Final = 8 << 20
#: records waiting or in flight beyond this make ``send`` wait (backpressure)
DEFAULT_BUFFER_BYTES: Final = 64 << 20
DEFAULT_DELIVERY_TIMEOUT: Final = 60.0
DEFAULT_REQUEST_TIMEOUT: Final = 10.0
#: requests in flight of an idempotent producer (order holds with many)
DEFAULT_IDEMPOTENT_IN_FLIGHT: Final = 5
#: the sequence ``resume`` asks about: past any a producer reaches, so the
#: data node refuses it and says which sequence it expects
RESUME_PROBE_SEQUENCE: Final = 1 << 62
_PROBE_BATCH: Final = bytes(build_batch([b""], 0))
#: how long the stream must hold still before ``resume`` trusts its answer
RESUME_SETTLE_S: Final = 0.5


class RecordTooLargeError(SBPError, ValueError):
    """A record or batch that no APPEND could carry (larger than the
    producer's ``max_request_bytes``). Raised by ``send``, ``send_many`` and
    ``send_batch`` before anything of it is sent: retrying cannot help."""

    def __init__(self, size: int, limit: int, what: str = "record") -> None:
        super().__init__(
            f"a {what} of {size:,} bytes is larger than the largest one a request can "
            f"carry ({limit:,} bytes; see the producer's max_request_bytes)"
        )
        self.size = size
        self.limit = limit


class RecordHandle:
    """One record sent: ``await handle.offset()`` once it is durable."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: PendingBatch, index: int) -> None:
        self._batch = batch
        self._index = index

    @property
    def done(self) -> bool:
        """Stored or failed for good."""
        return self._batch.done.is_set()

    @property
    def attempts(self) -> int:
        """APPEND requests that carried the record so far: 0 means it never
        left (a failure then stored nothing), more than 1 that it was sent
        again after an answer was lost or refused (it may be stored twice:
        delivery is at-least-once)."""
        return self._batch.attempts

    async def offset(self) -> int:
        """The record's offset in the stream, once durable; raises the
        error that made its delivery fail."""
        return await self._batch.wait() + self._index


class RecordsHandle:
    """The records of one ``send_many`` or ``send_batch``: ``await handle.offsets()``."""

    __slots__ = ("_count", "_segments")

    def __init__(self, segments: list[tuple[PendingBatch, int, int]], count: int) -> None:
        #: (batch, first index in it, records) — the records may span batches
        self._segments = segments
        self._count = count

    def __len__(self) -> int:
        return self._count

    @property
    def done(self) -> bool:
        return all(batch.done.is_set() for batch, _, _ in self._segments)

    async def wait(self) -> None:
        """Until every record is durable; raises the first failure."""
        for batch, _, _ in self._segments:
            await batch.wait()

    async def settle(self) -> tuple[list[tuple[int, int]], BaseException | None]:
        """Wait until every record is stored or failed for good, without
        raising: the stored runs as (first offset, record count), in the
        order sent, and the first failure (None when all were stored)."""
        stored: list[tuple[int, int]] = []
        failure: BaseException | None = None
        for batch, first, count in self._segments:
            await batch.done.wait()
            if batch.error is None:
                stored.append((batch.base_offset + first, count))
            elif failure is None:
                failure = batch.error
        return stored, failure

    async def offsets(self) -> npt.NDArray[np.int64]:
        """Each record's offset, in the order sent."""
        out = np.empty(self._count, dtype=np.int64)
        position = 0
        for batch, first, count in self._segments:
            base = await batch.wait() + first
            out[position : position + count] = np.arange(base, base + count, dtype=np.int64)
            position += count
        return out


def _stamps_that_fit(
    batch: PendingBatch,
    low: npt.NDArray[np.int64],
    high: npt.NDArray[np.int64],
    now_ms: int,
) -> int:
    """How many of the next records fit the batch in time, given the running
    lowest and highest of their timestamps."""
    held = batch.stamp_range(now_ms)
    lo, hi = held if held is not None else (int(low[0]), int(high[0]))
    span = np.maximum(high, hi) - np.minimum(low, lo)
    too_wide = np.nonzero(span > MAX_TIMESTAMP_SPAN_MS - STAMP_MARGIN_MS)[0]
    return int(too_wide[0]) if len(too_wide) else len(low)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _check_value(value: bytes | None, key: bytes | None) -> None:
    """A null value is a tombstone: it says a key is deleted (SPEC §13)."""
    if value is None and key is None:
        raise ValueError("a record without a value is a tombstone and needs a key")


def _extra_sizes(
    keys: Sequence[bytes | None] | None,
    blocks: Sequence[bytes] | None,
    timestamps: Sequence[int | None] | None,
    count: int,
) -> npt.NDArray[np.int64]:
    """``extra_bytes`` of every record, a column at a time."""
    sizes = np.zeros(count, dtype=np.int64)
    if keys is not None:
        key_sizes = entry_lengths(keys)
        sizes += np.where(key_sizes >= 0, key_sizes + FIELD_OVERHEAD, 0)
    if blocks is not None:
        block_sizes = np.fromiter(map(len, blocks), dtype=np.int64, count=count)
        sizes += np.where(block_sizes > 0, block_sizes + FIELD_OVERHEAD, 0)
    if timestamps is not None:
        sizes += FIELD_OVERHEAD * np.fromiter(
            (t is not None for t in timestamps), dtype=np.int64, count=count
        )
    return sizes


class Producer:
    """Appends records to one stream (see the module docstring).

    ::

        async with Producer("127.0.0.1:7400", stream_id) as producer:
            handle = await producer.send(b"hello")
            many = await producer.send_many([b"a", b"b"])
            await producer.flush()
            print(await handle.offset(), await many.offsets())

    ``pm`` is the PM's address or a ``PMClient``; ``pool`` the connection
    pool to share (one is opened for the producer otherwise). Leaving the
    ``async with`` block flushes, unless it is left by an exception.
    """

    def __init__(
        self,
        pm: str | PMClient,
        stream_id: int,
        *,
        pool: ConnectionPool | None = None,
        tls: ssl.SSLContext | None = None,
        linger: float = DEFAULT_LINGER,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        batch_records: int = DEFAULT_BATCH_RECORDS,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_in_flight: int | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        delivery_timeout: float = DEFAULT_DELIVERY_TIMEOUT,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        idempotent: bool = True,
        name: str = "",
        epoch: int = -1,
        stop_after_loss: bool = False,
    ) -> None:
        if max_in_flight is None:
            max_in_flight = DEFAULT_IDEMPOTENT_IN_FLIGHT if idempotent else 1
        if batch_records < 1 or batch_bytes < 1 or max_in_flight < 1:
            raise ValueError("batch_records, batch_bytes and max_in_flight must be at least 1")
        if name and not idempotent:
            raise ValueError("a producer name is for idempotent producers (idempotent=True)")
        self.stream_id = stream_id
        self.max_request_bytes = max_request_bytes
        self.max_in_flight = max_in_flight
        self.request_timeout = request_timeout
        self.idempotent = idempotent
        self.name = name
        #: asked of INIT_PRODUCER: -1 the next epoch (fencing the instance
        #: before), E >= 0 at least E (the same E again continues it)
        self.epoch = epoch
        #: after a batch is lost, send nothing more (the records stored are
        #: then the first ones sent, which ``stored`` counts) rather than go
        #: on under a new epoch; a producer pinned to an epoch always stops
        self.stop_after_loss = stop_after_loss or epoch >= 0
        self._context = ClientContext(pm, pool, request_timeout, tls)
        self._sender: Sender | None = None
        self._batches = Accumulator(
            linger=linger,
            batch_bytes=batch_bytes,
            batch_records=batch_records,
            buffer_bytes=buffer_bytes,
            delivery_timeout=delivery_timeout,
            wake_sender=self._wake_sender,
            idempotent=idempotent,
        )
        self._stack = AsyncExitStack()
        self._nursery: trio.Nursery | None = None

    def _wake_sender(self) -> None:
        if self._sender is not None:
            self._sender.wake()

    # -- lifetime -------------------------------------------------------------

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._context)
            identity = None
            if self.idempotent:
                identity = await self._context.pm.init_producer(self.name, self.epoch)
            self._sender = Sender(
                self.stream_id,
                self._batches,
                self._context,
                StreamRoutes(self._context.pm, self.stream_id),
                max_in_flight=self.max_in_flight,
                max_request_bytes=self.max_request_bytes,
                request_timeout=self.request_timeout,
                producer=identity,
                # pinned to an epoch (resume): a lost batch stops it instead
                new_epoch=None if self.stop_after_loss else self._new_epoch,
            )
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(self._sender.run)
            self._nursery.start_soon(self._batches.linger_loop)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is None:
                await self.flush()
        finally:
            self._batches.closing = True
            self._batches.fail_unfinished(
                ProducerClosedError("the producer closed before delivery")
            )
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            # The caller's exception propagates as it is, not wrapped in the
            # ExceptionGroup of our nursery: the stack exits as if all went well.
            await self._stack.__aexit__(None, None, None)

    @property
    def producer(self) -> tuple[int, int] | None:
        """(producer id, epoch) now, once started (idempotent only): the
        sender's, which moves on when its sequences start again."""
        return None if self._sender is None else self._sender.producer

    async def _new_epoch(self) -> tuple[int, int]:
        return await self._context.pm.init_producer(self.name, -1)

    async def resume(self, settle_s: float = RESUME_SETTLE_S) -> int:
        """How many records of this producer and epoch the stream holds (the
        sequence it expects next), which the next record sent then gets: a
        named producer that runs again at the same epoch over the same input
        skips that many records and stores the rest once. Call it before
        anything is sent; an earlier instance's requests still on their way
        are stored first (``_held_sequence``; a caller that knows an earlier
        instance may still be sending waits longer)."""
        if self.producer is None or self._sender is None:
            raise ProducerClosedError("resume() needs a started idempotent producer")
        if self._batches.unfinished or self._batches.next_sequence:
            raise ProducerClosedError("resume() comes before anything is sent")
        held = await self._held_sequence(settle_s)
        self._batches.next_sequence = held
        return held

    async def stored(self, settle_s: float = RESUME_SETTLE_S) -> int | None:
        """How many records this producer's run stored in the stream, asked
        of the stream as ``resume`` asks, so that the records whose answers
        were lost (a timeout) count too: the first that many records sent
        are stored, the rest are not. None when it cannot be known: the
        sequences started again under a new epoch during the run, or the
        stream does not answer."""
        sender = self._sender
        if sender is None or sender.producer is None or sender.sequences_restarted:
            return None
        try:
            return await self._held_sequence(settle_s)
        except (SBPError, OSError, trio.TooSlowError):
            return None

    async def _held_sequence(self, settle_s: float) -> int:
        """The sequence the stream expects next of this producer and epoch.
        The open range's primary is asked with a batch it can never store (a
        sequence far past any), retrying as the producer does, until two
        answers ``settle_s`` apart agree: requests still on their way (a
        Spark task attempt that died while they travelled, or this
        producer's own that timed out) are stored first."""
        assert self.producer is not None
        producer_id, epoch = self.producer
        probe = ProducerStamp(producer_id, epoch, RESUME_PROBE_SEQUENCE)
        routes = StreamRoutes(self._context.pm, self.stream_id)

        async def ask() -> int:
            await routes.refresh()
            rng = routes.open_range()
            if rng is None:
                raise RangeNotFoundError(f"stream {self.stream_id} has no open range")
            node = self._context.node(primary_of(rng))
            (result,) = await node.append(
                [(self.stream_id, _PROBE_BATCH)], producers=[probe], timeout=self.request_timeout
            )
            if result.error_code == ErrorCode.UNKNOWN_PRODUCER:
                return 0  # this epoch never appended to the stream
            if result.error_code == ErrorCode.OUT_OF_ORDER_SEQUENCE:
                return int(result.next_sequence)
            raise error_for(result.error_code, result.error_message or "probe was stored")

        with trio.fail_after(self._batches.delivery_timeout):
            held = await until_deadline(ask, f"asking for producer {producer_id}'s sequence")
            while True:
                await trio.sleep(settle_s)
                again = await until_deadline(ask, f"asking for producer {producer_id}'s sequence")
                if again == held:
                    return held
                held = again

    # -- sending --------------------------------------------------------------

    async def send(
        self,
        value: bytes | None,
        key: bytes | None = None,
        headers: Headers | None = None,
        timestamp: int | None = None,
    ) -> RecordHandle:
        """Add one record; returns at once unless the buffer is full. ``key``,
        ``headers`` ((name, value) pairs or a mapping; names may repeat) and
        ``timestamp`` (ms since the Unix epoch; by default the time its
        batch is made) are optional (SPEC §13): a record with none of them
        costs no more than a value alone. A ``None`` value with a key is a
        tombstone. Raises ``RecordTooLargeError`` for a record no request
        could carry, and ``ProducerFencedError`` once a newer instance of
        this producer runs."""
        self._check_fenced()
        block = header_block(headers)
        _check_value(value, key)
        extra = extra_bytes(key, block, timestamp) if key or block or timestamp else 0
        size = (0 if value is None else len(value)) + extra
        self._check_record_size(size)
        if self._batches.buffered >= self._batches.buffer_bytes:
            await self._batches.wait_for_space()
        batch = self._batches.open_batch()
        stamp = _now_ms() if timestamp is None else timestamp
        if (timestamp is not None or batch.stamps is not None) and not batch.takes_stamps(
            stamp, stamp, stamp if timestamp is None else _now_ms()
        ):
            self._batches.close_open_batch()  # too far in time from its records: a new batch
            batch = self._batches.open_batch()
        if (
            extra
            or value is None
            or batch.keys is not None
            or batch.headers is not None
            or (batch.timestamps is not None)
        ):
            batch.add(value, key, block, timestamp)
        else:
            batch.values.append(value)
        batch.nbytes += size + RECORD_OVERHEAD
        handle = RecordHandle(batch, len(batch.values) - 1)
        if self._batches.is_full(batch):
            self._batches.close_open_batch()
            # Let the sender run: a loop of sends never blocks otherwise.
            await trio.lowlevel.checkpoint()
        return handle

    async def send_many(
        self,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None = None,
        headers: Sequence[Headers | None] | None = None,
        timestamps: Sequence[int | None] | None = None,
    ) -> RecordsHandle:
        """Add records in order; ``keys``, ``headers`` and ``timestamps``, when
        given, hold one entry per record (None: none). Without them the work
        per record is a length and a slice. Raises ``RecordTooLargeError``,
        with none of them added, when one is larger than a request may carry."""
        self._check_fenced()
        count = len(values)
        if count == 0:
            return RecordsHandle([], 0)
        for name, column in (("keys", keys), ("headers", headers), ("timestamps", timestamps)):
            if column is not None and len(column) != count:
                raise ValueError(f"{count} values but {len(column)} {name}")
        now_ms = _now_ms()
        stamps = (
            None
            if timestamps is None
            else np.fromiter(
                (now_ms if t is None else t for t in timestamps), dtype=np.int64, count=count
            )
        )
        blocks = None if headers is None else header_blocks(headers)
        plain = keys is None and blocks is None and timestamps is None
        if plain:
            sizes = np.fromiter(map(len, values), dtype=np.int64, count=count)  # type: ignore[arg-type]
        else:
            sizes = _extra_sizes(keys, blocks, timestamps, count)
            value_sizes = entry_lengths(values)
            if value_sizes.min() < 0:  # tombstones: each needs a key
                for i in np.nonzero(value_sizes < 0)[0].tolist():
                    _check_value(None, None if keys is None else keys[i])
            sizes += np.maximum(value_sizes, 0)
        self._check_record_size(int(sizes.max()))
        if self._batches.buffered >= self._batches.buffer_bytes:
            await self._batches.wait_for_space()
        sizes += RECORD_OVERHEAD
        ends = np.cumsum(sizes)  # bytes used by values[:i+1]
        segments: list[tuple[PendingBatch, int, int]] = []
        start = 0
        used = 0  # ends[start - 1], the bytes taken so far
        while start < count:
            batch = self._batches.open_batch()
            room_records = self._batches.batch_records - len(batch.values)
            room_bytes = self._batches.batch_bytes - batch.nbytes
            # records that fit the byte limit: the one crossing it still goes in
            fit = int(np.searchsorted(ends, used + room_bytes, side="left")) - start + 1
            take = max(1, min(room_records, fit, count - start))
            if stamps is not None:
                # no further in time from the batch's records than a batch spans
                low = np.minimum.accumulate(stamps[start : start + take])
                high = np.maximum.accumulate(stamps[start : start + take])
                if not batch.takes_stamps(int(low[-1]), int(high[-1]), now_ms):
                    take = _stamps_that_fit(batch, low, high, now_ms)
                    if take == 0:
                        self._batches.close_open_batch()
                        continue
            end = start + take
            if plain and batch.keys is None and batch.headers is None and batch.timestamps is None:
                batch.values.extend(values[start:end])
            else:
                batch.extend(
                    values[start:end],
                    None if keys is None else keys[start:end],
                    None if blocks is None else blocks[start:end],
                    None if timestamps is None else timestamps[start:end],
                )
                if stamps is not None and timestamps is not None:
                    given = [t for t in timestamps[start:end] if t is not None]
                    if given:
                        batch.note_stamps(min(given), max(given))
            taken = int(ends[end - 1]) - used
            batch.nbytes += taken
            used += taken
            segments.append((batch, len(batch.values) - take, take))
            if self._batches.is_full(batch):
                self._batches.close_open_batch()
            start = end
        await trio.lowlevel.checkpoint()
        return RecordsHandle(segments, count)

    async def send_batch(self, batch: Buffer) -> RecordsHandle:
        """Add a record batch built by the caller (``sbp.batches``), as it is.

        It travels as one batch of an APPEND, after every record sent before
        it and with the same routing and retries; records sent before it are
        closed into a batch of their own first. The buffer is sent without
        a copy, so it must not change until the records are durable. Raises
        ``InvalidRecordBatchError`` for a malformed batch (the CRC is left
        to the data node) and ``RecordTooLargeError`` (a ``ValueError``) for
        one larger than ``max_request_bytes``.
        """
        self._check_fenced()
        data = memoryview(batch).cast("B")
        header = validate_batch(data, verify_crc=False)
        if len(data) > self.max_request_bytes:
            raise RecordTooLargeError(len(data), self.max_request_bytes, "batch")
        if self._batches.buffered >= self._batches.buffer_bytes:
            await self._batches.wait_for_space()
        # Sequence numbers give the order: what was sent before goes first.
        self._batches.close_open_batch()
        built = self._batches.new_batch()
        built.data = data
        self._batches.enqueue_encoded(built)
        await trio.lowlevel.checkpoint()
        return RecordsHandle([(built, 0, header.record_count)], header.record_count)

    async def flush(self) -> None:
        """Send what is buffered now and wait until it is durable; raises the
        first delivery failure among those records."""
        self._batches.close_open_batch()
        waiting = list(self._batches.unfinished.values())
        error: BaseException | None = None
        for batch in waiting:
            await batch.done.wait()
            if error is None and batch.error is not None:
                error = batch.error
        if error is not None:
            raise error

    @property
    def max_record_bytes(self) -> int:
        """The largest record value a request can carry: alone in its batch,
        after the batch header and its length word (a key, headers or a
        timestamp count against it too, with a length word each)."""
        return self.max_request_bytes - BATCH_HEADER_SIZE - RECORD_OVERHEAD

    def _check_fenced(self) -> None:
        if self._sender is not None and self._sender.fenced is not None:
            raise self._sender.fenced

    def _check_record_size(self, largest: int) -> None:
        if largest > self.max_record_bytes:
            raise RecordTooLargeError(largest, self.max_record_bytes)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of records not yet durable (waiting or in flight)."""
        return self._batches.buffered
