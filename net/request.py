"""What a request handler sees: the ``Request`` it serves and the ``Responder``
it answers through, one response sequence per request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from sbp import messages
from sbp.enums import ErrorCode, Flags, Opcode

if TYPE_CHECKING:
    from .connection import Connection

M = TypeVar("M", bound=messages.Message)

_UNDECODED: Any = object()


class Request:
    """One request received on a connection.

    ``header`` is the decoded request message (``sbp.messages.request_type``),
    or the raw header bytes for PING. It is decoded on first access, so a
    handler that never reads it pays nothing; a header that does not decode
    raises ``HeaderDecodeError`` (answered as ``INVALID_REQUEST``).
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

    def __init__(
        self,
        connection: Connection,
        opcode: Opcode,
        stream_id: int,
        raw_header: bytes,
        payload: memoryview,
        received_at: float,
        arrival: int,
    ) -> None:
        self.connection = connection
        self.opcode = opcode
        self.stream_id = stream_id
        self.raw_header = raw_header
        self.payload = payload
        #: trio time at which the chunk holding the request was read
        self.received_at = received_at
        #: the request's place among those received on its connection (0, 1, …):
        #: handlers run as concurrent tasks, which trio starts in no set order
        self.arrival = arrival
        self._header: Any = _UNDECODED

    @property
    def header(self) -> Any:
        """The decoded request message (raw bytes for PING)."""
        if self._header is _UNDECODED:
            message_type = messages.request_type(self.opcode)
            if message_type is None:  # PING: opaque bytes, echoed
                self._header = self.raw_header
            else:
                self._header = message_type.decode(self.raw_header)
        return self._header

    def header_as(self, message_type: type[M]) -> M:
        """The decoded header, checked to be of ``message_type`` (for typed handlers)."""
        header = self.header
        if not isinstance(header, message_type):
            raise TypeError(f"{self.opcode.name} header is {type(header).__name__}")
        return header


class Responder:
    """Sends the response sequence of one request: any number of frames, the
    last with RESPONSE_END. Anything sent after the end is a bug and raises."""

    __slots__ = ("_connection", "_done", "_tracked", "error_code", "opcode", "started", "stream_id")

    def __init__(
        self, connection: Connection, opcode: int, stream_id: int, *, tracked: bool = True
    ) -> None:
        self._connection = connection
        self.opcode = opcode
        self.stream_id = stream_id
        # Untracked responders answer frames the connection state never
        # registered (rejected frames, a duplicate stream id): ending them must
        # not end the sequence of the request that owns that id.
        self._tracked = tracked
        self._done = False
        #: the SYSTEM_ERROR code sent, NONE for a normal response
        self.error_code = ErrorCode.NONE
        #: trio time at which serving the request began
        self.started = trio.current_time()

    @property
    def done(self) -> bool:
        """True once the frame with RESPONSE_END was handed to the connection."""
        return self._done

    async def send(
        self, header: messages.Message, payload: bytes | memoryview = b"", *, end: bool = True
    ) -> None:
        """Send one response frame; ``end=True`` on the last one."""
        await self.send_raw(header.encode(), payload, end=end)

    async def send_error(self, code: ErrorCode, message: str = "") -> None:
        """End the sequence with a SYSTEM_ERROR response carrying ``code``."""
        self.error_code = code
        header = messages.SystemError(error_code=code, error_message=message).encode()
        await self.send_raw(header, flags=Flags.SYSTEM_ERROR, end=True)

    async def send_raw(
        self,
        header: bytes,
        payload: bytes | memoryview = b"",
        *,
        flags: Flags = Flags.NONE,
        end: bool = True,
    ) -> None:
        """Send one response frame whose header is already encoded."""
        if self._done:
            raise RuntimeError(f"response to stream {self.stream_id} already ended")
        flags |= Flags.RESPONSE
        if end:
            flags |= Flags.RESPONSE_END
        await self._connection._send_response(
            self.opcode, flags, self.stream_id, header, payload, tracked=self._tracked
        )
        self._done = end

    def end_nowait(self, header: messages.Message) -> None:
        """Send the one and last response frame without waiting, from a
        request an immediate handler took (``start_nowait``). Only for those:
        the request ends here, when its frame is queued."""
        if self._done:
            raise RuntimeError(f"response to stream {self.stream_id} already ended")
        self._done = True
        self._connection._end_nowait(self, header.encode())


#: ``async def handler(request, responder) -> None``
RequestHandler = Callable[[Request, Responder], Awaitable[None]]

#: ``handler.start_nowait(request, responder) -> bool``, a handler's optional
#: synchronous path, tried first for every request it would serve. True: it
#: took the request and will end the response with ``Responder.end_nowait``
#: (from trio's thread, no task per request). False: the request is served as
#: usual, by a task calling the handler. A ``ProtocolError`` it raises (before
#: doing anything) is the request's answer.
ImmediateStart = Callable[[Request, Responder], bool]
