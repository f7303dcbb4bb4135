"""The serving side: SPEC §1's bad-frame table fed raw bytes, the dispatcher,
backpressure, and the TCP server (limits, drain)."""

from __future__ import annotations

import struct
import sys
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from net.connection import RECEIVE_CHUNK, Connection
from net.limits import CLIENT_LIMITS, ConnectionLimits
from net.request import Request, Responder
from net.server import Dispatcher, Server
from net.service import announce
from sbp import messages
from sbp.connection import DEFAULT_HIGH_WATER, Side
from sbp.constants import FIXED_HEADER_SIZE, SERVER_STREAM_ID_BIT
from sbp.enums import ErrorCode, Flags, Opcode
from sbp.errors import ChecksumMismatchError, ShuttingDownError, ThrottledError
from sbp.frames import Frame, FrameDecoder, encode_frame

from ..eventually import eventually

RESPONSE_END = Flags.RESPONSE | Flags.RESPONSE_END
SYSTEM_ERROR_END = RESPONSE_END | Flags.SYSTEM_ERROR


class Peer:
    """The far end of a serving connection, speaking raw bytes."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def request(self, opcode: int, stream_id: int, header: bytes = b"") -> None:
        await self.send(encode_frame(opcode, Flags.NONE, stream_id, header))

    async def receive(self) -> Frame:
        while not self.frames:
            data = await self.stream.receive_some(65536)
            assert data, "the server closed the connection"
            for event in self.decoder.feed(data):
                assert isinstance(event, Frame), event
                self.frames.append(event)
        return self.frames.pop(0)

    async def receive_until_closed(self) -> list[Frame]:
        """Every frame up to the server closing the connection."""
        received = list(self.frames)
        self.frames.clear()
        while data := await self.stream.receive_some(65536):
            for event in self.decoder.feed(data):
                assert isinstance(event, Frame), event
                received.append(event)
        return received


def system_error(frame: Frame) -> tuple[int, ErrorCode | int]:
    assert frame.flags == SYSTEM_ERROR_END
    return frame.stream_id, messages.SystemErrorHeader.decode(frame.header).error_code


def heartbeat(client_id: str) -> bytes:
    return messages.HeartbeatRequest(client_id=client_id).encode()


class Handlers:
    """HEARTBEAT echoes its client_id; every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = trio.Event()
        self.hold = False
        self.running = 0
        self.most_running = 0

    async def heartbeat(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.HeartbeatRequest)
        self.calls.append(header.client_id)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.hold or header.client_id.startswith("hold"):
                await self.release.wait()
            response = messages.HeartbeatResponse(client_id=header.client_id)
            await responder.send(response, bytes(request.payload))
        finally:
            self.running -= 1

    def dispatcher(self) -> Dispatcher:
        dispatcher = Dispatcher("test node")
        dispatcher.register(Opcode.HEARTBEAT, self.heartbeat)
        return dispatcher


@asynccontextmanager
async def serving(
    handlers: Handlers | Immediate, limits: ConnectionLimits = CLIENT_LIMITS
) -> AsyncIterator[tuple[Peer, Connection]]:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server = Connection(
        server_stream, side=Side.SERVER, handler=handlers.dispatcher(), limits=limits
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        yield Peer(client_stream), server
        nursery.cancel_scope.cancel()


async def answers_ping(peer: Peer, stream_id: int = 99) -> None:
    await peer.send(encode_frame(Opcode.PING, Flags.NONE, stream_id, b"", b"still here"))
    frame = await peer.receive()
    assert (frame.opcode, frame.flags, frame.stream_id) == (Opcode.PING, RESPONSE_END, stream_id)
    assert bytes(frame.payload) == b"still here"


# -- SPEC §1: what a receiver does with a bad frame -------------------------------


@pytest.mark.parametrize(
    ("frame_length", "code"),
    [(8, ErrorCode.INVALID_REQUEST), (4096, ErrorCode.FRAME_TOO_LARGE)],
    ids=["too-small", "too-large"],
)
async def test_frame_length_out_of_bounds_sends_goaway_and_closes(
    frame_length: int, code: ErrorCode
) -> None:
    handlers = Handlers()
    async with serving(handlers, ConnectionLimits(max_frame_length=1024)) as (peer, server):
        await peer.send(struct.pack(">IBHBI", frame_length, 23, Opcode.PING, 0, 1))
        frames = await peer.receive_until_closed()
        assert [(f.opcode, f.flags) for f in frames] == [(Opcode.GOAWAY, Flags.NONE)]
        assert frames[0].stream_id & SERVER_STREAM_ID_BIT
        assert messages.GoAway.decode(frames[0].header).error_code == code
        await server.wait_closed()
        assert server.engine.discarded == {"fatal": 1}


async def test_bad_magic_is_discarded_and_the_connection_goes_on() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, server):
        bad = bytearray(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 1, heartbeat("x")))
        bad[4] = 24
        await peer.send(bytes(bad))
        await answers_ping(peer)
        assert server.engine.discarded == {"bad_magic": 1}
        assert handlers.calls == []


