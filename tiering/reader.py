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

from sbp.errors import ObjectStoreUnavailableError, ProtocolError

from . import layout
from .cache import ChunkCache
from .layout import RangeIndex, RangeTrailer
from .store import ObjectStore

T = TypeVar("T")

#: bytes per cached chunk and per ranged GET
CHUNK_BYTES: Final = 4 << 20
#: chunks read ahead of the one a read needs
READ_AHEAD: Final = 2
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
    ) -> tuple[bytes, int]:
        """Whole batches of the range from the one holding ``offset``: at
        most ``max_bytes`` of them but at least one, and the offsets they
        cover."""
        key = layout.object_key(stream_id, range_index, epoch)
        index = await self._index(key)
        position, end, records = index.span(offset, max_bytes)
        first, last = position // CHUNK_BYTES, (end - 1) // CHUNK_BYTES
        chunks: dict[int, bytes] = {}
        async with trio.open_nursery() as nursery:
            for chunk in range(first, last + 1):
                nursery.start_soon(self._load, key, index, chunk, chunks)
        self._read_ahead(key, index, last)
        joined = b"".join(chunks[c] for c in range(first, last + 1))
        skip = position - first * CHUNK_BYTES
        return joined[skip : skip + end - position], records

    def forget(self, stream_id: int, range_index: int, epoch: int) -> None:
        """The object was deleted: nothing of it is served from memory or disk."""
        key = layout.object_key(stream_id, range_index, epoch)
        self._indexes.pop(key, None)
        self.cache.forget_object(key)

    async def _index(self, key: str) -> RangeIndex:
        found = self._indexes.get(key)
        if found is not None:
            self._indexes.move_to_end(key)
            return found
        size, tail = await self._call(self.store.read_tail, key, layout.TRAILER.size)
        try:
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

    async def _load(self, key: str, index: RangeIndex, chunk: int, into: dict[int, bytes]) -> None:
        into[chunk] = await self._chunk(key, index, chunk)

    async def _chunk(self, key: str, index: RangeIndex, chunk: int) -> bytes:
        while True:
            cached = self.cache.get(key, chunk)
            if cached is not None:
                return cached
            reading = self._reading.get((key, chunk))
            if reading is None:
                break
            await reading.wait()  # read by another reader: cached now, unless it failed
            if self.cache.get(key, chunk) is None and (key, chunk) not in self._reading:
                break
        done = self._reading[(key, chunk)] = trio.Event()
        try:
            start = chunk * CHUNK_BYTES
            length = min(CHUNK_BYTES, index.trailer.data_bytes - start)
            data = await self._call(self.store.read, key, start, length)
            self.downloaded_bytes += len(data)
            self.cache.put(key, chunk, data)
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
        with contextlib.suppress(ProtocolError):  # the read that needs it will say so
            await self._chunk(key, index, chunk)

    async def _call(self, call: Callable[..., T], *args: Any) -> T:
        try:
            return await self.store.run(call, *args)
        except ObjectStoreUnavailableError:
            self.download_errors += 1
            raise
