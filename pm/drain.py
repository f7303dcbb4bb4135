"""Draining data nodes (SPEC §12): every range a draining node holds moves
to live active nodes, so that the node can be stopped and removed.

A node is draining while the metadata marks it so (``SetDraining``): nothing
new is placed on it (``NodeRegistry.loads`` leaves it out). Every pass of the
PM's upkeep, for each draining node:

1. its open ranges are sealed; their next ranges go on other nodes;
2. each sealed range it holds whose other replicas number fewer than the
   stream wants gets new replicas on live active nodes, which copy the
   range from a replica that holds it (catch-up, SPEC §7);
3. once that many of its other replicas hold all of it (RANGE_HOLDINGS),
   the range's replica set drops the draining node.

A range is a move in progress when its replica set holds a draining node
and enough others: both steps are commits of the range, so a PM that
restarts or takes over goes on where the last one was. A range never has
fewer replicas than before (the new ones are added before the old one
leaves), so never fewer than ``ack_nums``.

A pass takes each step for many ranges at once (up to
``MAX_RANGES_PER_PASS``): step 1 seals ``pm.upkeep.SEALS_AT_ONCE`` at a time; the
ranges that step 3 moves go in one commit, then one SYNC_RANGES per node
for all of them, and the same for those that step 2 gives new replicas.
New copies start no faster than the PM's ``MoveBudget`` allows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import trio

from net.ratelog import RateLimitedLog
from sbp.enums import DataNodeState
from sbp.errors import NoAvailableDataNodeError, ProtocolError

from .changes import PutRange
from .move_budget import MoveBudget
from .placement import place_copies
from .range_sizes import HoldingsLink
from .records import Holding, RangeRecord
from .upkeep import UpkeepHost, seal_in_turn

log = logging.getLogger(__name__)
_stuck = RateLimitedLog(log, interval=60.0)

#: what an unanswered replica counts as holding
_NONE: Final = Holding(held_end=-1, size=0)
#: sealed ranges of a draining node moved a step per pass (the rest wait
#: for later passes, and count in its bytes to move only from then on)
MAX_RANGES_PER_PASS: Final = 4000
#: of those, copies started in one pass at most: the ranges copied since
#: the last pass (the first ones) leave in the same pass
MAX_COPIES_PER_PASS: Final = MAX_RANGES_PER_PASS // 2
#: what a target node's appends write over this long counts as headed its
#: way: a node taking a producer's appends gets copies only once the others
#: have been given about this many seconds of its writes (``place_copies``)
COPY_WRITE_HORIZON_S: Final = 10.0


class NodeDrains:
    """See the module docstring."""

    def __init__(
        self,
        pm: UpkeepHost,
        link: HoldingsLink,
        budget: MoveBudget,
        *,
        min_free_space: int = 0,
    ) -> None:
        self._pm = pm
        self._link = link
        self._min_free_space = min_free_space
        self._budget = budget
        #: bytes still to copy off each draining node, as of its last pass
        self.bytes_to_move: dict[int, int] = {}
        #: ranges whose draining replica left, since start-up (metrics)
        self.moved = 0
        #: by draining node: the replicas of its ranges known to hold all of
        #: a sealed range, by (node_id, stream_id, range_index): (start, holding)
        self._whole: dict[int, dict[tuple[int, int, int], tuple[int, Holding]]] = {}
        #: bytes still to be copied to each node by the moves seen this pass,
        #: so that the ranges a pass places spread over the nodes
        self._incoming: dict[int, int] = {}

    def state(self, node_id: int) -> DataNodeState:
        if node_id not in self._pm.registry.draining:
            return DataNodeState.ACTIVE
        if self._pm.store.ranges_on_node(node_id):
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
        draining = sorted(self._pm.registry.draining)
        self._incoming = {}
        for node_id in list(self.bytes_to_move):
            if node_id not in draining:
                del self.bytes_to_move[node_id]
        for node_id in list(self._whole):
            if node_id not in draining:
                del self._whole[node_id]
        for node_id in draining:
            if self._pm.stopping or trio.current_time() >= deadline:
                return
            with trio.move_on_at(deadline):
                try:
                    await self._drain(node_id, deadline)
                except (ProtocolError, OSError) as error:
                    _stuck.warning(f"drain {node_id}", "draining data node %d: %s", node_id, error)

    async def _drain(self, node_id: int, deadline: float) -> None:
        store = self._pm.store
        held = store.ranges_on_node(node_id)
        if not held:
            if self.bytes_to_move.pop(node_id, None) is not None:
                log.warning("data node %d is drained: it holds no range", node_id)
            return
        open_here = [rng.key for rng in held if rng.is_open]
        if open_here:
            await seal_in_turn(self._pm, open_here, deadline, cause="drain")
            held = store.ranges_on_node(node_id)
        sealed = [rng for rng in held if not rng.is_open][:MAX_RANGES_PER_PASS]
        holdings = await self._holdings(node_id, sealed)
        steps = self._steps(sealed, holdings)
        await self._leave(node_id, steps.leaving, deadline)
        await self._add_replicas(steps.adding, deadline)
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
            if not self._pm.registry.is_alive(member):
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
        self, ranges: Sequence[RangeRecord], holdings: dict[tuple[int, int, int], Holding]
    ) -> _Steps:
        """The step each sealed range of a draining node takes in this pass,
        and the bytes still to copy for them."""
        steps = _Steps()
        draining = self._pm.registry.draining
        for rng in ranges:
            stream = self._pm.store.stream(rng.stream_id)
            if stream is None:
                continue  # being deleted
            others = [n for n in rng.nodes if n not in draining]
            wanted = max(stream.replica_nums, rng.replicas_wanted, 1)
            size = max((holdings.get((n, *rng.key), _NONE).size for n in rng.nodes), default=0)
            whole = [n for n in others if holdings.get((n, *rng.key), _NONE).covers(rng)]
            if len(whole) >= wanted:
                steps.leaving.append(rng)
            elif len(others) < wanted:
                if not any((n, *rng.key) in holdings for n in rng.nodes):
                    # no replica answered RANGE_HOLDINGS in this pass: the copy's
                    # size, and so its share of the move budget, is not known
                    continue
                steps.to_move += size
                if len(steps.adding) < MAX_COPIES_PER_PASS and self._budget.may_start(size):
                    steps.adding.append((rng, wanted - len(others), size))
            else:
                copying = {
                    n: holdings.get((n, *rng.key), _NONE).size for n in others if n not in whole
                }
                for target, copied in copying.items():
                    self._incoming[target] = self._incoming.get(target, 0) + max(size - copied, 0)
                steps.to_move += max(size - max(copying.values(), default=0), 0)
        return steps

    async def _add_replicas(
        self, adding: Sequence[tuple[RangeRecord, int, int]], deadline: float
    ) -> None:
        """Give each range ``count`` new replicas, which copy ``size``
        bytes: placed one after another, in one commit."""
        if not adding:
            return
        async with self._pm.hold_all(rng.stream_id for rng, _, _ in adding):
            added_to: list[tuple[RangeRecord, tuple[int, ...]]] = []
            for rng, count, size in adding:
                current = self._pm.store.range(rng.stream_id, rng.range_index)
                if current is None or current.is_open or current.nodes != rng.nodes:
                    continue  # changed meanwhile: the next pass looks again
                candidates = [
                    load for load in self._pm.registry.loads() if load.node_id not in current.nodes
                ]
                try:
                    added = place_copies(
                        candidates,
                        count,
                        size,
                        self._incoming,
                        min_free_space=self._min_free_space,
                        write_horizon_s=COPY_WRITE_HORIZON_S,
                    )
                except NoAvailableDataNodeError as error:
                    _stuck.warning(
                        f"drain place {rng.key}",
                        "stream %d range %d cannot leave its draining replica yet: %s",
                        rng.stream_id,
                        rng.range_index,
                        error,
                    )
                    continue
                for target in added:
                    self._incoming[target] = self._incoming.get(target, 0) + size
                added_to.append((current, tuple(added)))
            await self._pm.commit(
                [PutRange(replace(rng, nodes=(*rng.nodes, *added))) for rng, added in added_to]
            )
            await self._pm.sync_streams((rng.stream_id for rng, _ in added_to), deadline)
            for current, added in added_to:
                log.info(
                    "stream %d range %d: node(s) %s added, which copy it off draining node(s) %s",
                    current.stream_id,
                    current.range_index,
                    _ids(added),
                    _ids(n for n in current.nodes if n in self._pm.registry.draining),
                )

    async def _leave(self, node_id: int, ranges: Sequence[RangeRecord], deadline: float) -> None:
        """``node_id`` leaves the replicas of ``ranges``, in one commit."""
        if not ranges:
            return
        async with self._pm.hold_all(rng.stream_id for rng in ranges):
            changes: list[PutRange] = []
            for rng in ranges:
                current = self._pm.store.range(rng.stream_id, rng.range_index)
                if current is None or current.nodes != rng.nodes:
                    continue
                nodes = tuple(n for n in current.nodes if n != node_id)
                wanted = current.replicas_wanted if len(nodes) < current.replicas_wanted else 0
                changes.append(PutRange(replace(current, nodes=nodes, replicas_wanted=wanted)))
            await self._pm.commit(changes)
            # counted with the commit that moves them, which is what DESCRIBE_CLUSTER
            # shows at once (drained), not after telling the nodes
            self.moved += len(changes)
            await self._pm.sync_streams(
                (c.range.stream_id for c in changes), deadline, also={node_id}
            )
            for change in changes:
                log.info(
                    "stream %d range %d moved off draining node %d: now on %s",
                    change.range.stream_id,
                    change.range.range_index,
                    node_id,
                    _ids(change.range.nodes),
                )


@dataclass
class _Steps:
    """What a pass does with a draining node's sealed ranges."""

    #: ranges that others hold whole: the draining node leaves them
    leaving: list[RangeRecord] = field(default_factory=list)
    #: ranges short of replicas that may start a copy now: (range, new
    #: replicas wanted, bytes to copy)
    adding: list[tuple[RangeRecord, int, int]] = field(default_factory=list)
    #: bytes still to copy for the ranges looked at
    to_move: int = 0


def _ids(nodes: Iterable[int]) -> str:
    return ", ".join(map(str, nodes))
