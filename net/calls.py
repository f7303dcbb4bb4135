"""Requests of ours on a connection: ``Caller`` sends them and matches the
answers, ``Call`` is what each waits on while its frames arrive (one
consumer per call), ``Response`` what it gets."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import trio

from sbp import messages
from sbp.connection import ConnectionEngine, decode_response
from sbp.enums import Opcode
from sbp.errors import HeaderDecodeError, RequestTimeoutError
from sbp.frames import Frame

H = TypeVar("H")

#: the longest a request waits for a throttle a server asked (servers tell
#: at most 30 s; SPEC §12)
MAX_THROTTLE_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class Response(Generic[H]):
    """A response received for a request of ours.

    ``header`` is the decoded response message (raw bytes for PING). When
    ``request()`` collected several frames, ``header`` is the last frame's,
    ``payload`` all payloads joined, and ``parts`` each frame's own response.
    """

    opcode: Opcode
    header: H
    payload: bytes | memoryview
    frames: int = 1
    parts: tuple[Response[H], ...] = field(default=(), repr=False)


class Call:
    """A request of ours awaiting its response frames (one consumer) until
    its ``deadline`` (trio time), when ``Caller.expire_calls`` fails it."""

    __slots__ = ("_wakeup", "deadline", "ended", "error", "frames", "opcode", "stream_id")

    def __init__(self, opcode: Opcode, stream_id: int, deadline: float = math.inf) -> None:
        self.opcode = opcode
        self.stream_id = stream_id
        self.deadline = deadline
        self.frames: deque[Frame] = deque()
        self.error: BaseException | None = None
        self.ended = False  # RESPONSE_END received (its frame may still be queued)
        self._wakeup = trio.Event()

    def put(self, frame: Frame) -> None:
        self.ended = self.ended or frame.is_end
        self.frames.append(frame)
        self._wakeup.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wakeup.set()

    def expire(self) -> None:
        """The deadline passed: the frames received are still taken, then a
        timeout is raised (an answer received whole is not failed)."""
        if self.error is None and not self.ended:
            self.fail(RequestTimeoutError(f"no response to {self.opcode.name} before the deadline"))

    async def next_frame(self) -> Frame:
        """The next frame, raising the connection's error or a timeout."""
        while True:
            if self.frames:
                return self.frames.popleft()
            if self.error is not None:
                raise self.error
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
                continue
            await self._wakeup.wait()


class Throttles:
    """The waits a server asked of this connection (``throttle_time_ms``,
    SPEC §12). The next request of the answer's kind waits until then; and
    since the server reads nothing more from the connection meanwhile, the
    requests still unanswered on it wait as long: their deadlines move out
    by the time the hold grew, so a client that waits as told never times
    out for it."""

    __slots__ = ("_calls", "held_until", "until")

    def __init__(self, calls: dict[int, Call]) -> None:
        self._calls = calls
        #: by opcode: the trio time before which no request of it is sent
        self.until: dict[int, float] = {}
        #: when the server reads from this connection again, as last told
        self.held_until = 0.0

    def note(self, response: Response[Any]) -> Response[Any]:
        throttle_ms = getattr(response.header, "throttle_time_ms", 0)
        if throttle_ms > 0:
            now = trio.current_time()
            until = now + throttle_ms / 1000
            self.until[response.opcode] = max(self.until.get(response.opcode, 0.0), until)
            grown = until - max(self.held_until, now)
            if grown > 0:
                self.held_until = until
                for call in self._calls.values():
                    call.deadline += grown
        return response


class Responses:
    """The frames of one streamed response, up to RESPONSE_END (a plain
    iterator: leaving the loop early leaves no generator to finalize)."""

    __slots__ = ("_call", "_done", "_peer", "_throttles")

    def __init__(self, call: Call, peer: str, throttles: Throttles) -> None:
        self._call, self._peer, self._done = call, peer, False
        self._throttles = throttles

    def __aiter__(self) -> Responses:
        return self

    async def __anext__(self) -> Response[Any]:
        if self._done:
            raise StopAsyncIteration
        frame = await self._call.next_frame()
        self._done = frame.is_end
        return self._throttles.note(to_response(self._call.opcode, frame, self._peer))


def to_response(opcode: Opcode, frame: Frame, peer: str) -> Response[Any]:
    return Response(opcode, decode_response(opcode, frame, peer), frame.payload)


def deadline_after(timeout: float | None) -> float:
    return math.inf if timeout is None else trio.current_time() + timeout


M = TypeVar("M")


def header_as(response: Response[Any], expected: type[M]) -> M:
    """A response's header, checked to be of ``expected`` (typed for the caller)."""
    header = response.header
    if not isinstance(header, expected):
        raise HeaderDecodeError(
            f"{response.opcode.name} answered with {type(header).__name__}, not {expected.__name__}"
        )
    return header


class CallHost(Protocol):
    """What a ``Caller`` needs of its connection."""

    @property
    def peer(self) -> str: ...

    @property
    def engine(self) -> ConnectionEngine: ...

    def check_open(self) -> None: ...

    def wake_writer(self) -> None: ...

    async def wait_room(self) -> None: ...

    def start_task(self, fn: Callable[[], Awaitable[None]]) -> None: ...

    def after_request(self) -> None: ...


