"""The placement manager's request logic, over plain records (SPEC §5, PM).

``PlacementManager`` owns the metadata store, the node registry and the link
to the data nodes, and implements each PM request as a method taking and
returning records; ``pm.handlers`` translates to and from the wire and
authorizes each item before it gets here.

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

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from functools import partial
from typing import Final

import trio

from sbp.enums import DataNodeState
from sbp.errors import (
    DataNodeNotFoundError,
    ProtocolError,
    RangeNotFoundError,
    RequestTimeoutError,
)
from tiering.store import ObjectStore

from . import stream_settings
from .changes import (
    Change,
    DeleteStream,
    Metadata,
    MetadataCounts,
    PutRange,
    PutStream,
    RaiseNextStreamId,
    no_stream,
    require_stream,
)
from .compaction import DEFAULT_COMPACTION, CompactionSettings, Compactor
from .datanode_link import DataNodeCalls
from .drain import NodeDrains
from .groups import ConsumerGroups, RecordTimes, StreamEnds
from .liveness import NodeRegistry, NodeState
from .locks import StreamLocks
from .members import GroupMembers
from .move_budget import MoveBudget
from .moves import ReplicaMoves
from .node_admin import DataNodeAdmin
from .node_telling import NodeTelling
from .placement import place
from .producers import ProducerIds
from .range_log import RangeLog
from .range_sizes import RangeSizes
from .rebalance import DEFAULT_INTERVAL_S as REBALANCE_INTERVAL_S
from .rebalance import DEFAULT_THRESHOLD as REBALANCE_THRESHOLD
from .rebalance import PlannedMove, Rebalancer
from .reconciler import RECONCILE_INTERVAL_S, NodeReconciler
from .records import NodeRecord, Outcome, RangeRecord, StreamRecord
from .sealing import RangeSealer
from .size_retention import DEFAULT_INTERVAL_S as SIZE_RETENTION_INTERVAL_S
from .size_retention import SizeRetention
from .stream_ids import StreamIds
from .stream_updates import StreamUpdates
from .tiering import DEFAULT_INTERVAL_S as TIERING_INTERVAL_S
from .tiering import DEFAULT_ROLL_BYTES as TIERING_ROLL_BYTES
from .tiering import DEFAULT_SWEEP_INTERVAL_S as TIERING_SWEEP_INTERVAL_S
from .tiering import Tiering
from .trims import trim_streams
from .upkeep import ReplicaUpkeep

log = logging.getLogger(__name__)
#: GET_STREAMS listing: page size when the request gives no limit, and the cap
#: (10,000 results stay far below the 16 MiB frame limit)
DEFAULT_LIST_LIMIT: Final = 1000
MAX_LIST_LIMIT: Final = 10_000


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
        #: SYNC_RANGES and DELETE_STREAMS to the data nodes, one ordered queue per node
        self.telling = NodeTelling(
            store, registry, link, lambda node_id: self.reconciler.note_returning(node_id)
        )
        self.stream_ids = StreamIds(store.next_stream_id())
        registry.restore(store.nodes(), store.range_counts_by_node(), store.draining_nodes())
        #: nodes brought back in step with the metadata
        self.reconciler = NodeReconciler(
            store,
            registry,
            link,
            self.telling.queues,
            self._locks,
            self.commit,
            self.stream_ids,
            interval=reconcile_interval,
            stopping=lambda: self.telling.stopping,
        )
        #: seals of ranges, asked for and the PM's own
        self.sealer = RangeSealer(
            store,
            registry,
            link,
            self.hold,
            self.commit,
            self._place,
            self.sync_streams,
            min_free_space,
        )
        #: the bytes of ranges, as replicas hold them
        self.range_sizes = RangeSizes(registry, link)
        #: every move of a sealed range's replicas, whatever its cause; how
        #: fast copies start for drains and rebalancing (``--max-move-bytes-per-s``)
        self.moves = ReplicaMoves(
            store,
            registry,
            link,
            self.range_sizes,
            MoveBudget(max_move_bytes_per_s),
            self.hold_all,
            self.commit,
            self.sync_streams,
            min_free_space=min_free_space,
        )
        #: the replicas' upkeep: dead primaries, repairs, full nodes, short-handed ranges
        self.upkeep = ReplicaUpkeep(
            self, self.moves, min_free_space=min_free_space, repair_after=repair_after
        )
        #: streams' size limits (SPEC §12)
        self.size_retention = SizeRetention(self, self.range_sizes, size_retention_interval)
        #: every change of ranges and streams, and what follows each
        self.range_log = RangeLog(store)
        self.range_log.observe(registry, self.upkeep, self.size_retention)
        #: nodes being drained (SPEC §12)
        self.drains = NodeDrains(
            store, registry, link, self.moves, self.seal_ranges, lambda: self.stopping
        )
        #: sealed ranges moved to even out the nodes (SPEC §12)
        self.rebalancer = Rebalancer(
            store,
            registry,
            self.range_sizes,
            self.moves,
            threshold=rebalance_threshold,
            interval=rebalance_interval,
            min_free_space=min_free_space,
        )
        #: streams' settings changed
        self.stream_updates = StreamUpdates(
            store,
            registry,
            link,
            self.hold_all,
            self.commit,
            self.sync_streams,
            object_store=self.object_store,
            min_free_space=min_free_space,
        )
        #: the data nodes' heartbeats, drains and removals
        self.nodes = DataNodeAdmin(
            store,
            registry,
            link,
            self.commit,
            self.sync_streams,
            self.reconciler.note_returning,
            self.drains.state,
        )
        #: compacted streams' passes (SPEC §13)
        self.compactor = Compactor(
            store,
            link,
            registry,
            partial(self.sealer.seal_rolled, cause="compaction"),
            settings=compaction,
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
                partial(self.sealer.seal_rolled, cause="tiering"),
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
        self.telling.stop()

    @property
    def stopping(self) -> bool:
        """Whether shutdown has ended the calls to data nodes (``stop_outgoing``)."""
        return self.telling.stopping

    @property
    def seals(self) -> Counter[str]:
        """Ranges sealed, by cause (metrics)."""
        return self.sealer.seals

    async def heartbeat(self, node: NodeRecord) -> None:
        await self.nodes.heartbeat(node)

    async def report_metrics(self, node: NodeRecord, metrics: dict[str, int]) -> None:
        await self.nodes.report_metrics(node, metrics)

    async def drain_nodes(
        self, node_ids: Sequence[int], *, cancel: bool = False
    ) -> list[Outcome[DataNodeState]]:
        return await self.nodes.drain_nodes(node_ids, cancel=cancel)

    async def remove_nodes(self, node_ids: Sequence[int]) -> list[ProtocolError | None]:
        return await self.nodes.remove_nodes(node_ids)

    def cluster(self) -> list[NodeState]:
        """Every known data node with its liveness and latest report."""
        return self.registry.states()

    async def move_ranges(self, timeout: float) -> None:
        """One step of every move under way, then the drains' and the
        rebalancer's plans (the upkeep's pass)."""
        with trio.move_on_after(timeout):
            try:
                await self.moves.advance(trio.current_time() + timeout)
            except (ProtocolError, OSError) as error:
                log.warning("moving replicas: %s", error)
        if not self.stopping:
            await self.drains.run_pass(timeout)
        if not self.stopping:
            await self.rebalancer.run_pass(timeout)

    async def rebalance(self, *, dry_run: bool) -> tuple[list[PlannedMove], int]:
        """A plan that evens out the nodes, started unless ``dry_run``, and
        the moves already under way (a new plan waits for them: none is made)."""
        pending = self.rebalancer.pending()
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
                        results[index] = Outcome(error=no_stream(stream_id))
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
                await self.telling.delete_streams(by_node, deadline)
        return results

    async def update_streams(
        self, specs: Sequence[StreamRecord], timeout: float
    ) -> list[Outcome[StreamRecord]]:
        """UPDATE_STREAMS (``pm.stream_updates``)."""
        return await self.stream_updates.update(specs, timeout)

    def get_streams(self, stream_ids: Sequence[int]) -> list[Outcome[StreamRecord]]:
        results: list[Outcome[StreamRecord]] = []
        for stream_id in stream_ids:
            stream = self.store.stream(stream_id)
            results.append(
                Outcome(error=no_stream(stream_id)) if stream is None else Outcome(stream)
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
        """TRIM_STREAMS (``pm.trims``)."""
        return await trim_streams(
            self.store, self._link, self.hold, self.commit, self.sync_stream, trims, timeout
        )

    # -- ranges ---------------------------------------------------------------

    async def seal_ranges(
        self, keys: Sequence[tuple[int, int]], timeout: float, *, cause: str = "request"
    ) -> list[Outcome[list[RangeRecord]]]:
        """SEAL_RANGES (``pm.sealing.RangeSealer``)."""
        return await self.sealer.seal_ranges(keys, timeout, cause=cause)

    async def seal_one(
        self, stream_id: int, range_index: int, deadline: float
    ) -> list[RangeRecord]:
        return await self.sealer.seal_one(stream_id, range_index, deadline)

    def stream_ranges(self, stream_id: int) -> list[RangeRecord]:
        """LIST_RANGES by stream: every range, in order."""
        require_stream(self.store, stream_id)
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
                results.append(Outcome(error=no_stream(stream_id)))
            else:
                results.append(
                    Outcome(
                        error=RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
                    )
                )
        return results

    # -- helpers --------------------------------------------------------------

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

    async def sync_stream(self, stream_id: int, deadline: float, also: Iterable[int] = ()) -> None:
        await self.telling.sync_streams([stream_id], deadline, also)

    async def sync_streams(
        self, stream_ids: Iterable[int], deadline: float, also: Iterable[int] = ()
    ) -> None:
        """SYNC_RANGES of each stream to its nodes and ``also`` (``pm.node_telling``)."""
        await self.telling.sync_streams(stream_ids, deadline, also)
