"""What a request handler sees: the ``Request`` it serves and the ``Responder``
it answers through, and the ``RequestHandler`` protocol a connection calls.

A handler answers through one ``Responder`` whether or not it runs in a task
of its own: ``send_nowait`` queues a frame and returns, ``send`` first waits
while the connection holds more than its high-water mark of unsent bytes (a
handler streaming many frames to a peer that does not read stops there,
holding its request slot). Both end the request with the frame that has
``end=True``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol, TypeVar

import trio

from sbp import messages
from sbp.connection import RequestReceived, system_error_header
from sbp.enums import ErrorCode, Opcode
from sbp.errors import ConnectionClosed, FrameTooLargeError, ProtocolError, wire_code
from sbp.frames import Buffer

from .budget import ConnectionBudget

M = TypeVar("M", bound=messages.Message)

logger = logging.getLogger(__name__)

_UNDECODED: Any = object()

#: what a request's ``timeout_ms`` means on every server (docs/protocol.md):
#: its deadline, counted from when it was read; 0 or less means this default;
#: and no request may ask for longer than the cap (a deadline of days would
#: hold a server's shutdown and memory as long)
DEFAULT_REQUEST_TIMEOUT_S: Final = 30.0
MAX_REQUEST_TIMEOUT_S: Final = 300.0


def request_timeout(timeout_ms: int) -> float:
    """Seconds a request carrying ``timeout_ms`` may take (see above)."""
    if timeout_ms <= 0:
        return DEFAULT_REQUEST_TIMEOUT_S
    return min(timeout_ms / 1000, MAX_REQUEST_TIMEOUT_S)


class Answering(Protocol):
    """What requests and responders need of their connection
    (``net.connection.Connection`` is it)."""

    @property
    def peer(self) -> str: ...

    @property
    def principal(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def queue_response(
        self,
        responder: Responder,
        header: bytes,
        payload: Buffer,
        *,
        end: bool,
        system_error: bool = False,
    ) -> bool: ...

    def queue_borrowed_response(
        self, responder: Responder, header: bytes, payload: Sequence[Buffer], *, end: bool
    ) -> bool: ...

    def hold_reads(self, seconds: float) -> None: ...

    async def wait_room(self) -> None: ...

    @property
    def budget(self) -> ConnectionBudget | None: ...


class Request:
    """One request received on a connection.

    ``header`` is the decoded request message (``sbp.messages.request_type``),
    decoded on first access, so a handler that never reads it pays nothing; a
    header that does not decode raises ``HeaderDecodeError`` (answered as
    ``INVALID_REQUEST``).
    """

    __slots__ = (
        "_header",
        "arrival",
        "connection",
        "opcode",
        "payload",
        "raw_header",
        "received_at",
        "stream_id",
    )

    def __init__(self, connection: Answering, event: RequestReceived, received_at: float) -> None:
        self.connection = connection
        self.opcode: Opcode = event.opcode
        self.stream_id = event.stream_id
        self.raw_header = event.header
        self.payload = event.payload
        #: trio time at which the chunk holding the request was read
        self.received_at = received_at
        #: the request's place among those received on its connection (0, 1, …)
        self.arrival = event.arrival
        self._header: Any = _UNDECODED

    @property
    def header(self) -> messages.Message:
        """The decoded request message."""
        if self._header is _UNDECODED:
            message_type = messages.request_type(self.opcode)
            if message_type is None:
                raise TypeError(f"{self.opcode.name} has no request table")
            self._header = message_type.decode(self.raw_header)
        header: messages.Message = self._header
        return header

    @property
    def principal(self) -> str:
        """Who sent it (``net.authz``): its connection's principal."""
        return self.connection.principal

    def deadline(self, timeout_ms: int) -> float:
        """The trio time by which the request must be answered (``request_timeout``)."""
        return self.received_at + request_timeout(timeout_ms)

    def header_as(self, message_type: type[M]) -> M:
        """The decoded header, checked to be of ``message_type``."""
        header = self.header
        if not isinstance(header, message_type):
            raise TypeError(f"{self.opcode.name} header is {type(header).__name__}")
        return header


