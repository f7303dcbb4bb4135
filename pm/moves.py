"""Moving a sealed range's replicas: the one way the PM does it, whatever
the cause (a drain, a rebalance, a dead node's repair, a short-handed
range's top-up). Planners (``pm.drain``, ``pm.rebalance``, ``pm.upkeep``)
say what should move (``Move``); ``ReplicaMoves`` carries it out and
touches the metadata, the planners never.

A move takes two steps, each batched over many moves: one commit, then
one SYNC_RANGES per node.

1. **Add.** The new replicas (chosen by the planner, or placed here among
   the live active nodes) join the range's replicas; they copy it from the
   others (catch-up, SPEC §7). The move is recorded (``MoveRecord``, with
   its cause) in the same commit, so a PM that restarts or takes over
   goes on with it.
2. **Drop.** Once every new replica holds all of the range
   (RANGE_HOLDINGS), the old one leaves the range's replicas in the commit
   that ends the move; it then frees the range.

A move with nothing to wait for takes both steps in one commit and is
never recorded: one that adds without dropping (a top-up), one that drops
without adding (a drained node's range others already hold whole), and
a repair (its old replica is on a node dead past the repair delay, which
serves nothing to wait for). So a range never has fewer replicas than before a move.

Each step compares the range with the one the move was planned from (or
recorded on) under the stream's lock, and leaves a range that changed
meanwhile to the next pass; a recorded move whose range was sealed
elsewhere, trimmed away or drained of its new node is dropped.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Final

import trio

from net.ratelog import RateLimitedLog
from sbp.errors import NoAvailableDataNodeError, ProtocolError

from .changes import Change, DeleteMove, Metadata, PutMove, PutRange
from .liveness import NodeRegistry
from .move_budget import MoveBudget
from .placement import place_copies
from .range_sizes import HoldingsLink, RangeSizes
from .records import MoveCause, MoveRecord, RangeRecord

log = logging.getLogger(__name__)
_stuck = RateLimitedLog(log, interval=60.0)

#: causes whose copies start no faster than the ``MoveBudget`` allows: a
#: repair or a top-up restores redundancy, which is not held back
BUDGETED: Final = frozenset({MoveCause.DRAIN, MoveCause.REBALANCE})
#: causes whose old replica stays until the new ones hold the range: a
#: repair replaces a node dead past the repair delay, which serves nothing
WAITING: Final = frozenset({MoveCause.DRAIN, MoveCause.REBALANCE})
#: what a node's appends write over this long counts as headed its way when
#: a drain places copies: a node taking a producer's appends gets copies
#: only once the others have been given about this much (``place_copies``)
COPY_WRITE_HORIZON_S: Final = 10.0
#: how long a repair or a top-up waits to learn its range's size
SIZING_TIMEOUT_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class Move:
    """What a planner asks for: ``leaving`` (None: nobody) leaves ``rng``'s
    replicas once ``joining`` hold it; with no ``joining``, ``count`` new
    replicas are placed here (at least ``at_least`` of them). ``size``: the
    bytes a copy moves (the budget and the room on the new node);
    ``weight``: what it adds to its node's share of this pass's copies
    (bytes, or 1 where sizes are not known)."""

    rng: RangeRecord
    cause: MoveCause
    leaving: int | None = None
    joining: tuple[int, ...] = ()
    count: int = 0
    at_least: int | None = None
    size: int = 0
    weight: int = 0


class ReplicaMoves:
    """See the module docstring."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: HoldingsLink,
        sizes: RangeSizes,
        budget: MoveBudget,
        hold_all: Callable[[Iterable[int]], AbstractAsyncContextManager[None]],
        commit: Callable[[Sequence[Change]], Awaitable[None]],
        sync_streams: Callable[[Iterable[int], float, Iterable[int]], Awaitable[None]],
        *,
        min_free_space: int = 0,
    ) -> None:
        self._store = store
        self._registry = registry
        self._link = link
        self._sizes = sizes
        self._budget = budget
        self._hold_all = hold_all
        self._commit = commit
        self._sync_streams = sync_streams
        self._min_free_space = min_free_space
        #: moves ended since start-up, by cause (metrics)
        self.finished: Counter[MoveCause] = Counter()

    def in_flight(self, cause: MoveCause | None = None) -> list[MoveRecord]:
        """The recorded moves (of one cause)."""
        return [m for m in self._store.moves() if cause is None or m.cause == cause]

    async def record(self, moves: Sequence[MoveRecord]) -> None:
        """Record planned moves (a rebalance's plan, one commit); the passes
        carry them out (``advance``)."""
        await self._commit([PutMove(move) for move in moves])

    # -- step 1 -------------------------------------------------------------------

    async def start(
        self, moves: Sequence[Move], deadline: float, incoming: dict[int, int] | None = None
    ) -> int:
        """Take the first step of each move, in one commit: the new replicas
        are placed (spread by ``incoming``, by node, which they add their
        ``weight`` to) and join; those with nothing to wait for take both.
        Returns how many moves took their step."""
        if not moves:
            return 0
        moves = await self._sized(moves)
        incoming = {} if incoming is None else incoming
        changes: list[Change] = []
        done: list[tuple[Move, tuple[int, ...], bool]] = []
        async with self._hold_all(m.rng.stream_id for m in moves):
            for move in moves:
                current = move.rng
                if self._store.range(*current.key) != current or current.is_open:
                    continue  # changed meanwhile: the next pass looks again
                copies = bool(move.joining) or move.count > 0
                if copies and move.cause in BUDGETED and not self._budget.may_start(move.size):
                    continue  # a later pass starts it
                joining = move.joining or self._place(move, current, incoming)
                if joining is None:
                    continue
                for node_id in joining:
                    incoming[node_id] = incoming.get(node_id, 0) + move.weight
                waits = bool(joining) and move.leaving is not None and move.cause in WAITING
                leaving = () if move.leaving is None or waits else (move.leaving,)
                nodes = (*(n for n in current.nodes if n not in leaving), *joining)
                changes.append(PutRange(_with_nodes(current, nodes)))
                if waits:
                    assert move.leaving is not None
                    record = MoveRecord(*current.key, move.leaving, joining, move.cause)
                    changes.append(PutMove(record))
                done.append((move, joining, waits))
            await self._commit(changes)
            for move, _, waits in done:
                if not waits:
                    self.finished[move.cause] += 1  # counted with the commit
            await self._sync_streams(
                {m.rng.stream_id for m, _, _ in done},
                deadline,
                {m.leaving for m, _, waits in done if m.leaving is not None and not waits},
            )
        for move, joining, waits in done:
            _log_step(move.cause, move.rng, move.leaving, joining, ended=not waits)
        return len(done)

    async def _sized(self, moves: Sequence[Move]) -> Sequence[Move]:
        """The moves with copies to place and no size (a repair's, a
        top-up's), with the size of their range as a live replica holds it:
        a node with no room for the whole range is not given a copy (one
        that left the range for being full had freed what it held of it,
        and would be given it again, to fill up and stay short of it)."""
        unsized = [m.rng for m in moves if _unsized(m)]
        if not unsized:
            return moves
        sizes: dict[tuple[int, int], int] = {}
        # a repair must not wait on a slow replica: unsized, it is placed
        # by free space alone
        with trio.move_on_after(SIZING_TIMEOUT_S):
            try:
                sizes = await self._sizes.sizes(unsized)
            except (ProtocolError, OSError) as error:
                _stuck.warning("sizes", "RANGE_HOLDINGS for new replicas' room: %s", error)
        return [
            replace(m, size=sizes[m.rng.key]) if _unsized(m) and m.rng.key in sizes else m
            for m in moves
        ]

    def _place(
        self, move: Move, current: RangeRecord, incoming: dict[int, int]
    ) -> tuple[int, ...] | None:
        """The new replicas of a move that names none: ``count`` of them on
        live active nodes without the range; None when none can be placed
        (or fewer than ``at_least``)."""
        if move.count <= 0:
            return ()
        candidates = [load for load in self._registry.loads() if load.node_id not in current.nodes]
        try:
            placed = place_copies(
                candidates,
                move.count,
                move.size,
                incoming,
                min_free_space=self._min_free_space,
                write_horizon_s=COPY_WRITE_HORIZON_S if move.cause == MoveCause.DRAIN else 0.0,
            )
        except NoAvailableDataNodeError as error:
            _stuck.warning(
                f"place {move.cause} {current.key}",
                "stream %d range %d: its %s cannot start: %s",
                *current.key,
                _what(move.cause),
                error,
            )
            return None
        needed = move.count if move.at_least is None else move.at_least
        if len(placed) < needed:
            _stuck.warning(
                f"place {move.cause} {current.key}",
                "stream %d range %d: its %s needs %d new replica(s), and only %d live "
                "active node(s) without it have room",
                *current.key,
                _what(move.cause),
                needed,
                len(placed),
            )
            return None
        return placed

    # -- step 2 -------------------------------------------------------------------

    async def advance(self, deadline: float) -> None:
        """One pass over the recorded moves: drop those overtaken, add the
        new replicas of planned ones (within the budget), and end those whose
        new replicas hold the range."""
        overtaken: list[Change] = []
        planned: list[Move] = []
        waiting: dict[int, list[tuple[MoveRecord, RangeRecord]]] = {}
        for move in self._store.moves():
            rng = self._store.range(*move.key)
            if rng is None or self._overtaken(move, rng):
                overtaken.append(DeleteMove(*move.key))
                continue
            missing = tuple(n for n in move.to_nodes if n not in rng.nodes)
            if missing:
                planned.append(Move(rng, move.cause, move.from_node, missing))
                continue
            for node_id in move.to_nodes:
                waiting.setdefault(node_id, []).append((move, rng))
        if overtaken:
            await self._commit(overtaken)
        await self._add_planned(planned, deadline)
        await self.finish(await self._held(waiting), deadline)

    def _overtaken(self, move: MoveRecord, rng: RangeRecord) -> bool:
        """A range sealed elsewhere or changed, a new node dead or draining,
        or a drain cancelled (the range keeps its old and new replicas)."""
        registry = self._registry
        return (
            rng.is_open
            or move.from_node not in rng.nodes
            or (move.cause == MoveCause.DRAIN and move.from_node not in registry.draining)
            or any(n in registry.draining for n in move.to_nodes)
            or any(n not in rng.nodes and not registry.is_alive(n) for n in move.to_nodes)
        )

    async def _add_planned(self, planned: Sequence[Move], deadline: float) -> None:
        """The first step of recorded moves planned ahead (a rebalance's):
        their new replicas join, within the budget; the record stays."""
        if not planned:
            return
        sizes = await self._sizes.sizes([m.rng for m in planned])
        startable = [
            m
            for m in planned
            if m.cause not in BUDGETED or self._budget.may_start(sizes.get(m.rng.key, 0))
        ]
        if not startable:
            return
        added: list[Move] = []
        async with self._hold_all(m.rng.stream_id for m in startable):
            changes: list[Change] = []
            for move in startable:
                if self._store.range(*move.rng.key) != move.rng:
                    continue
                changes.append(PutRange(_with_nodes(move.rng, (*move.rng.nodes, *move.joining))))
                added.append(move)
            await self._commit(changes)
            await self._sync_streams({m.rng.stream_id for m in added}, deadline, ())
        for move in added:
            _log_step(move.cause, move.rng, move.leaving, move.joining, ended=False)

    async def _held(
        self, waiting: dict[int, list[tuple[MoveRecord, RangeRecord]]]
    ) -> list[tuple[MoveRecord, RangeRecord]]:
        """The moves whose every new replica holds all of the range."""
        short: set[tuple[int, int]] = set()
        moves: dict[tuple[int, int], tuple[MoveRecord, RangeRecord]] = {}
        for node_id, pairs in waiting.items():
            for move, rng in pairs:
                moves[move.key] = (move, rng)
            if not self._registry.is_alive(node_id):
                short.update(move.key for move, _ in pairs)
                continue
            try:
                holdings = await self._link.range_holdings(node_id, [m.key for m, _ in pairs])
            except (ProtocolError, OSError) as error:
                _stuck.warning(
                    f"holdings {node_id}", "RANGE_HOLDINGS of data node %d: %s", node_id, error
                )
                short.update(move.key for move, _ in pairs)
                continue
            for move, rng in pairs:
                holding = holdings.get(move.key)
                if holding is None or not holding.covers(rng):
                    short.add(move.key)
        return [pair for key, pair in moves.items() if key not in short]

    async def finish(self, moves: Sequence[tuple[MoveRecord, RangeRecord]], deadline: float) -> int:
        """The second step of recorded moves whose new replicas hold the
        range, in one commit: the old replica leaves, the record goes."""
        if not moves:
            return 0
        ended: list[tuple[MoveRecord, RangeRecord]] = []
        async with self._hold_all(rng.stream_id for _, rng in moves):
            changes: list[Change] = []
            for move, rng in moves:
                if self._store.range(*move.key) != rng:
                    continue
                nodes = tuple(n for n in rng.nodes if n != move.from_node)
                changes += [PutRange(_with_nodes(rng, nodes)), DeleteMove(*move.key)]
                ended.append((move, rng))
            await self._commit(changes)
            for move, _ in ended:
                self.finished[move.cause] += 1  # counted with the commit
            await self._sync_streams(
                {move.stream_id for move, _ in ended},
                deadline,
                {move.from_node for move, _ in ended},
            )
        for move, rng in ended:
            _log_step(move.cause, rng, move.from_node, (), ended=True)
        return len(ended)


