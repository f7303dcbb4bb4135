"""How a range replica's stored state changes (SPEC §7): the rules storage
carries out inside the writer's transaction, as pure functions. Each takes
what this replica holds and what came in, and returns what to store and what
to drop; none reads or writes anything, so the callers in ``commands`` and
``writer`` only persist what is decided here.

``datanode.replica_state`` names the states these produce (LEADING,
FOLLOWING, FENCED, SEALED_HERE, SHORT, WHOLE) and decides everything that is
not stored: commit offsets, how far a replica is read, when a range sealed
here is settled on the PM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from .model import RangeInfo, hosts


def seal_here(local: RangeInfo, held_next: int) -> RangeInfo:
    """SEAL_RANGES: LEADING, FOLLOWING or FENCED -> SEALED_HERE, ended at
    what this replica holds (``held_next``, the stream's next offset here);
    the PM's end, maybe lower, comes later with SYNC_RANGES. A sealed range
    is left as it is: sealing is one-way."""
    if not local.is_open:
        return local
    return dataclasses.replace(
        local, end_offset=max(held_next, local.start_offset), sealed_here=True
    )


@dataclasses.dataclass(frozen=True)
class SyncedRange:
    """What a SYNC_RANGES makes of one range held here."""

    #: the range as stored from now on
    info: RangeInfo
    #: the PM sealed the range below what this replica holds: the records
    #: from here on were never acknowledged and are dropped (SPEC §7)
    excess_from: int | None = None
    #: the range is sealed and moved to other nodes (a drain, a rebalance,
    #: a repair): its records here are dropped
    moved_off: bool = False


def sync_range(
    local: RangeInfo | None, incoming: RangeInfo, held_next: int, node_id: int | None
) -> SyncedRange:
    """One range of the PM's view (``incoming``) against this replica's
    (``local``, None when new here; ``held_next`` the stream's next offset
    here):

    - new or open on both: the PM's view is taken (LEADING or FOLLOWING);
    - sealed here, still open in the PM's view (it has not heard yet): it
      stays SEALED_HERE at its provisional end;
    - sealed by the PM: SHORT or WHOLE at the PM's end, dropping what this
      replica holds past it;
    - sealed and no longer naming this node: its records here are dropped.
    """
    info = dataclasses.replace(incoming, deleted=False, next_offset=0, sealed_here=False)
    if local is None:
        return SyncedRange(info)
    excess_from = None
    if not local.is_open and info.is_open:
        info = dataclasses.replace(info, end_offset=local.end_offset, sealed_here=local.sealed_here)
    elif not info.is_open:
        held_top = held_next if local.is_open else local.end_offset
        if held_top > info.end_offset:
            excess_from = info.end_offset
    moved_off = hosts(local, node_id) and not hosts(info, node_id) and not info.is_open
    return SyncedRange(info, excess_from, moved_off)


def fenced_by_failed_commit(
    appended_ranges: Iterable[tuple[int, int]], handed_on_streams: Collection[int]
) -> set[tuple[int, int]]:
    """LEADING -> FENCED: a commit failed after its batches went to the
    followers. The ranges appended to in that transaction, of the streams
    whose batches were handed on, may have those offsets on followers
    already, and this node would give them out again: they take no more
    appends here until the PM seals them."""
    return {key for key in appended_ranges if key[0] in handed_on_streams}
