"""The data node's core: the counterpart of the PM's ``PlacementManager``.

``DataNode`` decides every request the node serves (what storage does,
what a replica may answer) over one ``StorageEngine`` and the replica rules
of ``replica_state``. It is wired whole in its constructor and runs its
background work (replication, catch-up, retention, the PM link) in ``run``.
The handlers in ``datanode.handlers`` translate the wire to calls on it and
its answers back to the wire; they also authorize each item (SPEC §9)
before the core sees it, as the PM's handlers do. The ACL itself
(``access``) lives here, reloaded on SIGHUP.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from net.authz import AccessCollector, AccessControl
from net.pool import ConnectionPool
from sbp import messages
from sbp.enums import ObjectState
from sbp.errors import (
    DataNodeNotFoundError,
    EpochFencedError,
    InvalidRequestError,
    OffsetOutOfRangeError,
    ProtocolError,
    RangeNotFoundError,
)
from sbp.key_hash import KeyMap
from storage.compaction import RangeKeys
from storage.engine import NO_BATCHES, BorrowedBatches, StorageEngine
from storage.layout import IndexEntry
from storage.model import AppendItem, RangeInfo, ReplicaBatch, hosts
from tiering.layout import RangeTrailer

from .appends import Answer, Appends, AppendTicket
from .compaction import (
    DEFAULT_COMPACTION_BYTES_PER_S,
    CompactionCollector,
    NodeCompaction,
    RangeCompacted,
)
from .convert import info_to_range, range_to_info, table_to_snapshots
from .items import check_stream_id, failed, outcomes, wait_future
from .metrics import DataNodeMetrics
from .pm_link import PMLink
from .quotas import QuotaCollector, Quotas
from .replica_state import ReplicaStates
from .replication.catchup import CatchUp
from .replication.metrics import ReplicationCollector
from .replication.primary import Replicator
from .report import LoadReporter
from .retention import DEFAULT_INTERVAL_S, RetentionKeeper
from .tiered import NodeTiering, TieringCollector
from .timeouts import TimeoutQueue
from .waiters import StreamWaiters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PMSettings:
    """Where the PM is, and how often the node tells it it is alive and its load."""

    address: str
    heartbeat_interval_s: float
    metrics_interval_s: float


class Reads(Protocol):
    """Where a FETCH pass keeps the batches it borrows until it answers."""

    def borrow(
        self, engine: StorageEngine, stream_id: int, offset: int, max_bytes: int, limit: int | None
    ) -> BorrowedBatches: ...


class DataNode:
    """See the module docstring. Without a ``pool`` the node neither
    replicates nor catches up (a node of unreplicated ranges, as tests and
    tools run it); without ``pm`` it never asks a PM anything. ``pm`` is
    where the PM is, or a link to it already made."""

    def __init__(
        self,
        node_id: int,
        engine: StorageEngine,
        *,
        access: AccessControl | None = None,
        quotas: Quotas | None = None,
        pool: ConnectionPool | None = None,
        pm: PMSettings | PMLink | None = None,
        data_dir: Path | None = None,
        retention_interval_s: float = DEFAULT_INTERVAL_S,
        compaction_bytes_per_s: int = DEFAULT_COMPACTION_BYTES_PER_S,
        tiering: NodeTiering | None = None,
    ) -> None:
        self.node_id = node_id
        self.engine = engine
        self.waiters = StreamWaiters()
        self.metrics = DataNodeMetrics(
            storage_stats=engine.stats,
            waiting_fetches=lambda: self.waiters.waiting,
            hosted_ranges=engine.list_ranges,
        )
        self.access = access or AccessControl()
        self.metrics.registry.register(AccessCollector(self.access))
        #: byte rates per principal (SPEC §12)
        self.quotas = quotas or Quotas()
        self.metrics.registry.register(QuotaCollector(self.quotas))
        self.replicas = ReplicaStates(node_id, engine, self.waiters)
        #: "host:port" given to the PM and clients (``serving_at``)
        self.advertise_addr = ""
        self._serving = trio.Event()
        #: set on shutdown: long polls answer what they have instead of waiting
        self.draining = False
        #: the highest PM term seen in a SYNC_RANGES or SEAL_RANGES (SPEC §8):
        #: one from an older term comes from a deposed PM and is refused
        self.pm_term = engine.pm_term()
        self._fenced_pm_explained = False
        #: answers the APPENDs whose timeout_ms passes before they are durable
        self.append_timeouts = TimeoutQueue()
        self.pm: PMLink | None = None if isinstance(pm, PMSettings) else pm
        if isinstance(pm, PMSettings):
            assert pool is not None, "a PM link needs a connection pool"
            reporter = LoadReporter(
                engine,
                self.metrics.counters,
                data_dir or engine.path,
                self.identity,
                self._missing_replicas,
            )
            self.pm = PMLink(
                pm.address,
                pool,
                self.identity,
                reporter.build,
                self.install_ranges,
                heartbeat_interval=pm.heartbeat_interval_s,
                metrics_interval=pm.metrics_interval_s,
            )
        self.replicator: Replicator | None = None
        self.catch_up: CatchUp | None = None
        if pool is not None:
            self.replicator = Replicator(self.replicas, self.pm, pool)
            self.catch_up = CatchUp(self.replicas, self.waiters, pool)
            self.metrics.registry.register(ReplicationCollector(self.replicator, self.catch_up))
        self.retention = RetentionKeeper(
            engine, self.waiters, self.metrics.counters, self.pm, retention_interval_s
        )
        #: rewrites of sealed ranges of compacted streams (SPEC §13)
        self.compaction = NodeCompaction(engine, self.waiters, compaction_bytes_per_s)
        self.metrics.registry.register(CompactionCollector(self.compaction.counters))
        #: copies to the object store and reads from it (SPEC §14)
        self.tiering = tiering
        if tiering is not None:
            self.metrics.registry.register(TieringCollector(tiering))
        self._appends = Appends(
            engine,
            self.replicator,
            self.waiters,
            self.metrics.counters,
            self.append_timeouts,
            self.knows,
            self.learn_stream,
        )

    def _missing_replicas(self) -> int:
        lagging = self.replicator.lagging_ranges() if self.replicator is not None else 0
        return lagging + (len(self.catch_up.missing) if self.catch_up is not None else 0)

    # -- running ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The node's background work, until cancelled. Started before the
        listener: an APPEND to a replicated range must never be answered
        without its pipeline."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._reload_on_sighup)
            nursery.start_soon(self.append_timeouts.run)
            if self.replicator is not None:
                await nursery.start(self.replicator.run)
            if self.catch_up is not None:
                nursery.start_soon(self.catch_up.run)
            task_status.started()
            nursery.start_soon(self.retention.run)
            if self.tiering is not None:
                nursery.start_soon(self.tiering.run)
            if self.pm is not None:
                # registers with the address clients are to use: once known
                await self._serving.wait()
                nursery.start_soon(self.pm.run)

    async def _reload_on_sighup(self) -> None:
        """SIGHUP reads the ACL file and the quota file again."""
        if self.access.path is None and self.quotas.path is None:
            return
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                self.access.reload()
                self.quotas.reload()

    def serving_at(self, advertise_addr: str) -> None:
        """The listener is bound: this is the address the PM and clients get."""
        self.advertise_addr = advertise_addr
        self._serving.set()

    def drain(self) -> None:
        """Shutdown begins: long polls end now rather than at their
        max_wait_ms, answering what they have."""
        self.draining = True
        self.waiters.notify_all()

    def identity(self) -> messages.DataNode:
        return messages.DataNode(node_id=self.node_id, advertise_addr=self.advertise_addr)

    # -- APPEND -----------------------------------------------------------------------

    def append(
        self,
        items: list[AppendItem],
        denials: Sequence[ProtocolError | None],
        connection: object,
        deadline: float,
        received_at: float,
        on_answer: Answer,
    ) -> Awaitable[None] | None:
        """Store the items (SPEC §5), answering ``on_answer`` once: when
        durable here and, for replicated ranges, once the commit offset
        passes them; TIMEOUT at ``deadline``. Items with a denial (SPEC §9,
        by the handler; empty: none) are refused alone. Returns an awaitable when the
        request must first wait for streams this node learns from the PM
        (``appends.Appends.start``)."""
        counters = self.metrics.counters
        counters.append_requests += 1
        counters.append_items += len(items)
        ticket = AppendTicket(items, denials, deadline, received_at, counters, on_answer)
        return self._appends.start(ticket, connection)

    # -- FETCH ------------------------------------------------------------------------

    def read(self, stream_id: int, offset: int, max_bytes: int, reads: Reads) -> BorrowedBatches:
        """The stream's whole batches from ``offset``, borrowed until
        ``reads`` closes; in a replicated range whose end the PM has not
        fixed, only those below the commit offset (SPEC §7). A follower
        behind its primary has nothing yet rather than refusing an offset
        the primary may hold (``ReplicaStates.waits_past_end``)."""
        limit = self.replicas.read_limit(stream_id, offset)
        try:
            return reads.borrow(self.engine, stream_id, offset, max_bytes, limit)
        except OffsetOutOfRangeError:
            if self.replicas.waits_past_end(stream_id, offset, limit):
                return NO_BATCHES
            raise

    # -- REPLICATE --------------------------------------------------------------------

    def producer_snapshot(self, stream_id: int, as_of: int) -> messages.ProducerStateResponse:
        """PRODUCER_STATE: the stream's producer state as of ``as_of``, for a
        replica of the range that starts there."""
        try:
            check_stream_id(stream_id)
            table = self.engine.producer_snapshot(stream_id, as_of)
        except ProtocolError as error:
            return failed(messages.ProducerStateResponse, error)
        return messages.ProducerStateResponse(producers=table_to_snapshots(table))

    async def range_holdings(
        self, ranges: Sequence[tuple[int, int]], skips: Sequence[int]
    ) -> list[tuple[int, int, int, int] | ProtocolError]:
        """RANGE_HOLDINGS (the PM's): per range, how far this node holds it
        without a gap, the bytes of that, where to cut it to drop its first
        ``skips[i]`` bytes (0: not asked), and the offset after the last
        batch it holds of the stream with a record without a key; or the
        error. The index is read off the event loop."""

        def look() -> list[tuple[int, int, int, int] | ProtocolError]:
            engine = self.engine
            found: list[tuple[int, int, int, int] | ProtocolError] = []
            for i, (stream_id, range_index) in enumerate(ranges):
                skip = skips[i] if i < len(skips) else 0
                try:
                    check_stream_id(stream_id)
                    held_end, size = engine.range_holding(stream_id, range_index)
                    cut = engine.offset_after_bytes(stream_id, range_index, skip) if skip else 0
                except ProtocolError as error:
                    found.append(error)
                    continue
                found.append((held_end, size, cut, engine.keyless_below(stream_id)))
            return found

        return await trio.to_thread.run_sync(look)

    async def compaction_keys(self, stream_id: int, range_index: int) -> tuple[RangeKeys, int]:
        """COMPACTION_KEYS (the PM's): what a sealed range held here holds
        of each key, and when its last batch was appended."""
        check_stream_id(stream_id)
        return await self.compaction.keys(stream_id, range_index)

    async def compact_ranges(
        self, stream_id: int, ranges: Sequence[tuple[int, bool]], keys: KeyMap
    ) -> list[RangeCompacted | ProtocolError]:
        """COMPACT_RANGES (the PM's): rewrite sealed ranges held here by
        ``keys``, per range with its tombstones dropped or not; per range,
        what it did or why not."""
        done: list[RangeCompacted | ProtocolError] = []
        for range_index, drop_tombstones in ranges:
            try:
                check_stream_id(stream_id)
                done.append(
                    await self.compaction.compact(stream_id, range_index, keys, drop_tombstones)
                )
            except ProtocolError as error:
                done.append(error)
        self.waiters.notify(stream_id)
        return done

    async def replicate(
        self, items: Sequence[tuple[ReplicaBatch | ProtocolError, int]], deadline: float
    ) -> list[int | ProtocolError]:
        """A follower's side of REPLICATE (SPEC §7), of items checked by the
        handler (a batch, or the error refusing it) with the primary's
        commit offset each carries: per item, this replica's
        durable next offset of the range after it, or the error refusing it.
        Batches go to storage in one transaction, in arrival order; an item
        carrying only the commit offset is answered from what is durable
        now. An accepted item's commit offset is what FETCH here may serve
        up to. A range this node has not heard of yet is asked of the PM, so
        the primary's next try finds it."""
        unknown = {
            batch.stream_id
            for batch, _ in items
            if isinstance(batch, ReplicaBatch) and not self.knows(batch.stream_id)
        }
        if unknown:
            with trio.move_on_at(deadline):
                for stream_id in sorted(unknown):
                    await self.learn_stream(stream_id)
        batches = [b for b, _ in items if isinstance(b, ReplicaBatch) and b.record_count]
        held: list[int | ProtocolError] = []
        if batches:
            [done] = await outcomes([self.engine.replicate(batches)], deadline)
            held = [done] * len(batches) if isinstance(done, ProtocolError) else done
        stored = iter(held)
        results: list[int | ProtocolError] = []
        relearn: set[int] = set()
        for batch, commit_offset in items:
            outcome: int | ProtocolError
            if not isinstance(batch, ReplicaBatch):
                outcome = batch
            elif batch.record_count:
                outcome = next(stored)
            else:
                try:
                    outcome = self.engine.replica_position(batch)
                except ProtocolError as error:
                    outcome = error
            if isinstance(outcome, ProtocolError):
                if isinstance(outcome, RangeNotFoundError) and isinstance(batch, ReplicaBatch):
                    relearn.add(batch.stream_id)
            else:
                assert isinstance(batch, ReplicaBatch)
                self.replicas.commits.advance(batch.stream_id, batch.range_index, commit_offset)
            results.append(outcome)
        with trio.move_on_at(deadline):
            for stream_id in sorted(relearn):
                await self.learn_stream(stream_id)
        return results

    # -- ranges -----------------------------------------------------------------------

    def list_ranges(self, owner: messages.RangeOwner) -> list[RangeInfo]:
        """The ranges of one stream, or of this whole node."""
        if owner.data_node is None:
            return self.engine.list_ranges(owner.stream_id)
        if owner.data_node.node_id != self.node_id:
            raise DataNodeNotFoundError(
                f"this is data node {self.node_id}, not {owner.data_node.node_id}"
            )
        return self.engine.list_ranges()

    async def describe(self, stream_id: int, range_index: int) -> RangeInfo:
        """One range as held here. A range (or stream) placed here that this
        node has not been told of yet, its SYNC_RANGES still on the way, is
        asked of the PM, as FETCH does, rather than have the reader give up
        on this replica."""
        try:
            return self.engine.describe_range(stream_id, range_index)
        except RangeNotFoundError:
            if not await self.learn_stream(stream_id):
                raise
            return self.engine.describe_range(stream_id, range_index)

    async def find_offset(
        self, stream_id: int, range_index: int, timestamp_ms: int
    ) -> tuple[int, int]:
        """FIND_OFFSETS (SPEC §11): the first offset of the range appended at
        or after ``timestamp_ms``, and its append time (-1: none, the offset
        is the range's end)."""
        check_stream_id(stream_id)
        try:
            return self.engine.find_offset(stream_id, range_index, timestamp_ms)
        except RangeNotFoundError:
            if not await self.learn_stream(stream_id):
                raise
            return self.engine.find_offset(stream_id, range_index, timestamp_ms)

    async def seal(
        self, pm_term: int, ranges: Sequence[tuple[int, int]], deadline: float
    ) -> list[RangeInfo | ProtocolError]:
        """SEAL_RANGES from the PM: each range ends at what this replica
        holds (SEALED_HERE). Submitted together, the seals commit in one
        transaction. A FETCH waiting at the end of a sealed range then gets
        RANGE_SEALED, and its replication stops."""
        refused = await self._refuse_older_term(pm_term)
        if refused is not None:
            return [refused] * len(ranges)
        sealed = await outcomes(
            [self.engine.seal_range(stream_id, index) for stream_id, index in ranges], deadline
        )
        for (stream_id, _), outcome in zip(ranges, sealed, strict=True):
            if not isinstance(outcome, ProtocolError):
                self.ranges_changed(stream_id)
        return sealed

    async def sync(
        self,
        pm_term: int,
        views: Sequence[tuple[int, Sequence[messages.Range]]],
        deadline: float,
        policies: Sequence[int | None] = (),
    ) -> list[list[RangeInfo] | ProtocolError]:
        """SYNC_RANGES from the PM: each stream's ranges become the PM's view
        of them. The streams whose view was applied are looked at again by
        retention (their settings may have changed on the PM)."""
        refused = await self._refuse_older_term(pm_term)
        if refused is not None:
            return [refused] * len(views)
        infos: list[list[RangeInfo] | ProtocolError] = []
        for stream_id, wire in views:
            try:
                check_stream_id(stream_id)
                infos.append([range_to_info(r) for r in wire])
            except ProtocolError as error:
                infos.append(error)
        applicable = [
            (stream_id, view)
            for (stream_id, _), view in zip(views, infos, strict=True)
            if not isinstance(view, ProtocolError)
        ]
        await self._prefetch_dropped(applicable)
        cleanup = list(policies) or [None] * len(views)
        synced = await outcomes(
            [
                view
                if isinstance(view, ProtocolError)
                else self.engine.sync_ranges(stream_id, view, policy)
                for (stream_id, _), view, policy in zip(views, infos, cleanup, strict=True)
            ],
            deadline,
        )
        applied = [
            stream_id
            for (stream_id, _), outcome in zip(views, synced, strict=True)
            if not isinstance(outcome, ProtocolError)
        ]
        for stream_id in applied:
            self.ranges_changed(stream_id)
        self.retention.nudge(applied)
        return synced

    async def delete(
        self,
        stream_ids: Sequence[int],
        denials: Sequence[ProtocolError | None],
        deadline: float,
    ) -> list[ProtocolError | None]:
        """DELETE_STREAMS: mark deleted, refuse writes, free the data. FETCHes
        waiting on a deleted stream then get STREAM_DELETED. A stream with a
        denial (SPEC §9, by the handler) is refused alone."""
        refusals: list[ProtocolError | None] = []
        for stream_id, denied in zip(stream_ids, denials, strict=True):
            try:
                check_stream_id(stream_id)
                refusals.append(denied)
            except ProtocolError as refused:
                refusals.append(refused)
        # every chunk of a deleted stream is freed: read them off the writer's path
        await self._prefetch_dropped(
            [(sid, []) for sid, refused in zip(stream_ids, refusals, strict=True) if not refused]
        )
        deleted = await outcomes(
            [
                refused if refused is not None else self.engine.delete_stream(stream_id)
                for stream_id, refused in zip(stream_ids, refusals, strict=True)
            ],
            deadline,
        )
        for stream_id, outcome in zip(stream_ids, deleted, strict=True):
            if outcome is None:
                self.waiters.notify(stream_id)
        return deleted

    def wire_range(self, info: RangeInfo) -> messages.Range:
        """``info`` for the wire, its commit offset filled in."""
        return info_to_range(info, self.replicas.commit_of(info))

    # -- what the PM says -----------------------------------------------------------

    async def _refuse_older_term(self, term: int) -> ProtocolError | None:
        """Why a PM's request must be refused whole: from an older PM term
        (SPEC §8); None to serve it. A newer term is recorded durably before
        the request does anything, so a restart does not forget it."""
        if term < self.pm_term:
            self._explain_fenced_pm(term)
            return EpochFencedError(
                f"PM term {term} is older than term {self.pm_term}: sent by a deposed PM"
            )
        if term > self.pm_term:
            self.pm_term = await wait_future(self.engine.raise_pm_term(term))
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

    def knows(self, stream_id: int) -> bool:
        return self.engine.next_offset(stream_id) is not None

    async def upload_range(
        self, stream_id: int, range_index: int, epoch: int
    ) -> RangeTrailer | ProtocolError:
        """UPLOAD_RANGE (the PM's, SPEC §14): copy a sealed range held whole
        here to the object store; its object's trailer, or the error."""
        if self.tiering is None:
            return InvalidRequestError(
                f"data node {self.node_id} has no object store (--object-store)"
            )
        try:
            check_stream_id(stream_id)
            return await self.tiering.upload(stream_id, range_index, epoch)
        except ProtocolError as error:
            return error

    def in_object_store(self, stream_id: int, offset: int) -> RangeInfo | bool:
        """Where a read at ``offset`` stands with the object store (SPEC §14):
        the range holding it when that is in the store only; False when this
        node reads it from its own disk (or has no object store); True when
        this node does not host it as it sees it, so the PM may list it in
        the store only (this node's view of the stream may be old)."""
        if self.tiering is None:
            return False
        info = self.engine.range_at(stream_id, offset)
        if info is not None and info.object_state == ObjectState.IN_STORE_ONLY:
            return info
        # the PM's list first: this node's own view may show it on its disk still
        listed = self.tiering.listed_range(stream_id, offset)
        if listed is not None:
            return listed
        return info is None or not hosts(info, self.node_id)

    async def learn_stream(self, stream_id: int) -> bool:
        """Ask the PM about a stream this node has no record of (SPEC §5:
        SYNC_RANGES only speeds things up). True when it is known afterwards."""
        if self.pm is None:
            return False
        known: bool = await self.pm.refresh_stream(stream_id)
        return known

    async def install_ranges(self, stream_id: int, ranges: Sequence[messages.Range]) -> None:
        """Apply ranges looked up on the PM, as SYNC_RANGES would, unless
        the answer may be older than what SYNC_RANGES brought meanwhile
        (``StorageEngine.learn_ranges``)."""
        infos = [range_to_info(r) for r in ranges]
        if self.tiering is not None:
            self.tiering.note_listed(stream_id, infos)
        await self._prefetch_dropped([(stream_id, infos)])
        await wait_future(self.engine.learn_ranges(stream_id, infos))
        self.ranges_changed(stream_id)

    def ranges_changed(self, stream_id: int) -> None:
        """A seal or a new view of the stream's ranges was applied: waiting
        FETCHes look again (a sealed end answers RANGE_SEALED), replication
        of a range no longer open here stops, and sealed ranges this replica
        is short of are caught up."""
        self.waiters.notify(stream_id)
        if self.replicator is not None:
            self.replicator.ranges_changed(stream_id)
        if self.catch_up is not None:
            self.catch_up.stream_changed(stream_id)

    async def _prefetch_dropped(self, views: Sequence[tuple[int, Sequence[RangeInfo]]]) -> None:
        """Before the PM's views of streams' ranges are applied: read, on a
        worker thread, the chunks they free (those below a stream's first
        range, or all of them with no range), so that the writer does not
        wait for the disk (``StorageEngine.prefetch_chunks``). Views that
        free nothing (the usual SYNC_RANGES, after a seal) are applied
        without the trip to a thread."""
        engine = self.engine
        freeing = [(sid, infos) for sid, infos in views if _frees(engine, sid, infos)]

        def prefetch() -> None:
            for stream_id, infos in freeing:
                stop = _below(min(info.start_offset for info in infos)) if infos else None
                engine.prefetch_chunks(stream_id, stop)

        if freeing:
            await trio.to_thread.run_sync(prefetch)


def _frees(engine: StorageEngine, stream_id: int, infos: Sequence[RangeInfo]) -> bool:
    """Whether applying ``infos`` drops stored chunks of the stream."""
    first = engine.first_offset(stream_id)
    if first is None:
        return False  # nothing stored here
    return not infos or min(info.start_offset for info in infos) > first


def _below(offset: int) -> Callable[[int, IndexEntry], bool]:
    """A ``prefetch_chunks`` stop: at the first chunk that ends past ``offset``."""

    def stop(end_offset: int, _entry: IndexEntry) -> bool:
        return end_offset > offset

    return stop
