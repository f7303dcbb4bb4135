"""Work kept under a rate of bytes per second (compaction, uploads to the
object store)."""

from __future__ import annotations

import trio


class Pacer:
    """Keeps work under ``rate`` bytes per second, on average since the last
    second of idleness (0: no limit)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._free_at = 0.0

    async def spend(self, nbytes: int) -> None:
        """Count ``nbytes`` done; sleep as long as they take at the rate."""
        if self.rate <= 0 or nbytes <= 0:
            return
        now = trio.current_time()
        self._free_at = max(self._free_at, now - 1.0) + nbytes / self.rate
        if self._free_at > now:
            await trio.sleep(self._free_at - now)
