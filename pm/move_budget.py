"""How fast the PM starts copies of ranges to other nodes (drains and
rebalancing, SPEC §12): ``--max-move-bytes-per-s``, one allowance for both.

A token bucket of one second's worth: a copy of a range may start while the
allowance is above zero, and takes the range's size from it. Copies thus
start no faster than the rate on average; each one runs at the speed of the
new replica's catch-up.
"""

from __future__ import annotations

import trio


class MoveBudget:
    """See the module docstring; a rate of 0 never holds a copy back."""

    def __init__(self, bytes_per_s: int) -> None:
        self.rate = bytes_per_s
        self._allowance = float(bytes_per_s)
        self._refilled_at: float | None = None

    def may_start(self, size: int) -> bool:
        """Whether a copy of ``size`` bytes may start now (taking its bytes)."""
        if self.rate <= 0:
            return True
        now = trio.current_time()
        if self._refilled_at is not None:
            elapsed = now - self._refilled_at
            self._allowance = min(self._allowance + elapsed * self.rate, float(self.rate))
        self._refilled_at = now
        if self._allowance <= 0:
            return False
        self._allowance -= size
        return True
