"""Driving the test cluster from synchronous tests: create streams, append
known values, seal ranges through the PM, and read what a stream holds."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Self

from client.sync import SyncClient
from sbp import messages
from sbp.batches import build_batch
from spark_jobs.layout import RangeSlice, StreamLayout, describe_stream, replica_addresses
from spark_jobs.reader import read_slice

TIMEOUT_S = 10.0


def make_values(tag: str, count: int) -> list[bytes]:
    """Distinct values of varied lengths (0 to 40 bytes past the tag)."""
    return [f"{tag}-{i}-".encode() + b"x" * (i % 41) for i in range(count)]


class StreamOps:
    """A client of the cluster for test set-up and checks."""

    def __init__(self, pm_address: str) -> None:
        self.pm_address = pm_address
        self._client = SyncClient(pm_address, timeout=TIMEOUT_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._client.close()

    def create_stream(self, replicas: int = 1) -> int:
        return int(self._client.create_stream(replicas).stream_id)

    def append(self, stream_id: int, values: Sequence[bytes], timestamp_ms: int = 0) -> int:
        """Append ``values`` as one batch; its base offset."""
        batch = build_batch(values, timestamp_ms or int(time.time() * 1000))
        with self._client.producer(stream_id, request_timeout=TIMEOUT_S) as producer:
            return int(producer.send_batch(batch).offsets()[0])

    def group_positions(self, group: str) -> tuple[messages.GroupOffsetResult, ...]:
        """The consumer group's positions as the PM holds them."""
        return self._client.run(self._client.pm.fetch_offsets, group)

    def ranges(self, stream_id: int) -> tuple[messages.Range, ...]:
        return self._client.list_ranges(stream_id)

    def tier(self, stream_id: int, local_retention_ms: int = 0) -> None:
        """Make the stream tiered (SPEC §14)."""
        self._client.update_stream(stream_id, local_retention_ms=local_retention_ms)

    def seal(self, stream_id: int) -> messages.Range:
        """Seal the open range (the PM opens the next one); the new open range."""
        return self._client.seal(stream_id)[-1]

    def trim(self, stream_id: int, offset: int) -> int:
        """Drop the records below ``offset``; the stream's first offset after."""
        return self._client.trim(stream_id, offset)

    def layout(self, stream_id: int) -> StreamLayout:
        client = self._client
        return client.run(describe_stream, client.pm, client.pool, stream_id)

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
            for batch in read_slice(self._client, piece, 1 << 20):
                values.extend(batch.column("value").to_pylist())
        return values
