"""What a data node that was away missed: the comparison of its own listing
(LIST_RANGES by data node, asked of the node) with the PM's metadata.

The PM tells only live nodes of a change (a dead one would just be waited
for), so a node that was dead, unreachable past a request's deadline, or
down while the PM restarted may still hold streams deleted since, ranges
trimmed away since, or an open range sealed since. ``plan`` finds them; the
manager then sends DELETE_STREAMS and SYNC_RANGES (see
``pm.reconciler``).

A stream the node has and the PM does not is deleted only when its id is
below the next id the PM would hand out: stream ids are never reused, so
such a stream existed here and was deleted. A higher id was never created
by this PM (a data directory from another cluster, say); it is reported and
left alone rather than destroyed, and recorded as foreign in the metadata,
since the next id then moves past it so that no new stream takes its id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from .records import RangeRecord


@dataclass
class ReconcilePlan:
    """Streams to delete on the node, to sync to it, and to leave alone."""

    delete: list[int] = field(default_factory=list)
    sync: list[int] = field(default_factory=list)
    foreign: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.delete or self.sync)


def _shape(ranges: Iterable[RangeRecord]) -> set[tuple[int, int, int]]:
    """What must agree between the node and the PM, range by range."""
    return {(r.range_index, r.start_offset, r.end_offset) for r in ranges}


def plan(
    on_node: Iterable[RangeRecord],
    in_metadata: Iterable[RangeRecord],
    stream_exists: Callable[[int], bool],
    next_stream_id: int,
    foreign: AbstractSet[int] = frozenset(),
) -> ReconcilePlan:
    """Compare the ranges a node lists (``on_node``) with those the metadata
    places on it (``in_metadata``); ``stream_exists`` asks the metadata, and
    ``foreign`` holds the streams found foreign before (the next id has
    moved past them since)."""
    node_view: dict[int, list[RangeRecord]] = defaultdict(list)
    pm_view: dict[int, list[RangeRecord]] = defaultdict(list)
    for rng in on_node:
        node_view[rng.stream_id].append(rng)
    for rng in in_metadata:
        pm_view[rng.stream_id].append(rng)
    result = ReconcilePlan()
    for stream_id in sorted(node_view.keys() | pm_view.keys()):
        if stream_id not in pm_view and not stream_exists(stream_id):
            if stream_id < next_stream_id and stream_id not in foreign:
                result.delete.append(stream_id)
            else:
                result.foreign.append(stream_id)
        elif _shape(node_view.get(stream_id, ())) != _shape(pm_view.get(stream_id, ())):
            # trimmed (ranges gone, a later start), sealed, or never heard of here
            result.sync.append(stream_id)
    return result


def id_list(ids: Sequence[int], shown: int = 10) -> str:
    """Ids for a log line: the first few and how many more."""
    text = ", ".join(str(i) for i in ids[:shown])
    return text if len(ids) <= shown else f"{text} and {len(ids) - shown} more"
