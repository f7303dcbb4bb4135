"""Retention on the data node: drop batches older than their stream's period.

The PM owns each stream's ``retention_period_ms``; only the data node knows
when each batch was appended. So, every ``interval`` seconds (and soon after
a SYNC_RANGES, which the PM sends when UPDATE_STREAMS changes a stream),
the node:

1. asks the PM for the retention periods of the streams it hosts
   (GET_STREAMS, in pages) and records the ones that changed; without an
   answer it keeps the periods it last stored, so retention goes on while
   the PM is away;
2. drops, in one storage command, every batch appended longer ago than its
   stream's period (whole batches, oldest first: the stream's first offset
   rises);
3. tells the PM each stream's new first offset (TRIM_STREAMS), so the PM's
   ranges start where the data does, and the PM drops sealed ranges left
   empty from every node that hosts them.

What it freed is counted in ``sbp_datanode_retention_*`` metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Final

import trio

from storage.engine import StorageEngine
from storage.model import Expired
from storage.writer import wall_clock_ms

from .items import wait_future
from .metrics import NodeCounters
from .pm_link import PMLink
from .waiters import StreamWaiters

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S: Final = 30.0
#: a nudge (SYNC_RANGES) is acted on after this, so that a burst of them
#: costs one pass
NUDGE_DELAY_S: Final = 0.5
#: stream ids per GET_STREAMS and TRIM_STREAMS
PAGE: Final = 1000


class RetentionKeeper:
    """Applies the hosted streams' retention periods (see the module docstring)."""

    def __init__(
        self,
        engine: StorageEngine,
        waiters: StreamWaiters,
        counters: NodeCounters,
        pm: PMLink | None,
        interval: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self._engine = engine
        self._waiters = waiters
        self._counters = counters
        self._pm = pm
        self._interval = interval
        self._nudged: set[int] = set()
        self._wake = trio.Event()
        #: new first offsets the PM has not yet taken, by stream
        self._unreported: dict[int, int] = {}

    def nudge(self, stream_ids: Iterable[int]) -> None:
        """Look at these streams again soon: their settings may have changed."""
        self._nudged.update(stream_ids)
        self._wake.set()

    async def run(self) -> None:
        """A pass every ``interval`` seconds, and soon after a nudge, until cancelled."""
        next_full = trio.current_time() + self._interval
        while True:
            with trio.move_on_at(next_full):
                await self._wake.wait()
                await trio.sleep(NUDGE_DELAY_S)
            self._wake = trio.Event()
            if trio.current_time() >= next_full:
                self._nudged.clear()
                await self.apply(None)
                # producers silent past the expiry go on the same schedule
                await wait_future(self._engine.forget_idle_producers())
                next_full = trio.current_time() + self._interval
            elif self._nudged:
                nudged, self._nudged = self._nudged, set()
                await self.apply(nudged)

    def _prefetch_expired(self, periods: dict[int, int]) -> None:
        """Read the chunks retention is about to free, off the writer's path
        (``StorageEngine.prefetch_chunks``)."""
        now_ms = wall_clock_ms()
        for stream_id, period_ms in periods.items():
            if period_ms > 0:
                cutoff = now_ms - period_ms
                self._engine.prefetch_chunks(
                    stream_id,
                    lambda _end, entry: entry.append_time_ms >= cutoff,  # noqa: B023
                )

    async def apply(self, stream_ids: set[int] | None) -> list[Expired]:
        """One pass over these streams (all hosted ones for None); what it freed."""
        engine = self._engine
        known = engine.retention_periods()
        ids = sorted(known if stream_ids is None else stream_ids & known.keys())
        if not ids:
            return []
        fresh = await self._periods_from_pm(ids)
        changed = {sid: period for sid, period in fresh.items() if known.get(sid) != period}
        if changed:
            await wait_future(engine.set_retentions(changed))
        periods = known | changed
        await trio.to_thread.run_sync(self._prefetch_expired, {sid: periods[sid] for sid in ids})
        expired = await wait_future(engine.expire(ids))
        counters = self._counters
        counters.retention_runs += 1
        for done in expired:
            counters.retention_freed_records += done.freed_records
            counters.retention_freed_bytes += done.freed_bytes
            self._waiters.notify(done.stream_id)
            logger.info(
                "retention dropped offsets %d..%d of stream %d (%d bytes)",
                done.old_first_offset,
                done.first_offset - 1,
                done.stream_id,
                done.freed_bytes,
            )
        for done in expired:
            self._unreported[done.stream_id] = done.first_offset
        if self._unreported:
            await self._report_trims()
        return expired

    async def _periods_from_pm(self, ids: Sequence[int]) -> dict[int, int]:
        pm = self._pm
        if pm is None or not pm.connected:
            return {}
        periods: dict[int, int] = {}
        for start in range(0, len(ids), PAGE):
            page = ids[start : start + PAGE]
            found = await pm.retention_periods(page)
            if found is None:
                break  # the PM is away: keep what is stored
            periods.update(found)
        return periods

    async def _report_trims(self) -> None:
        pm = self._pm
        if pm is None:
            self._unreported.clear()
            return
        # The local data is gone already; what the PM does not take now is
        # sent again on the next pass (readers below the new first offset
        # get OFFSET_OUT_OF_RANGE from this node meanwhile).
        trims = sorted(self._unreported.items())
        for start in range(0, len(trims), PAGE):
            page = trims[start : start + PAGE]
            if not await pm.report_trims(page):
                return
            for stream_id, offset in page:
                if self._unreported.get(stream_id) == offset:
                    del self._unreported[stream_id]
