"""sbp.connection.ConnectionEngine without trio: bytes in, events and bytes
out. SPEC §1's bad-frame table is checked row by row as data, then stream
ids, response matching, abandoned requests, serving, GOAWAY and slots."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbp import messages
from sbp.connection import (
    BAD_FRAME_ACTIONS,
    GATHERED_PAYLOAD_BYTES,
    BadFrameAction,
    CallFailed,
    ConnectionEngine,
    ConnectionTerminated,
    GoAwayReceived,
    RequestReceived,
    ResponseReceived,
    Side,
    decode_response,
)
from sbp.constants import (
    DEFAULT_MAX_FRAME_LENGTH,
    FIRST_CLIENT_STREAM_ID,
    MAX_CLIENT_STREAM_ID,
    SERVER_STREAM_ID_BIT,
)
from sbp.enums import ErrorCode, Flags, Opcode
from sbp.errors import (
    ChecksumMismatchError,
    ConnectionClosed,
    FrameTooLargeError,
    ShuttingDownError,
)
from sbp.frames import FrameDecoder, FrameEvent, encode_frame

MORE = Flags.RESPONSE
END = Flags.RESPONSE | Flags.RESPONSE_END
HEARTBEAT = messages.HeartbeatRequest(client_id="c").encode()


def server() -> ConnectionEngine:
    return ConnectionEngine(Side.SERVER, max_concurrent_requests=4)


def sent_frames(engine: ConnectionEngine) -> list[FrameEvent]:
    """What the engine queued, decoded back into frames."""
    return FrameDecoder().feed(b"".join(engine.data_to_send()))


def system_error(event: FrameEvent) -> tuple[int, ErrorCode]:
    assert event.flags & Flags.SYSTEM_ERROR, event  # type: ignore[union-attr]
    decoded = messages.SystemErrorHeader.decode(event.header)  # type: ignore[union-attr]
    return event.stream_id, decoded.error_code  # type: ignore[union-attr]


def corrupt_magic(frame: bytes) -> bytes:
    return frame[:4] + b"\x00" + frame[5:]


def unknown_opcode(frame: bytes) -> bytes:
    return frame[:5] + struct.pack(">H", 0x7777) + frame[7:]


def bad_header_format(frame: bytes) -> bytes:
    return frame[:12] + b"\x02" + frame[13:]


def bad_checksum(frame: bytes) -> bytes:
    return frame[:-4] + b"\xde\xad\xbe\xef"


def header_past_frame(frame: bytes) -> bytes:
    return frame[:13] + struct.pack(">I", 0xFFFF)[1:] + frame[16:]


def too_long(frame: bytes) -> bytes:
    return struct.pack(">I", DEFAULT_MAX_FRAME_LENGTH + 1) + frame[4:]


def too_short(frame: bytes) -> bytes:
    return struct.pack(">I", 15) + frame[4:]


def unexpected_response(frame: bytes) -> bytes:
    return encode_frame(Opcode.HEARTBEAT, END, 9, HEARTBEAT)


#: SPEC §1's rows: (the table's condition, how to make such a frame from a good
#: request, what the server must queue and report)
INVALID = ErrorCode.INVALID_REQUEST
ROWS: list[tuple[str, Callable[[bytes], bytes], ErrorCode | None, str | None]] = [
    ("frame_length < 16 or > the limit", too_long, ErrorCode.FRAME_TOO_LARGE, "fatal"),
    ("frame_length < 16 or > the limit", too_short, INVALID, "fatal"),
    ("magic != 23", corrupt_magic, None, "bad_magic"),
    ("unknown opcode", unknown_opcode, None, "unknown_opcode"),
    ("header_format != 0x01", bad_header_format, INVALID, "rejected_invalid_request"),
    ("checksum mismatch", bad_checksum, ErrorCode.CHECKSUM_MISMATCH, "rejected_checksum_mismatch"),
    ("header_length past the frame", header_past_frame, INVALID, "rejected_invalid_request"),
    (
        "response for a stream id with no request in flight",
        unexpected_response,
        None,
        "unexpected_response",
    ),
]


def test_every_row_of_the_table_is_covered() -> None:
    assert {condition for condition, *_ in ROWS} == set(BAD_FRAME_ACTIONS)


@pytest.mark.parametrize(("condition", "make", "code", "counted"), ROWS)
def test_bad_frame_table(
    condition: str, make: Callable[[bytes], bytes], code: ErrorCode | None, counted: str
) -> None:
    action = BAD_FRAME_ACTIONS[condition][1]
    engine = server()
    good = encode_frame(Opcode.HEARTBEAT, Flags.NONE, 7, HEARTBEAT, b"payload")
    events = engine.feed(
        make(good) + (good if action is not BadFrameAction.GOAWAY_AND_CLOSE else b"")
    )
    out = sent_frames(engine)
    assert engine.discarded == {counted: 1}
    if action is BadFrameAction.GOAWAY_AND_CLOSE:
        assert events == [ConnectionTerminated(code, events[0].message)]  # type: ignore[arg-type, union-attr]
        assert [f.opcode for f in out] == [Opcode.GOAWAY]  # type: ignore[union-attr]
        assert messages.GoAway.decode(out[0].header).error_code == code  # type: ignore[union-attr]
        assert not engine.wants_data
        assert engine.feed(good) == []  # nothing more is read
        return
    # Discarded or answered, the connection goes on: the good frame after it is served.
    assert [type(e) for e in events] == [RequestReceived]
    assert engine.serving == 1
    if action is BadFrameAction.ANSWER_ERROR:
        assert [system_error(f) for f in out] == [(7, code)]
    else:
        assert out == []


def test_a_rejected_response_fails_our_request_and_is_not_answered() -> None:
    client = ConnectionEngine(Side.CLIENT)
    stream_id = client.send_request(Opcode.HEARTBEAT, HEARTBEAT)
    client.data_to_send()
    answer = encode_frame(Opcode.HEARTBEAT, END, stream_id, b"", b"x")
    [event] = client.feed(bad_checksum(answer))
    assert isinstance(event, CallFailed) and isinstance(event.error, ChecksumMismatchError)
    assert client.data_to_send() == [] and client.pending == 0
    assert client.discarded == {"rejected_response_checksum_mismatch": 1}


def test_ping_is_answered_at_once_with_its_bytes() -> None:
    engine = server()
    assert engine.feed(encode_frame(Opcode.PING, Flags.NONE, 3, b"hd", b"pl")) == []
    [pong] = sent_frames(engine)
    assert (pong.opcode, pong.flags, pong.stream_id, pong.header, bytes(pong.payload)) == (  # type: ignore[union-attr]
        Opcode.PING, END, 3, b"hd", b"pl",
    )  # fmt: skip
    assert engine.serving == 0


def test_an_answer_too_large_to_frame_leaves_the_request_to_be_answered() -> None:
    engine = server()
    [received] = engine.feed(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 7, HEARTBEAT))
    assert isinstance(received, RequestReceived)
    with pytest.raises(FrameTooLargeError):
        engine.send_response(7, bytes(1 << 24))
    assert engine.serving == 1 and sent_frames(engine) == []
    engine.send_response(7, b"", system_error=True)
    [answer] = sent_frames(engine)
    assert (answer.stream_id, answer.flags) == (7, END | Flags.SYSTEM_ERROR)  # type: ignore[union-attr]
    assert engine.serving == 0


def test_a_duplicate_id_is_refused_and_the_first_request_carries_on() -> None:
    engine = server()
    frame = encode_frame(Opcode.HEARTBEAT, Flags.NONE, 5, HEARTBEAT)
    [first] = engine.feed(frame)
    assert engine.feed(frame) == []
    assert [system_error(f) for f in sent_frames(engine)] == [(5, ErrorCode.INVALID_REQUEST)]
    assert engine.is_serving(5)
    engine.send_response(5, b"")
    assert not engine.is_serving(5) and isinstance(first, RequestReceived)
    with pytest.raises(RuntimeError, match="no request being served"):
        engine.send_response(5, b"")


def test_after_our_goaway_new_requests_are_shutting_down() -> None:
    engine = server()
    [served] = engine.feed(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 1, HEARTBEAT))
    engine.send_goaway(ErrorCode.SHUTTING_DOWN, "bye")
    assert engine.feed(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 2, HEARTBEAT)) == []
    goaway, refused = sent_frames(engine)
    assert goaway.opcode == Opcode.GOAWAY and goaway.stream_id & SERVER_STREAM_ID_BIT  # type: ignore[union-attr]
    assert system_error(refused) == (2, ErrorCode.SHUTTING_DOWN)
    engine.send_response(1, b"")  # the request in flight still finishes
    assert engine.serving == 0 and isinstance(served, RequestReceived)


def test_a_peers_goaway_stops_our_new_requests() -> None:
    client = ConnectionEngine(Side.CLIENT)
    goaway = messages.GoAway(error_code=ErrorCode.SHUTTING_DOWN, error_message="bye").encode()
    assert client.feed(encode_frame(Opcode.GOAWAY, Flags.NONE, SERVER_STREAM_ID_BIT, goaway)) == [
        GoAwayReceived(ErrorCode.SHUTTING_DOWN, "bye")
    ]
    with pytest.raises(ShuttingDownError, match="SHUTTING_DOWN: bye"):
        client.send_request(Opcode.HEARTBEAT, HEARTBEAT)
    client.send_request(Opcode.PING, after_goaway=True)  # a keepalive may still go


def test_a_client_end_answers_requests_unsupported() -> None:
    client = ConnectionEngine(Side.CLIENT, serves_requests=False)
    assert client.feed(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 4, HEARTBEAT)) == []
    assert [system_error(f) for f in sent_frames(client)] == [(4, ErrorCode.UNSUPPORTED_OPERATION)]


def test_slots_and_unsent_bytes_stop_reading() -> None:
    engine = ConnectionEngine(Side.SERVER, max_concurrent_requests=2, high_water=100)
    frames = b"".join(encode_frame(Opcode.HEARTBEAT, Flags.NONE, i, HEARTBEAT) for i in (1, 2))
    assert len(engine.feed(frames)) == 2
    assert not engine.wants_data  # both slots taken
    engine.send_response(1, b"", b"x" * 200)
    assert engine.serving == 1 and not engine.wants_data  # a slot, but 200 bytes unsent
    engine.data_to_send()
    assert engine.wants_data and engine.outgoing_bytes == 0


def test_data_to_send_takes_up_to_a_limit_but_at_least_one_frame() -> None:
    engine = server()
    for i in range(3):
        engine.feed(encode_frame(Opcode.PING, Flags.NONE, i, b"", b"x" * 40))
    big = engine.data_to_send(limit=130)
    assert len(big) == 2 and engine.outgoing_bytes == 60
    assert len(engine.data_to_send(limit=1)) == 1


def test_a_large_answer_payload_is_handed_over_as_it_is_not_copied() -> None:
    engine = server()
    engine.feed(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 1, HEARTBEAT))
    engine.feed(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 2, HEARTBEAT))
    engine.send_response(1, b"small", b"s" * 100)
    large = bytearray(b"L" * GATHERED_PAYLOAD_BYTES)
    engine.send_response(2, b"hdr", large)
    # the small frame goes alone: the large one is never split from its pieces
    small = engine.data_to_send(limit=1000)
    assert small == [encode_frame(Opcode.HEARTBEAT, END, 1, b"small", b"s" * 100)]
    head, payload, checksum = engine.data_to_send(limit=1000)
    assert payload is large
    wire = b"".join((head, payload, checksum))
    assert wire == encode_frame(Opcode.HEARTBEAT, END, 2, b"hdr", large)
    assert engine.outgoing_bytes == 0
    assert FrameDecoder().feed(wire)[0].payload == large


def test_client_ids_count_up_from_a_line_end_and_server_ids_set_the_top_bit() -> None:
    """A client's first stream id is the bytes "\r\n\r\n" (an HTTP server
    given as an SBP address answers at once); the next count up from it."""
    client = ConnectionEngine(Side.CLIENT)
    first = FIRST_CLIENT_STREAM_ID
    assert [client.send_request(Opcode.PING) for _ in range(3)] == [first, first + 1, first + 2]
    assert first.to_bytes(4, "big") == b"\r\n\r\n"
    own = ConnectionEngine(Side.SERVER)
    assert own.send_request(Opcode.PING) == SERVER_STREAM_ID_BIT
    assert client.pending == 3


def test_ids_wrap_around_and_skip_those_still_in_use() -> None:
    client = ConnectionEngine(Side.CLIENT)
    client._next_id = 0
    first = client.send_request(Opcode.PING)
    client._next_id = MAX_CLIENT_STREAM_ID
    assert client.send_request(Opcode.PING) == MAX_CLIENT_STREAM_ID
    assert client.send_request(Opcode.PING) == 1  # 0 still awaits its answer
    assert first == 0


def test_a_response_sequence_ends_at_response_end_and_decodes() -> None:
    client = ConnectionEngine(Side.CLIENT)
    stream_id = client.send_request(Opcode.HEARTBEAT, HEARTBEAT)
    answer = messages.HeartbeatResponse(client_id="c").encode()
    more = encode_frame(Opcode.HEARTBEAT, MORE, stream_id, answer)
    [event] = client.feed(more)
    assert isinstance(event, ResponseReceived) and not event.frame.is_end
    [last] = client.feed(encode_frame(Opcode.HEARTBEAT, END, stream_id, answer))
    assert isinstance(last, ResponseReceived) and last.frame.is_end and client.pending == 0
    assert decode_response(Opcode.HEARTBEAT, last.frame) == messages.HeartbeatResponse(
        client_id="c"
    )
    assert client.feed(encode_frame(Opcode.HEARTBEAT, END, stream_id, answer)) == []
    assert client.discarded == {"unexpected_response": 1}


def test_abandoned_requests_drop_late_frames_until_their_end() -> None:
    client = ConnectionEngine(Side.CLIENT)
    stream_id = client.send_request(Opcode.PING)
    client.abandon(stream_id)
    assert client.pending == 0
    assert client.send_request(Opcode.PING) != stream_id  # not reused yet
    assert client.feed(encode_frame(Opcode.PING, MORE, stream_id)) == []
    assert client.feed(encode_frame(Opcode.PING, END, stream_id)) == []
    assert client.feed(encode_frame(Opcode.PING, END, stream_id)) == []
    assert client.discarded == {"late_response": 2, "unexpected_response": 1}


def test_a_terminated_engine_refuses_requests() -> None:
    engine = server()
    engine.feed(too_long(encode_frame(Opcode.PING, Flags.NONE, 1)))
    with pytest.raises(ConnectionClosed):
        engine.send_request(Opcode.PING)


operations = st.lists(
    st.tuples(st.sampled_from(["start", "abandon", "more", "end"]), st.integers(0, 7)),
    max_size=60,
)


@given(operations)
def test_pending_matches_a_simple_model(ops: list[tuple[str, int]]) -> None:
    """Random starts, abandons and response frames: ``pending`` and the
    events always agree with a set-based model."""
    client = ConnectionEngine(Side.CLIENT)
    pending: set[int] = set()
    abandoned: set[int] = set()
    for op, pick in ops:
        known = sorted(pending | abandoned)
        stream_id = known[pick % len(known)] if known else pick
        if op == "start":
            new = client.send_request(Opcode.PING)
            assert new not in pending and new not in abandoned
            pending.add(new)
        elif op == "abandon":
            client.abandon(stream_id)
            if stream_id in pending:
                pending.discard(stream_id)
                abandoned.add(stream_id)
        else:
            end = op == "end"
            events = client.feed(encode_frame(Opcode.PING, END if end else MORE, stream_id))
            if stream_id in pending:
                assert [type(e) for e in events] == [ResponseReceived]
                if end:
                    pending.discard(stream_id)
            else:
                assert events == []
                if stream_id in abandoned and end:
                    abandoned.discard(stream_id)
        assert client.pending == len(pending)
