"""The PM's side of tiered storage (SPEC §14): each range's object state.

A tiered stream's sealed range goes through three states, as in KIP-405:

- 0, on its replicas only. The PM asks one live replica to copy it to the
  object store (UPLOAD_RANGE), reads the object's trailer back, and only
  when the object is whole and is that range's (stream, index, epoch, end)
  records state 1, with when its last batch was appended. A copy that fails
  is asked for again, with a backoff; a range is recorded once (the commit
  takes the range as state 0 only).
- 1, also in the store. Once its last batch is older than the stream's
  ``local_retention_ms``, the PM records state 2 with no replica, then tells
  the old replicas (SYNC_RANGES), which drop their copies as after any move.
- 2, in the store only. LIST_RANGES lists live nodes that serve it from the
  store (``serving_nodes``: the same ones for a range while the nodes stay
  the same, so their caches stay warm).

Objects are deleted once the metadata stops naming them: right after a
commit removes a copied range (retention, trims, DELETE_STREAMS), and by a
sweep that lists the store and deletes what names no range, such as the
object of an upload a crash cut short.

Each state change costs O(1) in the number of ranges: the ranges waiting
for a copy and those waiting to leave the nodes are kept as they are
committed (a set, and a heap by when they may leave), not looked for.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Final, Protocol

import trio

from net.ratelog import RateLimitedLog
from sbp.enums import ObjectState
from sbp.errors import (
    ConnectionClosed,
    NoAvailableDataNodeError,
    ProtocolError,
    RangeNotFoundError,
    UnknownServerError,
)
from tiering import layout
from tiering.store import ObjectStore

from .changes import Change, DeleteRange, DeleteStream, Metadata, PutRange, PutStream
from .liveness import NodeRegistry
from .range_log import Committed
from .range_sizes import RangeSizes
from .records import Outcome, RangeRecord, StreamRecord
from .rolling import HoldingsLink, roll_full

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log, interval=30.0)


DEFAULT_INTERVAL_S: Final = 1.0
#: a tiered stream's open range is sealed once it holds this much, so that
#: it can be copied (``--tiered-roll-bytes``)
DEFAULT_ROLL_BYTES: Final = 64 << 20
#: tiered streams' bytes on the nodes and in the store are sized this often
SIZE_INTERVAL_S: Final = 30.0
#: objects no metadata names are looked for this often
DEFAULT_SWEEP_INTERVAL_S: Final = 600.0
#: copies the PM has asked for at once
_CONCURRENT_UPLOADS: Final = 4
#: a failed copy is asked for again after this, doubling up to the cap
_RETRY_INITIAL_S: Final = 1.0
_RETRY_MAX_S: Final = 60.0
#: streams read per page when the metadata is first looked through
_PAGE: Final = 1000
#: what a call to a data node or the store may fail with
_CALL_ERRORS: Final = (ProtocolError, ConnectionClosed, OSError)
#: how long a pass's calls to the data nodes may take
_CALL_TIMEOUT_S: Final = 30.0
#: nodes that serve a range in the store only
SERVING_NODES: Final = 2


def tiered(stream: StreamRecord | None) -> bool:
    return stream is not None and stream.local_retention_ms >= 0


def serving_nodes(rng: RangeRecord, live: Sequence[int]) -> tuple[int, ...]:
    """The live nodes that serve a range in the store only: a choice fixed
    by the range's identity, so that one range is read through the same
    nodes' caches while the live nodes stay the same."""
    if not live:
        return ()
    first = (rng.stream_id * 1_000_003 + rng.range_index) % len(live)
    count = min(SERVING_NODES, len(live))
    return tuple(live[(first + i) % len(live)] for i in range(count))


class UploadCalls(HoldingsLink, Protocol):
    async def upload_range(self, node_id: int, rng: RangeRecord) -> None:
        """UPLOAD_RANGE: the node copies the sealed range to the store."""


class TrimStreams(Protocol):
    async def __call__(
        self, trims: Sequence[tuple[int, int]], timeout: float
    ) -> Sequence[Outcome[tuple[StreamRecord, RangeRecord]]]: ...


