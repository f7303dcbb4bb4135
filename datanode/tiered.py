"""A data node's part in tiered storage (SPEC §14): it copies the sealed
ranges the PM asks for to the object store (``tiering.upload``), and serves
FETCH of ranges that are in the store only (``tiering.reader``, through the
disk cache under ``--data-dir``)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sbp.enums import ObjectState
from sbp.errors import InvalidRequestError, ProtocolError
from storage.engine import BorrowedBatches, StorageEngine
from storage.model import RangeInfo
from tiering.cache import ChunkCache
from tiering.layout import RangeTrailer
from tiering.reader import TieredReads
from tiering.store import DEFAULT_TIMEOUT_S, ObjectStore, ObjectStoreSettings
from tiering.upload import RangeUploads

#: the cache's directory under the node's data directory
CACHE_DIR: Final = "object-cache"
#: streams whose ranges in the store only a node keeps as the PM listed them
MAX_LISTED_STREAMS: Final = 10_000
#: a read of a range this node does not know asks the PM at most this often
LOOKUP_EVERY_S: Final = 1.0


class TieringCollector(Collector):
    """What a node copied to the object store and read from it (/metrics)."""

    def __init__(self, tiering: NodeTiering) -> None:
        self._tiering = tiering

    def collect(self) -> Iterator[Metric]:
        uploads = self._tiering.uploads.counters
        reads = self._tiering.reads
        cache = self._tiering.cache
        for name, help_text, value in (
            (
                "uploaded_bytes",
                "bytes of ranges copied to the object store",
                uploads.uploaded_bytes,
            ),
            ("uploaded_ranges", "ranges copied to the object store", uploads.uploaded_ranges),
            ("upload_errors", "copies to the object store that failed", uploads.upload_errors),
            ("downloaded_bytes", "bytes read from the object store", reads.downloaded_bytes),
            ("download_errors", "reads from the object store that failed", reads.download_errors),
            ("object_cache_hits", "chunk reads the disk cache served", cache.hits),
            ("object_cache_misses", "chunk reads the disk cache did not hold", cache.misses),
        ):
            yield CounterMetricFamily(f"sbp_datanode_{name}", help_text, value=value)
        yield GaugeMetricFamily(
            "sbp_datanode_object_cache_bytes",
            "bytes of object chunks in the disk cache",
            value=cache.bytes,
        )


class NodeTiering:
    """See the module docstring."""

    def __init__(
        self,
        engine: StorageEngine,
        settings: ObjectStoreSettings,
        data_dir: Path,
        *,
        upload_bytes_per_s: int,
        cache_bytes: int,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._engine = engine
        self.store = ObjectStore(settings, timeout=timeout)
        self.uploads = RangeUploads(engine, self.store, upload_bytes_per_s)
        self.cache = ChunkCache(data_dir / CACHE_DIR, cache_bytes)
        self.reads = TieredReads(self.store, self.cache)
        #: ranges in the store only as the PM last listed them, by stream and
        #: index: a node serves them whether or not it holds the stream
        #: (its own view of a stream it does not host may be old)
        self._listed: dict[int, list[RangeInfo]] = {}
        #: when each stream was last looked up for a read (``may_look_up``)
        self._looked_up: dict[int, float] = {}

    async def run(self) -> None:
        await self.reads.run()

    def note_listed(self, stream_id: int, ranges: Sequence[RangeInfo]) -> None:
        """The PM listed the stream's ranges (LIST_RANGES): keep those in
        the store only, by start offset."""
        offloaded = sorted(
            (r for r in ranges if r.object_state == ObjectState.IN_STORE_ONLY),
            key=lambda r: r.start_offset,
        )
        if offloaded:
            self._listed[stream_id] = offloaded
            while len(self._listed) > MAX_LISTED_STREAMS:
                del self._listed[next(iter(self._listed))]
        else:
            self._listed.pop(stream_id, None)

    def listed_range(self, stream_id: int, offset: int) -> RangeInfo | None:
        """The range in the store only that holds ``offset``, as the PM listed it."""
        listed = self._listed.get(stream_id)
        if not listed:
            return None
        at = bisect.bisect_right(listed, offset, key=lambda r: r.start_offset) - 1
        if at >= 0 and offset < listed[at].end_offset:
            return listed[at]
        return None

    def may_look_up(self, stream_id: int) -> bool:
        """Whether a read may ask the PM about the stream now: once a
        second at most per stream."""
        now = time.monotonic()
        if now - self._looked_up.get(stream_id, -LOOKUP_EVERY_S) < LOOKUP_EVERY_S:
            return False
        self._looked_up[stream_id] = now
        if len(self._looked_up) > MAX_LISTED_STREAMS:
            del self._looked_up[next(iter(self._looked_up))]
        return True

    async def upload(self, stream_id: int, range_index: int, epoch: int) -> RangeTrailer:
        return await self.uploads.upload(stream_id, range_index, epoch)

    async def read(self, info: RangeInfo, offset: int, max_bytes: int) -> BorrowedBatches:
        """FETCH's batches of a range in the store only, from ``offset``."""
        if offset >= info.end_offset:
            raise InvalidRequestError(
                f"offset {offset} is past range {info.range_index} of stream {info.stream_id}"
            )
        data, records = await self.reads.read(
            info.stream_id, info.range_index, info.epoch, offset, max_bytes
        )
        if self.reads.near_end(info.stream_id, info.range_index, info.epoch, offset + records):
            self._read_next_ahead(info)
        return BorrowedBatches.owned(data, records)

    def _read_next_ahead(self, info: RangeInfo) -> None:
        """A reader near the end of a range in the store goes on to the next
        one: its first chunks are read ahead if it is in the store only."""
        try:
            following = self._engine.describe_range(info.stream_id, info.range_index + 1)
        except ProtocolError:
            return
        if following.object_state == ObjectState.IN_STORE_ONLY:
            self.reads.read_ahead(following.stream_id, following.range_index, following.epoch)
