"""Consumer groups (SPEC §11): positions kept in the PM's metadata, and the
streams' end offsets that turn them into lag.

- COMMIT_OFFSETS checks each item (the stream exists, the offset lies
  between its first offset and its end, metadata ≤ 4 KiB) and writes the
  items that pass in one metadata commit, so they land together or not at
  all. An offset past the end the PM last learned is checked again against
  the open range's primary before it is refused.
- ``StreamEnds`` learns the next offset of every stream a group has a
  position on by asking the open ranges' primaries with DESCRIBE_RANGES,
  one request per node for up to 1,000 ranges, every ``interval``.
- ``RecordTimes`` then reads the timestamp of the oldest record each group
  has not read (``client.lag``, as ``sbp groups describe`` does): the lag in
  seconds is its age.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from client.lag import lag_seconds
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

from .changes import Change, DeleteGroup, Metadata, PutGroupOffsets
from .members import GroupMembers
from .records import GroupOffsetRecord, Outcome, RangeRecord

log = logging.getLogger(__name__)

#: how long one round of end offsets (or one record's time) may take
END_TIMEOUT_S: Final = 5.0
#: oldest unread records whose time is read in one round, at most
DATED_PER_ROUND: Final = 1000


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
    """What ``StreamEnds`` and ``RecordTimes`` ask of the data nodes
    (``pm.datanode_link``)."""

    async def ends_of_open_ranges(
        self, node_id: int, ranges: Sequence[RangeRecord]
    ) -> dict[int, int]:
        """DESCRIBE_RANGES of open ranges on their primary: next offset by stream."""

    async def record_timestamp(self, node_id: int, stream_id: int, offset: int) -> int | None:
        """The timestamp of the record at ``offset``, read from the node (``client.lag``)."""


class StreamEnds:
    """The end offsets of streams, as last learned. The map is replaced,
    never changed in place, so that /metrics can read it from its own thread."""

    def __init__(self, store: Metadata, link: EndCalls) -> None:
        self._store = store
        self._link = link
        self._ends: dict[int, int] = {}
        #: by stream: the range its end was last read from, and whether it was open
        self._read_from: dict[int, tuple[int, bool]] = {}

    def end(self, stream_id: int) -> int | None:
        return self._ends.get(stream_id)

    def note(self, found: dict[int, int], ranges: dict[int, int], *, sealed: bool) -> None:
        """Record these streams' ends, read from the ranges ``ranges`` names
        (stream -> range index), sealed or open. Two refreshes may be
        answered in either order: an open range's end never goes below one
        already read from it, and is not taken once that range or a later
        one is known sealed."""
        read_from = self._read_from
        taken: dict[int, int] = {}
        for stream_id, end in found.items():
            index = ranges[stream_id]
            known = read_from.get(stream_id)
            if not sealed and known is not None:
                known_index, known_open = known
                if known_index > index or (known_index == index and not known_open):
                    continue  # an answer from before a seal
                if known_index == index:
                    end = max(end, self._ends.get(stream_id, end))
            taken[stream_id] = end
        self._read_from = {**read_from, **{s: (ranges[s], not sealed) for s in taken}}
        if any(self._ends.get(s) != end for s, end in taken.items()):
            self._ends = {**self._ends, **taken}

    def forget_others(self, stream_ids: Iterable[int]) -> None:
        """Keep only these streams' ends (the others lost their last position)."""
        keep = set(stream_ids)
        if any(s not in keep for s in self._ends):
            self._ends = {s: end for s, end in self._ends.items() if s in keep}
            self._read_from = {s: r for s, r in self._read_from.items() if s in keep}

    async def refresh(self, stream_ids: Iterable[int]) -> None:
        """Learn these streams' ends: a sealed last range's end as stored,
        an open one's from its primary (one request per node)."""
        by_primary: dict[int, list[RangeRecord]] = {}
        sealed: dict[int, int] = {}
        sealed_ranges: dict[int, int] = {}
        for stream_id in stream_ids:
            last = self._store.last_range(stream_id)
            if last is None:
                continue
            if not last.is_open:
                sealed[stream_id] = last.end_offset
                sealed_ranges[stream_id] = last.range_index
            else:
                by_primary.setdefault(last.primary, []).append(last)
        self.note(sealed, sealed_ranges, sealed=True)

        async def ask(node_id: int, ranges: list[RangeRecord]) -> None:
            with trio.move_on_after(END_TIMEOUT_S):
                try:
                    found = await self._link.ends_of_open_ranges(node_id, ranges)
                except (SBPError, OSError) as error:
                    log.info("end offsets from data node %d: %s", node_id, error)
                    return
                self.note(found, {r.stream_id: r.range_index for r in ranges}, sealed=False)

        async with trio.open_nursery() as nursery:
            for node_id, ranges in by_primary.items():
                nursery.start_soon(ask, node_id, ranges)


