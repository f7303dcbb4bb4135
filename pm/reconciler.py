"""Bringing a data node back in step with the metadata (``pm.reconcile``
finds what it missed; this sends it): each node as it comes back, or when
it did not take a call, and every live node every ``interval`` anyway.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Protocol

import trio

from sbp.errors import SBPError

from . import reconcile
from .changes import Change, MarkForeignStream, Metadata, RaiseNextStreamId
from .liveness import NodeRegistry
from .locks import StreamLocks
from .node_syncs import NodeSyncs
from .reconcile import ReconcilePlan
from .records import RangeRecord
from .stream_ids import StreamIds

log = logging.getLogger(__name__)

#: how long reconciling a returning data node may take, and the wait before
#: trying again after a failure (doubling per failure in a row, up to the max)
RECONCILE_TIMEOUT_S: Final = 60.0
RECONCILE_RETRY_S: Final = 10.0
RECONCILE_RETRY_MAX_S: Final = 600.0
#: every live node is also compared with the metadata this often: what put a
#: node out of step unnoticed is set right within this long
RECONCILE_INTERVAL_S: Final = 60.0


class HostedRanges(Protocol):
    async def hosted_ranges(self, node_id: int) -> list[RangeRecord]:
        """LIST_RANGES by data node, asked of the node itself."""
        ...


class NodeReconciler:
    """See the module docstring."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: HostedRanges,
        syncs: NodeSyncs,
        locks: StreamLocks,
        commit: Callable[[Sequence[Change]], Awaitable[None]],
        stream_ids: StreamIds,
        *,
        interval: float,
        stopping: Callable[[], bool],
    ) -> None:
        self._store = store
        self._registry = registry
        self._link = link
        self._syncs = syncs
        self._locks = locks
        self._commit = commit
        self._stream_ids = stream_ids
        #: how often every live node is reconciled anyway (0: never)
        self._interval = interval
        self._stopping = stopping
        # Nodes back from the dead (or first heard of since start-up) whose
        # data may predate changes they were not told of; see reconcile_node.
        self._returning, self._returned = trio.open_memory_channel[int](math.inf)
        self._reconciling: set[int] = set()
        #: streams sent to a node by a reconcile, by cause (metrics)
        self.reconciled: Counter[str] = Counter()
        #: by node: the streams it holds that this PM never created, as last logged
        self._foreign_told: dict[int, list[int]] = {}

    def note_returning(self, node_id: int) -> None:
        """Reconcile this node soon (``run``)."""
        self._returning.send_nowait(node_id)

    async def run(self, timeout: float = RECONCILE_TIMEOUT_S) -> None:
        """Run forever: reconcile each data node as it comes back (see
        ``reconcile_node``), several nodes at once, and every live node
        every ``reconcile_interval``."""
        async with trio.open_nursery() as nursery:
            if self._interval > 0:
                nursery.start_soon(self._reconcile_live_nodes, timeout)
            async for node_id in self._returned:
                if node_id not in self._reconciling:
                    self._reconciling.add(node_id)
                    nursery.start_soon(self._reconcile_until_done, node_id, timeout)

    async def _reconcile_live_nodes(self, timeout: float) -> None:
        """Every ``reconcile_interval``, send each live node the streams whose
        ranges it sees otherwise than the metadata. A node's view can go out
        of step without a failure the PM sees (a view applied out of order,
        say); left alone, the PM would count on a replica that holds nothing
        until the stream's ranges next change. Nothing is deleted here: only
        a node that was away or missed a call is sent DELETE_STREAMS. A node
        that does not answer is tried at the next interval."""
        while True:
            await trio.sleep(self._interval)
            for state in self._registry.states():
                if self._stopping():
                    return
                if not state.alive or state.node_id in self._reconciling:
                    continue
                with trio.move_on_after(timeout):
                    try:
                        await self.reconcile_node(state.node_id, periodic=True)
                    except (SBPError, OSError) as exc:
                        log.info("comparing data node %d with the metadata: %s", state.node_id, exc)

    async def _reconcile_until_done(self, node_id: int, timeout: float) -> None:
        """Reconcile, trying again after a failure with a delay that doubles
        each time (``RECONCILE_RETRY_S`` up to ``RECONCILE_RETRY_MAX_S``) while
        the node stays alive; a node that died is reconciled when it is back."""
        delay = RECONCILE_RETRY_S
        try:
            while True:
                try:
                    with trio.fail_after(timeout):
                        await self.reconcile_node(node_id)
                    return
                except (SBPError, OSError, trio.TooSlowError) as exc:
                    log.warning(
                        "reconciling data node %d failed (%s); trying again in %.0f s",
                        node_id,
                        exc or type(exc).__name__,
                        delay,
                    )
                await trio.sleep(delay)
                if not self._registry.is_alive(node_id):
                    return
                delay = min(delay * 2, RECONCILE_RETRY_MAX_S)
        finally:
            self._reconciling.discard(node_id)

    async def reconcile_node(self, node_id: int, *, periodic: bool = False) -> ReconcilePlan:
        """Tell a data node what it missed while away (``pm.reconcile``):
        DELETE_STREAMS for streams deleted since (not in the ``periodic``
        comparison of a live node), SYNC_RANGES (the PM's whole list, under
        the stream's lock so it cannot overtake a newer change) for streams
        trimmed, sealed or created since. Returns what was done."""
        hosted = await self._link.hosted_ranges(node_id)
        known_foreign = self._store.foreign_streams()
        todo = reconcile.plan(
            hosted,
            self._store.ranges_on_node(node_id),
            lambda stream_id: self._store.stream(stream_id) is not None,
            self._stream_ids.next,
            known_foreign,
        )
        if periodic:
            todo.delete = []
        if todo.foreign:
            # A new stream with a held id would be handed the old records: the
            # next id moves past them, and they are recorded as foreign so
            # that no later reconcile takes them for deleted ones.
            changes: list[Change] = [
                MarkForeignStream(sid) for sid in todo.foreign if sid not in known_foreign
            ]
            if self._stream_ids.move_past(max(todo.foreign)):
                changes.append(RaiseNextStreamId(self._stream_ids.next))
            if changes:
                await self._commit(changes)
        if todo.foreign and self._foreign_told.get(node_id) != todo.foreign:
            # said once per node and set of streams: every live node is
            # reconciled every reconcile_interval
            self._foreign_told[node_id] = todo.foreign
            log.warning(
                "data node %d holds streams this PM never created (%s): a PM with other "
                "metadata placed them (another cluster's, or one PM's LMDB metadata where PMs "
                "on etcd now run: `sbp-pm migrate` moves it). Left alone, and no new stream "
                "takes their ids",
                node_id,
                reconcile.id_list(todo.foreign),
            )
        if todo.delete:
            await self._syncs.delete(node_id, todo.delete)
        for stream_id in todo.sync:
            async with self._locks.hold(stream_id):
                await self._syncs.sync(node_id, [stream_id])
            self.reconciled["periodic" if periodic else "returning"] += 1
        if not todo.empty:
            log.info(
                "data node %d was behind: deleted streams %s, synced streams %s",
                node_id,
                reconcile.id_list(todo.delete) or "none",
                reconcile.id_list(todo.sync) or "none",
            )
        return todo
