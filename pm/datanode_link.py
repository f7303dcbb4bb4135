"""The PM's calls to data nodes: SYNC_RANGES, SEAL_RANGES, DESCRIBE_RANGES,
DELETE_STREAMS and LIST_RANGES, over one pooled connection per node.

Every call retries what may pass (a connection refused or closed, a node
shutting down, any retriable error code) with backoff until the caller's
cancel scope ends it: the PM runs these calls under the deadline of the
request that caused them, so brief unreachability costs a retry, not a
failure. Each request carries the time left as its own ``timeout_ms``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final, TypeVar

import trio

from net.limits import ConnectionLimits
from net.pool import ConnectionPool, backoff_delay
from sbp import messages
from sbp.enums import ErrorCode, Opcode
from sbp.errors import (
    ConnectionClosed,
    DataNodeNotFoundError,
    ProtocolError,
    UnknownServerError,
    error_for,
    raise_for_code,
)

from .records import RangeRecord
from .wire import DataNodeCache, range_message, range_record

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the deadline sent when the caller has none
DEFAULT_CALL_TIMEOUT_S: Final = 30.0
#: stream entries per SYNC_RANGES or DELETE_STREAMS request (keeps frames well
#: under the frame limit and the data node's per-request work bounded)
MAX_STREAMS_PER_REQUEST: Final = 1000
RETRY_INITIAL_S: Final = 0.05
RETRY_MAX_S: Final = 1.0
#: error codes a data node may answer for a stream it has nothing of: a
#: delete or a sync of such a stream is already in the state the PM wants
_NOTHING_THERE: Final = frozenset({ErrorCode.STREAM_NOT_FOUND, ErrorCode.STREAM_DELETED})


class DataNodeLink:
    """Calls to data nodes by node id; implements ``pm.manager.DataNodeCalls``."""

    def __init__(self, pool: ConnectionPool, address_of: Callable[[int], str]) -> None:
        self._pool = pool
        self._address_of = address_of
        self._data_node = DataNodeCache(address_of)

    @classmethod
    def new_pool(cls) -> ConnectionPool:
        """A connection pool suited to these calls (enter it before use)."""
        return ConnectionPool(limits=ConnectionLimits(), connect_timeout=2.0, connect_attempts=1)

    async def sync_ranges(
        self, node_id: int, streams: Sequence[tuple[int, Sequence[RangeRecord]]]
    ) -> None:
        for start in range(0, len(streams), MAX_STREAMS_PER_REQUEST):
            chunk = streams[start : start + MAX_STREAMS_PER_REQUEST]
            entries = tuple(
                messages.StreamRanges(
                    stream_id=stream_id,
                    ranges=tuple(range_message(r, self._data_node) for r in ranges),
                )
                for stream_id, ranges in chunk
            )
            response = await self._call(
                node_id,
                Opcode.SYNC_RANGES,
                partial(_timed, messages.SyncRangesRequest, stream_ranges=entries),
                _as_is,
            )
            for result in response.sync_responses:
                if result.error_code not in (ErrorCode.NONE, *_NOTHING_THERE):
                    log.warning(
                        "node %d: SYNC_RANGES of stream %d: %s",
                        node_id,
                        result.stream_id,
                        error_for(result.error_code, result.error_message),
                    )

    async def seal_range(self, rng: RangeRecord) -> int:
        key = (messages.RangeId(stream_id=rng.stream_id, range_index=rng.range_index),)

        def end_offset(response: messages.SealRangesResponse) -> int:
            for result in response.seal_responses:
                raise_for_code(result.error_code, result.error_message)
                for sealed in result.ranges:
                    if sealed.range_index == rng.range_index:
                        return int(sealed.end_offset)
            raise UnknownServerError(
                f"node {rng.primary} sealed stream {rng.stream_id} range {rng.range_index} "
                "without returning it"
            )

        return await self._call(
            rng.primary,
            Opcode.SEAL_RANGES,
            partial(_timed, messages.SealRangesRequest, ranges=key),
            end_offset,
        )

    async def next_offset(self, rng: RangeRecord) -> int:
        key = (messages.RangeId(stream_id=rng.stream_id, range_index=rng.range_index),)

        def next_offset(response: messages.DescribeRangesResponse) -> int:
            for result in response.describe_responses:
                raise_for_code(result.error_code, result.error_message)
                if result.range is not None:
                    return int(result.range.next_offset)
            raise UnknownServerError(
                f"node {rng.primary} described stream {rng.stream_id} range {rng.range_index} "
                "without returning it"
            )

        return await self._call(
            rng.primary,
            Opcode.DESCRIBE_RANGES,
            partial(_timed, messages.DescribeRangesRequest, ranges=key),
            next_offset,
        )

    async def delete_streams(self, node_id: int, stream_ids: Sequence[int]) -> None:
        for start in range(0, len(stream_ids), MAX_STREAMS_PER_REQUEST):
            streams = tuple(
                messages.Stream(stream_id=stream_id)
                for stream_id in stream_ids[start : start + MAX_STREAMS_PER_REQUEST]
            )
            response = await self._call(
                node_id,
                Opcode.DELETE_STREAMS,
                partial(_timed, messages.DeleteStreamsRequest, streams=streams),
                _as_is,
            )
            for result in response.delete_responses:
                if result.error_code not in (ErrorCode.NONE, *_NOTHING_THERE):
                    log.warning(
                        "node %d: DELETE_STREAMS: %s",
                        node_id,
                        error_for(result.error_code, result.error_message),
                    )

    async def hosted_ranges(self, node_id: int) -> list[RangeRecord]:
        """LIST_RANGES by data node, asked of the node itself: what it holds."""
        owner = messages.RangeOwner(data_node=self._data_node(node_id))

        def ranges(response: messages.ListRangesResponse) -> list[RangeRecord]:
            listed: list[RangeRecord] = []
            for result in response.list_responses:
                raise_for_code(result.error_code, result.error_message)
                listed.extend(range_record(rng) for rng in result.ranges)
            return listed

        return await self._call(
            node_id,
            Opcode.LIST_RANGES,
            partial(_timed, messages.ListRangesRequest, range_owners=(owner,)),
            ranges,
        )

    async def _call(
        self,
        node_id: int,
        opcode: Opcode,
        build: Callable[[int], messages.Message],
        accept: Callable[[Any], T],
    ) -> T:
        """Send ``build(timeout_ms)`` to the node until ``accept`` takes the
        response header or the caller's deadline passes. ``accept`` raises
        ``ProtocolError`` for an item error; a retriable one is retried too."""
        failures = 0
        while True:
            address = self._address_of(node_id)
            if not address:
                raise DataNodeNotFoundError(f"no data node {node_id}")
            remaining = trio.current_effective_deadline() - trio.current_time()
            if math.isinf(remaining):
                remaining = DEFAULT_CALL_TIMEOUT_S
            timeout_ms = max(int(remaining * 1000), 1)
            try:
                connection = await self._pool.get(address)
                response = await connection.request(
                    opcode, build(timeout_ms), timeout=max(remaining, 0.001)
                )
                return accept(response.header)
            except ProtocolError as exc:
                if not exc.retriable:
                    raise
                error: Exception = exc
            except (ConnectionClosed, OSError) as exc:
                error = exc
            failures += 1
            log.debug(
                "%s to node %d at %s failed (%s); retrying", opcode.name, node_id, address, error
            )
            await trio.sleep(backoff_delay(failures, initial=RETRY_INITIAL_S, cap=RETRY_MAX_S))


def _timed(
    message: Callable[..., messages.Message], timeout_ms: int, **fields: Any
) -> messages.Message:
    return message(timeout_ms=timeout_ms, **fields)


def _as_is(header: T) -> T:
    return header
