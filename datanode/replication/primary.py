"""The primary's side of replication (SPEC §7).

For each open range this node leads that has followers, a ``RangePipeline``
sends every follower the range's batches with REPLICATE, in offset order:

- what it sends it reads back from its own storage, from the follower's next
  offset up to its own durable next offset, so a resend after a gap, a
  reconnect or a restart of either side is the same code as the first send;
- except for the newest batches: the storage writer hands them over
  (``applied``) as soon as their group is written, before its commit syncs,
  and they go to the followers from memory while this node's fsync runs, so
  the primary's and the followers' syncs overlap. A follower may thus hold
  batches this node has not made durable; the commit offset never passes
  this node's durable next offset, and a range whose commit failed (or led
  here before a restart) is fenced until the PM seals it, so an offset
  handed out once is never handed to another batch;
- up to ``WINDOW`` frames are in flight per follower, each up to
  ``FRAME_BYTES`` of batches, and they leave in the order they were made;
- a follower's answer carries its durable next offset: the match offset.
  ``OUT_OF_ORDER`` rewinds the sender to it (older frames' answers are then
  ignored: a generation number tells them apart);
- the commit offset is the ``ack_nums``-th highest of the primary's durable
  next offset and the followers' match offsets (``sbp.replication``). When it
  moves, the APPEND items below it are answered, FETCHes wake, and followers
  with nothing left to send get the new commit offset alone.

An APPEND item of a replicated range waits (``wait_commit``) until the
commit offset passes its batch. When its request's deadline comes first, or
the range is sealed under it, it is answered ``NOT_ENOUGH_REPLICAS``: the
writer seals and goes on in the next range.

A follower that cannot be reached is retried with backoff, for as long as
the range is open and led here.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import trio

from client.ordered import SendOrder, Turn, replicate_request
from client.retry import retry_delay
from net.calls import header_as
from net.connection import Connection
from net.pool import ConnectionPool
from net.ratelog import RateLimitedLog
from sbp import messages
from sbp.batches import Buffer, batch_spans, peek_header, stamp_base_offset
from sbp.enums import ErrorCode, Opcode
from sbp.errors import ConnectionClosed, ProtocolError, SBPError, error_for
from sbp.producer_stamp import ProducerStamp
from sbp.replication import commit_offset, effective_acks
from sbp.stats import Buckets
from storage.model import RangeInfo

from ..pm_link import PMLink
from ..replica_state import SETTLE_AFTER_S, ReplicaStates

logger = logging.getLogger(__name__)
_unreachable = RateLimitedLog(logger, interval=30.0)

#: REPLICATE frames in flight per follower, and the batch bytes of one
WINDOW: Final = 8
#: the producer fields of a batch no idempotent producer sent
NO_PRODUCER: Final = ProducerStamp(0, 0, 0)
FRAME_BYTES: Final = 1 << 20
#: how long a moved commit offset waits for a frame of batches to carry it
#: before it is sent alone: followers serve FETCH up to it, so this is how
#: much later an idle follower's readers may see the last records
COMMIT_LINGER_S: Final = 0.002
#: how long a follower has to answer one REPLICATE
REPLICATE_TIMEOUT_S: Final = 10.0
#: the longest wait between tries to have the PM seal a range sealed here
#: (``Replicator._seal_unsettled``)
SETTLE_MAX_S: Final = 30.0
#: how long to wait for the PM before trying again to learn ack_nums
ACKS_RETRY_S: Final = 1.0

#: upper bounds of the REPLICATE round-trip buckets, seconds
REPLICATE_SECONDS_BOUNDS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip

#: called with True once the commit offset passes the item, False when it never will
CommitCallback = Callable[[bool], None]
#: one REPLICATE's items, its payload, and the offset after its batches
ReplicateFrame = tuple[list[messages.ReplicateInfo], memoryview, int]


@dataclass(eq=False)
class Follower:
    """What the primary knows of one follower of the range."""

    node_id: int
    address: str
    #: the follower's durable next offset of the range, from its answers
    match: int
    #: where the next frame starts; None until the follower said where it is
    send_offset: int | None = None
    #: the commit offset last sent to it
    sent_commit: int = -1
    in_flight: int = 0
    #: batch bytes sent and not yet answered
    in_flight_bytes: int = 0
    #: bumped by a rewind: answers to frames of older generations are stale
    generation: int = 0
    #: failed connections or frames in a row (the backoff before the next)
    failures: int = 0
    #: whether ``match`` is the follower's own answer (not the start offset
    #: assumed before it said): only answers count toward the commit offset
    heard: bool = False
    wake: trio.Event = field(default_factory=trio.Event)
    #: set when the PM tells another address: a backoff ends at once
    moved: trio.Event = field(default_factory=trio.Event)

    def move_to(self, address: str) -> None:
        if address != self.address:
            self.address = address
            self.moved.set()


async def _wake_when_closed(
    follower: Follower, connection: Connection, scope: trio.CancelScope
) -> None:
    """Wake the follower's sender when its connection closes, so an idle
    follower that went away is reconnected at once."""
    with scope:
        await connection.wait_closed()
        follower.wake.set()


class RangePipeline:
    """Replication of one open range led here; see the module docstring."""

    def __init__(
        self,
        replicas: ReplicaStates,
        pm: PMLink | None,
        pool: ConnectionPool,
        info: RangeInfo,
        latency: Buckets,
    ) -> None:
        self.replicas = replicas
        self.engine = replicas.engine
        self.pm = pm
        self.pool = pool
        self.latency = latency
        self.stream_id = info.stream_id
        self.range_index = info.range_index
        self.epoch = info.epoch
        self.start_offset = info.start_offset
        self.followers = [
            Follower(r.node_id, r.address, info.start_offset)
            for r in info.replicas
            if not r.is_primary
        ]
        self.replica_nums = len(info.replicas)
        #: None until the PM said; nothing is committed before
        self.ack_nums: int | None = None
        #: (end offset, callback) of the items waiting, in offset order
        self._waiting: collections.deque[tuple[int, CommitCallback]] = collections.deque()
        #: batches written here whose commit is still syncing, in offset
        #: order: (base offset, end offset, the batch with its offset
        #: stamped, its producer's fields)
        self._ahead: collections.deque[tuple[int, int, bytearray, ProducerStamp | None]] = (
            collections.deque()
        )
        self._stopped = trio.Event()

    @property
    def commit(self) -> int:
        """The range's commit offset (kept in ``ReplicaStates.commits``); -1
        until enough replicas have said what they hold."""
        return self.replicas.commits.get(self.stream_id, self.range_index, -1)

    # -- what the APPEND path uses ---------------------------------------------

    def wait_commit(self, end_offset: int, callback: CommitCallback) -> None:
        """Call ``callback(True)`` once the commit offset reaches ``end_offset``."""
        if self._stopped.is_set():
            callback(False)
        elif end_offset <= self.commit and self.ack_nums is not None:
            callback(True)
        else:
            self._waiting.append((end_offset, callback))
            self.new_data()

    def new_data(self) -> None:
        """Batches were made durable here: the followers have more to take,
        and the commit offset may move (followers that took them from memory
        may have answered already)."""
        self._drop_durable()
        for follower in self.followers:
            follower.wake.set()
        self._recompute()

    def applied(
        self,
        base_offset: int,
        record_count: int,
        batch: Buffer,
        producer: ProducerStamp | None = None,
    ) -> None:
        """A batch is written here and its commit is syncing: the followers
        may take it now, from memory. Only a batch that continues what is
        durable or already held here is kept (one that comes after its own
        commit is read from storage, as any durable batch)."""
        durable = self._drop_durable()
        ahead = self._ahead
        if base_offset != (ahead[-1][1] if ahead else durable):
            return
        stamped = bytearray(batch)
        stamp_base_offset(stamped, base_offset)
        ahead.append((base_offset, base_offset + record_count, stamped, producer))
        self.new_data()

    def _durable(self) -> int:
        return self.engine.next_offset(self.stream_id) or self.start_offset

    def _drop_durable(self) -> int:
        """Forget the batches in memory that are durable now (read from
        storage from now on); the durable next offset."""
        durable = self._durable()
        ahead = self._ahead
        while ahead and ahead[0][1] <= durable:
            ahead.popleft()
        return durable

    def stop(self) -> None:
        """The range is sealed or no longer led here: nothing more commits."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._ahead.clear()
            waiting, self._waiting = self._waiting, collections.deque()
            for _end, callback in waiting:
                callback(False)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    # -- the pipeline ----------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._learn_acks)
                for follower in self.followers:
                    nursery.start_soon(self._follow, follower)
                await self._stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            self.stop()

    async def _learn_acks(self) -> None:
        while self.ack_nums is None:
            wanted = 0 if self.pm is None else await self.pm.ack_nums(self.stream_id)
            if wanted is None:
                await trio.sleep(ACKS_RETRY_S)
                continue
            self.ack_nums = effective_acks(self.replica_nums, wanted)
        self._recompute()

    async def _follow(self, follower: Follower) -> None:
        while True:
            error: BaseException | None = None
            try:
                connection = await self.pool.get(follower.address)
                await self._stream_to(follower, connection)
            # ValueError: an address the PM gave that cannot be used (retried:
            # the node may be moved to a usable one)
            except* (SBPError, OSError, ValueError, trio.TooSlowError) as group:
                error = group.exceptions[0]
            if error is None:
                return  # nothing left to replicate: the range stopped
            follower.failures += 1
            _unreachable.warning(
                f"follower {follower.node_id}",
                "REPLICATE of stream %d range %d to node %d at %s: %s",
                self.stream_id,
                self.range_index,
                follower.node_id,
                follower.address,
                error or type(error).__name__,
            )
            follower.send_offset = None
            follower.in_flight = 0
            # A follower reached again may have restarted and forgotten the
            # commit offset: it is sent again even when nothing new is written.
            follower.sent_commit = -1
            with trio.move_on_after(retry_delay(follower.failures)):
                await follower.moved.wait()
            follower.moved = trio.Event()

    async def _stream_to(self, follower: Follower, connection: Connection) -> None:
        """Send the follower what it lacks, for as long as the connection lasts."""
        watch = trio.CancelScope()
        async with trio.open_nursery() as frames:
            frames.start_soon(_wake_when_closed, follower, connection, watch)
            try:
                await self._send_loop(follower, connection, frames)
            finally:
                watch.cancel()

    async def _send_loop(
        self, follower: Follower, connection: Connection, frames: trio.Nursery
    ) -> None:
        """Frames of batches (and the commit offset alone when nothing new
        is written) until the range stops or the connection closes."""
        order = SendOrder()
        #: when the commit offset goes alone if no batch carries it first
        commit_due = math.inf
        while True:
            if connection.closed:
                # an idle follower that went away (a restart) is
                # reconnected now, not at the next append
                raise ConnectionClosed(f"connection to follower {follower.node_id} closed")
            follower.wake = trio.Event()
            if follower.send_offset is None:
                # Ask where it is: an item without a batch, answered with
                # its next offset.
                await self._frame(follower, connection, [], b"", order.turn())
                continue
            frame = None
            if follower.in_flight < WINDOW:
                frame = self._next_frame(follower.send_offset)
                if self.stopped:
                    return
            if frame:
                commit_due = math.inf
                items, payload, follower.send_offset = frame
                follower.in_flight += 1
                frames.start_soon(self._frame, follower, connection, items, payload, order.turn())
                continue
            if self.commit > follower.sent_commit and follower.in_flight == 0:
                # The next frame of batches carries the commit offset: one
                # alone goes only once none came for COMMIT_LINGER_S (a
                # frame more per append for each follower otherwise).
                commit_due = min(commit_due, trio.current_time() + COMMIT_LINGER_S)
                if trio.current_time() < commit_due:
                    with trio.move_on_at(commit_due):
                        await follower.wake.wait()
                    continue
                commit_due = math.inf
                follower.in_flight += 1
                frames.start_soon(self._frame, follower, connection, [], b"", order.turn())
                continue
            await follower.wake.wait()

    def _next_frame(self, offset: int) -> ReplicateFrame | None:
        """The next frame from ``offset``: durable batches from storage, the
        newer ones from memory; None when there is nothing to send yet."""
        if offset < self._durable():
            return self._read_frame(offset)
        items: list[messages.ReplicateInfo] = []
        pieces: list[bytearray] = []
        size = 0
        for base_offset, end_offset, batch, producer in self._ahead:
            if end_offset <= offset:
                continue
            if base_offset != offset or (items and size + len(batch) > FRAME_BYTES):
                break
            items.append(self._item(base_offset, len(batch), producer))
            pieces.append(batch)
            size += len(batch)
            offset = end_offset
        if not items:
            return None
        return items, memoryview(pieces[0] if len(pieces) == 1 else b"".join(pieces)), offset

    def _read_frame(self, offset: int) -> ReplicateFrame:
        """The batches from ``offset`` on, up to one frame's worth: as items,
        the payload (the read's own buffer, not copied again), and the
        offset after them."""
        try:
            data = self.engine.read(self.stream_id, offset, FRAME_BYTES)
        except ProtocolError as error:
            logger.info(
                "stream %d range %d: nothing to replicate from %d: %s",
                self.stream_id,
                self.range_index,
                offset,
                error,
            )
            self.stop()
            return [], memoryview(b""), offset
        headers = [(peek_header(data, start), end - start) for start, end in batch_spans(data)]
        if not headers:
            return [], memoryview(data), offset
        last = headers[-1][0]
        stamps = self.engine.producer_stamps(self.stream_id, offset, last.next_offset)
        items = [
            self._item(header.base_offset, length, stamps.get(header.base_offset))
            for header, length in headers
        ]
        return items, memoryview(data), last.next_offset

    def _item(
        self, base_offset: int, batch_length: int = 0, producer: ProducerStamp | None = None
    ) -> messages.ReplicateInfo:
        """One REPLICATE item of this range, with the producer fields its
        APPEND had; without a batch it carries only the commit offset."""
        if producer is None:
            producer = NO_PRODUCER
        return messages.ReplicateInfo(
            stream_id=self.stream_id,
            range_index=self.range_index,
            epoch=self.epoch,
            base_offset=base_offset,
            batch_length=batch_length,
            # -1 until known here: a follower never learns a commit offset
            # the primary only assumed
            commit_offset=self.commit,
            producer_id=producer.producer_id,
            producer_epoch=producer.epoch,
            base_sequence=producer.base_sequence,
        )

    async def _frame(
        self,
        follower: Follower,
        connection: Connection,
        items: list[messages.ReplicateInfo],
        payload: bytes | memoryview,
        turn: Turn,
    ) -> None:
        """One REPLICATE: sent after the frame before it, answered on its own."""
        generation = follower.generation
        if not items:  # the commit offset alone (or a question where it is)
            items = [self._item(follower.send_offset or self.start_offset)]
        # What the follower is told is what its items carry: the commit offset
        # when the frame was read, which may be older than the pipeline's by
        # the time the frame leaves. Counting the newer one as sent would leave
        # an idle follower serving one commit short until the next append.
        commit = items[0].commit_offset
        header = replicate_request(items, int(REPLICATE_TIMEOUT_S * 1000))
        results: list[messages.ReplicateResult] = []
        follower.in_flight_bytes += len(payload)
        try:
            started = trio.current_time()
            responses = await turn.request(
                connection, Opcode.REPLICATE, header, payload, timeout=REPLICATE_TIMEOUT_S
            )
            for response in responses:
                results.extend(header_as(response, messages.ReplicateResponse).replicate_responses)
            self.latency.observe(trio.current_time() - started)
        finally:
            follower.in_flight = max(0, follower.in_flight - 1)
            follower.in_flight_bytes -= len(payload)
            follower.wake.set()
        follower.sent_commit = max(follower.sent_commit, commit)
        self._take_answers(follower, generation, results)

    def _take_answers(
        self, follower: Follower, generation: int, results: list[messages.ReplicateResult]
    ) -> None:
        for result in results:
            code = result.error_code
            if code == ErrorCode.NONE:
                follower.failures = 0
                follower.heard = True
                follower.match = max(follower.match, result.next_offset)
                if follower.send_offset is None:
                    follower.send_offset = result.next_offset
            elif code == ErrorCode.OUT_OF_ORDER:
                follower.heard = True
                follower.match = max(follower.match, result.next_offset)
                if generation == follower.generation:
                    follower.generation += 1
                    follower.send_offset = result.next_offset
            elif code in (ErrorCode.RANGE_SEALED, ErrorCode.EPOCH_FENCED):
                # Sealed by the PM (a failover): nothing more can commit here.
                logger.info(
                    "stream %d range %d: follower %d refuses REPLICATE: %s",
                    self.stream_id,
                    self.range_index,
                    follower.node_id,
                    error_for(code, result.error_message),
                )
                self.stop()
                return
            else:
                raise error_for(code, result.error_message)
        self._recompute()

    def _recompute(self) -> None:
        if self.ack_nums is None or self.stopped:
            return
        durable = self._durable()
        # Followers not heard from since this pipeline started (this node
        # restarted, say) may hold more than the start offset: until enough
        # have answered, the commit offset is not known, not the start.
        offsets = [durable, *(f.match for f in self.followers if f.heard)]
        if len(offsets) < self.ack_nums:
            return
        # Never past what this primary holds durably: a follower ahead of it
        # (batches sent while this node's commit synced, or a node run with
        # --sync never that lost its tail) holds nothing it acknowledged.
        committed = min(commit_offset(offsets, self.ack_nums), durable)
        if committed < self.commit:
            return
        self.replicas.commits.advance(self.stream_id, self.range_index, committed)
        waiting = self._waiting
        while waiting and waiting[0][0] <= committed:
            waiting.popleft()[1](True)
        for follower in self.followers:
            if follower.sent_commit < committed:
                follower.wake.set()


