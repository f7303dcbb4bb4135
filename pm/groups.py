"""Consumer groups (SPEC §11): positions kept in the PM's metadata, and the
streams' end offsets that turn them into lag.

- COMMIT_OFFSETS checks each item (the stream exists, the offset lies
  between its first offset and its end, metadata ≤ 4 KiB) and writes the
  items that pass in one metadata commit, so they land together or not at
  all. An offset past the end the PM last learned is checked again against
  the open range's primary before it is refused.
- ``StreamEnds`` learns the next offset of every stream a group has a
  position on by asking the open ranges' primaries with DESCRIBE_RANGES,
  one request per node for up to 1,000 ranges, every ``interval``. It keeps
  when each end was seen, which dates records for the lag in seconds: the
  oldest record a group has not read was appended between the last time the
  end was at or below it and the first time it was past it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from sbp.constants import (
    MAX_GROUP_COMMIT_ITEMS,
    MAX_GROUP_METADATA_BYTES,
    MAX_GROUP_NAME_BYTES,
)
from sbp.errors import (
    GroupNotFoundError,
    InvalidRequestError,
    OffsetOutOfRangeError,
    ProtocolError,
    SBPError,
    StreamNotFoundError,
)

from .metadata import Change, DeleteGroup, Metadata, PutGroupOffsets
from .records import GroupOffsetRecord, Outcome, RangeRecord

log = logging.getLogger(__name__)

#: end samples kept per stream for the lag in seconds
END_SAMPLES: Final = 720
#: how long one round of end offsets may take
END_TIMEOUT_S: Final = 5.0


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


def check_group_name(group: str) -> None:
    size = len(group.encode())
    if size == 0:
        raise InvalidRequestError(
            f"a consumer group name is 1 to {MAX_GROUP_NAME_BYTES} bytes; it is empty"
        )
    if size > MAX_GROUP_NAME_BYTES:
        raise InvalidRequestError(
            f"a consumer group name is 1 to {MAX_GROUP_NAME_BYTES} bytes; {size} given"
        )


@dataclass(frozen=True, slots=True)
class OffsetItem:
    """One item of a COMMIT_OFFSETS."""

    stream_id: int
    offset: int
    metadata: str = ""


class EndCalls(Protocol):
    """What ``StreamEnds`` asks of the data nodes (``pm.datanode_link``)."""

    async def ends_of_open_ranges(
        self, node_id: int, ranges: Sequence[RangeRecord]
    ) -> dict[int, int]:
        """DESCRIBE_RANGES of open ranges on their primary: next offset by stream."""


class StreamEnds:
    """The end offsets of streams, as last learned, with when each was seen.

    Each stream's samples are two lists (when, end), oldest first, one
    sample per change of the end. They are only appended to, or replaced
    whole, so that /metrics can read them from its own thread."""

    def __init__(
        self,
        store: Metadata,
        link: EndCalls,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self._store = store
        self._link = link
        self._clock_ms = clock_ms
        #: stream id -> (seen at ms, end offset)
        self._samples: dict[int, tuple[list[int], list[int]]] = {}

    def end(self, stream_id: int) -> int | None:
        samples = self._samples.get(stream_id)
        return samples[1][-1] if samples else None

    def note(self, stream_id: int, end: int, now_ms: int | None = None) -> None:
        """Record the stream's end as seen now."""
        now = self._clock_ms() if now_ms is None else now_ms
        samples = self._samples.get(stream_id)
        if samples is not None and samples[1][-1] == end:
            return
        if samples is None or end < samples[1][-1]:
            # new, or trimmed or recreated: the old dates mean nothing
            self._samples[stream_id] = ([now], [end])
            return
        times, ends = samples
        if len(ends) >= 2 * END_SAMPLES:
            self._samples[stream_id] = ([*times[-END_SAMPLES:], now], [*ends[-END_SAMPLES:], end])
            return
        times.append(now)  # the time first: a reader that sees the end sees its time
        ends.append(end)

    def forget_others(self, stream_ids: Iterable[int]) -> None:
        """Keep only these streams' ends (the others lost their last position)."""
        keep = set(stream_ids)
        for stream_id in [s for s in self._samples if s not in keep]:
            del self._samples[stream_id]

    def age_ms(self, stream_id: int, offset: int, now_ms: int | None = None) -> int | None:
        """How long ago the record at ``offset`` was appended, as the end
        samples date it: 0 when it is not appended yet, None when no end is
        known. Before the oldest sample it is at least that sample's age."""
        samples = self._samples.get(stream_id)
        if samples is None:
            return None
        times, ends = samples
        count = len(ends)  # appended to meanwhile: look at what was there
        now = self._clock_ms() if now_ms is None else now_ms
        if offset >= ends[count - 1]:
            return 0
        after = bisect.bisect_right(ends, offset, 0, count)  # the first sample past it
        seen_at, end = times[after], ends[after]
        if after == 0:
            return max(now - seen_at, 0)
        before_at, before_end = times[after - 1], ends[after - 1]
        # appended between the two samples: spread evenly over that time
        share = (offset - before_end) / max(end - before_end, 1)
        return max(now - int(before_at + share * (seen_at - before_at)), 0)

    async def refresh(self, stream_ids: Iterable[int]) -> None:
        """Learn these streams' ends: a sealed last range's end as stored,
        an open one's from its primary (one request per node)."""
        by_primary: dict[int, list[RangeRecord]] = {}
        for stream_id in stream_ids:
            last = self._store.last_range(stream_id)
            if last is None:
                continue
            if not last.is_open:
                self.note(stream_id, last.end_offset)
            else:
                by_primary.setdefault(last.primary, []).append(last)

        async def ask(node_id: int, ranges: list[RangeRecord]) -> None:
            with trio.move_on_after(END_TIMEOUT_S):
                try:
                    found = await self._link.ends_of_open_ranges(node_id, ranges)
                except (SBPError, OSError) as error:
                    log.info("end offsets from data node %d: %s", node_id, error)
                    return
                now = self._clock_ms()
                for stream_id, end in found.items():
                    self.note(stream_id, end, now)

        async with trio.open_nursery() as nursery:
            for node_id, ranges in by_primary.items():
                nursery.start_soon(ask, node_id, ranges)

    async def run(self, streams: Callable[[], set[int]], interval: float) -> None:
        """Forever: refresh the ends of ``streams()`` every ``interval`` seconds."""
        while True:
            wanted = streams()
            self.forget_others(wanted)
            await self.refresh(wanted)
            await trio.sleep(interval)


