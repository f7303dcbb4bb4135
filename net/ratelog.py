"""Warnings that may repeat thousands of times a second (a full disk, a
client sending oversized frames), logged at most once per interval per kind,
with the count of those left out since."""

from __future__ import annotations

import logging
import time
from typing import Final

DEFAULT_INTERVAL_S: Final = 10.0


class RateLimitedLog:
    """``warning(kind, message, *args)`` logs the first of a kind, then at
    most one per ``interval`` seconds, saying how many were left out."""

    def __init__(self, logger: logging.Logger, interval: float = DEFAULT_INTERVAL_S) -> None:
        self._logger = logger
        self._interval = interval
        #: kind -> (when it was last logged, how many were left out since)
        self._kinds: dict[str, tuple[float, int]] = {}

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """Log now or count it; True when it was logged."""
        now = time.monotonic()
        last, skipped = self._kinds.get(kind, (-self._interval, 0))
        if now - last < self._interval:
            self._kinds[kind] = (last, skipped + 1)
            return False
        self._kinds[kind] = (now, 0)
        if skipped:
            message += f" ({skipped} more like it in the last {now - last:.0f} s)"
        self._logger.warning(message, *args)
        return True
