"""sbp.frames: golden bytes, every decoder event, and properties (chunking
never changes the events; corruption yields only typed events)."""

from __future__ import annotations

import itertools
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbp.constants import FIXED_HEADER_SIZE, MAX_HEADER_LENGTH, MIN_FRAME_LENGTH
from sbp.enums import ErrorCode, Flags, Opcode
from sbp.errors import FrameTooLargeError
from sbp.frames import (
    MAX_READ_SIZE,
    MIN_READ_SIZE,
    READ_SIZE,
    DiscardedFrame,
    DiscardReason,
    FatalFrameError,
    Frame,
    FrameDecoder,
    FrameEvent,
    RejectedFrame,
    decode_frame,
    encode_frame,
    gathered_frame_pieces,
)

EVENT_TYPES = (Frame, DiscardedFrame, RejectedFrame, FatalFrameError)


def test_golden_empty_ping() -> None:
    # frame_length 16, magic 23, opcode 1, flags 0, stream 0, format 1, length 0, crc 0
    expected = bytes.fromhex("0000001017000100000000000100000000000000")
    assert encode_frame(Opcode.PING, Flags.NONE, 0) == expected
    assert decode_frame(expected) == Frame(Opcode.PING, Flags.NONE, 0, b"", b"")


def test_golden_frame_with_header_and_payload() -> None:
    data = encode_frame(
        Opcode.APPEND, Flags.RESPONSE | Flags.RESPONSE_END, 0x01020304, b"HDR", b"pay"
    )
    crc = zlib.crc32(b"pay")
    assert data == (
        struct.pack(">IBHBI", 16 + 3 + 3, 23, 0x1001, 0x03, 0x01020304)
        + bytes([0x01, 0, 0, 3])
        + b"HDR"
        + b"pay"
        + struct.pack(">I", crc)
    )
    frame = decode_frame(data)
    assert isinstance(frame, Frame)
    assert (frame.opcode, frame.stream_id, frame.header, bytes(frame.payload)) == (
        Opcode.APPEND,
        0x01020304,
        b"HDR",
        b"pay",
    )
    assert frame.is_response and frame.is_end and not frame.is_system_error
    assert frame.encode() == data


def test_unknown_flag_bits_are_ignored() -> None:
    data = bytearray(encode_frame(Opcode.PING, Flags.NONE, 1))
    data[7] = 0xF8 | Flags.RESPONSE
    frame = decode_frame(bytes(data))
    assert isinstance(frame, Frame) and frame.flags == Flags.RESPONSE


def test_encode_rejects_what_the_wire_cannot_carry() -> None:
    with pytest.raises(ValueError, match="stream id"):
        encode_frame(Opcode.PING, 0, 1 << 32)
    with pytest.raises(ValueError, match="stream id"):
        encode_frame(Opcode.PING, 0, -1)
    with pytest.raises(FrameTooLargeError, match="is over the 16,777,215 a frame carries"):
        encode_frame(Opcode.PING, 0, 0, bytes(MAX_HEADER_LENGTH + 1))


def test_bad_magic_is_discarded_whole() -> None:
    data = bytearray(encode_frame(Opcode.FETCH, Flags.NONE, 9, b"h", b"p"))
    data[4] = 99
    decoder = FrameDecoder()
    assert decoder.feed(bytes(data) + encode_frame(Opcode.PING, 0, 1)) == [
        DiscardedFrame(DiscardReason.BAD_MAGIC, Opcode.FETCH, 9, 18),
        Frame(Opcode.PING, Flags.NONE, 1, b"", b""),
    ]


def test_unknown_opcode_is_discarded() -> None:
    event = decode_frame(encode_frame(0x7777, Flags.NONE, 3, b"h", b"p"))
    assert event == DiscardedFrame(DiscardReason.UNKNOWN_OPCODE, 0x7777, 3, 18)


