"""LIST_RANGES, SEAL_RANGES, SYNC_RANGES, DESCRIBE_RANGES and FIND_OFFSETS on the wire:
each item to ``DataNode`` and its outcome back; each succeeds or fails alone.

SEAL_RANGES and SYNC_RANGES come from the PM: with an ACL file (SPEC §9)
only the cluster's own principals may send them; listing and describing a
stream's ranges needs DESCRIBE of it, and a node's whole listing CLUSTER;
finding an offset by time needs FETCH of the stream. RANGE_HOLDINGS (the
PM's, implementation-private) says how much of each range this replica holds.
"""

from __future__ import annotations

from net.authz import require
from net.request import Request, Responder
from sbp import messages
from sbp.answer_frames import list_ranges_frames
from sbp.enums import ErrorCode
from sbp.errors import ProtocolError
from sbp.key_hash import KeyMap
from storage.model import RangeInfo

from ..compaction import RangeCompacted
from ..items import failed
from ..node import DataNode


class RangeHandlers:
    def __init__(self, node: DataNode) -> None:
        self._node = node
        self._access = node.access

    async def list_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.ListRangesRequest)
        results = []
        for owner in header.range_owners:
            try:
                require(
                    self._access.check(request.principal, "CLUSTER")
                    if owner.data_node is not None
                    else self._access.check(request.principal, "DESCRIBE", owner.stream_id)
                )
                infos = self._node.list_ranges(owner)
            except ProtocolError as error:
                results.append(failed(messages.ListRangesResult, error, range_owner=owner))
                continue
            ranges = tuple(self._node.wire_range(info) for info in infos)
            results.append(messages.ListRangesResult(range_owner=owner, ranges=ranges))
        await responder.send_sequence(list(list_ranges_frames(results)))

    async def seal_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.SealRangesRequest)
        denied = self._access.check_internal(request.principal, "SEAL_RANGES")
        sealed: list[RangeInfo | ProtocolError] = (
            [denied] * len(header.ranges)
            if denied is not None
            else await self._node.seal(
                header.pm_term,
                [(r.stream_id, r.range_index) for r in header.ranges],
                request.deadline(header.timeout_ms),
            )
        )
        results = tuple(
            failed(messages.SealRangesResult, outcome, stream_id=range_id.stream_id)
            if isinstance(outcome, ProtocolError)
            else messages.SealRangesResult(
                stream_id=range_id.stream_id, ranges=(self._node.wire_range(outcome),)
            )
            for range_id, outcome in zip(header.ranges, sealed, strict=True)
        )
        await responder.send(messages.SealRangesResponse(seal_responses=results))

    async def sync_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.SyncRangesRequest)
        denied = self._access.check_internal(request.principal, "SYNC_RANGES")
        synced: list[list[RangeInfo] | ProtocolError] = (
            [denied] * len(header.stream_ranges)
            if denied is not None
            else await self._node.sync(
                header.pm_term,
                [(item.stream_id, item.ranges) for item in header.stream_ranges],
                request.deadline(header.timeout_ms),
                [
                    None if item.stream is None else item.stream.cleanup_policy
                    for item in header.stream_ranges
                ],
            )
        )
        results = tuple(
            failed(messages.SyncRangesResult, outcome, stream_id=item.stream_id)
            if isinstance(outcome, ProtocolError)
            else messages.SyncRangesResult(
                stream_id=item.stream_id,
                ranges=tuple(self._node.wire_range(info) for info in outcome),
            )
            for item, outcome in zip(header.stream_ranges, synced, strict=True)
        )
        await responder.send(messages.SyncRangesResponse(sync_responses=results))

    async def describe_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DescribeRangesRequest)
        results: list[messages.DescribeRangeResult] = []
        for range_id in header.ranges:
            try:
                require(self._access.check(request.principal, "DESCRIBE", range_id.stream_id))
                info = await self._node.describe(range_id.stream_id, range_id.range_index)
            except ProtocolError as error:
                results.append(
                    failed(messages.DescribeRangeResult, error, stream_id=range_id.stream_id)
                )
                continue
            results.append(
                messages.DescribeRangeResult(
                    stream_id=range_id.stream_id, range=self._node.wire_range(info)
                )
            )
        await responder.send(messages.DescribeRangesResponse(describe_responses=tuple(results)))

    async def find_offsets(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.FindOffsetsRequest)
        results: list[messages.FindOffsetResult] = []
        for wanted in header.find_requests:
            try:
                require(self._access.check(request.principal, "FETCH", wanted.stream_id))
                offset, found_ms = await self._node.find_offset(
                    wanted.stream_id, wanted.range_index, wanted.timestamp_ms
                )
            except ProtocolError as error:
                results.append(
                    failed(
                        messages.FindOffsetResult,
                        error,
                        stream_id=wanted.stream_id,
                        range_index=wanted.range_index,
                    )
                )
                continue
            results.append(
                messages.FindOffsetResult(
                    stream_id=wanted.stream_id,
                    range_index=wanted.range_index,
                    offset=offset,
                    timestamp_ms=found_ms,
                )
            )
        await responder.send(messages.FindOffsetsResponse(find_responses=tuple(results)))

    async def range_holdings(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.RangeHoldingsRequest)
        keys = [(r.stream_id, r.range_index) for r in header.ranges]
        denied = self._access.check_internal(request.principal, "RANGE_HOLDINGS")
        outcomes: list[tuple[int, int, int, int] | ProtocolError] = (
            [denied] * len(keys)
            if denied is not None
            else await self._node.range_holdings(keys, header.skip_bytes)
        )
        results = tuple(
            failed(messages.RangeHolding, outcome, stream_id=stream_id, range_index=range_index)
            if isinstance(outcome, ProtocolError)
            else messages.RangeHolding(
                stream_id=stream_id,
                range_index=range_index,
                held_end=outcome[0],
                bytes=outcome[1],
                offset_after_skip=outcome[2],
                keyless_below=outcome[3],
            )
            for (stream_id, range_index), outcome in zip(keys, outcomes, strict=True)
        )
        await responder.send(messages.RangeHoldingsResponse(holdings=results))

    async def compaction_keys(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.CompactionKeysRequest)
        try:
            require(self._access.check_internal(request.principal, "COMPACTION_KEYS"))
            found, last_append_ms = await self._node.compaction_keys(
                header.stream_id, header.range_index
            )
        except ProtocolError as error:
            await responder.send(failed(messages.CompactionKeysResponse, error))
            return
        await responder.send(
            messages.CompactionKeysResponse(
                keys=len(found.keys),
                records=found.records,
                bytes=found.bytes,
                last_append_ms=last_append_ms,
            ),
            found.keys.encode(),
        )

    async def compact_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.CompactRangesRequest)
        try:
            keys = KeyMap.decode(request.payload)
        except ValueError as error:
            responder.send_error_nowait(ErrorCode.INVALID_REQUEST, str(error))
            return
        wanted = [(r.range_index, r.drop_tombstones) for r in header.ranges]
        denied = self._access.check_internal(request.principal, "COMPACT_RANGES")
        outcomes: list[RangeCompacted | ProtocolError] = (
            [denied] * len(wanted)
            if denied is not None
            else await self._node.compact_ranges(header.stream_id, wanted, keys)
        )
        results = tuple(
            failed(messages.CompactRangeResult, outcome, range_index=range_index)
            if isinstance(outcome, ProtocolError)
            else messages.CompactRangeResult(
                range_index=range_index,
                bytes_before=outcome.bytes_before,
                bytes_after=outcome.bytes_after,
                records_removed=outcome.records_removed,
                tombstones_removed=outcome.tombstones_removed,
            )
            for (range_index, _), outcome in zip(wanted, outcomes, strict=True)
        )
        await responder.send(messages.CompactRangesResponse(results=results))

    async def upload_range(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.UploadRangeRequest)
        denied = self._access.check_internal(request.principal, "UPLOAD_RANGE")
        outcome = (
            denied
            if denied is not None
            else await self._node.upload_range(header.stream_id, header.range_index, header.epoch)
        )
        if isinstance(outcome, ProtocolError):
            await responder.send(failed(messages.UploadRangeResponse, outcome))
            return
        await responder.send(
            messages.UploadRangeResponse(
                object_bytes=outcome.object_bytes, last_append_ms=outcome.last_append_ms
            )
        )
