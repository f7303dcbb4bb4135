"""What every request handler of the data node shares."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import trio

from net.authz import AccessControl
from sbp import messages
from sbp.errors import EpochFencedError, InvalidRequestError, NotPrimaryError
from storage import writes
from storage.engine import StorageEngine
from storage.layout import MAX_STREAM_ID, IndexEntry
from storage.model import RangeInfo
from storage.writes import WriteContext

from .convert import info_to_range, range_to_info
from .metrics import DataNodeMetrics
from .pm_link import PMLink
from .replication.commits import CommitOffsets
from .timeouts import TimeoutQueue
from .waiters import StreamWaiters

if TYPE_CHECKING:
    from .replication.primary import Replicator

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass
class NodeContext:
    """The node's identity, storage and shared machinery."""

    node_id: int
    engine: StorageEngine
    metrics: DataNodeMetrics
    waiters: StreamWaiters = field(default_factory=StreamWaiters)
    #: answers the APPENDs of the immediate path whose timeout_ms passes
    #: before they are durable (``run`` it for that)
    append_timeouts: TimeoutQueue = field(default_factory=TimeoutQueue)
    #: "host:port" given to the PM and clients; set once the listener is bound
    advertise_addr: str = ""
    pm: PMLink | None = None
    #: set on shutdown: long polls answer what they have instead of waiting
    draining: bool = False
    #: called with the streams a SYNC_RANGES touched (their settings may have
    #: changed on the PM: the retention keeper looks again)
    on_streams_synced: Callable[[Iterable[int]], None] = lambda _ids: None
    #: the commit offsets of the replicated ranges this node holds (SPEC §7)
    commits: CommitOffsets = field(init=False)
    #: the primary's replication to followers; set by the server
    replicator: Replicator | None = None
    #: called with a stream whose ranges changed (the catch-up looks at it)
    on_ranges_changed: Callable[[int], None] = lambda _id: None
    #: who may do what (SPEC §9); allows everything without an ACL file
    access: AccessControl = field(default_factory=AccessControl)
    #: the highest PM term seen in a SYNC_RANGES or SEAL_RANGES (SPEC §8):
    #: one from an older term comes from a deposed PM and is refused
    pm_term: int = 0
    #: whether the log has said why an older term's PM is refused
    _fenced_pm_explained: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.commits = CommitOffsets(self.waiters)

    async def admit_pm_term(self, term: int) -> EpochFencedError | None:
        """None unless ``term`` is older than one seen here; a newer one is
        recorded durably before the request it came with does anything, so a
        restart does not forget it."""
        if term < self.pm_term:
            self._explain_fenced_pm(term)
            return EpochFencedError(
                f"PM term {term} is older than term {self.pm_term}: sent by a deposed PM"
            )
        if term > self.pm_term:
            self.pm_term = await self.command(lambda ctx: writes.raise_pm_term(ctx, term))
        return None

    def _explain_fenced_pm(self, term: int) -> None:
        """Say once, in the log, why a PM is refused: most often not a deposed
        leader but a data directory run with PMs of another kind."""
        if self._fenced_pm_explained:
            return
        self._fenced_pm_explained = True
        cause = (
            "one PM keeping its metadata in LMDB (term 0) now talks to a data directory "
            "whose ranges PMs on etcd placed (`sbp-cluster --ha`): run those PMs again, "
            "or move the LMDB metadata into etcd with `sbp-pm migrate`"
            if term == 0
            else "a PM of another cluster (its etcd holds other metadata), or a deposed "
            "leader that has not noticed yet"
        )
        logger.warning(
            "refusing SYNC_RANGES and SEAL_RANGES of a PM at term %d: this node recorded term "
            "%d, so a PM of a later term placed its ranges. Likely cause: %s",
            term,
            self.pm_term,
            cause,
        )

    def identity(self) -> messages.DataNode:
        return messages.DataNode(node_id=self.node_id, advertise_addr=self.advertise_addr)

    def read_limit(self, stream_id: int, offset: int) -> int | None:
        """Where a FETCH at ``offset`` must stop in the stream: the commit
        offset of its first replicated range whose end the PM has not fixed
        yet (the open range, or one sealed here and not yet told where the PM
        ended it), None when there is none (SPEC §7: only acknowledged records
        are served).

        A replica that holds records at ``offset`` there but has not learned
        the range's commit offset since it started refuses (``NOT_PRIMARY``,
        retriable: a reader goes on to another replica) rather than answer
        nothing, which a reader would take for the end of the stream."""
        info = self.engine.unsettled_range(stream_id)
        if info is None:
            return None
        if not self.commits.known(stream_id, info.range_index):
            held = self.engine.next_offset(stream_id) or info.start_offset
            if info.start_offset <= offset < held:
                raise NotPrimaryError(
                    f"data node {self.node_id} does not know the commit offset of stream "
                    f"{stream_id} range {info.range_index} yet (it restarted and has not "
                    "heard from the primary): read from another replica"
                )
        return self.commits.get(stream_id, info.range_index, info.start_offset)

    def leads(self, stream_id: int) -> bool:
        """Whether this node is the primary of the stream's open range."""
        info = self.engine.open_range(stream_id)
        return info is not None and info.primary_node_id == self.node_id

    def commit_of(self, info: RangeInfo) -> int:
        """The range's commit offset as this node knows it: a sealed range's
        end, an unreplicated range's next offset, else the commit table's."""
        if len(info.replicas) <= 1:
            return info.next_offset
        if info.end_is_final:
            return info.end_offset
        return self.commits.get(info.stream_id, info.range_index, info.start_offset)

    def wire_range(self, info: RangeInfo) -> messages.Range:
        """``info`` for the wire, its commit offset filled in."""
        return info_to_range(info, self.commit_of(info))

    def knows(self, stream_id: int) -> bool:
        return self.engine.next_offset(stream_id) is not None

    async def learn_stream(self, stream_id: int) -> bool:
        """Ask the PM about a stream this node has no record of (SPEC §5: SYNC_RANGES
        only speeds things up). True when the stream is known afterwards."""
        if self.pm is None:
            return False
        return await self.pm.refresh_stream(stream_id)

    async def install_ranges(self, stream_id: int, ranges: Sequence[messages.Range]) -> None:
        """Apply ranges learned from the PM, as SYNC_RANGES would."""
        infos = [range_to_info(r) for r in ranges]
        await prefetch_dropped(self.engine, [(stream_id, infos)])
        await self.command(lambda ctx: _sync(ctx, stream_id, infos))
        self.ranges_changed(stream_id)

    def ranges_changed(self, stream_id: int) -> None:
        """A seal or a new view of the stream's ranges was applied: waiting
        FETCHes look again (a sealed end answers RANGE_SEALED), replication
        of a range no longer open here stops, and sealed ranges this replica
        is short of are caught up."""
        self.waiters.notify(stream_id)
        if self.replicator is not None:
            self.replicator.ranges_changed(stream_id)
        self.on_ranges_changed(stream_id)

    async def command(self, fn: Callable[[WriteContext], T]) -> T:
        """Run a change in the storage writer's transaction and wait for its
        commit without blocking the event loop (or a worker thread)."""
        return await wait_future(self.engine.submit_command(fn))