class RecordTimes:
    """The timestamps of the oldest records groups have not read, by
    (stream, offset), read from the replicas (``client.lag``): what dates
    the lag in seconds. A record's timestamp never changes, so each is read
    once for as long as a group stays at its offset. Replaced whole, never
    changed in place (/metrics reads it from its own thread)."""

    def __init__(self, store: Metadata, link: EndCalls) -> None:
        self._store = store
        self._link = link
        self._times: dict[tuple[int, int], int] = {}

    def get(self, stream_id: int, offset: int) -> int | None:
        return self._times.get((stream_id, offset))

    async def learn(self, wanted: Sequence[tuple[int, int]]) -> None:
        """Keep the times of ``wanted`` (stream, offset) pairs only, reading
        those not known yet, at most ``DATED_PER_ROUND`` of them, from a
        replica of the range that holds each (its primary first)."""
        keep = set(wanted)
        known = {key: t for key, t in self._times.items() if key in keep}
        missing = [key for key in wanted if key not in known][:DATED_PER_ROUND]
        found: dict[tuple[int, int], int] = {}

        async def read(stream_id: int, offset: int) -> None:
            holder = next(
                (r for r in reversed(self._store.ranges(stream_id)) if r.start_offset <= offset),
                None,
            )
            if holder is None:
                return
            for node_id in holder.nodes:
                with trio.move_on_after(END_TIMEOUT_S):
                    try:
                        when = await self._link.record_timestamp(node_id, stream_id, offset)
                    except (SBPError, OSError) as error:
                        log.debug("record time of stream %d at %d: %s", stream_id, offset, error)
                        continue
                    if when is not None:
                        found[(stream_id, offset)] = when
                    return

        async with trio.open_nursery() as nursery:
            for stream_id, offset in missing:
                nursery.start_soon(read, stream_id, offset)
        self._times = {**known, **found}


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
        times: RecordTimes,
        members: GroupMembers,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self._store = store
        #: the groups' members (SPEC §15): who may commit
        self.members = members
        self._commit = commit
        self.ends = ends
        self.times = times
        self._clock_ms = clock_ms
        #: commits stored, by group (metrics: the commit rate)
        self.commits: dict[str, int] = {}
        #: set by each commit: its positions are dated at once (``run``)
        self._committed = trio.Event()
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
        self, group: str, items: Sequence[OffsetItem], member_id: str = "", member_epoch: int = -1
    ) -> list[Outcome[GroupOffsetRecord]]:
        """Store the items that pass their checks, all in one commit; per
        item, the stored position or why it was refused. A member's commit
        (``member_id``) is fenced by its epoch and holdings (SPEC §15)."""
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
        fenced = self.members.check_commit(
            group, member_id, member_epoch, [item.stream_id for item in items]
        )
        outcomes: list[Outcome[GroupOffsetRecord]] = []
        for item, refused in zip(items, fenced, strict=True):
            try:
                if refused is not None:
                    raise refused
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
            self._committed.set()
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
        seconds = lag_seconds(
            record.offset,
            end,
            self.times.get(record.stream_id, record.offset),
            self._clock_ms(),
        )
        return Position(record, end, lag, None if seconds is None else int(seconds * 1000))

    async def run(self, interval: float) -> None:
        """Forever: every ``interval`` seconds the ends of the streams groups
        read; then, and right after each commit, the times of the oldest
        records they have not read (so a moved position is dated within a
        FETCH, not an interval, later)."""
        refresh_at = 0.0
        while True:
            if trio.current_time() >= refresh_at:
                wanted = self.streams_with_positions()
                self.ends.forget_others(wanted)
                await self.ends.refresh(wanted)
                refresh_at = trio.current_time() + interval
            self._committed = trio.Event()
            behind = sorted(
                (r.offset - (self.ends.end(r.stream_id) or 0), r.stream_id, r.offset)
                for r in self.records()
                if 0 <= r.offset < (self.ends.end(r.stream_id) or 0)
            )  # the furthest behind first, as /metrics shows them
            await self.times.learn([(stream_id, offset) for _, stream_id, offset in behind])
            with trio.move_on_at(refresh_at):
                await self._committed.wait()

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
                members = len(self.members.members(group))
                if members:
                    raise InvalidRequestError(
                        f"group {group!r} has {members} live members; remove them first "
                        "(sbp groups delete --force)"
                    )
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
