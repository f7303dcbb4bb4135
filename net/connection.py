"""One SBP connection over any trio stream, usable by either end.

A ``Connection`` drives the sans-IO codec (``sbp.frames.FrameDecoder``) and
state (``sbp.connection.ConnectionState``) over a ``trio.abc.Stream``:

- one reader task turns bytes into frames: responses go to the request
  waiting for them, requests are served each in its own task, or with no
  task by the handler's synchronous path (``start_nowait``) when it has one;
- one writer task owns the stream's send side, so frames never interleave;
  frames queued while it writes go out together in one ``send_all``, which
  saves a system call per frame when many requests are in flight;
- the bad-frame table of SPEC §1 is applied here, in ``_on_event``, and
  nowhere else.

Backpressure: a serving connection holds at most
``limits.max_concurrent_requests`` requests; while all slots are taken the
reader stops reading, so a flood of requests waits in the peer's socket buffer,
not in our memory. The outgoing queue is bounded too, so a peer that does not
read stalls the tasks that answer it rather than growing a buffer (an
answer from a synchronous path waits for room in a task too, and keeps its
request's slot until then).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import trio

from sbp import messages
from sbp.connection import (
    ConnectionState,
    DuplicateRequest,
    GoAwayReceived,
    LateResponse,
    RequestReceived,
    ResponseReceived,
    Side,
    UnexpectedResponse,
)
from sbp.constants import DEFAULT_MAX_FRAME_LENGTH, FRAME_OVERHEAD
from sbp.enums import ErrorCode, Flags, Opcode
from sbp.errors import (
    ConnectionClosed,
    HeaderDecodeError,
    ProtocolError,
    RequestTimeoutError,
    ShuttingDownError,
    error_for,
)
from sbp.frames import (
    READ_SIZE,
    DiscardedFrame,
    FatalFrameError,
    Frame,
    FrameDecoder,
    FrameEvent,
    RejectedFrame,
    encode_frame,
)

from .observer import NULL_OBSERVER, ConnectionObserver
from .ratelog import RateLimitedLog
from .request import ImmediateStart, Request, RequestHandler, Responder

logger = logging.getLogger(__name__)
#: frames that end a connection (FRAME_TOO_LARGE …): logged, but not a flood
_bad_frames = RateLimitedLog(logger)

#: bytes asked of a non-socket stream per read: the decoder's own read size,
#: which with its one partial frame bounds what a connection holds unread
RECEIVE_CHUNK = READ_SIZE
#: frames waiting for the writer; senders wait when it is full
OUTGOING_QUEUE_FRAMES = 64
#: queued frames are joined into one write up to this many bytes; larger
#: frames are written alone rather than copied again
COALESCE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Per-connection limits and timers (seconds)."""

    #: largest frame_length accepted; a larger one ends the connection
    max_frame_length: int = DEFAULT_MAX_FRAME_LENGTH
    #: requests served at once; at the limit the reader stops reading
    max_concurrent_requests: int = 256
    #: close after this long with no traffic and nothing in flight (None: never)
    idle_timeout: float | None = None
    #: PING the peer after this long without receiving anything (None: never)
    keepalive_interval: float | None = None
    #: how long a keepalive PING may go unanswered before the peer is dead
    keepalive_timeout: float = 10.0
    #: how long a graceful close waits for requests in flight
    drain_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")


#: clients send no keepalive: their calls find a dead connection soon enough
CLIENT_LIMITS = ConnectionLimits()
#: servers ping idle peers so that a dead one does not hold its slot forever
SERVER_LIMITS = ConnectionLimits(keepalive_interval=30.0)


@dataclass(frozen=True, slots=True)
class Response:
    """A response received for a request of ours.

    ``header`` is the decoded response message (``sbp.messages.response_type``),
    raw bytes for PING. When ``request()`` collected several frames,
    ``header`` is the last frame's, ``payload`` all payloads joined, and
    ``parts`` holds each frame's own response.
    """

    opcode: Opcode
    header: Any
    payload: bytes | memoryview
    frames: int = 1
    parts: tuple[Response, ...] = field(default=(), repr=False)


