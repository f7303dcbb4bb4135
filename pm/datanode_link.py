"""The PM's calls to data nodes: SYNC_RANGES, SEAL_RANGES, DESCRIBE_RANGES,
DELETE_STREAMS, LIST_RANGES and RANGE_HOLDINGS, over one pooled connection
per node.

Every call retries what may pass (a connection refused or closed, a node
shutting down, any retriable error code) with backoff until the caller's
cancel scope ends it: the PM runs these calls under the deadline of the
request that caused them, so brief unreachability costs a retry, not a
failure. Each request carries the time left as its own ``timeout_ms``.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Protocol, TypeVar

import trio

from client import retry as retries
from client.datanode_client import DataNodeClient
from client.lag import record_timestamp
from net.limits import ConnectionLimits
from net.pool import ConnectionPool
from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import (
    DataNodeNotFoundError,
    SBPError,
    UnknownServerError,
    error_for,
)
from sbp.key_hash import KeyMap

from .records import Holding, RangeRecord, StreamRecord
from .wire import DataNodeCache, range_message, range_record, stream_message

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how long a newly advertised address gets to answer PING
VERIFY_TIMEOUT_S: Final = 2.0
#: the deadline sent when the caller has none
DEFAULT_CALL_TIMEOUT_S: Final = 30.0
#: how long a data node may take to copy a range to the object store
UPLOAD_TIMEOUT_S: Final = 60.0
#: stream entries per SYNC_RANGES or DELETE_STREAMS request (keeps frames well
#: under the frame limit and the data node's per-request work bounded)
MAX_STREAMS_PER_REQUEST: Final = 1000
RETRY_INITIAL_S: Final = 0.05
RETRY_MAX_S: Final = 1.0
#: error codes a data node may answer for a stream it has nothing of: a
#: delete or a sync of such a stream is already in the state the PM wants
_NOTHING_THERE: Final = frozenset({ErrorCode.STREAM_NOT_FOUND, ErrorCode.STREAM_DELETED})


class DataNodeCalls(Protocol):
    """What the PM asks of data nodes (``pm.datanode_link`` over the network).

    Each call retries brief unreachability until the caller's cancel scope
    (the request's deadline) ends it, and raises ``ProtocolError`` for an
    answer that retrying cannot change.
    """

    async def sync_ranges(
        self, node_id: int, streams: Sequence[tuple[int, Sequence[RangeRecord]]]
    ) -> None:
        """SYNC_RANGES: each stream with its whole current list of ranges."""

    async def seal_replica(self, rng: RangeRecord, node_id: int) -> int:
        """SEAL_RANGES on one replica of the range; returns its durable next
        offset (where the replica sealed it)."""

    async def next_offset(self, rng: RangeRecord) -> int:
        """DESCRIBE_RANGES on the range's primary; returns its next offset."""

    async def ends_of_open_ranges(
        self, node_id: int, ranges: Sequence[RangeRecord]
    ) -> dict[int, int]:
        """DESCRIBE_RANGES of open ranges on their primary, in batches: the
        next offset of each it could describe, by stream id."""

    async def record_timestamp(self, node_id: int, stream_id: int, offset: int) -> int | None:
        """FETCH of the batch holding ``offset``: its record's timestamp."""

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        """RANGE_HOLDINGS: what the node holds of each range, by (stream_id,
        range_index), and where to cut each to drop its first ``skips[i]``
        bytes; those it does not hold left out."""

    async def compaction_keys(
        self, node_id: int, stream_id: int, range_index: int
    ) -> tuple[KeyMap, int, int]:
        """COMPACTION_KEYS: a sealed range's latest offset of each key, its
        bytes and when it was last appended to."""

    async def compact_ranges(
        self, node_id: int, stream_id: int, ranges: Sequence[tuple[int, bool]], keys: KeyMap
    ) -> list[messages.CompactRangeResult]:
        """COMPACT_RANGES: rewrite the node's replicas of sealed ranges by ``keys``."""

    async def delete_streams(self, node_id: int, stream_ids: Sequence[int]) -> None:
        """DELETE_STREAMS."""

    async def upload_range(self, node_id: int, rng: RangeRecord) -> None:
        """UPLOAD_RANGE: the node copies the sealed range to the object store."""

    async def hosted_ranges(self, node_id: int) -> list[RangeRecord]:
        """LIST_RANGES by data node, asked of the node: the ranges it holds."""

    async def reachable(self, address: str) -> bool:
        """Whether ``address`` answers PING (briefly; never raises)."""


class DataNodeLink:
    """Calls to data nodes by node id; implements ``DataNodeCalls``
    over the client library's ``DataNodeClient`` and retry policy."""

    def __init__(
        self,
        pool: ConnectionPool,
        address_of: Callable[[int], str],
        *,
        term: int = 0,
        stream_of: Callable[[int], StreamRecord | None] = lambda _: None,
    ) -> None:
        self._pool = pool
        self._address_of = address_of
        #: a stream's settings, sent with its ranges in SYNC_RANGES
        self._stream_of = stream_of
        #: the PM term sent with SYNC_RANGES and SEAL_RANGES (SPEC §8; 0 without etcd)
        self.term = term
        self._data_node = DataNodeCache(address_of)

    @classmethod
    def new_pool(cls, tls: ssl.SSLContext | None = None) -> ConnectionPool:
        """A connection pool suited to these calls (enter it before use)."""
        return ConnectionPool(
            limits=ConnectionLimits(), connect_timeout=2.0, connect_attempts=1, tls=tls
        )

    async def sync_ranges(
        self, node_id: int, streams: Sequence[tuple[int, Sequence[RangeRecord]]]
    ) -> None:
        for start in range(0, len(streams), MAX_STREAMS_PER_REQUEST):
            chunk = streams[start : start + MAX_STREAMS_PER_REQUEST]
            entries = [
                messages.StreamRanges(
                    stream_id=stream_id,
                    ranges=tuple(range_message(r, self._data_node) for r in ranges),
                    stream=_stream_or_none(self._stream_of(stream_id)),
                )
                for stream_id, ranges in chunk
            ]
            results = await self._call(
                node_id,
                "SYNC_RANGES",
                lambda node, timeout: node.sync_ranges(
                    entries,  # noqa: B023
                    timeout=timeout,
                    pm_term=self.term,
                ),
            )
            for result in results:
                if result.error_code not in (ErrorCode.NONE, *_NOTHING_THERE):
                    log.warning(
                        "node %d: SYNC_RANGES of stream %d: %s",
                        node_id,
                        result.stream_id,
                        error_for(result.error_code, result.error_message),
                    )

    async def seal_replica(self, rng: RangeRecord, node_id: int) -> int:
        result = await self._call(
            node_id,
            "SEAL_RANGES",
            lambda node, timeout: node.seal_range(
                rng.stream_id, rng.range_index, timeout=timeout, pm_term=self.term
            ),
        )
        for sealed in result.ranges:
            if sealed.range_index == rng.range_index:
                return int(sealed.end_offset)
        raise UnknownServerError(
            f"node {node_id} sealed stream {rng.stream_id} range {rng.range_index} "
            "without returning it"
        )

    async def next_offset(self, rng: RangeRecord) -> int:
        described = await self._call(
            rng.primary,
            "DESCRIBE_RANGES",
            lambda node, timeout: node.describe_range(
                rng.stream_id, rng.range_index, timeout=timeout
            ),
        )
        return int(described.next_offset)

    async def ends_of_open_ranges(
        self, node_id: int, ranges: Sequence[RangeRecord]
    ) -> dict[int, int]:
        """The live next offset of each of these open ranges the node is
        primary of, by stream id (DESCRIBE_RANGES in batches); ranges it
        cannot describe are left out."""
        found: dict[int, int] = {}
        for start in range(0, len(ranges), MAX_STREAMS_PER_REQUEST):
            chunk = [
                messages.RangeId(stream_id=r.stream_id, range_index=r.range_index)
                for r in ranges[start : start + MAX_STREAMS_PER_REQUEST]
            ]
            results = await self._call(
                node_id,
                "DESCRIBE_RANGES",
                lambda node, timeout: node.describe_ranges(chunk, timeout=timeout),  # noqa: B023
            )
            for result in results:
                if result.error_code == ErrorCode.NONE and result.range is not None:
                    found[result.stream_id] = int(result.range.next_offset)
        return found

    async def record_timestamp(self, node_id: int, stream_id: int, offset: int) -> int | None:
        """The timestamp of the record at ``offset`` on the node (``client.lag``)."""
        return await self._call(
            node_id,
            "FETCH",
            lambda node, timeout: record_timestamp(node, stream_id, offset),
        )

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        """What the node holds of each of these ranges (RANGE_HOLDINGS in
        batches), and where to cut each to drop its first ``skips[i]`` bytes;
        ranges it does not hold are left out."""
        found: dict[tuple[int, int], Holding] = {}
        for start in range(0, len(keys), MAX_STREAMS_PER_REQUEST):
            end = start + MAX_STREAMS_PER_REQUEST
            chunk = [
                messages.RangeId(stream_id=stream_id, range_index=range_index)
                for stream_id, range_index in keys[start:end]
            ]
            skipped = list(skips[start:end])
            results = await self._call(
                node_id,
                "RANGE_HOLDINGS",
                lambda node, timeout: node.range_holdings(
                    chunk,  # noqa: B023
                    skipped,  # noqa: B023
                    timeout=timeout,
                ),
            )
            for result in results:
                if result.error_code == ErrorCode.NONE:
                    key = (int(result.stream_id), int(result.range_index))
                    found[key] = Holding(
                        int(result.held_end),
                        int(result.bytes),
                        int(result.offset_after_skip),
                        int(result.keyless_below),
                    )
        return found

    async def compaction_keys(
        self, node_id: int, stream_id: int, range_index: int
    ) -> tuple[KeyMap, int, int]:
        """What a sealed range held on the node holds of each key: the map,
        the bytes scanned, and when its last batch was appended."""
        header, payload = await self._call(
            node_id,
            "COMPACTION_KEYS",
            lambda node, timeout: node.compaction_keys(stream_id, range_index, timeout=timeout),
        )
        return KeyMap.decode(payload), int(header.bytes), int(header.last_append_ms)

    async def compact_ranges(
        self, node_id: int, stream_id: int, ranges: Sequence[tuple[int, bool]], keys: KeyMap
    ) -> list[messages.CompactRangeResult]:
        """Rewrite the node's replicas of these sealed ranges (index, drop
        tombstones) by ``keys``; per range, what it did."""
        wanted = [messages.CompactRange(range_index=i, drop_tombstones=d) for i, d in ranges]
        encoded = keys.encode()
        results = await self._call(
            node_id,
            "COMPACT_RANGES",
            lambda node, timeout: node.compact_ranges(stream_id, wanted, encoded, timeout=timeout),
        )
        return list(results)

    async def upload_range(self, node_id: int, rng: RangeRecord) -> None:
        """UPLOAD_RANGE: the node copies the sealed range to the object store
        (SPEC §14); ``ProtocolError`` when it did not."""
        # One attempt: a copy that fails is asked for again by the tiering
        # pass, of whichever replica is live then (``pm.tiering``).
        with trio.fail_after(UPLOAD_TIMEOUT_S):
            await self._call(
                node_id,
                "UPLOAD_RANGE",
                lambda node, timeout: node.upload_range(
                    rng.stream_id, rng.range_index, rng.epoch, timeout=timeout
                ),
                retry=False,
            )

    async def delete_streams(self, node_id: int, stream_ids: Sequence[int]) -> None:
        for start in range(0, len(stream_ids), MAX_STREAMS_PER_REQUEST):
            chunk = stream_ids[start : start + MAX_STREAMS_PER_REQUEST]
            results = await self._call(
                node_id,
                "DELETE_STREAMS",
                lambda node, timeout: node.delete_streams(chunk, timeout=timeout),  # noqa: B023
            )
            for result in results:
                if result.error_code not in (ErrorCode.NONE, *_NOTHING_THERE):
                    log.warning(
                        "node %d: DELETE_STREAMS: %s",
                        node_id,
                        error_for(result.error_code, result.error_message),
                    )

    async def hosted_ranges(self, node_id: int) -> list[RangeRecord]:
        """LIST_RANGES by data node, asked of the node itself: what it holds."""
        listed = await self._call(
            node_id,
            "LIST_RANGES",
            lambda node, timeout: node.list_node_ranges(self._data_node(node_id), timeout=timeout),
        )
        return [range_record(rng) for rng in listed]

    async def reachable(self, address: str) -> bool:
        """Whether a data node's advertised address answers PING within
        ``VERIFY_TIMEOUT_S``."""
        with trio.move_on_after(VERIFY_TIMEOUT_S):
            try:
                connection = await self._pool.get(address)
                await connection.ping(timeout=VERIFY_TIMEOUT_S)
            except (SBPError, OSError, ValueError) as error:
                log.info("data node address %s does not answer PING: %s", address, error)
                return False
            return True
        log.info("data node address %s did not answer PING in time", address)
        return False

    async def _call(
        self,
        node_id: int,
        what: str,
        call: Callable[[DataNodeClient, float], Awaitable[T]],
        *,
        retry: bool = True,
    ) -> T:
        """``call`` on the node until it answers for good or the caller's
        deadline passes (``client.retry``; once without ``retry``); each
        attempt sends the time left as its ``timeout_ms``."""

        async def attempt() -> T:
            address = self._address_of(node_id)
            if not address:
                raise DataNodeNotFoundError(f"no data node {node_id}")
            remaining = trio.current_effective_deadline() - trio.current_time()
            if math.isinf(remaining):
                remaining = DEFAULT_CALL_TIMEOUT_S
            node = DataNodeClient(address, pool=self._pool, timeout=max(remaining, 0.001))
            return await call(node, max(remaining, 0.001))

        if not retry:
            return await attempt()
        return await retries.until_deadline(
            attempt, f"{what} to node {node_id}", initial=RETRY_INITIAL_S, cap=RETRY_MAX_S
        )


def _stream_or_none(stream: StreamRecord | None) -> messages.Stream | None:
    return None if stream is None else stream_message(stream)