async def test_unknown_opcode_is_discarded() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, server):
        await peer.send(encode_frame(0x7777, Flags.NONE, 1, b"abc", b"payload"))
        await answers_ping(peer)
        assert server.engine.discarded == {"unknown_opcode": 1}


async def test_header_format_other_than_flatbuffers_is_invalid_request() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, _server):
        frame = bytearray(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 7, heartbeat("x")))
        frame[FIXED_HEADER_SIZE] = 0x02
        await peer.send(bytes(frame))
        assert system_error(await peer.receive()) == (7, ErrorCode.INVALID_REQUEST)
        await answers_ping(peer)
        assert handlers.calls == []


async def test_checksum_mismatch_is_answered_and_nothing_applied() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, _server):
        frame = bytearray(encode_frame(Opcode.HEARTBEAT, Flags.NONE, 7, heartbeat("x"), b"data"))
        frame[-1] ^= 0xFF
        await peer.send(bytes(frame))
        assert system_error(await peer.receive()) == (7, ErrorCode.CHECKSUM_MISMATCH)
        await answers_ping(peer)
        assert handlers.calls == []


async def test_undecodable_header_is_invalid_request_and_handler_not_called() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, _server):
        await peer.request(Opcode.HEARTBEAT, 7, b"\xff\xff\xff\x7f garbage")
        stream_id, code = system_error(await peer.receive())
        assert (stream_id, code) == (7, ErrorCode.INVALID_REQUEST)
        assert handlers.calls == []


async def test_opcode_not_served_by_this_role_is_unsupported_operation() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, _server):
        await peer.request(Opcode.APPEND, 7, messages.AppendRequest().encode())
        frame = await peer.receive()
        assert system_error(frame) == (7, ErrorCode.UNSUPPORTED_OPERATION)
        assert (
            "test node does not serve APPEND"
            in messages.SystemErrorHeader.decode(frame.header).error_message
        )


async def test_responses_nobody_asked_for_are_counted_never_answered() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, server):
        await peer.send(encode_frame(Opcode.HEARTBEAT, RESPONSE_END, 5, b""))
        # A response that also fails its checksum: still never answered.
        bad = bytearray(encode_frame(Opcode.HEARTBEAT, RESPONSE_END, 6, b"", b"data"))
        bad[-1] ^= 0xFF
        await peer.send(bytes(bad))
        await answers_ping(peer)
        assert server.engine.discarded == {
            "unexpected_response": 1,
            "rejected_response_checksum_mismatch": 1,
        }


async def test_duplicate_stream_id_is_rejected_and_the_first_goes_on() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, _server):
        await peer.request(Opcode.HEARTBEAT, 3, heartbeat("hold-first"))
        await trio.testing.wait_all_tasks_blocked()
        await peer.request(Opcode.HEARTBEAT, 3, heartbeat("second"))
        assert system_error(await peer.receive()) == (3, ErrorCode.INVALID_REQUEST)
        handlers.release.set()
        frame = await peer.receive()
        assert (frame.stream_id, frame.flags) == (3, RESPONSE_END)
        assert messages.HeartbeatResponse.decode(frame.header).client_id == "hold-first"
        assert handlers.calls == ["hold-first"]
        # The id is free again once the first request is answered.
        await peer.request(Opcode.HEARTBEAT, 3, heartbeat("third"))
        assert messages.HeartbeatResponse.decode((await peer.receive()).header).client_id == (
            "third"
        )


