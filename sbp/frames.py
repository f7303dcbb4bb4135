"""The SBP frame codec (SPEC §1), sans-IO.

``encode_frame`` builds the bytes of one frame. ``FrameDecoder`` is fed
arbitrary chunks of a byte stream and returns one event per frame:

========================  =====================================================
event                     what the receiver does
========================  =====================================================
``Frame``                 a well-formed frame with a known opcode: handle it
``DiscardedFrame``        bad magic or unknown opcode: drop it, count it
``RejectedFrame``         bad header format, a header longer than the frame, or
                          a checksum mismatch: answer with a SYSTEM_ERROR
                          response carrying ``error_code`` (unless the frame was
                          itself a response), apply nothing
``FatalFrameError``       frame_length out of bounds: the stream cannot be
                          resynchronised; send GOAWAY with ``error_code`` and
                          close. The decoder accepts nothing after it.
========================  =====================================================

The length limit is checked as soon as the 4-byte length is in, before any of
the body is buffered, so a peer cannot make a receiver hold more than one
frame of at most ``max_frame_length`` bytes. A socket reader can read
straight into the decoder's buffer (``receive_buffer``, then ``received``)
instead of handing it chunks; room is made a read at a time (at most
``MAX_READ_SIZE`` ahead of what has arrived), never for a whole announced
frame at once, until its first ``MAX_READ_SIZE`` are in or the peer already
sent a frame as large: then room for all the rest at once, so the frame is
copied once at most and its buffer is its size. ``growth`` says how much
the next room takes, before it is made, for a caller that must ask a
budget first. Between frames the
decoder keeps one read's worth of buffer (or, after a frame of up to two
reads' worth, a buffer of that frame's size, which the next one as large
arrives in without growing), so an idle connection holds little;
the buffers of large frames handed over go to a process-wide pool
(``sbp.allocator.RECEIVE_BUFFERS``) and receive a later large frame once
nothing refers to them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

# The same CRC-32 as zlib.crc32 (SPEC §1), but zlib-ng's folds with carry-less
# multiplication, many times faster on large payloads than the stdlib's zlib,
# which matters because every payload is summed once by each side.
from zlib_ng.zlib_ng import crc32

from .allocator import RECEIVE_BUFFERS
from .constants import (
    CHECKSUM,
    CHECKSUM_SIZE,
    DEFAULT_MAX_FRAME_LENGTH,
    FIXED_HEADER,
    FIXED_HEADER_SIZE,
    FRAME_OVERHEAD,
    HEADER_FORMAT_FLATBUFFERS,
    HEADER_PRELUDE,
    LENGTH_FIELD_SIZE,
    MAGIC,
    MAX_HEADER_LENGTH,
    MAX_STREAM_ID,
    MIN_FRAME_LENGTH,
)
from .enums import KNOWN_FLAGS, KNOWN_OPCODES, ErrorCode, Flags
from .errors import FrameTooLargeError

#: any bytes-like buffer a frame, a payload or a record batch may come in
Buffer: TypeAlias = bytes | bytearray | memoryview

#: offset of the header within a whole frame
_HEADER_START = FIXED_HEADER_SIZE + HEADER_PRELUDE.size  # 16
_LENGTH = CHECKSUM  # a big-endian uint32, like the checksum
# Flag tests run several times per frame: plain ints and a table of the eight
# Flags values avoid IntFlag's Python-level operators, which cost a call per use.
_RESPONSE = int(Flags.RESPONSE)
_RESPONSE_END = int(Flags.RESPONSE_END)
_SYSTEM_ERROR = int(Flags.SYSTEM_ERROR)
_FLAG_MASK = int(KNOWN_FLAGS)
_FLAGS_BY_VALUE = tuple(Flags(value) for value in range(_FLAG_MASK + 1))


@dataclass(frozen=True, slots=True)
class Frame:
    """One well-formed frame. ``header`` is the raw FlatBuffers table (empty
    when the frame has none); ``payload`` is a view into the received bytes,
    so that large payloads are not copied again on their way to storage."""

    opcode: int
    flags: Flags
    stream_id: int
    header: bytes = b""
    payload: bytes | memoryview = b""

    @property
    def is_response(self) -> bool:
        return bool(int(self.flags) & _RESPONSE)

    @property
    def is_end(self) -> bool:
        return bool(int(self.flags) & _RESPONSE_END)

    @property
    def is_system_error(self) -> bool:
        return bool(int(self.flags) & _SYSTEM_ERROR)

    def encode(self) -> bytes:
        return encode_frame(self.opcode, self.flags, self.stream_id, self.header, self.payload)


class DiscardReason(enum.Enum):
    BAD_MAGIC = "bad_magic"
    UNKNOWN_OPCODE = "unknown_opcode"


@dataclass(frozen=True, slots=True)
class DiscardedFrame:
    """A frame skipped whole: count it, keep the connection."""

    reason: DiscardReason
    opcode: int
    stream_id: int
    frame_length: int


@dataclass(frozen=True, slots=True)
class RejectedFrame:
    """A frame that gets a SYSTEM_ERROR answer and is otherwise not applied."""

    opcode: int
    flags: Flags
    stream_id: int
    error_code: ErrorCode
    message: str

    @property
    def is_response(self) -> bool:
        return bool(int(self.flags) & _RESPONSE)


@dataclass(frozen=True, slots=True)
class FatalFrameError:
    """The byte stream cannot be resynchronised: GOAWAY (when possible), close."""

    error_code: ErrorCode
    message: str


FrameEvent = Frame | DiscardedFrame | RejectedFrame | FatalFrameError


def encode_frame(
    opcode: int,
    flags: int,
    stream_id: int,
    header: Buffer = b"",
    payload: Buffer = b"",
) -> bytes:
    """The wire bytes of one frame (header_format FlatBuffers)."""
    return b"".join(frame_pieces(opcode, flags, stream_id, header, payload))


def frame_pieces(
    opcode: int,
    flags: int,
    stream_id: int,
    header: Buffer = b"",
    payload: Buffer = b"",
) -> tuple[bytes, Buffer, bytes]:
    """One frame as (fixed header and extended header, payload, checksum),
    whose concatenation is ``encode_frame``'s answer: a large payload can
    then be written with the rest (``sendmsg``) without being copied."""
    payload_length = len(payload)
    head = _frame_head(opcode, flags, stream_id, header, payload_length)
    checksum = crc32(payload) if payload_length else 0
    return head, payload, CHECKSUM.pack(checksum)


def gathered_frame_pieces(
    opcode: int,
    flags: int,
    stream_id: int,
    header: Buffer,
    payload: Sequence[Buffer],
) -> list[Buffer]:
    """``frame_pieces`` for a payload held in several buffers (whole record
    batches where they are stored): the head, every payload buffer as it
    is, then the checksum of them all."""
    checksum = 0
    payload_length = 0
    for piece in payload:
        checksum = crc32(piece, checksum)
        payload_length += len(piece)
    head = _frame_head(opcode, flags, stream_id, header, payload_length)
    return [head, *payload, CHECKSUM.pack(checksum)]


def _frame_head(
    opcode: int, flags: int, stream_id: int, header: Buffer, payload_length: int
) -> bytes:
    """The fixed header and the extended header of a frame."""
    header_length = len(header)
    if header_length > MAX_HEADER_LENGTH:
        raise FrameTooLargeError(
            f"a header of {header_length:,} bytes is over the {MAX_HEADER_LENGTH:,} a frame "
            "carries: ask for fewer items at a time"
        )
    if not 0 <= stream_id <= MAX_STREAM_ID:
        raise ValueError(f"stream id {stream_id} out of range")
    frame_length = MIN_FRAME_LENGTH + header_length + payload_length
    return b"".join(
        (
            FIXED_HEADER.pack(frame_length, MAGIC, opcode, flags, stream_id),
            HEADER_PRELUDE.pack((HEADER_FORMAT_FLATBUFFERS << 24) | header_length),
            header,
        )
    )


#: bytes a receive buffer offers a read when no large frame is under way
READ_SIZE: Final = 64 * 1024
#: what a new connection's first read is offered; each read that fills what
#: it was offered doubles it, up to ``READ_SIZE`` (as Netty's adaptive
#: receive buffers), so a busy connection reads 64 KiB at a time and one
#: that only ever sends small requests reads 4 KiB
MIN_READ_SIZE: Final = 4 * 1024
#: a frame whose rest is larger than a read is read straight to its end, in a
#: buffer of its own, up to this much per read (a peer that announces a huge
#: frame and sends nothing more does not make the receiver allocate it)
MAX_READ_SIZE: Final = 1024 * 1024
#: frames larger than this are read exactly to their end
_LARGE_FRAME: Final = READ_SIZE // 4


class FrameDecoder:
    """Incremental decoder: ``feed`` chunks, get back the events of every
    frame completed so far; a partial frame stays buffered.

    A socket reader can skip the copy ``feed`` makes: read into
    ``receive_buffer()`` (``recv_into``, ``readv``), then call ``received(nbytes)``.
    """

    def __init__(self, max_frame_length: int = DEFAULT_MAX_FRAME_LENGTH) -> None:
        if max_frame_length < MIN_FRAME_LENGTH:
            raise ValueError(f"max_frame_length must be at least {MIN_FRAME_LENGTH}")
        self.max_frame_length = max_frame_length
        # the received bytes are _buffer[:_filled]; the rest is room for reads
        self._buffer = bytearray()
        self._filled = 0
        self._failed = False
        #: the view receive_buffer handed out: a bytearray with a live view
        #: cannot be resized, so it is released before anything else
        self._view: memoryview | None = None
        #: the size of the last frame larger than a read: a frame no larger
        #: gets room for all of it at once, so it is not copied while growing
        self._large_frame = 0
        #: what the next read between frames is offered (see MIN_READ_SIZE)
        self._read_size = MIN_READ_SIZE

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a returned event."""
        return self._filled

    @property
    def holding(self) -> int:
        """Bytes of memory held for a frame not yet whole (0 between frames)."""
        return len(self._buffer) if self._filled else 0

    @property
    def failed(self) -> bool:
        """True once a FatalFrameError was returned; nothing more is decoded."""
        return self._failed

    def feed(self, data: bytes | bytearray | memoryview) -> list[FrameEvent]:
        self._release_view()
        if self._failed:
            return []
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        self._make_room(size)
        self._buffer[self._filled : self._filled + size] = data
        self._filled += size
        return self._frames()

    def receive_buffer(self) -> memoryview:
        """Where the next bytes read from the stream go; then ``received``.

        Up to a read's worth (``MIN_READ_SIZE`` growing to ``READ_SIZE`` while
        reads fill it) while the next frame's length is
        unknown or the frame is small; once a large frame's length is in,
        exactly the rest of it (at most ``MAX_READ_SIZE`` at a time, or all
        of it when a frame as large was received before), so a large frame
        arrives in a buffer of its own and is handed over with no copy, and
        no read reaches past it into the next frame.
        """
        self._release_view()
        filled = self._filled
        size = self._next_read_size()
        self._make_room(size)
        view = self._view = memoryview(self._buffer)[filled : filled + size]
        return view

    def growth(self) -> int:
        """How much ``holding`` grows when ``receive_buffer`` makes room for
        the next read (0 between frames: a read's worth is not a frame's)."""
        if not self._filled:
            return 0
        return max(0, self._room_for(self._next_read_size()) - len(self._buffer))

    def _next_read_size(self) -> int:
        filled = self._filled
        size = self._read_size
        if filled < LENGTH_FIELD_SIZE and size < self._large_frame <= 2 * READ_SIZE:
            # between frames of a peer sending frames just over a read (64 KiB
            # batches): room for all of the next one as large, so it takes
            # one read, not a read and then its last few bytes
            size = self._large_frame - filled
        if filled >= LENGTH_FIELD_SIZE and not self._failed:
            (frame_length,) = _LENGTH.unpack_from(self._buffer, 0)
            total = frame_length + LENGTH_FIELD_SIZE
            if total > _LARGE_FRAME and frame_length <= self.max_frame_length:
                if total <= self._large_frame or filled >= MAX_READ_SIZE:
                    # as large as one already received, or this one's first
                    # MAX_READ_SIZE are in: room for the rest at once, so the
                    # frame is copied once at most, into a buffer of its size
                    size = total - filled
                else:
                    size = min(total - filled, MAX_READ_SIZE)
        return size

    def received(self, nbytes: int) -> list[FrameEvent]:
        """``nbytes`` were read into the last ``receive_buffer()``."""
        view = self._view
        if view is not None and nbytes == view.nbytes and nbytes == self._read_size:
            self._read_size = min(2 * nbytes, READ_SIZE)  # a full read: offer more
        self._release_view()
        if self._failed:
            return []
        self._filled += nbytes
        return self._frames()

    def release(self) -> None:
        """Let go of the buffer at once (the connection is over): a large
        half-received frame's memory is not left to the cyclic garbage
        collector, which an idle process may not run for a long time."""
        self._release_view()
        self._buffer = bytearray()
        self._filled = 0

    def _release_view(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None

    def _room_for(self, size: int) -> int:
        """The buffer's size once it has room for ``size`` more bytes."""
        buffer = self._buffer
        needed = self._filled + size
        if len(buffer) >= needed:
            return len(buffer)
        if self._filled == 0:
            return needed
        # geometric growth: a small frame read in pieces is copied a bounded
        # number of times, not once per piece (a large one gets its size)
        return max(needed, 2 * len(buffer))

    def _make_room(self, size: int) -> None:
        """Room for ``size`` more bytes after the received ones."""
        buffer = self._buffer
        filled = self._filled
        wanted = self._room_for(size)
        if len(buffer) >= wanted:
            return
        if filled == 0:
            self._buffer = bytearray(wanted)
            return
        grown = RECEIVE_BUFFERS.take(wanted) if wanted > READ_SIZE else None
        if grown is None:
            grown = bytearray(wanted)
        with memoryview(buffer) as view:
            grown[:filled] = view[:filled]
        self._buffer = grown

    def _frames(self) -> list[FrameEvent]:
        """The events of the whole frames received, removed from the buffer."""
        buffer = self._buffer
        filled = self._filled
        start = 0
        events: list[FrameEvent] = []
        while filled - start >= LENGTH_FIELD_SIZE:
            (frame_length,) = _LENGTH.unpack_from(buffer, start)
            if frame_length < MIN_FRAME_LENGTH or frame_length > self.max_frame_length:
                events.append(self._fail(frame_length))
                return events
            total = frame_length + LENGTH_FIELD_SIZE
            if filled - start < total:
                break
            raw: bytes | bytearray
            if start == 0 and filled - total < total:
                # The frame is most of what was received: hand the buffer
                # itself over and keep a copy of the (smaller) rest, so a
                # large payload is never copied out of the receive buffer.
                if total > READ_SIZE:
                    self._large_frame = total
                    RECEIVE_BUFFERS.keep(buffer)
                raw = buffer
                filled -= total
                buffer = self._buffer = self._next_buffer(filled)
                with memoryview(raw) as view:
                    buffer[:filled] = view[total : total + filled]
                del raw[total:]
            else:
                # One copy of a small frame.
                with memoryview(buffer) as view:
                    raw = bytes(view[start : start + total])
                start += total
            events.append(_decode_whole_frame(raw))
        if start:
            # from the front of a bytearray: O(1), its start just moves
            del buffer[:start]
            filled -= start
        self._filled = filled
        return events

    def _next_buffer(self, filled: int) -> bytearray:
        """The buffer after one handed over, for the ``filled`` bytes of the
        next frame received with it: room for a read, or for all of a frame
        as large as the last large one when that is little more than a read
        (a peer sending 64 KiB batches sends frames just over READ_SIZE: each
        then arrives in a buffer of its size, not grown and copied), taken
        from the pool when one there is free (no zeroing)."""
        size = max(filled, self._read_size)
        if size < self._large_frame <= 2 * READ_SIZE:
            size = self._large_frame
        buffer = RECEIVE_BUFFERS.take(size) if size > READ_SIZE else None
        return buffer if buffer is not None else bytearray(size)

    def _fail(self, frame_length: int) -> FatalFrameError:
        self._failed = True
        self._buffer = bytearray()
        self._filled = 0
        if frame_length > self.max_frame_length:
            foreign = _foreign_protocol(frame_length)
            return FatalFrameError(
                ErrorCode.FRAME_TOO_LARGE,
                f"that address does not speak SBP ({foreign})"
                if foreign
                else f"frame_length {frame_length} exceeds the limit of {self.max_frame_length}",
            )
        return FatalFrameError(
            ErrorCode.INVALID_REQUEST,
            f"frame_length {frame_length} is below the minimum of {MIN_FRAME_LENGTH}",
        )


def _decode_whole_frame(raw: bytes | bytearray) -> FrameEvent:
    """Classify one complete frame (``raw`` includes the length field; the
    payload of a good frame is a view into it, so nothing may change it)."""
    frame_length, magic, opcode, flags_value, stream_id = FIXED_HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        return DiscardedFrame(DiscardReason.BAD_MAGIC, opcode, stream_id, frame_length)
    if opcode not in KNOWN_OPCODES:
        return DiscardedFrame(DiscardReason.UNKNOWN_OPCODE, opcode, stream_id, frame_length)
    flags = _FLAGS_BY_VALUE[flags_value & _FLAG_MASK]
    (prelude,) = HEADER_PRELUDE.unpack_from(raw, FIXED_HEADER_SIZE)
    header_format = prelude >> 24
    header_length = prelude & 0xFFFFFF
    if header_format != HEADER_FORMAT_FLATBUFFERS:
        return RejectedFrame(
            opcode,
            flags,
            stream_id,
            ErrorCode.INVALID_REQUEST,
            f"unsupported header_format 0x{header_format:02x}",
        )
    payload_end = len(raw) - CHECKSUM_SIZE
    payload_start = _HEADER_START + header_length
    if payload_start > payload_end:
        return RejectedFrame(
            opcode,
            flags,
            stream_id,
            ErrorCode.INVALID_REQUEST,
            f"header_length {header_length} exceeds the frame "
            f"({frame_length + LENGTH_FIELD_SIZE - FRAME_OVERHEAD} bytes for header and payload)",
        )
    view = memoryview(raw)
    payload = view[payload_start:payload_end]
    (checksum,) = CHECKSUM.unpack_from(raw, payload_end)
    actual = crc32(payload) if len(payload) else 0
    if actual != checksum:
        return RejectedFrame(
            opcode,
            flags,
            stream_id,
            ErrorCode.CHECKSUM_MISMATCH,
            f"payload checksum 0x{actual:08x} does not match 0x{checksum:08x}",
        )
    header = view[_HEADER_START:payload_start].tobytes()
    return Frame(opcode, flags, stream_id, header, payload)


def decode_frame(data: bytes | bytearray | memoryview) -> FrameEvent:
    """Decode exactly one whole frame (for tests and tools)."""
    events = FrameDecoder(max_frame_length=max(len(data), MIN_FRAME_LENGTH)).feed(data)
    if len(events) != 1:
        raise ValueError(f"expected exactly one frame, got {len(events)} events")
    return events[0]


#: what the first four bytes of other protocols read as a frame_length say
_FOREIGN_STARTS: Final = (
    (b"HTTP", "it answered HTTP"),
    # an HTTP server answering a request line without a version (HTTP/0.9
    # style, as Python's http.server and so the /metrics ports do): a page
    (b"<!DO", "it answered HTTP"),
    (b"<!do", "it answered HTTP"),
    (b"<htm", "it answered HTTP"),
    (b"<HTM", "it answered HTTP"),
    (b"GET ", "it sent an HTTP request"),
    (b"POST", "it sent an HTTP request"),
    (b"PUT ", "it sent an HTTP request"),
    (b"HEAD", "it sent an HTTP request"),
    (b"SSH-", "it answered SSH"),
)


def _foreign_protocol(frame_length: int) -> str:
    """What a frame length too large to be SBP's says of the peer: another
    protocol's first bytes ("" when they are none that is known)."""
    start = frame_length.to_bytes(4, "big")
    for prefix, what in _FOREIGN_STARTS:
        if start == prefix:
            return what
    if start[0] == 0x16 and start[1] == 0x03:  # a TLS handshake record
        return "it speaks TLS"
    return ""
