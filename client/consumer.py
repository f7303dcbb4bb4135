"""``Consumer``: reads one stream from an offset, across its ranges and data nodes.

A fetcher task walks the stream: it finds the range holding the next offset
(the PM's LIST_RANGES, cached), FETCHes from that range's primary, reads the
next offset from the last batch header of the answer and asks for the next
chunk at once, so up to ``prefetch`` answers wait, already received, while the
caller decodes the one before. Decoding verifies the CRC-32C of every batch:
a corrupt batch raises ``InvalidRecordBatchError``, it is never skipped.

At a sealed range's end the fetcher moves to the next range. A data node's
RANGE_SEALED, RANGE_NOT_FOUND or NOT_PRIMARY, OFFSET_OUT_OF_RANGE at a range
end, or a connection that fails, makes it list the ranges again and retry,
with backoff, for up to ``retry_timeout`` seconds.

Without ``tail`` the consumer stops at the end of the stream as it is when
the fetcher gets there; with ``tail`` it long-polls (``max_wait_ms``) for
new records and never stops by itself. At the tail it talks to the data
node alone: the PM is asked again only when the node says the range moved
(a seal) or cannot be reached, so a tail outlives a PM restart.

``from_offset`` None (the default) starts at the stream's first stored
offset, as ``sbp read`` does, so a trimmed stream reads from where its data
begins.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import numpy as np
import trio

from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import BATCH_HEADER, DecodedRecords, batch_spans, decode_batches
from sbp.enums import ErrorCode
from sbp.errors import (
    InvalidRecordBatchError,
    OffsetOutOfRangeError,
    SBPError,
    error_for,
)

from ._routing import (
    STALE_ROUTE_CODES,
    ClientContext,
    StreamRoutes,
    replica_for_read,
)
from .pm_client import PMClient
from .retry import is_transient, retry_delay

#: bytes asked per FETCH: 1 MiB chunks read faster here than 4-16 MiB ones
#: (less to buffer per frame, warmer caches; see docs/benchmarks.md)
DEFAULT_FETCH_BYTES: Final = 1 << 20
DEFAULT_PREFETCH: Final = 4
DEFAULT_MAX_WAIT_MS: Final = 500
DEFAULT_RETRY_TIMEOUT: Final = 60.0
DEFAULT_REQUEST_TIMEOUT: Final = 10.0


@dataclass(frozen=True, slots=True)
class Record:
    """One record as a consumer yields it."""

    offset: int
    timestamp: int
    value: bytes


class _End:
    """Sent by the fetcher after the last chunk (without ``tail``)."""


_END: Final = _End()


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One FETCH answer: whole batches, the first record wanted, the next offset."""

    data: memoryview
    first_wanted: int


