"""REPORT_METRICS: the node's load, measured, for the PM's placement.

Rates are differences of the node's counters (and the storage writer's)
between two reports, divided by the time between them; averages are over the
same window. Fields of int16 are clamped, as SPEC §3 says.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from sbp import messages
from storage.engine import StorageEngine
from storage.model import RangeInfo

from .metrics import NodeCounters, memory_used

INT16_MAX: Final = (1 << 15) - 1
INT32_MAX: Final = (1 << 31) - 1


def clamp16(value: float) -> int:
    return max(0, min(INT16_MAX, round(value)))


def active_range_count(ranges: list[RangeInfo]) -> int:
    """Open (writable) ranges among those hosted."""
    return sum(1 for info in ranges if info.is_open)


class LoadReporter:
    """Builds each REPORT_METRICS request from what changed since the last one."""

    def __init__(
        self,
        engine: StorageEngine,
        counters: NodeCounters,
        data_dir: Path,
        identity: Callable[[], messages.DataNode],
        missing_replicas: Callable[[], int] = lambda: 0,
    ) -> None:
        self._engine = engine
        self._missing_replicas = missing_replicas
        self._counters = counters
        self._data_dir = data_dir
        self._identity = identity
        self._last_time = time.monotonic()
        self._last_counters = counters.snapshot()
        self._last_storage = engine.stats()

    def build(self) -> messages.ReportMetricsRequest:
        now = time.monotonic()
        counters = self._counters.snapshot()
        storage = self._engine.stats()
        seconds = max(now - self._last_time, 1e-3)
        before, stored_before = self._last_counters, self._last_storage
        self._last_time, self._last_counters, self._last_storage = now, counters, storage

        appends = counters.append_requests - before.append_requests
        fetches = counters.fetch_requests - before.fetch_requests
        commits = storage.commits_total - stored_before.commits_total
        commit_seconds = storage.commit_seconds_total - stored_before.commit_seconds_total
        return messages.ReportMetricsRequest(
            data_node=self._identity(),
            disk_in_rate=round((counters.appended_bytes - before.appended_bytes) / seconds),
            disk_out_rate=round((counters.fetched_bytes - before.fetched_bytes) / seconds),
            # what appends can still use: the disk's free space, or the room
            # left in the LMDB map when that is less (a full map refuses
            # appends with STORAGE_FULL however much disk is free)
            disk_free_space=min(shutil.disk_usage(self._data_dir).free, storage.append_room_bytes),
            # the index is written in the same transaction as the batches
            disk_unindexed_data_size=0,
            memory_used=memory_used(),
            uring_task_rate=clamp16(commits / seconds),
            uring_inflight_task_cnt=clamp16(storage.appends_in_commit),
            uring_pending_task_cnt=min(storage.appends_waiting, INT32_MAX),
            uring_task_avg_latency=clamp16(1000 * commit_seconds / commits if commits else 0),
            network_append_rate=clamp16(appends / seconds),
            network_fetch_rate=clamp16(fetches / seconds),
            network_failed_append_rate=clamp16(
                (counters.append_items_failed - before.append_items_failed) / seconds
            ),
            network_failed_fetch_rate=clamp16(
                (counters.fetch_items_failed - before.fetch_items_failed) / seconds
            ),
            network_append_avg_latency=clamp16(
                _mean_ms(counters.append_seconds - before.append_seconds, appends)
            ),
            network_fetch_avg_latency=clamp16(
                _mean_ms(counters.fetch_seconds - before.fetch_seconds, fetches)
            ),
            # Until replication lands every range has exactly the one replica it needs.
            range_missing_replica_cnt=clamp16(self._missing_replicas()),
            range_active_cnt=clamp16(active_range_count(self._engine.list_ranges())),
        )


def _mean_ms(seconds: float, count: int) -> float:
    return 1000 * seconds / count if count else 0.0
