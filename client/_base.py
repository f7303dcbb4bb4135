"""What the PM client and the data node client share: reaching the server
(through a pool by address, or over a connection given), request deadlines,
and turning per-item error codes into exceptions for one-item calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Self, TypeVar

from net.calls import Response
from net.connection import Connection
from net.pool import ConnectionPool
from sbp import messages
from sbp.enums import ClientRole, Opcode
from sbp.errors import InvalidRequestError, ShuttingDownError, raise_for_code

#: default deadline of one call, seconds
DEFAULT_TIMEOUT = 30.0
#: the client waits this much longer than the deadline it sends (timeout_ms),
#: so that the server's own TIMEOUT answer arrives before the client gives up
DEADLINE_GRACE = 1.0

M = TypeVar("M", bound=messages.Message)


#: raise the exception for a per-item error code (``sbp.errors.raise_for_code``)
raise_for_item = raise_for_code


def single(results: tuple[M, ...], what: str) -> M:
    """The one result of a one-item request."""
    if len(results) != 1:
        raise InvalidRequestError(f"{what}: expected 1 result, the server sent {len(results)}")
    return results[0]


class SBPClient:
    """Base of the protocol clients. Give it an address ("host:port") to go
    through a ``ConnectionPool`` (its own, opened by ``async with``, unless one
    is passed), or a running ``Connection`` to use as it is."""

    def __init__(
        self,
        target: str | Connection,
        *,
        pool: ConnectionPool | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.timeout = timeout
        self._fixed: Connection | None = None
        self._own_pool = False
        if isinstance(target, Connection):
            self._fixed = target
            self.address = target.peer
            self._pool = pool
        else:
            self.address = target
            self._own_pool = pool is None
            self._pool = pool if pool is not None else ConnectionPool()

    async def __aenter__(self) -> Self:
        if self._own_pool and self._pool is not None:
            await self._pool.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._own_pool and self._pool is not None:
            await self._pool.__aexit__(exc_type, exc, tb)

    async def connection(self) -> Connection:
        """The connection to use now (a fresh one after a GOAWAY or a failure)."""
        if self._fixed is not None:
            return self._fixed
        assert self._pool is not None
        return await self._pool.get(self.address)

    def timeout_ms(self, timeout: float | None) -> int:
        """The ``timeout_ms`` a request header carries for a call's timeout."""
        return int((self.timeout if timeout is None else timeout) * 1000)

    def _deadline(self, timeout: float | None) -> float:
        return (self.timeout if timeout is None else timeout) + DEADLINE_GRACE

    async def call(
        self,
        opcode: Opcode,
        header: messages.Message | None,
        payload: bytes | memoryview = b"",
        *,
        timeout: float | None = None,
    ) -> Response[Any]:
        """One unary request. A connection that received GOAWAY refuses it
        before it is sent, and a draining server refuses it unapplied, so on a
        pooled connection it is tried once more on a fresh connection."""
        seconds = self._deadline(timeout)
        connection = await self.connection()
        try:
            return await connection.request(opcode, header, payload, timeout=seconds)
        except ShuttingDownError:
            if self._fixed is not None:
                raise
        connection = await self.connection()
        return await connection.request(opcode, header, payload, timeout=seconds)

    @asynccontextmanager
    async def call_streaming(
        self,
        opcode: Opcode,
        header: messages.Message,
        payload: bytes | memoryview = b"",
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[AsyncIterator[Response[Any]]]:
        """A request answered in several frames (see ``Connection.stream``)."""
        seconds = self._deadline(timeout)
        connection = await self.connection()
        async with connection.stream(opcode, header, payload, timeout=seconds) as responses:
            yield responses

    async def ping(self, *, timeout: float | None = None) -> float:
        """Round trip to the server, in seconds."""
        connection = await self.connection()
        return await connection.ping(timeout=self.timeout if timeout is None else timeout)

    async def heartbeat(
        self,
        client_id: str,
        *,
        role: ClientRole = ClientRole.CLIENT,
        data_node: messages.DataNode | None = None,
        timeout: float | None = None,
    ) -> messages.HeartbeatResponse:
        """HEARTBEAT: announce this client; the answer describes the server."""
        request = messages.HeartbeatRequest(
            client_id=client_id, client_role=role, data_node=data_node
        )
        response = await self.call(Opcode.HEARTBEAT, request, timeout=timeout)
        header: messages.HeartbeatResponse = response.header
        return header
