"""``Consumer``: reads one stream from an offset, across its ranges and data nodes.

A fetcher task walks the stream: it finds the range holding the next offset
(the PM's LIST_RANGES, cached), FETCHes from that range's primary, reads the
next offset from the last batch header of the answer and asks for the next
chunk at once, so up to ``prefetch`` answers wait, already received, while the
caller decodes the one before.

Reading history, the fetcher also keeps up to ``read_ahead`` FETCHes in
flight: once an answer comes back full, it asks for the chunk after it at
the next offset, and for the chunks after that at the offsets they would
start at if each answer held as many records as the last one (streams are
mostly written in batches of one size). An answer asked for ahead is used
only if it starts exactly where the walk got to; otherwise it is dropped and
the walk asks again. So the node reads and sends the next chunks while this
process receives and decodes the last one, instead of each waiting for the
other. Decoding verifies the CRC-32C of every batch:
a corrupt batch raises ``InvalidRecordBatchError``, it is never skipped.

At a sealed range's end the fetcher moves to the next range. A data node's
RANGE_SEALED, RANGE_NOT_FOUND or NOT_PRIMARY, OFFSET_OUT_OF_RANGE at a range
end, or a connection that fails, makes it list the ranges again and retry,
with backoff, for up to ``retry_timeout`` seconds; each retry goes to the
range's next replica, and it gives up only once every replica was tried.

Without ``tail`` the consumer stops at the end of the stream as it is when
the fetcher gets there; with ``tail`` it long-polls (``max_wait_ms``) for
new records and never stops by itself. At the tail it talks to the data
node alone: the PM is asked again only when the node says the range moved
(a seal) or cannot be reached, so a tail outlives a PM restart.

``from_offset`` None (the default) starts at the stream's first stored
offset, as ``sbp read`` does, so a trimmed stream reads from where its data
begins.

With a consumer ``group`` (SPEC §11) the consumer starts at the group's
position and stores its own: ``commit()`` what was handed out, and every
``auto_commit_interval`` what the caller is done with (docs/client.md,
Consumer groups). ``seek`` and ``seek_to_time`` restart the fetcher
elsewhere.

This module is the API and the positions; the walk the fetcher task makes
is ``client.range_walk``.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import numpy as np
import trio

from net.pool import ConnectionPool
from sbp.batches import DecodedRecords, decode_batches
from sbp.constants import MAX_GROUP_NAME_BYTES
from sbp.errors import (
    GroupNotFoundError,
    SBPError,
    raise_for_code,
)

from ._routing import (
    ClientContext,
)
from .by_time import offset_at_time, stream_end
from .pm_client import PMClient
from .range_walk import End, RangeWalk, Sent, WalkSettings

#: bytes asked per FETCH: 2 MiB chunks read faster than 1 MiB ones (half the
#: requests, each costing both ends the same Python); with 4 MiB ones an
#: answer and what is made of it no longer fit a core's cache, and a reader
#: that copies its records on is slower (docs/benchmarks.md, design decisions)
DEFAULT_FETCH_BYTES: Final = 2 << 20
DEFAULT_PREFETCH: Final = 4
#: FETCHes in flight while reading history (see the module docstring)
DEFAULT_READ_AHEAD: Final = 3
DEFAULT_MAX_WAIT_MS: Final = 500
DEFAULT_RETRY_TIMEOUT: Final = 60.0
DEFAULT_REQUEST_TIMEOUT: Final = 10.0
#: a group consumer stores its position this often by itself (SPEC §11)
DEFAULT_AUTO_COMMIT_INTERVAL: Final = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Record:
    """One record as a consumer yields it: its offset, its own timestamp
    (ms since the Unix epoch), its value (None: a tombstone, SPEC §13), its
    key and headers (magic 2 batches; none for magic 1), and its stream."""

    offset: int
    timestamp: int
    value: bytes | None
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    stream_id: int = 0


class Consumer:
    """Reads one stream (see the module docstring).

    ::

        async with Consumer("127.0.0.1:7400", stream_id, from_offset=0) as consumer:
            async for records in consumer:  # sbp.batches.DecodedRecords
                print(records.offsets, records.to_list())

    ``records()`` yields one ``Record`` at a time instead. ``pm`` is the
    PM's address or a ``PMClient``; ``pool`` the connection pool to share.
    ``prefer_followers`` reads a replicated range from a follower first,
    taking the reads off the node that takes its appends; the primary is
    then the last replica tried.
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
        read_ahead: int = DEFAULT_READ_AHEAD,
        prefer_followers: bool = False,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        group: str | None = None,
        auto_commit_interval: float | None = DEFAULT_AUTO_COMMIT_INTERVAL,
    ) -> None:
        if group is not None and not 1 <= len(group.encode()) <= MAX_GROUP_NAME_BYTES:
            raise ValueError(f"a consumer group name is 1 to {MAX_GROUP_NAME_BYTES} bytes")
        if auto_commit_interval is not None and auto_commit_interval <= 0:
            raise ValueError("auto_commit_interval must be positive (None: commit() only)")
        if from_offset is not None and from_offset < 0:
            raise ValueError("from_offset must be >= 0")
        if prefetch < 1 or fetch_bytes < 1:
            raise ValueError("prefetch and fetch_bytes must be at least 1")
        if read_ahead < 0:
            raise ValueError("read_ahead must be >= 0")
        self.stream_id = stream_id
        self.from_offset = from_offset
        self.tail = tail
        self.max_wait_ms = max_wait_ms
        self.fetch_bytes = fetch_bytes
        self.prefetch = prefetch
        self.read_ahead = read_ahead
        self.prefer_followers = prefer_followers
        self.retry_timeout = retry_timeout
        self._context = ClientContext(pm, pool, request_timeout, tls)
        self.group = group
        self.auto_commit_interval = auto_commit_interval
        self._stack = AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        self._fetcher = trio.CancelScope()
        send, receive = trio.open_memory_channel[Sent](prefetch)
        self._send = send
        self._receive = receive
        self._finished = False
        #: the offset after the last record handed out (the start until then;
        #: with ``from_offset`` None, known once the ranges were listed)
        self.position = 0 if from_offset is None else from_offset
        #: the batch being handed out a record at a time (``records()``, the
        #: sync iterator), and the rest of it: the next read starts with what
        #: is left of it past ``position``
        self.in_hand: DecodedRecords | None = None
        self.unread: Iterator[Record] = iter(())
        #: the offset after the records the caller is done with: those handed
        #: out before it asked for more (what automatic commits store)
        self.processed = self.position
        #: what the group last stored for this stream (None: nothing yet)
        self.committed: int | None = None

    # -- lifetime -------------------------------------------------------------

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._context)
            if self.group is not None:
                await self._start_at_group_position(self.group)
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._start_fetcher()
            if self.group is not None and self.auto_commit_interval is not None:
                self._nursery.start_soon(self._auto_commit, self.auto_commit_interval)
            self._stack = stack.pop_all()
        return self

    def _start_fetcher(self) -> None:
        assert self._nursery is not None
        self._fetcher = trio.CancelScope()
        send, self._receive = trio.open_memory_channel[Sent](self.prefetch)
        self._send = send
        self._finished = False

        async def fetch(scope: trio.CancelScope) -> None:
            with scope:
                await self._fetch_loop()

        self._nursery.start_soon(fetch, self._fetcher)

    async def _start_at_group_position(self, group: str) -> None:
        """Start where the group stopped (SPEC §11), else at ``from_offset``."""
        try:
            [stored] = await self._context.pm.fetch_offsets(group, [self.stream_id])
        except GroupNotFoundError:
            return
        raise_for_code(stored.error_code, stored.error_message)
        if stored.offset >= 0:
            self.from_offset = self.position = self.processed = stored.offset
            self.committed = stored.offset

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if (
                exc_type is None
                and self.group is not None
                and self.auto_commit_interval is not None
                and self.position != self.committed
            ):
                await self.commit()  # the block is done with all it was handed
        finally:
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            # The caller's exception propagates as it is, not wrapped in the
            # ExceptionGroup of our nursery: the stack exits as if all went well.
            await self._stack.__aexit__(None, None, None)

    # -- reading --------------------------------------------------------------

    async def next_batch(self) -> DecodedRecords | None:
        """The next records, decoded and CRC-checked; None at the end of the
        stream (never, with ``tail``). They count as handed out: ``position``
        moves past them."""
        self.processed = self.position  # the caller is done with what it had
        records = await self.receive_batch()
        if records is not None and len(records):
            self.position = int(records.offsets[-1]) + 1
        return records

    async def receive_batch(self) -> DecodedRecords | None:
        """``next_batch`` for a caller that hands the records out one at a
        time and moves ``position`` itself, so that a commit never covers a
        record not yet handed out."""
        held, self.in_hand, self.unread = self.in_hand, None, iter(())
        if held is not None and len(held) and int(held.offsets[-1]) >= self.position:
            # a loop over records() left part way: the rest comes first
            return _drop_before(held, self.position)
        if self._finished:
            return None
        item = await self._receive.receive()
        if isinstance(item, End):
            self._finished = True
            return None
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        records = decode_batches(item.data)
        if len(records) and records.offsets[0] < item.first_wanted:
            records = _drop_before(records, item.first_wanted)
        return records

    def __aiter__(self) -> AsyncIterator[DecodedRecords]:
        return _Batches(self)

    def records(self) -> AsyncIterator[Record]:
        """One ``Record`` at a time (a Python object per record: for
        convenience; iterate over batches for bulk reads)."""
        return _Records(self)

    # -- positions (SPEC §11) ---------------------------------------------------

    async def commit(self, offset: int | None = None) -> None:
        """Store ``offset`` (by default ``position``: the offset after the
        last record handed out, never one still prefetched) as the group's
        position on this stream."""
        if self.group is None:
            raise ValueError("commit() needs a consumer group (Consumer(..., group=...))")
        wanted = self.position if offset is None else offset
        await self._context.pm.commit_offset(self.group, self.stream_id, wanted)
        self.committed = wanted

    async def _auto_commit(self, interval: float) -> None:
        """Store ``processed`` every ``interval``: never a record the caller
        may still be working on (it counts once the caller asks for more)."""
        while True:
            await trio.sleep(interval)
            if self.processed != self.committed:
                try:
                    await self.commit(self.processed)
                except (SBPError, OSError) as error:  # tried again on the next interval
                    logger.warning("consumer group %s: commit failed: %s", self.group, error)

    async def seek(self, offset: int) -> None:
        """Read from ``offset`` next: the records prefetched are dropped."""
        if offset < 0:
            raise ValueError("offset must be >= 0")
        if self._nursery is None:
            raise RuntimeError("not open; use `async with`")
        self._fetcher.cancel()
        self.in_hand, self.unread = None, iter(())
        self.from_offset = self.position = self.processed = offset
        self._start_fetcher()

    async def seek_to_time(self, timestamp_ms: int) -> int:
        """Read from the first record appended at or after ``timestamp_ms``
        (ms since the Unix epoch; the stream's end when none was); that offset."""
        offset = await offset_at_time(self._context, self.stream_id, timestamp_ms)
        await self.seek(offset)
        return offset

    async def end_offset(self) -> int:
        """The stream's end (its next offset) now, from its open range's primary."""
        return await stream_end(self._context, self.stream_id)

    async def lag(self) -> int:
        """Records between ``position`` and the stream's end now."""
        return max(await self.end_offset() - self.position, 0)

    # -- the fetcher ----------------------------------------------------------

    async def _fetch_loop(self) -> None:
        assert self._nursery is not None
        settings = WalkSettings(
            tail=self.tail,
            max_wait_ms=self.max_wait_ms,
            fetch_bytes=self.fetch_bytes,
            read_ahead=self.read_ahead,
            prefer_followers=self.prefer_followers,
            retry_timeout=self.retry_timeout,
        )
        walk = RangeWalk(self._context, self.stream_id, settings, self._nursery, self._send)
        await walk.run(self.from_offset, self._started_at)

    def _started_at(self, offset: int) -> None:
        """The stream's first stored offset, where a read from the start begins."""
        self.position = offset


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
    """A consumer's records one at a time (see ``_Batches``); ``position``
    follows each record handed out. The rest of a batch stays with the
    consumer, so a loop left early and ``records()`` called again go on
    with the next record."""

    __slots__ = ("_consumer",)

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def __aiter__(self) -> _Records:
        return self

    async def __anext__(self) -> Record:
        consumer = self._consumer
        consumer.processed = consumer.position  # done with the last one
        while True:
            record = next(consumer.unread, None)
            if record is not None:
                consumer.position = record.offset + 1
                return record
            records = await consumer.receive_batch()
            if records is None:
                raise StopAsyncIteration
            consumer.in_hand = records
            consumer.unread = iter_records(records, consumer.stream_id)


def iter_records(records: DecodedRecords, stream_id: int = 0) -> Iterator[Record]:
    """The decoded records (of ``stream_id``) one ``Record`` at a time."""
    values = records.values
    bounds = records.value_offsets.tolist()
    timestamps = records.timestamps.tolist()
    if records.keys is None and records.headers is None and records.value_valid is None:
        for i, offset in enumerate(records.offsets.tolist()):
            value = values[bounds[i] : bounds[i + 1]].tobytes()
            yield Record(offset, timestamps[i], value, None, (), stream_id)
        return
    for i, offset in enumerate(records.offsets.tolist()):
        yield Record(
            offset,
            timestamps[i],
            records.value(i),
            records.key(i),
            tuple(records.headers_of(i)),
            stream_id,
        )


def _drop_before(records: DecodedRecords, first: int) -> DecodedRecords:
    """``records`` without those below offset ``first`` (a fetch returns the
    whole batch holding the offset asked for)."""
    return records.drop_first(int(np.searchsorted(records.offsets, first)))