@dataclass(frozen=True, slots=True)
class Position:
    """A group's position on a stream, with the stream's end and the lag."""

    record: GroupOffsetRecord
    end_offset: int  # -1: unknown
    lag_records: int  # -1: unknown
    lag_ms: int | None  # None: unknown


class ConsumerGroups:
    """COMMIT_OFFSETS, FETCH_OFFSETS, LIST_GROUPS and DELETE_GROUPS over the
    metadata, committing through ``commit`` (the manager's: HA's guard)."""

    def __init__(
        self,
        store: Metadata,
        commit: Callable[[Sequence[Change]], Awaitable[None]],
        ends: StreamEnds,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self._store = store
        self._commit = commit
        self.ends = ends
        self._clock_ms = clock_ms
        #: commits stored, by group (metrics: the commit rate)
        self.commits: dict[str, int] = {}
        #: every position, by group and stream: read from the metadata when
        #: this PM starts leading, then kept with each change it commits (it
        #: is the only writer)
        self._held: dict[str, dict[int, GroupOffsetRecord]] = {}
        for record in store.all_group_offsets():
            self._held.setdefault(record.group, {})[record.stream_id] = record

    def forget_streams(self, stream_ids: Iterable[int]) -> None:
        """These streams were deleted, and their positions with them."""
        gone = set(stream_ids)
        held = self._held
        for group, streams in list(held.items()):
            kept = {s: r for s, r in streams.items() if s not in gone}
            if len(kept) != len(streams):
                if kept:
                    held[group] = kept
                else:
                    del held[group]

    async def commit(
        self, group: str, items: Sequence[OffsetItem]
    ) -> list[Outcome[GroupOffsetRecord]]:
        """Store the items that pass their checks, all in one commit; per
        item, the stored position or why it was refused."""
        try:
            check_group_name(group)
            if len(items) > MAX_GROUP_COMMIT_ITEMS:
                raise InvalidRequestError(
                    f"a commit holds at most {MAX_GROUP_COMMIT_ITEMS} positions; {len(items)} given"
                )
            if len({item.stream_id for item in items}) < len(items):
                raise InvalidRequestError("a commit names each stream once")
        except InvalidRequestError as error:
            return [Outcome(error=error) for _ in items]
        now = self._clock_ms()
        outcomes: list[Outcome[GroupOffsetRecord]] = []
        for item in items:
            try:
                await self._check(item)
            except ProtocolError as error:
                outcomes.append(Outcome(error=error))
                continue
            record = GroupOffsetRecord(group, item.stream_id, item.offset, now, item.metadata)
            outcomes.append(Outcome(record))
        stored = tuple(o.value for o in outcomes if o.value is not None)
        if stored:
            await self._commit([PutGroupOffsets(stored)])
            self._held.setdefault(group, {}).update((r.stream_id, r) for r in stored)
            self.commits[group] = self.commits.get(group, 0) + 1
        return outcomes

    async def _check(self, item: OffsetItem) -> None:
        size = len(item.metadata.encode())
        if size > MAX_GROUP_METADATA_BYTES:
            raise InvalidRequestError(
                f"position metadata is at most {MAX_GROUP_METADATA_BYTES} bytes; {size} given"
            )
        ranges = self._store.ranges(item.stream_id)
        if self._store.stream(item.stream_id) is None or not ranges:
            raise StreamNotFoundError(f"no stream {item.stream_id}")
        first = ranges[0].start_offset
        end = self.ends.end(item.stream_id)
        if end is None or item.offset > end:
            await self.ends.refresh([item.stream_id])
            end = self.ends.end(item.stream_id)
        if end is None:
            end = ranges[-1].start_offset if ranges[-1].is_open else ranges[-1].end_offset
        if not first <= item.offset <= end:
            raise OffsetOutOfRangeError(
                f"offset {item.offset} is outside stream {item.stream_id}'s "
                f"offsets {first} to {end}"
            )

    def fetch(self, group: str, stream_ids: Sequence[int]) -> list[Position]:
        """The group's positions on these streams (all of its own when none
        are named; offset -1 where it has none); ``GroupNotFoundError`` for
        an unknown group."""
        check_group_name(group)
        held = self._held.get(group)
        if not held:
            raise GroupNotFoundError(f"no consumer group {group!r}")
        wanted = list(stream_ids) if stream_ids else sorted(held)
        return [self.position(held.get(s) or GroupOffsetRecord(group, s, -1, 0)) for s in wanted]

    def position(self, record: GroupOffsetRecord) -> Position:
        end = self.ends.end(record.stream_id)
        if end is None or record.offset < 0:
            return Position(record, -1 if end is None else end, -1, None)
        lag = max(end - record.offset, 0)
        return Position(record, end, lag, self.ends.age_ms(record.stream_id, record.offset))

    def records(self) -> list[GroupOffsetRecord]:
        """Every position, by group and stream id (LIST_GROUPS, /metrics)."""
        # /metrics reads from its own thread: list() copies a dict in one step
        groups = sorted(list(self._held.items()), key=lambda item: item[0].encode())
        found: list[GroupOffsetRecord] = []
        for _, held in groups:
            found += sorted(list(held.values()), key=lambda r: r.stream_id)
        return found

    def furthest_behind(self, count: int) -> tuple[list[Position], int]:
        """The ``count`` positions furthest behind in records (those with no
        known end last), with the lag in seconds; and how many there are.
        Only those shown are dated, so a scrape of many positions stays cheap."""
        records = self.records()
        ends = self.ends

        def behind(record: GroupOffsetRecord) -> int:
            end = ends.end(record.stream_id)
            return -1 if end is None else max(end - record.offset, 0)

        lags = [(behind(r), r) for r in records]
        lags.sort(key=lambda item: (-item[0], item[1].group, item[1].stream_id))
        return [self.position(r) for _, r in lags[:count]], len(records)

    def streams_with_positions(self) -> set[int]:
        return {s for held in list(self._held.values()) for s in list(held)}

    async def delete(self, groups: Sequence[str]) -> list[ProtocolError | None]:
        """Forget whole groups; per group, None or why not."""
        outcomes: list[ProtocolError | None] = []
        doomed: list[str] = []
        for group in groups:
            try:
                check_group_name(group)
                if not self._held.get(group):
                    raise GroupNotFoundError(f"no consumer group {group!r}")
            except ProtocolError as error:
                outcomes.append(error)
                continue
            outcomes.append(None)
            doomed.append(group)
        if doomed:
            await self._commit([DeleteGroup(group) for group in doomed])
            for group in doomed:
                self.commits.pop(group, None)
                self._held.pop(group, None)
        return outcomes
