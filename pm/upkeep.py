"""The PM's upkeep of replicas: what it does on its own, every pass of
``watch_nodes``, so that every range keeps the replicas its stream wants.

- a replicated open range whose primary is dead is sealed (SPEC §7), so
  its writers go on in a next range on live nodes;
- a node dead for longer than the repair delay is replaced in every
  replicated range it holds, by a live node that copies the range;
- a live node that is full has its open ranges sealed, so its streams go
  on where there is room;
- a range on fewer nodes than it wants (``RangeRecord.short_handed``) gets
  the replicas it lacks;
- the ranges of draining nodes move a step further (``pm.drain``).

It seals through the ``PlacementManager`` (``UpkeepHost``), as a client's
request does, and moves replicas through ``pm.moves.ReplicaMoves``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Final, Protocol

import trio

from net.ratelog import RateLimitedLog
from sbp.errors import NoAvailableDataNodeError, ProtocolError

from .changes import Metadata, PutRange
from .liveness import NodeRegistry, NodeState
from .moves import Move, ReplicaMoves
from .placement import place
from .range_log import Committed
from .records import MoveCause, RangeRecord

log = logging.getLogger(__name__)
_seal_failures = RateLimitedLog(log, interval=60.0)
_near_full = RateLimitedLog(log, interval=300.0)


def _size(value: int) -> str:
    return f"{value / (1 << 20):,.0f} MiB"


#: how often the PM looks at the data nodes' liveness and load
DEAD_NODE_CHECK_S: Final = 1.0
#: open ranges sealed at once by a pass (a drain's, a repair's): each seal
#: asks its replicas and tells its nodes, and many thousands at once would
#: keep those calls waiting past the pass's deadline
SEALS_AT_ONCE: Final = 1000
#: ranges given replicas in one commit (a dead node replaced, or ones they lack)
REPAIRS_AT_ONCE: Final = 2000


class _Outcome(Protocol):
    @property
    def error(self) -> BaseException | None: ...


class SealRanges(Protocol):
    async def __call__(
        self, keys: Sequence[tuple[int, int]], timeout: float, *, cause: str = ...
    ) -> Sequence[_Outcome]: ...


class UpkeepHost(Protocol):
    """What the upkeep needs of the PM: its metadata and nodes, the same
    seals as a request, and a pass of the moves of ranges."""

    store: Metadata
    registry: NodeRegistry

    @property
    def stopping(self) -> bool: ...

    async def seal_ranges(
        self, keys: Sequence[tuple[int, int]], timeout: float, *, cause: str = ...
    ) -> Sequence[_Outcome]: ...

    async def move_ranges(self, timeout: float) -> None: ...


async def seal_in_turn(
    seal_ranges: SealRanges, keys: Sequence[tuple[int, int]], deadline: float, *, cause: str
) -> list[_Outcome]:
    """Seal the open ranges ``keys``, ``SEALS_AT_ONCE`` at a time, starting
    none that the last one's time says would not end by the deadline: the
    outcomes of those tried (a later pass seals the rest)."""
    outcomes: list[_Outcome] = []
    took = 0.0
    for start in range(0, len(keys), SEALS_AT_ONCE):
        began = trio.current_time()
        if deadline - began < 2 * took:
            break
        chunk = keys[start : start + SEALS_AT_ONCE]
        outcomes += await seal_ranges(chunk, deadline - began, cause=cause)
        took = trio.current_time() - began
    return outcomes


class ReplicaUpkeep:
    """See the module docstring."""

    def __init__(
        self,
        pm: UpkeepHost,
        moves: ReplicaMoves,
        *,
        min_free_space: int = 0,
        repair_after: float = math.inf,
    ) -> None:
        self._pm = pm
        self._moves = moves
        self._min_free_space = min_free_space
        self._repair_after = repair_after
        #: ranges on fewer nodes than they want; None until the first pass of
        #: ``watch_nodes`` found those of the metadata
        self._short_handed: set[tuple[int, int]] | None = None

    @property
    def repairs(self) -> int:
        """Ranges whose dead replica was replaced, or that got replicas they
        lacked, since start-up (metrics)."""
        return self._moves.finished[MoveCause.REPAIR] + self._moves.finished[MoveCause.TOP_UP]

    def under_replicated(self) -> int:
        """Replicated ranges with a replica on a dead data node, and ranges on
        fewer nodes than they want (``RangeRecord.short_handed``)."""
        on_dead = {
            rng.key
            for state in self._pm.registry.states()
            if not state.alive
            for rng in self._pm.store.ranges_on_node(state.node_id)
            if len(rng.nodes) > 1
        }
        return len(on_dead | (self._short_handed or set()))

    def committed(self, done: Committed) -> None:
        """The short-handed ranges follow a commit (``pm.range_log``)."""
        for key in done.replaced:
            self.forget(key)
        for change in done.changes:
            if isinstance(change, PutRange):
                self.track(change.range)

    def forget(self, key: tuple[int, int]) -> None:
        """A range replaced or removed: ``track`` takes the new one, if any."""
        if self._short_handed is not None:
            self._short_handed.discard(key)

    def track(self, rng: RangeRecord) -> None:
        """Keep ``_short_handed`` up to date with a range just committed."""
        if self._short_handed is None:
            return  # the first pass of watch_nodes finds it
        if rng.short_handed:
            self._short_handed.add(rng.key)
        else:
            self._short_handed.discard(rng.key)

    async def watch_nodes(self, interval: float = DEAD_NODE_CHECK_S) -> None:
        """Run for the PM's life: every ``interval``,

        - seal the replicated open ranges whose primary is dead (SPEC §7), so
          that their writers go on in a next range, and repair the ranges of
          nodes dead longer than the repair delay;
        - move writes off full nodes (``drain_full_node``);
        - give ranges left on fewer nodes than they want the replicas they
          lack (``restore_replication``).

        What cannot be done yet (too few replicas answer, no node to place
        on) is tried again at the next pass."""
        while True:
            await trio.sleep(interval)
            if self._short_handed is None:
                await self.find_short_handed()
            for state in self._pm.registry.states():
                if self._pm.stopping:
                    break
                if state.alive:
                    if state.is_full(self._min_free_space):
                        await self.drain_full_node(state.node_id, timeout=interval * 4)
                    elif state.is_near_full(self._min_free_space):
                        self._warn_near_full(state)
                    continue
                await self.seal_after_failure(state.node_id, timeout=interval * 4)
                if self._pm.registry.seconds_since_seen(state) > self._repair_after:
                    await self.repair_node(state.node_id, timeout=interval * 4)
            if not self._pm.stopping:
                await self.restore_replication(timeout=interval * 4)
            if not self._pm.stopping:
                await self._pm.move_ranges(timeout=interval * 4)

    def _warn_near_full(self, state: NodeState) -> None:
        """Say so before a node is full and its open ranges are moved off it."""
        left = state.seconds_to_full(self._min_free_space)
        _near_full.warning(
            f"near full {state.node_id}",
            "data node %d is nearly full: %s free%s; at %s it gets no new ranges "
            "(docs/datanode.md, Disk pressure)",
            state.node_id,
            _size(state.metrics.get("disk_free_space", 0)),
            "" if left is None else f", full in about {left / 60:.0f} min at its write rate",
            _size(self._min_free_space),
        )

    async def find_short_handed(self) -> None:
        """Fill ``_short_handed`` from the metadata (after a start or a change
        of leader), one node's ranges at a time between other work; ranges
        committed meanwhile are tracked as they are committed."""
        found = self._short_handed = set()
        for state in self._pm.registry.states():
            found.update(
                r.key for r in self._pm.store.ranges_on_node(state.node_id) if r.short_handed
            )
            await trio.sleep(0)

    async def drain_full_node(self, node_id: int, timeout: float) -> int:
        """A live node whose last report left it less free space than placement
        asks for is full: its disk or its LMDB map cannot take much more. Seal
        the open ranges it holds, so that their streams go on in ranges placed
        on nodes with room; the seal lets a replica there that is short of the
        end leave the range (``pm.sealing.full_and_short``). A range whose next one
        cannot be placed elsewhere stays open. Returns how many were sealed."""
        open_here = [rng.key for rng in self._pm.store.ranges_on_node(node_id) if rng.is_open]
        if not open_here:
            return 0
        outcomes = await self._pm.seal_ranges(open_here, timeout, cause="full_node")
        for (stream_id, range_index), outcome in zip(open_here, outcomes, strict=True):
            if outcome.error is None:
                log.warning(
                    "stream %d range %d sealed: node %d is full", stream_id, range_index, node_id
                )
            else:
                _seal_failures.warning(
                    f"drain {stream_id} {range_index}",
                    "stream %d range %d: node %d is full and the seal failed: %s",
                    stream_id,
                    range_index,
                    node_id,
                    outcome.error,
                )
        return sum(o.error is None for o in outcomes)

    async def seal_after_failure(self, node_id: int, timeout: float) -> int:
        """Seal every open range led by ``node_id`` (a dead data node) that has
        followers, so its streams go on in a next range on live nodes.
        Returns how many were sealed; those that could not be (too few
        replicas answered) are left for the next call."""
        led = [
            rng
            for rng in self._pm.store.ranges_on_node(node_id)
            if rng.is_open and rng.primary == node_id and len(rng.nodes) > 1
        ]
        if not led:
            return 0
        outcomes = await self._pm.seal_ranges(
            [rng.key for rng in led], timeout, cause="dead_primary"
        )
        sealed = 0
        for rng, outcome in zip(led, outcomes, strict=True):
            if outcome.error is None:
                sealed += 1
                log.warning(
                    "stream %d range %d sealed: its primary, node %d, is dead",
                    rng.stream_id,
                    rng.range_index,
                    node_id,
                )
            else:
                _seal_failures.warning(
                    f"seal {rng.key}",
                    "stream %d range %d: its primary, node %d, is dead and the seal failed: %s",
                    rng.stream_id,
                    rng.range_index,
                    node_id,
                    outcome.error,
                )
        return sealed

    async def repair_node(self, node_id: int, timeout: float) -> int:
        """Replace the dead ``node_id`` in every replicated range it holds by a
        live node, which copies the range from a surviving replica (its
        catch-up); an open range is sealed first, so its writers go on in a
        range placed on live nodes. Ranges are replaced ``REPAIRS_AT_ONCE``
        at a time, each batch one commit and one SYNC_RANGES per node.
        Returns how many ranges were repaired."""
        deadline = trio.current_time() + timeout

        def replicated() -> list[RangeRecord]:
            # a lone replica has nothing left to copy from
            return [rng for rng in self._pm.store.ranges_on_node(node_id) if len(rng.nodes) > 1]

        held = replicated()
        open_here = [rng.key for rng in held if rng.is_open]
        if open_here:
            outcomes = await seal_in_turn(self._pm.seal_ranges, open_here, deadline, cause="repair")
            for key, outcome in zip(open_here, outcomes, strict=False):
                if outcome.error is not None:
                    _seal_failures.warning(
                        f"repair {key}",
                        "stream %d range %d: replacing dead node %d failed: %s",
                        *key,
                        node_id,
                        outcome.error,
                    )
            held = replicated()
        sealed = [rng for rng in held if not rng.is_open]
        repaired = 0
        #: replacements chosen so far, by node: the copies spread over the nodes
        incoming: dict[int, int] = {}
        for start in range(0, len(sealed), REPAIRS_AT_ONCE):
            if trio.current_time() >= deadline:
                break
            with trio.move_on_at(deadline):
                try:
                    repaired += await self._replace(
                        node_id, sealed[start : start + REPAIRS_AT_ONCE], incoming, deadline
                    )
                except (ProtocolError, OSError) as error:
                    _seal_failures.warning(
                        f"repair {node_id}", "replacing dead node %d failed: %s", node_id, error
                    )
        return repaired

    async def _replace(
        self,
        dead: int,
        ranges: Sequence[RangeRecord],
        incoming: dict[int, int],
        deadline: float,
    ) -> int:
        """Replace ``dead`` in the sealed ``ranges``, in one commit (a move
        off a dead node takes both its steps at once, ``pm.moves``)."""
        moves = [
            Move(rng, MoveCause.REPAIR, leaving=dead, count=1, weight=1)
            for rng in ranges
            if dead in rng.nodes
        ]
        return await self._moves.start(moves, deadline, incoming)

    async def restore_replication(self, timeout: float) -> int:
        """Give each short-handed range the replicas it lacks, on live nodes
        with room: a sealed one gets them at once and they copy it from its
        replicas (catch-up); an open one is sealed once its next range can be
        placed on every replica its stream wants, and is then topped up as a
        sealed one. Seals go ``SEALS_AT_ONCE`` at a time, top-ups
        ``REPAIRS_AT_ONCE`` per commit. Returns how many ranges got replicas."""
        deadline = trio.current_time() + timeout
        to_seal: list[tuple[int, int]] = []
        sealed: list[tuple[int, int]] = []
        for key in sorted(self._short_handed or ()):
            current = self._pm.store.range(*key)
            stream = self._pm.store.stream(key[0])
            if current is None or stream is None or not current.short_handed:
                if self._short_handed is not None:
                    self._short_handed.discard(key)
            elif not current.is_open:
                sealed.append(key)
            elif self._next_range_fits(stream.replica_nums):
                to_seal.append(key)
        if to_seal:
            outcomes = await seal_in_turn(
                self._pm.seal_ranges, to_seal, deadline, cause="under_replicated"
            )
            for key, outcome in zip(to_seal, outcomes, strict=False):
                if outcome.error is None:
                    log.warning(
                        "stream %d range %d sealed: its next range can be placed on all its "
                        "replicas",
                        *key,
                    )
                    sealed.append(key)
                else:
                    _seal_failures.warning(
                        f"top up {key}",
                        "stream %d range %d: adding replicas failed: %s",
                        *key,
                        outcome.error,
                    )
        restored = 0
        for start in range(0, len(sealed), REPAIRS_AT_ONCE):
            if trio.current_time() >= deadline or self._pm.stopping:
                break
            with trio.move_on_at(deadline):
                try:
                    restored += await self._top_up(
                        sealed[start : start + REPAIRS_AT_ONCE], deadline
                    )
                except (ProtocolError, OSError) as error:
                    _seal_failures.warning("top up", "adding replicas failed: %s", error)
        return restored

    def _next_range_fits(self, replica_nums: int) -> bool:
        """Whether a next range would get all its replicas (sealing an open
        short-handed range is of no use until then: it would make another)."""
        try:
            place(self._pm.registry.loads(), replica_nums, min_free_space=self._min_free_space)
        except NoAvailableDataNodeError:
            return False
        return True

    async def _top_up(self, keys: Sequence[tuple[int, int]], deadline: float) -> int:
        """Give the sealed short-handed ranges ``keys`` the replicas they
        lack (at least one each), in one commit; returns how many got some."""
        moves = []
        for key in keys:
            current = self._pm.store.range(*key)
            if current is None or current.is_open or not current.short_handed:
                continue
            lacking = current.replicas_wanted - len(current.nodes)
            moves.append(Move(current, MoveCause.TOP_UP, count=lacking, at_least=1, weight=1))
        return await self._moves.start(moves, deadline)