def test_header_format_other_than_flatbuffers_is_rejected() -> None:
    data = bytearray(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 3, b"h"))
    data[FIXED_HEADER_SIZE] = 2
    event = decode_frame(bytes(data))
    assert isinstance(event, RejectedFrame)
    assert (event.opcode, event.stream_id, event.error_code) == (
        Opcode.HEARTBEAT,
        3,
        ErrorCode.INVALID_REQUEST,
    )
    assert "header_format 0x02" in event.message and not event.is_response


def test_header_longer_than_the_frame_is_rejected() -> None:
    data = bytearray(encode_frame(Opcode.HEARTBEAT, Flags.RESPONSE, 3, b"hh", b"p"))
    data[FIXED_HEADER_SIZE + 3] = 200
    event = decode_frame(bytes(data))
    assert isinstance(event, RejectedFrame) and event.error_code == ErrorCode.INVALID_REQUEST
    assert event.is_response


@pytest.mark.parametrize("payload", [b"", b"payload"])
def test_checksum_mismatch_is_rejected(payload: bytes) -> None:
    data = bytearray(encode_frame(Opcode.APPEND, Flags.NONE, 3, b"h", payload))
    data[-1] ^= 1
    event = decode_frame(bytes(data))
    assert isinstance(event, RejectedFrame)
    assert event.error_code == ErrorCode.CHECKSUM_MISMATCH


@settings(max_examples=50)
@given(st.binary(min_size=1, max_size=200_000))
def test_checksum_is_zlibs_crc32(payload: bytes) -> None:
    """SPEC §1 names zlib.crc32; the faster implementation must agree with it."""
    encoded = encode_frame(Opcode.APPEND, Flags.NONE, 3, b"h", payload)
    assert struct.unpack(">I", encoded[-4:])[0] == zlib.crc32(payload)
    assert isinstance(decode_frame(encoded), Frame)


def test_frame_length_too_small_is_fatal() -> None:
    decoder = FrameDecoder()
    events = decoder.feed(struct.pack(">I", MIN_FRAME_LENGTH - 1) + bytes(40))
    assert len(events) == 1 and isinstance(events[0], FatalFrameError)
    assert events[0].error_code == ErrorCode.INVALID_REQUEST
    assert decoder.failed and decoder.buffered == 0
    assert decoder.feed(encode_frame(Opcode.PING, 0, 1)) == []


def test_frame_length_too_large_is_fatal_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame_length=1024)
    assert decoder.feed(b"\x00\x00") == []
    events = decoder.feed(struct.pack(">H", 1025))
    assert events == [
        FatalFrameError(ErrorCode.FRAME_TOO_LARGE, "frame_length 1025 exceeds the limit of 1024")
    ]
    assert decoder.buffered == 0


def test_frame_at_the_limit_is_accepted() -> None:
    payload = bytes(1024 - MIN_FRAME_LENGTH)
    decoder = FrameDecoder(max_frame_length=1024)
    (frame,) = decoder.feed(encode_frame(Opcode.APPEND, 0, 1, b"", payload))
    assert isinstance(frame, Frame) and len(frame.payload) == len(payload)


def test_partial_frames_stay_buffered() -> None:
    data = encode_frame(Opcode.PING, 0, 1, b"abc", b"defg")
    decoder = FrameDecoder()
    assert decoder.feed(data[:-1]) == []
    assert decoder.buffered == len(data) - 1
    assert len(decoder.feed(data[-1:])) == 1
    assert decoder.buffered == 0


def test_decoder_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="at least"):
        FrameDecoder(max_frame_length=MIN_FRAME_LENGTH - 1)
    with pytest.raises(ValueError, match="exactly one frame"):
        decode_frame(encode_frame(Opcode.PING, 0, 1) * 2)


# -- properties ---------------------------------------------------------------------

opcodes = st.sampled_from([int(op) for op in Opcode] + [0x7777])
frames = st.builds(
    encode_frame,
    opcodes,
    st.sampled_from([0, 1, 3, 7]),
    st.integers(0, (1 << 32) - 1),
    st.binary(max_size=40),
    st.binary(max_size=200),
)


