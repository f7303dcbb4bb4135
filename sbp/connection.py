"""The SBP connection engine, sans-IO (as h2's ``H2Connection`` and h11's
``Connection``): bytes in, events out, bytes to send.

One ``ConnectionEngine`` serves either end of a connection and makes every
protocol decision SPEC §1 and §5 leave to a connection, so that the I/O
driver (``net.connection``) only moves bytes and runs handlers:

- the bad-frame table of SPEC §1 (``BAD_FRAME_ACTIONS`` below): frames are
  discarded and counted, answered with a SYSTEM_ERROR, or end the
  connection with a GOAWAY;
- PING is answered at once;
- a request reusing the id of one still being served is answered
  ``INVALID_REQUEST``, and the first request carries on;
- after this end sent GOAWAY, new requests are answered ``SHUTTING_DOWN``;
  after the peer sent one, no new request of ours may start;
- stream ids for our requests (``[0, 2**31)`` for a client; a server's own
  requests set the top bit), the matching of response frames to them, and
  requests we gave up on, whose late frames are dropped;
- request slots: at most ``max_concurrent_requests`` of the peer's requests
  are served at once, and each gets exactly one response sequence.

Frames to send wait in the engine (``data_to_send``); ``wants_data`` tells
the driver whether to read more: not while every slot is taken or while more
than ``high_water`` bytes wait to be sent (a peer that does not read its
answers stops being read from). Nothing here blocks, sleeps or reads a clock.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from . import messages
from .constants import (
    DEFAULT_MAX_FRAME_LENGTH,
    FIRST_CLIENT_STREAM_ID,
    FRAME_OVERHEAD,
    MAX_CLIENT_STREAM_ID,
    SERVER_STREAM_ID_BIT,
)
from .enums import ErrorCode, Flags, Opcode
from .errors import (
    ConnectionClosed,
    HeaderDecodeError,
    NotLeaderError,
    ShuttingDownError,
    code_name,
    error_for,
)
from .frames import (
    Buffer,
    DiscardedFrame,
    FatalFrameError,
    Frame,
    FrameDecoder,
    FrameEvent,
    RejectedFrame,
    encode_frame,
    frame_pieces,
    gathered_frame_pieces,
)
from .observer import NULL_OBSERVER, ConnectionObserver

#: an answer's payload at least this large is queued as it is, not copied
#: into its frame: the driver writes the frame's pieces with one ``sendmsg``
#: (a FETCH answer of a megabyte was copied twice more before it reached
#: the socket)
GATHERED_PAYLOAD_BYTES: Final = 64 * 1024

#: bytes waiting to be sent above which the engine stops asking for input
DEFAULT_HIGH_WATER: Final = 1 << 20
DEFAULT_MAX_CONCURRENT_REQUESTS: Final = 256
_RESPONSE_END = Flags.RESPONSE | Flags.RESPONSE_END
#: the Opcode member of each known opcode number (an enum call costs more)
_OPCODES: Final = {int(opcode): opcode for opcode in Opcode}
#: request frames the engine answers itself, without taking a slot
_NO_SLOT: Final = frozenset({Opcode.PING, Opcode.GOAWAY})
_SYSTEM_ERROR_END = _RESPONSE_END | Flags.SYSTEM_ERROR


class Side(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class BadFrameAction(enum.Enum):
    """What SPEC §1's table says a receiver does with a bad frame."""

    DISCARD = "discard the frame, count it, keep the connection"
    ANSWER_ERROR = "answer with a SYSTEM_ERROR response; apply nothing"
    GOAWAY_AND_CLOSE = "send GOAWAY, then close the connection"


#: SPEC §1 "What a receiver does with a bad frame", as data: the decoder's
#: event for each condition and the engine's action (tests/unit check both).
BAD_FRAME_ACTIONS: Final = {
    "frame_length < 16 or > the limit": (FatalFrameError, BadFrameAction.GOAWAY_AND_CLOSE),
    "magic != 23": (DiscardedFrame, BadFrameAction.DISCARD),
    "unknown opcode": (DiscardedFrame, BadFrameAction.DISCARD),
    "header_format != 0x01": (RejectedFrame, BadFrameAction.ANSWER_ERROR),
    "checksum mismatch": (RejectedFrame, BadFrameAction.ANSWER_ERROR),
    "header_length past the frame": (RejectedFrame, BadFrameAction.ANSWER_ERROR),
    "response for a stream id with no request in flight": (Frame, BadFrameAction.DISCARD),
}


