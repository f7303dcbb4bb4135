"""APPEND: record batches to the open ranges this node leads, answered once durable."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Sequence

import trio

from net.ratelog import RateLimitedLog
from net.request import Request, Responder
from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import (
    AuthorizationFailedError,
    InvalidRequestError,
    ProtocolError,
    RequestTimeoutError,
)
from storage.model import AppendItem, AppendOutcome, AppendResult

from ..context import NodeContext
from ..replication.primary import RangePipeline
from ..timeouts import TimeoutQueue

#: a full disk refuses every append: one warning per interval says so
logger = logging.getLogger(__name__)
_storage_full = RateLimitedLog(logger)


class AppendHandler:
    """Serves APPEND (SPEC §5) without a task per request.

    The payload is cut into one memoryview per item (no copy) and the whole
    request goes to the storage engine as one submission, so one group commit
    answers it. The engine calls back on its writer thread; the callback only
    hands the outcomes to ``_Completions``, which has trio deliver them: that
    answers the request and wakes the FETCHes waiting on those streams.

    The connection's reader calls ``start`` as soon as a request is decoded,
    and the request is submitted right there: arrival order is submission
    order, with nothing to sort. ``timeout_ms`` is kept by the node's
    ``TimeoutQueue``. A request naming a stream this node must first learn
    from the PM cannot be submitted yet: it waits in its connection's slow
    lane, a FIFO that one task (the one ``start`` returns) works through,
    and every later APPEND of that connection queues behind it there until
    the lane is empty, so one stream's batches keep request order.
    """

    def __init__(self, node: NodeContext) -> None:
        self._node = node
        self._counters = node.metrics.counters
        self._completions: _Completions | None = None
        #: per connection, the appends waiting to be submitted, oldest first
        self._slow_lanes: dict[object, collections.deque[_Append]] = {}

    def start(self, request: Request, responder: Responder) -> Awaitable[None] | None:
        infos, items, deadline = _parse(request)
        counters = self._counters
        counters.append_requests += 1
        counters.append_items += len(infos)
        append = _Append(
            self, items, self._completions_now(), infos, responder, request.received_at
        )
        node = self._node
        if items and node.access.enabled:
            append.deny(node.access.check_each(request.principal, "APPEND", append.stream_ids()))
        if not append.to_store:
            # nothing to store (no items, or every one denied), nothing to keep in order
            append.deliver(append.with_denials([]))
            return None
        if deadline < math.inf:
            append.timeouts = node.append_timeouts
            node.append_timeouts.add(deadline, append)
        lane = self._slow_lanes.get(request.connection)
        if lane is None and all(node.knows(item.stream_id) for item in append.to_store):
            append.submit()
            return None
        if lane is not None:
            lane.append(append)
            return None
        lane = self._slow_lanes[request.connection] = collections.deque([append])
        return self._work_through(request.connection, lane)

    async def _work_through(self, connection: object, lane: collections.deque[_Append]) -> None:
        """Submit the lane's appends in order, learning unknown streams first."""
        node = self._node
        try:
            while lane:
                append = lane[0]
                if not append.finished:  # not expired while it waited
                    for stream_id in {item.stream_id for item in append.to_store}:
                        if not node.knows(stream_id):
                            await node.learn_stream(stream_id)
                    if not append.finished:
                        append.submit()
                lane.popleft()
        finally:
            del self._slow_lanes[connection]

    def _completions_now(self) -> _Completions:
        if self._completions is None:
            self._completions = _Completions(trio.lowlevel.current_trio_token())
        return self._completions

    def results(
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
        self._ready: collections.deque[tuple[_Append, list[AppendOutcome], bool]] = (
            collections.deque()
        )
        self._scheduled = False

    def put(self, pending: _Append, outcomes: list[AppendOutcome], *, durable: bool = True) -> None:
        """On the writer thread: queue, and wake trio unless a drain is due.
        ``durable`` False: the outcomes of a group written, not yet committed."""
        self._ready.append((pending, outcomes, durable))
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
            pending, outcomes, durable = ready.popleft()
            if not durable:
                try:
                    pending.applied(outcomes)
                except Exception:
                    logger.exception("replicating an APPEND ahead of its commit failed")
                continue
            try:
                pending.deliver(outcomes)
            except Exception:
                # This runs as a trio system callback, where an exception
                # would end the whole process: one bad answer must not.
                logger.exception("APPEND answer failed")
                pending.fail_unknown()


class _Append:
    """One request's items on their way through the storage writer: the
    outcomes come back on the writer thread and are delivered on trio's,
    where they answer the request, unless its deadline came first (then the
    node's ``TimeoutQueue`` answers TIMEOUT through ``expire``)."""

    __slots__ = (
        "completions",
        "denied",
        "finished",
        "handler",
        "infos",
        "items",
        "received_at",
        "responder",
        "results",
        "timeouts",
        "to_store",
        "uncommitted",
    )

    def __init__(
        self,
        handler: AppendHandler,
        items: list[AppendItem],
        completions: _Completions,
        infos: Sequence[messages.AppendInfo],
        responder: Responder,
        received_at: float,
    ) -> None:
        self.handler = handler
        self.items = items
        self.completions = completions
        self.infos = infos
        self.responder: Responder | None = responder
        self.received_at = received_at
        self.timeouts: TimeoutQueue | None = None
        #: answered, from the delivery or by ``expire`` (``timeouts.Expiring``)
        self.finished = False
        #: once durable here: the answer, and the items of replicated ranges
        #: whose commit offset has not passed them yet (SPEC §7)
        self.results: list[messages.AppendResult] | None = None
        self.uncommitted: set[int] = set()
        #: by item index, the items refused AUTHORIZATION_FAILED (SPEC §9);
        #: the others go to storage
        self.denied: dict[int, ProtocolError] = {}
        self.to_store = items

    def stream_ids(self) -> list[int]:
        return [item.stream_id for item in self.items]

    def deny(self, denials: list[AuthorizationFailedError | None]) -> None:
        """Keep the denied items out of storage; they are answered with their error."""
        self.denied = {index: error for index, error in enumerate(denials) if error is not None}
        if self.denied:
            self.to_store = [i for n, i in enumerate(self.items) if n not in self.denied]

    def with_denials(self, outcomes: list[AppendOutcome]) -> list[AppendOutcome]:
        """The stored items' outcomes, with the denied items' errors in their places."""
        if not self.denied:
            return outcomes
        stored = iter(outcomes)
        return [self.denied.get(n) or next(stored) for n in range(len(self.items))]

    def submit(self) -> None:
        """To the storage writer; batches of ranges replicated from here go
        to the followers as soon as they are written (``on_applied``)."""
        node = self.handler._node
        replicator = node.replicator
        replicated = replicator is not None and any(
            replicator.replicates(item.stream_id) for item in self.to_store
        )
        node.engine.submit(self.to_store, self.on_durable, self.on_applied if replicated else None)

    def on_applied(self, outcomes: list[AppendOutcome]) -> None:
        """Runs on the storage writer thread, before the commit: hand over."""
        self.completions.put(self, outcomes, durable=False)

    def on_durable(self, outcomes: list[AppendOutcome]) -> None:
        """Runs on the storage writer thread: hand over, never block."""
        self.completions.put(self, self.with_denials(outcomes))

    def applied(self, outcomes: list[AppendOutcome]) -> None:
        """On the trio thread: the stored items' batches are written, their
        commit syncing; the pipelines of replicated ranges take them now."""
        replicator = self.handler._node.replicator
        assert replicator is not None
        for item, outcome in zip(self.to_store, outcomes, strict=True):
            if isinstance(outcome, AppendResult) and replicator.replicates(item.stream_id):
                pipeline = replicator.pipeline_for(item.stream_id, outcome.base_offset)
                if pipeline is not None:
                    pipeline.applied(outcome.base_offset, outcome.record_count, item.batch)

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
        # Batches of replicated ranges go to the followers even when this
        # request timed out already: their pipelines send what is durable.
        pipelines = self._pipelines(outcomes)
        if self.finished:
            return  # timed out already
        self.results = self.handler.results(self.infos, outcomes)
        waits = [
            (index, pipeline, outcome.base_offset + outcome.record_count)
            for index, (outcome, pipeline) in enumerate(zip(outcomes, pipelines, strict=True))
            if pipeline is not None and isinstance(outcome, AppendResult)
        ]
        if not waits:
            self._answer_now()
            return
        # All of them first: a callback may run at once, and must not find
        # the set empty before the last item is in it.
        self.uncommitted.update(index for index, _, _ in waits)
        for index, pipeline, end_offset in waits:
            pipeline.wait_commit(end_offset, functools.partial(self._committed, index))

    def _pipelines(self, outcomes: list[AppendOutcome]) -> list[RangePipeline | None]:
        """Per item, the replication pipeline of its range (None: not replicated)."""
        replicator = self.handler._node.replicator
        if replicator is None:
            return [None] * len(outcomes)
        found: list[RangePipeline | None] = []
        for info, outcome in zip(self.infos, outcomes, strict=True):
            pipeline = None
            if isinstance(outcome, AppendResult):
                pipeline = replicator.pipeline_for(info.stream_id, outcome.base_offset)
                if pipeline is not None:
                    pipeline.new_data()
            found.append(pipeline)
        return found

    def _committed(self, index: int, committed: bool) -> None:
        """The commit offset passed item ``index`` (or never will)."""
        if self.finished or index not in self.uncommitted:
            return
        self.uncommitted.discard(index)
        if not committed:
            assert self.results is not None
            self.handler._counters.append_items_failed += 1
            self.results[index] = _not_replicated(
                self.infos[index], "its range was sealed before enough replicas held the batch"
            )
        if not self.uncommitted:
            self._answer_now()

    def _answer_now(self) -> None:
        if self.timeouts is not None:
            self.timeouts.finished()
        assert self.results is not None
        self._end(self.results)

    def expire(self) -> None:
        """The deadline passed first. Items already submitted still become
        durable (a retry may then append them twice, as in any at-least-once
        log); the client is told they did not finish in time."""
        if self.results is None:
            self.handler._counters.append_items_failed += len(self.infos)
            late = RequestTimeoutError("not durable before the request's timeout_ms")
            outcomes = self.with_denials([late] * len(self.to_store))
            self._end(self.handler.results(self.infos, outcomes))
            return
        # Durable here, but not on enough replicas in time.
        self.handler._counters.append_items_failed += len(self.uncommitted)
        for index in self.uncommitted:
            self.results[index] = _not_replicated(
                self.infos[index], "fewer than ack_nums replicas held the batch before the deadline"
            )
        self.uncommitted.clear()
        self._end(self.results)

    def fail_unknown(self) -> None:
        """Answer UNKNOWN when building the real answer failed (a bug)."""
        responder, self.responder = self.responder, None
        self.finished = True
        if responder is not None and not responder.done:
            responder.send_error_nowait(ErrorCode.UNKNOWN, "internal server error")

    def _end(self, results: list[messages.AppendResult]) -> None:
        self.finished = True
        self.handler._counters.append_seconds += trio.current_time() - self.received_at
        responder = self.responder
        assert responder is not None
        responder.send_nowait(messages.AppendResponse(append_responses=tuple(results)))
        self.responder = None


def _parse(request: Request) -> tuple[Sequence[messages.AppendInfo], list[AppendItem], float]:
    """The request's items, one payload view each, and its deadline (trio
    time; infinite without ``timeout_ms``)."""
    header = request.header_as(messages.AppendRequest)
    infos = header.append_requests
    deadline = request.deadline(header.timeout_ms)
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


def _not_replicated(info: messages.AppendInfo, why: str) -> messages.AppendResult:
    return messages.AppendResult(
        stream_id=info.stream_id,
        request_index=info.request_index,
        base_offset=-1,
        error_code=ErrorCode.NOT_ENOUGH_REPLICAS,
        error_message=why,
    )
