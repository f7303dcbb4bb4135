"""sbp.connection.ConnectionState: stream ids, response matching, abandoned
requests, the requests being served, GOAWAY."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
from sbp.constants import MAX_CLIENT_STREAM_ID, SERVER_STREAM_ID_BIT
from sbp.enums import Flags, Opcode
from sbp.frames import Frame

MORE = Flags.RESPONSE
END = Flags.RESPONSE | Flags.RESPONSE_END


def response(stream_id: int, flags: Flags = END) -> Frame:
    return Frame(Opcode.FETCH, flags, stream_id)


def request(stream_id: int, opcode: Opcode = Opcode.FETCH) -> Frame:
    return Frame(opcode, Flags.NONE, stream_id)


def test_client_ids_count_up_from_zero_and_server_ids_set_the_top_bit() -> None:
    client = ConnectionState(Side.CLIENT)
    assert [client.start_request() for _ in range(3)] == [0, 1, 2]
    server = ConnectionState(Side.SERVER)
    assert [server.start_request() for _ in range(2)] == [
        SERVER_STREAM_ID_BIT,
        SERVER_STREAM_ID_BIT | 1,
    ]
    assert client.pending == 3 and server.pending == 2


def test_ids_wrap_around_and_skip_those_still_in_use() -> None:
    state = ConnectionState(Side.CLIENT)
    first = state.start_request()  # 0 stays pending
    state._next_id = MAX_CLIENT_STREAM_ID
    assert state.start_request() == MAX_CLIENT_STREAM_ID
    assert state.start_request() == 1  # 0 is skipped: still awaiting its answer
    assert first == 0


def test_a_response_sequence_ends_at_response_end() -> None:
    state = ConnectionState(Side.CLIENT)
    stream_id = state.start_request()
    assert state.receive(response(stream_id, MORE)) == ResponseReceived(
        response(stream_id, MORE), end=False
    )
    assert state.pending == 1
    assert state.receive(response(stream_id)) == ResponseReceived(response(stream_id), end=True)
    assert state.pending == 0
    assert isinstance(state.receive(response(stream_id)), UnexpectedResponse)


def test_abandoned_requests_drop_late_frames_until_their_end() -> None:
    state = ConnectionState(Side.CLIENT)
    stream_id = state.start_request()
    state.abandon(stream_id)
    assert state.pending == 0
    # Its id is not reused while late frames may still come.
    assert state.start_request() != stream_id
    assert isinstance(state.receive(response(stream_id, MORE)), LateResponse)
    assert isinstance(state.receive(response(stream_id)), LateResponse)
    assert isinstance(state.receive(response(stream_id)), UnexpectedResponse)


def test_abandon_after_the_end_and_forget_are_harmless() -> None:
    state = ConnectionState(Side.CLIENT)
    stream_id = state.start_request()
    state.receive(response(stream_id))
    state.abandon(stream_id)
    assert isinstance(state.receive(response(stream_id)), UnexpectedResponse)
    other = state.start_request()
    state.abandon(other)
    state.forget(other)
    assert isinstance(state.receive(response(other)), UnexpectedResponse)


def test_serving_requests_and_duplicates() -> None:
    state = ConnectionState(Side.SERVER)
    assert state.receive(request(5)) == RequestReceived(request(5))
    assert state.is_serving(5) and state.serving == 1
    assert state.receive(request(5)) == DuplicateRequest(request(5))
    state.response_sent(5, end=False)
    assert state.is_serving(5)
    state.response_sent(5, end=True)
    assert not state.is_serving(5) and state.serving == 0
    assert isinstance(state.receive(request(5)), RequestReceived)
    with pytest.raises(RuntimeError, match="no request being served"):
        state.response_sent(6, end=True)


def test_goaway() -> None:
    state = ConnectionState(Side.CLIENT)
    frame = Frame(Opcode.GOAWAY, Flags.NONE, SERVER_STREAM_ID_BIT)
    assert state.receive(frame) == GoAwayReceived(frame)
    assert state.goaway_received and not state.goaway_sent
    assert state.serving == 0  # a GOAWAY is never answered


def test_one_way_ids_are_not_pending() -> None:
    state = ConnectionState(Side.SERVER)
    stream_id = state.start_one_way()
    assert stream_id & SERVER_STREAM_ID_BIT and state.pending == 0
    assert state.start_request() == stream_id + 1


operations = st.lists(
    st.tuples(st.sampled_from(["start", "abandon", "more", "end"]), st.integers(0, 7)),
    max_size=60,
)


@given(operations)
def test_pending_matches_a_simple_model(ops: list[tuple[str, int]]) -> None:
    """Random starts, abandons and response frames: ``pending`` and the event
    kinds always agree with a set-based model."""
    state = ConnectionState(Side.CLIENT)
    pending: set[int] = set()
    abandoned: set[int] = set()
    for op, pick in ops:
        known = sorted(pending | abandoned)
        stream_id = known[pick % len(known)] if known else pick
        if op == "start":
            new = state.start_request()
            assert new not in pending and new not in abandoned
            pending.add(new)
        elif op == "abandon":
            state.abandon(stream_id)
            if stream_id in pending:
                pending.discard(stream_id)
                abandoned.add(stream_id)
        else:
            end = op == "end"
            event = state.receive(response(stream_id, END if end else MORE))
            if stream_id in pending:
                assert event == ResponseReceived(response(stream_id, END if end else MORE), end)
                if end:
                    pending.discard(stream_id)
            elif stream_id in abandoned:
                assert isinstance(event, LateResponse)
                if end:
                    abandoned.discard(stream_id)
            else:
                assert isinstance(event, UnexpectedResponse)
        assert state.pending == len(pending)