class Responder:
    """Sends the response sequence of one request: any number of frames, the
    last with ``end=True``. Anything sent after the end is a bug and raises."""

    __slots__ = ("_connection", "charge", "done", "error_code", "opcode", "started", "stream_id")

    def __init__(self, connection: Answering, opcode: Opcode, stream_id: int) -> None:
        self._connection = connection
        self.opcode = opcode
        self.stream_id = stream_id
        #: True once the frame with RESPONSE_END was handed to the connection
        self.done = False
        #: the SYSTEM_ERROR code sent, NONE for a normal response
        self.error_code = ErrorCode.NONE
        #: trio time at which serving the request began
        self.started = trio.current_time()
        #: bytes of the server's request budget this request holds
        self.charge = 0

    def send_nowait(
        self,
        header: messages.Message,
        payload: Buffer = b"",
        *,
        end: bool = True,
    ) -> bool:
        """Queue one response frame and return at once; False when the
        connection is gone (nobody is left to answer)."""
        return self._queue(header.encode(), payload, end=end)

    def send_borrowed_nowait(
        self, header: messages.Message, payload: Sequence[Buffer], *, end: bool = True
    ) -> bool:
        """``send_nowait`` for a payload in buffers valid only until this
        returns (record batches in a read transaction): they are written or
        copied before it does."""
        self._check_open(end)
        try:
            return self._connection.queue_borrowed_response(self, header.encode(), payload, end=end)
        except FrameTooLargeError:
            self.done = False  # nothing was queued: the request is still to answer
            raise

    async def send(
        self,
        header: messages.Message,
        payload: Buffer = b"",
        *,
        end: bool = True,
    ) -> None:
        """Wait while the connection has more than its high-water mark of
        bytes unsent (the request keeps its slot meanwhile, so a peer that
        does not read stops being read from), then queue one response frame.
        Raises ``ConnectionClosed`` when the connection is gone."""
        await self._connection.wait_room()
        if not self._queue(header.encode(), payload, end=end):
            raise ConnectionClosed(f"connection to {self._connection.peer} closed")

    async def send_sequence(self, headers: Sequence[messages.Message]) -> None:
        """``send`` each of ``headers`` as a frame of one response sequence,
        RESPONSE_END on the last."""
        for i, header in enumerate(headers, 1):
            await self.send(header, end=i == len(headers))

    @asynccontextmanager
    async def answer_room(self, nbytes: int) -> AsyncIterator[None]:
        """Room to read an answer of up to ``nbytes`` and queue it: once the
        connection is below its high-water mark, hold ``nbytes`` of its own
        share and of the server's answer budget until the answer is queued
        (from then on the queued bytes count, until written). A handler
        reading large answers (FETCH) reads inside this."""
        connection = self._connection
        await connection.wait_room()
        budget = connection.budget
        if budget is None:
            yield
            return
        async with budget.answer_room(nbytes):
            yield

    def send_error_nowait(
        self, code: ErrorCode, message: str = "", *, leader_addr: str = ""
    ) -> bool:
        """End the sequence with a SYSTEM_ERROR answer carrying ``code`` (and,
        with NOT_LEADER, the leader's address)."""
        self.error_code = code
        header = system_error_header(code, message, leader_addr)
        return self._queue(header, b"", end=True, system_error=True)

    async def send_error(
        self, code: ErrorCode, message: str = "", *, leader_addr: str = ""
    ) -> None:
        self.send_error_nowait(code, message, leader_addr=leader_addr)

    def _queue(
        self,
        header: bytes,
        payload: Buffer,
        *,
        end: bool,
        system_error: bool = False,
    ) -> bool:
        self._check_open(end)
        try:
            return self._connection.queue_response(
                self, header, payload, end=end, system_error=system_error
            )
        except FrameTooLargeError:
            # raised before anything was queued: the request is still to
            # answer, with this error
            self.done = False
            raise

    def _check_open(self, end: bool) -> None:
        """Refuse a frame after the last one; note whether this one is it."""
        if self.done:
            raise RuntimeError(f"response to stream {self.stream_id} already ended")
        self.done = end


class RequestHandler(Protocol):
    """What a serving connection calls for each request of the peer."""

    def start(self, request: Request, responder: Responder) -> Awaitable[None] | None:
        """Begin serving the request. Return None when it was taken without a
        task (it is answered through ``responder`` later, from trio's thread),
        or an awaitable the connection runs in a task of its own. A
        ``ProtocolError`` raised here is the request's answer."""
        ...


async def serve_in_task(work: Awaitable[None], request: Request, responder: Responder) -> None:
    """Run a handler's task: a ``ProtocolError`` it raises before answering
    becomes the SYSTEM_ERROR answer, a crash ``UNKNOWN``. (A task may end
    before its request is answered when it arranged for a later answer.)"""
    name = request.opcode.name
    try:
        await work
    except ConnectionClosed:
        return  # nobody left to answer
    except ProtocolError as exc:
        if responder.done:
            logger.warning("%s handler raised after responding: %s", name, exc)
        else:
            responder.send_error_nowait(
                wire_code(exc.code), exc.message, leader_addr=getattr(exc, "leader_addr", "")
            )
        return
    except Exception:
        if request.connection.closed:
            # The peer went away mid-response: there is no one left to answer.
            logger.debug("%s: %s left before the response", name, request.connection.peer)
        else:
            logger.exception("%s handler failed (peer %s)", name, request.connection.peer)
        if not responder.done:
            responder.send_error_nowait(ErrorCode.UNKNOWN, "internal server error")
