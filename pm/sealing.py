"""Sealing ranges (SPEC §7): ``RangeSealer`` seals a stream's open range
and opens its next one, under the stream's lock, for SEAL_RANGES and for
the PM's own seals (dead primaries, drains, full nodes, rolls). It asks
every replica to seal and gathers the next offsets they answer
(``seal_replicas``), says why a seal failed (``seal_refused``), and picks
the full replicas that hold less than the sealed range and leave it
(``full_and_short``). The end itself is ``sbp.replication.seal_end``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from functools import partial
from typing import Final, Protocol

import trio

from sbp.enums import ErrorCode
from sbp.errors import (
    EpochFencedError,
    NotEnoughReplicasError,
    ProtocolError,
    RangeNotFoundError,
    SBPError,
)
from sbp.replication import effective_acks, seal_end

from .batches import each_outcome
from .changes import Change, Metadata, PutRange, require_stream
from .liveness import NodeRegistry
from .records import Outcome, RangeRecord

log = logging.getLogger(__name__)

#: how long replicas that have not answered yet may still answer once enough have
SEAL_GRACE_S: Final = 0.5
#: a replica on a node held dead is asked to seal for this long at most
DEAD_REPLICA_SEAL_S: Final = 2.0


class SealCall(Protocol):
    async def seal_replica(self, rng: RangeRecord, node_id: int) -> int:
        """SEAL_RANGES of ``rng`` on ``node_id``: the next offset it holds."""
        ...


def full_and_short(
    registry: NodeRegistry, min_free_space: int, rng: RangeRecord, held: dict[int, int], end: int
) -> list[int]:
    """The replicas of a range sealed at ``end`` that hold less of it and
    whose node is full: they could not copy the rest (catch-up), so they
    leave the range rather than stay short of it for good; the range is
    then under-replicated until a node with room takes a copy
    (``restore_replication``). Never the replica whose answer is the end."""
    if len(rng.nodes) <= 1:
        return []
    leaving = []
    for node_id, offset in held.items():
        state = registry.get(node_id)
        if offset < end and state is not None and state.is_full(min_free_space):
            log.warning(
                "stream %d range %d: node %d is full and holds %d of its %d records; "
                "it leaves the range",
                rng.stream_id,
                rng.range_index,
                node_id,
                max(offset - rng.start_offset, 0),
                end - rng.start_offset,
            )
            leaving.append(node_id)
    return leaving


async def seal_replicas(
    link: SealCall,
    registry: NodeRegistry,
    rng: RangeRecord,
    ack_nums: int,
    refusals: dict[int, BaseException],
) -> dict[int, int]:
    """SEAL_RANGES on the range's replicas: the next offset each answered,
    by node id, from which the caller takes the end by SPEC §7's rule
    (``sbp.replication.seal_end``); why the others did not, into
    ``refusals``.

    One replica: its answer, waited for until the deadline (nothing else
    holds the records). Several: every replica is asked at once; once
    ``R - A + 1`` have answered, the others get ``SEAL_GRACE_S`` more. A
    replica that sealed refuses the primary's REPLICATE from then on, so
    after enough answers no more records can be acknowledged in the range.
    """
    if len(rng.nodes) == 1:
        return {rng.primary: await link.seal_replica(rng, rng.primary)}
    answers: dict[int, int] = {}
    needed = len(rng.nodes) - ack_nums + 1
    settled = trio.Event()
    all_done = trio.Event()
    unfinished = len(rng.nodes)

    async def ask(node_id: int) -> None:
        nonlocal unfinished
        # A node the PM holds dead gets one short try, not the whole deadline.
        budget = math.inf if registry.is_alive(node_id) else DEAD_REPLICA_SEAL_S
        try:
            with trio.fail_after(budget):
                answers[node_id] = await link.seal_replica(rng, node_id)
        except (SBPError, OSError, trio.TooSlowError) as error:
            refusals[node_id] = error
            log.info(
                "SEAL_RANGES of stream %d range %d on node %d: %s",
                rng.stream_id,
                rng.range_index,
                node_id,
                error or "no answer",
            )
        finally:
            unfinished -= 1
            if len(answers) >= needed or not unfinished:
                settled.set()
            if not unfinished:
                all_done.set()

    async with trio.open_nursery() as nursery:
        for node_id in rng.nodes:
            nursery.start_soon(ask, node_id)
        await settled.wait()
        with trio.move_on_after(SEAL_GRACE_S):
            await all_done.wait()
        nursery.cancel_scope.cancel()
    return answers


def seal_refused(
    error: NotEnoughReplicasError, refusals: dict[int, BaseException]
) -> ProtocolError:
    """The seal's failure with what each replica that did not answer said:
    when every one of them refused this PM's term, the cause is the term
    (a deposed PM, or data placed by PMs of another kind), not the replicas."""
    reasons = "; ".join(
        f"node {node_id}: {why or 'no answer in time'}" for node_id, why in sorted(refusals.items())
    )
    fenced = refusals and all(
        getattr(why, "code", None) == ErrorCode.EPOCH_FENCED for why in refusals.values()
    )
    if fenced:
        return EpochFencedError(f"the replicas refuse this PM's term ({reasons})")
    return NotEnoughReplicasError(f"{error.message} ({reasons})" if reasons else error.message)


class RangeSealer:
    """See the module docstring. ``place(replica_nums, at_least)``: the
    nodes of a next range; ``sync_streams(ids, deadline, also)`` tells the
    nodes."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: SealCall,
        hold: Callable[[int], AbstractAsyncContextManager[None]],
        commit: Callable[[Sequence[Change]], Awaitable[None]],
        place: Callable[[int, int], tuple[int, ...]],
        sync_streams: Callable[[Iterable[int], float, Iterable[int]], Awaitable[None]],
        min_free_space: int,
    ) -> None:
        self._store = store
        self._registry = registry
        self._link = link
        self._hold = hold
        self._commit = commit
        self._place = place
        self._sync_streams = sync_streams
        self._min_free_space = min_free_space
        #: seals by cause (metrics)
        self.seals: Counter[str] = Counter()

    async def seal_ranges(
        self, keys: Sequence[tuple[int, int]], timeout: float, *, cause: str = "request"
    ) -> list[Outcome[list[RangeRecord]]]:
        """Seal each ``(stream_id, range_index)`` and create the stream's next
        range; returns the sealed range and the next one. Sealing a range that
        is already sealed returns the current state (an idempotent retry).
        ``cause`` names why, for the seal counts (``seals``)."""
        deadline = trio.current_time() + timeout
        outcomes = await each_outcome(
            deadline, [partial(self.seal_one, sid, index, deadline) for sid, index in keys]
        )
        self.seals[cause] += sum(o.error is None for o in outcomes)
        return outcomes

    async def seal_rolled(self, stream_id: int, range_index: int, cause: str) -> None:
        """Seal an open range that has grown to its roll size (compacted and
        tiered streams)."""
        outcome = (await self.seal_ranges([(stream_id, range_index)], 30.0, cause=cause))[0]
        if outcome.error is not None:
            raise outcome.error

    async def seal_one(
        self, stream_id: int, range_index: int, deadline: float
    ) -> list[RangeRecord]:
        async with self._hold(stream_id):
            stream = require_stream(self._store, stream_id)
            rng = self._store.range(stream_id, range_index)
            if rng is None:
                raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
            if not rng.is_open:
                following = self._store.range(stream_id, range_index + 1)
                return [rng] if following is None else [rng, following]
            # Place first: when no node can take the next range, the open one
            # stays open and writable rather than leaving the stream without one.
            # The next range may go on fewer nodes than replica_nums, down to
            # ack_nums (SPEC §7: degraded, under-replicated).
            nodes = self._place(
                stream.replica_nums, effective_acks(stream.replica_nums, stream.ack_nums)
            )
            acks = effective_acks(len(rng.nodes), stream.ack_nums)
            refusals: dict[int, BaseException] = {}
            held = await seal_replicas(self._link, self._registry, rng, acks, refusals)
            try:
                end = seal_end(list(held.values()), len(rng.nodes), acks)
            except NotEnoughReplicasError as error:
                raise seal_refused(error, refusals) from None
            # A trim may have raised the start past what the replicas had seen.
            leaving = full_and_short(self._registry, self._min_free_space, rng, held, end)
            end = max(end, rng.start_offset)
            sealed = replace(
                rng,
                end_offset=end,
                nodes=tuple(n for n in rng.nodes if n not in leaving),
                replicas_wanted=max(rng.replicas_wanted, len(rng.nodes))
                if leaving
                else rng.replicas_wanted,
            )
            following = RangeRecord(
                stream_id,
                range_index + 1,
                end,
                nodes,
                epoch=stream.epoch,
                replicas_wanted=stream.replica_nums if len(nodes) < stream.replica_nums else 0,
            )
            await self._commit([PutRange(sealed), PutRange(following)])
            if len(nodes) < stream.replica_nums:
                log.warning(
                    "stream %d range %d placed on %d of %d replicas (too few live nodes with room)",
                    stream_id,
                    following.range_index,
                    len(nodes),
                    stream.replica_nums,
                )
            await self._sync_streams([stream_id], deadline, leaving)
            return [sealed, following]