class Consumer:
    """Reads one stream (see the module docstring).

    ::

        async with Consumer("127.0.0.1:7400", stream_id, from_offset=0) as consumer:
            async for records in consumer:  # sbp.batches.DecodedRecords
                print(records.offsets, records.to_list())

    ``records()`` yields one ``Record`` at a time instead. ``pm`` is the
    PM's address or a ``PMClient``; ``pool`` the connection pool to share.
    """

    def __init__(
        self,
        pm: str | PMClient,
        stream_id: int,
        from_offset: int | None = None,
        *,
        pool: ConnectionPool | None = None,
        tls: ssl.SSLContext | None = None,
        tail: bool = False,
        max_wait_ms: int = DEFAULT_MAX_WAIT_MS,
        fetch_bytes: int = DEFAULT_FETCH_BYTES,
        prefetch: int = DEFAULT_PREFETCH,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        if from_offset is not None and from_offset < 0:
            raise ValueError("from_offset must be >= 0")
        if prefetch < 1 or fetch_bytes < 1:
            raise ValueError("prefetch and fetch_bytes must be at least 1")
        self.stream_id = stream_id
        self.from_offset = from_offset
        self.tail = tail
        self.max_wait_ms = max_wait_ms
        self.fetch_bytes = fetch_bytes
        self.prefetch = prefetch
        self.retry_timeout = retry_timeout
        self._context = ClientContext(pm, pool, request_timeout, tls)
        self._stack = AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        send, receive = trio.open_memory_channel[_Chunk | _End | BaseException](prefetch)
        self._send = send
        self._receive = receive
        self._finished = False
        #: the offset after the last record handed out (the start until then;
        #: with ``from_offset`` None, known once the ranges were listed)
        self.position = 0 if from_offset is None else from_offset

    # -- lifetime -------------------------------------------------------------

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._context)
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(self._fetch_loop)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        # The caller's exception propagates as it is, not wrapped in the
        # ExceptionGroup of our nursery: the stack exits as if all went well.
        await self._stack.__aexit__(None, None, None)

    # -- reading --------------------------------------------------------------

    async def next_batch(self) -> DecodedRecords | None:
        """The next records, decoded and CRC-checked; None at the end of the
        stream (never, with ``tail``)."""
        if self._finished:
            return None
        item = await self._receive.receive()
        if isinstance(item, _End):
            self._finished = True
            return None
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        records = decode_batches(item.data)
        if len(records) and records.offsets[0] < item.first_wanted:
            records = _drop_before(records, item.first_wanted)
        if len(records):
            self.position = int(records.offsets[-1]) + 1
        return records

    def __aiter__(self) -> AsyncIterator[DecodedRecords]:
        return _Batches(self)

    def records(self) -> AsyncIterator[Record]:
        """One ``Record`` at a time (a Python object per record: for
        convenience; iterate over batches for bulk reads)."""
        return _Records(self)

    # -- the fetcher ----------------------------------------------------------

    async def _fetch_loop(self) -> None:
        try:
            await self._walk()
        except (SBPError, OSError, trio.TooSlowError) as error:
            await self._send.send(error)
        else:
            await self._send.send(_END)

    async def _walk(self) -> None:
        """Fetch chunk after chunk from ``from_offset`` to the end (or forever)."""
        routes = StreamRoutes(self._context.pm, self.stream_id)
        await self._retrying(routes.refresh)
        offset = routes.first_offset if self.from_offset is None else self.from_offset
        if self.from_offset is None:
            self.position = offset
        failures = 0
        failing_since: float | None = None
        while True:
            rng = routes.range_for(offset)
            if rng is None:
                rng = await self._locate(routes, offset)
            sealed = not rng.is_open
            wait_ms = self.max_wait_ms if self.tail and not sealed else 0
            try:
                result, data = await self._fetch(rng, offset, wait_ms, failures)
                code = ErrorCode.coerce(result.error_code)
                if code != ErrorCode.NONE:
                    raise error_for(code, result.error_message)
            except OffsetOutOfRangeError:
                # Stale only if the ranges changed under us (a seal at this offset).
                await self._retrying(routes.refresh)
                again = routes.range_for(offset)
                if again is not None and again.range_index == rng.range_index:
                    raise
                continue
            except (SBPError, OSError, trio.TooSlowError) as error:
                if not is_transient(error):
                    raise
                now = trio.current_time()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since > self.retry_timeout:
                    raise
                failures += 1
                if failures > 1 or getattr(error, "code", None) not in STALE_ROUTE_CODES:
                    await trio.sleep(retry_delay(failures))
                await self._retrying(routes.refresh)
                continue
            failures, failing_since = 0, None
            if len(data):
                next_offset = _next_offset(data)
                if next_offset <= offset:
                    raise InvalidRecordBatchError(
                        f"FETCH at {offset} of stream {self.stream_id} returned batches "
                        f"ending at {next_offset}"
                    )
                await self._send.send(_Chunk(data, offset))
                offset = next_offset
                continue
            # Nothing at ``offset``: the tail of the open range, or a range
            # sealed since it was listed.
            if sealed and offset < rng.end_offset:
                raise OffsetOutOfRangeError(
                    f"range {rng.range_index} of stream {self.stream_id} returned nothing "
                    f"at {offset}, before its end {rng.end_offset}"
                )
            if not sealed:
                # The open range's tail: the node answers RANGE_SEALED once a
                # seal moves the stream on, so the PM is not needed here.
                if not self.tail:
                    return
                continue
            await self._retrying(routes.refresh)

    async def _locate(self, routes: StreamRoutes, offset: int) -> messages.Range:
        """The range holding ``offset`` after listing the ranges again."""
        await self._retrying(routes.refresh)
        rng = routes.range_for(offset)
        if rng is not None:
            return rng
        if offset < routes.first_offset:
            raise OffsetOutOfRangeError(
                f"offset {offset} of stream {self.stream_id} is below its first offset "
                f"{routes.first_offset} (trimmed)"
            )
        raise OffsetOutOfRangeError(
            f"offset {offset} of stream {self.stream_id} is past the end of its ranges"
        )

    async def _fetch(
        self, rng: messages.Range, offset: int, wait_ms: int, attempt: int
    ) -> tuple[messages.FetchResult, memoryview]:
        node = self._context.node(replica_for_read(rng, attempt))
        info = messages.FetchInfo(
            stream_id=self.stream_id, fetch_offset=offset, batch_max_bytes=self.fetch_bytes
        )
        result: messages.FetchResult | None = None
        data = memoryview(b"")
        async with node.fetch([info], max_wait_ms=wait_ms, min_bytes=1) as results:
            async for fetched in results:
                result, data = fetched.result, fetched.data
        if result is None:
            raise InvalidRecordBatchError(f"FETCH of stream {self.stream_id}: no result")
        return result, data

    async def _retrying(self, refresh: Callable[[], Awaitable[object]]) -> None:
        """Call the PM (``refresh``) until it answers or ``retry_timeout`` passes."""
        failures = 0
        with trio.fail_after(self.retry_timeout):
            while True:
                try:
                    await refresh()
                    return
                except (SBPError, OSError) as error:
                    if not is_transient(error):
                        raise
                    failures += 1
                    await trio.sleep(retry_delay(failures))


