"""``DataNodeClient``: every request a data node serves (SPEC §2, §5).

APPEND results may come back spread over several response frames (one per
group commit); ``append`` gathers them. FETCH answers each item as soon as it
has data; ``fetch`` yields every result with its slice of the payload as the
frames stream in, without copying the record batches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from net.calls import Response, header_as
from sbp import messages
from sbp.enums import Opcode
from sbp.errors import HeaderDecodeError, UnknownServerError, raise_for_code
from sbp.producer_stamp import ProducerStamp

from ._base import single
from ._ranges import RangeCalls
from .ordered import append_request


@dataclass(frozen=True, slots=True)
class FetchedBatches:
    """One FETCH result and its whole record batches (``batch_length`` bytes,
    a view into the received frame)."""

    result: messages.FetchResult
    data: memoryview


class DataNodeClient(RangeCalls):
    """A client of one data node (see ``SBPClient`` for how it connects).

    Range calls (``list_ranges``, ``seal_ranges``, ``describe_ranges``) and
    ``delete_streams`` come from ``RangeCalls``; on a data node they cover only
    the ranges it hosts, and sealing there only stops appends.
    """

    async def append(
        self,
        batches: Sequence[tuple[int, bytes | memoryview]],
        *,
        timeout: float | None = None,
        producers: Sequence[ProducerStamp | None] | None = None,
    ) -> tuple[messages.AppendResult, ...]:
        """APPEND ``(stream_id, record batch)`` pairs in one request; the
        results, in request order, each carry their own ``error_code``.
        ``producers``: per batch, an idempotent producer's fields (SPEC §10)."""
        stamps = producers if producers is not None else [None] * len(batches)
        request = append_request(
            [
                (stream_id, len(batch), stamp)
                for (stream_id, batch), stamp in zip(batches, stamps, strict=True)
            ],
            self.timeout_ms(timeout),
        )
        payload = b"".join(batch for _, batch in batches)
        connection = await self.connection()
        # one unary call, not a stream: the answer is one frame, rarely more,
        # and the stream's context managers cost a client ~5 % of its CPU per APPEND
        response = await connection.request(
            Opcode.APPEND, request, payload, timeout=self._deadline(timeout)
        )
        results: list[messages.AppendResult] = []
        for part in response.parts or (response,):
            results.extend(header_as(part, messages.AppendResponse).append_responses)
        if len(results) > 1:
            results.sort(key=lambda result: result.request_index)
        return tuple(results)

    async def append_batch(
        self,
        stream_id: int,
        batch: bytes | memoryview,
        *,
        timeout: float | None = None,
        producer: ProducerStamp | None = None,
    ) -> messages.AppendResult:
        """Append one record batch (as ``producer``'s, if given); returns its
        result (``base_offset``) or raises."""
        appended = await self.append([(stream_id, batch)], timeout=timeout, producers=[producer])
        result = single(appended, "APPEND")
        raise_for_code(result.error_code, result.error_message)
        return result

    async def find_offset(
        self, stream_id: int, range_index: int, timestamp_ms: int, *, timeout: float | None = None
    ) -> tuple[int, int]:
        """FIND_OFFSETS (SPEC §11) of one range: the first offset appended at
        or after ``timestamp_ms`` and its append time, or the range's end
        (next offset while open) and -1 when none was."""
        wanted = messages.FindOffset(
            stream_id=stream_id, range_index=range_index, timestamp_ms=timestamp_ms
        )
        request = messages.FindOffsetsRequest(
            timeout_ms=self.timeout_ms(timeout), find_requests=(wanted,)
        )
        header = await self.call_for(
            messages.FindOffsetsResponse, Opcode.FIND_OFFSETS, request, timeout=timeout
        )
        result = single(header.find_responses, "FIND_OFFSETS")
        raise_for_code(result.error_code, result.error_message)
        return result.offset, result.timestamp_ms

    async def producer_state(
        self, stream_id: int, as_of_offset: int, *, timeout: float | None = None
    ) -> tuple[messages.ProducerSnapshot, ...]:
        """PRODUCER_STATE (implementation-private, between data nodes): the
        stream's idempotent producers as of ``as_of_offset`` on that node."""
        request = messages.ProducerStateRequest(
            timeout_ms=self.timeout_ms(timeout), stream_id=stream_id, as_of_offset=as_of_offset
        )
        header = await self.call_for(
            messages.ProducerStateResponse, Opcode.PRODUCER_STATE, request, timeout=timeout
        )
        raise_for_code(header.error_code, header.error_message)
        return header.producers

    async def range_holdings(
        self,
        range_ids: Sequence[messages.RangeId],
        skip_bytes: Sequence[int] = (),
        *,
        timeout: float | None = None,
    ) -> tuple[messages.RangeHolding, ...]:
        """RANGE_HOLDINGS (implementation-private, PM to data node): how far
        that node holds each range without a gap, the bytes of it, and where
        to cut it to drop its first ``skip_bytes[i]`` bytes."""
        request = messages.RangeHoldingsRequest(
            timeout_ms=self.timeout_ms(timeout),
            ranges=tuple(range_ids),
            skip_bytes=tuple(skip_bytes),
        )
        header = await self.call_for(
            messages.RangeHoldingsResponse, Opcode.RANGE_HOLDINGS, request, timeout=timeout
        )
        return header.holdings

    async def compaction_keys(
        self, stream_id: int, range_index: int, *, timeout: float | None = None
    ) -> tuple[messages.CompactionKeysResponse, bytes | memoryview]:
        """COMPACTION_KEYS (implementation-private, PM to data node): what a
        sealed range holds of each key (the answer and its payload, the
        key map); raises the node's error."""
        request = messages.CompactionKeysRequest(
            timeout_ms=self.timeout_ms(timeout), stream_id=stream_id, range_index=range_index
        )
        response = await self.call(Opcode.COMPACTION_KEYS, request, timeout=timeout)
        header = response.header
        if not isinstance(header, messages.CompactionKeysResponse):
            raise UnknownServerError(f"COMPACTION_KEYS answered with {type(header).__name__}")
        raise_for_code(header.error_code, header.error_message)
        return header, response.payload

    async def compact_ranges(
        self,
        stream_id: int,
        ranges: Sequence[messages.CompactRange],
        key_map: bytes,
        *,
        timeout: float | None = None,
    ) -> tuple[messages.CompactRangeResult, ...]:
        """COMPACT_RANGES (implementation-private, PM to data node): rewrite
        sealed ranges of a stream by a key map (``storage.compaction.KeyMap``
        encoded)."""
        request = messages.CompactRangesRequest(
            timeout_ms=self.timeout_ms(timeout), stream_id=stream_id, ranges=tuple(ranges)
        )
        header = await self.call_for(
            messages.CompactRangesResponse, Opcode.COMPACT_RANGES, request, key_map, timeout=timeout
        )
        return header.results

    async def upload_range(
        self, stream_id: int, range_index: int, epoch: int, *, timeout: float | None = None
    ) -> messages.UploadRangeResponse:
        """UPLOAD_RANGE (implementation-private, PM to data node): copy a
        sealed range to the object store (SPEC §14)."""
        request = messages.UploadRangeRequest(
            timeout_ms=self.timeout_ms(timeout),
            stream_id=stream_id,
            range_index=range_index,
            epoch=epoch,
        )
        header = await self.call_for(
            messages.UploadRangeResponse, Opcode.UPLOAD_RANGE, request, timeout=timeout
        )
        raise_for_code(header.error_code, header.error_message)
        return header

    @asynccontextmanager
    async def fetch(
        self,
        requests: Sequence[messages.FetchInfo],
        *,
        max_wait_ms: int = 0,
        min_bytes: int = 0,
        timeout: float | None = None,
    ) -> AsyncIterator[AsyncIterator[FetchedBatches]]:
        """FETCH: iterate over the results as they arrive::

            async with client.fetch([FetchInfo(...)], max_wait_ms=500) as results:
                async for fetched in results:
                    ...  # fetched.result.error_code, fetched.data

        The deadline (``timeout``, default the client's) is counted on top
        of ``max_wait_ms``, the long-poll bound the node answers within.
        """
        request = messages.FetchRequest(
            max_wait_ms=max_wait_ms, min_bytes=min_bytes, fetch_requests=tuple(requests)
        )
        deadline = (self.timeout if timeout is None else timeout) + max_wait_ms / 1000
        async with self.call_streaming(Opcode.FETCH, request, timeout=deadline) as responses:
            yield _FetchResults(responses)

    async def sync_ranges(
        self,
        stream_ranges: Sequence[messages.StreamRanges],
        *,
        timeout: float | None = None,
        pm_term: int = 0,
    ) -> tuple[messages.SyncRangesResult, ...]:
        """SYNC_RANGES (sent by the PM, in its term): the ranges of each
        stream this node hosts."""
        request = messages.SyncRangesRequest(
            timeout_ms=self.timeout_ms(timeout),
            stream_ranges=tuple(stream_ranges),
            pm_term=pm_term,
        )
        header = await self.call_for(
            messages.SyncRangesResponse, Opcode.SYNC_RANGES, request, timeout=timeout
        )
        return header.sync_responses


