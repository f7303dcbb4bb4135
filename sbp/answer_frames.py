"""Answers in several frames (SPEC §1: a response sequence is one or more
frames), for the answers that grow with the cluster rather than with the
request: LIST_RANGES of a data node or a stream, LIST_GROUPS, and
FETCH_OFFSETS of all of a group's positions.

A frame's header holds at most 2^24 - 1 bytes: about 79,000 ranges of three
replicas, or 4,000 positions with 4 KiB of metadata each. An answer whose
results take more than ``FRAME_BYTES`` (estimated, an upper bound) is cut
into frames:

- LIST_RANGES and LIST_GROUPS are cut inside a result: every frame but the
  last ends with a ``ListRangesResult`` (a ``GroupListing``) whose ranges
  (stream ids) go on in the first result of the next frame, for the same
  owner (group).
- FETCH_OFFSETS is cut between positions.

The ``join_*`` functions put the frames back together; an answer of one
frame is the plain answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Final, Protocol, TypeVar

from . import messages

#: encoded bytes of a frame's results before the answer is cut: well under
#: the header limit whatever the estimates leave out
FRAME_BYTES: Final = 4 * 1024 * 1024
#: a range's encoded bytes besides its replicas, and each replica's besides
#: its address (FlatBuffers tables, vtables, offsets and alignment; over-estimates)
_RANGE_BYTES: Final = 96
_REPLICA_BYTES: Final = 64
#: a group listing's bytes besides its name, and each stream id's
_LISTING_BYTES: Final = 64
_STREAM_ID_BYTES: Final = 8
#: a position's bytes besides its strings
_POSITION_BYTES: Final = 112

Result = TypeVar("Result")
Item = TypeVar("Item")


def range_bytes(rng: messages.Range) -> int:
    """An upper bound of the bytes ``rng`` takes in an encoded answer."""
    return _RANGE_BYTES + sum(
        _REPLICA_BYTES + len(replica.data_node.advertise_addr.encode())
        for replica in rng.replica_nodes
    )


def position_bytes(position: messages.GroupOffsetResult) -> int:
    """An upper bound of the bytes ``position`` takes in an encoded answer."""
    return _POSITION_BYTES + len(position.metadata.encode()) + len(position.error_message.encode())


def listing_bytes(listing: messages.GroupListing) -> int:
    """An upper bound of the bytes ``listing`` takes besides its stream ids."""
    return _LISTING_BYTES + len(listing.group.encode())


def list_ranges_frames(
    results: Sequence[messages.ListRangesResult], frame_bytes: int = FRAME_BYTES
) -> Iterator[messages.ListRangesResponse]:
    """The frames' headers of a LIST_RANGES answer, in order."""
    for part in _cut(
        results,
        lambda result: result.ranges,
        lambda result, ranges: replace(result, ranges=tuple(ranges)),
        range_bytes,
        lambda _: 0,
        frame_bytes,
    ):
        yield messages.ListRangesResponse(list_responses=tuple(part))


def join_list_ranges(
    frames: Sequence[messages.ListRangesResponse],
) -> messages.ListRangesResponse:
    """The answer of ``list_ranges_frames``'s frames (as received, in order)."""
    results = _join(
        [frame.list_responses for frame in frames],
        lambda result, more: replace(result, ranges=result.ranges + more.ranges),
    )
    return _joined(frames, list_responses=results)


def list_groups_frames(
    listings: Sequence[messages.GroupListing], frame_bytes: int = FRAME_BYTES
) -> Iterator[messages.ListGroupsResponse]:
    """The frames' headers of a LIST_GROUPS answer, in order."""
    for part in _cut(
        listings,
        lambda listing: listing.stream_ids,
        lambda listing, ids: replace(listing, stream_ids=tuple(ids)),
        lambda _: _STREAM_ID_BYTES,
        listing_bytes,
        frame_bytes,
    ):
        yield messages.ListGroupsResponse(groups=tuple(part))


def join_list_groups(frames: Sequence[messages.ListGroupsResponse]) -> messages.ListGroupsResponse:
    """The answer of ``list_groups_frames``'s frames (as received, in order)."""
    listings = _join(
        [frame.groups for frame in frames],
        lambda listing, more: replace(listing, stream_ids=listing.stream_ids + more.stream_ids),
    )
    return _joined(frames, groups=listings)


def fetch_offsets_frames(
    positions: Sequence[messages.GroupOffsetResult], frame_bytes: int = FRAME_BYTES
) -> Iterator[messages.FetchOffsetsResponse]:
    """The frames' headers of a FETCH_OFFSETS answer, in order."""
    part: list[messages.GroupOffsetResult] = []
    used = 0
    for position in positions:
        size = position_bytes(position)
        if used + size > frame_bytes and part:
            yield messages.FetchOffsetsResponse(fetch_responses=tuple(part))
            part, used = [], 0
        part.append(position)
        used += size
    yield messages.FetchOffsetsResponse(fetch_responses=tuple(part))


def join_fetch_offsets(
    frames: Sequence[messages.FetchOffsetsResponse],
) -> messages.FetchOffsetsResponse:
    """The answer of ``fetch_offsets_frames``'s frames (as received, in order)."""
    positions = tuple(position for frame in frames for position in frame.fetch_responses)
    return _joined(frames, fetch_responses=positions)


def _cut(
    results: Sequence[Result],
    items_of: Callable[[Result], Sequence[Item]],
    with_items: Callable[[Result, Sequence[Item]], Result],
    item_bytes: Callable[[Item], int],
    result_bytes: Callable[[Result], int],
    frame_bytes: int,
) -> Iterator[list[Result]]:
    """The results in runs, one per frame, each taking at most
    ``frame_bytes`` unless a single item does: a run is cut inside a result
    (before its first item, if need be), and the next run goes on with it."""
    part: list[Result] = []
    used = 0
    for result in results:
        items = items_of(result)
        used += result_bytes(result)
        start = 0
        for i, item in enumerate(items):
            size = item_bytes(item)
            if used + size > frame_bytes and (part or i > start):
                part.append(with_items(result, items[start:i]))
                yield part
                part, used, start = [], result_bytes(result), i
            used += size
        part.append(result if start == 0 else with_items(result, items[start:]))
    yield part


def _join(
    parts: Sequence[Sequence[Result]], go_on: Callable[[Result, Result], Result]
) -> tuple[Result, ...]:
    """The results of ``_cut``'s runs: the first result of every run after
    the first goes on with the last result before it."""
    results: list[Result] = []
    for k, part in enumerate(parts):
        for i, result in enumerate(part):
            if k and i == 0:
                results[-1] = go_on(results[-1], result)
            else:
                results.append(result)
    return tuple(results)


class _Answer(Protocol):
    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def throttle_time_ms(self) -> int: ...


Answer = TypeVar("Answer", bound=_Answer)


def _joined(frames: Sequence[Answer], **results: tuple[Any, ...]) -> Answer:
    """The first frame with the results of all of them (and the longest
    throttle time any asks for); a single frame as it is."""
    if len(frames) == 1:
        return frames[0]
    throttle = max(frame.throttle_time_ms for frame in frames)
    return replace(frames[0], throttle_time_ms=throttle, **results)