class _Batches:
    """The non-empty batches of a consumer. A plain iterator rather than an
    async generator: leaving a loop early must leave nothing to finalize."""

    __slots__ = ("_consumer",)

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def __aiter__(self) -> _Batches:
        return self

    async def __anext__(self) -> DecodedRecords:
        while (records := await self._consumer.next_batch()) is not None:
            if len(records):
                return records
        raise StopAsyncIteration


class _Records:
    """A consumer's records one at a time (see ``_Batches``)."""

    __slots__ = ("_batches", "_current")

    def __init__(self, consumer: Consumer) -> None:
        self._batches = _Batches(consumer)
        self._current: Iterator[Record] = iter(())

    def __aiter__(self) -> _Records:
        return self

    async def __anext__(self) -> Record:
        while True:
            record = next(self._current, None)
            if record is not None:
                return record
            self._current = iter_records(await self._batches.__anext__())


def iter_records(records: DecodedRecords) -> Iterator[Record]:
    """The decoded records one ``Record`` at a time."""
    values = records.values
    bounds = records.value_offsets.tolist()
    timestamps = records.timestamps.tolist()
    for i, offset in enumerate(records.offsets.tolist()):
        yield Record(offset, timestamps[i], values[bounds[i] : bounds[i + 1]].tobytes())


def _next_offset(data: memoryview) -> int:
    """The offset after the last record of the batches in ``data``."""
    start, _ = batch_spans(data)[-1]
    header = BATCH_HEADER.unpack_from(data, start)
    return int(header[0]) + int(header[5])


def _drop_before(records: DecodedRecords, first: int) -> DecodedRecords:
    """``records`` without those below offset ``first`` (a fetch returns the
    whole batch holding the offset asked for)."""
    skip = int(np.searchsorted(records.offsets, first))
    value_offsets = records.value_offsets[skip:]
    start = int(value_offsets[0])
    return DecodedRecords(
        records.offsets[skip:],
        records.timestamps[skip:],
        records.values[start:],
        value_offsets - value_offsets.dtype.type(start),
    )
