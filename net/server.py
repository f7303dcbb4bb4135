"""Serving SBP: the opcode dispatcher and the TCP accept loop.

The bad-frame table of SPEC §1 is applied by the serving side of
``Connection``; the ``Dispatcher`` adds the two rules that depend on the role:
an opcode this role does not serve is ``UNSUPPORTED_OPERATION``, and a header
that does not decode as the opcode's table is ``INVALID_REQUEST`` (both raised
as ``ProtocolError`` and answered with a SYSTEM_ERROR by the connection).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from contextlib import suppress

import trio

from sbp import messages
from sbp.connection import Side
from sbp.constants import SERVER_STREAM_ID_BIT
from sbp.enums import ErrorCode, Flags, Opcode
from sbp.errors import UnsupportedOperationError
from sbp.frames import encode_frame

from .address import peer_name
from .connection import Connection
from .limits import SERVER_LIMITS, ConnectionLimits
from .observer import ConnectionObserver
from .request import Request, RequestHandler, Responder

__all__ = ["Dispatcher", "Request", "RequestHandler", "Responder", "Server"]

logger = logging.getLogger(__name__)

#: how long a connection refused at the limit gets to receive its GOAWAY
REFUSE_SEND_TIMEOUT = 1.0
#: how long a TLS client gets to finish its handshake
TLS_HANDSHAKE_TIMEOUT = 10.0
#: opcodes the connection itself answers; no handler may take them
_BUILT_IN = frozenset({Opcode.PING, Opcode.GOAWAY})


class Dispatcher:
    """Routes each request to the handler registered for its opcode; it is
    itself the ``RequestHandler`` a serving ``Connection`` calls."""

    def __init__(self, role_name: str) -> None:
        self.role_name = role_name
        self._handlers: dict[int, RequestHandler] = {}

    def register(
        self, opcode: Opcode, serve: Callable[[Request, Responder], Awaitable[None]]
    ) -> None:
        """Serve ``opcode`` with an async function, a task per request."""
        self.register_handler(opcode, _InTask(serve))

    def register_handler(self, opcode: Opcode, handler: RequestHandler) -> None:
        """Serve ``opcode`` with a ``RequestHandler``, which may take requests
        without a task (``start`` returning None)."""
        if opcode in _BUILT_IN:
            raise ValueError(f"{opcode.name} is answered by the connection itself")
        if opcode in self._handlers:
            raise ValueError(f"{opcode.name} already has a handler")
        self._handlers[opcode] = handler

    @property
    def opcodes(self) -> frozenset[int]:
        return frozenset(self._handlers)

    def start(self, request: Request, responder: Responder) -> Awaitable[None] | None:
        handler = self._handlers.get(request.opcode)
        if handler is None:
            raise UnsupportedOperationError(
                f"the {self.role_name} does not serve {request.opcode.name}"
            )
        # Decoded before the handler sees it: a bad header is answered
        # INVALID_REQUEST (HeaderDecodeError) and never reaches a handler.
        _ = request.header
        return handler.start(request, responder)


class _InTask:
    """An async handler function as a ``RequestHandler``: always a task."""

    __slots__ = ("_serve",)

    def __init__(self, serve: Callable[[Request, Responder], Awaitable[None]]) -> None:
        self._serve = serve

    def start(self, request: Request, responder: Responder) -> Awaitable[None]:
        return self._run(request, responder)

    async def _run(self, request: Request, responder: Responder) -> None:
        await self._serve(request, responder)
        if not responder.done:
            logger.error("%s handler returned without ending its response", request.opcode.name)
            responder.send_error_nowait(ErrorCode.UNKNOWN, "the server sent no complete response")


class Server:
    """Accepts TCP connections and serves each with a ``Connection``."""

    def __init__(
        self,
        dispatcher: RequestHandler,
        *,
        limits: ConnectionLimits = SERVER_LIMITS,
        observer: ConnectionObserver | None = None,
        max_connections: int = 1024,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        #: accept TLS only (``net.tls.TLSSettings.server_context``) when set
        self.tls = tls
        self.dispatcher = dispatcher
        self.limits = limits
        self.observer = observer
        self.max_connections = max_connections
        self._connections: set[Connection] = set()
        self._draining = False
        self._accepting: trio.CancelScope | None = None
        #: connections refused because the server was full or draining
        self.refused = 0

    @property
    def connections(self) -> frozenset[Connection]:
        return frozenset(self._connections)

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (port 0: any free port), report the bound
        ``(host, port)`` and serve until cancelled or drained."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound_host, bound_port = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as self._accepting:
                task_status.started((bound_host, bound_port))
                await trio.serve_listeners(self._serve_stream, listeners, handler_nursery=nursery)

    async def drain(self, timeout: float) -> None:
        """GOAWAY on every connection, wait up to ``timeout`` for the requests
        in flight, close them all and stop accepting."""
        self._draining = True
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for connection in list(self._connections):
                    nursery.start_soon(connection.drain, timeout)
        async with trio.open_nursery() as nursery:
            for connection in list(self._connections):
                nursery.start_soon(connection.aclose)
        if self._accepting is not None:
            self._accepting.cancel()

    async def _serve_stream(self, tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp
        if self.tls is not None:
            stream = trio.SSLStream(tcp, self.tls, server_side=True)
            try:
                with trio.fail_after(TLS_HANDSHAKE_TIMEOUT):
                    await stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError, OSError) as error:
                # Plain text on a TLS port, or no acceptable certificate.
                logger.info("TLS handshake with %s failed: %s", peer_name(tcp), error)
                await trio.aclose_forcefully(tcp)
                return
        if self._draining or len(self._connections) >= self.max_connections:
            await self._refuse(stream)
            return
        connection = Connection(
            stream,
            peer=peer_name(tcp),
            side=Side.SERVER,
            handler=self.dispatcher,
            limits=self.limits,
            observer=self.observer,
        )
        self._connections.add(connection)
        try:
            await connection.run()
        except Exception:
            # One broken connection must never take the accept loop down.
            logger.exception("connection from %s failed", connection.peer)
        finally:
            self._connections.discard(connection)

    async def _refuse(self, stream: trio.abc.Stream) -> None:
        self.refused += 1
        if self._draining:
            code, text = ErrorCode.SHUTTING_DOWN, "the server is shutting down"
        else:
            code, text = ErrorCode.THROTTLED, f"over {self.max_connections} connections"
        header = messages.GoAway(error_code=code, error_message=text).encode()
        with trio.move_on_after(REFUSE_SEND_TIMEOUT):
            with suppress(trio.BrokenResourceError):
                await stream.send_all(
                    encode_frame(Opcode.GOAWAY, Flags.NONE, SERVER_STREAM_ID_BIT, header)
                )
        await trio.aclose_forcefully(stream)
