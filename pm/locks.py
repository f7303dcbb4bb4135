"""Per-stream locks: changes to one stream's ranges happen one at a time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack, asynccontextmanager

import trio


class StreamLocks:
    """One ``trio.Lock`` per stream id, created on demand and dropped when no
    task holds or waits for it, so memory follows concurrency, not stream count."""

    def __init__(self) -> None:
        self._locks: dict[int, trio.Lock] = {}
        self._users: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, stream_id: int) -> AsyncIterator[None]:
        lock = self._locks.get(stream_id)
        if lock is None:
            lock = self._locks[stream_id] = trio.Lock()
        self._users[stream_id] = self._users.get(stream_id, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[stream_id] -= 1
            if self._users[stream_id] == 0:
                del self._users[stream_id]
                del self._locks[stream_id]

    @asynccontextmanager
    async def hold_all(self, stream_ids: Iterable[int]) -> AsyncIterator[None]:
        """Hold the locks of several streams, taken in id order so that two
        batches over overlapping streams cannot deadlock."""
        async with AsyncExitStack() as stack:
            for stream_id in sorted(set(stream_ids)):
                await stack.enter_async_context(self.hold(stream_id))
            yield
