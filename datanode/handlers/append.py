"""APPEND: record batches to the open ranges this node leads, answered once durable."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Sequence

import trio

from net.ratelog import RateLimitedLog
from net.request import Request, Responder
from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import InvalidRequestError, ProtocolError
from storage.model import AppendItem, AppendOutcome

from ..context import NodeContext
from ..timeouts import TimeoutQueue

#: a full disk refuses every append: one warning per interval says so
_storage_full = RateLimitedLog(logging.getLogger(__name__))


class AppendHandler:
    """Serves APPEND (SPEC §5).

    The payload is cut into one memoryview per item (no copy) and the whole
    request goes to the storage engine as one submission, so one group commit
    answers it. The engine calls back on its writer thread; the callback only
    hands the outcomes to ``_Completions``, which has trio deliver them: that
    answers the request and wakes the FETCHes waiting on those streams.

    Two paths lead to the engine:

    - ``start_nowait``, the common case: the connection's reader offers the
      request as soon as it is decoded and it is submitted right there, in
      arrival order, and answered from the delivery. No task, no cancel scope;
      ``timeout_ms`` is kept by the node's ``TimeoutQueue``.
    - ``__call__``, a task per request, for a request that has to wait before
      its submission: one naming a stream this node must first learn about
      from the PM, and every later APPEND of its connection until those have
      been submitted (they queue at ``node.append_order`` in arrival order).
    """

    def __init__(self, node: NodeContext) -> None:
        self._node = node
        self._counters = node.metrics.counters
        self._completions: _Completions | None = None
        #: per connection, the requests handed to the task path and not yet
        #: submitted: while there are any, later ones follow them there
        self._waiting: dict[object, set[Request]] = {}

    def start_nowait(self, request: Request, responder: Responder) -> bool:
        """Submit now, if nothing must be waited for first (see the class)."""
        infos, items, deadline = _parse(request)
        if not items:
            return False  # nothing to submit, nothing to keep in order
        node = self._node
        connection = request.connection
        if connection in self._waiting or not all(node.knows(item.stream_id) for item in items):
            self._waiting.setdefault(connection, set()).add(request)
            return False
        pending = _ImmediateAppend(
            self, items, self._completions_now(), infos, responder, request.received_at
        )
        node.engine.submit(items, pending.on_durable)
        self._count_request(infos)
        if deadline < math.inf:
            pending.timeouts = node.append_timeouts
            node.append_timeouts.add(deadline, pending)
        return True

    async def __call__(self, request: Request, responder: Responder) -> None:
        infos, items, deadline = _parse(request)
        self._count_request(infos)
        try:
            results = await self._append(request, infos, items, deadline)
        finally:
            self._counters.append_seconds += trio.current_time() - request.received_at
        await responder.send(messages.AppendResponse(append_responses=tuple(results)))

    def _count_request(self, infos: Sequence[messages.AppendInfo]) -> None:
        counters = self._counters
        counters.append_requests += 1
        counters.append_items += len(infos)

    def _completions_now(self) -> _Completions:
        if self._completions is None:
            self._completions = _Completions(trio.lowlevel.current_trio_token())
        return self._completions

    def _submitted(self, request: Request) -> None:
        """A request of the task path is past its submission (or never will
        be): later APPENDs of its connection may go straight in again."""
        waiting = self._waiting.get(request.connection)
        if waiting is not None:
            waiting.discard(request)
            if not waiting:
                del self._waiting[request.connection]

    async def _append(
        self,
        request: Request,
        infos: Sequence[messages.AppendInfo],
        items: list[AppendItem],
        deadline: float,
    ) -> list[messages.AppendResult]:
        if not items:
            return []
        node = self._node
        pending = _AwaitedAppend(self, items, self._completions_now())
        with trio.move_on_at(deadline):
            # Up to the submission, requests of one connection go in arrival
            # order: that is what keeps one stream's batches in request order.
            try:
                async with node.append_order.turn(request):
                    for stream_id in {item.stream_id for item in items}:
                        if not node.knows(stream_id):
                            await node.learn_stream(stream_id)
                    node.engine.submit(items, pending.on_durable)
            finally:
                self._submitted(request)
            await pending.done.wait()
        if pending.outcomes is None:
            # The deadline passed first. Items already submitted still become
            # durable (a retry may then append them twice, as in any
            # at-least-once log); the client is told they did not finish in time.
            pending.done.set()
            self._counters.append_items_failed += len(items)
            return [_timed_out(info) for info in infos]
        return self._results(infos, pending.outcomes)

    def _results(
        self, infos: Sequence[messages.AppendInfo], outcomes: list[AppendOutcome]
    ) -> list[messages.AppendResult]:
        results: list[messages.AppendResult] = []
        for info, outcome in zip(infos, outcomes, strict=True):
            if isinstance(outcome, ProtocolError):
                results.append(
                    messages.AppendResult(
                        stream_id=info.stream_id,
                        request_index=info.request_index,
                        base_offset=-1,
                        error_code=outcome.code,
                        error_message=outcome.message,
                    )
                )
                continue
            results.append(
                messages.AppendResult(
                    stream_id=info.stream_id,
                    request_index=info.request_index,
                    base_offset=outcome.base_offset,
                    stream_append_time_ms=outcome.append_time_ms,
                )
            )
        return results


class _Completions:
    """Outcomes handed from the storage writer thread to trio, many per wake-up.

    ``run_sync_soon`` costs the writer a syscall (the event loop's wake-up
    socket) and with it the GIL, which it must then win back from the busy
    event loop: paying that once per group commit instead of once per
    request keeps the writer, the node's bottleneck, on its own work.
    """

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._ready: collections.deque[tuple[_Submission, list[AppendOutcome]]] = (
            collections.deque()
        )
        self._scheduled = False

    def put(self, pending: _Submission, outcomes: list[AppendOutcome]) -> None:
        """On the writer thread: queue, and wake trio unless a drain is due."""
        self._ready.append((pending, outcomes))
        if not self._scheduled:
            self._scheduled = True
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._drain)

    def _drain(self) -> None:
        # Cleared before popping: whatever the writer queues from now on
        # either is popped below or schedules the next drain.
        self._scheduled = False
        ready = self._ready
        while ready:
            pending, outcomes = ready.popleft()
            pending.deliver(outcomes)


class _Submission:
    """One request's items on their way through the storage writer: the
    outcomes come back on the writer thread and are delivered on trio's."""

    __slots__ = ("completions", "handler", "items")

    def __init__(
        self, handler: AppendHandler, items: list[AppendItem], completions: _Completions
    ) -> None:
        self.handler = handler
        self.items = items
        self.completions = completions

    def on_durable(self, outcomes: list[AppendOutcome]) -> None:
        """Runs on the storage writer thread: hand over, never block."""
        self.completions.put(self, outcomes)

    def deliver(self, outcomes: list[AppendOutcome]) -> None:
        """On the trio thread: count, wake the FETCHes waiting on these streams
        (even when the request itself already timed out), then answer."""
        counters = self.handler._counters
        waiters = self.handler._node.waiters
        for item, outcome in zip(self.items, outcomes, strict=True):
            if isinstance(outcome, ProtocolError):
                counters.append_items_failed += 1
                if outcome.code == ErrorCode.STORAGE_FULL:
                    _storage_full.warning(
                        "STORAGE_FULL", "APPEND to stream %d refused: %s", item.stream_id, outcome
                    )
            else:
                counters.appended_records += outcome.record_count
                counters.appended_bytes += len(item.batch)
                waiters.notify(item.stream_id)
        self.items = []  # the payload views: their receive buffers can go
        self._answer(outcomes)

    def _answer(self, outcomes: list[AppendOutcome]) -> None:
        raise NotImplementedError