def feed_in_chunks(data: bytes, cuts: list[int], max_frame_length: int = 4096) -> list[FrameEvent]:
    decoder = FrameDecoder(max_frame_length)
    events: list[FrameEvent] = []
    start = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        events += decoder.feed(data[start:cut])
        start = cut
    return events


def receive_in_reads(
    data: bytes, reads: list[int], max_frame_length: int = 4096
) -> list[FrameEvent]:
    """What a socket reader gets: each read fills up to ``reads[i]`` bytes of
    the decoder's receive buffer (and at least one, as a socket would)."""
    decoder = FrameDecoder(max_frame_length)
    events: list[FrameEvent] = []
    position = 0
    for wanted in itertools.cycle(reads or [len(data)]):
        if position >= len(data) or decoder.failed:
            break
        target = decoder.receive_buffer()
        assert len(target) > 0
        n = max(1, min(wanted, len(target), len(data) - position))
        target[:n] = data[position : position + n]
        position += n
        events += decoder.received(n)
    return events


@given(st.lists(frames, max_size=12), st.lists(st.integers(0, 4000), max_size=30))
def test_chunking_never_changes_the_events(encoded: list[bytes], cuts: list[int]) -> None:
    data = b"".join(encoded)
    whole = FrameDecoder(4096).feed(data)
    assert feed_in_chunks(data, [c for c in cuts if c <= len(data)]) == whole
    assert len(whole) == len(encoded)


@given(
    st.lists(frames, max_size=12),
    st.lists(st.integers(1, 5000), max_size=30),
    st.lists(st.integers(0, 4000), max_size=10),
)
def test_reading_into_the_decoder_gives_the_events_of_feeding_it(
    encoded: list[bytes], reads: list[int], cuts: list[int]
) -> None:
    data = b"".join(encoded)
    whole = FrameDecoder(4096).feed(data)
    assert receive_in_reads(data, reads) == whole
    # the two ways mix: feed some, read the rest
    decoder = FrameDecoder(4096)
    cut = min(cuts, default=0) if cuts else 0
    events = decoder.feed(data[:cut])
    target = decoder.receive_buffer()
    while cut < len(data):
        n = min(len(target), len(data) - cut)
        target[:n] = data[cut : cut + n]
        cut += n
        events += decoder.received(n)
        target = decoder.receive_buffer()
    assert events == whole


large_frames = st.builds(
    encode_frame,
    st.just(int(Opcode.APPEND)),
    st.just(0),
    st.integers(0, 1000),
    st.binary(max_size=40),
    st.integers(0, 150_000).map(lambda n: bytes(n % 251 for _ in range(1)) * n),
)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.one_of(frames, large_frames), max_size=6),
    st.lists(st.integers(1, 200_000), max_size=20),
)
def test_large_frames_read_in_any_pieces_give_the_events_of_feeding_them(
    encoded: list[bytes], reads: list[int]
) -> None:
    data = b"".join(encoded)
    whole = FrameDecoder(1 << 20).feed(data)
    assert len(whole) == len(encoded)
    assert receive_in_reads(data, reads, 1 << 20) == whole


def test_a_large_frame_is_read_into_a_buffer_of_its_own_and_handed_over() -> None:
    payload = bytes(range(256)) * 1000  # 256,000 bytes: more than a read
    frame = encode_frame(Opcode.APPEND, Flags.NONE, 9, b"h" * 24, payload)
    decoder = FrameDecoder()
    first = decoder.receive_buffer()
    assert len(first) == MIN_READ_SIZE  # a new connection reads a little first
    first[:] = frame[:MIN_READ_SIZE]
    assert decoder.received(MIN_READ_SIZE) == []
    # once its length is known, the reader is offered the rest, a large
    # read at a time
    rest = decoder.receive_buffer()
    assert len(rest) == len(frame) - MIN_READ_SIZE
    rest[:] = frame[MIN_READ_SIZE:]
    (event,) = decoder.received(len(frame) - MIN_READ_SIZE)
    assert isinstance(event, Frame) and event.payload == payload
    assert decoder.buffered == 0
    # the payload is a view of the very buffer that was read into
    assert isinstance(event.payload, memoryview)
    assert memoryview(event.payload.obj).nbytes == len(frame)
    # the next frame as large gets room for all of it once its length is in:
    # its first read is copied once, the rest arrives in one piece in place
    first = decoder.receive_buffer()
    size = len(first)
    assert MIN_READ_SIZE < size <= READ_SIZE  # the full read made the next larger
    first[:] = frame[:size]
    assert decoder.received(size) == []
    rest = decoder.receive_buffer()
    assert len(rest) == len(frame) - size
    buffer = rest.obj
    rest[:] = frame[size:]
    (event,) = decoder.received(len(rest))
    assert isinstance(event, Frame) and isinstance(event.payload, memoryview)
    assert event.payload.obj is buffer and event.payload == payload
    assert decoder.holding == 0


