"""Where a stream's records live: its ranges as the PM last listed them, and
the connections a producer or consumer needs to reach them.

Both the producer and the consumer route by the same cache: the producer to
the primary of the open range, the consumer to the range holding an offset.
The cache is only a hint; a data node's RANGE_SEALED, RANGE_NOT_FOUND or
NOT_PRIMARY, or a connection that fails, makes the caller ``refresh`` it.
"""

from __future__ import annotations

import bisect
import ssl
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Final, Self

import trio

from net.pool import ConnectionPool
from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import RangeNotFoundError

from .datanode_client import DataNodeClient
from .pm_client import PMClient

#: errors a data node answers when the client's view of the ranges is stale
STALE_ROUTE_CODES: Final = frozenset(
    {ErrorCode.RANGE_SEALED, ErrorCode.RANGE_NOT_FOUND, ErrorCode.NOT_PRIMARY}
)


def primary_of(rng: messages.Range) -> messages.DataNode:
    """The data node that takes appends and serves reads for a range.

    Appends go there; reads start there (``replica_for_read``).
    """
    primary = rng.primary_node()
    if primary is not None:
        return primary
    raise RangeNotFoundError(
        f"range {rng.range_index} of stream {rng.stream_id} has no primary data node"
    )


def replica_for_read(
    rng: messages.Range, attempt: int, *, prefer_followers: bool = False
) -> messages.DataNode:
    """The replica to read a range from: the primary (with ``prefer_followers``,
    its first follower, and the primary last), then after each failed
    attempt the next replica in turn (SPEC §7: every replica serves what is
    committed), so a reader falls over from a dead or lagging node."""
    replicas = rng.nodes_primary_first()
    if not replicas:
        raise RangeNotFoundError(
            f"range {rng.range_index} of stream {rng.stream_id} has no data node"
        )
    if prefer_followers:
        replicas = (*replicas[1:], replicas[0])
    return replicas[attempt % len(replicas)]


class StreamRoutes:
    """The ranges of one stream, cached from the PM's LIST_RANGES."""

    def __init__(self, pm: PMClient, stream_id: int) -> None:
        self.pm = pm
        self.stream_id = stream_id
        self.ranges: tuple[messages.Range, ...] = ()
        self._starts: list[int] = []
        self._refreshing: trio.Event | None = None

    async def refresh(self) -> tuple[messages.Range, ...]:
        """List the ranges again. Callers that ask while a refresh is under
        way share its answer instead of sending their own."""
        if self._refreshing is not None:
            await self._refreshing.wait()
            return self.ranges
        self._refreshing = trio.Event()
        try:
            self.ranges = await self.pm.list_stream_ranges(self.stream_id)
            self._starts = [rng.start_offset for rng in self.ranges]
        finally:
            self._refreshing.set()
            self._refreshing = None
        return self.ranges

    def open_range(self) -> messages.Range | None:
        """The writable range as last listed (None if none is known)."""
        if self.ranges and self.ranges[-1].is_open:
            return self.ranges[-1]
        return None

    def range_for(self, offset: int) -> messages.Range | None:
        """The range holding ``offset`` as last listed: a sealed range with
        ``start <= offset < end``, or the open range from its start on."""
        index = bisect.bisect_right(self._starts, offset) - 1
        if index < 0:
            return None
        rng = self.ranges[index]
        return rng if rng.holds(offset) else None

    @property
    def first_offset(self) -> int:
        """The stream's first readable offset as last listed (0 if unknown)."""
        return self.ranges[0].start_offset if self.ranges else 0


class ClientContext:
    """The PM client and the connection pool a producer or consumer works
    with: the caller's when given, otherwise opened here (with ``tls``, an
    ``ssl.SSLContext`` from ``net.tls.TLSSettings.client_context``) and
    closed on exit."""

    def __init__(
        self,
        pm: str | PMClient,
        pool: ConnectionPool | None,
        request_timeout: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._pm_target = pm
        self._given_pool = pool
        self._tls = tls
        self.request_timeout = request_timeout
        self._stack = AsyncExitStack()
        self._pool: ConnectionPool | None = None
        self._pm: PMClient | None = None
        self._nodes: dict[str, DataNodeClient] = {}

    async def __aenter__(self) -> Self:
        pool = self._given_pool
        if pool is None:
            pool = await self._stack.enter_async_context(ConnectionPool(tls=self._tls))
        self._pool = pool
        if isinstance(self._pm_target, PMClient):
            self._pm = self._pm_target
        else:
            self._pm = PMClient(self._pm_target, pool=pool, timeout=self.request_timeout)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.__aexit__(exc_type, exc, tb)

    @property
    def pm(self) -> PMClient:
        if self._pm is None:
            raise RuntimeError("not open; use `async with`")
        return self._pm

    @property
    def pool(self) -> ConnectionPool:
        if self._pool is None:
            raise RuntimeError("not open; use `async with`")
        return self._pool

    def node(self, data_node: messages.DataNode) -> DataNodeClient:
        """The client of a data node (by its advertised address)."""
        address = data_node.advertise_addr
        client = self._nodes.get(address)
        if client is None:
            if self._pool is None:
                raise RuntimeError("not open; use `async with`")
            client = DataNodeClient(address, pool=self._pool, timeout=self.request_timeout)
            self._nodes[address] = client
        return client
