"""APPEND: record batches to the open ranges this node leads, answered once durable."""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Sequence

import trio

from net.request import Request, Responder
from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import InvalidRequestError, ProtocolError
from storage.model import AppendItem, AppendOutcome

from ..context import NodeContext


class AppendHandler:
    """Serves APPEND (SPEC §5).

    The payload is cut into one memoryview per item (no copy) and the whole
    request goes to the storage engine as one submission, so one group commit
    answers it. The engine calls back on its writer thread; the callback only
    hands the outcomes to ``_Completions``, which has trio run
    ``_Pending.deliver`` for each: that wakes the handler and the FETCHes
    waiting on those streams.
    """

    def __init__(self, node: NodeContext) -> None:
        self._node = node
        self._counters = node.metrics.counters
        self._completions: _Completions | None = None

    async def __call__(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.AppendRequest)
        infos = header.append_requests
        items = _split_payload(infos, request.payload)
        counters = self._counters
        counters.append_requests += 1
        counters.append_items += len(infos)
        deadline = (
            request.received_at + header.timeout_ms / 1000 if header.timeout_ms > 0 else math.inf
        )
        try:
            results = await self._append(request, infos, items, deadline)
        finally:
            elapsed = trio.current_time() - request.received_at
            counters.append_seconds += elapsed
        await responder.send(messages.AppendResponse(append_responses=tuple(results)))

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
        if self._completions is None:
            self._completions = _Completions(trio.lowlevel.current_trio_token())
        pending = _Pending(self, items, self._completions)
        with trio.move_on_at(deadline):
            # Up to the submission, requests of one connection go in arrival
            # order: that is what keeps one stream's batches in request order.
            async with node.append_order.turn(request):
                for stream_id in {item.stream_id for item in items}:
                    if not node.knows(stream_id):
                        await node.learn_stream(stream_id)
                node.engine.submit(items, pending.on_durable)
                pending.submitted = True
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
        self._ready: collections.deque[tuple[_Pending, list[AppendOutcome]]] = collections.deque()
        self._scheduled = False

    def put(self, pending: _Pending, outcomes: list[AppendOutcome]) -> None:
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


class _Pending:
    """One submission's outcomes, handed from the writer thread to trio."""

    __slots__ = ("completions", "done", "handler", "items", "outcomes", "submitted")

    def __init__(
        self, handler: AppendHandler, items: list[AppendItem], completions: _Completions
    ) -> None:
        self.handler = handler
        self.items = items
        self.completions = completions
        self.done = trio.Event()
        self.outcomes: list[AppendOutcome] | None = None
        self.submitted = False

    def on_durable(self, outcomes: list[AppendOutcome]) -> None:
        """Runs on the storage writer thread: hand over, never block."""
        self.completions.put(self, outcomes)

    def deliver(self, outcomes: list[AppendOutcome]) -> None:
        """On the trio thread: count, wake the FETCHes waiting on these streams
        (even when the request itself already timed out), wake the handler."""
        counters = self.handler._counters
        waiters = self.handler._node.waiters
        for item, outcome in zip(self.items, outcomes, strict=True):
            if isinstance(outcome, ProtocolError):
                counters.append_items_failed += 1
            else:
                counters.appended_records += outcome.record_count
                counters.appended_bytes += len(item.batch)
                waiters.notify(item.stream_id)
        if not self.done.is_set():
            self.outcomes = outcomes
            self.done.set()


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
