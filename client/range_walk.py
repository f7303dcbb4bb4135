"""The walk of one stream a ``Consumer`` reads (its fetcher task): the
range holding the next offset, FETCHes to its replicas with read-ahead,
retries across replicas, the end of the stream, moving on at a sealed
range's end. See ``client.consumer`` for what it does; this module is how.

The walk sends what it reads into a channel, in offset order: a ``Chunk``
per FETCH answer, then ``END`` (without ``tail``), or the error that ended it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import trio

from sbp import messages
from sbp.batches import BASE_OFFSET, batch_span, batch_spans
from sbp.enums import ErrorCode
from sbp.errors import (
    ConnectionClosed,
    InvalidRecordBatchError,
    OffsetOutOfRangeError,
    RangeSealedError,
    RecordsUnreachableError,
    SBPError,
    error_for,
)

from ._routing import STALE_ROUTE_CODES, ClientContext, StreamRoutes, replica_for_read
from .compacted_tail import compacted_end
from .retry import is_transient, retry_delay


@dataclass(frozen=True, slots=True)
class Chunk:
    """One FETCH answer: whole batches, the first record wanted, the next offset."""

    data: memoryview
    first_wanted: int


class End:
    """Sent by the fetcher after the last chunk (without ``tail``)."""


END: Final = End()


@dataclass(slots=True)
class _Ahead:
    """A FETCH sent before the answer ahead of it came back."""

    offset: int
    cancel: trio.CancelScope
    done: trio.Event
    #: the answer, or None if the FETCH failed (the walk then asks again)
    answer: tuple[messages.FetchResult, memoryview] | None = None


@dataclass(frozen=True, slots=True)
class WalkSettings:
    """How a walk reads (the ``Consumer``'s options of the same names)."""

    tail: bool
    max_wait_ms: int
    fetch_bytes: int
    read_ahead: int
    prefer_followers: bool
    retry_timeout: float


#: what a walk sends: a chunk, the end, or the error that ended it
Sent = Chunk | End | BaseException


class RangeWalk:
    """One walk of a stream from an offset (see the module docstring); the
    FETCHes sent ahead run in ``nursery``."""

    def __init__(
        self,
        context: ClientContext,
        stream_id: int,
        settings: WalkSettings,
        nursery: trio.Nursery,
        send: trio.MemorySendChannel[Sent],
    ) -> None:
        self._context = context
        self.stream_id = stream_id
        self.tail = settings.tail
        self.max_wait_ms = settings.max_wait_ms
        self.fetch_bytes = settings.fetch_bytes
        self.read_ahead = settings.read_ahead
        self.prefer_followers = settings.prefer_followers
        self.retry_timeout = settings.retry_timeout
        self._nursery = nursery
        self._send = send

    async def run(self, from_offset: int | None, started_at: Callable[[int], None]) -> None:
        """Walk from ``from_offset`` (None: the stream's first stored offset,
        told to ``started_at`` once the ranges are listed) to the end, or
        forever with ``tail``; what it reads, its end or its error go to the
        channel."""
        try:
            await self._walk(from_offset, started_at)
        except (SBPError, OSError, trio.TooSlowError) as error:
            await self._send.send(error)
        else:
            await self._send.send(END)

    async def _walk(self, from_offset: int | None, started_at: Callable[[int], None]) -> None:
        routes = StreamRoutes(self._context.pm, self.stream_id)
        await self._retrying(routes.refresh)
        offset = routes.first_offset if from_offset is None else from_offset
        if from_offset is None:
            started_at(offset)
        #: FETCHes sent ahead, in offset order (see ``client.consumer``)
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
                await self._send.send(Chunk(data, offset))
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
        if len(data) < self.fetch_bytes // 2:
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
