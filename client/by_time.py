"""Where a stream's offsets are: its end now, and (SPEC §11) the first
offset appended at or after a moment, found range by range from the newest.

Each range is asked (FIND_OFFSETS) on its replicas in turn until one
answers. A range whose first batch is already late enough may have an
earlier range that is too, so the search goes on backwards until a range
answers an offset past its start, or a range with records answers none;
the answer is then the earliest offset found. An empty range is passed
over. Ranges the PM has trimmed away are not asked.
"""

from __future__ import annotations

from sbp import messages
from sbp.errors import RangeNotFoundError, SBPError

from ._routing import ClientContext, primary_of


async def stream_end(context: ClientContext, stream_id: int) -> int:
    """The offset the stream's next record gets: a sealed last range's end,
    else the open range's next offset, asked of its primary (the PM's is a
    snapshot)."""
    ranges = await context.pm.list_stream_ranges(stream_id)
    if not ranges:
        return 0
    last = ranges[-1]
    if not last.is_open:
        return int(last.end_offset)
    described = await context.node(primary_of(last)).describe_range(stream_id, last.range_index)
    return int(described.next_offset)


async def offset_at_time(context: ClientContext, stream_id: int, timestamp_ms: int) -> int:
    """The first offset of the stream appended at or after ``timestamp_ms``;
    the stream's end (next offset) when nothing was.

    An empty range (the open range right after a seal, or one sealed where
    it started) has no record to date, so it says nothing about the time:
    the search passes over it to the ranges before."""
    ranges = await context.pm.list_stream_ranges(stream_id)
    if not ranges:
        raise RangeNotFoundError(f"stream {stream_id} has no ranges")
    end: int | None = None  # the newest range's answer: the end when nothing is late enough
    found: int | None = None
    for rng in reversed(ranges):
        offset, appended_ms = await _find_in_range(context, rng, timestamp_ms)
        if end is None:
            end = offset
        if appended_ms < 0:
            if offset <= rng.start_offset:  # an empty range: look further back
                continue
            break  # every record here is older: the answer is after this range
        found = offset
        if offset > rng.start_offset:
            break
    assert end is not None
    return end if found is None else found


async def _find_in_range(
    context: ClientContext, rng: messages.Range, timestamp_ms: int
) -> tuple[int, int]:
    failure: SBPError | OSError | None = None
    for replica in rng.nodes_primary_first():
        try:
            return await context.node(replica).find_offset(
                rng.stream_id, rng.range_index, timestamp_ms
            )
        except (SBPError, OSError) as error:
            failure = error
    raise RangeNotFoundError(
        f"no replica of stream {rng.stream_id} range {rng.range_index} could find an offset "
        f"by time: {failure}"
    )
