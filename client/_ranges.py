"""Requests both the PM and the data node serve with the same tables:
LIST_RANGES, SEAL_RANGES, DESCRIBE_RANGES and DELETE_STREAMS (SPEC §2)."""

from __future__ import annotations

from collections.abc import Sequence

from sbp import messages
from sbp.answer_frames import join_list_ranges
from sbp.enums import Opcode
from sbp.errors import RangeNotFoundError, raise_for_code

from ._base import SBPClient, single


class RangeCalls(SBPClient):
    """Range and stream-deletion calls; batch methods return per-item
    results, one-item methods raise for a non-NONE error code."""

    async def list_ranges(
        self, owners: Sequence[messages.RangeOwner], *, timeout: float | None = None
    ) -> tuple[messages.ListRangesResult, ...]:
        request = messages.ListRangesRequest(
            timeout_ms=self.timeout_ms(timeout), range_owners=tuple(owners)
        )
        frames = await self.call_for_frames(
            messages.ListRangesResponse, Opcode.LIST_RANGES, request, timeout=timeout
        )
        return join_list_ranges(frames).list_responses

    async def list_stream_ranges(
        self, stream_id: int, *, timeout: float | None = None
    ) -> tuple[messages.Range, ...]:
        """Every range of a stream, in order."""
        owner = messages.RangeOwner(stream_id=stream_id)
        result = single(await self.list_ranges([owner], timeout=timeout), "LIST_RANGES")
        raise_for_code(result.error_code, result.error_message)
        return result.ranges

    async def list_node_ranges(
        self, data_node: messages.DataNode, *, timeout: float | None = None
    ) -> tuple[messages.Range, ...]:
        """Every range hosted on a data node."""
        owner = messages.RangeOwner(data_node=data_node)
        result = single(await self.list_ranges([owner], timeout=timeout), "LIST_RANGES")
        raise_for_code(result.error_code, result.error_message)
        return result.ranges

    async def seal_ranges(
        self,
        range_ids: Sequence[messages.RangeId],
        *,
        timeout: float | None = None,
        pm_term: int = 0,
    ) -> tuple[messages.SealRangesResult, ...]:
        """SEAL_RANGES: seal each open range and create the next one (a PM
        sealing on a data node gives its term)."""
        request = messages.SealRangesRequest(
            timeout_ms=self.timeout_ms(timeout), ranges=tuple(range_ids), pm_term=pm_term
        )
        header = await self.call_for(
            messages.SealRangesResponse, Opcode.SEAL_RANGES, request, timeout=timeout
        )
        return header.seal_responses

    async def seal_range(
        self, stream_id: int, range_index: int, *, timeout: float | None = None, pm_term: int = 0
    ) -> messages.SealRangesResult:
        """Seal one range; the result's ``ranges`` are the sealed one and the next."""
        range_id = messages.RangeId(stream_id=stream_id, range_index=range_index)
        sealed = await self.seal_ranges([range_id], timeout=timeout, pm_term=pm_term)
        result = single(sealed, "SEAL_RANGES")
        raise_for_code(result.error_code, result.error_message)
        return result

    async def describe_ranges(
        self, range_ids: Sequence[messages.RangeId], *, timeout: float | None = None
    ) -> tuple[messages.DescribeRangeResult, ...]:
        request = messages.DescribeRangesRequest(
            timeout_ms=self.timeout_ms(timeout), ranges=tuple(range_ids)
        )
        header = await self.call_for(
            messages.DescribeRangesResponse, Opcode.DESCRIBE_RANGES, request, timeout=timeout
        )
        return header.describe_responses

    async def describe_range(
        self, stream_id: int, range_index: int, *, timeout: float | None = None
    ) -> messages.Range:
        range_id = messages.RangeId(stream_id=stream_id, range_index=range_index)
        result = single(await self.describe_ranges([range_id], timeout=timeout), "DESCRIBE_RANGES")
        raise_for_code(result.error_code, result.error_message)
        if result.range is None:
            raise RangeNotFoundError(f"no range {range_index} of stream {stream_id}")
        return result.range

    async def delete_streams(
        self, stream_ids: Sequence[int], *, timeout: float | None = None
    ) -> tuple[messages.DeleteStreamResult, ...]:
        request = messages.DeleteStreamsRequest(
            timeout_ms=self.timeout_ms(timeout),
            streams=tuple(messages.Stream(stream_id=stream_id) for stream_id in stream_ids),
        )
        header = await self.call_for(
            messages.DeleteStreamsResponse, Opcode.DELETE_STREAMS, request, timeout=timeout
        )
        return header.delete_responses

    async def delete_stream(
        self, stream_id: int, *, timeout: float | None = None
    ) -> messages.DeleteStreamResult:
        result = single(await self.delete_streams([stream_id], timeout=timeout), "DELETE_STREAMS")
        raise_for_code(result.error_code, result.error_message)
        return result
