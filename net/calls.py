"""Requests of ours on a connection: the ``Response`` they get, and the
``Call`` each waits on while its frames arrive (one consumer per call)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import trio

from sbp.connection import decode_response
from sbp.enums import Opcode
from sbp.errors import HeaderDecodeError, RequestTimeoutError
from sbp.frames import Frame

H = TypeVar("H")


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
    """A request of ours awaiting its response frames (one consumer)."""

    __slots__ = ("_wakeup", "ended", "error", "frames", "opcode", "stream_id")

    def __init__(self, opcode: Opcode, stream_id: int) -> None:
        self.opcode = opcode
        self.stream_id = stream_id
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
            if deadline == math.inf:  # a cancel scope costs µs: only for real deadlines
                await self._wakeup.wait()
                continue
            with trio.move_on_at(deadline):
                await self._wakeup.wait()
                continue
            raise RequestTimeoutError(f"no response to {self.opcode.name} before the deadline")


class Responses:
    """The frames of one streamed response, up to RESPONSE_END (a plain
    iterator: leaving the loop early leaves no generator to finalize)."""

    __slots__ = ("_call", "_deadline", "_done", "_peer")

    def __init__(self, call: Call, deadline: float, peer: str) -> None:
        self._call, self._deadline, self._peer, self._done = call, deadline, peer, False

    def __aiter__(self) -> Responses:
        return self

    async def __anext__(self) -> Response[Any]:
        if self._done:
            raise StopAsyncIteration
        frame = await self._call.next_frame(self._deadline)
        self._done = frame.is_end
        return to_response(self._call.opcode, frame, self._peer)


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
