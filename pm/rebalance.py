"""Rebalancing (SPEC §12): the PM evens out the bytes and the range counts
of the live active data nodes by moving sealed ranges, the way a drain
moves them.

**Plan.** While the live active nodes' bytes (as the ranges' replicas hold
them, ``RangeSizes``) differ by more than ``threshold`` of their mean, or
their range counts by more than that share (and more than one), the PM
picks the move of one sealed range, to a node with room that lacks it,
that lowers the spread the most (looked for between the three most and the
three least loaded nodes, among the ranges nearest in size to what would
even each pair out): the sum over the nodes of the squared
distances of their bytes and (weighing less) counts from the means, as
shares of the means. It stops when no move lowers it, or at ``MAX_PLANNED_MOVES``.

**Moves.** A plan is recorded whole (moves of cause REBALANCE), so a PM
that restarts or takes over goes on with it; ``pm.moves.ReplicaMoves``
carries each out as it does every move: the new node joins the range's
replicas (no faster than the ``MoveBudget``) and copies it (§7 catch-up);
once it holds all of it, the old node leaves, in the commit that ends the
move, and deletes the range's chunks (storage ``drop_span``). A move whose
range changed meanwhile (sealed elsewhere, repaired, drained) is dropped.

The PM plans on its own every ``interval`` when no move is left, or when
asked (``sbp cluster rebalance``, which can print the plan only).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import trio

from client.format import size_text
from net.ratelog import RateLimitedLog
from sbp.errors import ProtocolError

from .changes import Metadata
from .liveness import NodeRegistry
from .moves import ReplicaMoves
from .placement import has_room
from .range_sizes import RangeSizes
from .records import MoveCause, MoveRecord, RangeRecord

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log, interval=60.0)

#: moves in one plan at most
MAX_PLANNED_MOVES: Final = 100
DEFAULT_THRESHOLD: Final = 0.2
#: how much range counts weigh against bytes: open ranges count but cannot
#: move, so counts alone must not hold back a move that evens out the disks
COUNT_WEIGHT: Final = 0.25
#: the most and the least loaded nodes a move is looked for between
PAIRS_LOOKED_AT: Final = 3
#: ranges looked at on each side of the size that would even a pair out
SIZES_LOOKED_AT: Final = 8
DEFAULT_INTERVAL_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class PlannedMove:
    move: MoveRecord
    size: int


@dataclass
class _Node:
    node_id: int
    ranges: dict[tuple[int, int], RangeRecord]
    used: int
    has_room: bool
    #: its sealed ranges as (size, key), by size: the ones that may move
    movable: list[tuple[int, tuple[int, int]]] = field(default_factory=list)

    def give(self, rng: RangeRecord, size: int, to: _Node) -> None:
        del self.ranges[rng.key]
        self.movable.remove((size, rng.key))
        self.used -= size
        to.ranges[rng.key] = rng
        bisect.insort(to.movable, (size, rng.key))
        to.used += size


class Rebalancer:
    """See the module docstring."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        sizes: RangeSizes,
        moves: ReplicaMoves,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        interval: float = DEFAULT_INTERVAL_S,
        min_free_space: int = 0,
    ) -> None:
        self._store = store
        self._registry = registry
        self._sizes = sizes
        self._moves = moves
        self.threshold = threshold
        self._interval = interval
        self._min_free_space = min_free_space
        self._next_plan = trio.current_time() + interval

    @property
    def moved(self) -> int:
        """Moves finished since start-up (metrics)."""
        return self._moves.finished[MoveCause.REBALANCE]

    def pending(self) -> int:
        """The moves of the last plan not done yet."""
        return len(self._moves.in_flight(MoveCause.REBALANCE))

    async def run_pass(self, timeout: float) -> None:
        """Plan new moves when none is left and it is time (the moves
        themselves advance with every other, ``ReplicaMoves.advance``)."""
        deadline = trio.current_time() + timeout
        with trio.move_on_at(deadline):
            try:
                if self._interval > 0 and trio.current_time() >= self._next_plan:
                    self._next_plan = trio.current_time() + self._interval
                    if not self.pending():
                        await self.start(await self.plan())
            except (ProtocolError, OSError) as error:
                _failures.warning("rebalance", "rebalancing: %s", error)

    # -- planning -------------------------------------------------------------------

    async def plan(self) -> list[PlannedMove]:
        """The moves that bring the live active nodes within the threshold."""
        nodes = [
            _Node(load.node_id, {}, 0, has_room(load.disk_free_space, self._min_free_space))
            for load in self._registry.loads()
        ]
        if len(nodes) < 2:
            return []
        everything: dict[tuple[int, int], RangeRecord] = {}
        for node in nodes:
            for rng in self._store.ranges_on_node(node.node_id):
                node.ranges[rng.key] = rng
                everything[rng.key] = rng
        sizes = await self._sizes.sizes(list(everything.values()))
        for node in nodes:
            node.used = sum(sizes.get(key, 0) for key in node.ranges)
            node.movable = sorted(
                (sizes.get(key, 0), key) for key, rng in node.ranges.items() if not rng.is_open
            )
        planned: list[PlannedMove] = []
        while len(planned) < MAX_PLANNED_MOVES and not self._balanced(nodes):
            step = self._best_move(nodes)
            if step is None:
                break
            source, target, rng, size = step
            source.give(rng, size, target)
            move = MoveRecord(*rng.key, source.node_id, (target.node_id,), MoveCause.REBALANCE)
            planned.append(PlannedMove(move, size))
            await trio.sleep(0)  # a large plan does not hold the event loop
        return planned

    def _balanced(self, nodes: Sequence[_Node]) -> bool:
        used = [n.used for n in nodes]
        counts = [len(n.ranges) for n in nodes]
        mean_used = sum(used) / len(used)
        mean_count = sum(counts) / len(counts)
        return (max(used) - min(used) <= self.threshold * mean_used) and (
            max(counts) - min(counts) <= max(1.0, self.threshold * mean_count)
        )

    def _best_move(self, nodes: Sequence[_Node]) -> tuple[_Node, _Node, RangeRecord, int] | None:
        """The move that lowers the spread the most: the sum over the nodes
        of the squared distance of their bytes from the mean, and of their
        range counts (weighed ``COUNT_WEIGHT``), as shares of the means
        (which moves do not change). Looked for between the most and the
        least loaded nodes (``PAIRS_LOOKED_AT`` of each), among the ranges
        whose size is nearest the one that would even the two out."""
        mean_used = sum(n.used for n in nodes) / len(nodes) or 1.0
        mean_count = sum(len(n.ranges) for n in nodes) / len(nodes) or 1.0

        def cost(used: float, count: int) -> float:
            return (used / mean_used - 1) ** 2 + COUNT_WEIGHT * (count / mean_count - 1) ** 2

        order = sorted(
            nodes, key=lambda n: cost(n.used, len(n.ranges)) * (1 if n.used >= mean_used else -1)
        )
        sources = order[-PAIRS_LOOKED_AT:]
        targets = [n for n in order[:PAIRS_LOOKED_AT] if n.has_room]
        best: tuple[float, _Node, _Node, RangeRecord, int] | None = None
        for source in sources:
            here = cost(source.used, len(source.ranges))
            for target in targets:
                if target is source:
                    continue
                there = cost(target.used, len(target.ranges))
                ideal = (source.used - target.used) // 2
                middle = bisect.bisect_left(source.movable, (ideal, (-1, -1)))
                nearby = source.movable[max(0, middle - SIZES_LOOKED_AT) : middle + SIZES_LOOKED_AT]
                for size, key in nearby:
                    rng = source.ranges[key]
                    if key in target.ranges or target.node_id in rng.nodes:
                        continue
                    gain = (
                        cost(source.used - size, len(source.ranges) - 1)
                        - here
                        + cost(target.used + size, len(target.ranges) + 1)
                        - there
                    )
                    if gain < -1e-9 and (best is None or gain < best[0]):
                        best = (gain, source, target, rng, size)
        return None if best is None else best[1:]

    async def start(self, plan: Sequence[PlannedMove]) -> None:
        """Record the planned moves (one commit); the passes carry them out."""
        if not plan:
            return
        await self._moves.record([planned.move for planned in plan])
        log.warning(
            "rebalancing: %d range(s), %s, to move (%s)",
            len(plan),
            size_text(sum(p.size for p in plan)),
            ", ".join(
                f"{p.move.stream_id}/{p.move.range_index} {p.move.from_node}->{p.move.to_node}"
                for p in plan[:10]
            )
            + (" …" if len(plan) > 10 else ""),
        )
