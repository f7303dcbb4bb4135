"""Sealing a range on its replicas (SPEC §7), for ``PlacementManager.seal_one``:
ask every replica to seal and gather the next offsets they answer
(``seal_replicas``), say why a seal failed (``seal_refused``), and pick the
full replicas that hold less than the sealed range and leave it
(``full_and_short``). The end itself is ``sbp.replication.seal_end``.
"""

from __future__ import annotations

import logging
import math
from typing import Final, Protocol

import trio

from sbp.enums import ErrorCode
from sbp.errors import EpochFencedError, NotEnoughReplicasError, ProtocolError, SBPError

from .liveness import NodeRegistry
from .records import RangeRecord

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
