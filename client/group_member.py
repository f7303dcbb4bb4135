"""``GroupConsumer``: one member of a consumer group that shares the group's
streams with its other members (SPEC §15).

The member joins with GROUP_HEARTBEAT and sends one every
``heartbeat_interval_ms`` the PM asks for, from a task of its own, listing
the streams it reads or may still start reading (``owned``); each answer
lists the streams it may read now. A member's session counts from when
the heartbeat that was answered left, not from when the answer was read.
A stream is read by a ``Consumer`` of its own, from the group's position,
and its batches come out of ``next_batch`` tagged with their stream.

Changes to what it reads are made in the caller's task, between batches
(when it asks for the next one, it is done with the last): a stream taken
away is committed up to what was handed out, its reading stopped and
``on_revoked`` called, and only then does a heartbeat stop listing it, so
the PM gives it to another member only once nobody reads it; a stream
given is started from the group's position and ``on_assigned`` called.
A member the PM fenced or forgot (paused past its session) drops every
stream at once (its commits would be refused) and joins again; so does one
that has heard nothing from the PM for a whole session, before it hands
out anything more.

Delivery is at least once across a rebalance: records handed out after the
last commit of a stream are read again by its next member.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Literal, Self

import trio

from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import DecodedRecords
from sbp.constants import MAX_GROUP_NAME_BYTES
from sbp.errors import (
    FencedMemberEpochError,
    GroupNotFoundError,
    SBPError,
    UnknownMemberIdError,
    raise_for_code,
)

from ._routing import ClientContext
from .consumer import DEFAULT_REQUEST_TIMEOUT, Consumer, Record, iter_records
from .pm_client import PMClient
from .retry import is_transient

logger = logging.getLogger(__name__)

DEFAULT_SESSION_TIMEOUT: Final = 45.0
DEFAULT_AUTO_COMMIT_INTERVAL: Final = 5.0
#: with ``subscribe="all"``, the streams are listed again this often
ALL_STREAMS_REFRESH_S: Final = 5.0
MAX_MEMBER_ID_BYTES: Final = 64

StreamsCallback = Callable[[list[int]], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class StreamBatch:
    """Records of one stream, as ``GroupConsumer.next_batch`` hands them out."""

    stream_id: int
    records: DecodedRecords


@dataclass(slots=True)
class _Reading:
    """One stream this member reads: its consumer's scope and positions."""

    scope: trio.CancelScope
    #: the offset after the last record handed out
    position: int
    #: the offset after the records the caller is done with
    processed: int
    committed: int | None = None
    done: trio.Event = field(default_factory=trio.Event)


class _Changed:
    """Put in the batches' channel when the assignment changed."""


_CHANGED: Final = _Changed()