def _with_nodes(rng: RangeRecord, nodes: tuple[int, ...]) -> RangeRecord:
    """``rng`` on ``nodes``; the replicas it wants are kept only while it has fewer."""
    wanted = rng.replicas_wanted if len(nodes) < rng.replicas_wanted else 0
    return replace(rng, nodes=nodes, replicas_wanted=wanted)


def _log_step(
    cause: MoveCause,
    rng: RangeRecord,
    leaving: int | None,
    joining: tuple[int, ...],
    *,
    ended: bool,
) -> None:
    what = _what(cause)
    level = logging.WARNING if cause in (MoveCause.REPAIR, MoveCause.TOP_UP) else logging.INFO
    if joining and not ended:
        log.log(
            level,
            "stream %d range %d (%s): node(s) %s added, which copy it%s",
            *rng.key,
            what,
            ", ".join(map(str, joining)),
            "" if leaving is None else f" off node {leaving}",
        )
    elif joining:
        log.log(
            level,
            "stream %d range %d (%s): node(s) %s added%s",
            *rng.key,
            what,
            ", ".join(map(str, joining)),
            "" if leaving is None else f" in place of node {leaving}",
        )
    else:
        log.log(level, "stream %d range %d (%s): moved off node %s", *rng.key, what, leaving)


def _unsized(move: Move) -> bool:
    """A move that places new replicas without knowing its range's size."""
    return move.count > 0 and not move.joining and not move.size


def _what(cause: MoveCause) -> str:
    """The cause as logs name it: drain, rebalance, repair, top-up."""
    return cause.name.lower().replace("_", "-")