class Replicator:
    """The node's range pipelines, one per open replicated range led here."""

    def __init__(self, replicas: ReplicaStates, pm: PMLink | None, pool: ConnectionPool) -> None:
        self._replicas = replicas
        self._engine = replicas.engine
        self._pm = pm
        self._pool = pool
        #: by stream, then range index: a stream is here only while one of its ranges replicates
        self._pipelines: dict[int, dict[int, RangePipeline]] = {}
        self._nursery: trio.Nursery | None = None
        #: streams that may have ranges sealed here whose end the PM has not fixed
        self._unsettled: dict[int, float] = {}
        #: REPLICATE round trips of every pipeline
        self.latency = Buckets(REPLICATE_SECONDS_BOUNDS)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # Ranges led here since before a restart: their followers may lack
            # batches, and their commit offset must be learned again before
            # FETCH serves them; they are fenced (``ReplicaStates``).
            for stream_id in self._replicas.fence_after_restart():
                self.lead(stream_id)
            task_status.started()
            await self._seal_unsettled()

    async def _seal_unsettled(self) -> None:
        """Ranges sealed here by a SEAL_RANGES whose end this node was never
        told (the PM's seal ran out of answers, the PM went away mid-seal, or
        its SYNC_RANGES did not reach this node) take no appends and serve
        only what is committed: once one has waited ``SETTLE_AFTER_S``, this
        node asks the PM to seal it itself, then asks it for the stream's
        ranges, again with backoff, until their end is known here."""
        failures = 0
        while True:
            await trio.sleep(
                SETTLE_AFTER_S if not failures else retry_delay(failures, cap=SETTLE_MAX_S)
            )
            due, settled = self._replicas.due_to_settle(dict(self._unsettled), trio.current_time())
            for stream_id in settled:
                del self._unsettled[stream_id]
            pm = self._pm
            if not due or pm is None:
                failures = 0
                continue
            settled = []
            for info in due:
                sealed = await pm.seal_range(info)
                if sealed:
                    # A range the PM had sealed already is answered with its
                    # state and no SYNC_RANGES: a replica that missed the
                    # first one (cut off from the PM then) learns the end here.
                    await pm.refresh_stream(info.stream_id)
                settled.append(sealed)
            failures = 0 if all(settled) else failures + 1

    def lead(self, stream_id: int) -> None:
        """Start the pipeline of the stream's open range if it is led here
        and has followers."""
        info = self._engine.open_range(stream_id)
        if info is not None and self._replicas.leads_replicated(info):
            self.pipeline_for(stream_id, info.start_offset)

    def pipeline_for(self, stream_id: int, offset: int) -> RangePipeline | None:
        """The pipeline of the replicated open range led here that holds
        ``offset``, started if need be; None when that range has no followers
        (it answers as an unreplicated range does)."""
        info = self._engine.range_at(stream_id, offset)
        if info is None or len(info.replicas) <= 1:
            return None
        pipeline = self._pipelines.get(stream_id, {}).get(info.range_index)
        if pipeline is None or pipeline.stopped:
            pipeline = RangePipeline(self._replicas, self._pm, self._pool, info, self.latency)
            if not info.is_open or info.primary_node_id != self._replicas.node_id:
                pipeline.stop()  # sealed under the append: it cannot commit here
                return pipeline
            self._pipelines.setdefault(stream_id, {})[info.range_index] = pipeline
            assert self._nursery is not None, "the replicator is not running"
            self._nursery.start_soon(self._run_pipeline, pipeline)
        return pipeline

    async def _run_pipeline(self, pipeline: RangePipeline) -> None:
        try:
            await pipeline.run()
        except Exception:
            # One range's replication must never take the node down (a range
            # told with a follower address that cannot be used, say): it
            # stops, and its appends are answered NOT_ENOUGH_REPLICAS.
            logger.exception(
                "replication of stream %d range %d stopped",
                pipeline.stream_id,
                pipeline.range_index,
            )
        finally:
            ranges = self._pipelines.get(pipeline.stream_id, {})
            if ranges.get(pipeline.range_index) is pipeline:
                del ranges[pipeline.range_index]
                if not ranges:
                    del self._pipelines[pipeline.stream_id]

    def replicates(self, stream_id: int) -> bool:
        """Whether a range of the stream led here is being replicated."""
        return stream_id in self._pipelines

    def ranges_changed(self, stream_id: int) -> None:
        """A seal or SYNC_RANGES touched the stream: pipelines of ranges no
        longer open and led here stop (their waiting items fail), and
        followers' addresses are brought up to date."""
        engine = self._engine
        self.lead(stream_id)
        self._unsettled.setdefault(stream_id, trio.current_time())
        for index, pipeline in list(self._pipelines.get(stream_id, {}).items()):
            info = engine.open_range(stream_id)
            if (
                info is None
                or info.range_index != index
                or info.primary_node_id != self._replicas.node_id
            ):
                pipeline.stop()
                continue
            # a follower that moved is reached at its new address from the next connection on
            addresses = {r.node_id: r.address for r in info.replicas}
            for follower in pipeline.followers:
                follower.move_to(addresses.get(follower.node_id, follower.address))

    @property
    def pipelines(self) -> list[RangePipeline]:
        return [p for ranges in self._pipelines.values() for p in ranges.values()]

    def follower_lag(self) -> dict[int, tuple[int, int]]:
        """Per follower node: records durable here it does not hold yet, and
        batch bytes sent to it and not yet answered, over every range."""
        engine = self._engine
        lag: dict[int, tuple[int, int]] = {}
        for pipeline in self.pipelines:
            durable = engine.next_offset(pipeline.stream_id) or pipeline.start_offset
            for f in pipeline.followers:
                records, sent = lag.get(f.node_id, (0, 0))
                lag[f.node_id] = (records + max(0, durable - f.match), sent + f.in_flight_bytes)
        return lag

    def lagging_ranges(self) -> int:
        """Open ranges led here with a follower that does not hold all that
        is durable here (unreachable, or behind)."""
        engine = self._engine
        count = 0
        for pipeline in self.pipelines:
            durable = engine.next_offset(pipeline.stream_id) or pipeline.start_offset
            if any(f.match < durable for f in pipeline.followers):
                count += 1
        return count
