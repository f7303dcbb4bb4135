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

**Moves.** Each planned move is metadata (``PutMove``), so a PM that
restarts or takes over goes on with it. Every pass of the upkeep, a move
whose new node is not a replica yet gets it (no faster than the
``MoveBudget``); the new replica copies the range (§7 catch-up); once it
holds all of it, the old node leaves the range's replicas, in the same
commit that ends the move. The old node then deletes the range's chunks
(storage ``drop_span``). A move whose range changed meanwhile (sealed
elsewhere, repaired, drained) is dropped.

The PM plans on its own every ``interval`` when no move is left, or when
asked (``sbp cluster rebalance``, which can print the plan only).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import trio

from client.format import size_text
from net.ratelog import RateLimitedLog
from sbp.errors import ProtocolError

from .changes import DeleteMove, PutMove, PutRange
from .move_budget import MoveBudget
from .placement import has_room
from .range_sizes import HoldingsLink, RangeSizes
from .records import MoveRecord, RangeRecord
from .upkeep import UpkeepHost

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
        pm: UpkeepHost,
        sizes: RangeSizes,
        link: HoldingsLink,
        budget: MoveBudget,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        interval: float = DEFAULT_INTERVAL_S,
        min_free_space: int = 0,
    ) -> None:
        self._pm = pm
        self._sizes = sizes
        self._link = link
        self._budget = budget
        self.threshold = threshold
        self._interval = interval
        self._min_free_space = min_free_space
        self._next_plan = trio.current_time() + interval
        #: moves finished since start-up (metrics)
        self.moved = 0

    async def run_pass(self, timeout: float) -> None:
        """Advance the moves; plan new ones when none is left and it is time."""
        deadline = trio.current_time() + timeout
        with trio.move_on_at(deadline):
            try:
                await self._advance(deadline)
                if self._interval > 0 and trio.current_time() >= self._next_plan:
                    self._next_plan = trio.current_time() + self._interval
                    if not self._pm.store.moves():
                        await self.start(await self.plan())
            except (ProtocolError, OSError) as error:
                _failures.warning("rebalance", "rebalancing: %s", error)

    # -- planning -------------------------------------------------------------------

    async def plan(self) -> list[PlannedMove]:
        """The moves that bring the live active nodes within the threshold."""
        nodes = [
            _Node(load.node_id, {}, 0, has_room(load.disk_free_space, self._min_free_space))
            for load in self._pm.registry.loads()
        ]
        if len(nodes) < 2:
            return []
        everything: dict[tuple[int, int], RangeRecord] = {}
        for node in nodes:
            for rng in self._pm.store.ranges_on_node(node.node_id):
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
            planned.append(PlannedMove(MoveRecord(*rng.key, source.node_id, target.node_id), size))
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
        await self._pm.commit([PutMove(planned.move) for planned in plan])
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

    # -- moving ---------------------------------------------------------------------

    async def _advance(self, deadline: float) -> None:
        waiting: dict[int, list[tuple[MoveRecord, RangeRecord]]] = {}
        for move in self._pm.store.moves():
            rng = self._pm.store.range(*move.key)
            registry = self._pm.registry
            if (
                rng is None
                or rng.is_open
                or move.from_node not in rng.nodes
                or move.to_node in registry.draining
                or (move.to_node not in rng.nodes and not registry.is_alive(move.to_node))
            ):
                await self._pm.commit([DeleteMove(*move.key)])  # overtaken
                continue
            if move.to_node not in rng.nodes:
                await self._add(move, rng, deadline)
            else:
                waiting.setdefault(move.to_node, []).append((move, rng))
        for to_node, moves in waiting.items():
            if not self._pm.registry.is_alive(to_node):
                continue
            holdings = await self._link.range_holdings(to_node, [m.key for m, _ in moves])
            for move, rng in moves:
                holding = holdings.get(move.key)
                if holding is not None and holding.covers(rng):
                    await self._finish(move, rng, deadline)

    async def _add(self, move: MoveRecord, rng: RangeRecord, deadline: float) -> None:
        size = (await self._sizes.sizes([rng])).get(rng.key, 0)
        if not self._budget.may_start(size):
            return
        async with self._pm.hold(rng.stream_id):
            current = self._pm.store.range(*move.key)
            if current != rng:
                return  # changed meanwhile: the next pass looks again
            await self._pm.commit([PutRange(replace(rng, nodes=(*rng.nodes, move.to_node)))])
            await self._pm.sync_stream(rng.stream_id, deadline)
        log.info(
            "stream %d range %d: node %d added, which copies it (moving off node %d)",
            *move.key,
            move.to_node,
            move.from_node,
        )

    async def _finish(self, move: MoveRecord, rng: RangeRecord, deadline: float) -> None:
        async with self._pm.hold(rng.stream_id):
            current = self._pm.store.range(*move.key)
            if current != rng:
                return
            nodes = tuple(n for n in rng.nodes if n != move.from_node)
            await self._pm.commit([PutRange(replace(rng, nodes=nodes)), DeleteMove(*move.key)])
            self.moved += 1  # with the commit, as the drain counts its moves
            await self._pm.sync_stream(rng.stream_id, deadline, also={move.from_node})
        log.info(
            "stream %d range %d moved from node %d to node %d",
            *move.key,
            move.from_node,
            move.to_node,
        )
