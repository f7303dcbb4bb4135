"""A data node's part in compaction (SPEC §13): the PM asks what a sealed
range holds of each key (COMPACTION_KEYS), then has every replica of the
stream's sealed ranges rewrite them by one map of each key's latest offset
(COMPACT_RANGES). The reads and the rewriting run off the event loop; the
rewritten chunks go in through the storage writer in one transaction per
range, so a crash leaves a range as it was or compacted whole, and appends
wait at most for that swap. The node reads and rewrites at most
``--compaction-bytes-per-s`` (0: no limit), so compaction never takes the
disk from appends and reads for long.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import trio
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from net.pacer import Pacer
from sbp.key_hash import KeyMap
from storage.compaction import RangeKeys
from storage.engine import StorageEngine

from .items import wait_future
from .waiters import StreamWaiters

logger = logging.getLogger(__name__)

#: bytes per second compaction reads and rewrites, by default
DEFAULT_COMPACTION_BYTES_PER_S: Final = 200 << 20


@dataclass(slots=True)
class CompactionCounters:
    """What compaction did on this node (/metrics)."""

    scanned_bytes: int = 0
    rewritten_ranges: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    records_removed: int = 0
    tombstones_removed: int = 0


@dataclass(frozen=True, slots=True)
class RangeCompacted:
    bytes_before: int
    bytes_after: int
    records_removed: int
    tombstones_removed: int


class NodeCompaction:
    """See the module docstring."""

    def __init__(self, engine: StorageEngine, waiters: StreamWaiters, rate: int) -> None:
        self._engine = engine
        self._waiters = waiters
        self.pacer = Pacer(rate)
        self.counters = CompactionCounters()
        #: one range at a time: the rate holds, and two passes never race
        self._lock = trio.Lock()

    async def keys(self, stream_id: int, range_index: int) -> tuple[RangeKeys, int]:
        """What a sealed range held here holds of each key, and when its
        last batch was appended."""
        async with self._lock:
            engine = self._engine
            found = await trio.to_thread.run_sync(engine.range_keys, stream_id, range_index)
            self.counters.scanned_bytes += found.bytes
            await self.pacer.spend(found.bytes)
            last = await trio.to_thread.run_sync(
                engine.range_last_append_ms, stream_id, range_index
            )
            return found, last

    async def compact(
        self, stream_id: int, range_index: int, keys: KeyMap, drop_tombstones: bool
    ) -> RangeCompacted:
        """Rewrite a sealed range held here by ``keys``."""
        async with self._lock:
            engine = self._engine
            rewrites = await trio.to_thread.run_sync(
                engine.compaction_rewrites, stream_id, range_index, keys, drop_tombstones
            )
            before = sum(r.old_size for r in rewrites)
            await self.pacer.spend(before)
            freed = await wait_future(engine.apply_compaction(stream_id, range_index, rewrites))
            done = RangeCompacted(
                before,
                before - freed,
                sum(r.records_removed for r in rewrites),
                sum(r.tombstones_removed for r in rewrites),
            )
            counters = self.counters
            counters.rewritten_ranges += 1
            counters.bytes_before += done.bytes_before
            counters.bytes_after += done.bytes_after
            counters.records_removed += done.records_removed
            counters.tombstones_removed += done.tombstones_removed
            if done.records_removed:
                logger.info(
                    "compacted stream %d range %d: %d records removed (%d tombstones), "
                    "%d of %d bytes left",
                    stream_id,
                    range_index,
                    done.records_removed,
                    done.tombstones_removed,
                    done.bytes_after,
                    done.bytes_before,
                )
            return done


class CompactionCollector(Collector):
    """What compaction did on this node, on /metrics."""

    def __init__(self, counters: CompactionCounters) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        c = self._counters
        for name, help_text, value in (
            ("scanned_bytes", "bytes of sealed ranges read for their keys", c.scanned_bytes),
            ("rewritten_ranges", "sealed ranges rewritten by a pass", c.rewritten_ranges),
            ("bytes_before", "bytes of the chunks rewritten, before", c.bytes_before),
            ("bytes_after", "bytes of the chunks rewritten, after", c.bytes_after),
            (
                "records_removed",
                "records removed: superseded, or expired tombstones",
                c.records_removed,
            ),
            ("tombstones_removed", "tombstones removed", c.tombstones_removed),
        ):
            yield CounterMetricFamily(f"sbp_datanode_compaction_{name}", help_text, value=value)