class _FetchResults:
    """Splits each FETCH response frame's payload among its results."""

    __slots__ = ("_pending", "_responses")

    def __init__(self, responses: AsyncIterator[Response[Any]]) -> None:
        self._responses = responses
        self._pending: list[FetchedBatches] = []

    def __aiter__(self) -> _FetchResults:
        return self

    async def __anext__(self) -> FetchedBatches:
        while not self._pending:
            response = await self._responses.__anext__()  # StopAsyncIteration ends us too
            self._pending = list(reversed(split_fetch_payload(response)))
        return self._pending.pop()


def split_fetch_payload(response: Response[Any]) -> list[FetchedBatches]:
    """Each result of one FETCH response frame with its slice of the payload."""
    header = header_as(response, messages.FetchResponse)
    payload = memoryview(response.payload)
    fetched = []
    offset = 0
    for result in header.fetch_responses:
        end = offset + result.batch_length
        if result.batch_length < 0 or end > len(payload):
            raise HeaderDecodeError(
                f"FETCH result {result.request_index} claims {result.batch_length} bytes "
                f"past the payload ({len(payload)} bytes)"
            )
        fetched.append(FetchedBatches(result, payload[offset:end]))
        offset = end
    if offset != len(payload):
        raise HeaderDecodeError(
            f"FETCH results cover {offset} bytes of a {len(payload)}-byte payload"
        )
    return fetched
