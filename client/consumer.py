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
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import numpy as np
import trio

from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import BASE_OFFSET, DecodedRecords, batch_span, batch_spans, decode_batches
from sbp.constants import MAX_GROUP_NAME_BYTES
from sbp.enums import ErrorCode
from sbp.errors import (
    ConnectionClosed,
    GroupNotFoundError,
    InvalidRecordBatchError,
    OffsetOutOfRangeError,
    RangeSealedError,
    RecordsUnreachableError,
    SBPError,
    error_for,
    raise_for_code,
)

from ._routing import (
    STALE_ROUTE_CODES,
    ClientContext,
    StreamRoutes,
    replica_for_read,
)
from .by_time import offset_at_time, stream_end
from .compacted_tail import compacted_end
from .pm_client import PMClient
from .retry import is_transient, retry_delay

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


class _End:
    """Sent by the fetcher after the last chunk (without ``tail``)."""


_END: Final = _End()


@dataclass(slots=True)
class _Ahead:
    """A FETCH sent before the answer ahead of it came back."""

    offset: int
    cancel: trio.CancelScope
    done: trio.Event
    #: the answer, or None if the FETCH failed (the walk then asks again)
    answer: tuple[messages.FetchResult, memoryview] | None = None


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
        send, receive = trio.open_memory_channel[_Chunk | _End | BaseException](prefetch)
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
        send, self._receive = trio.open_memory_channel[_Chunk | _End | BaseException](self.prefetch)
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
        if isinstance(item, _End):
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
        #: FETCHes sent ahead, in offset order (see the module docstring)
        ahead: list[_Ahead] = []
        try:
            await self._walk_from(routes, offset, ahead)
        finally:
            _drop(ahead)

    async def _walk_from(self, routes: StreamRoutes, offset: int, ahead: list[_Ahead]) -> None:
        """The walk from ``offset``, its answers taken from ``ahead`` when one
        was sent there."""
        attempts = _Attempts(self.retry_timeout)
        checked_end = False
        while True:
            rng = routes.range_for(offset)
            if rng is None:
                rng = await self._locate(routes, offset)
            sealed = not rng.is_open
            wait_ms = self.max_wait_ms if self.tail and not sealed else 0
            attempt_started = trio.current_time()
            try:
                answer = await _take(ahead, offset) if attempts.failures == 0 else None
                if answer is None:
                    _drop(ahead)
                    answer = await self._fetch(rng, offset, wait_ms, attempts.failures)
                result, data = answer
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
                # Each failed attempt goes to the next replica; give up only
                # once every one was tried: a paused node takes a whole
                # request timeout, and the window may be no longer than that.
                why = str(error) or type(error).__name__
                replicas = len(rng.replica_nodes)
                tried = self._tried(rng, attempts)
                cut_off = isinstance(error, OSError | ConnectionClosed)
                if attempts.fail(tried, why, replicas, started=attempt_started, cut_off=cut_off):
                    raise self._unreachable(rng, offset, attempts) from error
                if not self.tail and attempts.failures >= replicas:
                    # every replica failed once: if the PM has given up on all
                    # of their nodes, waiting out the window helps nobody
                    dead = await self._all_replicas_dead(rng)
                    if dead:
                        raise self._unreachable(rng, offset, attempts, dead) from error
                if attempts.failures > 1 or getattr(error, "code", None) not in STALE_ROUTE_CODES:
                    await trio.sleep(retry_delay(attempts.failures))
                await self._retrying(routes.refresh)
                continue
            if not len(data) and not sealed and not checked_end:
                # Nothing here: the stream's end, or a replica that cannot
                # serve what it holds. Only the live offsets can tell.
                try:
                    at_end = await self._confirm_end(rng, offset)
                except (SBPError, OSError, trio.TooSlowError) as error:
                    if not is_transient(error) or attempts.fail("every replica", str(error), 1):
                        raise
                    await trio.sleep(retry_delay(attempts.failures))
                    continue
                if not at_end:
                    why = "answered no records below the commit offset"
                    if attempts.fail(self._tried(rng, attempts), why, len(rng.replica_nodes)):
                        raise self._unreachable(rng, offset, attempts)
                    await trio.sleep(retry_delay(attempts.failures))
                    continue
                # once confirmed at a tail, later empty answers there are the
                # tail's own (a long poll that ran out)
                checked_end = self.tail
            if not len(data) and sealed and offset < rng.end_offset:
                end = await self._compacted_end(rng, offset, attempts.failures)
                if end is None:
                    why = f"answered no records at {offset}, before the range's end"
                    if attempts.fail(self._tried(rng, attempts), why, len(rng.replica_nodes)):
                        raise self._unreachable(rng, offset, attempts)
                    await trio.sleep(retry_delay(attempts.failures))
                    continue
                offset = end  # compaction left nothing from here to the end
                attempts = _Attempts(self.retry_timeout)
                continue
            attempts = _Attempts(self.retry_timeout)
            if len(data):
                next_offset = _next_offset(data)
                if next_offset <= offset:
                    raise InvalidRecordBatchError(
                        f"FETCH at {offset} of stream {self.stream_id} returned batches "
                        f"ending at {next_offset}"
                    )
                self._fetch_ahead(ahead, rng, next_offset, data)
                await self._send.send(_Chunk(data, offset))
                offset = next_offset
                continue
            # Nothing at ``offset``: the tail of the open range, a range
            # sealed since it was listed, or the end of a compacted one.
            if not sealed:
                # The open range's tail: the node answers RANGE_SEALED once a
                # seal moves the stream on, so the PM is not needed here.
                if not self.tail:
                    return
                continue
            await self._retrying(routes.refresh)

    def _tried(self, rng: messages.Range, attempts: _Attempts) -> str:
        """The address of the replica the last try went to."""
        nodes = rng.nodes_primary_first()
        if not nodes:
            return "no replica"
        replica = replica_for_read(rng, attempts.failures, prefer_followers=self.prefer_followers)
        return replica.advertise_addr

    def _unreachable(
        self, rng: messages.Range, offset: int, attempts: _Attempts, dead: str = ""
    ) -> RecordsUnreachableError:
        nodes = {r.data_node.advertise_addr: r.data_node.node_id for r in rng.replica_nodes}
        reasons = "; ".join(
            f"node {nodes[address]} at {address}: {why}"
            if address in nodes
            else f"{address}: {why}"
            for address, why in attempts.refusals.items()
        )
        return RecordsUnreachableError(
            f"no replica of stream {self.stream_id} range {rng.range_index} serves its "
            f"records from offset {offset} ({reasons})" + (f"; {dead}" if dead else ""),
            unreachable=attempts.all_cut_off,
        )

    async def _all_replicas_dead(self, rng: messages.Range) -> str:
        """When the PM counts every node of the range as dead (no heartbeat
        for its node timeout), which and for how long; "" otherwise, or when
        the PM cannot say."""
        try:
            with trio.fail_after(min(self._context.request_timeout, 5.0)):
                statuses = await self._context.pm.describe_cluster()
        except (SBPError, OSError, trio.TooSlowError):
            return ""
        by_id = {s.data_node.node_id: s for s in statuses}
        now_ms = time.time() * 1000
        told = []
        for replica in rng.replica_nodes:
            status = by_id.get(replica.data_node.node_id)
            if status is None or status.alive:
                return ""
            silent = max(now_ms - status.last_heartbeat_ms, 0) / 1000
            told.append(f"node {replica.data_node.node_id} for {silent:.0f} s")
        return "the PM has had no heartbeat from " + ", ".join(told)

    async def _confirm_end(self, rng: messages.Range, offset: int) -> bool:
        """After an empty answer at ``offset`` in the open range: True when
        ``offset`` is where the committed records end, False when a replica
        says records below its commit offset lie there (the one asked could
        not serve them: it restarted, or lags), or when without the primary
        no replica can tell. An offset past the range's next offset raises
        ``OffsetOutOfRangeError``, as an unreplicated range answers it. The
        live offsets are the highest the replicas that answer report."""
        if len(rng.replica_nodes) <= 1:
            return True  # the node that answered is the one that knows
        live: list[messages.Range] = []
        last_error: BaseException | None = None
        primary_answered = False
        primary_unsure = False
        for replica in rng.nodes_primary_first():
            try:
                described = await self._context.node(replica).describe_range(
                    rng.stream_id, rng.range_index
                )
            except (SBPError, OSError, trio.TooSlowError) as error:
                last_error = error
                continue
            live.append(described)
            # every replica is asked: one that restarted reports a commit
            # offset lower than the range's, the primary too
            if replica == rng.primary_node():
                primary_answered = True
                # -1: the primary has not learned its commit offset again
                # since it restarted; what it holds may be committed
                primary_unsure = described.commit_offset < 0
        if not live:
            assert last_error is not None
            raise last_error
        if any(not r.is_open for r in live):
            raise RangeSealedError(
                f"range {rng.range_index} of stream {self.stream_id} was sealed"
            )  # the walk lists the ranges again
        next_offset = max(r.next_offset for r in live)
        if offset > next_offset:
            raise OffsetOutOfRangeError(
                f"offset {offset} is above the next offset {next_offset} of stream {self.stream_id}"
            )
        if offset < max(r.commit_offset for r in live):
            return False
        if primary_unsure and offset < next_offset:
            return False
        # Without the primary, records a follower holds past ``offset`` may
        # be committed without it knowing (it restarted): not the end yet.
        return primary_answered or offset >= next_offset

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

    def _fetch_ahead(
        self, ahead: list[_Ahead], rng: messages.Range, next_offset: int, data: memoryview
    ) -> None:
        """Keep ``read_ahead`` FETCHes in flight after a full answer: at
        ``next_offset``, then where the chunks after it would start if each
        held as many records as ``data``. Never past a sealed range's end,
        and never long-polling: a FETCH ahead at the tail comes back empty."""
        if self._nursery is None or len(data) < self.fetch_bytes // 2:
            return  # not a full answer: the walk is near the end, or at the tail
        first_base = int(BASE_OFFSET.unpack_from(data, 0)[0])
        step = next_offset - first_base
        predicted = ahead[-1].offset + step if ahead else next_offset
        while len(ahead) < self.read_ahead:
            if not rng.is_open and predicted >= rng.end_offset:
                return
            ahead.append(self._send_ahead(rng, predicted))
            predicted += step

    def _send_ahead(self, rng: messages.Range, offset: int) -> _Ahead:
        sent = _Ahead(offset, trio.CancelScope(), trio.Event())

        async def fetch() -> None:
            with sent.cancel:
                try:
                    sent.answer = await self._fetch(rng, offset, 0, 0)
                except (SBPError, OSError, trio.TooSlowError):
                    sent.answer = None  # the walk asks again, with its retries
            sent.done.set()

        assert self._nursery is not None
        self._nursery.start_soon(fetch)
        return sent

    async def _compacted_end(self, rng: messages.Range, offset: int, attempt: int) -> int | None:
        """After an empty answer at ``offset`` in a sealed range: its end when
        the replica that answered holds nothing more of it (compacted away),
        None when it cannot tell or lacks records."""
        replica = replica_for_read(rng, attempt, prefer_followers=self.prefer_followers)
        try:
            return await compacted_end(
                self._context.node(replica), rng.stream_id, rng.range_index, offset
            )
        except (SBPError, OSError, trio.TooSlowError):
            return None

    async def _fetch(
        self, rng: messages.Range, offset: int, wait_ms: int, attempt: int
    ) -> tuple[messages.FetchResult, memoryview]:
        replica = replica_for_read(rng, attempt, prefer_followers=self.prefer_followers)
        node = self._context.node(replica)
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
        """Call the PM (``refresh``) until it answers or ``retry_timeout``
        passes; then the last failure is the error (a PM that is gone is
        "cannot connect", not "no answer in time")."""
        failures = 0
        last: BaseException | None = None
        with trio.move_on_after(self.retry_timeout):
            while True:
                try:
                    await refresh()
                    return
                except (SBPError, OSError) as error:
                    if not is_transient(error):
                        raise
                    last = error
                    failures += 1
                    await trio.sleep(retry_delay(failures))
        if last is not None:
            raise last
        raise trio.TooSlowError(f"no answer from the PM within {self.retry_timeout:g} s")


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


