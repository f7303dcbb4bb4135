"""Compacted streams (SPEC §13): the PM's passes over their sealed ranges.

A stream's ranges live on different nodes, so no node can tell alone which
record of a key is the latest. The PM does, as Kafka's cleaner does for a
log: it keeps, per stream, how far compaction has been applied (the clean
end). A pass

1. asks a replica of each sealed range past the clean end (oldest first:
   the dirty ranges) what the range holds of each key (COMPACTION_KEYS: a
   16-byte hash and its latest offset there), stopping at a range appended
   to less than ``min_compaction_lag_ms`` ago, or when the map would pass
   ``max_keys`` (the rest waits for the next pass: a prefix of the dirty
   ranges is compacted, and the clean end moves past it);
2. merges them into one map of each key's latest offset;
3. has every replica of every sealed range up to the last dirty one taken
   rewrite it by that map (COMPACT_RANGES): a record whose key the map
   gives a later offset is removed, wherever it is. The map is the same for
   all, and the rewrite a function of the bytes and the map alone, so the
   replicas of a range stay alike.

Only once every replica has done its part does the clean end move. A
tombstone that is its key's latest goes once its range was first compacted
``delete_retention_ms`` ago (the PM tells each range whether). The clean end
and the first compaction of each range are kept in memory: a PM that
restarts compacts from the start again (which changes nothing already
compacted) and keeps tombstones longer, never shorter.

Ranges are only compacted once sealed, so an open range of a compacted
stream is sealed once it holds ``roll_bytes``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import numpy as np
import trio

from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import InvalidRequestError, ProtocolError, RequestTimeoutError, SBPError
from sbp.key_hash import KeyMap

from .changes import Metadata
from .liveness import NodeRegistry
from .records import Holding, RangeRecord, StreamRecord
from .rolling import roll_if_full
from .stream_settings import compacted

log = logging.getLogger(__name__)

#: a pass over every compacted stream this often (SPEC §13: within 60 s)
DEFAULT_INTERVAL_S: Final = 60.0
#: keys in one pass's map at most: 24 bytes each in the map the PM builds
#: and sends to each node (12 MiB, under the 16 MiB frame)
DEFAULT_MAX_KEYS: Final = 500_000
#: an open range of a compacted stream is sealed once it holds this much
DEFAULT_ROLL_BYTES: Final = 64 << 20
#: how long one node's part of a pass may take
CALL_TIMEOUT_S: Final = 120.0
_PAGE: Final = 1000


@dataclass(frozen=True, slots=True)
class CompactionSettings:
    """The PM's compaction flags."""

    interval: float = DEFAULT_INTERVAL_S
    max_keys: int = DEFAULT_MAX_KEYS
    roll_bytes: int = DEFAULT_ROLL_BYTES


DEFAULT_COMPACTION: Final = CompactionSettings()


class CompactionCalls(Protocol):
    """What a pass asks of the data nodes (``pm.datanode_link``)."""

    async def compaction_keys(
        self, node_id: int, stream_id: int, range_index: int
    ) -> tuple[KeyMap, int, int]: ...

    async def compact_ranges(
        self, node_id: int, stream_id: int, ranges: Sequence[tuple[int, bool]], keys: KeyMap
    ) -> list[messages.CompactRangeResult]: ...

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]: ...


@dataclass(slots=True)
class StreamCompaction:
    """What the PM knows of one compacted stream's compaction."""

    clean_end: int = 0
    #: by range index: when a pass first compacted it (ms)
    first_compacted: dict[int, int] = field(default_factory=dict)
    #: ranges whose tombstones have been dropped
    tombstones_dropped: set[int] = field(default_factory=set)
    #: by range index: its bytes when last scanned or rewritten
    bytes: dict[int, int] = field(default_factory=dict)
    #: ``dirty_ratio`` after the last pass (metrics)
    dirty: float = 0.0

    def dirty_ratio(self, ranges: Sequence[RangeRecord]) -> float:
        """Of the sealed ranges' bytes known, the share past the clean end."""
        total = dirty = 0
        for rng in ranges:
            size = self.bytes.get(rng.range_index)
            if size is None or rng.is_open:
                continue
            total += size
            if rng.end_offset > self.clean_end:
                dirty += size
        return dirty / total if total else 0.0


@dataclass(slots=True)
class CompactionStats:
    """What passes did, over every stream (metrics)."""

    passes: int = 0
    failed_passes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    records_removed: int = 0
    tombstones_removed: int = 0
    rolls: int = 0