async def test_frames_split_at_every_byte_are_all_served() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, _server):
        data = b"".join(
            encode_frame(Opcode.HEARTBEAT, Flags.NONE, i, heartbeat(str(i)), b"p" * i)
            for i in range(5)
        )
        for i in range(len(data)):
            await peer.send(data[i : i + 1])
        answers = sorted([await peer.receive() for _ in range(5)], key=lambda f: f.stream_id)
        for i, frame in enumerate(answers):
            assert messages.HeartbeatResponse.decode(frame.header).client_id == str(i)
            assert bytes(frame.payload) == b"p" * i


async def test_requests_after_goaway_sent_are_answered_shutting_down() -> None:
    handlers = Handlers()
    async with serving(handlers) as (peer, server):
        await server.send_goaway(ErrorCode.NONE, "restarting")
        goaway = await peer.receive()
        assert goaway.opcode == Opcode.GOAWAY
        assert messages.GoAway.decode(goaway.header).error_message == "restarting"
        await peer.request(Opcode.HEARTBEAT, 1, heartbeat("late"))
        assert system_error(await peer.receive()) == (1, ErrorCode.SHUTTING_DOWN)
        assert handlers.calls == []


async def test_a_corrupted_response_fails_only_its_request() -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = Connection(client_stream, side=Side.CLIENT, peer="server")
    server = Peer(server_stream)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)

        async def corrupt_then_answer() -> None:
            first = await server.receive()
            bad = bytearray(encode_frame(Opcode.PING, RESPONSE_END, first.stream_id, b"", b"xx"))
            bad[-1] ^= 0xFF
            await server.send(bytes(bad))
            second = await server.receive()
            await server.send(encode_frame(Opcode.PING, RESPONSE_END, second.stream_id))

        nursery.start_soon(corrupt_then_answer)
        with pytest.raises(ChecksumMismatchError, match="from server"):
            await client.request(Opcode.PING, b"", b"xx")
        assert await client.ping() >= 0
        assert client.engine.discarded == {"rejected_response_checksum_mismatch": 1}
        nursery.cancel_scope.cancel()


# -- backpressure -----------------------------------------------------------------


async def test_request_flood_stops_reading_at_the_concurrency_limit() -> None:
    handlers = Handlers()
    handlers.hold = True
    limits = ConnectionLimits(max_concurrent_requests=4)
    async with serving(handlers, limits) as (peer, server):
        flood = b"".join(
            encode_frame(Opcode.HEARTBEAT, Flags.NONE, i, heartbeat(str(i)), bytes(1000))
            for i in range(200)
        )
        await peer.send(flood)
        await trio.testing.wait_all_tasks_blocked()
        assert handlers.running == 4
        assert server.serving == 4
        # Unread requests stay in the transport, not in the connection.
        assert server.engine.buffered <= RECEIVE_CHUNK
        handlers.release.set()
        answered = {(await peer.receive()).stream_id for _ in range(200)}
        assert answered == set(range(200))
        assert handlers.most_running == 4


async def flood_without_reading(
    dispatcher: Dispatcher, client_id: str, request_payload: bytes, answer_bytes: int
) -> None:
    """Send 1,000 requests and read no answer until the server has stopped
    reading: its writes stall, its 8 slots fill, and the client's sends
    block; then read every answer (each ``answer_bytes`` of payload)."""
    slots = 8
    server = Server(dispatcher, limits=ConnectionLimits(max_concurrent_requests=slots))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        stream = await trio.open_tcp_stream(host, port)
        requests = 1000  # more requests and answers than the socket buffers hold
        sent = 0

        async def flood() -> None:
            nonlocal sent
            for i in range(requests):
                frame = encode_frame(
                    Opcode.HEARTBEAT, Flags.NONE, i, heartbeat(client_id), request_payload
                )
                await stream.send_all(frame)
                sent += 1

        nursery.start_soon(flood)
        with trio.move_on_after(1.0):
            while True:
                await trio.sleep(0.01)
                (connection,) = server.connections
                assert connection.serving <= slots
                assert connection.engine.buffered <= RECEIVE_CHUNK
        (connection,) = server.connections
        # The answers the client does not read stop at the high-water mark
        # (plus what the requests being served were allowed to queue), and
        # with them the reading.
        assert connection.engine.outgoing_bytes <= DEFAULT_HIGH_WATER + slots * (
            answer_bytes + 64 * 1024
        )
        assert sent < requests  # the server stopped reading, so the client blocks
        # Now read everything: all requests complete.
        decoder = FrameDecoder(max_frame_length=1 << 20)
        answered = 0
        while answered < requests:
            for event in decoder.feed(await stream.receive_some(1 << 20)):
                assert isinstance(event, Frame) and event.flags == RESPONSE_END
                assert len(event.payload) == answer_bytes
                answered += 1
        assert sent == requests
        await stream.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.deadline(60)
