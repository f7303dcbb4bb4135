"""A data node's part in tiered storage (SPEC §14): it copies the sealed
ranges the PM asks for to the object store (``tiering.upload``), and serves
FETCH of ranges that are in the store only (``tiering.reader``, through the
disk cache under ``--data-dir``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sbp.errors import InvalidRequestError
from storage.engine import BorrowedBatches, StorageEngine
from storage.model import RangeInfo
from tiering.cache import ChunkCache
from tiering.layout import RangeTrailer
from tiering.reader import TieredReads
from tiering.store import ObjectStore, ObjectStoreSettings
from tiering.upload import RangeUploads

#: the cache's directory under the node's data directory
CACHE_DIR: Final = "object-cache"
#: a range read from the object store only (SPEC §14)
IN_STORE_ONLY: Final = 2


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
    ) -> None:
        self.store = ObjectStore(settings)
        self.uploads = RangeUploads(engine, self.store, upload_bytes_per_s)
        self.cache = ChunkCache(data_dir / CACHE_DIR, cache_bytes)
        self.reads = TieredReads(self.store, self.cache)

    async def run(self) -> None:
        await self.reads.run()

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
        return BorrowedBatches.owned(data, records)