class Compactor:
    """See the module docstring. ``seal(stream_id, range_index)`` seals an
    open range as SEAL_RANGES would."""

    def __init__(
        self,
        store: Metadata,
        link: CompactionCalls,
        registry: NodeRegistry,
        seal: Callable[[int, int], Awaitable[object]],
        *,
        settings: CompactionSettings = DEFAULT_COMPACTION,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        from .groups import wall_clock_ms

        self._store = store
        self._link = link
        self._registry = registry
        self._seal = seal
        self.interval = settings.interval
        self.max_keys = settings.max_keys
        self.roll_bytes = settings.roll_bytes
        self._clock_ms = clock_ms or wall_clock_ms
        self.streams: dict[int, StreamCompaction] = {}
        self.stats = CompactionStats()

    async def run(self) -> None:
        """A pass over every compacted stream each ``interval``."""
        while True:
            await trio.sleep(self.interval)
            await self.pass_all()

    async def pass_all(self) -> None:
        seen: set[int] = set()
        start_after = 0
        while page := self._store.streams(start_after=start_after, limit=_PAGE):
            start_after = page[-1].stream_id
            for stream in page:
                if not compacted(stream):
                    continue
                seen.add(stream.stream_id)
                with trio.move_on_after(CALL_TIMEOUT_S * 2):
                    try:
                        await self.roll(stream)
                        await self.compact(stream)
                    except (SBPError, OSError) as error:
                        self.stats.failed_passes += 1
                        log.info("compaction of stream %d: %s", stream.stream_id, error)
        for stream_id in [s for s in self.streams if s not in seen]:
            del self.streams[stream_id]  # deleted, or no longer compacted

    async def roll(self, stream: StreamRecord) -> None:
        """Seal the stream's open range once it holds ``roll_bytes``: only
        sealed ranges are compacted."""
        if await roll_if_full(
            self._store, self._link, self._seal, stream.stream_id, self.roll_bytes
        ):
            self.stats.rolls += 1

    async def compact(self, stream: StreamRecord) -> bool:
        """One pass over the stream (see the module docstring); whether it
        rewrote anything."""
        state = self.streams.setdefault(stream.stream_id, StreamCompaction())
        sealed = [r for r in self._store.ranges(stream.stream_id) if not r.is_open]
        try:
            return await self._compact(stream, state, sealed) if sealed else False
        finally:
            state.dirty = state.dirty_ratio(sealed)

    async def _compact(
        self, stream: StreamRecord, state: StreamCompaction, sealed: list[RangeRecord]
    ) -> bool:
        sid = stream.stream_id
        now = self._clock_ms()
        state.clean_end = max(state.clean_end, sealed[0].start_offset)
        maps: list[KeyMap] = []
        keys = 0
        dirty_end = state.clean_end
        for rng in sealed:
            if rng.end_offset <= state.clean_end:
                continue
            found, size, last_append_ms = await self._keys_of(rng)
            state.bytes[rng.range_index] = size
            if last_append_ms > now - stream.min_compaction_lag_ms:
                break  # too young: it and the ranges after it wait
            if maps and keys + len(found) > self.max_keys:
                log.info(
                    "stream %d: compacting up to offset %d this pass; the keys past it "
                    "would pass the map's %d",
                    sid,
                    dirty_end,
                    self.max_keys,
                )
                break
            maps.append(found)
            keys += len(found)
            dirty_end = rng.end_offset
        expiring = {
            rng.range_index
            for rng in sealed
            if rng.range_index in state.first_compacted
            and rng.range_index not in state.tombstones_dropped
            and now - state.first_compacted[rng.range_index] >= stream.delete_retention_ms
        }
        if dirty_end == state.clean_end and not expiring:
            return False
        key_map = _merged(maps)
        targets = [r for r in sealed if r.end_offset <= dirty_end or r.range_index in expiring]
        if not maps:
            targets = [r for r in sealed if r.range_index in expiring]
        done = await self._rewrite(stream, targets, key_map, expiring)
        self.stats.passes += 1
        if not done:
            self.stats.failed_passes += 1
            return False
        state.clean_end = max(state.clean_end, dirty_end)
        for rng in targets:
            state.first_compacted.setdefault(rng.range_index, now)
        state.tombstones_dropped |= expiring
        return True

    async def _keys_of(self, rng: RangeRecord) -> tuple[KeyMap, int, int]:
        """What the range holds of each key, asked of its live replicas in
        turn (primary first)."""
        failure: BaseException | None = None
        for node_id in rng.nodes:
            if not self._registry.is_alive(node_id):
                continue
            with trio.move_on_after(CALL_TIMEOUT_S):
                try:
                    return await self._link.compaction_keys(node_id, rng.stream_id, rng.range_index)
                except (SBPError, OSError) as error:
                    failure = error
        raise ProtocolError(
            f"no replica of stream {rng.stream_id} range {rng.range_index} gave its keys"
            + (f": {failure}" if failure else "")
        )

    async def _rewrite(
        self,
        stream: StreamRecord,
        targets: Sequence[RangeRecord],
        keys: KeyMap,
        expiring: set[int],
    ) -> bool:
        """Every replica of ``targets`` rewrites them by ``keys``; whether
        all did."""
        by_node: dict[int, list[tuple[int, bool]]] = defaultdict(list)
        for rng in targets:
            for node_id in rng.nodes:
                by_node[node_id].append((rng.range_index, rng.range_index in expiring))
        failures: list[str] = []
        state = self.streams[stream.stream_id]
        stats = self.stats

        async def one(node_id: int, ranges: list[tuple[int, bool]]) -> None:
            if not self._registry.is_alive(node_id):
                failures.append(f"node {node_id} is dead")
                return
            with trio.move_on_after(CALL_TIMEOUT_S) as scope:
                try:
                    results = await self._link.compact_ranges(
                        node_id, stream.stream_id, ranges, keys
                    )
                except (SBPError, OSError) as error:
                    failures.append(f"node {node_id}: {error}")
                    return
            if scope.cancelled_caught:
                failures.append(f"node {node_id}: no answer in {CALL_TIMEOUT_S:g} s")
                return
            for result in results:
                if result.error_code != ErrorCode.NONE:
                    failures.append(
                        f"node {node_id} range {result.range_index}: {result.error_message}"
                    )
                    continue
                state.bytes[result.range_index] = result.bytes_after + (
                    state.bytes.get(result.range_index, 0) - result.bytes_before
                    if result.range_index in state.bytes
                    else 0
                )
                stats.bytes_before += result.bytes_before
                stats.bytes_after += result.bytes_after
                stats.records_removed += result.records_removed
                stats.tombstones_removed += result.tombstones_removed

        async with trio.open_nursery() as nursery:
            for node_id, ranges in by_node.items():
                nursery.start_soon(one, node_id, ranges)
        if failures:
            log.info(
                "compaction of stream %d waits for the next pass: %s",
                stream.stream_id,
                "; ".join(failures),
            )
        return not failures


def _merged(maps: Sequence[KeyMap]) -> KeyMap:
    """One map of each key's latest offset over several ranges' maps."""
    if not maps:
        return KeyMap.latest(np.empty(0, dtype="S16"), np.empty(0, dtype=np.int64))
    if len(maps) == 1:
        return maps[0]
    return KeyMap.latest(
        np.concatenate([m.hashes for m in maps]), np.concatenate([m.offsets for m in maps])
    )


async def check_all_keyed(
    store: Metadata, link: CompactionCalls, stream_id: int, deadline: float
) -> None:
    """Refuse to compact a stream that holds records without keys (SPEC
    §13): every replica of its ranges is asked what it holds; one that
    cannot answer leaves it refused too (compaction keeps one record per
    key, and a record without a key has none to keep it by)."""
    ranges = store.ranges(stream_id)
    first = ranges[0].start_offset if ranges else 0
    by_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for rng in ranges:
        for node_id in rng.nodes:
            by_node[node_id].append(rng.key)
    with trio.move_on_at(deadline) as scope:
        for node_id, keys in by_node.items():
            try:
                holdings = await link.range_holdings(node_id, keys)
            except (SBPError, OSError) as error:
                raise InvalidRequestError(
                    f"stream {stream_id} cannot be compacted now: data node {node_id} "
                    f"does not say whether it holds records without keys ({error})"
                ) from None
            keyless = max((h.keyless_below for h in holdings.values()), default=0)
            if keyless > first:
                raise InvalidRequestError(
                    f"stream {stream_id} holds records without keys (below offset "
                    f"{keyless}): a compacted stream keeps each key's latest record, so "
                    "every record needs a key; trim them first"
                )
    if scope.cancelled_caught:
        raise RequestTimeoutError(f"stream {stream_id}: the data nodes did not answer in time")
