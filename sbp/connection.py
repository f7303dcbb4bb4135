"""Per-connection protocol state, sans-IO (as h2 keeps its streams).

One ``ConnectionState`` serves either end of a connection. It allocates stream
ids for the requests this end sends, matches received response frames to
them, remembers requests it has abandoned (timed out or cancelled) so their
late frames are dropped quietly, and tracks the requests it is serving so that
each gets exactly one response sequence.

Ids: a client's requests use ``[0, 2**31)``; requests a server starts on its
own (PING, GOAWAY) set the top bit, so the two never collide.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .constants import MAX_CLIENT_STREAM_ID, SERVER_STREAM_ID_BIT
from .enums import Opcode
from .frames import Frame


class Side(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


@dataclass(frozen=True, slots=True)
class RequestReceived:
    """A request frame to serve; answer it with one response sequence."""

    frame: Frame


@dataclass(frozen=True, slots=True)
class DuplicateRequest:
    """A request reusing the stream id of one still being served. It gets a
    SYSTEM_ERROR ``INVALID_REQUEST``; the first request carries on."""

    frame: Frame


@dataclass(frozen=True, slots=True)
class GoAwayReceived:
    """The peer accepts no new requests on this connection."""

    frame: Frame


@dataclass(frozen=True, slots=True)
class ResponseReceived:
    """A response frame for a request of ours; ``end`` closes its sequence."""

    frame: Frame
    end: bool


@dataclass(frozen=True, slots=True)
class LateResponse:
    """A response for a request we abandoned: drop it."""

    frame: Frame


@dataclass(frozen=True, slots=True)
class UnexpectedResponse:
    """A response for a stream id with no request in flight: discard, count."""

    frame: Frame


ConnectionEvent = (
    RequestReceived
    | DuplicateRequest
    | GoAwayReceived
    | ResponseReceived
    | LateResponse
    | UnexpectedResponse
)


class StreamIdsExhausted(RuntimeError):
    """Every stream id of this side is awaiting a response."""


class ConnectionState:
    def __init__(self, side: Side) -> None:
        self.side = side
        self._base = 0 if side is Side.CLIENT else SERVER_STREAM_ID_BIT
        self._next_id = 0
        self._pending: set[int] = set()  # our requests awaiting RESPONSE_END
        self._abandoned: set[int] = set()  # ours, given up, late frames dropped
        self._serving: set[int] = set()  # the peer's requests not yet answered
        self.goaway_received = False
        self.goaway_sent = False

    # -- our requests ---------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def serving(self) -> int:
        return len(self._serving)

    def start_request(self) -> int:
        """Allocate a stream id for a new request and mark it in flight."""
        span = MAX_CLIENT_STREAM_ID + 1
        for _ in range(span):
            candidate = self._base | self._next_id
            self._next_id = (self._next_id + 1) % span
            if candidate not in self._pending and candidate not in self._abandoned:
                self._pending.add(candidate)
                return candidate
        raise StreamIdsExhausted("no free stream id on this connection")

    def start_one_way(self) -> int:
        """A stream id for a frame that gets no answer (GOAWAY)."""
        candidate = self._base | self._next_id
        self._next_id = (self._next_id + 1) % (MAX_CLIENT_STREAM_ID + 1)
        return candidate

    def abandon(self, stream_id: int) -> None:
        """Give up on a request (timeout, cancellation): its late frames will
        be dropped until its RESPONSE_END arrives."""
        if stream_id in self._pending:
            self._pending.discard(stream_id)
            self._abandoned.add(stream_id)

    def forget(self, stream_id: int) -> None:
        """Drop every trace of a request (the connection failed, or the
        request was never sent)."""
        self._pending.discard(stream_id)
        self._abandoned.discard(stream_id)

    # -- frames in ------------------------------------------------------------

    def receive(self, frame: Frame) -> ConnectionEvent:
        if frame.is_response:
            return self._receive_response(frame)
        if frame.opcode == Opcode.GOAWAY:
            self.goaway_received = True
            return GoAwayReceived(frame)
        if frame.stream_id in self._serving:
            return DuplicateRequest(frame)
        self._serving.add(frame.stream_id)
        return RequestReceived(frame)

    def _receive_response(self, frame: Frame) -> ConnectionEvent:
        stream_id = frame.stream_id
        end = frame.is_end
        if stream_id in self._pending:
            if end:
                self._pending.discard(stream_id)
            return ResponseReceived(frame, end)
        if stream_id in self._abandoned:
            if end:
                self._abandoned.discard(stream_id)
            return LateResponse(frame)
        return UnexpectedResponse(frame)

    # -- frames out -----------------------------------------------------------

    def response_sent(self, stream_id: int, end: bool) -> None:
        """Record that a response frame for a request we serve went out."""
        if stream_id not in self._serving:
            raise RuntimeError(f"stream {stream_id} has no request being served")
        if end:
            self._serving.discard(stream_id)

    def is_serving(self, stream_id: int) -> bool:
        return stream_id in self._serving
