"""Which data nodes the PM knows, which are alive, and how loaded they are.

A node registers with its first HEARTBEAT (the caller persists it) and is
alive while its heartbeats keep coming: a node whose last heartbeat is older
than the node timeout is dead and gets no new ranges, and it is alive again as
soon as it heartbeats. REPORT_METRICS counts as a sign of life too.

Nodes restored from the metadata after a PM restart start alive, as if they
had just heartbeated: a data node that is still up heartbeats well within the
timeout, and the PM can place ranges from its first request instead of
refusing everything for one timeout. A node that really is gone turns dead one
timeout later.

All in memory: heartbeat times and load reports are soft state that the data
nodes resend every few seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from .changes import PutRange
from .placement import NodeLoad, has_room
from .range_log import Committed
from .records import NodeRecord

log = logging.getLogger(__name__)

#: a node with less than this many times ``--min-free-space`` free is near full
NEAR_FULL_FACTOR: Final = 2
#: a node that fills up within this long at its write rate is near full
NEAR_FULL_S: Final = 3600.0


@dataclass
class NodeState:
    """One data node as the PM sees it now."""

    node: NodeRecord
    #: clock() time of the last HEARTBEAT or REPORT_METRICS
    last_seen: float
    #: wall-clock ms of that moment (for DESCRIBE_CLUSTER); 0 if never seen since start
    last_heartbeat_ms: int = 0
    #: the latest REPORT_METRICS fields by name (SPEC §3), empty before the first
    metrics: dict[str, int] = field(default_factory=dict)
    placed_since_report: int = 0
    hosted_ranges: int = 0
    primaries: int = 0
    alive: bool = True

    @property
    def node_id(self) -> int:
        return self.node.node_id

    def is_full(self, min_free_space: int) -> bool:
        """Whether its last report left it less free space than ``min_free_space``."""
        return not has_room(self.metrics.get("disk_free_space"), min_free_space)

    def seconds_to_full(self, min_free_space: int) -> float | None:
        """How long until it is full at the write rate of its last report
        (None: not writing, or not reported yet)."""
        free = self.metrics.get("disk_free_space")
        rate = self.metrics.get("disk_in_rate", 0)
        if free is None or rate <= 0:
            return None
        return max(free - min_free_space, 0) / rate

    def is_near_full(self, min_free_space: int) -> bool:
        """Not full yet, but within ``NEAR_FULL_FACTOR`` times the floor, or
        full within ``NEAR_FULL_S`` at its current write rate."""
        free = self.metrics.get("disk_free_space")
        if free is None or self.is_full(min_free_space):
            return False
        left = self.seconds_to_full(min_free_space)
        return free < NEAR_FULL_FACTOR * min_free_space or (left is not None and left < NEAR_FULL_S)

    def load(self) -> NodeLoad:
        free = self.metrics.get("disk_free_space")
        return NodeLoad(
            node_id=self.node.node_id,
            active_ranges=max(self.metrics.get("range_active_cnt", 0), 0)
            + self.placed_since_report,
            append_rate=max(self.metrics.get("network_append_rate", 0), 0),
            write_rate=max(self.metrics.get("disk_in_rate", 0), 0),
            disk_free_space=free,
            hosted_ranges=self.hosted_ranges,
            primaries=self.primaries,
        )


class NodeRegistry:
    """Data nodes by id, their liveness and their load."""

    def __init__(
        self,
        node_timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.node_timeout = node_timeout
        self._clock = clock
        self._wall_ms = wall_ms
        self._nodes: dict[int, NodeState] = {}
        #: nodes being drained (SPEC §12): never candidates for placement
        self.draining: set[int] = set()

    def restore(
        self, nodes: Iterable[NodeRecord], hosted: Mapping[int, int], draining: Iterable[int] = ()
    ) -> None:
        """Load the persisted nodes at start-up (alive, see the module docstring)."""
        self.draining = set(draining)
        now = self._clock()
        for node in nodes:
            self._nodes[node.node_id] = NodeState(
                node, last_seen=now, hosted_ranges=hosted.get(node.node_id, 0)
            )

    def heartbeat(self, node: NodeRecord) -> bool:
        """Refresh (or register) a node; True when its record is new or changed
        and must be persisted before the heartbeat is answered."""
        state = self._nodes.get(node.node_id)
        now = self._clock()
        if state is None:
            self._nodes[node.node_id] = NodeState(
                node, last_seen=now, last_heartbeat_ms=self._wall_ms()
            )
            return True
        changed = state.node != node
        state.node = node
        state.last_seen = now
        state.last_heartbeat_ms = self._wall_ms()
        return changed

    def is_returning(self, node_id: int) -> bool:
        """Whether a heartbeat from ``node_id`` now would bring back a node
        this PM knows: one not heard from since the PM started, or silent past
        the node timeout (whether or not a sweep has marked it dead yet). A
        node id never seen before is not returning: it holds nothing of this
        cluster."""
        state = self._nodes.get(node_id)
        return state is not None and (
            state.last_heartbeat_ms == 0 or self._clock() - state.last_seen > self.node_timeout
        )

    def report(self, node: NodeRecord, metrics: Mapping[str, int]) -> bool:
        """Record a load report; like ``heartbeat``, True when the node must be persisted."""
        changed = self.heartbeat(node)
        state = self._nodes[node.node_id]
        state.metrics = dict(metrics)
        state.placed_since_report = 0
        return changed

    def sweep(self) -> list[NodeState]:
        """Bring each node's liveness up to date, logging the changes; returns
        the nodes whose liveness changed."""
        now = self._clock()
        flipped = []
        # A copy: /metrics reads the states from its own thread while the
        # event loop may be registering a node.
        for state in list(self._nodes.values()):
            alive = now - state.last_seen <= self.node_timeout
            if alive != state.alive:
                state.alive = alive
                flipped.append(state)
                if alive:
                    log.info("data node %d at %s is alive again", state.node_id, state.node.address)
                else:
                    log.warning(
                        "data node %d at %s is dead: no heartbeat for %.1f s",
                        state.node_id,
                        state.node.address,
                        now - state.last_seen,
                    )
        return flipped

    def is_alive(self, node_id: int) -> bool:
        state = self._nodes.get(node_id)
        return state is not None and self._clock() - state.last_seen <= self.node_timeout

    def get(self, node_id: int) -> NodeState | None:
        return self._nodes.get(node_id)

    def address(self, node_id: int) -> str:
        """The node's advertise address, or "" for a node unknown here."""
        state = self._nodes.get(node_id)
        return "" if state is None else state.node.address

    def states(self) -> list[NodeState]:
        """Every known node, liveness brought up to date, by node id."""
        self.sweep()
        return sorted(self._nodes.copy().values(), key=lambda state: state.node_id)

    def seconds_since_seen(self, state: NodeState) -> float:
        return max(self._clock() - state.last_seen, 0.0)

    def live_ids(self) -> list[int]:
        """The live nodes' ids, in order."""
        return [state.node_id for state in self.states() if state.alive]

    def loads(self) -> list[NodeLoad]:
        """The loads of the live active nodes: the candidates for placement."""
        return [s.load() for s in self.states() if s.alive and s.node_id not in self.draining]

    def forget(self, node_id: int) -> None:
        """A node removed (``sbp nodes remove``)."""
        self._nodes.pop(node_id, None)
        self.draining.discard(node_id)

    def note_placed(self, nodes: tuple[int, ...]) -> None:
        """Count a placement decision (primary first) toward the nodes' load
        until their next report, so that a burst of placements spreads."""
        for position, node_id in enumerate(nodes):
            state = self._nodes.get(node_id)
            if state is None:
                continue
            state.placed_since_report += 1
            if position == 0:
                state.primaries += 1

    def committed(self, done: Committed) -> None:
        """Each node's range count follows a commit (``pm.range_log``)."""
        for nodes in done.replaced.values():
            self.note_removed(nodes)
        for change in done.changes:
            if isinstance(change, PutRange):
                self.note_hosted(change.range.nodes)

    def note_hosted(self, nodes: Iterable[int]) -> None:
        """Count a range committed on ``nodes``."""
        for node_id in nodes:
            state = self._nodes.get(node_id)
            if state is not None:
                state.hosted_ranges += 1

    def note_removed(self, nodes: Iterable[int]) -> None:
        """Count a range removed (trimmed or deleted) from ``nodes``."""
        for node_id in nodes:
            state = self._nodes.get(node_id)
            if state is not None and state.hosted_ranges > 0:
                state.hosted_ranges -= 1