class _AwaitedAppend(_Submission):
    """A submission of the task path: its handler waits for ``done``."""

    __slots__ = ("done", "outcomes")

    def __init__(
        self, handler: AppendHandler, items: list[AppendItem], completions: _Completions
    ) -> None:
        super().__init__(handler, items, completions)
        self.done = trio.Event()
        self.outcomes: list[AppendOutcome] | None = None

    def _answer(self, outcomes: list[AppendOutcome]) -> None:
        if not self.done.is_set():
            self.outcomes = outcomes
            self.done.set()


class _ImmediateAppend(_Submission):
    """A submission taken by ``start_nowait``: answered from the delivery, or
    with TIMEOUT by the node's ``TimeoutQueue`` if its deadline comes first."""

    __slots__ = ("finished", "infos", "received_at", "responder", "timeouts")

    def __init__(
        self,
        handler: AppendHandler,
        items: list[AppendItem],
        completions: _Completions,
        infos: Sequence[messages.AppendInfo],
        responder: Responder,
        received_at: float,
    ) -> None:
        super().__init__(handler, items, completions)
        self.infos = infos
        self.responder: Responder | None = responder
        self.received_at = received_at
        self.timeouts: TimeoutQueue | None = None
        #: answered, from the delivery or by ``expire`` (``timeouts.Expiring``)
        self.finished = False

    def _answer(self, outcomes: list[AppendOutcome]) -> None:
        if self.finished:
            return  # timed out already
        if self.timeouts is not None:
            self.timeouts.finished()
        self._end(self.handler._results(self.infos, outcomes))

    def expire(self) -> None:
        """The deadline passed first. The items still become durable (a retry
        may then append them twice, as in any at-least-once log); the client
        is told they did not finish in time."""
        self.handler._counters.append_items_failed += len(self.infos)
        self._end([_timed_out(info) for info in self.infos])

    def _end(self, results: list[messages.AppendResult]) -> None:
        self.finished = True
        responder, self.responder = self.responder, None
        self.handler._counters.append_seconds += trio.current_time() - self.received_at
        assert responder is not None
        responder.end_nowait(messages.AppendResponse(append_responses=tuple(results)))


def _parse(request: Request) -> tuple[Sequence[messages.AppendInfo], list[AppendItem], float]:
    """The request's items, one payload view each, and its deadline (trio
    time; infinite without ``timeout_ms``)."""
    header = request.header_as(messages.AppendRequest)
    infos = header.append_requests
    deadline = request.received_at + header.timeout_ms / 1000 if header.timeout_ms > 0 else math.inf
    return infos, _split_payload(infos, request.payload), deadline


def _split_payload(infos: Sequence[messages.AppendInfo], payload: memoryview) -> list[AppendItem]:
    """One view per item; a payload that is not exactly the items' batches
    end to end is a malformed request (the whole request fails)."""
    items: list[AppendItem] = []
    position = 0
    size = len(payload)
    for info in infos:
        end = position + info.batch_length
        if info.batch_length < 0 or end > size:
            break
        items.append(AppendItem(info.stream_id, payload[position:end]))
        position = end
    if len(items) != len(infos) or position != size:
        total = sum(info.batch_length for info in infos)
        raise InvalidRequestError(
            f"payload holds {size} bytes but the batch_lengths of {len(infos)} items sum to {total}"
        )
    return items


def _timed_out(info: messages.AppendInfo) -> messages.AppendResult:
    return messages.AppendResult(
        stream_id=info.stream_id,
        request_index=info.request_index,
        base_offset=-1,
        error_code=ErrorCode.TIMEOUT,
        error_message="not durable before the request's timeout_ms",
    )