class GroupConsumer:
    """See the module docstring. ``subscribe``: stream ids, or ``"all"``
    (every stream, as streams come and go; with ``where``, those it accepts).
    ``on_assigned`` and ``on_revoked`` (sync or async) get the streams given
    or taken away, between batches; ``on_lost`` (default: ``on_revoked``)
    the streams dropped at once when fenced, which must not be committed.
    ``auto_commit_interval`` (None: ``commit()`` only) stores what the
    caller is done with. ``start``: where a stream the group has no
    position on is read from, ``"earliest"`` or ``"latest"``; ``start_at``,
    when given, says where each stream given starts instead (None: as
    without it), for a caller that keeps its positions elsewhere."""

    def __init__(
        self,
        pm: str | PMClient,
        group: str,
        subscribe: Sequence[int] | Literal["all"],
        *,
        member_id: str | None = None,
        session_timeout: float = DEFAULT_SESSION_TIMEOUT,
        on_assigned: StreamsCallback | None = None,
        on_revoked: StreamsCallback | None = None,
        on_lost: StreamsCallback | None = None,
        auto_commit_interval: float | None = DEFAULT_AUTO_COMMIT_INTERVAL,
        start: Literal["earliest", "latest"] = "earliest",
        start_at: Callable[[int], Awaitable[int | None]] | None = None,
        where: Callable[[messages.Stream], bool] | None = None,
        pool: ConnectionPool | None = None,
        tls: ssl.SSLContext | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        max_wait_ms: int = 500,
    ) -> None:
        if not 1 <= len(group.encode()) <= MAX_GROUP_NAME_BYTES:
            raise ValueError(f"a consumer group name is 1 to {MAX_GROUP_NAME_BYTES} bytes")
        self.member_id = member_id or f"{uuid.uuid4()}"
        if not 1 <= len(self.member_id.encode()) <= MAX_MEMBER_ID_BYTES:
            raise ValueError(f"a member id is 1 to {MAX_MEMBER_ID_BYTES} bytes")
        if subscribe != "all" and not subscribe:
            raise ValueError('subscribe to stream ids, or to "all"')
        if not 1 <= session_timeout <= 1800:
            raise ValueError("session_timeout is 1 s to 30 min")
        if auto_commit_interval is not None and auto_commit_interval <= 0:
            raise ValueError("auto_commit_interval must be positive (None: commit() only)")
        self.group = group
        self._subscribe = subscribe
        self._subscribed: tuple[int, ...] = () if subscribe == "all" else tuple(sorted(subscribe))
        self.session_timeout = session_timeout
        self.on_assigned = on_assigned
        self.on_revoked = on_revoked
        self.on_lost = on_lost
        self.start_at = start_at
        self.where = where
        self.auto_commit_interval = auto_commit_interval
        self.start = start
        self.max_wait_ms = max_wait_ms
        self._context = ClientContext(pm, pool, request_timeout, tls)
        self._stack = AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        #: the member's epoch: 0 until it joins, and again after it is fenced
        self.epoch = 0
        #: what the last answer said it may read
        self._assigned: set[int] = set()
        #: the streams it reads now (what heartbeats list as owned)
        self._reading: dict[int, _Reading] = {}
        #: streams given whose reading is being started
        self._starting: set[int] = set()
        #: streams dropped at once (fenced): to tell ``on_revoked`` between batches
        self._lost: list[int] = []
        self._send, self._receive = trio.open_memory_channel[
            StreamBatch | _Changed | BaseException
        ](16)
        self._in_hand: StreamBatch | None = None
        self._unread: Iterator[Record] = iter(())
        self._closed = False
        self.heartbeat_interval = 1.0
        #: when the PM last answered a heartbeat (``trio.current_time``)
        self._heard_at = 0.0

    # -- lifetime ---------------------------------------------------------------

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._context)
            if self._subscribe == "all":
                self._subscribed = await self._all_streams()
            await self._heartbeat()  # joined, or the reason why not
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(self._heartbeats)
            if self.auto_commit_interval is not None:
                self._nursery.start_soon(self._auto_commit, self.auto_commit_interval)
            self._stack = stack.pop_all()
        self._changed()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close(commit=exc_type is None)

    async def close(self, *, commit: bool = True) -> None:
        """Commit what the caller is done with (unless ``commit`` is False),
        stop reading and leave the group at once: its streams move to the
        other members without waiting for the session to end. Called from
        the task that opened the member (leaving ``async with`` does it)."""
        if self._closed:
            return
        self._closed = True
        try:
            # shielded: a member closed by a cancellation still leaves at once
            with trio.CancelScope(shield=True):
                if commit and self._reading and self.epoch > 0:
                    with trio.move_on_after(self._context.request_timeout):
                        await self._commit({s: r.processed for s, r in self._reading.items()})
                for reading in self._reading.values():
                    reading.scope.cancel()
                with trio.move_on_after(self._context.request_timeout):
                    try:
                        await self._pm.group_heartbeat(self.group, self.member_id, -1)
                    except (SBPError, OSError) as error:
                        logger.info("group %r: leaving: %s", self.group, error)
        finally:
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            await self._stack.__aexit__(None, None, None)

    @property
    def _pm(self) -> PMClient:
        return self._context.pm

    @property
    def assignment(self) -> frozenset[int]:
        """The streams this member reads now."""
        return frozenset(self._reading)

    def holds(self, stream_id: int) -> bool:
        """Whether this member may still act on the stream: it reads it,
        and the PM answered it within a session (a member silent longer
        may have lost it to another)."""
        fresh = trio.current_time() - self._heard_at <= self.session_timeout
        return self.epoch > 0 and fresh and stream_id in self._reading

    # -- reading ----------------------------------------------------------------

    async def next_batch(self) -> StreamBatch:
        """The next records of one of the streams this member reads (it
        waits for them: a member reads for as long as it is open). The
        caller is done with what it was handed before."""
        self._done_with_last()
        while True:
            item = await self._receive.receive()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, _Changed):
                await self._apply_assignment()
                continue
            if self.epoch and trio.current_time() - self._heard_at > self.session_timeout:
                # no answer for a whole session (paused, or cut off): the PM
                # may have given every stream away; nothing more is handed out
                # until a heartbeat says what this member reads
                self._drop_everything()
                continue
            reading = self._reading.get(item.stream_id)
            if reading is None or not len(item.records):
                continue  # taken away meanwhile: its next member reads it
            records = item.records
            if int(records.offsets[-1]) < reading.position:
                continue
            reading.position = int(records.offsets[-1]) + 1
            return item

    def __aiter__(self) -> AsyncIterator[StreamBatch]:
        return self

    async def __anext__(self) -> StreamBatch:
        return await self.next_batch()

    async def records(self) -> AsyncIterator[Record]:
        """One ``Record`` at a time (``Record.stream_id`` says whose)."""
        while True:
            record = next(self._unread, None)
            if record is not None:
                reading = self._reading.get(record.stream_id)
                if reading is None:  # taken away between two records
                    self._unread = iter(())
                    continue
                yield record
                reading.processed = max(reading.processed, record.offset + 1)
                continue
            batch = await self.next_batch()
            # next_batch counted the whole batch as handed out; records()
            # hands it out a record at a time
            reading = self._reading[batch.stream_id]
            reading.position = int(batch.records.offsets[0])
            self._unread = _counting(iter_records(batch.records, batch.stream_id), reading)

    def _done_with_last(self) -> None:
        for reading in self._reading.values():
            reading.processed = reading.position

    # -- positions --------------------------------------------------------------

    async def commit(self) -> None:
        """Store what was handed out, on every stream this member reads, as
        the group's positions; ``FencedMemberEpochError`` when the PM no
        longer lets this member commit (it joins again by itself)."""
        await self._commit({s: r.position for s, r in self._reading.items()})

    async def _commit(self, positions: dict[int, int]) -> None:
        wanted = {  # never behind what this member stored (commit() then auto-commits)
            s: offset
            for s, offset in positions.items()
            if s in self._reading and offset > _or_below_all(self._reading[s].committed)
        }
        if not wanted:
            return
        items = [messages.GroupOffset(stream_id=s, offset=o) for s, o in sorted(wanted.items())]
        results = await self._pm.commit_offsets(
            self.group, items, member_id=self.member_id, member_epoch=self.epoch
        )
        for result in results:
            raise_for_code(result.error_code, result.error_message)
            reading = self._reading.get(result.stream_id)
            if reading is not None:
                reading.committed = result.offset

    async def _auto_commit(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            try:
                await self._commit({s: r.processed for s, r in self._reading.items()})
            except (FencedMemberEpochError, UnknownMemberIdError) as error:
                logger.info("group %r: a commit was fenced (%s): joining again", self.group, error)
            except (SBPError, OSError) as error:
                if not is_transient(error):
                    raise
                logger.info("group %r: automatic commit: %s", self.group, error)

    # -- membership ---------------------------------------------------------------

    async def _heartbeats(self) -> None:
        listed_at = trio.current_time()
        while True:
            await trio.sleep(self.heartbeat_interval)
            if (
                self._subscribe == "all"
                and trio.current_time() - listed_at >= ALL_STREAMS_REFRESH_S
            ):
                try:
                    self._subscribed = await self._all_streams()
                    listed_at = trio.current_time()
                except (SBPError, OSError) as error:
                    logger.info("group %r: listing the streams: %s", self.group, error)
            try:
                await self._heartbeat()
            except (FencedMemberEpochError, UnknownMemberIdError) as error:
                logger.info("group %r: %s; joining again", self.group, error)
                self._drop_everything()
            except (SBPError, OSError) as error:
                if not is_transient(error):
                    await self._send.send(error)
                    return
                logger.info("group %r: heartbeat: %s", self.group, error)

    async def _heartbeat(self) -> None:
        if self.epoch == 0 and not self._subscribed:
            return  # "all" of no stream yet: nothing to join until one is there
        # owned: every stream this member may read before the answer comes,
        # not only those it reads now; the PM gives a stream to another
        # member as soon as a heartbeat leaves it out
        owned = sorted(set(self._reading) | self._starting | self._assigned)
        # the answer speaks for the PM as of some time after the request left:
        # the session counts from then (an answer read after a pause is old)
        sent_at = trio.current_time()
        answer = await self._pm.group_heartbeat(
            self.group,
            self.member_id,
            self.epoch,
            streams=self._subscribed,
            owned=owned,
            session_timeout_ms=int(self.session_timeout * 1000),
        )
        self.epoch = answer.member_epoch
        self._heard_at = sent_at
        self.heartbeat_interval = max(answer.heartbeat_interval_ms, 1) / 1000
        assigned = set(answer.assigned)
        if assigned != self._assigned or assigned != set(self._reading):
            self._assigned = assigned
            self._changed()

    def _changed(self) -> None:
        # a full channel is read soon; the next heartbeat tells of the change again
        with contextlib.suppress(trio.WouldBlock):
            self._send.send_nowait(_CHANGED)

    def _drop_everything(self) -> None:
        """Fenced or forgotten: another member may read every stream now."""
        self._lost += sorted(self._reading)
        for reading in self._reading.values():
            reading.scope.cancel()
        self._reading.clear()
        self._assigned = set()
        self.epoch = 0
        self._changed()

    async def _apply_assignment(self) -> None:
        """Between batches: let go of what was taken away (committed first),
        start what was given."""
        if self._lost:
            lost, self._lost = self._lost, []
            await _call(self.on_lost or self.on_revoked, lost)
        revoked = sorted(set(self._reading) - self._assigned)
        if revoked:
            await _call(self.on_revoked, revoked)
            try:
                await self._commit({s: self._reading[s].position for s in revoked})
            except (FencedMemberEpochError, UnknownMemberIdError) as error:
                logger.info(
                    "group %r: the commit of revoked streams was fenced: %s", self.group, error
                )
            for stream_id in revoked:
                self._reading.pop(stream_id).scope.cancel()
        given = sorted(self._assigned - set(self._reading))
        if given:
            self._starting.update(given)
            try:
                started = await self._start_reading(given)
            finally:
                self._starting.difference_update(given)
            if started:
                await _call(self.on_assigned, started)
        if set(self._reading) != self._assigned:
            self._changed()  # an answer came while streams were being started

    async def _start_reading(self, stream_ids: list[int]) -> list[int]:
        """Reads the streams given that an answer has not taken away (or a
        fence dropped) while their positions were looked up; those."""
        positions: dict[int, int] = {}
        if self.start_at is not None:
            for stream_id in stream_ids:
                offset = await self.start_at(stream_id)
                if offset is not None:
                    positions[stream_id] = offset
        else:
            try:
                for result in await self._pm.fetch_offsets(self.group, stream_ids):
                    if result.error_code == 0 and result.offset >= 0:
                        positions[result.stream_id] = result.offset
            except GroupNotFoundError:
                pass
        starts: dict[int, int | None] = {}
        for stream_id in stream_ids:
            starts[stream_id] = positions.get(stream_id)
            if starts[stream_id] is None and self.start == "latest":
                starts[stream_id] = await self._end_of(stream_id)
        assert self._nursery is not None
        started = [s for s in stream_ids if s in self._assigned and s not in self._reading]
        for stream_id in started:
            start = starts[stream_id]
            reading = _Reading(trio.CancelScope(), start or 0, start or 0, positions.get(stream_id))
            self._reading[stream_id] = reading
            self._nursery.start_soon(self._read, stream_id, start, reading)
        return started

    async def _end_of(self, stream_id: int) -> int:
        async with Consumer(self._pm, stream_id, pool=self._context.pool) as consumer:
            return await consumer.end_offset()

    async def _read(self, stream_id: int, start: int | None, reading: _Reading) -> None:
        with reading.scope:
            try:
                async with Consumer(
                    self._pm,
                    stream_id,
                    start,
                    pool=self._context.pool,
                    tail=True,
                    max_wait_ms=self.max_wait_ms,
                ) as consumer:
                    if start is None:
                        reading.position = reading.processed = consumer.position
                    async for records in consumer:
                        await self._send.send(StreamBatch(stream_id, records))
            except (SBPError, OSError) as error:
                await self._send.send(error)
        reading.done.set()

    async def _all_streams(self) -> tuple[int, ...]:
        where = self.where
        return tuple(
            sorted(
                [s.stream_id async for s in self._pm.list_streams() if where is None or where(s)]
            )
        )


def _or_below_all(committed: int | None) -> int:
    return -1 if committed is None else committed


def _counting(records: Iterator[Record], reading: _Reading) -> Iterator[Record]:
    """Records handed out one at a time, ``position`` following each."""
    for record in records:
        reading.position = record.offset + 1
        yield record


async def _call(callback: StreamsCallback | None, streams: list[int]) -> None:
    if callback is None:
        return
    result = callback(streams)
    if result is not None:
        await result
