"""Serving SBP: the opcode dispatcher and the TCP accept loop.

The bad-frame table of SPEC §1 is decided by the connection engine
(``sbp.connection``) and carried out by ``Connection``; the ``Dispatcher``
adds the two rules that depend on the role:
an opcode this role does not serve is ``UNSUPPORTED_OPERATION``, and a header
that does not decode as the opcode's table is ``INVALID_REQUEST`` (both raised
as ``ProtocolError`` and answered with a SYSTEM_ERROR by the connection).
"""

from __future__ import annotations

import errno
import logging
import os
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
from sbp.observer import ConnectionObserver

from .address import format_address, peer_name
from .authz import principal_of
from .budget import ServerBudgets
from .connection import Connection
from .limits import SERVER_LIMITS, ConnectionLimits
from .ratelog import RateLimitedLog
from .request import Request, RequestHandler, Responder
from .service import ServiceError
from .tls import describe_link_error

__all__ = ["Dispatcher", "Request", "RequestHandler", "Responder", "Server"]

logger = logging.getLogger(__name__)

#: how long a connection refused at the limit gets to receive its GOAWAY
REFUSE_SEND_TIMEOUT = 1.0
#: how long a TLS client gets to finish its handshake
TLS_HANDSHAKE_TIMEOUT = 10.0
#: accept() errors that mean "no descriptor or buffer for another connection"
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: how long to wait before accepting again when even the reserve did not help
_ACCEPT_RETRY_S = 0.1
_capacity = RateLimitedLog(logger)
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
        budgets: ServerBudgets | None = None,
    ) -> None:
        #: the byte budgets every connection shares (net.budget)
        self.budgets = budgets if budgets is not None else ServerBudgets()
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
        ``(host, port)`` and serve until cancelled or drained. An address
        that cannot be listened on (taken, say) is a ``ServiceError`` that
        names it."""
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as error:
            raise ServiceError(
                f"cannot listen on {format_address(host, port)}: {error.strerror or error}"
            ) from None
        bound_host, bound_port = listeners[0].socket.getsockname()[:2]
        reserve = _Reserve()
        try:
            async with trio.open_nursery() as nursery:
                with trio.CancelScope() as self._accepting:
                    task_status.started((bound_host, bound_port))
                    async with trio.open_nursery() as accepting:
                        for listener in listeners:
                            accepting.start_soon(self._accept_loop, listener, nursery, reserve)
        finally:
            reserve.close()
            for listener in listeners:
                await trio.aclose_forcefully(listener)

    async def _accept_loop(
        self, listener: trio.SocketListener, nursery: trio.Nursery, reserve: _Reserve
    ) -> None:
        """Accept and serve. Out of file descriptors, a waiting client is not
        left hanging in the backlog: the reserved descriptor is given up to
        accept it, it is told THROTTLED and closed, and the reserve is taken
        again; the condition is logged at a bounded rate, never a traceback."""
        while True:
            try:
                stream = await listener.accept()
            except OSError as error:
                if error.errno not in _OUT_OF_DESCRIPTORS:
                    raise
                _capacity.warning(
                    "descriptors",
                    "out of file descriptors (%s): refusing new connections",
                    error.strerror,
                )
                await self._refuse_one(listener, reserve)
                continue
            nursery.start_soon(self._serve_stream, stream)

    async def _refuse_one(self, listener: trio.SocketListener, reserve: _Reserve) -> None:
        reserve.close()
        try:
            with trio.move_on_after(REFUSE_SEND_TIMEOUT):
                stream = await listener.accept()
                await self._refuse(stream, "out of file descriptors")
        except OSError:
            await trio.sleep(_ACCEPT_RETRY_S)  # still none free: wait, do not spin
        finally:
            reserve.take()

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
                why = describe_link_error(error)
                logger.info("TLS handshake with %s failed: %s", peer_name(tcp), why)
                await trio.aclose_forcefully(tcp)
                return
        if self._draining or len(self._connections) >= self.max_connections:
            await self._refuse(stream)
            return
        connection = Connection(
            stream,
            peer=peer_name(tcp),
            principal=principal_of(stream),
            side=Side.SERVER,
            handler=self.dispatcher,
            limits=self.limits,
            observer=self.observer,
            budgets=self.budgets,
        )
        self._connections.add(connection)
        try:
            await connection.run()
        except Exception:
            # One broken connection must never take the accept loop down.
            logger.exception("connection from %s failed", connection.peer)
        finally:
            self._connections.discard(connection)

    async def _refuse(self, stream: trio.abc.Stream, why: str = "") -> None:
        self.refused += 1
        if self._draining:
            code, text = ErrorCode.SHUTTING_DOWN, "the server is shutting down"
        else:
            code, text = ErrorCode.THROTTLED, why or f"over {self.max_connections} connections"
        header = messages.GoAway(error_code=code, error_message=text).encode()
        with trio.move_on_after(REFUSE_SEND_TIMEOUT):
            with suppress(trio.BrokenResourceError):
                await stream.send_all(
                    encode_frame(Opcode.GOAWAY, Flags.NONE, SERVER_STREAM_ID_BIT, header)
                )
        await trio.aclose_forcefully(stream)


class _Reserve:
    """One file descriptor held back, given up for a moment when the process
    has no other, so that a waiting client can be told no."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self.take()

    def take(self) -> None:
        if self._fd is None:
            try:
                self._fd = os.open(os.devnull, os.O_RDONLY)
            except OSError:
                self._fd = None  # none to spare now; taken again after the next refusal

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
