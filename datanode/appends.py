"""The path of an APPEND through the data node's core, as an explicit
state machine per request (``AppendTicket``).

A ticket moves through storage in one direction::

    RECEIVED --submit--------------------> SUBMITTED
    RECEIVED --a stream is unknown here--> QUEUED --learned--> SUBMITTED
    SUBMITTED --group written (replicated ranges only)--> WRITTEN
    SUBMITTED | WRITTEN --group durable--> DURABLE

and is answered once, independently of that: at DURABLE when no item waits
for replicas, once the commit offset passes every replicated item (or its
range is sealed under it: NOT_ENOUGH_REPLICAS), or when ``timeout_ms``
passes first (``expire``: TIMEOUT, the batches still land). Each transition
is one method below; nothing else changes ``state``.

No task per request: the connection's reader calls ``Appends.start`` as
soon as a request is decoded and the ticket is submitted right there, so
arrival order is submission order. A ticket naming a stream this node must
first learn from the PM waits in its connection's slow lane, a FIFO that
one task works through, and every later APPEND of that connection queues
behind it there, so one stream's batches keep request order.

The storage writer calls back on its own thread; ``_Completions`` hands the
outcomes to trio, many per wake-up.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import trio

from net.ratelog import RateLimitedLog
from sbp.enums import ErrorCode
from sbp.errors import NotEnoughReplicasError, ProtocolError, RequestTimeoutError
from storage.engine import StorageEngine
from storage.model import AppendItem, AppendOutcome, AppendResult

from .metrics import NodeCounters
from .replication.primary import RangePipeline, Replicator
from .timeouts import TimeoutQueue
from .waiters import StreamWaiters

logger = logging.getLogger(__name__)
#: a full disk refuses every append: one warning per interval says so
_storage_full = RateLimitedLog(logger)

#: called once per ticket, on trio's thread, with one outcome per item
#: (None: building the answer failed, a bug; the request is answered UNKNOWN)
Answer = Callable[[list[AppendOutcome] | None], None]


class TicketState(enum.Enum):
    """Where a ticket is; each step asserts the one before it."""

    RECEIVED = "received"
    QUEUED = "queued"
    SUBMITTED = "submitted"
    WRITTEN = "written"
    DURABLE = "durable"


_BEFORE_DURABLE = frozenset({TicketState.RECEIVED, TicketState.SUBMITTED, TicketState.WRITTEN})


class Appends:
    """Takes APPEND tickets to storage and answers them; see the module docstring."""

    def __init__(
        self,
        engine: StorageEngine,
        replicator: Replicator | None,
        waiters: StreamWaiters,
        counters: NodeCounters,
        timeouts: TimeoutQueue,
        knows: Callable[[int], bool],
        learn: Callable[[int], Awaitable[bool]],
    ) -> None:
        self._engine = engine
        self._replicator = replicator
        self._waiters = waiters
        self._counters = counters
        self._timeouts = timeouts
        self._knows = knows
        self._learn = learn
        self._completions: _Completions | None = None
        #: per connection, the tickets waiting to be submitted, oldest first
        self._slow_lanes: dict[object, collections.deque[AppendTicket]] = {}

    def start(self, ticket: AppendTicket, connection: object) -> Awaitable[None] | None:
        """Submit the ticket now, or queue it behind its connection's slow
        lane; the awaitable, when one is returned, works through that lane."""
        if not ticket.to_store:
            # nothing to store (no items, or every one denied), nothing to keep in order
            self.durable(ticket, [])
            return None
        if ticket.deadline < math.inf:
            ticket.timeouts = self._timeouts
            self._timeouts.add(ticket.deadline, ticket)
        lane = self._slow_lanes.get(connection)
        if lane is None and all(self._knows(item.stream_id) for item in ticket.to_store):
            self._submit(ticket)
            return None
        assert ticket.state is TicketState.RECEIVED, ticket.state
        ticket.state = TicketState.QUEUED
        if lane is not None:
            lane.append(ticket)
            return None
        lane = self._slow_lanes[connection] = collections.deque([ticket])
        return self._work_through(connection, lane)

    async def _work_through(
        self, connection: object, lane: collections.deque[AppendTicket]
    ) -> None:
        """Submit the lane's tickets in order, learning unknown streams first."""
        try:
            while lane:
                ticket = lane[0]
                if not ticket.answered:  # not expired while it waited
                    for stream_id in {item.stream_id for item in ticket.to_store}:
                        if not self._knows(stream_id):
                            await self._learn(stream_id)
                    if not ticket.answered:
                        self._submit(ticket)
                lane.popleft()
        finally:
            del self._slow_lanes[connection]

    def _submit(self, ticket: AppendTicket) -> None:
        """RECEIVED | QUEUED -> SUBMITTED: to the storage writer; batches of
        ranges replicated from here go to the followers as soon as their
        group is written (WRITTEN), before it is durable."""
        if self._completions is None:
            self._completions = _Completions(trio.lowlevel.current_trio_token())
        completions = self._completions
        replicator = self._replicator
        replicated = replicator is not None and any(
            replicator.replicates(item.stream_id) for item in ticket.to_store
        )
        assert ticket.state in (TicketState.RECEIVED, TicketState.QUEUED), ticket.state
        ticket.state = TicketState.SUBMITTED
        self._engine.submit(
            ticket.to_store,
            functools.partial(completions.put, self, ticket, durable=True),
            functools.partial(completions.put, self, ticket, durable=False) if replicated else None,
        )

    def written(self, ticket: AppendTicket, outcomes: list[AppendOutcome]) -> None:
        """SUBMITTED -> WRITTEN, on trio's thread: the batches are written,
        their commit syncing; the pipelines of replicated ranges take them
        now, from memory."""
        assert ticket.state is TicketState.SUBMITTED, ticket.state
        ticket.state = TicketState.WRITTEN
        replicator = self._replicator
        assert replicator is not None
        for item, outcome in zip(ticket.to_store, outcomes, strict=True):
            if (
                isinstance(outcome, AppendResult)
                and not outcome.duplicate
                and replicator.replicates(item.stream_id)
            ):
                pipeline = replicator.pipeline_for(item.stream_id, outcome.base_offset)
                if pipeline is not None:
                    pipeline.applied(
                        outcome.base_offset, outcome.record_count, item.batch, item.producer
                    )

    def durable(self, ticket: AppendTicket, stored: list[AppendOutcome]) -> None:
        """-> DURABLE, on trio's thread: count, wake the FETCHes waiting on
        these streams (even when the ticket was answered TIMEOUT already),
        then answer, or wait for the replicas of replicated items."""
        # RECEIVED: nothing to store (see ``start``)
        assert ticket.state in _BEFORE_DURABLE, ticket.state
        ticket.state = TicketState.DURABLE
        outcomes = ticket.with_denials(stored)
        counters = self._counters
        for item, outcome in zip(ticket.items, outcomes, strict=True):
            if isinstance(outcome, ProtocolError):
                counters.append_items_failed += 1
                if outcome.code == ErrorCode.PRODUCER_FENCED:
                    counters.producers_fenced += 1
                elif outcome.code == ErrorCode.OUT_OF_ORDER_SEQUENCE:
                    counters.out_of_order_sequences += 1
                elif outcome.code == ErrorCode.UNKNOWN_PRODUCER:
                    counters.unknown_producers += 1
                elif outcome.code == ErrorCode.STORAGE_FULL:
                    _storage_full.warning(
                        "STORAGE_FULL", "APPEND to stream %d refused: %s", item.stream_id, outcome
                    )
            elif outcome.duplicate:
                counters.duplicates_answered += 1
            else:
                counters.appended_records += outcome.record_count
                counters.appended_bytes += len(item.batch)
                self._waiters.notify(item.stream_id)
        # the payload views: their receive buffers can go, though the ticket
        # stays in the timeout queue until that is next compacted
        ticket.items = ticket.to_store = []
        # Batches of replicated ranges go to the followers even when this
        # ticket timed out already: their pipelines send what is durable.
        pipelines = self._pipelines(ticket, outcomes)
        if ticket.answered:
            return
        ticket.outcomes = outcomes
        waits = [
            (index, pipeline, outcome.base_offset + outcome.record_count)
            for index, (outcome, pipeline) in enumerate(zip(outcomes, pipelines, strict=True))
            if pipeline is not None and isinstance(outcome, AppendResult)
        ]
        if not waits:
            ticket.answer_with(outcomes)
            return
        # All of them first: a callback may run at once, and must not find
        # the set empty before the last item is in it.
        ticket.uncommitted.update(index for index, _, _ in waits)
        for index, pipeline, end_offset in waits:
            pipeline.wait_commit(end_offset, functools.partial(ticket.committed, index))

    def _pipelines(
        self, ticket: AppendTicket, outcomes: list[AppendOutcome]
    ) -> list[RangePipeline | None]:
        """Per item, the replication pipeline of its range (None: not replicated)."""
        replicator = self._replicator
        if replicator is None:
            return [None] * len(outcomes)
        found: list[RangePipeline | None] = []
        for stream_id, outcome in zip(ticket.stream_ids, outcomes, strict=True):
            pipeline = None
            if isinstance(outcome, AppendResult) and not self._settled(stream_id, outcome):
                pipeline = replicator.pipeline_for(stream_id, outcome.base_offset)
                if pipeline is not None:
                    pipeline.new_data()
            found.append(pipeline)
        return found

    def _settled(self, stream_id: int, outcome: AppendResult) -> bool:
        """A resend of a batch in a range the PM sealed with it inside: it is
        in the stream for good, with nothing left to wait for (SPEC §10)."""
        if not outcome.duplicate:
            return False
        info = self._engine.range_at(stream_id, outcome.base_offset)
        return info is not None and info.end_is_final