# -- events -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestReceived:
    """A request of the peer to serve: answer it with one response sequence
    (``send_response`` … ``end=True``). ``arrival`` numbers the requests of
    the connection in the order they arrived (0, 1, …)."""

    opcode: Opcode
    stream_id: int
    header: bytes
    payload: memoryview
    arrival: int


@dataclass(frozen=True, slots=True)
class ResponseReceived:
    """A response frame for a request of ours; ``frame.is_end`` ends it."""

    stream_id: int
    frame: Frame


@dataclass(frozen=True, slots=True)
class CallFailed:
    """A response frame for a request of ours that failed the frame checks:
    the request fails with ``error`` (its sequence is over for us)."""

    stream_id: int
    error: Exception


@dataclass(frozen=True, slots=True)
class GoAwayReceived:
    """The peer accepts no new requests; ours in flight carry on."""

    error_code: ErrorCode | int
    message: str


@dataclass(frozen=True, slots=True)
class ConnectionTerminated:
    """The byte stream is unusable (a bad frame length): a GOAWAY is queued,
    nothing more is read; send what is queued and close."""

    error_code: ErrorCode
    message: str


Event = RequestReceived | ResponseReceived | CallFailed | GoAwayReceived | ConnectionTerminated


class StreamIdsExhausted(RuntimeError):
    """Every stream id of this side is awaiting a response."""


# -- the engine -----------------------------------------------------------------


