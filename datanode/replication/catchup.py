"""Catch-up (SPEC §7): a replica of a sealed range that holds less than the
range's end copies the rest from a replica that holds it.

This happens after a failover (a follower was behind when the PM sealed the
range), after a restart, and when the PM places a new replica of a sealed
range on this node to repair a lost one. Whenever a stream's ranges change
here (``DataNode.ranges_changed``) and at start-up, its sealed ranges are
looked at: each one short of its end is copied with FETCH from the other
replicas in turn, primary first, from where this node's records stop, and
stored through the storage writer (``StorageEngine.catch_up``). A replica that
cannot serve it is skipped; when none can, the range is tried again later.
Until a range is whole it counts as missing a replica
(``range_missing_replica_cnt``) and this node serves only what it holds.

The same pass takes in what the node lacks of the stream's idempotent
producers (SPEC §10). FETCH carries no producer fields, so a range copied
here leaves this node's producer table not whole from where the copy
began; once the range is whole here, the node asks the range's other
replicas for the state as of its end (PRODUCER_STATE) and merges the
first answer, so that it can give that state to the range after even when
the replicas it copied from are gone. A replica of the open range whose
table is not whole as of the range's start (it did not hold the range
before, or that take-in failed) asks a replica of the range that ends
there in the same way. Until then its primary refuses idempotent appends
(RANGE_NOT_FOUND, retriable). When every replica of that range answers
that its own state is not whole there, or none can be reached in
``PRODUCER_STATE_ATTEMPTS`` passes, it goes on with what it has, and says
so in its log.
"""

from __future__ import annotations

import logging
from typing import Final

import trio

from client.compacted_tail import compacted_end
from client.datanode_client import DataNodeClient
from client.retry import retry_delay
from net.pool import ConnectionPool
from net.ratelog import RateLimitedLog
from sbp import messages
from sbp.batches import batch_spans, validate_batch
from sbp.enums import ErrorCode
from sbp.errors import ProtocolError, SBPError, error_for
from storage.model import RangeInfo, ReplicaBatch, hosts

from ..convert import snapshots_to_table
from ..items import wait_future
from ..replica_state import ReplicaState, ReplicaStates
from ..waiters import StreamWaiters

logger = logging.getLogger(__name__)
_no_source = RateLimitedLog(logger, interval=30.0)

#: bytes asked of a peer per FETCH, and so stored per write: appends to
#: this node wait behind one such write at most
COPY_BYTES: Final = 1 << 20
#: how long one FETCH of a peer may take
COPY_TIMEOUT_S: Final = 30.0
#: the longest wait before a range no peer could serve is tried again
RETRY_MAX_S: Final = 10.0
#: passes at taking in a stream's producer state before going on without it
PRODUCER_STATE_ATTEMPTS: Final = 5