async def _take(ahead: list[_Ahead], offset: int) -> tuple[messages.FetchResult, memoryview] | None:
    """The answer of the FETCH sent ahead at ``offset``, if the first one
    ahead was sent there (those after it stay); None if none was, or if it
    failed or was refused (the walk then asks again itself)."""
    if not ahead or ahead[0].offset != offset:
        return None
    sent = ahead.pop(0)
    await sent.done.wait()
    if sent.answer is None or sent.answer[0].error_code != ErrorCode.NONE:
        return None
    return sent.answer


class _Attempts:
    """The failed tries at one offset since the last good answer: what each
    replica said, and since when. A reader gives up once ``window`` seconds
    have passed and every replica was tried."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.failures = 0
        self.since: float | None = None
        #: the last failure of each replica tried, by address
        self.refusals: dict[str, str] = {}
        #: the replicas whose last failure was a connection that failed
        self.cut_off: set[str] = set()

    @property
    def all_cut_off(self) -> bool:
        """Whether no replica tried could be reached at all."""
        return bool(self.refusals) and self.cut_off >= self.refusals.keys()

    def fail(
        self,
        replica: str,
        why: str,
        replicas: int,
        started: float | None = None,
        *,
        cut_off: bool = False,
    ) -> bool:
        """Count a failed try of ``replica`` (begun at ``started``: the
        window counts from the first failed try's start, so a try that hung
        until its own timeout is part of it); True when it is time to give up."""
        now = trio.current_time()
        if self.since is None:
            self.since = now if started is None else started
        self.refusals[replica] = why
        if cut_off:
            self.cut_off.add(replica)
        else:
            self.cut_off.discard(replica)
        give_up = now - self.since > self.window and self.failures + 1 >= replicas
        self.failures += 1
        return give_up


def _drop(ahead: list[_Ahead]) -> None:
    """Cancel the FETCHes sent ahead: the walk went elsewhere."""
    for sent in ahead:
        sent.cancel.cancel()
    ahead.clear()


def _next_offset(data: memoryview) -> int:
    """The offset after the last batch in ``data`` (its span, which covers
    records compaction removed too)."""
    start, _ = batch_spans(data)[-1]
    return int(BASE_OFFSET.unpack_from(data, start)[0]) + batch_span(data, start)


def _drop_before(records: DecodedRecords, first: int) -> DecodedRecords:
    """``records`` without those below offset ``first`` (a fetch returns the
    whole batch holding the offset asked for)."""
    return records.drop_first(int(np.searchsorted(records.offsets, first)))
