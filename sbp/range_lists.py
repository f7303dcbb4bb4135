"""LIST_RANGES answers in several frames (SPEC §1: a response sequence is
one or more frames).

A data node or a stream can have more ranges than one frame's header holds
(2^24 - 1 bytes: about 79,000 ranges of three replicas). The answer is then
cut into frames, always inside a result: every frame but the last ends with
a ``ListRangesResult`` whose ranges go on in the first result of the next
frame, for the same owner. ``join_list_frames`` puts them back together;
an answer of one frame is the plain answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Final

from . import messages

#: encoded bytes of a frame's ranges before the answer is cut: well under
#: the header limit whatever the ranges' replicas and addresses
FRAME_RANGE_BYTES: Final = 4 * 1024 * 1024
#: a range's encoded bytes besides its replicas, and each replica's besides
#: its address (FlatBuffers tables, vtables, offsets and alignment; over-estimates)
_RANGE_BYTES: Final = 96
_REPLICA_BYTES: Final = 64


def encoded_size(rng: messages.Range) -> int:
    """An upper bound of the bytes ``rng`` takes in an encoded answer."""
    return _RANGE_BYTES + sum(
        _REPLICA_BYTES + len(replica.data_node.advertise_addr.encode())
        for replica in rng.replica_nodes
    )


def list_frames(
    results: Sequence[messages.ListRangesResult], frame_bytes: int = FRAME_RANGE_BYTES
) -> Iterator[messages.ListRangesResponse]:
    """The frames' headers of the answer ``results``, in order: one frame
    unless their ranges take more than ``frame_bytes``, and none whose
    ranges do unless a single range does."""
    frame: list[messages.ListRangesResult] = []
    used = 0
    for result in results:
        start = 0
        for i, rng in enumerate(result.ranges):
            size = encoded_size(rng)
            if used + size > frame_bytes and used:
                # cut inside this result (before its first range, if need
                # be): the next frame goes on with it
                frame.append(replace(result, ranges=result.ranges[start:i]))
                yield messages.ListRangesResponse(list_responses=tuple(frame))
                frame, used, start = [], 0, i
            used += size
        frame.append(result if start == 0 else replace(result, ranges=result.ranges[start:]))
    yield messages.ListRangesResponse(list_responses=tuple(frame))


def join_list_frames(
    frames: Sequence[messages.ListRangesResponse],
) -> messages.ListRangesResponse:
    """The answer of ``list_frames``'s frames (as received, in order)."""
    if len(frames) == 1:
        return frames[0]
    results: list[messages.ListRangesResult] = []
    continued = False
    for frame in frames:
        for i, result in enumerate(frame.list_responses):
            if continued and i == 0:
                results[-1] = replace(results[-1], ranges=results[-1].ranges + result.ranges)
            else:
                results.append(result)
        continued = True
    throttle = max(frame.throttle_time_ms for frame in frames)
    return messages.ListRangesResponse(throttle_time_ms=throttle, list_responses=tuple(results))
