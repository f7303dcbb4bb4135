"""``Producer``: appends records to one stream, in batches, with retries.

Records accumulate in an open batch until it holds ``batch_records`` records
or ``batch_bytes`` bytes, or ``linger`` seconds have passed since its first
record. Closed batches are encoded at once (``sbp.batches``, numpy) and wait
in order for the sender, as do batches the caller encoded (``send_batch``),
which travel as they are. The sender packs as many as fit in
``max_request_bytes`` into one APPEND to the primary of the stream's open
range, with up to ``max_in_flight`` requests on the connection at a time.

Failure handling: a retriable answer (RANGE_SEALED, RANGE_NOT_FOUND,
NOT_PRIMARY, TIMEOUT, a lost connection …) stops the sender; it waits for
the requests still in flight, lists the ranges again from the PM, backs off
and sends the failed batches again, oldest first, until ``delivery_timeout``
runs out. A request whose answer was lost may have been applied, so a retry
can store a batch twice: delivery is at-least-once.

Ordering: with ``max_in_flight=1`` (the default) one stream's records are
stored in the order they were sent, across seals and retries, because the
data node applies one request's batches in one commit and a request goes
only after the one before it was answered. With more requests in flight, a
batch behind a failed one may be stored before the failed one's retry (the
failed one's range was sealed and the next range opened on the same node
while it travelled): more throughput per stream, order only without failures.
"""

from __future__ import annotations

import bisect
import logging
import math
import ssl
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Final, Self

import numpy as np
import numpy.typing as npt
import trio

from net.calls import header_as
from net.connection import Connection
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import BATCH_HEADER_SIZE, Buffer, build_batch, validate_batch
from sbp.enums import ErrorCode, Opcode
from sbp.errors import ProtocolError, RangeNotFoundError, SBPError, error_for

from ._base import DEADLINE_GRACE
from ._routing import ClientContext, StreamRoutes, primary_of
from .pm_client import PMClient
from .retry import is_transient, retry_delay

log = logging.getLogger(__name__)

#: answers after which the producer asks the PM to seal the range it wrote to
#: (SPEC §7): too few replicas took the batch, or the primary sealed the range
#: on a seal request whose end the PM never recorded (a seal that ran out of
#: answers). Sealing a range the PM has sealed already only returns it.
_SEAL_ON: Final = frozenset({ErrorCode.NOT_ENOUGH_REPLICAS, ErrorCode.RANGE_SEALED})

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
#: per-record bytes a batch adds to the values: the uint32 length
_RECORD_OVERHEAD: Final = 4


class ProducerClosedError(SBPError):
    """``send`` on a producer that is closed or closing."""


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


class _Batch:
    """Records that travel together: filled while open, then encoded once.

    ``done`` is set when the batch is durable (``base_offset``) or has
    failed for good (``error``).
    """

    __slots__ = (
        "attempts",
        "base_offset",
        "data",
        "deadline",
        "done",
        "error",
        "nbytes",
        "opened_at",
        "seq",
        "values",
    )

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.values: list[bytes] = []
        self.nbytes = 0
        self.opened_at = 0.0
        self.data: bytearray | memoryview | None = None
        self.deadline = math.inf
        self.done = trio.Event()
        self.base_offset = -1
        self.error: BaseException | None = None
        #: APPEND requests that carried it (more than one: it was retried)
        self.attempts = 0

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