def test_frames_just_over_a_read_arrive_in_one_read_each() -> None:
    # 64 KiB batches make frames a little larger than a read: once one has
    # come, each next one as large is offered in full, not a read and then
    # its last few bytes
    frames = [
        encode_frame(Opcode.APPEND, Flags.NONE, n, b"h" * 40, bytes([n]) * READ_SIZE)
        for n in range(4)
    ]
    decoder = FrameDecoder()
    reads_per_frame = []
    for n, frame in enumerate(frames):
        reads: list[int] = []
        event, buffer = read_frame_in(decoder, frame, reads)
        assert event.payload == bytes([n]) * READ_SIZE
        assert isinstance(event.payload, memoryview) and event.payload.obj is buffer
        reads_per_frame.append(len(reads))
    assert reads_per_frame[1:] == [1, 1, 1]
    assert decoder.holding == 0


def read_frame_in(
    decoder: FrameDecoder, frame: bytes, reads: list[int] | None = None
) -> tuple[Frame, bytearray]:
    """One frame through ``receive_buffer``/``received``; the event and the
    buffer the rest of it was read into (``reads`` gets each read's size)."""
    events: list[FrameEvent] = []
    position = 0
    buffer = None
    while not events:
        target = decoder.receive_buffer()
        buffer = target.obj
        n = min(len(target), len(frame) - position)
        target[:n] = frame[position : position + n]
        position += n
        if reads is not None:
            reads.append(n)
        events = decoder.received(n)
    (event,) = events
    assert isinstance(event, Frame) and isinstance(buffer, bytearray)
    return event, buffer


@pytest.mark.usefixtures("own_buffer_pool")
def test_a_large_frames_buffer_is_read_into_again_once_nothing_refers_to_it() -> None:
    frames = [
        encode_frame(Opcode.FETCH, Flags.RESPONSE, 9, b"h", bytes([i]) * (300_000 - i))
        for i in range(12)
    ]
    decoder = FrameDecoder()
    read_frame_in(decoder, frames[0])  # dropped at once
    event, buffer = read_frame_in(decoder, frames[1])
    del event
    buffer_id = id(buffer)
    del buffer
    # the buffers of dropped frames come back, in place
    reused = 0
    for frame in frames[2:6]:
        event, buffer = read_frame_in(decoder, frame)
        assert event.payload == frame[17:-4]
        reused += id(buffer) == buffer_id
        del event, buffer
    assert reused >= 1
    # a frame whose payload, a view of it or an array made of it is still
    # held keeps its buffer: later frames never write into it
    views: list[tuple[bytes, memoryview]] = []
    arrays: list[tuple[bytes, np.ndarray]] = []
    for index, frame in enumerate(frames[6:]):
        event, _ = read_frame_in(decoder, frame)
        if index % 2:
            views.append((frame[117:217], event.payload[100:200]))
        else:
            arrays.append((frame[17:-4], np.frombuffer(event.payload, np.uint8)))
        del event, _
    assert all(bytes(view) == expected for expected, view in views)
    assert all(array.tobytes() == expected for expected, array in arrays)


