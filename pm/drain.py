"""Draining data nodes (SPEC §12): every range a draining node holds moves
to live active nodes, so that the node can be stopped and removed.

A node is draining while the metadata marks it so (``SetDraining``): nothing
new is placed on it (``NodeRegistry.loads`` leaves it out). ``NodeDrains``
plans; ``pm.moves.ReplicaMoves`` carries the moves out. Every pass of the
PM's upkeep, for each draining node:

1. its open ranges are sealed; their next ranges go on other nodes;
2. each sealed range it holds whose other replicas number fewer than the
   stream wants gets a move (cause DRAIN): new replicas on live active
   nodes copy the range (catch-up, SPEC §7), and the draining node leaves
   once they hold all of it;
3. a range that enough other replicas already hold whole (RANGE_HOLDINGS)
   is left at once.

The moves are recorded, so a PM that restarts or takes over goes on where
the last one was. A range never has fewer replicas than before (the new
ones are added before the old one leaves), so never fewer than
``ack_nums``.

A pass plans up to ``MAX_RANGES_PER_PASS`` ranges, ``MAX_COPIES_PER_PASS``
of them copies (no faster than the PM's ``MoveBudget``); open ranges are
sealed ``pm.upkeep.SEALS_AT_ONCE`` at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import trio

from net.ratelog import RateLimitedLog
from sbp.enums import DataNodeState
from sbp.errors import ProtocolError

from .changes import Metadata
from .liveness import NodeRegistry
from .moves import Move, ReplicaMoves
from .range_sizes import HoldingsLink
from .records import Holding, MoveCause, RangeRecord
from .upkeep import SealRanges, seal_in_turn

log = logging.getLogger(__name__)
_stuck = RateLimitedLog(log, interval=60.0)

#: what an unanswered replica counts as holding
_NONE: Final = Holding(held_end=-1, size=0)
#: sealed ranges of a draining node planned per pass (the rest wait for
#: later passes, and count in its bytes to move only from then on)
MAX_RANGES_PER_PASS: Final = 4000
#: of those, copies started in one pass at most
MAX_COPIES_PER_PASS: Final = MAX_RANGES_PER_PASS // 2


class NodeDrains:
    """See the module docstring."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: HoldingsLink,
        moves: ReplicaMoves,
        seal_ranges: SealRanges,
        stopping: Callable[[], bool],
    ) -> None:
        self._store = store
        self._registry = registry
        self._link = link
        self._moves = moves
        self._seal_ranges = seal_ranges
        self._stopping = stopping
        #: bytes still to copy off each draining node, as of its last pass
        self.bytes_to_move: dict[int, int] = {}
        #: by draining node: the replicas of its ranges known to hold all of
        #: a sealed range, by (node_id, stream_id, range_index): (start, holding)
        self._whole: dict[int, dict[tuple[int, int, int], tuple[int, Holding]]] = {}
        #: bytes still to be copied to each node by the moves seen this pass,
        #: so that the ranges a pass places spread over the nodes
        self._incoming: dict[int, int] = {}

    @property
    def moved(self) -> int:
        """Ranges whose draining replica left, since start-up (metrics)."""
        return self._moves.finished[MoveCause.DRAIN]

    def state(self, node_id: int) -> DataNodeState:
        if node_id not in self._registry.draining:
            return DataNodeState.ACTIVE
        if self._store.ranges_on_node(node_id):
            return DataNodeState.DRAINING
        return DataNodeState.DRAINED

    def to_move(self, node_id: int) -> int:
        """Bytes of a draining node's ranges still to copy off, as of its last
        pass; 0 once it holds no range."""
        if self.state(node_id) is not DataNodeState.DRAINING:
            return 0
        return self.bytes_to_move.get(node_id, 0)

    async def run_pass(self, timeout: float) -> None:
        """One pass over every draining node that still holds ranges."""
        deadline = trio.current_time() + timeout
        draining = sorted(self._registry.draining)
        self._incoming = {}
        for node_id in list(self.bytes_to_move):
            if node_id not in draining:
                del self.bytes_to_move[node_id]
        for node_id in list(self._whole):
            if node_id not in draining:
                del self._whole[node_id]
        for node_id in draining:
            if self._stopping() or trio.current_time() >= deadline:
                return
            with trio.move_on_at(deadline):
                try:
                    await self._drain(node_id, deadline)
                except (ProtocolError, OSError) as error:
                    _stuck.warning(f"drain {node_id}", "draining data node %d: %s", node_id, error)

    async def _drain(self, node_id: int, deadline: float) -> None:
        held = self._store.ranges_on_node(node_id)
        if not held:
            if self.bytes_to_move.pop(node_id, None) is not None:
                log.warning("data node %d is drained: it holds no range", node_id)
            return
        open_here = [rng.key for rng in held if rng.is_open]
        if open_here:
            await seal_in_turn(self._seal_ranges, open_here, deadline, cause="drain")
            held = self._store.ranges_on_node(node_id)
        sealed = [rng for rng in held if not rng.is_open][:MAX_RANGES_PER_PASS]
        holdings = await self._holdings(node_id, sealed)
        moving = {move.key for move in self._moves.in_flight()}
        steps = self._steps(node_id, sealed, holdings, moving)
        await self._moves.start(steps.moves, deadline, self._incoming)
        self.bytes_to_move[node_id] = steps.to_move

    async def _holdings(
        self, node_id: int, ranges: Sequence[RangeRecord]
    ) -> dict[tuple[int, int, int], Holding]:
        """What the draining node and each other replica hold of ``ranges``,
        by (node_id, stream_id, range_index); a node that does not answer
        is left out. A replica that held all of a sealed range (at the same
        start) is not asked again: a sealed range does not grow."""
        whole = self._whole.setdefault(node_id, {})
        current = {(member, *rng.key) for rng in ranges for member in rng.nodes}
        for gone in [k for k in whole if k not in current]:
            del whole[gone]
        found: dict[tuple[int, int, int], Holding] = {}
        asked: dict[int, list[tuple[int, int]]] = {}
        for rng in ranges:
            for member in rng.nodes:
                kept = whole.get((member, *rng.key))
                if kept is not None and kept[0] == rng.start_offset:
                    found[(member, *rng.key)] = kept[1]
                else:
                    asked.setdefault(member, []).append(rng.key)
        by_key = {rng.key: rng for rng in ranges}

        async def ask(member: int, keys: list[tuple[int, int]]) -> None:
            if not self._registry.is_alive(member):
                return
            try:
                answer = await self._link.range_holdings(member, keys)
            except (ProtocolError, OSError) as error:
                _stuck.warning(
                    f"holdings {member}", "RANGE_HOLDINGS of data node %d: %s", member, error
                )
                return
            for key, value in answer.items():
                found[(member, *key)] = value
                rng = by_key[key]
                if value.covers(rng):
                    whole[(member, *key)] = (rng.start_offset, value)

        async with trio.open_nursery() as nursery:
            for member, keys in asked.items():
                nursery.start_soon(ask, member, keys)
        return found

    def _steps(
        self,
        node_id: int,
        ranges: Sequence[RangeRecord],
        holdings: dict[tuple[int, int, int], Holding],
        moving: set[tuple[int, int]],
    ) -> _Steps:
        """The moves this pass starts for the sealed ranges of a draining
        node, and the bytes still to copy for them."""
        steps = _Steps()
        draining = self._registry.draining
        copies = 0
        for rng in ranges:
            stream = self._store.stream(rng.stream_id)
            if stream is None:
                continue  # being deleted
            others = [n for n in rng.nodes if n not in draining]
            wanted = max(stream.replica_nums, rng.replicas_wanted, 1)
            size = max((holdings.get((n, *rng.key), _NONE).size for n in rng.nodes), default=0)
            whole = [n for n in others if holdings.get((n, *rng.key), _NONE).covers(rng)]
            if rng.key not in moving and len(whole) >= wanted:
                steps.moves.append(Move(rng, MoveCause.DRAIN, leaving=node_id))
            elif rng.key not in moving and len(others) < wanted:
                if not any((n, *rng.key) in holdings for n in rng.nodes):
                    # no replica answered RANGE_HOLDINGS in this pass: the copy's
                    # size, and so its share of the move budget, is not known
                    continue
                steps.to_move += size
                if copies < MAX_COPIES_PER_PASS:
                    copies += 1
                    steps.moves.append(
                        Move(
                            rng,
                            MoveCause.DRAIN,
                            leaving=node_id,
                            count=wanted - len(others),
                            size=size,
                            weight=size,
                        )
                    )
            else:  # copies under way
                copying = {
                    n: holdings.get((n, *rng.key), _NONE).size for n in others if n not in whole
                }
                for target, copied in copying.items():
                    self._incoming[target] = self._incoming.get(target, 0) + max(size - copied, 0)
                steps.to_move += max(size - max(copying.values(), default=0), 0)
        return steps


@dataclass
class _Steps:
    """What a pass does with a draining node's sealed ranges."""

    moves: list[Move] = field(default_factory=list)
    #: bytes still to copy for the ranges looked at
    to_move: int = 0
