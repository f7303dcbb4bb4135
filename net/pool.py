"""A small pool of client connections, one per address, shared by callers.

A connection that closed or received GOAWAY is replaced on the next ``get``.
Connecting retries with exponential backoff and full jitter, and an address
that keeps failing is backed off across calls too, so that a crowd of callers
does not hammer a node that is down.
"""

from __future__ import annotations

import random
import ssl
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import trio

from sbp.connection import Side
from sbp.errors import ConnectionClosed
from sbp.observer import ConnectionObserver

from .address import parse_address
from .connection import Connection
from .limits import CLIENT_LIMITS, ConnectionLimits
from .tls import describe_link_error

#: first retry delay; doubles per consecutive failure up to BACKOFF_MAX
BACKOFF_INITIAL = 0.05
BACKOFF_MAX = 5.0


def backoff_delay(
    failures: int, *, initial: float = BACKOFF_INITIAL, cap: float = BACKOFF_MAX
) -> float:
    """Delay before the next attempt after ``failures`` consecutive ones
    ("full jitter": uniform in [0, min(cap, initial * 2**(failures-1))])."""
    if failures <= 0:
        return 0.0
    return random.uniform(0.0, min(cap, initial * 2 ** (failures - 1)))


class _Endpoint:
    __slots__ = ("connection", "failures", "lock")

    def __init__(self) -> None:
        self.lock = trio.Lock()  # one connect at a time per address
        self.connection: Connection | None = None
        self.failures = 0


class ConnectionPool:
    """Live connections by address; an async context manager whose nursery
    runs them. ``get`` returns the shared connection, connecting when needed."""

    def __init__(
        self,
        *,
        limits: ConnectionLimits = CLIENT_LIMITS,
        connect_timeout: float = 5.0,
        connect_attempts: int = 3,
        observer: ConnectionObserver | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        #: dial with TLS (``net.tls.TLSSettings.client_context``) when set
        self.tls = tls
        self.limits = limits
        self.connect_timeout = connect_timeout
        self.connect_attempts = connect_attempts
        self.observer = observer
        self._endpoints: dict[str, _Endpoint] = {}
        self._nursery: trio.Nursery | None = None
        self._nursery_manager: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._closed = False

    async def __aenter__(self) -> ConnectionPool:
        manager = trio.open_nursery()
        self._nursery = await manager.__aenter__()
        self._nursery_manager = manager
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        manager = self._nursery_manager
        assert manager is not None
        try:
            await self.aclose()
        except BaseException as error:
            # Closing can be cancelled (a server stopping); the nursery must
            # be exited all the same, or trio's nursery stack is corrupted.
            if not await manager.__aexit__(type(error), error, error.__traceback__):
                raise
            return True
        # The body's own exception (a ConnectionClosed …) propagates as it is,
        # not wrapped in an ExceptionGroup of the pool's nursery: its
        # connections are closed, so the nursery has nothing left to wait for.
        await manager.__aexit__(None, None, None)
        return None

    async def get(self, address: str, *, one_attempt: bool = False) -> Connection:
        """The live connection to ``address`` ("host:port"). ``one_attempt``:
        connect once, at once, without the backoff of earlier failures (a
        caller with other addresses to try, such as a client of several PMs,
        goes on to the next one rather than wait for this one)."""
        if self._nursery is None or self._closed:
            raise RuntimeError("the pool is not open; use `async with ConnectionPool()`")
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            endpoint = self._endpoints[address] = _Endpoint()
        connection = endpoint.connection
        if connection is not None and _usable(connection):
            return connection
        async with endpoint.lock:
            connection = endpoint.connection
            if connection is not None and _usable(connection):
                return connection
            endpoint.connection = connection = await self._connect(address, endpoint, one_attempt)
            return connection

    async def _connect(self, address: str, endpoint: _Endpoint, one_attempt: bool) -> Connection:
        host, port = parse_address(address)
        last_error: BaseException | None = None
        attempts = 1 if one_attempt else self.connect_attempts
        for _ in range(attempts):
            if not one_attempt:
                await trio.sleep(backoff_delay(endpoint.failures))
            try:
                with trio.fail_after(self.connect_timeout):
                    stream = await self._open_stream(host, port)
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                endpoint.failures += 1
                last_error = exc
                continue
            endpoint.failures = 0
            connection = Connection(
                stream, side=Side.CLIENT, limits=self.limits, observer=self.observer, peer=address
            )
            assert self._nursery is not None
            await self._nursery.start(connection.run)
            return connection
        if isinstance(last_error, trio.TooSlowError):
            reason = "timed out"
        else:
            reason = describe_link_error(last_error) if last_error else "no attempt"
        raise ConnectionClosed(
            f"cannot connect to {address} after {attempts} attempts: {reason}"
        ) from last_error

    async def _open_stream(self, host: str, port: int) -> trio.abc.Stream:
        tcp = await trio.open_tcp_stream(host, port)
        if self.tls is None:
            return tcp
        secure = trio.SSLStream(tcp, self.tls, server_hostname=host)
        try:
            await secure.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return secure

    def connection(self, address: str) -> Connection | None:
        """The current connection to ``address``, if any (without connecting)."""
        endpoint = self._endpoints.get(address)
        return endpoint.connection if endpoint is not None else None

    async def aclose(self) -> None:
        """Close every connection; ``get`` fails afterwards."""
        self._closed = True
        async with trio.open_nursery() as nursery:
            for endpoint in self._endpoints.values():
                if endpoint.connection is not None:
                    nursery.start_soon(endpoint.connection.aclose)


def _usable(connection: Connection) -> bool:
    return not connection.closed and not connection.goaway_received