def test_reads_grow_while_they_fill() -> None:
    decoder = FrameDecoder()
    sizes = []
    for _ in range(6):
        view = decoder.receive_buffer()
        sizes.append(len(view))
        empty = len(encode_frame(Opcode.PING, Flags.NONE, 1))
        frames = encode_frame(Opcode.PING, Flags.NONE, 1, b"", b"x" * (len(view) - empty))
        view[:] = frames
        assert len(decoder.received(len(view))) == 1
    assert sizes == [
        MIN_READ_SIZE,
        2 * MIN_READ_SIZE,
        4 * MIN_READ_SIZE,
        8 * MIN_READ_SIZE,
        READ_SIZE,
        READ_SIZE,
    ]


def test_an_announced_huge_frame_is_not_allocated_ahead_of_its_bytes() -> None:
    decoder = FrameDecoder(max_frame_length=64 * 1024 * 1024)
    target = decoder.receive_buffer()
    target[:4] = struct.pack(">I", 60 * 1024 * 1024)
    assert decoder.received(4) == []
    assert len(decoder.receive_buffer()) == MAX_READ_SIZE


def test_a_frame_length_over_the_limit_is_fatal_when_read_into() -> None:
    decoder = FrameDecoder(max_frame_length=1024)
    target = decoder.receive_buffer()
    target[:4] = struct.pack(">I", 5000)
    (event,) = decoder.received(4)
    assert isinstance(event, FatalFrameError)
    assert event.error_code == ErrorCode.FRAME_TOO_LARGE
    assert decoder.received(0) == [] and decoder.buffered == 0


@settings(max_examples=300)
@given(
    st.lists(frames, min_size=1, max_size=8),
    st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), max_size=8),
    st.lists(st.integers(0, 2000), max_size=10),
)
def test_corruption_yields_only_typed_events(
    encoded: list[bytes], flips: list[tuple[int, int]], cuts: list[int]
) -> None:
    data = bytearray(b"".join(encoded))
    for position, value in flips:
        data[position % len(data)] = value
    events = feed_in_chunks(bytes(data), [c for c in cuts if c <= len(data)], 1024)
    assert all(isinstance(event, EVENT_TYPES) for event in events)
    fatal = [i for i, event in enumerate(events) if isinstance(event, FatalFrameError)]
    assert fatal in ([], [len(events) - 1])  # nothing is decoded after a fatal error


def test_a_payload_in_pieces_frames_as_the_same_payload_whole() -> None:
    payload = [b"batch one", bytearray(b""), memoryview(b"and the rest" * 1000)]
    for pieces in ([], payload):
        gathered = gathered_frame_pieces(Opcode.FETCH, Flags.RESPONSE, 7, b"head", pieces)
        assert gathered[1:-1] == pieces  # written as they are
        assert b"".join(gathered) == encode_frame(
            Opcode.FETCH, Flags.RESPONSE, 7, b"head", b"".join(pieces)
        )


def test_a_frame_larger_than_a_read_gets_a_buffer_of_its_size_after_its_first_mib() -> None:
    """Announced 8 MiB: room is made a large read at a time until 1 MiB of
    it is in, then for all the rest at once, so the buffer is the frame's
    size (not the doubling of a growing one) and ``growth`` says so before
    the room is made; ``release`` lets the buffer go."""
    payload = bytes(8 << 20)
    frame = encode_frame(Opcode.APPEND, Flags.NONE, 3, b"h" * 24, payload)
    decoder = FrameDecoder(16 << 20)
    received = 0
    pieces = []
    while received < MAX_READ_SIZE:
        target = decoder.receive_buffer()
        assert len(target) <= MAX_READ_SIZE
        n = min(len(target), MAX_READ_SIZE - received)
        target[:n] = frame[received : received + n]
        assert decoder.received(n) == []
        received += n
        pieces.append(n)
    assert decoder.growth() == len(frame) - decoder.holding
    rest = decoder.receive_buffer()
    assert len(rest) == len(frame) - received and decoder.holding == len(frame)
    rest[: len(rest) // 2] = frame[received : received + len(rest) // 2]
    assert decoder.received(len(rest) // 2) == []
    assert decoder.growth() == 0 and decoder.holding == len(frame)
    decoder.release()
    assert decoder.holding == 0 and decoder.buffered == 0