class AppendTicket:
    """One APPEND request's items on their way through storage and
    replication; see the module docstring for its states."""

    __slots__ = (
        "answered",
        "counters",
        "deadline",
        "denied",
        "items",
        "on_answer",
        "outcomes",
        "received_at",
        "state",
        "stream_ids",
        "timeouts",
        "to_store",
        "uncommitted",
    )

    def __init__(
        self,
        items: list[AppendItem],
        denials: Sequence[ProtocolError | None],
        deadline: float,
        received_at: float,
        counters: NodeCounters,
        on_answer: Answer,
    ) -> None:
        self.state = TicketState.RECEIVED
        self.items = items
        self.stream_ids = [item.stream_id for item in items]
        #: by item index, the items refused before storage (SPEC §9); the others are stored
        self.denied = {n: error for n, error in enumerate(denials) if error is not None}
        self.to_store = (
            [item for n, item in enumerate(items) if n not in self.denied] if self.denied else items
        )
        self.deadline = deadline
        self.received_at = received_at
        self.counters = counters
        self.on_answer: Answer | None = on_answer
        self.timeouts: TimeoutQueue | None = None
        #: answered, from the delivery or by ``expire`` (``timeouts.Expiring``)
        self.answered = False
        #: once DURABLE: one outcome per item, and the items of replicated
        #: ranges whose commit offset has not passed them yet (SPEC §7)
        self.outcomes: list[AppendOutcome] | None = None
        self.uncommitted: set[int] = set()

    @property
    def finished(self) -> bool:  # ``timeouts.Expiring``
        return self.answered

    def with_denials(self, stored: list[AppendOutcome]) -> list[AppendOutcome]:
        """The stored items' outcomes, with the denied items' errors in their places."""
        if not self.denied:
            return stored
        outcomes = iter(stored)
        return [self.denied.get(n) or next(outcomes) for n in range(len(self.stream_ids))]

    def committed(self, index: int, committed: bool) -> None:
        """The commit offset passed item ``index`` (or never will: its range
        was sealed under it)."""
        if self.answered or index not in self.uncommitted:
            return
        self.uncommitted.discard(index)
        assert self.outcomes is not None
        if not committed:
            self.counters.append_items_failed += 1
            self.outcomes[index] = NotEnoughReplicasError(
                "its range was sealed before enough replicas held the batch"
            )
        if not self.uncommitted:
            self.answer_with(self.outcomes)

    def expire(self) -> None:
        """The deadline passed first. Items already submitted still become
        durable; the client is told they did not finish in time."""
        if self.outcomes is None:
            self.counters.append_items_failed += len(self.to_store)
            late = RequestTimeoutError("not durable before the request's timeout_ms")
            self._answer(self.with_denials([late] * len(self.to_store)))
            return
        # Durable here, but not on enough replicas in time.
        self.counters.append_items_failed += len(self.uncommitted)
        for index in self.uncommitted:
            self.outcomes[index] = NotEnoughReplicasError(
                "fewer than ack_nums replicas held the batch before the deadline"
            )
        self.uncommitted.clear()
        self._answer(self.outcomes)

    def answer_with(self, outcomes: list[AppendOutcome]) -> None:
        """Answer now (not by the deadline): the deadline is not needed any more."""
        if self.timeouts is not None:
            self.timeouts.finished()
        self._answer(outcomes)

    def fail(self) -> None:
        """Answer UNKNOWN when building the real answer failed (a bug)."""
        on_answer, self.on_answer = self.on_answer, None
        self.answered = True
        if on_answer is not None:
            on_answer(None)

    def _answer(self, outcomes: list[AppendOutcome]) -> None:
        self.answered = True
        self.counters.append_seconds += trio.current_time() - self.received_at
        on_answer = self.on_answer
        if on_answer is not None:
            on_answer(outcomes)  # kept until it returns: ``fail`` answers if it raised
            self.on_answer = None


