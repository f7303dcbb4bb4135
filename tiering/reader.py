"""Reads of ranges that are in the object store only (SPEC §14, state 2).

A read finds its batches in the range's index (fetched once per object and
kept), then reads the chunks that hold them: from the disk cache, or with
ranged GETs, all at once, and starts GETs of the next chunks ahead of the
reader. Concurrent reads of one chunk share one GET. A store that fails or
does not answer in time makes the read ``ObjectStoreUnavailableError``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final, TypeVar

import trio

from sbp.batches import Buffer
from sbp.errors import ObjectStoreUnavailableError, ProtocolError

from . import layout
from .cache import ChunkCache
from .layout import RangeIndex, RangeTrailer
from .store import ObjectStore

T = TypeVar("T")

#: bytes per cached chunk and per ranged GET
CHUNK_BYTES: Final = 8 << 20
#: chunks read ahead of the one a read needs
READ_AHEAD: Final = 4
#: chunks read from the store kept in memory as well (the newest)
RECENT_CHUNKS: Final = 2 * (READ_AHEAD + 1)
#: indexes of objects kept in memory
_MAX_INDEXES: Final = 4096


class TieredReads:
    """See the module docstring."""

    def __init__(self, store: ObjectStore, cache: ChunkCache) -> None:
        self.store = store
        self.cache = cache
        self._indexes: OrderedDict[str, RangeIndex] = OrderedDict()
        #: chunks being read: readers wait for the one GET
        self._reading: dict[tuple[str, int], trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        #: the chunks read from the store most recently, kept in memory too:
        #: a reader goes through each a FETCH at a time
        self._recent: OrderedDict[tuple[str, int], memoryview] = OrderedDict()
        #: objects whose index is being read ahead of a reader
        self._starting: set[str] = set()
        #: bytes read from the store (metrics)
        self.downloaded_bytes = 0
        self.download_errors = 0

    async def run(self) -> None:
        """Host the reads ahead, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.sleep_forever()

    async def read(
        self, stream_id: int, range_index: int, epoch: int, offset: int, max_bytes: int
    ) -> tuple[Buffer, int]:
        """Whole batches of the range from the one holding ``offset``: at
        most ``max_bytes`` of them but at least one, and the offsets they
        cover."""
        key = layout.object_key(stream_id, range_index, epoch)
        index = self._indexes.get(key) or await self._index(key)
        position, end, records = index.span(offset, max_bytes)
        first, last = position // CHUNK_BYTES, (end - 1) // CHUNK_BYTES
        # the part of each chunk the read needs
        wanted = {
            chunk: (
                max(position - chunk * CHUNK_BYTES, 0),
                min(end - chunk * CHUNK_BYTES, CHUNK_BYTES),
            )
            for chunk in range(first, last + 1)
        }
        pieces: dict[int, Buffer] = {}
        for chunk, (start, stop) in wanted.items():  # what is at hand, without a task
            held = self._held(key, chunk, start, stop)
            if held is not None:
                pieces[chunk] = held
        if len(pieces) < len(wanted):
            async with trio.open_nursery() as nursery:
                for chunk, (start, stop) in wanted.items():
                    if chunk not in pieces:
                        nursery.start_soon(self._load, key, index, chunk, start, stop, pieces)
        self._read_ahead(key, index, last)
        if len(pieces) == 1:
            return pieces[first], records  # a view: FETCH writes it out as it is
        return b"".join(pieces[c] for c in range(first, last + 1)), records

    def _held(self, key: str, chunk: int, start: int, stop: int) -> Buffer | None:
        """``[start, stop)`` of a chunk in memory or in the disk cache."""
        recent = self._recent.get((key, chunk))
        if recent is not None:
            self.cache.hits += 1
            return recent[start:stop]
        if (key, chunk) in self.cache:
            return self.cache.get(key, chunk, start, stop - start)
        return None

    def near_end(self, stream_id: int, range_index: int, epoch: int, offset: int) -> bool:
        """Whether a read at ``offset`` is within the read-ahead of the end of
        the range's object (time to read the next range ahead)."""
        index = self._indexes.get(layout.object_key(stream_id, range_index, epoch))
        if index is None:
            return False
        position, _, _ = index.span(min(offset, int(index.offsets[-1]) - 1), 1)
        return index.trailer.data_bytes - position <= READ_AHEAD * CHUNK_BYTES

    def read_ahead(self, stream_id: int, range_index: int, epoch: int) -> None:
        """Start reading a range's index and first chunks, for a reader about
        to get there."""
        key = layout.object_key(stream_id, range_index, epoch)
        if self._nursery is not None and key not in self._indexes and key not in self._starting:
            self._starting.add(key)
            self._nursery.start_soon(self._start_ahead, key)

    async def _start_ahead(self, key: str) -> None:
        try:
            with contextlib.suppress(ProtocolError):
                index = await self._index(key)
                self._read_ahead(key, index, -1)
        finally:
            self._starting.discard(key)

    def forget(self, stream_id: int, range_index: int, epoch: int) -> None:
        """The object was deleted: nothing of it is served from memory or disk."""
        key = layout.object_key(stream_id, range_index, epoch)
        self._indexes.pop(key, None)
        self.cache.forget_object(key)
        for recent in [k for k in self._recent if k[0] == key]:
            del self._recent[recent]

    async def _index(self, key: str) -> RangeIndex:
        known = self._indexes.get(key)
        if known is not None:
            self._indexes.move_to_end(key)
            return known
        tail_of = await self._call(self.store.read_tail, key, layout.TRAILER.size)
        try:
            if tail_of is None:
                raise ValueError("it is not in the store")
            size, tail = tail_of
            trailer = RangeTrailer.decode(tail)
            if size != trailer.object_bytes:
                raise ValueError(f"{size} bytes, the trailer says {trailer.object_bytes}")
            raw = await self._call(self.store.read, key, trailer.data_bytes, trailer.index_bytes)
            index = RangeIndex(trailer, raw)
        except ValueError as error:
            self.download_errors += 1
            raise ObjectStoreUnavailableError(f"object {key} cannot be read: {error}") from None
        self._indexes[key] = index
        while len(self._indexes) > _MAX_INDEXES:
            self._indexes.popitem(last=False)
        return index

    async def _load(
        self,
        key: str,
        index: RangeIndex,
        chunk: int,
        start: int,
        stop: int,
        into: dict[int, Buffer],
    ) -> None:
        """``[start, stop)`` of the chunk into ``into[chunk]``."""
        while True:
            held = self._held(key, chunk, start, stop)
            if held is not None:
                into[chunk] = held
                return
            reading = self._reading.get((key, chunk))
            if reading is None:
                break
            await reading.wait()  # read by another reader: cached now, unless it failed
        self.cache.misses += 1
        data = await self._fetch(key, index, chunk)
        into[chunk] = data[start:stop]

    async def _fetch(self, key: str, index: RangeIndex, chunk: int) -> memoryview:
        """The whole chunk from the store, then into the cache; one GET for
        all who want it meanwhile."""
        done = self._reading[(key, chunk)] = trio.Event()
        try:
            start = chunk * CHUNK_BYTES
            length = min(CHUNK_BYTES, index.trailer.data_bytes - start)
            data = await self._call(self.store.read, key, start, length)
            self.downloaded_bytes += len(data)
            self._recent[(key, chunk)] = data
            while len(self._recent) > RECENT_CHUNKS:
                self._recent.popitem(last=False)
            if await trio.to_thread.run_sync(self.cache.write, key, chunk, data):
                self.cache.admit(key, chunk, len(data))
            return data
        finally:
            del self._reading[(key, chunk)]
            done.set()

    def _read_ahead(self, key: str, index: RangeIndex, last: int) -> None:
        if self._nursery is None:
            return
        chunks = -(-index.trailer.data_bytes // CHUNK_BYTES)
        for chunk in range(last + 1, min(last + 1 + READ_AHEAD, chunks)):
            if (key, chunk) not in self._reading and (key, chunk) not in self.cache:
                self._nursery.start_soon(self._ahead, key, index, chunk)

    async def _ahead(self, key: str, index: RangeIndex, chunk: int) -> None:
        if (key, chunk) in self._reading or (key, chunk) in self.cache:
            return
        with contextlib.suppress(ProtocolError):  # the read that needs it will say so
            await self._fetch(key, index, chunk)

    async def _call(self, call: Callable[..., T], *args: Any) -> T:
        try:
            return await self.store.run(call, *args)
        except ObjectStoreUnavailableError:
            self.download_errors += 1
            raise
