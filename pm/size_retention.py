"""Size retention (SPEC §12): a stream with ``retention_bytes`` keeps at most
about that many bytes of record batches.

A stream's ranges lie on different data nodes, so no data node sees its whole
size: the PM applies the limit. Every ``interval`` it sizes each limited
stream's ranges (RANGE_HOLDINGS to a live replica of each; a sealed range is
sized once, an open one every pass) and, when the stream holds more than its
limit, trims it (as TRIM_STREAMS does) where the oldest excess ends: past
whole ranges, then inside the next one at a boundary of whole batches that
its replica finds. The data nodes then drop what lies below the new start,
as after any trim. Time retention goes on as before on the data nodes; both
apply, so the stricter wins.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final, Protocol

import trio

from net.ratelog import RateLimitedLog
from sbp.errors import ProtocolError

from .changes import DeleteStream, Metadata, PutStream
from .liveness import NodeRegistry
from .range_log import Committed
from .range_sizes import RangeSizes
from .records import Outcome, RangeRecord, StreamRecord

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log, interval=60.0)

DEFAULT_INTERVAL_S: Final = 10.0
#: streams read per page when the limited ones are first looked for
_PAGE: Final = 1000


class SizeHost(Protocol):
    store: Metadata
    registry: NodeRegistry

    @property
    def stopping(self) -> bool: ...

    async def trim_streams(
        self, trims: Sequence[tuple[int, int]], timeout: float
    ) -> Sequence[Outcome[tuple[StreamRecord, RangeRecord]]]: ...


class SizeRetention:
    """See the module docstring."""

    def __init__(
        self, pm: SizeHost, sizes: RangeSizes, interval: float = DEFAULT_INTERVAL_S
    ) -> None:
        self._pm = pm
        self._sizes = sizes
        self.interval = interval
        #: streams with a size limit; None until the first pass found them
        self._limited: set[int] | None = None
        #: trims made, and the bytes they dropped (metrics)
        self.trims = 0
        self.trimmed_bytes = 0

    def committed(self, done: Committed) -> None:
        """The streams under a size limit follow a commit (``pm.range_log``)."""
        for change in done.changes:
            if isinstance(change, PutStream):
                self.track(change.stream)
            elif isinstance(change, DeleteStream):
                self.forget(change.stream_id)

    def track(self, stream: StreamRecord) -> None:
        """A stream committed: follow its limit."""
        if self._limited is None:
            return  # the first pass finds it
        if _limited(stream):
            self._limited.add(stream.stream_id)
        else:
            self._limited.discard(stream.stream_id)

    def forget(self, stream_id: int) -> None:
        if self._limited is not None:
            self._limited.discard(stream_id)
        self._sizes.forget_stream(stream_id)

    async def run(self) -> None:
        """A pass every ``interval`` for the PM's life."""
        while True:
            await trio.sleep(self.interval)
            if self._limited is None:
                await self._find_limited()
            if not self._pm.stopping:
                await self.apply(timeout=self.interval * 4)

    async def _find_limited(self) -> None:
        found: set[int] = set()
        self._limited = found
        start_after = 0
        while page := self._pm.store.streams(start_after=start_after, limit=_PAGE):
            found.update(s.stream_id for s in page if _limited(s))
            start_after = page[-1].stream_id
            await trio.sleep(0)

    async def apply(self, timeout: float) -> int:
        """One pass over the limited streams; how many were trimmed."""
        deadline = trio.current_time() + timeout
        trimmed = 0
        for stream_id in sorted(self._limited or ()):
            stream = self._pm.store.stream(stream_id)
            if stream is None or not _limited(stream):
                self.forget(stream_id)
                continue
            if self._pm.stopping or trio.current_time() >= deadline:
                break
            with trio.move_on_at(deadline):
                try:
                    trimmed += await self._apply(stream, deadline)
                except (ProtocolError, OSError) as error:
                    _failures.warning(
                        f"size {stream_id}", "size retention of stream %d: %s", stream_id, error
                    )
        return trimmed

    async def _apply(self, stream: StreamRecord, deadline: float) -> int:
        ranges = self._pm.store.ranges(stream.stream_id)
        current = {rng.key for rng in ranges}
        self._sizes.forget(k for k in self._sizes.keys_of(stream.stream_id) if k not in current)
        sizes = await self._sizes.sizes(ranges)
        excess = sum(sizes.values()) - stream.retention_bytes
        if excess <= 0 or not ranges:
            return 0
        cut, dropped = ranges[0].start_offset, 0
        for rng in ranges:
            size = sizes.get(rng.key, 0)
            if not rng.is_open and size <= excess:
                excess -= size
                dropped += size
                cut = rng.end_offset
                continue
            inside = await self._sizes.cut(rng, excess)
            if inside is not None and inside > cut:
                cut = inside
                dropped += excess
            break
        if cut <= ranges[0].start_offset:
            return 0
        [outcome] = await self._pm.trim_streams(
            [(stream.stream_id, cut)], deadline - trio.current_time()
        )
        if outcome.error is not None:
            raise outcome.error
        self.trims += 1
        self.trimmed_bytes += dropped
        log.info(
            "stream %d trimmed to offset %d: it held more than its %d-byte limit",
            stream.stream_id,
            cut,
            stream.retention_bytes,
        )
        return 1


def _limited(stream: StreamRecord) -> bool:
    """Whether the stream's size is limited: a limit set, and not a stream
    only compacted (cleanup_policy 1, SPEC §13), which keeps every key's
    latest record whatever its size."""
    return stream.retention_bytes > 0 and stream.cleanup_policy != 1