class Caller:
    """The requests one connection sends and the answers it matches to them."""

    def __init__(self, host: CallHost) -> None:
        self._host = host
        self.calls: dict[int, Call] = {}
        #: our PINGs in flight: keepalive traffic keeps nothing busy
        self.pings = 0
        #: what servers' throttle_time_ms asked of this connection (SPEC §12)
        self.throttles = Throttles(self.calls)
        #: when ``_expire_calls`` wakes next (the earliest deadline it knew
        #: of); infinite when the task is not running
        self._next_expiry = math.inf
        self._earlier_deadline = trio.lowlevel.ParkingLot()

    async def _expire_calls(self) -> None:
        """Fail each call whose deadline passed (a task of the connection's,
        started by a call with a deadline, ended once none is left).

        One task for all of them, waking at the earliest deadline, rather
        than a cancel scope around each wait: that cost a client ~10 % of
        its CPU per request. It scans the calls in flight once per wake,
        which is about once per timeout when calls end in time; an idle
        connection has no such task (it would cost ~4 KiB)."""
        while True:
            now = trio.current_time()
            earliest = math.inf
            for call in self.calls.values():
                if call.deadline <= now:
                    call.expire()
                elif call.deadline < earliest:
                    earliest = call.deadline
            self._next_expiry = earliest
            if earliest == math.inf:
                return
            with trio.move_on_at(earliest):
                await self._earlier_deadline.park()

    def fail_all(self, error: BaseException) -> None:
        for call in self.calls.values():
            call.fail(error)

    async def request(
        self,
        opcode: Opcode,
        header: messages.Message | bytes | None = None,
        payload: bytes | memoryview = b"",
        *,
        timeout: float | None = None,
    ) -> Response[Any]:
        """Send a request and wait for its whole response sequence.

        A SYSTEM_ERROR answer raises the ``ProtocolError`` of its code; the
        deadline raises ``RequestTimeoutError``. A timed-out or cancelled
        request is abandoned: its late frames are dropped, nothing else is hurt.
        """
        deadline = deadline_after(timeout)
        call = await self.open_call(opcode, header, payload, deadline)
        try:
            peer, throttles = self._host.peer, self.throttles
            parts = [throttles.note(to_response(opcode, await call.next_frame(), peer))]
            while not call.ended or call.frames:
                frame = await call.next_frame()
                parts.append(throttles.note(to_response(opcode, frame, peer)))
            if len(parts) == 1:
                return parts[0]
            payload = b"".join(part.payload for part in parts)
            return Response(opcode, parts[-1].header, payload, len(parts), tuple(parts))
        finally:
            self.close_call(call)

    @asynccontextmanager
    async def stream(
        self,
        opcode: Opcode,
        header: messages.Message | bytes | None = None,
        payload: bytes | memoryview = b"",
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[AsyncIterator[Response[Any]]]:
        """Send a request answered in several frames; iterate over them as
        they arrive, up to RESPONSE_END. Leaving early abandons the request;
        ``timeout`` bounds the whole sequence."""
        deadline = deadline_after(timeout)
        call = await self.open_call(opcode, header, payload, deadline)
        try:
            yield Responses(call, self._host.peer, self.throttles)
        finally:
            self.close_call(call)

    async def ping(self, *, timeout: float | None = None) -> float:
        """Round trip of a PING, in seconds."""
        started = trio.current_time()
        await self.request(Opcode.PING, timeout=timeout)
        return trio.current_time() - started

    async def open_call(
        self,
        opcode: Opcode,
        header: messages.Message | bytes | None,
        payload: bytes | memoryview,
        deadline: float,
        *,
        after_goaway: bool = False,
    ) -> Call:
        host = self._host
        engine = host.engine
        host.check_open()
        if not after_goaway:
            engine.check_can_request()
        throttled_until = self.throttles.until.get(opcode, 0.0)
        now = trio.current_time()
        if throttled_until > now:
            # The server asked for this wait (and reads nothing from us
            # meanwhile): the request's own time starts after it.
            await trio.sleep_until(min(throttled_until, now + MAX_THROTTLE_WAIT_S))
            deadline += trio.current_time() - now
            host.check_open()
        encoded = header.encode() if isinstance(header, messages.Message) else bytes(header or b"")
        if engine.outgoing_bytes > engine.high_water:
            with trio.move_on_at(deadline):
                await host.wait_room()
            host.check_open()
            if engine.outgoing_bytes > engine.high_water:
                raise RequestTimeoutError(f"{opcode.name} could not be sent before the deadline")
        stream_id = engine.send_request(opcode, encoded, payload, after_goaway=after_goaway)
        call = self.calls[stream_id] = Call(opcode, stream_id, deadline)
        if deadline < self._next_expiry:
            if self._next_expiry == math.inf:
                host.start_task(self._expire_calls)
            else:
                self._earlier_deadline.unpark_all()
            self._next_expiry = deadline
        self.pings += opcode == Opcode.PING
        host.wake_writer()
        return call

    def close_call(self, call: Call) -> None:
        if self.calls.pop(call.stream_id, None) is None:
            return
        self.pings -= call.opcode == Opcode.PING
        if call.ended:
            self._host.engine.forget(call.stream_id)
        else:  # cancelled, timed out or left early: late frames are dropped
            self._host.engine.abandon(call.stream_id)
        self._host.after_request()

    async def keepalive_ping(self, timeout: float) -> bool:
        """A PING that may go out after the peer's GOAWAY; False when it got
        no answer within ``timeout``."""
        call = await self.open_call(
            Opcode.PING, None, b"", deadline_after(timeout), after_goaway=True
        )
        try:
            await call.next_frame()
        except RequestTimeoutError:
            return False
        finally:
            self.close_call(call)
        return True