class _Completions:
    """Outcomes handed from the storage writer thread to trio, many per wake-up.

    ``run_sync_soon`` costs the writer a syscall (the event loop's wake-up
    socket) and with it the GIL, which it must then win back from the busy
    event loop: paying that once per group commit instead of once per
    request keeps the writer, the node's bottleneck, on its own work.
    """

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._ready: collections.deque[tuple[Appends, AppendTicket, list[AppendOutcome], bool]] = (
            collections.deque()
        )
        self._scheduled = False

    def put(
        self,
        appends: Appends,
        ticket: AppendTicket,
        outcomes: list[AppendOutcome],
        *,
        durable: bool,
    ) -> None:
        """On the writer thread: queue, and wake trio unless a drain is due.
        ``durable`` False: the outcomes of a group written, not yet committed."""
        self._ready.append((appends, ticket, outcomes, durable))
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
            appends, ticket, outcomes, durable = ready.popleft()
            if not durable:
                try:
                    appends.written(ticket, outcomes)
                except Exception:
                    logger.exception("replicating an APPEND ahead of its commit failed")
                continue
            try:
                appends.durable(ticket, outcomes)
            except Exception:
                # This runs as a trio system callback, where an exception
                # would end the whole process: one bad answer must not.
                logger.exception("APPEND answer failed")
                ticket.fail()
