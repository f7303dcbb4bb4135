"""The data nodes as members of the cluster: their HEARTBEAT and
REPORT_METRICS (registered, persisted, checked to answer at the address
they advertise), drains started and cancelled (SPEC §12) and nodes removed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import trio

from sbp.enums import DataNodeState
from sbp.errors import DataNodeNotFoundError, InvalidRequestError, ProtocolError

from .changes import Change, DeleteNode, Metadata, PutNode, SetDraining
from .datanode_link import DataNodeCalls
from .liveness import NodeRegistry
from .records import NodeRecord, Outcome

log = logging.getLogger(__name__)


class DataNodeAdmin:
    """See the module docstring. ``sync_streams(ids, deadline)`` tells nodes
    of streams; ``note_returning(node_id)`` has a node reconciled;
    ``drain_state(node_id)`` is where its drain is."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: DataNodeCalls,
        commit: Callable[[Sequence[Change]], Awaitable[None]],
        sync_streams: Callable[[Iterable[int], float], Awaitable[None]],
        note_returning: Callable[[int], None],
        drain_state: Callable[[int], DataNodeState],
    ) -> None:
        self._store = store
        self._registry = registry
        self._link = link
        self._commit = commit
        self._sync_streams = sync_streams
        self._note_returning = note_returning
        self._drain_state = drain_state

    async def heartbeat(self, node: NodeRecord) -> None:
        """A data node's HEARTBEAT: register or refresh it (persisted when new)."""
        _check_node(node)
        await self._verify_if_new(node)
        self._note_if_returning(node.node_id)
        moved_from = self._registry.address(node.node_id)
        if self._registry.heartbeat(node):
            await self._registered(node, moved_from)

    async def report_metrics(self, node: NodeRecord, metrics: dict[str, int]) -> None:
        """A data node's REPORT_METRICS: its latest load, and a sign of life."""
        _check_node(node)
        await self._verify_if_new(node)
        self._note_if_returning(node.node_id)
        moved_from = self._registry.address(node.node_id)
        if self._registry.report(node, metrics):
            await self._registered(node, moved_from)

    async def _registered(self, node: NodeRecord, moved_from: str) -> None:
        """Persist a node that is new or advertises another address. A node
        that moved (restarted on another port) is what every replica of its
        ranges must reach from now on: its streams go to all of them at once
        (SYNC_RANGES carries each replica's address), so that primaries
        replicate to its new address and followers learn where it leads."""
        await self._commit([PutNode(node)])
        if not moved_from or moved_from == node.address:
            log.info("data node %d registered at %s", node.node_id, node.address)
            return
        log.info("data node %d moved from %s to %s", node.node_id, moved_from, node.address)
        streams = {rng.stream_id for rng in self._store.ranges_on_node(node.node_id)}
        if streams:
            # queued at once, answered in the background: the heartbeat waits for none of it
            await self._sync_streams(streams, trio.current_time())

    async def _verify_if_new(self, node: NodeRecord) -> None:
        """Before a node id is registered, or moves to another address, the
        address must answer PING: anyone may send a HEARTBEAT with role
        DATA_NODE, and a made-up address would otherwise get ranges."""
        known = self._registry.get(node.node_id)
        if known is not None and known.node.address == node.address:
            return
        if not await self._link.reachable(node.address):
            raise InvalidRequestError(
                f"data node {node.node_id} advertises {node.address}, which does not answer PING"
            )

    def _note_if_returning(self, node_id: int) -> None:
        if self._registry.is_returning(node_id):
            self._note_returning(node_id)

    async def drain_nodes(
        self, node_ids: Sequence[int], *, cancel: bool = False
    ) -> list[Outcome[DataNodeState]]:
        """DRAIN_DATA_NODES (SPEC §12): mark the nodes draining (or, with
        ``cancel``, active again) in one commit; the upkeep moves their
        ranges (``pm.drain``). Idempotent. Each node's state after it."""
        known = {state.node_id for state in self._registry.states()}
        changes: list[SetDraining] = [
            SetDraining(node_id, not cancel)
            for node_id in dict.fromkeys(node_ids)
            if node_id in known and (node_id in self._registry.draining) == cancel
        ]
        await self._commit(changes)
        for change in changes:
            if change.draining:
                self._registry.draining.add(change.node_id)
                log.warning("data node %d is draining", change.node_id)
            else:
                self._registry.draining.discard(change.node_id)
                log.warning("data node %d: drain cancelled, it is active", change.node_id)
        return [
            Outcome(value=self._drain_state(node_id))
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
            state = self._registry.get(node_id)
            held = len(self._store.ranges_on_node(node_id))
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
        await self._commit([DeleteNode(node_id) for node_id in doomed])
        for node_id in doomed:
            self._registry.forget(node_id)
            log.warning("data node %d removed", node_id)
        return refusals


def _check_node(node: NodeRecord) -> None:
    host, sep, port = node.address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidRequestError(
            f"data node {node.node_id} advertises {node.address!r}, not host:port"
        )