class SyncStreams(Protocol):
    async def __call__(
        self, stream_ids: Iterable[int], deadline: float, also: Iterable[int] = ()
    ) -> None: ...


class Tiering:
    """See the module docstring."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: UploadCalls,
        objects: ObjectStore,
        commit: Callable[[Sequence[Change]], Awaitable[None]],
        hold: Callable[[int], AbstractAsyncContextManager[None]],
        sync_streams: SyncStreams,
        trim_streams: TrimStreams,
        seal: Callable[[int, int], Awaitable[None]],
        sizes: RangeSizes,
        *,
        roll_bytes: int = DEFAULT_ROLL_BYTES,
        interval: float = DEFAULT_INTERVAL_S,
        sweep_interval: float = DEFAULT_SWEEP_INTERVAL_S,
        wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self._store = store
        self._registry = registry
        self._link = link
        self.objects = objects
        self._commit = commit
        self._hold = hold
        self._sync_streams = sync_streams
        self._trim_streams = trim_streams
        self._seal = seal
        self._sizes = sizes
        self.roll_bytes = roll_bytes
        #: the tiered streams, whose open ranges roll at ``roll_bytes``
        self._tiered: set[int] = set()
        self.interval = interval
        self.sweep_interval = sweep_interval
        self._wall_ms = wall_ms
        #: sealed ranges of tiered streams in state 0
        self._to_copy: set[tuple[int, int]] = set()
        #: (when it may leave the nodes, stream, index) of ranges in state 1
        self._to_offload: list[tuple[int, int, int]] = []
        #: stream -> range index -> epoch of every range with an object, to
        #: delete the object once the range is removed
        self._objects: dict[int, dict[int, int]] = {}
        #: (when its retention period ends, stream, index) of ranges with an
        #: object: the data nodes do not see those in the store only expire
        self._to_expire: list[tuple[int, int, int]] = []
        #: objects of removed ranges, to delete
        self._to_delete: list[str] = []
        #: when each range waiting for a copy was first seen waiting (wall ms)
        self._waiting_since: dict[tuple[int, int], int] = {}
        #: stream -> (bytes on the nodes, bytes in the store), sized every
        #: ``SIZE_INTERVAL_S`` (metrics)
        self.stream_bytes: dict[int, tuple[int, int]] = {}
        #: (stream, index) -> (next try, backoff) of copies that failed
        self._backoff: dict[tuple[int, int], tuple[float, float]] = {}
        self._copying: set[tuple[int, int]] = set()
        self._wake = trio.Event()
        self._loaded = False
        # metrics
        self.copied = 0
        self.offloaded = 0
        self.deleted_objects = 0
        self.copy_failures = 0
        self.rolls = 0

    # -- following the metadata ----------------------------------------------

    def load(self) -> None:
        """Find, once, the ranges waiting for a step and those with objects."""
        start_after = 0
        while page := self._store.streams(start_after=start_after, limit=_PAGE):
            for stream in page:
                if tiered(stream):
                    self._tiered.add(stream.stream_id)
                for rng in self._store.ranges(stream.stream_id):
                    self._note(rng, stream)
            start_after = page[-1].stream_id
        self._loaded = True

    def committed(self, done: Committed) -> None:
        """Follow a commit (``pm.range_log``)."""
        for change in done.changes:
            if isinstance(change, PutRange):
                self._note(change.range, self._store.stream(change.range.stream_id))
            elif isinstance(change, DeleteRange):
                self._removed(change.stream_id, change.range_index)
            elif isinstance(change, DeleteStream):
                self._tiered.discard(change.stream_id)
                for index in list(self._objects.get(change.stream_id, ())):
                    self._removed(change.stream_id, index)
                self._to_copy = {k for k in self._to_copy if k[0] != change.stream_id}
                self.stream_bytes.pop(change.stream_id, None)
            elif isinstance(change, PutStream) and tiered(change.stream):
                # switched to tiered: its sealed ranges are copied too
                self._tiered.add(change.stream.stream_id)
                for rng in self._store.ranges(change.stream.stream_id):
                    self._note(rng, change.stream)
            elif isinstance(change, PutStream):
                self._tiered.discard(change.stream.stream_id)
        if self._to_copy or self._to_delete:
            self._wake.set()

    def _note(self, rng: RangeRecord, stream: StreamRecord | None) -> None:
        key = rng.key
        if rng.object_state != ObjectState.ON_NODES:
            self._objects.setdefault(rng.stream_id, {})[rng.range_index] = rng.epoch
            self._to_copy.discard(key)
            self._waiting_since.pop(key, None)
            if rng.object_state == ObjectState.IN_STORE_TOO and stream is not None:
                due = rng.last_append_ms + max(stream.local_retention_ms, 0)
                heapq.heappush(self._to_offload, (due, *key))
            if stream is not None and stream.retention_period_ms > 0:
                expires = rng.last_append_ms + stream.retention_period_ms
                heapq.heappush(self._to_expire, (expires, *key))
        elif tiered(stream) and not rng.is_open:
            self._to_copy.add(key)
            self._waiting_since.setdefault(key, self._wall_ms())

    def _removed(self, stream_id: int, range_index: int) -> None:
        self._to_copy.discard((stream_id, range_index))
        self._waiting_since.pop((stream_id, range_index), None)
        of_stream = self._objects.get(stream_id, {})
        epoch = of_stream.pop(range_index, None)
        if not of_stream:
            self._objects.pop(stream_id, None)
        if epoch is not None:
            self._to_delete.append(layout.object_key(stream_id, range_index, epoch))

    # -- the work ----------------------------------------------------------------

    async def run(self) -> None:
        """Copy, offload and delete, every interval (sooner when a commit
        brings work), and sweep now and then; until cancelled."""
        if not self._loaded:
            self.load()
        next_sweep = trio.current_time() + min(self.sweep_interval, 30.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._roll_full_ranges)
            nursery.start_soon(self._size_now_and_then)
            while True:
                self._start_copies(nursery)
                await self._offload_due()
                await self._expire_due()
                await self._delete_removed()
                if trio.current_time() >= next_sweep:
                    await self.sweep()
                    next_sweep = trio.current_time() + self.sweep_interval
                with trio.move_on_after(self.interval):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _roll_full_ranges(self) -> None:
        """Seal the open range of each tiered stream that holds
        ``roll_bytes``, every interval: a range is copied once sealed."""
        while True:
            await trio.sleep(self.interval)
            with trio.move_on_after(_CALL_TIMEOUT_S):
                try:
                    self.rolls += await roll_full(
                        self._store, self._link, self._seal, sorted(self._tiered), self.roll_bytes
                    )
                except _CALL_ERRORS as error:
                    _failures.warning("roll", "rolling tiered streams' open ranges: %r", error)

    async def _size_now_and_then(self) -> None:
        while True:
            with trio.move_on_after(_CALL_TIMEOUT_S):
                try:
                    await self.size_streams()
                except _CALL_ERRORS as error:
                    _failures.warning("size", "sizing tiered streams: %r", error)
            await trio.sleep(SIZE_INTERVAL_S)

    def _start_copies(self, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        for key in sorted(self._to_copy):
            if len(self._copying) >= _CONCURRENT_UPLOADS:
                return
            if key in self._copying or self._backoff.get(key, (0.0, 0.0))[0] > now:
                continue
            self._copying.add(key)
            nursery.start_soon(self._copy, key)

    async def _copy(self, key: tuple[int, int]) -> None:
        try:
            await self.copy(*key)
            self._backoff.pop(key, None)
        except (*_CALL_ERRORS, trio.TooSlowError) as error:
            self.copy_failures += 1
            if isinstance(error, RangeNotFoundError):
                # the node's view is behind the PM's: it catches up within a second
                self._backoff[key] = (trio.current_time() + _RETRY_INITIAL_S, _RETRY_INITIAL_S / 2)
                log.debug("copy of range %d of stream %d: %s", key[1], key[0], error)
                return
            _, backoff = self._backoff.get(key, (0.0, _RETRY_INITIAL_S / 2))
            backoff = min(backoff * 2, _RETRY_MAX_S)
            self._backoff[key] = (trio.current_time() + backoff, backoff)
            _failures.warning(
                "copy",
                "copy of range %d of stream %d to the object store failed (again in %.0f s): %s",
                key[1],
                key[0],
                backoff,
                error or type(error).__name__,
            )
        finally:
            self._copying.discard(key)

    async def copy(self, stream_id: int, range_index: int) -> bool:
        """Have a live replica copy the sealed range, check the object, and
        record state 1; whether this recorded it. ``ProtocolError`` when
        the copy or the check failed."""
        rng = self._store.range(stream_id, range_index)
        stream = self._store.stream(stream_id)
        if (
            rng is None
            or rng.object_state != ObjectState.ON_NODES
            or rng.is_open
            or not tiered(stream)
        ):
            self._to_copy.discard((stream_id, range_index))
            self._waiting_since.pop((stream_id, range_index), None)
            return False
        holders = [n for n in rng.nodes if self._registry.is_alive(n)]
        if not holders:
            raise NoAvailableDataNodeError(
                f"range {range_index} of stream {stream_id} has no live replica"
            )
        await self._link.upload_range(holders[0], rng)
        key = layout.object_key(stream_id, range_index, rng.epoch)
        trailer = await self.objects.range_trailer(
            key, (stream_id, range_index, rng.epoch, rng.end_offset)
        )
        if trailer is None:
            raise UnknownServerError(f"{key} is not a whole copy of range {range_index}")
        async with self._hold(stream_id):
            current = self._store.range(stream_id, range_index)
            if current != rng:
                return False  # changed meanwhile: looked at again as it is now
            await self._commit(
                [
                    PutRange(
                        dataclasses.replace(
                            rng,
                            object_state=ObjectState.IN_STORE_TOO,
                            last_append_ms=trailer.last_append_ms,
                            object_bytes=trailer.data_bytes,
                        )
                    )
                ]
            )
        self.copied += 1
        log.info("range %d of stream %d is in the object store (%s)", range_index, stream_id, key)
        return True

    async def _offload_due(self) -> None:
        now_ms = self._wall_ms()
        while self._to_offload and self._to_offload[0][0] <= now_ms:
            _, stream_id, range_index = heapq.heappop(self._to_offload)
            await self.offload(stream_id, range_index)

    async def offload(self, stream_id: int, range_index: int) -> bool:
        """Record a copied range as in the store only, if it is old enough,
        and tell its replicas, which drop their copies; whether it did."""
        async with self._hold(stream_id):
            rng = self._store.range(stream_id, range_index)
            stream = self._store.stream(stream_id)
            if rng is None or stream is None or rng.object_state != ObjectState.IN_STORE_TOO:
                return False
            due = rng.last_append_ms + max(stream.local_retention_ms, 0)
            if not tiered(stream) or due > self._wall_ms():
                if tiered(stream):
                    heapq.heappush(self._to_offload, (due, stream_id, range_index))
                return False
            offloaded = dataclasses.replace(
                rng, nodes=(), replicas_wanted=0, object_state=ObjectState.IN_STORE_ONLY
            )
            await self._commit([PutRange(offloaded)])
        self.offloaded += 1
        log.info("range %d of stream %d is in the object store only", range_index, stream_id)
        await self._sync_streams([stream_id], trio.current_time() + 5.0, also=rng.nodes)
        return True

    async def _expire_due(self) -> None:
        """Time retention (SPEC §12) of ranges with an object: a range whose
        last batch is older than its stream's retention period goes, with
        every range below it (they are older still), as a TRIM_STREAMS to
        its end would take them."""
        now_ms = self._wall_ms()
        trims: dict[int, tuple[int, int]] = {}  # stream -> (end offset, range index)
        while self._to_expire and self._to_expire[0][0] <= now_ms:
            _, stream_id, range_index = heapq.heappop(self._to_expire)
            rng = self._store.range(stream_id, range_index)
            stream = self._store.stream(stream_id)
            if rng is None or stream is None or stream.retention_period_ms <= 0:
                continue
            if rng.last_append_ms + stream.retention_period_ms > now_ms:
                heapq.heappush(
                    self._to_expire,
                    (rng.last_append_ms + stream.retention_period_ms, stream_id, range_index),
                )
                continue
            trims[stream_id] = max(trims.get(stream_id, (0, 0)), (rng.end_offset, range_index))
        if not trims:
            return
        asked = sorted((stream_id, end) for stream_id, (end, _) in trims.items())
        outcomes = await self._trim_streams(asked, 10.0)
        for (stream_id, offset), outcome in zip(asked, outcomes, strict=True):
            if outcome.error is not None:
                # asked again a pass later
                retry_at = now_ms + int(self.interval * 1000)
                heapq.heappush(self._to_expire, (retry_at, stream_id, trims[stream_id][1]))
                _failures.warning(
                    "expire", "stream %d: trim to %d failed: %s", stream_id, offset, outcome.error
                )
            else:
                log.info(
                    "stream %d trimmed to %d: its ranges below are past its retention period",
                    stream_id,
                    offset,
                )

    async def _delete_removed(self) -> None:
        if not self._to_delete:
            return
        keys, self._to_delete = self._to_delete, []
        try:
            await self.objects.run(self.objects.delete, keys, timeout=60.0)
            self.deleted_objects += len(keys)
        except ProtocolError as error:
            self._to_delete.extend(keys)  # again next pass; the sweep finds them too
            _failures.warning("delete", "deleting %d objects failed: %s", len(keys), error)

    async def sweep(self) -> int:
        """Delete the objects no range names; how many."""
        try:
            found = await self.objects.run(self.objects.list, layout.STREAMS_PREFIX, timeout=120.0)
        except ProtocolError as error:
            _failures.warning("sweep", "the sweep of the object store failed: %s", error)
            return 0
        orphans = []
        for key, _ in found:
            named = layout.parse_key(key)
            if named is None:
                continue
            stream_id, range_index, epoch = named
            rng = self._store.range(stream_id, range_index)
            if rng is None or rng.epoch != epoch:
                orphans.append(key)
        if orphans:
            self._to_delete.extend(orphans)
            await self._delete_removed()
            log.info("the sweep deleted %d objects no range names", len(orphans))
        return len(orphans)

    # -- what is where -------------------------------------------------------

    def pending_copies(self) -> int:
        return len(self._to_copy)

    def bytes_by_stream(self) -> dict[int, tuple[int, int]]:
        """Each tiered stream's (bytes on the nodes, bytes in the store) as
        last sized; 0 for one not sized yet."""
        sized = dict.fromkeys(self._tiered | set(self._objects), (0, 0))
        sized.update(self.stream_bytes)
        return sized

    def oldest_uncopied_seconds(self) -> float:
        """How long the sealed range waiting longest for its copy has waited
        (0 when none waits)."""
        if not self._waiting_since:
            return 0.0
        return max(self._wall_ms() - min(self._waiting_since.values()), 0) / 1000

    async def size_streams(self) -> None:
        """Bytes of each tiered stream (or one with an object) on the nodes
        and in the store (metrics): ranges on the nodes as their replicas
        hold them (a sealed range asked once), copied ones as their objects
        say."""
        streams = self._tiered | set(self._objects)
        sizes: dict[int, tuple[int, int]] = {}
        for stream_id in sorted(streams):
            ranges = self._store.ranges(stream_id)
            on_nodes = [r for r in ranges if r.nodes]
            held = await self._sizes.sizes(on_nodes) if on_nodes else {}
            in_store = sum(r.object_bytes for r in ranges if r.object_state != ObjectState.ON_NODES)
            sizes[stream_id] = (sum(held.values()), in_store)
        self.stream_bytes = sizes
