"""LIST_RANGES, SEAL_RANGES, SYNC_RANGES and DESCRIBE_RANGES on a data node.

SEAL_RANGES and SYNC_RANGES come from the PM: with an ACL file (SPEC §9)
only the cluster's own principals may send them; listing and describing a
stream's ranges needs DESCRIBE of it, and a node's whole listing CLUSTER.
"""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial

import trio

from net.request import Request, Responder
from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import (
    DataNodeNotFoundError,
    ProtocolError,
    RangeNotFoundError,
    RequestTimeoutError,
)
from storage import writes
from storage.model import RangeInfo

from ..context import NodeContext, check_stream_id, prefetch_dropped, wait_future
from ..convert import range_to_info


def timed_out() -> RequestTimeoutError:
    return RequestTimeoutError("not done before the request's timeout_ms")


class RangeHandlers:
    """The range operations; each item succeeds or fails on its own."""

    def __init__(self, node: NodeContext) -> None:
        self._node = node

    async def list_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.ListRangesRequest)
        results = [self._list_one(request.principal, owner) for owner in header.range_owners]
        await responder.send(messages.ListRangesResponse(list_responses=tuple(results)))

    def _list_one(self, principal: str, owner: messages.RangeOwner) -> messages.ListRangesResult:
        engine = self._node.engine
        access = self._node.access
        try:
            denied = (
                access.check(principal, "CLUSTER")
                if owner.data_node is not None
                else access.check(principal, "DESCRIBE", owner.stream_id)
            )
            if denied is not None:
                raise denied
            if owner.data_node is not None:
                if owner.data_node.node_id != self._node.node_id:
                    raise DataNodeNotFoundError(
                        f"this is data node {self._node.node_id}, not {owner.data_node.node_id}"
                    )
                infos = engine.list_ranges()
            else:
                infos = engine.list_ranges(owner.stream_id)
        except ProtocolError as error:
            return messages.ListRangesResult(
                range_owner=owner, error_code=error.code, error_message=error.message
            )
        return messages.ListRangesResult(
            range_owner=owner, ranges=tuple(self._node.wire_range(info) for info in infos)
        )

    async def _from_pm(self, request: Request, what: str, pm_term: int) -> ProtocolError | None:
        """Why a PM's request must be refused whole: not from the cluster
        (SPEC §9), or from an older PM term (SPEC §8); None to serve it."""
        denied = self._node.access.check_internal(request.principal, what)
        return denied if denied is not None else await self._node.admit_pm_term(pm_term)

    async def seal_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.SealRangesRequest)
        deadline = request.deadline(header.timeout_ms)
        engine = self._node.engine
        denied = await self._from_pm(request, "SEAL_RANGES", header.pm_term)
        if denied is not None:
            refused = tuple(_seal_error(r.stream_id, denied) for r in header.ranges)
            await responder.send(messages.SealRangesResponse(seal_responses=refused))
            return
        # Submitted together, the seals commit in one transaction.
        futures = [
            engine.submit_command(
                partial(
                    writes.seal_range,
                    stream_id=range_id.stream_id,
                    range_index=range_id.range_index,
                )
            )
            for range_id in header.ranges
        ]
        results: list[messages.SealRangesResult] = []
        for range_id, future in zip(header.ranges, futures, strict=True):
            stream_id = range_id.stream_id
            try:
                with trio.fail_at(deadline):
                    sealed = await wait_future(future)
            except trio.TooSlowError:
                results.append(_seal_error(stream_id, timed_out()))
                continue
            except ProtocolError as error:
                results.append(_seal_error(stream_id, error))
                continue
            # A FETCH waiting at the end of this range now gets RANGE_SEALED,
            # and replication of the range stops.
            self._node.ranges_changed(stream_id)
            results.append(
                messages.SealRangesResult(
                    stream_id=stream_id, ranges=(self._node.wire_range(sealed),)
                )
            )
        await responder.send(messages.SealRangesResponse(seal_responses=tuple(results)))

    async def sync_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.SyncRangesRequest)
        deadline = request.deadline(header.timeout_ms)
        engine = self._node.engine
        denied = await self._from_pm(request, "SYNC_RANGES", header.pm_term)
        if denied is not None:
            refused = tuple(_sync_error(item.stream_id, denied) for item in header.stream_ranges)
            await responder.send(messages.SyncRangesResponse(sync_responses=refused))
            return
        views: list[list[RangeInfo] | ProtocolError] = []
        for item in header.stream_ranges:
            try:
                check_stream_id(item.stream_id)
                views.append([range_to_info(wire) for wire in item.ranges])
            except ProtocolError as error:
                views.append(error)
        await prefetch_dropped(
            engine,
            [
                (item.stream_id, infos)
                for item, infos in zip(header.stream_ranges, views, strict=True)
                if not isinstance(infos, ProtocolError)
            ],
        )
        futures: list[Future[list[RangeInfo]] | ProtocolError] = [
            infos
            if isinstance(infos, ProtocolError)
            else engine.submit_command(
                partial(writes.sync_ranges, stream_id=item.stream_id, ranges=infos)
            )
            for item, infos in zip(header.stream_ranges, views, strict=True)
        ]
        results: list[messages.SyncRangesResult] = []
        for item, future in zip(header.stream_ranges, futures, strict=True):
            stream_id = item.stream_id
            try:
                if isinstance(future, ProtocolError):
                    raise future
                with trio.fail_at(deadline):
                    synced = await wait_future(future)
            except trio.TooSlowError:
                results.append(_sync_error(stream_id, timed_out()))
                continue
            except ProtocolError as error:
                results.append(_sync_error(stream_id, error))
                continue
            self._node.ranges_changed(stream_id)
            results.append(
                messages.SyncRangesResult(
                    stream_id=stream_id,
                    ranges=tuple(self._node.wire_range(info) for info in synced),
                )
            )
        self._node.on_streams_synced(
            result.stream_id for result in results if result.error_code == ErrorCode.NONE
        )
        await responder.send(messages.SyncRangesResponse(sync_responses=tuple(results)))

    async def describe_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DescribeRangesRequest)
        results: list[messages.DescribeRangeResult] = []
        for range_id in header.ranges:
            try:
                denied = self._node.access.check(request.principal, "DESCRIBE", range_id.stream_id)
                if denied is not None:
                    raise denied
                info = await self._describe(range_id.stream_id, range_id.range_index)
            except ProtocolError as error:
                results.append(
                    messages.DescribeRangeResult(
                        stream_id=range_id.stream_id,
                        error_code=error.code,
                        error_message=error.message,
                    )
                )
                continue
            results.append(
                messages.DescribeRangeResult(
                    stream_id=range_id.stream_id, range=self._node.wire_range(info)
                )
            )
        await responder.send(messages.DescribeRangesResponse(describe_responses=tuple(results)))

    async def _describe(self, stream_id: int, range_index: int) -> RangeInfo:
        engine = self._node.engine
        try:
            return engine.describe_range(stream_id, range_index)
        except RangeNotFoundError:
            # A range (or stream) placed here that this node has not been
            # told of yet, its SYNC_RANGES still on the way: ask the PM, as
            # FETCH does, rather than have the reader give up on this replica.
            if not await self._node.learn_stream(stream_id):
                raise
            return engine.describe_range(stream_id, range_index)


def _seal_error(stream_id: int, error: ProtocolError) -> messages.SealRangesResult:
    return messages.SealRangesResult(
        stream_id=stream_id, error_code=error_code(error), error_message=error.message
    )


def _sync_error(stream_id: int, error: ProtocolError) -> messages.SyncRangesResult:
    return messages.SyncRangesResult(
        stream_id=stream_id, error_code=error_code(error), error_message=error.message
    )


def error_code(error: ProtocolError) -> ErrorCode | int:
    """The wire code for an item that failed with ``error`` (never NONE)."""
    return error.code if error.code != ErrorCode.NONE else ErrorCode.UNKNOWN
