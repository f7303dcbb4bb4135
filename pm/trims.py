"""TRIM_STREAMS: each ``(stream_id, trim_offset)`` drops the ranges wholly
below the offset, and the first remaining range starts at it, under the
stream's lock. A trim into the open range is checked against the primary's
next offset (OFFSET_OUT_OF_RANGE beyond it); the nodes that hosted only
dropped ranges hear of the trim too, so that they free them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from functools import partial
from typing import Protocol

import trio

from sbp.errors import (
    InvalidRequestError,
    OffsetOutOfRangeError,
    RangeNotFoundError,
)

from .batches import each_outcome
from .changes import Change, DeleteRange, Metadata, PutRange, require_stream
from .records import Outcome, RangeRecord, StreamRecord


class NextOffsetCall(Protocol):
    async def next_offset(self, rng: RangeRecord) -> int: ...


async def trim_streams(
    store: Metadata,
    link: NextOffsetCall,
    hold: Callable[[int], AbstractAsyncContextManager[None]],
    commit: Callable[[Sequence[Change]], Awaitable[None]],
    sync_stream: Callable[[int, float, Iterable[int]], Awaitable[None]],
    trims: Sequence[tuple[int, int]],
    timeout: float,
) -> list[Outcome[tuple[StreamRecord, RangeRecord]]]:
    """See the module docstring: each stream and its first range after the trim."""
    deadline = trio.current_time() + timeout

    async def trim_one(stream_id: int, trim_offset: int) -> tuple[StreamRecord, RangeRecord]:
        if trim_offset < 0:
            raise InvalidRequestError(f"trim offset {trim_offset} is negative")
        async with hold(stream_id):
            stream = require_stream(store, stream_id)
            ranges = store.ranges(stream_id)
            if not ranges:
                raise RangeNotFoundError(f"stream {stream_id} has no ranges")
            if trim_offset <= ranges[0].start_offset:
                return stream, ranges[0]  # already trimmed that far: nothing to do
            last = ranges[-1]
            if last.is_open and trim_offset > last.start_offset:
                next_offset = await link.next_offset(last)
                if trim_offset > next_offset:
                    raise OffsetOutOfRangeError(
                        f"trim offset {trim_offset} is past stream {stream_id}'s "
                        f"next offset {next_offset}"
                    )
            elif not last.is_open and trim_offset > last.end_offset:
                raise OffsetOutOfRangeError(
                    f"trim offset {trim_offset} is past stream {stream_id}'s end {last.end_offset}"
                )
            kept = [r for r in ranges if r.is_open or r.end_offset > trim_offset]
            dropped = ranges[: len(ranges) - len(kept)]
            first = replace(kept[0], start_offset=max(kept[0].start_offset, trim_offset))
            changes: list[Change] = [DeleteRange(r.stream_id, r.range_index) for r in dropped]
            changes.append(PutRange(first))
            await commit(changes)
            await sync_stream(stream_id, deadline, {n for r in dropped for n in r.nodes})
            return stream, first

    return await each_outcome(
        deadline, [partial(trim_one, stream_id, offset) for stream_id, offset in trims]
    )