class _Call:
    """A request of ours awaiting its response frames (one consumer)."""

    __slots__ = ("_wakeup", "ended", "error", "frames", "opcode", "stream_id")

    def __init__(self, opcode: Opcode, stream_id: int) -> None:
        self.opcode = opcode
        self.stream_id = stream_id
        self.frames: deque[Frame] = deque()
        self.error: BaseException | None = None
        #: RESPONSE_END received (its frame may still wait in ``frames``)
        self.ended = False
        self._wakeup = trio.Event()

    def put(self, frame: Frame) -> None:
        self.frames.append(frame)
        self._wakeup.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wakeup.set()

    async def next_frame(self, deadline: float) -> Frame:
        """The next frame, raising the connection's error or a timeout."""
        while True:
            if self.frames:
                return self.frames.popleft()
            if self.error is not None:
                raise self.error
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
                continue
            if deadline == math.inf:
                # A cancel scope costs a few µs per request: only pay for a real deadline.
                await self._wakeup.wait()
                continue
            with trio.move_on_at(deadline):
                await self._wakeup.wait()
                continue
            raise RequestTimeoutError(f"no response to {self.opcode.name} before the deadline")


class _Responses:
    """The frames of one streamed response, up to RESPONSE_END. A plain
    iterator rather than an async generator: leaving the loop early must not
    leave a generator for the garbage collector to finalize."""

    __slots__ = ("_call", "_connection", "_deadline", "_done")

    def __init__(self, connection: Connection, call: _Call, deadline: float) -> None:
        self._connection = connection
        self._call = call
        self._deadline = deadline
        self._done = False

    def __aiter__(self) -> _Responses:
        return self

    async def __anext__(self) -> Response:
        if self._done:
            raise StopAsyncIteration
        frame = await self._call.next_frame(self._deadline)
        self._done = frame.is_end
        return self._connection._to_response(self._call.opcode, frame)


_RESPONSE_END = Flags.RESPONSE | Flags.RESPONSE_END


def _deadline(timeout: float | None) -> float:
    return math.inf if timeout is None else trio.current_time() + timeout


def _encode_header(header: messages.Message | bytes | None) -> bytes:
    if header is None:
        return b""
    if isinstance(header, bytes | bytearray | memoryview):
        return bytes(header)
    return header.encode()


