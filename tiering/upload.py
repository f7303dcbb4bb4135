"""A data node's copies of sealed ranges to the object store (SPEC §14).

The PM asks one replica of a sealed range (UPLOAD_RANGE) to copy it. The
replica reads the range's batches as FETCH serves them, writes them with
their index and trailer as one object (``tiering.layout``), paced by
``--max-upload-bytes-per-s``, and checks the object's size and trailer in
the store before it answers; the PM checks the trailer again before it
records the range as copied. An object already in the store and whole is
not written again. The reads from LMDB are short and on the event loop; the
writes to the store run in worker threads, so appends never wait on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import trio

from net.pacer import Pacer
from sbp.batches import peek_header
from sbp.errors import EpochFencedError, InvalidRequestError, RangeNotFoundError
from storage.engine import StorageEngine

from . import layout
from .layout import IndexBuilder, RangeTrailer
from .store import ObjectStore

#: bytes of batches read from LMDB and written to the store at a time
_PIECE_BYTES: Final = 8 << 20
#: how long one write of a piece (or the upload's completion) may take
_WRITE_TIMEOUT_S: Final = 60.0
#: uploads one node runs at once
_CONCURRENT: Final = 2


@dataclass(slots=True)
class UploadCounters:
    """What this node copied to the object store (/metrics)."""

    uploaded_bytes: int = 0
    uploaded_ranges: int = 0
    upload_errors: int = 0


class RangeUploads:
    """See the module docstring."""

    def __init__(self, engine: StorageEngine, store: ObjectStore, bytes_per_s: int) -> None:
        self._engine = engine
        self.store = store
        self.pacer = Pacer(bytes_per_s)
        self._slots = trio.Semaphore(_CONCURRENT)
        #: ranges being copied: a second ask waits for the first copy
        self._running: dict[tuple[int, int, int], trio.Event] = {}
        self.counters = UploadCounters()

    async def upload(self, stream_id: int, range_index: int, epoch: int) -> RangeTrailer:
        """Copy the sealed range (held whole here) to the store, unless it
        is there already; its trailer. ``ProtocolError`` when it cannot be:
        the range is not sealed or not whole here, the epoch differs, or the
        store fails (``ObjectStoreUnavailableError``)."""
        what = (stream_id, range_index, epoch)
        while (running := self._running.get(what)) is not None:
            await running.wait()
        done = self._running[what] = trio.Event()
        try:
            async with self._slots:
                return await self._upload(stream_id, range_index, epoch)
        except BaseException:
            self.counters.upload_errors += 1
            raise
        finally:
            del self._running[what]
            done.set()

    async def _upload(self, stream_id: int, range_index: int, epoch: int) -> RangeTrailer:
        engine = self._engine
        info = engine.describe_range(stream_id, range_index)
        where = f"range {range_index} of stream {stream_id}"
        if info.epoch != epoch:
            error = EpochFencedError if epoch < info.epoch else RangeNotFoundError
            raise error(f"{where} is at epoch {info.epoch} here, not {epoch}")
        if not info.end_is_final:
            # this node's view is behind the PM's seal: asked again, it will have it
            raise RangeNotFoundError(f"{where} is not sealed here where the PM sealed it yet")
        start = max(info.start_offset, engine.first_offset(stream_id) or 0)
        held = await trio.to_thread.run_sync(engine.held_end, stream_id, start, info.end_offset)
        if held < info.end_offset:
            raise RangeNotFoundError(f"{where} is held to {held} here, not to {info.end_offset}")
        key = layout.object_key(stream_id, range_index, epoch)
        copied = (stream_id, range_index, epoch, info.end_offset)
        existing = await self.store.range_trailer(key, copied)
        if existing is not None:
            return existing
        last_append_ms = await trio.to_thread.run_sync(
            engine.range_last_append_ms, stream_id, range_index
        )
        writer = await self.store.run(self.store.open_writer, key)
        index = IndexBuilder()
        offset = start
        while offset < info.end_offset:
            with engine.borrow(stream_id, offset, _PIECE_BYTES) as found:
                piece = found.copy()
            if not piece:
                raise RangeNotFoundError(f"{where}: nothing held at offset {offset}")
            offset = peek_header(piece, index.add(piece)).next_offset
            await self.pacer.spend(len(piece))
            await self.store.run(writer.write, piece, timeout=_WRITE_TIMEOUT_S)
            self.counters.uploaded_bytes += len(piece)
        tail, trailer = index.finish(stream_id, range_index, epoch, info.end_offset, last_append_ms)
        await self.store.run(writer.write, tail, timeout=_WRITE_TIMEOUT_S)
        await self.store.run(writer.close, timeout=_WRITE_TIMEOUT_S)
        if await self.store.range_trailer(key, copied) != trailer:
            raise InvalidRequestError(f"{key}: the store holds another object than was written")
        self.counters.uploaded_ranges += 1
        return trailer