async def test_slow_reader_over_tcp_bounds_handlers_and_memory() -> None:
    """A client that sends many requests and reads no answer: the server's
    writes stall, its slots fill, it stops reading; nothing grows unbounded."""
    handlers = Handlers()
    big = bytes(64 * 1024)

    async def large(request: Request, responder: Responder) -> None:
        handlers.running += 1
        handlers.most_running = max(handlers.most_running, handlers.running)
        try:
            await responder.send(messages.HeartbeatResponse(client_id="big"), big)
        finally:
            handlers.running -= 1

    dispatcher = Dispatcher("test")
    dispatcher.register(Opcode.HEARTBEAT, large)
    await flood_without_reading(dispatcher, "x", bytes(16 * 1024), len(big))
    assert handlers.most_running <= 8


# -- the TCP server -----------------------------------------------------------------


async def test_server_serves_tcp_and_drains() -> None:
    handlers = Handlers()
    server = Server(handlers.dispatcher())
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        assert host == "127.0.0.1" and port > 0
        stream = await trio.open_tcp_stream(host, port)
        client = Connection(stream, side=Side.CLIENT)
        await nursery.start(client.run)
        response = await client.request(Opcode.HEARTBEAT, messages.HeartbeatRequest(client_id="a"))
        assert response.header.client_id == "a"
        assert len(server.connections) == 1

        handlers.hold = True
        results: list[str] = []

        async def slow_call() -> None:
            request = messages.HeartbeatRequest(client_id="in-flight")
            results.append((await client.request(Opcode.HEARTBEAT, request)).header.client_id)

        nursery.start_soon(slow_call)
        await eventually(lambda: handlers.running == 1)
        nursery.start_soon(server.drain, 10.0)
        await eventually(lambda: client.goaway_received)
        with pytest.raises(ShuttingDownError):
            await client.request(Opcode.HEARTBEAT, messages.HeartbeatRequest(client_id="new"))
        handlers.release.set()
        await client.wait_closed()
        assert results == ["in-flight"]
    # serve() returned by itself once drained
    assert server.connections == frozenset()


async def test_server_refuses_connections_over_its_limit() -> None:
    handlers = Handlers()
    server = Server(handlers.dispatcher(), max_connections=1)
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        first = await trio.open_tcp_stream(host, port)
        await eventually(lambda: len(server.connections) == 1)
        second = Peer(await trio.open_tcp_stream(host, port))
        frames = await second.receive_until_closed()
        assert [f.opcode for f in frames] == [Opcode.GOAWAY]
        assert messages.GoAway.decode(frames[0].header).error_code == ErrorCode.THROTTLED
        assert server.refused == 1
        await second.stream.aclose()
        await first.aclose()
        nursery.cancel_scope.cancel()


async def test_dispatcher_rejects_built_in_and_duplicate_registrations() -> None:
    dispatcher = Dispatcher("x")
    noop = partial(Handlers.heartbeat, Handlers())
    with pytest.raises(ValueError, match="answered by the connection"):
        dispatcher.register(Opcode.PING, noop)
    dispatcher.register(Opcode.HEARTBEAT, noop)
    with pytest.raises(ValueError, match="already has a handler"):
        dispatcher.register(Opcode.HEARTBEAT, noop)
    assert dispatcher.opcodes == frozenset({Opcode.HEARTBEAT})