class CatchUp:
    """Copies what this node lacks of its sealed ranges; see the module docstring."""

    def __init__(
        self, replicas: ReplicaStates, waiters: StreamWaiters, pool: ConnectionPool
    ) -> None:
        self._replicas = replicas
        self._engine = replicas.engine
        self._waiters = waiters
        self._pool = pool
        self._pending: set[int] = set()
        self._wake = trio.Event()
        #: ranges known to be short here, by (stream_id, range_index)
        self.missing: set[tuple[int, int]] = set()
        #: streams whose producer state is still to be taken in: passes so far
        self._producer_passes: dict[int, int] = {}

    def stream_changed(self, stream_id: int) -> None:
        """The stream's ranges changed: check them soon."""
        self._pending.add(stream_id)
        self._wake.set()

    async def run(self) -> None:
        for stream_id in self._engine.stream_ids():
            self._pending.add(stream_id)
        failures = 0
        while True:
            if not self._pending:
                self._wake = trio.Event()
                if self.missing or self._producer_passes:
                    with trio.move_on_after(retry_delay(failures, cap=RETRY_MAX_S)):
                        await self._wake.wait()
                    self._pending.update(stream_id for stream_id, _ in self.missing)
                    self._pending.update(self._producer_passes)
                else:
                    await self._wake.wait()
                continue
            stream_id = self._pending.pop()
            try:
                whole = await self._catch_up_stream(stream_id)
            except Exception:  # never take the node down; tried again later
                logger.exception("catch-up of stream %d failed", stream_id)
                whole = False
            failures = 0 if whole else failures + 1

    async def _catch_up_stream(self, stream_id: int) -> bool:
        """Copy what the stream's sealed ranges lack here; True when none lacks anything."""
        whole = True
        for info in self._short_ranges(stream_id):
            key = (stream_id, info.range_index)
            self.missing.add(key)
            if await self._copy_range(info):
                self.missing.discard(key)
                await self._take_in_producers_at_end(info)
            else:
                whole = False
        if not await self._take_in_producers(stream_id):
            whole = False
        return whole

    async def _take_in_producers_at_end(self, info: RangeInfo) -> None:
        """A sealed range was just copied here without its producers'
        fields: take in the producer state as of its end from a replica
        that has it, so that this node can give it to the range after (if
        none can, this node's state stays not whole there)."""
        try:
            if self._engine.producers_whole_at(info.stream_id, info.end_offset):
                return
        except ProtocolError:  # forgotten meanwhile
            return
        await self._ask_producer_state(info.stream_id, info.end_offset, info)

    async def _take_in_producers(self, stream_id: int) -> bool:
        """Take in the producer state as of the open range's start, if this
        node's is not whole there; False when it is to be tried again."""
        engine = self._engine
        info = engine.open_range(stream_id)
        if engine.producers_ready(stream_id) or info is None:
            self._producer_passes.pop(stream_id, None)
            return True
        as_of = info.start_offset
        try:
            before: RangeInfo | None = engine.describe_range(stream_id, info.range_index - 1)
        except ProtocolError:  # the first range, or forgotten meanwhile
            before = None
        if before is not None and before.end_offset != as_of:
            before = None
        taken, not_whole = await self._ask_producer_state(stream_id, as_of, before)
        if taken:
            self._producer_passes.pop(stream_id, None)
            return True
        peers = 0 if before is None else len(self._peers(before))
        passes = self._producer_passes.get(stream_id, 0) + 1
        self._producer_passes[stream_id] = passes
        # every replica answered that it cannot tell: asking again does not help
        if peers and not_whole < peers and passes < PRODUCER_STATE_ATTEMPTS:
            return False
        logger.warning(
            "stream %d: no replica of the range before %d could give its producer state; "
            "going on without it (a producer that resumes there may be answered "
            "UNKNOWN_PRODUCER)",
            stream_id,
            as_of,
        )
        await wait_future(engine.take_in_producers(stream_id, as_of, None))
        self._producer_passes.pop(stream_id, None)
        return True

    async def _ask_producer_state(
        self, stream_id: int, as_of: int, holder: RangeInfo | None
    ) -> tuple[bool, int]:
        """Ask the other replicas of ``holder`` (the range that ends at
        ``as_of``), primary first, for the producer state as of ``as_of``
        and take in the first answer: whether one was taken in, and how
        many replicas answered that their own state is not whole there."""
        not_whole = 0
        for address in [] if holder is None else self._peers(holder):
            peer = DataNodeClient(address, pool=self._pool, timeout=COPY_TIMEOUT_S)
            try:
                snapshots = await peer.producer_state(stream_id, as_of)
            except (SBPError, OSError, ValueError, trio.TooSlowError) as error:
                if isinstance(error, ProtocolError) and error.code == ErrorCode.RANGE_NOT_FOUND:
                    not_whole += 1
                _no_source.warning(
                    f"producers {stream_id} from {address}",
                    "producer state of stream %d as of %d from %s: %s",
                    stream_id,
                    as_of,
                    address,
                    error or type(error).__name__,
                )
                continue
            await wait_future(
                self._engine.take_in_producers(stream_id, as_of, snapshots_to_table(snapshots))
            )
            logger.info(
                "stream %d: producer state of %d producers as of %d taken in from %s",
                stream_id,
                len(snapshots),
                as_of,
                address,
            )
            return True, not_whole
        return False, not_whole

    def _peers(self, info: RangeInfo) -> list[str]:
        """The addresses of the range's other replicas, primary first."""
        return [
            r.address
            for r in sorted(info.replicas, key=lambda r: not r.is_primary)
            if r.node_id != self._replicas.node_id
        ]

    def _short_ranges(self, stream_id: int) -> list[RangeInfo]:
        engine = self._engine
        if engine.first_offset(stream_id) is None:
            for key in [k for k in self.missing if k[0] == stream_id]:
                self.missing.discard(key)
            return []
        short = []
        try:
            hosted = engine.list_ranges(stream_id)
        except ProtocolError:  # forgotten meanwhile (the writer publishes on its own thread)
            hosted = []
        for info in hosted:
            if info.is_open or not hosts(info, self._replicas.node_id):
                continue
            if self._replicas.state_of(info) is ReplicaState.SHORT:
                short.append(info)
            else:
                self.missing.discard((stream_id, info.range_index))
        return short

    async def _copy_range(self, info: RangeInfo) -> bool:
        for address in self._peers(info):
            try:
                if await self._copy_from(address, info):
                    return True
            except (SBPError, OSError, ValueError, trio.TooSlowError) as error:
                # ValueError: a peer address that cannot be used (as the PM sent it)
                _no_source.warning(
                    f"copy {info.stream_id}/{info.range_index} from {address}",
                    "catch-up of stream %d range %d from %s: %s",
                    info.stream_id,
                    info.range_index,
                    address,
                    error or type(error).__name__,
                )
        return False

    async def _copy_from(self, address: str, info: RangeInfo) -> bool:
        """Copy from one peer until the range is whole here (True) or the
        peer has no more of it (False)."""
        engine = self._engine
        peer = DataNodeClient(address, pool=self._pool, timeout=COPY_TIMEOUT_S)
        first = engine.first_offset(info.stream_id) or 0
        held = engine.held_end(info.stream_id, max(info.start_offset, first), info.end_offset)
        while held < info.end_offset:
            want = messages.FetchInfo(
                stream_id=info.stream_id, fetch_offset=held, batch_max_bytes=COPY_BYTES
            )
            data = b""
            async with peer.fetch([want]) as results:
                async for fetched in results:
                    code = fetched.result.error_code
                    if code != ErrorCode.NONE:
                        raise error_for(code, fetched.result.error_message)
                    data = bytes(fetched.data)
            items = _items(info, data)
            if not data:
                # nothing there: compaction emptied the rest of the range
                # (SPEC §13), or the peer lacks it too
                end = await compacted_end(peer, info.stream_id, info.range_index, held)
                if end is None:
                    return False
                where = (info.stream_id, info.range_index)
                now = await wait_future(engine.catch_up([], end, where))
            elif not items:
                return False
            else:
                now = await wait_future(engine.catch_up(items))
            if now <= held:
                return False
            held = now
        logger.info(
            "stream %d range %d caught up to its end %d from %s",
            info.stream_id,
            info.range_index,
            info.end_offset,
            address,
        )
        self._waiters.notify(info.stream_id)
        return True


def _items(info: RangeInfo, data: bytes) -> list[ReplicaBatch]:
    """The batches of a FETCH answer, checked, as fill items of ``info``."""
    items = []
    for start, end in batch_spans(data):
        view = memoryview(data)[start:end]
        header = validate_batch(view)  # InvalidRecordBatchError: this peer is skipped
        if header.base_offset >= info.end_offset:
            break
        items.append(
            ReplicaBatch(
                info.stream_id,
                info.range_index,
                info.epoch,
                header.base_offset,
                view,
                header.span,
            )
        )
    return items
