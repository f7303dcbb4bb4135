"""Appending record batches to a stream from a Spark task.

Each batch goes to the primary of the stream's open range. When that range
was sealed or moved (RANGE_SEALED, RANGE_NOT_FOUND, NOT_PRIMARY) or the node
is unreachable, the ranges are asked of the PM again and the batch is sent
to the new open range. A batch whose answer was lost may have been stored
before the retry: appends are at-least-once.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from client.datanode_client import DataNodeClient
from client.pm_client import PMClient
from net.pool import ConnectionPool, backoff_delay
from sbp.errors import ConnectionClosed, ProtocolError, StreamNotFoundError

from .layout import replica_addresses

#: tries of one batch before the task fails (and Spark retries the task)
APPEND_ATTEMPTS = 8


@dataclass
class AppendedSpan:
    """Offsets a task appended: ``[first_offset, last_offset]`` and how many records."""

    records: int = 0
    batches: int = 0
    first_offset: int = -1
    last_offset: int = -1

    def add(self, base_offset: int, count: int) -> None:
        if self.first_offset < 0:
            self.first_offset = base_offset
        self.last_offset = base_offset + count - 1
        self.records += count
        self.batches += 1


class StreamAppender:
    """Appends batches to one stream, one request at a time (so in order)."""

    def __init__(
        self, pool: ConnectionPool, pm_address: str, stream_id: int, timeout: float
    ) -> None:
        self._pool = pool
        self._pm = PMClient(pm_address, pool=pool, timeout=timeout)
        self._stream_id = stream_id
        self._timeout = timeout
        self._primary: str | None = None

    async def _open_range_primary(self) -> str:
        ranges = await self._pm.list_stream_ranges(self._stream_id)
        open_ranges = [rng for rng in ranges if rng.is_open]
        if not open_ranges:
            raise StreamNotFoundError(f"stream {self._stream_id} has no open range")
        addresses = replica_addresses(open_ranges[-1])
        if not addresses:
            raise StreamNotFoundError(f"the open range of stream {self._stream_id} has no replica")
        return addresses[0]

    async def append(self, batch: bytearray) -> int:
        """Append one batch; its base offset."""
        failure: Exception | None = None
        for attempt in range(APPEND_ATTEMPTS):
            if attempt:
                await trio.sleep(backoff_delay(attempt))
            try:
                if self._primary is None:
                    self._primary = await self._open_range_primary()
                node = DataNodeClient(self._primary, pool=self._pool, timeout=self._timeout)
                result = await node.append_batch(self._stream_id, memoryview(batch))
                return int(result.base_offset)
            except ProtocolError as error:
                if not error.retriable:
                    raise
                failure = error
            except (ConnectionClosed, OSError) as error:
                failure = error
            self._primary = None  # ask the PM where the open range is now
        raise RuntimeError(
            f"appending to stream {self._stream_id} failed {APPEND_ATTEMPTS} times"
        ) from failure