class Connection:
    """One SBP connection; see the module docstring.

    ``handler`` serves the peer's requests (a ``net.server.Dispatcher``);
    without one, every request but PING is answered UNSUPPORTED_OPERATION.
    Start it with ``await nursery.start(connection.run)``.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        side: Side,
        handler: RequestHandler | None = None,
        limits: ConnectionLimits = ConnectionLimits(),
        observer: ConnectionObserver | None = None,
        peer: str = "",
    ) -> None:
        self.side = side
        self.peer = peer or _peer_name(stream)
        self.limits = limits
        self._stream = stream
        self._handler = handler
        #: the handler's synchronous path, if it has one (see ``_start_serving``)
        self._start_nowait: ImmediateStart | None = getattr(handler, "start_nowait", None)
        self._observer = observer or NULL_OBSERVER
        self._state = ConnectionState(side)
        self._decoder = FrameDecoder(limits.max_frame_length)
        self._calls: dict[int, _Call] = {}
        self._serving = 0
        self._slots = trio.Semaphore(limits.max_concurrent_requests)
        self._outgoing_send, self._outgoing_receive = trio.open_memory_channel[bytes](
            OUTGOING_QUEUE_FRAMES
        )
        self._nursery: trio.Nursery | None = None
        self._started = False
        self._closed = False
        self._close_reason = ""
        self._goaway: tuple[ErrorCode | int, str] | None = None
        self._quiet: trio.Event | None = None
        self._writer_done = trio.Event()
        self._finished = trio.Event()
        self._last_received = 0.0
        #: requests received so far: the next one's ``Request.arrival``
        self._arrivals = 0
        #: last frame other than PING in either direction (the idle timer)
        self._last_activity = 0.0
        #: PINGs in flight either way: keepalive traffic does not keep a connection busy
        self._pings = 0
        #: frames dropped by kind (bad_magic, unknown_opcode, late_response, ...)
        self.discarded: dict[str, int] = {}

    # -- public state ---------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def goaway_received(self) -> bool:
        """The peer sent GOAWAY: no new requests may go out on this connection."""
        return self._goaway is not None

    @property
    def goaway_sent(self) -> bool:
        return self._state.goaway_sent

    @property
    def in_flight(self) -> int:
        """Our requests awaiting responses plus the peer's requests being served."""
        return len(self._calls) + self._serving

    @property
    def serving(self) -> int:
        """The peer's requests being served right now."""
        return self._serving

    @property
    def buffered(self) -> int:
        """Received bytes not yet decoded into a frame."""
        return self._decoder.buffered

    @property
    def close_reason(self) -> str:
        return self._close_reason

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Connection {self.side.value} peer={self.peer} {state} in_flight={self.in_flight}>"

    # -- lifetime -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the connection until it ends; then every pending request fails
        with ``ConnectionClosed``. Network failures end it quietly."""
        if self._started:
            raise RuntimeError("a connection runs once")
        self._started = True
        self._last_received = self._last_activity = trio.current_time()
        self._observer.connection_opened()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._write_loop)
                if self.limits.keepalive_interval is not None:
                    nursery.start_soon(self._keepalive_loop, self.limits.keepalive_interval)
                if self.limits.idle_timeout is not None:
                    nursery.start_soon(self._idle_loop, self.limits.idle_timeout)
                task_status.started()
                await self._read_loop()
                # Reading is over, so no answer can arrive: fail what waits for
                # one now, then let frames already queued (a GOAWAY) go out.
                self._mark_closed(self._close_reason)
                await self._flush(self.limits.drain_timeout)
                nursery.cancel_scope.cancel()
        finally:
            self._mark_closed(self._close_reason or "connection ended")
            await trio.aclose_forcefully(self._stream)
            self._finished.set()
            self._observer.connection_closed()

    async def aclose(self) -> None:
        """Close now: queued frames get a moment to go out, requests in flight fail."""
        if not self._started:
            self._started = True
            self._mark_closed("closed before it ran")
            await trio.aclose_forcefully(self._stream)
            self._finished.set()
            return
        if not self._finished.is_set():
            self._set_reason("closed locally")
            if not self._closed:
                with trio.move_on_after(min(1.0, self.limits.drain_timeout)):
                    await self._flush(math.inf)
            self._shutdown(self._close_reason)
            await self._finished.wait()

    async def drain(self, timeout: float | None = None) -> None:
        """Graceful close: GOAWAY, wait (at most ``timeout``) for requests in
        flight in either direction, then close."""
        if self._closed:
            return
        if not self._state.goaway_sent:
            try:
                await self.send_goaway(ErrorCode.SHUTTING_DOWN, "shutting down")
            except ConnectionClosed:
                return
        with trio.move_on_after(self.limits.drain_timeout if timeout is None else timeout):
            await self.wait_quiet()
        await self.aclose()

    async def wait_quiet(self) -> None:
        """Return once nothing is in flight (or the connection is closed)."""
        while self.in_flight and not self._closed:
            if self._quiet is None or self._quiet.is_set():
                self._quiet = trio.Event()
            await self._quiet.wait()

    async def wait_closed(self) -> None:
        await self._finished.wait()

    # -- requests of ours -----------------------------------------------------

    async def request(
        self,
        opcode: Opcode,
        header: messages.Message | bytes | None = None,
        payload: bytes | memoryview = b"",
        *,
        timeout: float | None = None,
    ) -> Response:
        """Send a request and wait for its whole response sequence.

        A SYSTEM_ERROR answer raises the ``ProtocolError`` for its code; the
        deadline raises ``RequestTimeoutError``. A timed-out or cancelled
        request is abandoned: its late frames are dropped, nothing else is
        affected.
        """
        deadline = _deadline(timeout)
        call = await self._open_call(opcode, header, payload, deadline)
        try:
            frame = await call.next_frame(deadline)
            if frame.is_end:
                return self._to_response(opcode, frame)
            parts = [self._to_response(opcode, frame)]
            while not frame.is_end:
                frame = await call.next_frame(deadline)
                parts.append(self._to_response(opcode, frame))
            return Response(
                opcode,
                parts[-1].header,
                b"".join(part.payload for part in parts),
                len(parts),
                tuple(parts),
            )
        finally:
            self._close_call(call)

    @asynccontextmanager
    async def stream(
        self,
        opcode: Opcode,
        header: messages.Message | bytes | None = None,
        payload: bytes | memoryview = b"",
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[AsyncIterator[Response]]:
        """Send a request whose answer comes in several frames; iterate over
        them as they arrive, up to RESPONSE_END. Leaving the block early
        abandons the request. ``timeout`` bounds the whole sequence."""
        deadline = _deadline(timeout)
        call = await self._open_call(opcode, header, payload, deadline)
        try:
            yield _Responses(self, call, deadline)
        finally:
            self._close_call(call)

    async def ping(self, *, timeout: float | None = None) -> float:
        """Round trip of a PING, in seconds."""
        started = trio.current_time()
        await self.request(Opcode.PING, timeout=timeout)
        return trio.current_time() - started

    async def send_goaway(self, code: ErrorCode = ErrorCode.NONE, message: str = "") -> None:
        """Tell the peer to send no new requests here; ours in flight carry on,
        and new requests from the peer are answered SHUTTING_DOWN."""
        self._state.goaway_sent = True
        header = messages.GoAway(error_code=code, error_message=message).encode()
        stream_id = self._state.start_one_way()
        await self._write(Opcode.GOAWAY, encode_frame(Opcode.GOAWAY, Flags.NONE, stream_id, header))

    async def _open_call(
        self,
        opcode: Opcode,
        header: messages.Message | bytes | None,
        payload: bytes | memoryview,
        deadline: float,
        *,
        after_goaway: bool = False,
    ) -> _Call:
        if self._closed:
            raise ConnectionClosed(self._closed_message())
        if self._goaway is not None and not after_goaway:
            code, text = self._goaway
            raise ShuttingDownError(
                f"{self.peer} sent GOAWAY ({_code_name(code)}{': ' + text if text else ''})"
            )
        if not self._started:
            raise RuntimeError("the connection is not running; start it with nursery.start(run)")
        encoded_header = _encode_header(header)
        stream_id = self._state.start_request()
        try:
            data = encode_frame(opcode, Flags.NONE, stream_id, encoded_header, payload)
        except BaseException:
            self._state.forget(stream_id)
            raise
        call = _Call(opcode, stream_id)
        self._calls[stream_id] = call
        if opcode == Opcode.PING:
            self._pings += 1
        try:
            if self._write_nowait(opcode, data):
                return call
            with trio.move_on_at(deadline) as scope:
                await self._write(opcode, data)
        except BaseException:
            self._forget_call(call)
            raise
        if scope.cancelled_caught:
            self._forget_call(call)
            raise RequestTimeoutError(f"{opcode.name} could not be sent before the deadline")
        return call

    def _to_response(self, opcode: Opcode, frame: Frame) -> Response:
        if frame.is_system_error:
            try:
                error = messages.SystemError.decode(frame.header)
            except HeaderDecodeError as exc:
                raise HeaderDecodeError(f"undecodable SYSTEM_ERROR from {self.peer}") from exc
            raise error_for(error.error_code, error.error_message)
        message_type = messages.response_type(opcode)
        if message_type is None:  # PING: the header bytes come back as sent
            return Response(opcode, frame.header, frame.payload)
        return Response(opcode, message_type.decode(frame.header), frame.payload)

    def _unregister(self, call: _Call) -> bool:
        if self._calls.pop(call.stream_id, None) is None:
            return False
        if call.opcode == Opcode.PING:
            self._pings -= 1
        return True

    def _forget_call(self, call: _Call) -> None:
        self._unregister(call)
        self._state.forget(call.stream_id)
        self._after_request()

    def _close_call(self, call: _Call) -> None:
        if not self._unregister(call):
            return
        if not call.ended:
            # Cancelled, timed out or left early: frames still on their way
            # for this id are dropped until its RESPONSE_END.
            self._state.abandon(call.stream_id)
        self._after_request()

    # -- writing --------------------------------------------------------------

    async def _write(self, opcode: int, data: bytes) -> None:
        """Queue a frame for the writer, waiting while the queue is full."""
        if self._write_nowait(opcode, data):
            return
        try:
            await self._outgoing_send.send(data)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ConnectionClosed(self._closed_message()) from None
        self._frame_queued(opcode, len(data))

    def _write_nowait(self, opcode: int, data: bytes) -> bool:
        """Queue a frame if the queue has room (the common case, and no
        scheduling round trip); False if it is full."""
        if self._closed:
            raise ConnectionClosed(self._closed_message())
        try:
            self._outgoing_send.send_nowait(data)
        except trio.WouldBlock:
            return False
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ConnectionClosed(self._closed_message()) from None
        self._frame_queued(opcode, len(data))
        return True

    def _frame_queued(self, opcode: int, nbytes: int) -> None:
        if opcode != Opcode.PING:
            self._last_activity = trio.current_time()
        self._observer.frame_sent(opcode, nbytes)

    async def _send_response(
        self,
        opcode: int,
        flags: Flags,
        stream_id: int,
        header: bytes,
        payload: bytes | memoryview,
        *,
        tracked: bool,
    ) -> None:
        await self._write(
            opcode, self._response_frame(opcode, flags, stream_id, header, payload, tracked)
        )

    def _response_frame(
        self,
        opcode: int,
        flags: Flags,
        stream_id: int,
        header: bytes,
        payload: bytes | memoryview,
        tracked: bool,
    ) -> bytes:
        data = encode_frame(opcode, flags, stream_id, header, payload)
        if tracked:
            # Before the frame is queued: once it is out the peer may reuse
            # the id, and that new request must not look like a duplicate.
            self._state.response_sent(stream_id, bool(flags & Flags.RESPONSE_END))
        return data

    async def _write_loop(self) -> None:
        stream = self._stream
        receive = self._outgoing_receive
        try:
            async for data in receive:
                if len(data) < COALESCE_BYTES:
                    batch = [data]
                    size = len(data)
                    while size < COALESCE_BYTES:
                        try:
                            more = receive.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        batch.append(more)
                        size += len(more)
                    if len(batch) > 1:
                        data = b"".join(batch)
                await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._shutdown(f"send failed: {exc or type(exc).__name__}")
        finally:
            self._writer_done.set()

    async def _flush(self, timeout: float) -> None:
        """Stop accepting frames and wait (bounded) until the queued ones are written."""
        self._outgoing_send.close()
        with trio.move_on_after(timeout):
            await self._writer_done.wait()

    # -- reading --------------------------------------------------------------

    async def _read_loop(self) -> None:
        stream = self._stream
        decoder = self._decoder
        # A TCP stream is read straight into the decoder's buffer (recv_into):
        # one copy of each received byte fewer than receive_some + feed.
        sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        while True:
            try:
                if sock is not None:
                    nbytes = await sock.recv_into(decoder.receive_buffer())
                    events = decoder.received(nbytes)
                else:
                    data = await stream.receive_some(RECEIVE_CHUNK)
                    nbytes = len(data)
                    events = decoder.feed(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._set_reason(f"receive failed: {exc or type(exc).__name__}")
                return
            if not nbytes:
                self._set_reason(f"{self.peer} closed the connection")
                return
            self._last_received = trio.current_time()
            for event in events:
                if not await self._on_event(event):
                    return

    async def _on_event(self, event: FrameEvent) -> bool:
        """Apply SPEC §1's table to one decoder event; False ends reading."""
        if type(event) is Frame:
            await self._on_frame(event)
        elif type(event) is DiscardedFrame:
            self._discard(event.reason.value)
        elif type(event) is RejectedFrame:
            if event.is_response:
                # Answering a response could loop between two peers; instead
                # fail the request it belonged to, if it is ours.
                self._discard(f"rejected_response_{event.error_code.name.lower()}")
                call = self._calls.get(event.stream_id)
                if call is not None:
                    call.fail(error_for(event.error_code, f"{event.message} (from {self.peer})"))
                    if event.flags & Flags.RESPONSE_END:
                        self._state.forget(event.stream_id)
                    else:
                        self._state.abandon(event.stream_id)
            else:
                self._discard(f"rejected_{event.error_code.name.lower()}")
                await self._start_serving(
                    event.opcode, event.stream_id, None, (event.error_code, event.message)
                )
        elif type(event) is FatalFrameError:
            self._discard("fatal")
            self._set_reason(f"bad frame from {self.peer}: {event.message}")
            _bad_frames.warning(
                event.error_code.name,
                "%s from %s: %s; closing the connection",
                event.error_code.name,
                self.peer,
                event.message,
            )
            with suppress(ConnectionClosed):
                await self.send_goaway(event.error_code, event.message)
            return False
        return True

    async def _on_frame(self, frame: Frame) -> None:
        self._observer.frame_received(
            frame.opcode, FRAME_OVERHEAD + len(frame.header) + len(frame.payload)
        )
        if frame.opcode != Opcode.PING:
            self._last_activity = self._last_received
        event = self._state.receive(frame)
        kind = type(event)
        if kind is ResponseReceived:
            call = self._calls[frame.stream_id]
            if frame.is_end:
                call.ended = True
            call.put(frame)
        elif kind is RequestReceived:
            if frame.opcode != Opcode.PING or not self._answer_ping_now(frame):
                await self._start_serving(frame.opcode, frame.stream_id, frame, None)
        elif kind is DuplicateRequest:
            await self._start_serving(
                frame.opcode,
                frame.stream_id,
                None,
                (ErrorCode.INVALID_REQUEST, f"stream id {frame.stream_id} is already in use"),
            )
        elif kind is LateResponse:
            self._discard("late_response")
        elif kind is UnexpectedResponse:
            self._discard("unexpected_response")
        elif kind is GoAwayReceived:
            self._on_goaway(frame)

    def _on_goaway(self, frame: Frame) -> None:
        try:
            goaway = messages.GoAway.decode(frame.header)
            self._goaway = (goaway.error_code, goaway.error_message)
        except HeaderDecodeError:
            self._goaway = (ErrorCode.UNKNOWN, "undecodable GOAWAY")
        code, text = self._goaway
        self._set_reason(
            f"{self.peer} sent GOAWAY ({_code_name(code)}{': ' + text if text else ''})"
        )
        self._after_request()

    def _discard(self, kind: str) -> None:
        self.discarded[kind] = self.discarded.get(kind, 0) + 1
        self._observer.frame_discarded(kind)

    # -- serving the peer's requests -------------------------------------------

    def _answer_ping_now(self, frame: Frame) -> bool:
        """Answer a PING from the reader itself when the outgoing queue has
        room (no task to start, no slot to take); False if it has none."""
        data = encode_frame(
            Opcode.PING, _RESPONSE_END, frame.stream_id, frame.header, frame.payload
        )
        try:
            if not self._write_nowait(Opcode.PING, data):
                return False
        except ConnectionClosed:
            pass  # closing: nobody left to answer
        # No checkpoint since the frame was queued, so the peer cannot have
        # reused this id yet.
        self._state.response_sent(frame.stream_id, end=True)
        self._observer.request_started(Opcode.PING)
        self._observer.request_finished(Opcode.PING, 0.0, ErrorCode.NONE)
        return True

    async def _start_serving(
        self,
        opcode: int,
        stream_id: int,
        frame: Frame | None,
        rejection: tuple[ErrorCode, str] | None,
    ) -> None:
        # Taken before a possible wait: the request's place among those of
        # this connection, and when the chunk holding it was read.
        arrival, received_at = self._arrivals, self._last_received
        self._arrivals += 1
        # The backpressure point: with every slot taken the reader waits here
        # and reads nothing more from the socket.
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        self._serving += 1
        if opcode == Opcode.PING:
            self._pings += 1
        responder = Responder(self, opcode, stream_id, tracked=frame is not None)
        self._observer.request_started(opcode)
        request = None
        offered = False
        if frame is not None and rejection is None and opcode != Opcode.PING:
            request = Request(
                self,
                Opcode(opcode),
                stream_id,
                frame.header,
                memoryview(frame.payload),
                received_at,
                arrival,
            )
            if self._start_nowait is not None and not self._state.goaway_sent:
                # The handler's synchronous path: no task; it answers later
                # through Responder.end_nowait. A request it declines is served
                # by a task calling the handler; one it refuses with an error
                # is answered by a task with that error.
                offered = True
                try:
                    if self._start_nowait(request, responder):
                        return
                except ProtocolError as exc:
                    rejection = (_wire_code(exc.code), exc.message)
                except Exception:
                    logger.exception("%s handler failed (peer %s)", request.opcode.name, self.peer)
                    rejection = (ErrorCode.UNKNOWN, "internal server error")
        assert self._nursery is not None
        self._nursery.start_soon(self._serve, responder, frame, request, rejection, offered)

    async def _serve(
        self,
        responder: Responder,
        frame: Frame | None,
        request: Request | None,
        rejection: tuple[ErrorCode, str] | None,
        offered: bool,
    ) -> None:
        try:
            await self._answer(responder, frame, request, rejection, offered)
        except ConnectionClosed:
            pass  # nobody left to answer
        finally:
            self._request_done(responder)

    def _request_done(self, responder: Responder) -> None:
        """Bookkeeping once a request of the peer is answered, by either path."""
        self._slots.release()
        self._serving -= 1
        opcode = responder.opcode
        if opcode == Opcode.PING:
            self._pings -= 1
        self._after_request()
        self._observer.request_finished(
            opcode, trio.current_time() - responder.started, responder.error_code
        )

    def _end_nowait(self, responder: Responder, header: bytes) -> None:
        """The last response frame of a request served without a task.

        The request keeps its slot until the frame is queued: with the queue
        full, a task waits for room, so a peer that does not read its answers
        still stops being read from (the backpressure of the task path).
        """
        data = self._response_frame(
            responder.opcode, _RESPONSE_END, responder.stream_id, header, b"", True
        )
        try:
            queued = self._write_nowait(responder.opcode, data)
        except ConnectionClosed:
            queued = True  # nobody left to answer
        if queued or self._nursery is None:
            self._request_done(responder)
            return
        self._nursery.start_soon(self._write_then_done, responder, data)

    async def _write_then_done(self, responder: Responder, data: bytes) -> None:
        try:
            await self._write(responder.opcode, data)
        except ConnectionClosed:
            pass
        finally:
            self._request_done(responder)

    async def _answer(
        self,
        responder: Responder,
        frame: Frame | None,
        request: Request | None,
        rejection: tuple[ErrorCode, str] | None,
        offered: bool,
    ) -> None:
        opcode = responder.opcode
        if rejection is not None:
            await responder.send_error(*rejection)
            return
        assert frame is not None
        if opcode == Opcode.PING:
            await responder.send_raw(frame.header, frame.payload)
            return
        assert request is not None
        # A request the immediate path declined goes to its handler whatever
        # happened since (the handler may have counted on serving it).
        if not offered and self._state.goaway_sent:
            await responder.send_error(ErrorCode.SHUTTING_DOWN, "the connection is draining")
            return
        if self._handler is None:
            await responder.send_error(
                ErrorCode.UNSUPPORTED_OPERATION,
                f"this {self.side.value} end serves no {Opcode(opcode).name}",
            )
            return
        try:
            await self._handler(request, responder)
        except ProtocolError as exc:
            if responder.done:
                logger.warning("%s handler raised after responding: %s", request.opcode.name, exc)
            else:
                await responder.send_error(_wire_code(exc.code), exc.message)
            return
        except Exception:
            if self.closed:
                # The peer went away mid-response (a client that stopped
                # waiting): there is no one left to answer.
                logger.debug("%s: %s left before the response", request.opcode.name, self.peer)
                return
            logger.exception("%s handler failed (peer %s)", request.opcode.name, self.peer)
            if not responder.done:
                await responder.send_error(ErrorCode.UNKNOWN, "internal server error")
            return
        if not responder.done:
            logger.error("%s handler returned without ending its response", request.opcode.name)
            await responder.send_error(ErrorCode.UNKNOWN, "the server sent no complete response")

    # -- timers ---------------------------------------------------------------

    async def _keepalive_loop(self, interval: float) -> None:
        timeout = self.limits.keepalive_timeout
        while True:
            await trio.sleep_until(self._last_received + interval)
            if trio.current_time() - self._last_received < interval:
                continue
            call = None
            try:
                call = await self._open_call(
                    Opcode.PING, None, b"", _deadline(timeout), after_goaway=True
                )
                await call.next_frame(_deadline(timeout))
            except RequestTimeoutError:
                self._shutdown(f"{self.peer} did not answer a keepalive PING within {timeout:g} s")
                return
            except ConnectionClosed:
                return
            finally:
                if call is not None:
                    self._close_call(call)

    async def _idle_loop(self, idle_timeout: float) -> None:
        while True:
            await trio.sleep_until(self._last_activity + idle_timeout)
            now = trio.current_time()
            if self.in_flight > self._pings:
                self._last_activity = now
            elif now - self._last_activity >= idle_timeout:
                self._shutdown(f"idle for {idle_timeout:g} s")
                return

    # -- closing --------------------------------------------------------------

    def _after_request(self) -> None:
        """Bookkeeping when a request in either direction finishes."""
        if self.in_flight:
            return
        if self._quiet is not None:
            self._quiet.set()
        if self._goaway is not None and not self._closed:
            # The peer is going away and nothing is left to finish here.
            self._shutdown(self._close_reason)

    def _set_reason(self, reason: str) -> None:
        if not self._close_reason:
            self._close_reason = reason

    def _shutdown(self, reason: str) -> None:
        self._set_reason(reason)
        self._mark_closed(self._close_reason)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _mark_closed(self, reason: str) -> None:
        if self._closed:
            return
        self._set_reason(reason)
        self._closed = True
        for call in self._calls.values():
            call.fail(ConnectionClosed(self._closed_message()))
        if self._quiet is not None:
            self._quiet.set()

    def _closed_message(self) -> str:
        return f"connection to {self.peer} closed: {self._close_reason or 'closed'}"


def _code_name(code: ErrorCode | int) -> str:
    return code.name if isinstance(code, ErrorCode) else str(code)


def _wire_code(code: ErrorCode | int) -> ErrorCode:
    return code if isinstance(code, ErrorCode) else ErrorCode.UNKNOWN


def _peer_name(stream: trio.abc.Stream) -> str:
    socket = getattr(stream, "socket", None)
    if socket is not None:
        try:
            host, port = socket.getpeername()[:2]
        except OSError:
            return "unknown peer"
        return f"{host}:{port}"
    return type(stream).__name__