class ConnectionEngine:
    """One end of an SBP connection (see the module docstring)."""

    def __init__(
        self,
        side: Side,
        *,
        max_frame_length: int = DEFAULT_MAX_FRAME_LENGTH,
        max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
        serves_requests: bool = True,
        high_water: int = DEFAULT_HIGH_WATER,
        observer: ConnectionObserver | None = None,
        peer: str = "peer",
    ) -> None:
        if max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")
        self.side = side
        self.peer = peer
        self.max_concurrent_requests = max_concurrent_requests
        self.high_water = high_water
        self._serves_requests = serves_requests
        self._observer = observer or NULL_OBSERVER
        self._decoder = FrameDecoder(max_frame_length)
        self._base = 0 if side is Side.CLIENT else SERVER_STREAM_ID_BIT
        self._next_id = FIRST_CLIENT_STREAM_ID if side is Side.CLIENT else 0
        self._pending: set[int] = set()  # our requests awaiting RESPONSE_END
        self._abandoned: set[int] = set()  # ours, given up: late frames dropped
        self._serving: dict[int, Opcode] = {}  # the peer's requests not yet answered
        self._arrivals = 0
        #: decoded frames not yet turned into events (a request waiting for a slot)
        self._backlog: deque[FrameEvent] = deque()
        #: frames to send, each as (its size, its pieces)
        self._outgoing: deque[tuple[int, tuple[Buffer, ...]]] = deque()
        self.outgoing_bytes = 0
        #: frames other than PING sent or received so far (the idle timer's clock)
        self.activity = 0
        #: (code, message) of the GOAWAY the peer sent, None before one
        self.goaway_received: tuple[ErrorCode | int, str] | None = None
        self.goaway_sent = False
        #: set once the byte stream is unusable (nothing more is read)
        self.terminated: ConnectionTerminated | None = None
        #: frames dropped by kind (bad_magic, late_response, rejected_<code> …)
        self.discarded: dict[str, int] = {}

    # -- state ------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Requests of ours awaiting their RESPONSE_END."""
        return len(self._pending)

    @property
    def serving(self) -> int:
        """Requests of the peer being served (each holds a slot)."""
        return len(self._serving)

    @property
    def buffered(self) -> int:
        """Received bytes not yet decoded into a frame."""
        return self._decoder.buffered

    @property
    def holding(self) -> int:
        """Bytes of memory held for a frame being received (0 between frames)."""
        return self._decoder.holding

    @property
    def growth(self) -> int:
        """How much ``holding`` grows with the room the next read needs."""
        return self._decoder.growth()

    @property
    def wants_data(self) -> bool:
        """Whether to read more now: a free request slot, room to answer,
        and a usable stream."""
        return (
            self.terminated is None
            and not self._backlog
            and len(self._serving) < self.max_concurrent_requests
            and self.outgoing_bytes <= self.high_water
        )

    def is_serving(self, stream_id: int) -> bool:
        return stream_id in self._serving

    def release_buffers(self) -> None:
        """The connection is over: drop what was received and not yet
        served, and the frames not yet sent."""
        self._decoder.release()
        self._backlog.clear()
        self._outgoing.clear()
        self.outgoing_bytes = 0

    # -- bytes in -------------------------------------------------------------------

    def receive_buffer(self) -> memoryview:
        """Where the next read may put its bytes (then call ``received``)."""
        return self._decoder.receive_buffer()

    def received(self, nbytes: int) -> list[Event]:
        """``nbytes`` were read into ``receive_buffer()``: the events they make."""
        self._backlog.extend(self._decoder.received(nbytes))
        return self.next_events()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Bytes read some other way: the events they make."""
        self._backlog.extend(self._decoder.feed(data))
        return self.next_events()

    def next_events(self) -> list[Event]:
        """Events of frames already received, as far as request slots allow:
        a request with every slot taken waits, and the frames behind it with
        it (call again once a request ends)."""
        events: list[Event] = []
        backlog = self._backlog
        while backlog and self.terminated is None:
            item = backlog[0]
            if (
                type(item) is Frame
                and not item.is_response
                and item.opcode not in _NO_SLOT
                and len(self._serving) >= self.max_concurrent_requests
            ):
                break
            backlog.popleft()
            event: Event | None
            match item:
                case Frame():
                    event = self._on_frame(item)
                case DiscardedFrame(reason):
                    self._discard(reason.value)
                    event = None
                case RejectedFrame():
                    event = self._on_rejected(item)
                case FatalFrameError():
                    event = self._on_fatal(item)
            if event is not None:
                events.append(event)
        return events

    def _on_frame(self, frame: Frame) -> Event | None:
        opcode = _OPCODES[frame.opcode]  # the decoder passes known opcodes only
        self._observer.frame_received(
            opcode, FRAME_OVERHEAD + len(frame.header) + len(frame.payload)
        )
        if opcode != Opcode.PING:
            self.activity += 1
        if frame.is_response:
            return self._on_response(frame)
        if opcode == Opcode.GOAWAY:
            return self._on_goaway(frame)
        if frame.stream_id in self._serving:
            self._answer_error(
                opcode,
                frame.stream_id,
                ErrorCode.INVALID_REQUEST,
                f"stream id {frame.stream_id} is already in use",
            )
            return None
        if opcode == Opcode.PING:
            self._observer.request_started(opcode)
            self._queue(
                opcode,
                encode_frame(opcode, _RESPONSE_END, frame.stream_id, frame.header, frame.payload),
            )
            self._observer.request_finished(opcode, 0.0, ErrorCode.NONE)
            return None
        if self.goaway_sent:
            self._answer_error(
                opcode, frame.stream_id, ErrorCode.SHUTTING_DOWN, "the connection is draining"
            )
            return None
        if not self._serves_requests:
            self._answer_error(
                opcode,
                frame.stream_id,
                ErrorCode.UNSUPPORTED_OPERATION,
                f"this {self.side.value} end serves no {opcode.name}",
            )
            return None
        self._serving[frame.stream_id] = opcode
        self._observer.request_started(opcode)
        arrival = self._arrivals
        self._arrivals += 1
        payload = (
            frame.payload if isinstance(frame.payload, memoryview) else memoryview(frame.payload)
        )
        return RequestReceived(opcode, frame.stream_id, frame.header, payload, arrival)

    def _on_response(self, frame: Frame) -> Event | None:
        stream_id = frame.stream_id
        if stream_id in self._pending:
            if frame.is_end:
                self._pending.discard(stream_id)
            return ResponseReceived(stream_id, frame)
        if stream_id in self._abandoned:
            if frame.is_end:
                self._abandoned.discard(stream_id)
            self._discard("late_response")
            return None
        self._discard("unexpected_response")
        return None

    def _on_goaway(self, frame: Frame) -> Event:
        try:
            goaway = messages.GoAway.decode(frame.header)
            self.goaway_received = (goaway.error_code, goaway.error_message)
        except HeaderDecodeError:
            self.goaway_received = (ErrorCode.UNKNOWN, "undecodable GOAWAY")
        return GoAwayReceived(*self.goaway_received)

    def _on_rejected(self, rejected: RejectedFrame) -> Event | None:
        code_name = rejected.error_code.name.lower()
        if rejected.is_response:
            # Answering a response could loop between two peers; the request
            # it belongs to, if ours, fails instead.
            self._discard(f"rejected_response_{code_name}")
            stream_id = rejected.stream_id
            if stream_id not in self._pending:
                return None
            self._pending.discard(stream_id)
            if not rejected.flags & Flags.RESPONSE_END:
                self._abandoned.add(stream_id)
            error = error_for(rejected.error_code, f"{rejected.message} (from {self.peer})")
            return CallFailed(stream_id, error)
        self._discard(f"rejected_{code_name}")
        self._answer_error(
            rejected.opcode, rejected.stream_id, rejected.error_code, rejected.message
        )
        return None

    def _on_fatal(self, fatal: FatalFrameError) -> Event:
        self._discard("fatal")
        self.send_goaway(fatal.error_code, fatal.message)
        self.terminated = ConnectionTerminated(fatal.error_code, fatal.message)
        return self.terminated

    def _discard(self, kind: str) -> None:
        self.discarded[kind] = self.discarded.get(kind, 0) + 1
        self._observer.frame_discarded(kind)

    def _answer_error(self, opcode: int, stream_id: int, code: ErrorCode, message: str) -> None:
        """A SYSTEM_ERROR answer to a frame that never became a request being
        served (a rejected frame, a duplicate id, a request after GOAWAY)."""
        self._observer.request_started(opcode)
        header = system_error_header(code, message)
        self._queue(opcode, encode_frame(opcode, _SYSTEM_ERROR_END, stream_id, header))
        self._observer.request_finished(opcode, 0.0, code)

    # -- our requests ---------------------------------------------------------------

    def check_can_request(self) -> None:
        """Raise why no request of ours may start now, if one may not."""
        if self.terminated is not None:
            raise ConnectionClosed(
                f"connection to {self.peer} is unusable: {self.terminated.message}"
            )
        if self.goaway_received is not None:
            raise ShuttingDownError(describe_goaway(self.peer, *self.goaway_received))

    def send_request(
        self,
        opcode: Opcode,
        header: bytes = b"",
        payload: bytes | memoryview = b"",
        *,
        after_goaway: bool = False,
    ) -> int:
        """Queue a request; its stream id. ``after_goaway`` lets a keepalive
        PING out on a connection the peer is draining."""
        if not after_goaway:
            self.check_can_request()
        stream_id = self._new_stream_id()
        try:
            data = encode_frame(opcode, Flags.NONE, stream_id, header, payload)
        except BaseException:
            self._pending.discard(stream_id)
            raise
        self._queue(opcode, data)
        return stream_id

    def _new_stream_id(self) -> int:
        span = MAX_CLIENT_STREAM_ID + 1
        for _ in range(span):
            candidate = self._base | self._next_id
            self._next_id = (self._next_id + 1) % span
            if candidate not in self._pending and candidate not in self._abandoned:
                self._pending.add(candidate)
                return candidate
        raise StreamIdsExhausted("no free stream id on this connection")

    def abandon(self, stream_id: int) -> None:
        """Give up on a request (timeout, cancellation): frames still on their
        way for it are dropped until its RESPONSE_END."""
        if stream_id in self._pending:
            self._pending.discard(stream_id)
            self._abandoned.add(stream_id)

    def forget(self, stream_id: int) -> None:
        """Drop every trace of a request (its sequence is over, or it was never sent)."""
        self._pending.discard(stream_id)
        self._abandoned.discard(stream_id)

    # -- answers --------------------------------------------------------------------

    def send_response(
        self,
        stream_id: int,
        header: bytes,
        payload: Buffer = b"",
        *,
        end: bool = True,
        system_error: bool = False,
    ) -> Opcode:
        """Queue a response frame of a request being served; with ``end`` the
        request's slot is free again. Returns the request's opcode.

        A payload of ``GATHERED_PAYLOAD_BYTES`` or more is queued, not copied:
        it must not change until ``data_to_send`` has handed it over and it
        is written."""
        opcode, flags = self._answering(stream_id, end=end, system_error=system_error)
        pieces = frame_pieces(opcode, flags, stream_id, header, payload)
        self._answered(stream_id, end)
        if len(payload) >= GATHERED_PAYLOAD_BYTES:
            self._queue_pieces(opcode, pieces, sum(len(piece) for piece in pieces))
        else:
            self._queue(opcode, b"".join(pieces))
        return opcode

    def send_borrowed_response(
        self, stream_id: int, header: bytes, payload: Sequence[Buffer], *, end: bool = True
    ) -> list[Buffer]:
        """``send_response`` for a payload in buffers that stay valid for a
        moment only (record batches inside a read transaction): the frame is
        returned, as pieces to be written at once, instead of queued. What
        the caller could not write goes back, copied, through
        ``queue_unsent`` before anything else is queued. Only while nothing
        is queued, so that frames keep their order."""
        if self._outgoing:
            raise RuntimeError("frames are queued ahead of a borrowed payload")
        opcode, flags = self._answering(stream_id, end=end, system_error=False)
        pieces = gathered_frame_pieces(opcode, flags, stream_id, header, payload)
        self._answered(stream_id, end)
        self._count_frame(opcode, sum(len(piece) for piece in pieces))
        return pieces

    def queue_unsent(self, pieces: Sequence[Buffer]) -> None:
        """Queue again, first, what was taken (``data_to_send``) or handed
        out (``send_borrowed_response``) and could not be written at once."""
        size = sum(len(piece) for piece in pieces)
        self._outgoing.appendleft((size, tuple(pieces)))
        self.outgoing_bytes += size

    @property
    def queued_frames(self) -> int:
        """Frames queued and not yet taken by ``data_to_send``."""
        return len(self._outgoing)

    def _answering(self, stream_id: int, *, end: bool, system_error: bool) -> tuple[Opcode, int]:
        """The opcode and flags of a response frame of a request being served."""
        opcode = self._serving.get(stream_id)
        if opcode is None:
            raise RuntimeError(f"stream {stream_id} has no request being served")
        flags = _RESPONSE_END if end else Flags.RESPONSE
        if system_error:
            flags |= Flags.SYSTEM_ERROR
        return opcode, flags

    def _answered(self, stream_id: int, end: bool) -> None:
        """A response frame was framed (one that cannot be, a header over
        its limit, raises before this and leaves the request to be answered)."""
        if end:
            # Before the frame can reach the peer, which may then reuse the id.
            del self._serving[stream_id]

    def send_goaway(self, code: ErrorCode = ErrorCode.NONE, message: str = "") -> None:
        """Tell the peer to send no new requests; requests already being
        served here, and ours in flight, carry on."""
        self.goaway_sent = True
        header = messages.GoAway(error_code=code, error_message=message).encode()
        stream_id = self._base | self._next_id
        self._next_id = (self._next_id + 1) % (MAX_CLIENT_STREAM_ID + 1)
        self._queue(Opcode.GOAWAY, encode_frame(Opcode.GOAWAY, Flags.NONE, stream_id, header))

    # -- bytes out ------------------------------------------------------------------

    def _queue(self, opcode: int, data: bytes) -> None:
        self._queue_pieces(opcode, (data,), len(data))

    def _queue_pieces(self, opcode: int, pieces: tuple[Buffer, ...], size: int) -> None:
        self._outgoing.append((size, pieces))
        self.outgoing_bytes += size
        self._count_frame(opcode, size)

    def _count_frame(self, opcode: int, size: int) -> None:
        if opcode != Opcode.PING:
            self.activity += 1
        self._observer.frame_sent(opcode, size)

    def data_to_send(self, limit: int = 0) -> list[Buffer]:
        """Take queued frames, oldest first: all of them, or (``limit``) frames
        up to about that many bytes (at least one). What is returned is to be
        written in order; a frame with a large payload comes in three pieces
        (see ``send_response``), any other in one."""
        taken: list[Buffer] = []
        size = 0
        outgoing = self._outgoing
        while outgoing and (not limit or not taken or size + outgoing[0][0] <= limit):
            frame_size, pieces = outgoing.popleft()
            taken.extend(pieces)
            size += frame_size
        self.outgoing_bytes -= size
        return taken


def system_error_header(code: ErrorCode, message: str = "", leader_addr: str = "") -> bytes:
    """The encoded header of a SYSTEM_ERROR answer (SPEC §1)."""
    return messages.SystemErrorHeader(
        error_code=code, error_message=message, leader_addr=leader_addr
    ).encode()


def describe_goaway(peer: str, code: ErrorCode | int, text: str) -> str:
    """How a GOAWAY from ``peer`` reads in errors and close reasons."""
    return f"{peer} sent GOAWAY ({code_name(code)}{': ' + text if text else ''})"


def decode_response(opcode: Opcode, frame: Frame, peer: str = "peer") -> messages.Message | bytes:
    """The response message a frame carries (raw bytes for PING); a
    SYSTEM_ERROR answer raises the ``ProtocolError`` of its code."""
    if frame.is_system_error:
        try:
            error = messages.SystemErrorHeader.decode(frame.header)
        except HeaderDecodeError as exc:
            raise HeaderDecodeError(f"undecodable SYSTEM_ERROR from {peer}") from exc
        failure = error_for(error.error_code, error.error_message)
        if isinstance(failure, NotLeaderError):
            failure.leader_addr = error.leader_addr
        raise failure
    message_type = messages.response_type(opcode)
    if message_type is None:  # PING: the header bytes come back as sent
        return frame.header
    return message_type.decode(frame.header)