async def prefetch_dropped(
    engine: StorageEngine, views: Sequence[tuple[int, Sequence[RangeInfo]]]
) -> None:
    """Before the PM's views of streams' ranges are applied: read, on a worker
    thread, the chunks they free (those below a stream's first range, or all
    of them with no range), so that the writer does not wait for the disk
    (``StorageEngine.prefetch_chunks``). Views that free nothing (the usual
    SYNC_RANGES, after a seal) are applied without the trip to a thread, so
    a new range is known here as soon as before."""
    freeing = [(stream_id, infos) for stream_id, infos in views if _frees(engine, stream_id, infos)]

    def prefetch() -> None:
        for stream_id, infos in freeing:
            stop = _below(min(info.start_offset for info in infos)) if infos else None
            engine.prefetch_chunks(stream_id, stop)

    if freeing:
        await trio.to_thread.run_sync(prefetch)


def _frees(engine: StorageEngine, stream_id: int, infos: Sequence[RangeInfo]) -> bool:
    """Whether applying ``infos`` drops stored chunks of the stream: all of
    them with no range, those below the first range's start otherwise."""
    first = engine.first_offset(stream_id)
    if first is None:
        return False  # nothing stored here
    return not infos or min(info.start_offset for info in infos) > first


def _below(offset: int) -> Callable[[int, IndexEntry], bool]:
    """A ``prefetch_chunks`` stop: at the first chunk that ends past ``offset``."""

    def stop(end_offset: int, _entry: IndexEntry) -> bool:
        return end_offset > offset

    return stop


def _sync(ctx: WriteContext, stream_id: int, infos: list[RangeInfo]) -> list[RangeInfo]:
    return writes.sync_ranges(ctx, stream_id, infos)


def check_stream_id(stream_id: int) -> None:
    """Refuse a stream id the storage keys cannot hold, before it reaches the
    writer (where it would fail the whole group's transaction)."""
    if not 0 <= stream_id <= MAX_STREAM_ID:
        raise InvalidRequestError(f"stream id {stream_id} out of range")


async def wait_future(future: Future[T]) -> T:
    """Wait for a ``concurrent.futures.Future`` completed on another thread.

    The completing thread only schedules an event (``run_sync_soon`` is cheap
    and never blocks it); cancelling the wait leaves the operation running.
    """
    if not future.done():
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def on_done(_: Future[T]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(on_done)
        await done.wait()
    return future.result()