class RecordHandle:
    """One record sent: ``await handle.offset()`` once it is durable."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: _Batch, index: int) -> None:
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

    def __init__(self, segments: list[tuple[_Batch, int, int]], count: int) -> None:
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
        max_in_flight: int = 1,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        delivery_timeout: float = DEFAULT_DELIVERY_TIMEOUT,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        if batch_records < 1 or batch_bytes < 1 or max_in_flight < 1:
            raise ValueError("batch_records, batch_bytes and max_in_flight must be at least 1")
        self.stream_id = stream_id
        self.linger = linger
        self.batch_bytes = batch_bytes
        self.batch_records = batch_records
        self.max_request_bytes = max_request_bytes
        self.max_in_flight = max_in_flight
        self.buffer_bytes = buffer_bytes
        self.delivery_timeout = delivery_timeout
        self.request_timeout = request_timeout
        self._context = ClientContext(pm, pool, request_timeout, tls)
        self._routes: StreamRoutes | None = None
        self._stack = AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        self._next_seq = 0
        self._open: _Batch | None = None
        #: closed batches waiting for the sender, oldest (lowest seq) first
        self._ready: list[_Batch] = []
        self._ready_seqs: list[int] = []
        #: every batch not yet durable or failed, by seq
        self._unfinished: dict[int, _Batch] = {}
        self._buffered = 0
        self._in_flight = 0
        self._failures = 0
        self._retrying = False
        #: the range to seal before the next retry (it lacked replicas)
        self._seal_wanted: int | None = None
        self._closing = False
        self._wake_sender = trio.Event()
        self._wake_linger = trio.Event()
        self._space = trio.Event()
        self._idle = trio.Event()
        #: set when the previous request's frame is queued on its connection
        self._last_sent = trio.Event()
        self._last_sent.set()

    # -- lifetime -------------------------------------------------------------

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._context)
            self._routes = StreamRoutes(self._context.pm, self.stream_id)
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(self._send_loop)
            self._nursery.start_soon(self._linger_loop)
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
            self._closing = True
            self._fail_unfinished(ProducerClosedError("the producer closed before delivery"))
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            # The caller's exception propagates as it is, not wrapped in the
            # ExceptionGroup of our nursery: the stack exits as if all went well.
            await self._stack.__aexit__(None, None, None)

    # -- sending --------------------------------------------------------------

    async def send(self, value: bytes) -> RecordHandle:
        """Add one record; returns at once unless the buffer is full. Raises
        ``RecordTooLargeError`` for a record no request could carry."""
        self._check_record_size(len(value))
        if self._buffered >= self.buffer_bytes:
            await self._wait_for_space()
        batch = self._open or self._start_batch()
        batch.values.append(value)
        batch.nbytes += len(value) + _RECORD_OVERHEAD
        handle = RecordHandle(batch, len(batch.values) - 1)
        if len(batch.values) >= self.batch_records or batch.nbytes >= self.batch_bytes:
            self._close_open_batch()
            # Let the sender run: a loop of sends never blocks otherwise.
            await trio.lowlevel.checkpoint()
        return handle

    async def send_many(self, values: Sequence[bytes]) -> RecordsHandle:
        """Add records in order; the work per record is a length and a slice.
        Raises ``RecordTooLargeError``, with none of them added, when one is
        larger than a request may carry."""
        count = len(values)
        if count == 0:
            return RecordsHandle([], 0)
        sizes = np.fromiter(map(len, values), dtype=np.int64, count=count)
        self._check_record_size(int(sizes.max()))
        if self._buffered >= self.buffer_bytes:
            await self._wait_for_space()
        sizes += _RECORD_OVERHEAD
        ends = np.cumsum(sizes)  # bytes used by values[:i+1]
        segments: list[tuple[_Batch, int, int]] = []
        start = 0
        used = 0  # ends[start - 1], the bytes taken so far
        while start < count:
            batch = self._open or self._start_batch()
            room_records = self.batch_records - len(batch.values)
            room_bytes = self.batch_bytes - batch.nbytes
            # records that fit the byte limit: the one crossing it still goes in
            fit = int(np.searchsorted(ends, used + room_bytes, side="left")) - start + 1
            take = max(1, min(room_records, fit, count - start))
            end = start + take
            batch.values.extend(values[start:end])
            taken = int(ends[end - 1]) - used
            batch.nbytes += taken
            used += taken
            segments.append((batch, len(batch.values) - take, take))
            if len(batch.values) >= self.batch_records or batch.nbytes >= self.batch_bytes:
                self._close_open_batch()
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
        data = memoryview(batch).cast("B")
        header = validate_batch(data, verify_crc=False)
        if len(data) > self.max_request_bytes:
            raise RecordTooLargeError(len(data), self.max_request_bytes, "batch")
        if self._buffered >= self.buffer_bytes:
            await self._wait_for_space()
        # Sequence numbers give the order: what was sent before goes first.
        self._close_open_batch()
        built = self._new_batch()
        built.data = data
        self._enqueue_encoded(built)
        await trio.lowlevel.checkpoint()
        return RecordsHandle([(built, 0, header.record_count)], header.record_count)

    async def flush(self) -> None:
        """Send what is buffered now and wait until it is durable; raises the
        first delivery failure among those records."""
        self._close_open_batch()
        waiting = list(self._unfinished.values())
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
        after the batch header and its length word."""
        return self.max_request_bytes - BATCH_HEADER_SIZE - _RECORD_OVERHEAD

    def _check_record_size(self, largest: int) -> None:
        if largest > self.max_record_bytes:
            raise RecordTooLargeError(largest, self.max_record_bytes)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of records not yet durable (waiting or in flight)."""
        return self._buffered

    # -- batches --------------------------------------------------------------

    def _new_batch(self) -> _Batch:
        """A batch with the next sequence number, counted as unfinished."""
        if self._closing:
            raise ProducerClosedError("the producer is closed")
        batch = _Batch(self._next_seq)
        batch.opened_at = trio.current_time()
        self._next_seq += 1
        self._unfinished[batch.seq] = batch
        return batch

    def _start_batch(self) -> _Batch:
        """Open a batch for records to come; the linger clock starts."""
        batch = self._new_batch()
        self._open = batch
        self._wake_linger.set()
        return batch

    def _close_open_batch(self) -> None:
        """Encode the open batch and queue it for the sender."""
        batch = self._open
        if batch is None:
            return
        self._open = None
        batch.data = build_batch(batch.values, int(time.time() * 1000))
        batch.values = []  # the encoded batch holds them now
        self._enqueue_encoded(batch)

    def _enqueue_encoded(self, batch: _Batch) -> None:
        """Count an encoded batch as buffered and queue it for the sender."""
        assert batch.data is not None
        batch.nbytes = len(batch.data)
        batch.deadline = trio.current_time() + self.delivery_timeout
        self._buffered += batch.nbytes
        self._queue(batch)

    def _queue(self, batch: _Batch) -> None:
        index = bisect.bisect_left(self._ready_seqs, batch.seq)
        self._ready.insert(index, batch)
        self._ready_seqs.insert(index, batch.seq)
        self._wake_sender.set()

    def _finish(self, batch: _Batch) -> None:
        self._unfinished.pop(batch.seq, None)
        self._buffered -= batch.nbytes
        if self._buffered < self.buffer_bytes:
            self._space.set()

    def _fail_unfinished(self, error: BaseException) -> None:
        for batch in list(self._unfinished.values()):
            if not batch.done.is_set():
                batch.fail(error)
        self._unfinished.clear()
        self._ready.clear()
        self._ready_seqs.clear()
        self._open = None

    async def _wait_for_space(self) -> None:
        while self._buffered >= self.buffer_bytes:
            if self._closing:
                raise ProducerClosedError("the producer is closed")
            self._space = trio.Event()
            await self._space.wait()

    async def _linger_loop(self) -> None:
        """Close the open batch ``linger`` seconds after it was started."""
        while True:
            await self._wake_linger.wait()
            self._wake_linger = trio.Event()
            batch = self._open
            if batch is None:
                continue
            await trio.sleep_until(batch.opened_at + self.linger)
            if self._open is batch:
                self._close_open_batch()

    # -- the sender -----------------------------------------------------------

    async def _send_loop(self) -> None:
        assert self._routes is not None
        async with trio.open_nursery() as requests:
            while True:
                if not self._ready or self._in_flight >= self.max_in_flight:
                    self._wake_sender = trio.Event()
                    await self._wake_sender.wait()
                    continue
                if self._retrying:
                    if self._in_flight:
                        self._wake_sender = trio.Event()
                        await self._wake_sender.wait()
                        continue
                    await self._recover()
                    continue
                rng = self._routes.open_range()
                if rng is None:
                    await self._refresh_or_fail()
                    continue
                try:
                    node = self._context.node(primary_of(rng))
                    connection = await node.connection()
                except (SBPError, OSError) as error:
                    self._on_request_failed(list(self._ready), error)
                    continue
                batches = self._take_request()
                previous, sent = self._last_sent, trio.Event()
                self._last_sent = sent
                self._in_flight += 1
                requests.start_soon(
                    self._request, connection, rng.range_index, batches, previous, sent
                )

    def _take_request(self) -> list[_Batch]:
        """The oldest ready batches that fit one request (at least one)."""
        total = 0
        count = 0
        for batch in self._ready:
            size = batch.size()
            if count and total + size > self.max_request_bytes:
                break
            total += size
            count += 1
        taken = self._ready[:count]
        del self._ready[:count]
        del self._ready_seqs[:count]
        return taken

    async def _request(
        self,
        connection: Connection,
        range_index: int,
        batches: list[_Batch],
        previous: trio.Event,
        sent: trio.Event,
    ) -> None:
        retry: list[_Batch] = []
        error: BaseException | None = None
        try:
            infos = tuple(
                messages.AppendInfo(
                    stream_id=self.stream_id, request_index=i, batch_length=batch.size()
                )
                for i, batch in enumerate(batches)
            )
            header = messages.AppendRequest(
                timeout_ms=int(self.request_timeout * 1000), append_requests=infos
            )
            payload = b"".join(batch.data for batch in batches if batch.data is not None)
            for batch in batches:
                batch.attempts += 1
            # Requests leave in the order the sender made them: the data node
            # applies one connection's requests in arrival order.
            await previous.wait()
            results: dict[int, messages.AppendResult] = {}
            try:
                async with connection.stream(
                    Opcode.APPEND,
                    header,
                    payload,
                    timeout=self.request_timeout + DEADLINE_GRACE,
                ) as responses:
                    sent.set()
                    async for response in responses:
                        reply = header_as(response, messages.AppendResponse)
                        for item in reply.append_responses:
                            results[item.request_index] = item
            finally:
                sent.set()
            for index, batch in enumerate(batches):
                result = results.get(index)
                if result is None:
                    retry.append(batch)
                    error = ProtocolError(f"no APPEND result for batch {index}")
                elif result.error_code == ErrorCode.NONE:
                    self._finish(batch)
                    batch.resolve(result.base_offset)
                else:
                    item_error = error_for(result.error_code, result.error_message)
                    if result.error_code in _SEAL_ON:
                        self._seal_wanted = range_index
                    if is_transient(item_error):
                        retry.append(batch)
                        error = item_error
                    else:
                        self._finish(batch)
                        batch.fail(item_error)
            if not retry:
                self._failures = 0
        except (SBPError, OSError, trio.TooSlowError) as exc:
            if not is_transient(exc):
                for batch in batches:
                    self._finish(batch)
                    batch.fail(exc)
            else:
                retry, error = batches, exc
        finally:
            self._in_flight -= 1
            self._wake_sender.set()
        if retry:
            assert error is not None
            self._on_request_failed(retry, error)

    def _on_request_failed(self, batches: list[_Batch], error: BaseException) -> None:
        """Queue ``batches`` again (in order), or fail those past their deadline."""
        now = trio.current_time()
        for batch in batches:
            if batch in self._ready:
                continue
            if now >= batch.deadline:
                self._finish(batch)
                batch.fail(error)
            else:
                self._queue(batch)
        # Batches still waiting are judged by the same deadline rule.
        for batch in [b for b in self._ready if now >= b.deadline]:
            index = self._ready.index(batch)
            del self._ready[index]
            del self._ready_seqs[index]
            self._finish(batch)
            batch.fail(error)
        self._retrying = True
        self._wake_sender.set()

    async def _recover(self) -> None:
        """After a failure, with nothing in flight: back off, list the ranges
        again. A range that could not get enough replicas to hold a batch
        (NOT_ENOUGH_REPLICAS), or that its primary refused as sealed, is
        sealed first (SPEC §7; idempotent on the PM): the PM ends it where
        its acknowledged records end and opens the next one on live nodes,
        where the batches not acknowledged are sent again, in order. A dead
        primary is sealed by the PM itself once it misses its heartbeats."""
        self._failures += 1
        await trio.sleep(retry_delay(self._failures))
        self._retrying = False
        if self._seal_wanted is not None:
            await self._seal(self._seal_wanted)
            self._seal_wanted = None
        await self._refresh_or_fail()

    async def _seal(self, range_index: int) -> None:
        try:
            await self._context.pm.seal_range(self.stream_id, range_index)
        except (SBPError, OSError, trio.TooSlowError) as error:
            # Sealed already by someone else, or the PM cannot yet: the
            # refresh that follows shows which, and the retry goes on.
            log.info("stream %d: sealing range %d failed: %s", self.stream_id, range_index, error)

    async def _refresh_or_fail(self) -> None:
        assert self._routes is not None
        try:
            await self._routes.refresh()
        except (SBPError, OSError, trio.TooSlowError) as error:
            if not is_transient(error):
                self._fail_waiting(error)
                return
            self._failures += 1
            self._on_request_failed([], error)
            return
        if self._routes.open_range() is None:
            # Between a seal and the next range's creation, or a deleted stream.
            self._failures += 1
            self._on_request_failed(
                [], RangeNotFoundError(f"stream {self.stream_id} has no open range")
            )

    def _fail_waiting(self, error: BaseException) -> None:
        for batch in self._ready:
            self._finish(batch)
            batch.fail(error)
        self._ready.clear()
        self._ready_seqs.clear()
