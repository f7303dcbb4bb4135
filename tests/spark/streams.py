"""Driving the test cluster from synchronous tests: create streams, append
known values, seal ranges through the PM, and read what a stream holds."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Self

from client.loop_thread import LoopThread
from client.pm_client import PMClient
from sbp import messages
from sbp.batches import build_batch
from spark_jobs.appender import StreamAppender
from spark_jobs.layout import RangeSlice, StreamLayout, describe_stream, replica_addresses
from spark_jobs.reader import read_slice

TIMEOUT_S = 10.0


def make_values(tag: str, count: int) -> list[bytes]:
    """Distinct values of varied lengths (0 to 40 bytes past the tag)."""
    return [f"{tag}-{i}-".encode() + b"x" * (i % 41) for i in range(count)]


class StreamOps:
    """A connection to the cluster for test set-up and checks."""

    def __init__(self, pm_address: str) -> None:
        self.pm_address = pm_address
        self._loop = LoopThread()

    def __enter__(self) -> Self:
        self._loop.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._loop.close()

    @property
    def _pm(self) -> PMClient:
        return PMClient(self.pm_address, pool=self._loop.pool, timeout=TIMEOUT_S)

    def create_stream(self, replicas: int = 1) -> int:
        result = self._loop.run(self._pm.create_stream, replicas)
        assert result.stream is not None
        return int(result.stream.stream_id)

    def append(self, stream_id: int, values: Sequence[bytes], timestamp_ms: int = 0) -> int:
        """Append ``values`` as one batch; its base offset."""
        appender = StreamAppender(self._loop.pool, self.pm_address, stream_id, TIMEOUT_S)
        batch = build_batch(values, timestamp_ms or int(time.time() * 1000))
        return self._loop.run(appender.append, batch)

    def ranges(self, stream_id: int) -> tuple[messages.Range, ...]:
        return self._loop.run(self._pm.list_stream_ranges, stream_id)

    def seal(self, stream_id: int) -> messages.Range:
        """Seal the open range (the PM opens the next one); the new open range."""
        current = self.ranges(stream_id)[-1]
        result = self._loop.run(self._pm.seal_range, stream_id, current.range_index)
        return result.ranges[-1]

    def layout(self, stream_id: int) -> StreamLayout:
        return self._loop.run(
            describe_stream, self._loop.pool, self.pm_address, stream_id, TIMEOUT_S
        )

    def hosts(self, stream_id: int) -> set[str]:
        """The data nodes holding the primaries of the stream's ranges."""
        return {replica_addresses(rng)[0] for rng in self.ranges(stream_id)}

    def read_all(self, stream_id: int) -> list[bytes]:
        """Every value of the stream, read without Spark."""
        layout = self.layout(stream_id)
        values: list[bytes] = []
        for rng in layout.ranges:
            end = layout.next_offset if rng.is_open else rng.end_offset
            piece = RangeSlice(
                stream_id, rng.range_index, rng.start_offset, end, replica_addresses(rng)
            )
            for batch in read_slice(piece, 1 << 20, TIMEOUT_S):
                values.extend(batch.column("value").to_pylist())
        return values
