"""The placement manager's request logic, over plain records (SPEC §5, PM).

``PlacementManager`` owns the metadata store, the node registry and the link
to the data nodes, and implements each PM request as a method taking and
returning records; ``pm.handlers`` only translates to and from the wire.

Rules that hold throughout:

- Durability before answers: every change is committed (synced) before the
  request is answered, and before the data nodes hear of it. The commit is
  shielded from cancellation, so a request whose deadline passes mid-commit
  still learns whether it committed.
- Telling the data nodes (SYNC_RANGES, DELETE_STREAMS) after a commit is best
  effort within the request's deadline: the change is already the truth; a
  data node that missed it asks the PM (LIST_RANGES) when it meets the stream,
  and is reconciled with the metadata when it comes back (``pm.reconciler``).
  Sealing is different: the PM cannot record an end offset without the
  primary's answer, so a seal fails when the primary does not answer.
- Changes to one stream's ranges (seal, trim, update, delete) are serialised
  by a per-stream lock, held until the data nodes were told, so two racing
  seals produce exactly one next range. SYNC_RANGES reach a node one call
  at a time, each with the ranges as they are when it is sent
  (``pm.node_syncs``), so a node never gets an older view after a newer one.
- Per-item errors never fail the other items of a batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from functools import partial
from typing import Final, Protocol, TypeVar

import trio

from net.ratelog import RateLimitedLog
from sbp import messages
from sbp.enums import DataNodeState
from sbp.errors import (
    DataNodeNotFoundError,
    InvalidRequestError,
    NotEnoughReplicasError,
    OffsetOutOfRangeError,
    ProtocolError,
    RangeNotFoundError,
    RequestTimeoutError,
    SBPError,
    StreamNotFoundError,
)
from sbp.key_hash import KeyMap
from sbp.replication import effective_acks, seal_end
from tiering.store import ObjectStore

from . import reconcile, stream_settings
from .changes import (
    Change,
    DeleteNode,
    DeleteRange,
    DeleteStream,
    Metadata,
    MetadataCounts,
    PutNode,
    PutRange,
    PutStream,
    RaiseNextStreamId,
    SetDraining,
)
from .compaction import DEFAULT_COMPACTION, CompactionSettings, Compactor
from .drain import NodeDrains
from .groups import ConsumerGroups, RecordTimes, StreamEnds
from .liveness import NodeRegistry, NodeState
from .locks import StreamLocks
from .members import GroupMembers
from .move_budget import MoveBudget
from .node_syncs import NodeSyncs
from .placement import place
from .producers import ProducerIds
from .range_log import RangeLog
from .range_sizes import RangeSizes
from .rebalance import DEFAULT_INTERVAL_S as REBALANCE_INTERVAL_S
from .rebalance import DEFAULT_THRESHOLD as REBALANCE_THRESHOLD
from .rebalance import PlannedMove, Rebalancer
from .reconciler import RECONCILE_INTERVAL_S, NodeReconciler
from .records import Holding, NodeRecord, Outcome, RangeRecord, StreamRecord
from .sealing import full_and_short, seal_refused, seal_replicas
from .size_retention import DEFAULT_INTERVAL_S as SIZE_RETENTION_INTERVAL_S
from .size_retention import SizeRetention
from .stream_ids import StreamIds
from .tiering import DEFAULT_INTERVAL_S as TIERING_INTERVAL_S
from .tiering import DEFAULT_ROLL_BYTES as TIERING_ROLL_BYTES
from .tiering import DEFAULT_SWEEP_INTERVAL_S as TIERING_SWEEP_INTERVAL_S
from .tiering import Tiering
from .upkeep import ReplicaUpkeep

log = logging.getLogger(__name__)
#: a range whose seal keeps failing is retried every second: logged once a minute
_seal_failures = RateLimitedLog(log, interval=60.0)

T = TypeVar("T")

#: replica_nums is an int8 on the wire
#: GET_STREAMS listing: page size when the request gives no limit, and the cap
#: (10,000 results stay far below the 16 MiB frame limit)
DEFAULT_LIST_LIMIT: Final = 1000
MAX_LIST_LIMIT: Final = 10_000


class DataNodeCalls(Protocol):
    """What the PM asks of data nodes (``pm.datanode_link`` over the network).

    Each call retries brief unreachability until the caller's cancel scope
    (the request's deadline) ends it, and raises ``ProtocolError`` for an
    answer that retrying cannot change.
    """

    async def sync_ranges(
        self, node_id: int, streams: Sequence[tuple[int, Sequence[RangeRecord]]]
    ) -> None:
        """SYNC_RANGES: each stream with its whole current list of ranges."""

    async def seal_replica(self, rng: RangeRecord, node_id: int) -> int:
        """SEAL_RANGES on one replica of the range; returns its durable next
        offset (where the replica sealed it)."""

    async def next_offset(self, rng: RangeRecord) -> int:
        """DESCRIBE_RANGES on the range's primary; returns its next offset."""

    async def ends_of_open_ranges(
        self, node_id: int, ranges: Sequence[RangeRecord]
    ) -> dict[int, int]:
        """DESCRIBE_RANGES of open ranges on their primary, in batches: the
        next offset of each it could describe, by stream id."""

    async def record_timestamp(self, node_id: int, stream_id: int, offset: int) -> int | None:
        """FETCH of the batch holding ``offset``: its record's timestamp."""

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        """RANGE_HOLDINGS: what the node holds of each range, by (stream_id,
        range_index), and where to cut each to drop its first ``skips[i]``
        bytes; those it does not hold left out."""

    async def compaction_keys(
        self, node_id: int, stream_id: int, range_index: int
    ) -> tuple[KeyMap, int, int]:
        """COMPACTION_KEYS: a sealed range's latest offset of each key, its
        bytes and when it was last appended to."""

    async def compact_ranges(
        self, node_id: int, stream_id: int, ranges: Sequence[tuple[int, bool]], keys: KeyMap
    ) -> list[messages.CompactRangeResult]:
        """COMPACT_RANGES: rewrite the node's replicas of sealed ranges by ``keys``."""

    async def delete_streams(self, node_id: int, stream_ids: Sequence[int]) -> None:
        """DELETE_STREAMS."""

    async def upload_range(self, node_id: int, rng: RangeRecord) -> None:
        """UPLOAD_RANGE: the node copies the sealed range to the object store."""

    async def hosted_ranges(self, node_id: int) -> list[RangeRecord]:
        """LIST_RANGES by data node, asked of the node: the ranges it holds."""

    async def reachable(self, address: str) -> bool:
        """Whether ``address`` answers PING (briefly; never raises)."""


class PlacementManager:
    """Streams, ranges and data nodes: the PM's requests as methods."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: DataNodeCalls,
        *,
        min_free_space: int = 0,
        repair_after: float = math.inf,
        max_move_bytes_per_s: int = 0,
        size_retention_interval: float = SIZE_RETENTION_INTERVAL_S,
        rebalance_threshold: float = REBALANCE_THRESHOLD,
        rebalance_interval: float = REBALANCE_INTERVAL_S,
        reconcile_interval: float = RECONCILE_INTERVAL_S,
        objects: ObjectStore | None = None,
        object_sweep_interval: float = TIERING_SWEEP_INTERVAL_S,
        tiered_roll_bytes: int = TIERING_ROLL_BYTES,
        tiering_interval: float = TIERING_INTERVAL_S,
        compaction: CompactionSettings = DEFAULT_COMPACTION,
    ) -> None:
        self.store = store
        self.registry = registry
        self._link = link
        #: below this free space a data node is full (``--min-free-space``)
        self.min_free_space = min_free_space
        #: whether the cluster has an object store (SPEC §14): tiered streams need one
        self.object_store = objects is not None
        self._locks = StreamLocks()
        #: SYNC_RANGES and DELETE_STREAMS to the data nodes, one call at a time per node
        self._node_syncs = NodeSyncs(
            self._send_sync, self._sync_failed, delete=self._link.delete_streams
        )
        #: whether shutdown has ended the calls to data nodes (``stop_outgoing``)
        self.stopping = False
        #: seals by cause (metrics)
        self.seals: Counter[str] = Counter()
        self.stream_ids = StreamIds(store.next_stream_id())
        registry.restore(store.nodes(), store.range_counts_by_node(), store.draining_nodes())
        #: nodes brought back in step with the metadata
        self.reconciler = NodeReconciler(
            store,
            registry,
            link,
            self._node_syncs,
            self._locks,
            self.commit,
            self.stream_ids,
            interval=reconcile_interval,
            stopping=lambda: self.stopping,
        )
        #: the replicas' upkeep: dead primaries, repairs, full nodes, short-handed ranges
        self.upkeep = ReplicaUpkeep(self, min_free_space=min_free_space, repair_after=repair_after)
        #: streams' size limits (SPEC §12)
        #: the bytes of ranges, as replicas hold them
        self.range_sizes = RangeSizes(registry, link)
        self.size_retention = SizeRetention(self, self.range_sizes, size_retention_interval)
        #: every change of ranges and streams, and what follows each
        self.range_log = RangeLog(store)
        self.range_log.observe(registry, self.upkeep, self.size_retention)
        #: nodes being drained (SPEC §12)
        #: how fast copies of ranges start (drains and rebalancing)
        self.move_budget = MoveBudget(max_move_bytes_per_s)
        self.drains = NodeDrains(self, link, self.move_budget, min_free_space=min_free_space)
        #: sealed ranges moved to even out the nodes (SPEC §12)
        self.rebalancer = Rebalancer(
            self,
            self.range_sizes,
            link,
            self.move_budget,
            threshold=rebalance_threshold,
            interval=rebalance_interval,
            min_free_space=min_free_space,
        )
        #: compacted streams' passes (SPEC §13)
        self.compactor = Compactor(
            store, link, registry, self._seal_for_compaction, settings=compaction
        )
        #: tiered streams' ranges in the object store (SPEC §14)
        self.tiering: Tiering | None = None
        if objects is not None:
            self.tiering = Tiering(
                store,
                registry,
                link,
                objects,
                self.commit,
                self.hold,
                self.sync_streams,
                self.trim_streams,
                self._seal_for_tiering,
                self.range_sizes,
                roll_bytes=tiered_roll_bytes,
                interval=tiering_interval,
                sweep_interval=object_sweep_interval,
            )
            self.range_log.observe(self.tiering)
        #: idempotent producers' ids and epochs (INIT_PRODUCER)
        self.producers = ProducerIds(store, self.commit)
        #: consumer group members (SPEC §15)
        self.members = GroupMembers(store, self.commit)
        #: consumer groups' positions and the streams' ends (SPEC §11)
        self.groups = ConsumerGroups(
            store, self.commit, StreamEnds(store, link), RecordTimes(store, link), self.members
        )

    # -- data nodes -----------------------------------------------------------

    async def heartbeat(self, node: NodeRecord) -> None:
        """A data node's HEARTBEAT: register or refresh it (persisted when new)."""
        _check_node(node)
        await self._verify_if_new(node)
        self._note_if_returning(node.node_id)
        moved_from = self.registry.address(node.node_id)
        if self.registry.heartbeat(node):
            await self._registered(node, moved_from)

    async def report_metrics(self, node: NodeRecord, metrics: dict[str, int]) -> None:
        """A data node's REPORT_METRICS: its latest load, and a sign of life."""
        _check_node(node)
        await self._verify_if_new(node)
        self._note_if_returning(node.node_id)
        moved_from = self.registry.address(node.node_id)
        if self.registry.report(node, metrics):
            await self._registered(node, moved_from)

    async def _registered(self, node: NodeRecord, moved_from: str) -> None:
        """Persist a node that is new or advertises another address. A node
        that moved (restarted on another port) is what every replica of its
        ranges must reach from now on: its streams go to all of them at once
        (SYNC_RANGES carries each replica's address), so that primaries
        replicate to its new address and followers learn where it leads."""
        await self.commit([PutNode(node)])
        if not moved_from or moved_from == node.address:
            log.info("data node %d registered at %s", node.node_id, node.address)
            return
        log.info("data node %d moved from %s to %s", node.node_id, moved_from, node.address)
        streams = {rng.stream_id for rng in self.store.ranges_on_node(node.node_id)}
        if streams:
            # queued at once, answered in the background: the heartbeat waits for none of it
            await self.sync_streams(streams, deadline=trio.current_time())

    async def _verify_if_new(self, node: NodeRecord) -> None:
        """Before a node id is registered, or moves to another address, the
        address must answer PING: anyone may send a HEARTBEAT with role
        DATA_NODE, and a made-up address would otherwise get ranges."""
        known = self.registry.get(node.node_id)
        if known is not None and known.node.address == node.address:
            return
        if not await self._link.reachable(node.address):
            raise InvalidRequestError(
                f"data node {node.node_id} advertises {node.address}, which does not answer PING"
            )

    def _note_if_returning(self, node_id: int) -> None:
        if self.registry.is_returning(node_id):
            self.reconciler.note_returning(node_id)

    def hold(self, stream_id: int) -> AbstractAsyncContextManager[None]:
        """The stream's lock: one change of a stream's ranges at a time."""
        return self._locks.hold(stream_id)

    def hold_all(self, stream_ids: Iterable[int]) -> AbstractAsyncContextManager[None]:
        """The locks of several streams, for a change of all of them at once."""
        return self._locks.hold_all(stream_ids)

    def stop_outgoing(self) -> None:
        """Shutdown: end every call to data nodes still running after its
        request's commit, and any that would start, whatever its deadline
        (those that miss the change hear it when reconciled)."""
        self.stopping = True
        self._node_syncs.stop()

    def cluster(self) -> list[NodeState]:
        """Every known data node with its liveness and latest report."""
        return self.registry.states()

    async def drain_nodes(
        self, node_ids: Sequence[int], *, cancel: bool = False
    ) -> list[Outcome[DataNodeState]]:
        """DRAIN_DATA_NODES (SPEC §12): mark the nodes draining (or, with
        ``cancel``, active again) in one commit; the upkeep moves their
        ranges (``pm.drain``). Idempotent. Each node's state after it."""
        known = {state.node_id for state in self.registry.states()}
        changes: list[Change] = []
        for node_id in dict.fromkeys(node_ids):
            if node_id in known and (node_id in self.registry.draining) == cancel:
                changes.append(SetDraining(node_id, not cancel))
        await self.commit(changes)
        for change in changes:
            if isinstance(change, SetDraining):
                if change.draining:
                    self.registry.draining.add(change.node_id)
                    log.warning("data node %d is draining", change.node_id)
                else:
                    self.registry.draining.discard(change.node_id)
                    log.warning("data node %d: drain cancelled, it is active", change.node_id)
        return [
            Outcome(value=self.drains.state(node_id))
            if node_id in known
            else Outcome(error=DataNodeNotFoundError(f"no data node {node_id}"))
            for node_id in node_ids
        ]

    async def remove_nodes(self, node_ids: Sequence[int]) -> list[ProtocolError | None]:
        """Forget data nodes that are dead and hold no range (drained, or
        never given one); a live node, or one still holding ranges, is
        refused. One commit."""
        refusals: list[ProtocolError | None] = []
        for node_id in node_ids:
            state = self.registry.get(node_id)
            held = len(self.store.ranges_on_node(node_id))
            if state is None:
                refusals.append(DataNodeNotFoundError(f"no data node {node_id}"))
            elif held:
                refusals.append(
                    InvalidRequestError(
                        f"data node {node_id} holds {held} range(s): drain it first "
                        f"(sbp nodes drain {node_id} --wait)"
                    )
                )
            elif state.alive:
                refusals.append(
                    InvalidRequestError(
                        f"data node {node_id} is alive: stop it first (it would register again)"
                    )
                )
            else:
                refusals.append(None)
        doomed = sorted({n for n, r in zip(node_ids, refusals, strict=True) if r is None})
        await self.commit([DeleteNode(node_id) for node_id in doomed])
        for node_id in doomed:
            self.registry.forget(node_id)
            log.warning("data node %d removed", node_id)
        return refusals

    async def move_ranges(self, timeout: float) -> None:
        """One step of every drain and every rebalancing move (the upkeep's pass)."""
        await self.drains.run_pass(timeout)
        if not self.stopping:
            await self.rebalancer.run_pass(timeout)

    async def rebalance(self, *, dry_run: bool) -> tuple[list[PlannedMove], int]:
        """A plan that evens out the nodes, started unless ``dry_run``, and
        the moves already under way (a new plan waits for them: none is made)."""
        pending = len(self.store.moves())
        if pending:
            return [], pending
        plan = await self.rebalancer.plan()
        if not dry_run:
            await self.rebalancer.start(plan)
        return plan, 0

    def counts(self) -> MetadataCounts:
        return self.store.counts()

    # -- streams --------------------------------------------------------------

    async def create_streams(
        self, specs: Sequence[StreamRecord], timeout: float
    ) -> list[Outcome[tuple[StreamRecord, RangeRecord]]]:
        """Create streams (their ids are assigned here) with their range 0.

        The whole batch is one metadata transaction and one SYNC_RANGES per
        data node, which is what makes a frame of 1,000 streams cheap.
        """
        deadline = trio.current_time() + timeout
        results: list[Outcome[tuple[StreamRecord, RangeRecord]]] = []
        created: list[tuple[StreamRecord, RangeRecord]] = []
        for spec in specs:
            try:
                stream_settings.check_new(spec, object_store=self.object_store)
                nodes = self._place(spec.replica_nums)
            except ProtocolError as exc:
                results.append(Outcome(error=exc))
                continue
            stream = replace(spec, stream_id=self.stream_ids.take())
            first = RangeRecord(stream.stream_id, 0, 0, nodes, epoch=stream.epoch)
            created.append((stream, first))
            results.append(Outcome((stream, first)))
        if not created:
            return results
        changes: list[Change] = [PutStream(stream) for stream, _ in created]
        changes += [PutRange(rng) for _, rng in created]
        changes.append(RaiseNextStreamId(self.stream_ids.next))
        await self.commit(changes)
        await self.sync_streams([stream.stream_id for stream, _ in created], deadline)
        return results

    async def delete_streams(
        self, stream_ids: Sequence[int], timeout: float
    ) -> list[Outcome[StreamRecord]]:
        """Delete streams with their ranges, then tell the hosting data nodes."""
        deadline = trio.current_time() + timeout
        results: list[Outcome[StreamRecord]] = [
            Outcome(error=RequestTimeoutError("the request's deadline passed"))
        ] * len(stream_ids)
        with trio.move_on_at(deadline):
            async with self._locks.hold_all(stream_ids):
                doomed: dict[int, list[RangeRecord]] = {}
                for index, stream_id in enumerate(stream_ids):
                    stream = self.store.stream(stream_id)
                    if stream is None:
                        results[index] = Outcome(error=_no_stream(stream_id))
                        continue
                    results[index] = Outcome(stream)
                    doomed[stream_id] = self.store.ranges(stream_id)
                await self.commit([DeleteStream(stream_id) for stream_id in doomed])
                self.groups.forget_streams(doomed)  # their positions went in that commit
                await self.members.forget_streams(doomed)
                by_node: dict[int, list[int]] = defaultdict(list)
                for stream_id, ranges in doomed.items():
                    for node_id in sorted({n for rng in ranges for n in rng.nodes}):
                        by_node[node_id].append(stream_id)
                await self._tell(by_node, deadline, deleted=True)
        return results

    async def update_streams(
        self, specs: Sequence[StreamRecord], timeout: float
    ) -> list[Outcome[StreamRecord]]:
        """Change streams' replica_nums (0 keeps it), ack_nums (0 keeps it),
        retention (negative keeps it), retention_bytes (0 keeps it, -1
        removes it) and epoch (which may not go back:
        EPOCH_FENCED). New ranges use the new replica_nums and epoch;
        existing ranges stay where they are."""
        deadline = trio.current_time() + timeout
        results: list[Outcome[StreamRecord]] = [
            Outcome(error=RequestTimeoutError("the request's deadline passed"))
        ] * len(specs)
        with trio.move_on_at(deadline):
            async with self._locks.hold_all(spec.stream_id for spec in specs):
                # Later items of the batch see the earlier ones' changes.
                updated: dict[int, StreamRecord] = {}
                retention_changed: set[int] = set()
                for index, spec in enumerate(specs):
                    try:
                        current = updated.get(spec.stream_id) or self._require_stream(
                            spec.stream_id
                        )
                        new = stream_settings.updated(current, spec, object_store=self.object_store)
                        if stream_settings.compacted(new) and not stream_settings.compacted(
                            current
                        ):
                            await self._check_all_keyed(spec.stream_id, deadline)
                        if new.replica_nums != current.replica_nums:
                            # As CREATE_STREAMS would: a count no live nodes can
                            # hold would make every later seal fail.
                            place(
                                self.registry.loads(),
                                new.replica_nums,
                                min_free_space=self.min_free_space,
                            )
                    except ProtocolError as exc:
                        results[index] = Outcome(error=exc)
                        continue
                    if new.retention_period_ms != current.retention_period_ms:
                        retention_changed.add(spec.stream_id)
                    updated[spec.stream_id] = new
                    results[index] = Outcome(new)
                await self.commit([PutStream(stream) for stream in updated.values()])
                # The hosting data nodes apply retention; a SYNC_RANGES makes
                # them read the stream's new period now rather than on their
                # next pass.
                await self.sync_streams(retention_changed, deadline)
        return results

    async def _check_all_keyed(self, stream_id: int, deadline: float) -> None:
        """Refuse to compact a stream that holds records without keys (SPEC
        §13): every replica of its ranges is asked what it holds; one that
        cannot answer leaves it refused too (compaction keeps one record per
        key, and a record without a key has none to keep it by)."""
        ranges = self.store.ranges(stream_id)
        first = ranges[0].start_offset if ranges else 0
        by_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for rng in ranges:
            for node_id in rng.nodes:
                by_node[node_id].append(rng.key)
        with trio.move_on_at(deadline) as scope:
            for node_id, keys in by_node.items():
                try:
                    holdings = await self._link.range_holdings(node_id, keys)
                except (SBPError, OSError) as error:
                    raise InvalidRequestError(
                        f"stream {stream_id} cannot be compacted now: data node {node_id} "
                        f"does not say whether it holds records without keys ({error})"
                    ) from None
                keyless = max((h.keyless_below for h in holdings.values()), default=0)
                if keyless > first:
                    raise InvalidRequestError(
                        f"stream {stream_id} holds records without keys (below offset "
                        f"{keyless}): a compacted stream keeps each key's latest record, so "
                        "every record needs a key; trim them first"
                    )
        if scope.cancelled_caught:
            raise RequestTimeoutError(f"stream {stream_id}: the data nodes did not answer in time")

    def get_streams(self, stream_ids: Sequence[int]) -> list[Outcome[StreamRecord]]:
        results: list[Outcome[StreamRecord]] = []
        for stream_id in stream_ids:
            stream = self.store.stream(stream_id)
            results.append(
                Outcome(error=_no_stream(stream_id)) if stream is None else Outcome(stream)
            )
        return results

    def list_streams(self, start_after: int, limit: int) -> list[StreamRecord]:
        """One page of every stream in id order (GET_STREAMS with no ids)."""
        if limit <= 0:
            limit = DEFAULT_LIST_LIMIT
        return self.store.streams(start_after=start_after, limit=min(limit, MAX_LIST_LIMIT))

    async def trim_streams(
        self, trims: Sequence[tuple[int, int]], timeout: float
    ) -> list[Outcome[tuple[StreamRecord, RangeRecord]]]:
        """Trim each ``(stream_id, trim_offset)``: ranges wholly below the offset
        go, the first remaining range starts at it. Returns the stream and its
        first range after the trim. A trim into the open range is checked
        against the primary's next offset (OFFSET_OUT_OF_RANGE beyond it)."""
        deadline = trio.current_time() + timeout
        return await self._each(
            deadline, [partial(self._trim_one, sid, offset, deadline) for sid, offset in trims]
        )

    async def _trim_one(
        self, stream_id: int, trim_offset: int, deadline: float
    ) -> tuple[StreamRecord, RangeRecord]:
        if trim_offset < 0:
            raise InvalidRequestError(f"trim offset {trim_offset} is negative")
        async with self._locks.hold(stream_id):
            stream = self._require_stream(stream_id)
            ranges = self.store.ranges(stream_id)
            if not ranges:
                raise RangeNotFoundError(f"stream {stream_id} has no ranges")
            if trim_offset <= ranges[0].start_offset:
                return stream, ranges[0]  # already trimmed that far: nothing to do
            last = ranges[-1]
            if last.is_open and trim_offset > last.start_offset:
                next_offset = await self._link.next_offset(last)
                if trim_offset > next_offset:
                    raise OffsetOutOfRangeError(
                        f"trim offset {trim_offset} is past stream {stream_id}'s "
                        f"next offset {next_offset}"
                    )
            elif not last.is_open and trim_offset > last.end_offset:
                raise OffsetOutOfRangeError(
                    f"trim offset {trim_offset} is past stream {stream_id}'s end {last.end_offset}"
                )
            kept = [r for r in ranges if r.is_open or r.end_offset > trim_offset]
            dropped = ranges[: len(ranges) - len(kept)]
            first = replace(kept[0], start_offset=max(kept[0].start_offset, trim_offset))
            changes: list[Change] = [DeleteRange(r.stream_id, r.range_index) for r in dropped]
            changes.append(PutRange(first))
            await self.commit(changes)
            # Nodes that hosted only dropped ranges hear of the trim too: they free them.
            await self.sync_stream(stream_id, deadline, {n for r in dropped for n in r.nodes})
            return stream, first

    # -- ranges ---------------------------------------------------------------

    async def seal_ranges(
        self, keys: Sequence[tuple[int, int]], timeout: float, *, cause: str = "request"
    ) -> list[Outcome[list[RangeRecord]]]:
        """Seal each ``(stream_id, range_index)`` and create the stream's next
        range; returns the sealed range and the next one. Sealing a range that
        is already sealed returns the current state (an idempotent retry).
        ``cause`` names why, for the seal counts (``seals``)."""
        deadline = trio.current_time() + timeout
        outcomes = await self._each(
            deadline, [partial(self.seal_one, sid, index, deadline) for sid, index in keys]
        )
        self.seals[cause] += sum(o.error is None for o in outcomes)
        return outcomes

    async def _seal_for_compaction(self, stream_id: int, range_index: int) -> None:
        """Seal a compacted stream's open range that has grown to the roll size."""
        await self._seal_rolled(stream_id, range_index, "compaction")

    async def _seal_for_tiering(self, stream_id: int, range_index: int) -> None:
        """Seal a tiered stream's open range that has grown to the roll size."""
        await self._seal_rolled(stream_id, range_index, "tiering")

    async def _seal_rolled(self, stream_id: int, range_index: int, cause: str) -> None:
        outcome = (await self.seal_ranges([(stream_id, range_index)], 30.0, cause=cause))[0]
        if outcome.error is not None:
            raise outcome.error

    async def seal_one(
        self, stream_id: int, range_index: int, deadline: float
    ) -> list[RangeRecord]:
        async with self._locks.hold(stream_id):
            stream = self._require_stream(stream_id)
            rng = self.store.range(stream_id, range_index)
            if rng is None:
                raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
            if not rng.is_open:
                following = self.store.range(stream_id, range_index + 1)
                return [rng] if following is None else [rng, following]
            # Place first: when no node can take the next range, the open one
            # stays open and writable rather than leaving the stream without one.
            # The next range may go on fewer nodes than replica_nums, down to
            # ack_nums (SPEC §7: degraded, under-replicated).
            nodes = self._place(
                stream.replica_nums,
                at_least=effective_acks(stream.replica_nums, stream.ack_nums),
            )
            acks = effective_acks(len(rng.nodes), stream.ack_nums)
            refusals: dict[int, BaseException] = {}
            held = await seal_replicas(self._link, self.registry, rng, acks, refusals)
            try:
                end = seal_end(list(held.values()), len(rng.nodes), acks)
            except NotEnoughReplicasError as error:
                raise seal_refused(error, refusals) from None
            # A trim may have raised the start past what the replicas had seen.
            leaving = full_and_short(self.registry, self.min_free_space, rng, held, end)
            end = max(end, rng.start_offset)
            sealed = replace(
                rng,
                end_offset=end,
                nodes=tuple(n for n in rng.nodes if n not in leaving),
                replicas_wanted=max(rng.replicas_wanted, len(rng.nodes))
                if leaving
                else rng.replicas_wanted,
            )
            following = RangeRecord(
                stream_id,
                range_index + 1,
                end,
                nodes,
                epoch=stream.epoch,
                replicas_wanted=stream.replica_nums if len(nodes) < stream.replica_nums else 0,
            )
            await self.commit([PutRange(sealed), PutRange(following)])
            if len(nodes) < stream.replica_nums:
                log.warning(
                    "stream %d range %d placed on %d of %d replicas (too few live nodes with room)",
                    stream_id,
                    following.range_index,
                    len(nodes),
                    stream.replica_nums,
                )
            await self.sync_stream(stream_id, deadline, also=leaving)
            return [sealed, following]

    def stream_ranges(self, stream_id: int) -> list[RangeRecord]:
        """LIST_RANGES by stream: every range, in order."""
        self._require_stream(stream_id)
        return self.store.ranges(stream_id)

    def node_ranges(self, node_id: int) -> list[RangeRecord]:
        """LIST_RANGES by data node: every range hosted there."""
        if self.registry.get(node_id) is None:
            raise DataNodeNotFoundError(f"no data node {node_id}")
        return self.store.ranges_on_node(node_id)

    def describe_ranges(self, keys: Sequence[tuple[int, int]]) -> list[Outcome[RangeRecord]]:
        """DESCRIBE_RANGES: the PM's metadata of each range."""
        results: list[Outcome[RangeRecord]] = []
        for stream_id, range_index in keys:
            rng = self.store.range(stream_id, range_index)
            if rng is not None:
                results.append(Outcome(rng))
            elif self.store.stream(stream_id) is None:
                results.append(Outcome(error=_no_stream(stream_id)))
            else:
                results.append(
                    Outcome(
                        error=RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
                    )
                )
        return results

    # -- helpers --------------------------------------------------------------

    def _require_stream(self, stream_id: int) -> StreamRecord:
        stream = self.store.stream(stream_id)
        if stream is None:
            raise _no_stream(stream_id)
        return stream

    def _place(self, replica_nums: int, at_least: int | None = None) -> tuple[int, ...]:
        nodes = place(
            self.registry.loads(),
            replica_nums,
            min_free_space=self.min_free_space,
            at_least=at_least,
        )
        self.registry.note_placed(nodes)
        return nodes

    async def commit(self, changes: Sequence[Change]) -> None:
        """Commit ``changes`` atomically (``pm.range_log``: the state derived
        from the ranges follows there)."""
        await self.range_log.commit(changes)

    async def _each(
        self, deadline: float, items: Sequence[Callable[[], Awaitable[T]]]
    ) -> list[Outcome[T]]:
        """Run the items of a batch concurrently, each to its own outcome;
        those not done by the deadline are TIMEOUT."""
        results: list[Outcome[T] | None] = [None] * len(items)

        async def run(index: int, item: Callable[[], Awaitable[T]]) -> None:
            with trio.move_on_at(deadline):
                try:
                    results[index] = Outcome(await item())
                except ProtocolError as exc:
                    results[index] = Outcome(error=exc)

        async with trio.open_nursery() as nursery:
            for index, item in enumerate(items):
                nursery.start_soon(run, index, item)
        timeout = RequestTimeoutError("the request's deadline passed")
        return [Outcome(error=timeout) if r is None else r for r in results]

    async def sync_stream(self, stream_id: int, deadline: float, also: Iterable[int] = ()) -> None:
        await self.sync_streams([stream_id], deadline, also)

    async def sync_streams(
        self, stream_ids: Iterable[int], deadline: float, also: Iterable[int] = ()
    ) -> None:
        """SYNC_RANGES of each stream, with its current ranges, to every live
        node of its ranges and to ``also`` (``pm.node_syncs``): waited for
        until the deadline, and sent after it all the same. A node that does
        not take its call is reconciled."""
        by_node: dict[int, list[int]] = defaultdict(list)
        extra = set(also)
        for stream_id in sorted(set(stream_ids)):
            ranges = self.store.ranges(stream_id)
            for node_id in sorted({n for rng in ranges for n in rng.nodes} | extra):
                by_node[node_id].append(stream_id)
        await self._tell(by_node, deadline, deleted=False)

    async def _tell(self, by_node: dict[int, list[int]], deadline: float, *, deleted: bool) -> None:
        """SYNC_RANGES (or DELETE_STREAMS) of the streams to each live node,
        through its queue (``pm.node_syncs``), waited for until the deadline
        and sent after it all the same. A node that does not take its call
        is reconciled (``_sync_failed``), a dead one once it is back."""
        what = "DELETE_STREAMS" if deleted else "SYNC_RANGES"
        # Shielded: the change is committed, and its request learns it was
        # even when the calls run out of its time.
        with trio.CancelScope(deadline=deadline, shield=True):
            async with trio.open_nursery() as nursery:
                for node_id, ids in by_node.items():
                    if self.registry.is_alive(node_id):
                        nursery.start_soon(self._tell_node, node_id, ids, deleted)
                    else:
                        log.info(
                            "%s of %s to node %d skipped: the node is dead",
                            what,
                            _streams_text(ids),
                            node_id,
                        )

    async def _tell_node(self, node_id: int, stream_ids: Sequence[int], deleted: bool) -> None:
        # a failure was logged and the node is reconciled (_sync_failed)
        with contextlib.suppress(SBPError, OSError):
            if deleted:
                await self._node_syncs.delete(node_id, stream_ids)
            else:
                await self._node_syncs.sync(node_id, stream_ids)

    async def _send_sync(self, node_id: int, stream_ids: Sequence[int]) -> None:
        """SYNC_RANGES of the streams, with their ranges as they are now."""
        streams = [(stream_id, self.store.ranges(stream_id)) for stream_id in stream_ids]
        await self._link.sync_ranges(node_id, streams)

    def _sync_failed(self, node_id: int, stream_ids: Sequence[int], error: Exception) -> None:
        """A live node that did not take a SYNC_RANGES or DELETE_STREAMS (cut
        off from the PM, say, while its heartbeats still come) is reconciled
        as a returning node is: until then it could hold a range open that the
        PM sealed, short of its end, with nobody to tell it."""
        if not self.stopping:
            log.warning(
                "telling node %d of %s failed: %s", node_id, _streams_text(stream_ids), error
            )
        self.reconciler.note_returning(node_id)


def _streams_text(stream_ids: Sequence[int]) -> str:
    if len(stream_ids) == 1:
        return f"stream {stream_ids[0]}"
    return f"{len(stream_ids)} streams ({reconcile.id_list(stream_ids)})"


def _no_stream(stream_id: int) -> StreamNotFoundError:
    return StreamNotFoundError(f"no stream {stream_id}")


def _check_node(node: NodeRecord) -> None:
    host, sep, port = node.address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidRequestError(
            f"data node {node.node_id} advertises {node.address!r}, not host:port"
        )
