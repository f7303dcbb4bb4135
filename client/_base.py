"""What the PM client and the data node client share: reaching the server
(through a pool by address, or over a connection given), request deadlines,
and turning per-item error codes into exceptions for one-item calls."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Self, TypeVar

import trio

from net.calls import Response
from net.connection import Connection
from net.pool import ConnectionPool
from sbp import messages
from sbp.enums import ClientRole, Opcode
from sbp.errors import (
    ConnectionClosed,
    InvalidRequestError,
    NotLeaderError,
    ShuttingDownError,
)

#: default deadline of one call, seconds
DEFAULT_TIMEOUT = 30.0
#: the client waits this much longer than the deadline it sends (timeout_ms),
#: so that the server's own TIMEOUT answer arrives before the client gives up
DEADLINE_GRACE = 1.0
#: between two rounds of PM addresses that found no leader (an election is on)
LEADERLESS_PAUSE_S = 0.25

M = TypeVar("M", bound=messages.Message)
R = TypeVar("R", bound=messages.Message)


def single(results: tuple[M, ...], what: str) -> M:
    """The one result of a one-item request."""
    if len(results) != 1:
        raise InvalidRequestError(f"{what}: expected 1 result, the server sent {len(results)}")
    return results[0]


class SBPClient:
    """Base of the protocol clients, and the one way every caller of the
    project (users, the PM, the data nodes) sends a request.

    Give it an address ("host:port"), or several ("a:1,b:2" or a list), to
    go through a ``ConnectionPool`` (its own, opened by ``async with``, unless
    one is passed), or a running ``Connection`` to use as it is. With
    several addresses (PMs on etcd, SPEC §8) a call follows ``NOT_LEADER``
    to the leader it names and tries the next address when one cannot be
    reached; with one it behaves as a plain client.

    Deadlines: a call's ``timeout`` (the client's ``timeout`` by default) is
    sent as the request's ``timeout_ms``; the client waits ``DEADLINE_GRACE``
    longer, so that the server's own TIMEOUT answer arrives first. Retrying
    is the caller's (``client.retry``).
    """

    def __init__(
        self,
        target: str | Sequence[str] | Connection,
        *,
        pool: ConnectionPool | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.timeout = timeout
        self._fixed: Connection | None = None
        self._own_pool = False
        if isinstance(target, Connection):
            self._fixed = target
            self.addresses = [target.peer]
            self._pool = pool
        else:
            listed = target.split(",") if isinstance(target, str) else list(target)
            self.addresses = [address.strip() for address in listed if address.strip()]
            if not self.addresses:
                raise ValueError("no address given")
            self._own_pool = pool is None
            # A pool given brings its own TLS settings; ``tls`` is for the client's own.
            self._pool = pool if pool is not None else ConnectionPool(tls=tls)
        self.address = self.addresses[0]

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
        # With several addresses (PMs on etcd) a dead one is left at once for the next.
        return await self._pool.get(self.address, one_attempt=len(self.addresses) > 1)

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
        """One unary request, at the leader (see the class). A connection
        that received GOAWAY refuses it before it is sent, and a draining
        server refuses it unapplied, so it is tried again on a fresh one.

        While no PM leads (one died and its lease has not run out yet, SPEC
        §8), a whole round of the addresses finds none: the call pauses and
        goes round again, until its timeout."""
        give_up = trio.current_time() + (self.timeout if timeout is None else timeout)
        hops = 0
        while True:
            try:
                return await self._call_once(opcode, header, payload, self._deadline(timeout))
            except NotLeaderError as error:
                if self._fixed is not None:
                    raise
                hops += 1
                self._follow(error.leader_addr)
                failure: Exception = error
            except (ConnectionClosed, OSError) as error:
                if self._fixed is not None or len(self.addresses) == 1:
                    raise
                hops += 1
                self._follow("")
                failure = error
            if hops > len(self.addresses):
                if trio.current_time() + LEADERLESS_PAUSE_S >= give_up:
                    raise failure
                await trio.sleep(LEADERLESS_PAUSE_S)
                hops = 0

    async def call_for(
        self,
        expected: type[R],
        opcode: Opcode,
        header: messages.Message,
        payload: bytes | memoryview = b"",
        *,
        timeout: float | None = None,
    ) -> R:
        """``call`` whose answer header must be ``expected``: typed for the caller."""
        answer = (await self.call(opcode, header, payload, timeout=timeout)).header
        return _expected(expected, opcode, answer)

    async def call_for_frames(
        self,
        expected: type[R],
        opcode: Opcode,
        header: messages.Message,
        *,
        timeout: float | None = None,
    ) -> list[R]:
        """``call_for`` of an answer that may come in several frames: each
        frame's header, in order."""
        response = await self.call(opcode, header, timeout=timeout)
        return [_expected(expected, opcode, part.header) for part in response.parts or (response,)]

    def _follow(self, leader: str) -> None:
        """Point later calls at the leader named, or at the next address."""
        if leader:
            if leader not in self.addresses:
                self.addresses.append(leader)
            self.address = leader
        else:
            index = self.addresses.index(self.address)
            self.address = self.addresses[(index + 1) % len(self.addresses)]

    async def _call_once(
        self,
        opcode: Opcode,
        header: messages.Message | None,
        payload: bytes | memoryview,
        seconds: float,
    ) -> Response[Any]:
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
        header = await self.call_for(
            messages.HeartbeatResponse, Opcode.HEARTBEAT, request, timeout=timeout
        )
        return header


def _expected(expected: type[R], opcode: Opcode, answer: object) -> R:
    """``answer``, if it is the header ``expected``: a server that answers
    something else is refused."""
    if not isinstance(answer, expected):
        raise InvalidRequestError(
            f"{opcode.name}: the server answered {type(answer).__name__}, not {expected.__name__}"
        )
    return answer
