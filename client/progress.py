"""A one-line progress report on stderr for the CLI's long commands
(``sbp append`` of a file, ``sbp read`` of a large stream)."""

from __future__ import annotations

import time
from typing import IO

from . import format as fmt

#: the bar's width in characters
BAR_WIDTH = 30
#: the line is redrawn at most this often
REDRAW_S = 0.1


class Progress:
    """Records and bytes so far, their rates, and a bar when the total is
    known (in bytes or in records); drawn over itself with ``\\r``, ended
    with a newline by the final update."""

    def __init__(
        self,
        stream: IO[str],
        enabled: bool,
        *,
        total_bytes: int | None = None,
        total_records: int | None = None,
        verb: str = "stored",
    ) -> None:
        self._stream = stream
        self._enabled = enabled
        self._total_bytes = total_bytes
        self._total_records = total_records
        self._verb = verb
        self._started = time.monotonic()
        self._last_draw = 0.0

    def update(
        self, records: int, nbytes: int, *, done_bytes: int | None = None, final: bool = False
    ) -> None:
        """Draw ``records`` and ``nbytes`` (the bytes of their values, as the
        command's summary counts them); ``done_bytes``, when the bar counts
        other bytes (an input file's, line ends included), measures the bar."""
        if not self._enabled:
            return
        now = time.monotonic()
        if not final and now - self._last_draw < REDRAW_S:
            return
        self._last_draw = now
        seconds = max(now - self._started, 1e-6)
        line = (
            f"{records:,} records {self._verb}, {fmt.size_text(nbytes)}, "
            f"{records / seconds:,.0f} records/s, {fmt.size_text(int(nbytes / seconds))}/s"
        )
        done = None
        if self._total_bytes:
            done = (nbytes if done_bytes is None else done_bytes) / self._total_bytes
        elif self._total_records:
            done = records / self._total_records
        if done is not None:
            done = min(1.0, done)
            filled = int(done * BAR_WIDTH)
            line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:4.0%} " + line
        self._stream.write("\r" + line + ("\n" if final else ""))
        self._stream.flush()