def test_the_address_line_is_written_in_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log line written to the same file between the address and its newline
    would corrupt the line tools parse (with PYTHONUNBUFFERED, print writes
    the two separately)."""
    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            writes.append("<flush>")

    monkeypatch.setattr(sys, "stdout", Recorder())
    announce("listening on ", "::1", 7000)
    assert writes == ["listening on [::1]:7000\n", "<flush>"]


# -- the immediate path (start_nowait) ----------------------------------------------


class Immediate:
    """HEARTBEAT served without a task: ``later`` requests are held and ended
    by ``finish``; ``task`` ones are declined (served by ``__call__``);
    ``bad`` and ``crash`` ones raise."""

    def __init__(self, answer: str = "x") -> None:
        self.answer = answer
        self.held: list[Responder] = []
        self.offered: list[Request] = []
        self.called: list[Request] = []

    def start(self, request: Request, responder: Responder) -> Awaitable[None] | None:
        self.offered.append(request)
        case = request.header_as(messages.HeartbeatRequest).client_id
        if case == "task":
            return self.in_task(request, responder)
        if case == "bad":
            raise ThrottledError("not now")
        if case == "crash":
            raise ZeroDivisionError("boom")
        if case == "later":
            self.held.append(responder)
        else:
            responder.send_nowait(messages.HeartbeatResponse(client_id=self.answer))
        return None

    async def in_task(self, request: Request, responder: Responder) -> None:
        self.called.append(request)
        await responder.send(messages.HeartbeatResponse(client_id="from task"))

    def finish(self) -> None:
        for responder in self.held:
            responder.send_nowait(messages.HeartbeatResponse(client_id="later"))
        self.held.clear()

    def dispatcher(self) -> Dispatcher:
        dispatcher = Dispatcher("test")
        dispatcher.register_handler(Opcode.HEARTBEAT, self)
        return dispatcher


async def test_immediate_handlers_answer_without_a_task_and_decline_to_one() -> None:
    handler = Immediate()
    async with serving(handler) as (peer, server):
        for stream_id, case in enumerate(("later", "now", "task", "bad", "crash", "later")):
            await peer.request(Opcode.HEARTBEAT, stream_id, heartbeat(case))
        answered = {}
        for _ in range(4):
            frame = await peer.receive()
            answered[frame.stream_id] = frame
        assert messages.HeartbeatResponse.decode(answered[1].header).client_id == "x"
        assert messages.HeartbeatResponse.decode(answered[2].header).client_id == "from task"
        assert system_error(answered[3]) == (3, ErrorCode.THROTTLED)
        assert system_error(answered[4]) == (4, ErrorCode.UNKNOWN)
        # the declined request reached the handler itself, the same object;
        # the refused ones never did
        assert [request.stream_id for request in handler.called] == [2]
        assert handler.called[0] is handler.offered[2]
        await trio.testing.wait_all_tasks_blocked()
        assert server.serving == 2  # the held ones keep their slots
        handler.finish()
        for _ in range(2):
            frame = await peer.receive()
            assert frame.flags == RESPONSE_END and frame.stream_id in (0, 5)
        await trio.testing.wait_all_tasks_blocked()
        assert server.serving == 0


@pytest.mark.deadline(60)
async def test_immediate_answers_to_a_peer_that_does_not_read_stop_the_reading() -> None:
    """Answers without a task count against the same high-water mark of
    unsent bytes: past it the server stops reading, as on the task path."""
    handler = Immediate(answer="a" * 60_000)
    await flood_without_reading(handler.dispatcher(), "now", bytes(1024), 0)
    assert not handler.called


def test_timeout_ms_means_the_same_on_every_server() -> None:
    from net.request import DEFAULT_REQUEST_TIMEOUT_S, MAX_REQUEST_TIMEOUT_S, request_timeout

    assert request_timeout(0) == request_timeout(-5) == DEFAULT_REQUEST_TIMEOUT_S == 30.0
    assert request_timeout(1500) == 1.5
    assert request_timeout(2**31 - 1) == MAX_REQUEST_TIMEOUT_S == 300.0
