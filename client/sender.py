"""The producer's sender: takes the accumulator's batches to the primary of
the stream's open range, in order, and retries what fails (the part of
``Producer`` that aiokafka calls its sender).

It packs as many ready batches as fit in ``max_request_bytes`` into one
APPEND, with up to ``max_in_flight`` requests on the connection at a time;
they leave in the order they were made (``client.ordered``).

Failure handling: a retriable answer (RANGE_SEALED, RANGE_NOT_FOUND,
NOT_PRIMARY, TIMEOUT, a lost connection …) stops the sender; it waits for
the requests still in flight, lists the ranges again from the PM, backs off
and sends the failed batches again, oldest first, until their delivery
deadline passes.

An idempotent producer (SPEC §10) sends each batch with its id, epoch and
sequence, the same on every retry: a batch whose answer was lost is stored
once, and answered with where it was stored when sent again. At most
``IDEMPOTENT_WINDOW`` batches are unanswered at a time, the batches the data
node remembers per producer. A batch that reaches the node ahead of an
older one (which failed, and is sent again first) is refused
OUT_OF_ORDER_SEQUENCE with a lower expected sequence and goes again after
it, so order holds with many requests in flight; so is UNKNOWN_PRODUCER
while the producer's first batches have not reached the node. Any other
OUT_OF_ORDER_SEQUENCE, UNKNOWN_PRODUCER and PRODUCER_FENCED fail the batch:
the producer has lost track of what is stored, or a newer instance of it
runs, and it never sends the records under new sequences by itself. Without
idempotence a retry can store a batch twice: delivery is at-least-once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final

import trio

from net.calls import header_as
from net.connection import Connection
from sbp import messages
from sbp.enums import ErrorCode, Opcode
from sbp.errors import (
    ProducerFencedError,
    ProtocolError,
    RangeNotFoundError,
    SBPError,
    error_for,
)
from sbp.producer_stamp import ProducerStamp

from ._base import DEADLINE_GRACE
from ._routing import ClientContext, StreamRoutes, primary_of
from .accumulator import Accumulator, PendingBatch
from .ordered import SendOrder, Turn, append_request
from .retry import is_transient, retry_delay

log = logging.getLogger(__name__)

#: answers after which the producer asks the PM to seal the range it wrote to
#: (SPEC §7): too few replicas took the batch, or the primary sealed the range
#: on a seal request whose end the PM never recorded (a seal that ran out of
#: answers). Sealing a range the PM has sealed already only returns it.
_SEAL_ON: Final = frozenset({ErrorCode.NOT_ENOUGH_REPLICAS, ErrorCode.RANGE_SEALED})
#: batches an idempotent producer has unanswered at most: what the data node
#: remembers of each producer (SPEC §10 asks it to keep at least 64)
IDEMPOTENT_WINDOW: Final = 64
#: while a quota throttles the producer (SPEC §12), an APPEND carries about
#: this long of the rate its throttles tell: what it has in flight is then a
#: second or so of its rate, and none of it waits long enough to time out
THROTTLED_REQUEST_S: Final = 0.2
#: the smallest APPEND a throttled producer makes (one batch at least)
MIN_THROTTLED_REQUEST_BYTES: Final = 16 << 10
#: a producer's first APPENDs carry at most this much, doubling with each
#: answer that asks for no wait up to ``max_request_bytes``: a quota it
#: does not know of yet sees at most one such request at once, not several
#: of the largest
INITIAL_REQUEST_BYTES: Final = 1 << 20


class Sender:
    """See the module docstring."""

    def __init__(
        self,
        stream_id: int,
        accumulator: Accumulator,
        context: ClientContext,
        routes: StreamRoutes,
        *,
        max_in_flight: int,
        max_request_bytes: int,
        request_timeout: float,
        producer: tuple[int, int] | None = None,
        new_epoch: Callable[[], Awaitable[tuple[int, int]]] | None = None,
    ) -> None:
        self.stream_id = stream_id
        #: (producer id, epoch) of an idempotent producer
        self.producer = producer
        #: a new producer id or epoch, to start the sequences again after a gap;
        #: None for a producer pinned to its epoch, which stops instead
        self._new_epoch = new_epoch
        #: how often the sequences started again under a new id or epoch
        self.sequences_restarted = 0
        #: set once a newer instance of this producer fenced this one, or a
        #: producer pinned to its epoch lost a batch: nothing more is sent
        self.fenced: BaseException | None = None
        self._batches = accumulator
        self._context = context
        self._routes = routes
        self.max_in_flight = max_in_flight
        self.max_request_bytes = max_request_bytes
        #: bytes per APPEND now: less than ``max_request_bytes`` at first
        #: and while throttled
        self.request_bytes = min(INITIAL_REQUEST_BYTES, max_request_bytes)
        self.request_timeout = request_timeout
        self._in_flight = 0
        self._failures = 0
        self._retrying = False
        #: the range to seal before the next retry (it lacked replicas)
        self._seal_wanted: int | None = None
        self._wake = trio.Event()
        self._order = SendOrder()

    def wake(self) -> None:
        """A batch is ready, or a request ended."""
        self._wake.set()

    async def run(self) -> None:
        """Send until cancelled."""
        batches = self._batches
        async with trio.open_nursery() as requests:
            while True:
                if self.producer is not None and batches.sequence_broken is not None:
                    if self._in_flight:
                        await self._sleep()
                    else:
                        await self._restart_sequences(batches.sequence_broken)
                    continue
                if not batches.ready or self._in_flight >= self.max_in_flight:
                    await self._sleep()
                    continue
                if self._retrying:
                    if self._in_flight:
                        await self._sleep()
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
                    self._on_request_failed(list(batches.ready), error)
                    continue
                window = IDEMPOTENT_WINDOW if self.producer is not None else None
                taken = batches.take(min(self.request_bytes, self.max_request_bytes), window)
                if not taken:  # the oldest unanswered batch holds the window
                    await self._sleep()
                    continue
                self._in_flight += 1
                requests.start_soon(
                    self._request, connection, rng.range_index, taken, self._order.turn()
                )

    async def _sleep(self) -> None:
        self._wake = trio.Event()
        await self._wake.wait()

    async def _request(
        self,
        connection: Connection,
        range_index: int,
        batches: list[PendingBatch],
        turn: Turn,
    ) -> None:
        retry: list[PendingBatch] = []
        error: BaseException | None = None
        try:
            header = append_request(
                [(self.stream_id, batch.size(), self._stamp(batch)) for batch in batches],
                int(self.request_timeout * 1000),
            )
            payload = b"".join(batch.data for batch in batches if batch.data is not None)
            for batch in batches:
                batch.attempts += 1
            responses = await turn.request(
                connection,
                Opcode.APPEND,
                header,
                payload,
                timeout=self.request_timeout + DEADLINE_GRACE,
            )
            results: dict[int, messages.AppendResult] = {}
            throttle_ms = 0
            for response in responses:
                answer = header_as(response, messages.AppendResponse)
                throttle_ms = max(throttle_ms, answer.throttle_time_ms)
                for item in answer.append_responses:
                    results[item.request_index] = item
            self._follow_throttle(len(payload), throttle_ms)
            for index, batch in enumerate(batches):
                result = results.get(index)
                if result is None:
                    retry.append(batch)
                    error = ProtocolError(f"no APPEND result for batch {index}")
                elif result.error_code == ErrorCode.NONE:
                    self._batches.finish(batch)
                    batch.resolve(result.base_offset)
                else:
                    item_error = error_for(result.error_code, result.error_message)
                    if result.error_code in _SEAL_ON:
                        self._seal_wanted = range_index
                    if is_transient(item_error) or self._behind_a_retry(batch, result):
                        retry.append(batch)
                        # the first is the cause: the batches behind it were
                        # refused because it was not stored
                        error = error or item_error
                    else:
                        if isinstance(item_error, ProducerFencedError):
                            self.fenced = item_error
                        self._batches.failed(batch, item_error)
            if not retry:
                self._failures = 0
        except (SBPError, OSError, trio.TooSlowError) as exc:
            if not is_transient(exc):
                for batch in batches:
                    self._batches.failed(batch, exc)
            else:
                retry, error = batches, exc
        finally:
            self._in_flight -= 1
            self.wake()
        if retry:
            assert error is not None
            self._on_request_failed(retry, error)

    def _follow_throttle(self, sent: int, throttle_ms: int) -> None:
        """Size the next APPENDs by the quota's throttle (SPEC §12): ``sent``
        bytes were answered with a wait of ``throttle_ms``, so the rate is
        at most about ``sent / throttle``; requests of ``THROTTLED_REQUEST_S``
        of it keep the bytes in flight, and so the waits, short. Unthrottled
        answers double the size back up to ``max_request_bytes``."""
        if throttle_ms > 0:
            rate = sent / (throttle_ms / 1000)
            wanted = max(rate * THROTTLED_REQUEST_S, MIN_THROTTLED_REQUEST_BYTES)
            self.request_bytes = int(min(wanted, self.max_request_bytes))
        elif self.request_bytes < self.max_request_bytes:
            self.request_bytes = min(self.request_bytes * 2, self.max_request_bytes)

    async def _restart_sequences(self, error: BaseException) -> None:
        """A batch that carried a sequence failed for good, so the stream
        expects a sequence no later batch has. Start again under a new
        producer id or epoch: batches sent before fail (they may be stored,
        and are never sent under new sequences), those never sent get new
        sequences. A producer pinned to its epoch (``resume`` semantics)
        stops instead: the rest fails, and ``send`` raises the error."""
        if self._new_epoch is None or isinstance(error, ProducerFencedError):
            self.fenced = error
            self._batches.fail_ready(error)
            self._batches.sequence_broken = None
            return
        try:
            self.producer = await self._new_epoch()
        except (SBPError, OSError, trio.TooSlowError) as failure:
            if not is_transient(failure):
                self.fenced = failure
                self._batches.fail_ready(failure)
                self._batches.sequence_broken = None
                return
            self._failures += 1
            await trio.sleep(retry_delay(self._failures))
            return
        log.info(
            "stream %d: sequences start again as producer %d epoch %d after: %s",
            self.stream_id,
            *self.producer,
            error,
        )
        self.sequences_restarted += 1
        self._batches.restart_sequences(error)

    def _stamp(self, batch: PendingBatch) -> ProducerStamp | None:
        if self.producer is None:
            return None
        producer_id, epoch = self.producer
        return ProducerStamp(producer_id, epoch, batch.base_sequence)

    def _behind_a_retry(self, batch: PendingBatch, result: messages.AppendResult) -> bool:
        """An OUT_OF_ORDER_SEQUENCE (or UNKNOWN_PRODUCER) answer to a batch
        that reached the node ahead of an older one of this producer (which
        failed, or was still on its way): the node expects a sequence below
        this batch's, and only this producer's older batches hold those. The
        batch goes again after them, with the same sequence, until its
        delivery deadline."""
        if result.error_code == ErrorCode.OUT_OF_ORDER_SEQUENCE:
            return 0 <= result.next_sequence < batch.base_sequence
        if result.error_code == ErrorCode.UNKNOWN_PRODUCER:
            # no state for this producer there: none of its older batches had
            # reached the node when this one did; once they have, this one
            # is stored (if the state is gone for good, it fails at its
            # deadline and the sequences start again)
            return batch.base_sequence > 0
        return False

    def _on_request_failed(self, batches: list[PendingBatch], error: BaseException) -> None:
        """Queue ``batches`` again (in order), or fail those past their deadline."""
        now = trio.current_time()
        for batch in batches:
            if batch in self._batches.ready:
                continue
            if now >= batch.deadline:
                self._batches.failed(batch, error)
            else:
                self._batches.requeue(batch)
        # Batches still waiting are judged by the same deadline rule.
        self._batches.expire_ready(now, error)
        self._retrying = True
        self.wake()

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
        try:
            await self._routes.refresh()
        except (SBPError, OSError, trio.TooSlowError) as error:
            if not is_transient(error):
                self._batches.fail_ready(error)
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
