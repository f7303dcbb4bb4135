"""net.Connection as a client and as a server, over memory streams and TCP."""

from __future__ import annotations

import random
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from net.calls import deadline_after
from net.connection import Connection, _send_gathered, _send_now, _unsent
from net.limits import CLIENT_LIMITS, ConnectionLimits
from net.request import Request, RequestHandler, Responder
from net.server import Dispatcher
from sbp import messages
from sbp.connection import GATHERED_PAYLOAD_BYTES, Side
from sbp.enums import ErrorCode, Opcode
from sbp.errors import (
    ConnectionClosed,
    FrameTooLargeError,
    InvalidRequestError,
    RequestTimeoutError,
    ShuttingDownError,
    ThrottledError,
    UnknownServerError,
    UnsupportedOperationError,
)

Pair = tuple[Connection, Connection]


def heartbeat(client_id: str) -> messages.HeartbeatRequest:
    return messages.HeartbeatRequest(client_id=client_id)


@asynccontextmanager
async def connected(
    handler: RequestHandler | None,
    *,
    server_limits: ConnectionLimits = CLIENT_LIMITS,
    client_limits: ConnectionLimits = CLIENT_LIMITS,
    tcp: bool = False,
) -> AsyncIterator[Pair]:
    """A client and a serving connection, over a memory stream pair or loopback TCP."""
    async with trio.open_nursery() as nursery:
        if tcp:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = listeners[0].socket.getsockname()[1]
            client_stream: trio.abc.Stream = await trio.open_tcp_stream("127.0.0.1", port)
            server_stream: trio.abc.Stream = await listeners[0].accept()
            await listeners[0].aclose()
        else:
            client_stream, server_stream = trio.testing.memory_stream_pair()
        client = Connection(client_stream, side=Side.CLIENT, limits=client_limits, peer="server")
        server = Connection(
            server_stream, side=Side.SERVER, handler=handler, limits=server_limits, peer="client"
        )
        await nursery.start(server.run)
        await nursery.start(client.run)
        yield client, server
        nursery.cancel_scope.cancel()


async def echo(request: Request, responder: Responder) -> None:
    header = request.header_as(messages.HeartbeatRequest)
    await responder.send(messages.HeartbeatResponse(client_id=header.client_id))


def serving(handler: RequestHandler = echo) -> Dispatcher:
    """A dispatcher serving HEARTBEAT with ``handler``: tests drive their
    handler through HEARTBEAT's table, whose client_id names the case."""
    dispatcher = Dispatcher("test")
    dispatcher.register(Opcode.HEARTBEAT, handler)
    return dispatcher


def client_id(request: Request) -> str:
    return request.header_as(messages.HeartbeatRequest).client_id


@pytest.mark.parametrize("tcp", [False, True], ids=["memory", "tcp"])
async def test_unary_request_and_ping(tcp: bool) -> None:
    async with connected(serving(), tcp=tcp) as (client, server):
        response = await client.request(Opcode.HEARTBEAT, heartbeat("a"))
        assert response.header.client_id == "a"
        assert response.frames == 1
        assert bytes(response.payload) == b""
        assert await client.ping() >= 0
        # PING is answered by either end, echoing header and payload.
        pong = await server.request(Opcode.PING, b"hdr", b"payload")
        assert (pong.header, bytes(pong.payload)) == (b"hdr", b"payload")
        assert client.in_flight == 0 and server.in_flight == 0


async def test_a_lone_request_is_written_at_once_and_others_by_the_writer() -> None:
    """Over TCP a frame that is the connection's only business leaves when
    it is queued, with no round of the event loop; with another request in
    flight it waits for the writer task, which joins what queued meanwhile."""
    async with connected(serving(), tcp=True) as (client, _):
        first = await client.caller.open_call(
            Opcode.HEARTBEAT, heartbeat("first"), b"", deadline_after(5)
        )
        assert client.engine.queued_frames == 0  # already written
        second = await client.caller.open_call(
            Opcode.HEARTBEAT, heartbeat("second"), b"", deadline_after(5)
        )
        assert client.engine.queued_frames == 1  # left to the writer
        for call, name in ((first, "first"), (second, "second")):
            frame = await call.next_frame()
            assert messages.HeartbeatResponse.decode(frame.header).client_id == name
            client.caller.close_call(call)
    async with connected(serving(), tcp=False) as (client, _):
        call = await client.caller.open_call(
            Opcode.HEARTBEAT, heartbeat("memory"), b"", deadline_after(5)
        )
        assert client.engine.queued_frames == 1  # no socket: the writer task writes
        await call.next_frame()
        client.caller.close_call(call)


@pytest.mark.parametrize("tcp", [False, True], ids=["memory", "tcp"])
async def test_many_concurrent_requests_answered_out_of_order(tcp: bool) -> None:
    count = 50
    arrived: list[int] = []
    all_in = trio.Event()
    release = {i: trio.Event() for i in range(count)}

    async def held(request: Request, responder: Responder) -> None:
        index = int(client_id(request))
        arrived.append(index)
        if len(arrived) == count:
            all_in.set()
        await release[index].wait()
        # Two frames per answer: the first half of the payload, then the rest.
        payload = str(index).encode() * 1000
        await responder.send(messages.HeartbeatResponse(client_id="part"), payload[:500], end=False)
        await responder.send(messages.HeartbeatResponse(client_id=str(index)), payload[500:])

    results: dict[int, tuple[str, bytes, int]] = {}
    finished: list[int] = []

    async with connected(serving(held), tcp=tcp) as (client, _):

        async def call(index: int) -> None:
            response = await client.request(Opcode.HEARTBEAT, heartbeat(str(index)))
            results[index] = (response.header.client_id, bytes(response.payload), response.frames)
            finished.append(index)

        async with trio.open_nursery() as nursery:
            for index in range(count):
                nursery.start_soon(call, index)
            await all_in.wait()
            assert client.in_flight == count
            for index in reversed(range(count)):
                release[index].set()
                await trio.testing.wait_all_tasks_blocked()

    assert finished == list(reversed(range(count)))
    for index in range(count):
        assert results[index] == (str(index), str(index).encode() * 1000, 2)


#: answers large enough to be queued in pieces (GATHERED_PAYLOAD_BYTES), by client id
LARGE_ANSWERS = {
    i: random.Random(i).randbytes(GATHERED_PAYLOAD_BYTES * (i + 1) + i) for i in range(6)
}


async def large(request: Request, responder: Responder) -> None:
    index = int(client_id(request))
    await responder.send(messages.HeartbeatResponse(client_id=str(index)), LARGE_ANSWERS[index])


async def ask_for_every_large_answer(client: Connection) -> dict[int, bytes]:
    received: dict[int, bytes] = {}

    async def call(index: int) -> None:
        response = await client.request(Opcode.HEARTBEAT, heartbeat(str(index)))
        received[index] = bytes(response.payload)

    async with trio.open_nursery() as calls:
        for index in LARGE_ANSWERS:
            calls.start_soon(call, index)
    return received


async def over_small_socket_buffers(
    handler: RequestHandler,
) -> tuple[Connection, Connection, tuple[trio.SocketStream, trio.SocketStream]]:
    """A client and a serving connection (not running yet) over loopback TCP
    whose sockets hold 32 KiB: a large answer is written a little at a time."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    client_stream = await trio.open_tcp_stream("127.0.0.1", port)
    server_stream = await listener.accept()
    await listener.aclose()
    assert isinstance(server_stream, trio.SocketStream)
    server_stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32768)
    client_stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
    client = Connection(client_stream, side=Side.CLIENT, limits=CLIENT_LIMITS, peer="server")
    server = Connection(
        server_stream,
        side=Side.SERVER,
        handler=serving(handler),
        limits=CLIENT_LIMITS,
        peer="client",
    )
    return client, server, (client_stream, server_stream)


async def test_large_answers_arrive_whole_over_a_stream_without_a_socket() -> None:
    # TLS, or memory streams in tests: the pieces are joined into one write
    async with connected(serving(large)) as (client, _):
        assert await ask_for_every_large_answer(client) == LARGE_ANSWERS


async def test_large_answers_arrive_whole_through_partial_writes() -> None:
    """Answers written as pieces (sendmsg) arrive intact when the socket
    takes a little of each at a time: small socket buffers."""
    client, server, streams = await over_small_socket_buffers(large)
    # trio's 16 KiB low mark of unsent bytes is lifted on both ends
    for stream in streams:
        assert stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == 0
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        received = await ask_for_every_large_answer(client)
        nursery.cancel_scope.cancel()
    assert received == LARGE_ANSWERS


async def test_gathered_pieces_are_written_in_order_whatever_each_write_takes() -> None:
    class Trickle:
        """A socket that takes at most ``most`` bytes per sendmsg."""

        def __init__(self, most: int) -> None:
            self.most = most
            self.written = bytearray()
            self.calls = 0

        async def sendmsg(self, buffers: list[memoryview]) -> int:
            self.calls += 1
            room = self.most
            for buffer in buffers:
                taken = bytes(buffer[:room])
                self.written += taken
                room -= len(taken)
                if not room:
                    break
            return self.most - room

    pieces = [b"head", bytearray(b"p" * 1000), b"", b"crc!"]
    for most in (1, 3, 4, 5, 999, 1004, 5000):
        sock = Trickle(most)
        await _send_gathered(sock, pieces)  # type: ignore[arg-type]
        assert sock.written == b"".join(pieces)
        assert sock.calls == -(-1008 // most)


def borrowed_pieces(index: int) -> list[bytearray]:
    """LARGE_ANSWERS[index] in pieces of up to 5,000 bytes."""
    answer = LARGE_ANSWERS[index]
    return [bytearray(answer[at : at + 5000]) for at in range(0, len(answer), 5000)]


async def borrowed(request: Request, responder: Responder) -> None:
    """Answers as FETCH does, from buffers that are overwritten once
    ``send_borrowed_nowait`` returns (the read transaction they lived in
    ends): the peer must get them as they were."""
    index = int(client_id(request))
    pieces = borrowed_pieces(index)
    await trio.sleep(random.random() / 100)  # answers overtake each other
    responder.send_borrowed_nowait(messages.HeartbeatResponse(client_id=str(index)), pieces)
    for piece in pieces:
        piece[:] = b"x" * len(piece)


@pytest.mark.parametrize("tcp", [False, True])
async def test_borrowed_answers_arrive_as_they_were_when_sent(tcp: bool) -> None:
    # memory streams copy at once; over TCP what the socket takes is
    # written at once and the rest copied, or all copied behind other frames
    async with connected(serving(borrowed), tcp=tcp) as (client, _):
        for _ in range(3):
            assert await ask_for_every_large_answer(client) == LARGE_ANSWERS


async def test_borrowed_answers_arrive_whole_through_a_full_socket() -> None:
    """With small socket buffers most of each borrowed answer is copied and
    written later by the writer task, behind what the socket took at once."""
    client, server, _ = await over_small_socket_buffers(borrowed)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        for index in LARGE_ANSWERS:  # one at a time: each finds the socket idle
            response = await client.request(Opcode.HEARTBEAT, heartbeat(str(index)))
            assert bytes(response.payload) == LARGE_ANSWERS[index]
        nursery.cancel_scope.cancel()


async def test_send_now_writes_what_the_socket_takes_and_leaves_the_rest() -> None:
    a, b = trio.socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        # more buffers than one sendmsg takes (1,024), and more bytes than fit
        pieces: list[bytes] = [bytes([i % 251]) * (i % 97 + 1) for i in range(3000)]
        whole = b"".join(pieces)
        sent = _send_now(a, pieces)  # type: ignore[arg-type]
        assert 0 < sent < len(whole)
        rest = b"".join(_unsent(pieces, sent))  # type: ignore[arg-type]
        assert len(rest) == len(whole) - sent
        received = bytearray()
        while len(received) < sent:
            received += await b.recv(1 << 20)
        assert bytes(received) + rest == whole
        # a socket with room takes everything, in several calls
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        small = pieces[:2500]
        assert _send_now(a, small) == sum(map(len, small))  # type: ignore[arg-type]
        assert _unsent(small, sum(map(len, small))) == []  # type: ignore[arg-type]
        # the descriptor is still the connection's
        assert a.fileno() >= 0
    assert _send_now(a, [b"closed"]) == 0  # type: ignore[list-item]


def test_unsent_cuts_inside_a_piece_and_keeps_the_rest() -> None:
    pieces: list[bytes] = [b"head", b"", b"payload", b"crc!"]
    whole = b"".join(pieces)
    for sent in range(len(whole) + 1):
        assert b"".join(_unsent(pieces, sent)) == whole[sent:]  # type: ignore[arg-type]


async def test_handler_header_table_mismatch_is_invalid_request() -> None:
    # The dispatcher decodes with the opcode's own table before the handler runs.
    called = False

    async def handler(request: Request, responder: Responder) -> None:
        nonlocal called
        called = True

    async with connected(serving(handler)) as (client, _):
        with pytest.raises(InvalidRequestError):
            await client.request(Opcode.HEARTBEAT, b"\x01\x02\x03")
        assert not called


async def test_streaming_response_yields_frames_as_they_arrive() -> None:
    step = trio.Event()

    async def fetch(request: Request, responder: Responder) -> None:
        await responder.send(messages.HeartbeatResponse(client_id="1"), b"one", end=False)
        await step.wait()
        await responder.send(messages.HeartbeatResponse(client_id="2"), b"two", end=False)
        await responder.send(messages.HeartbeatResponse(client_id="3"), b"")

    async with connected(serving(fetch)) as (client, _):
        seen: list[tuple[str, bytes]] = []
        async with client.stream(Opcode.HEARTBEAT, heartbeat("x")) as responses:
            async for response in responses:
                seen.append((response.header.client_id, bytes(response.payload)))
                step.set()
        assert seen == [("1", b"one"), ("2", b"two"), ("3", b"")]
        assert client.in_flight == 0


async def test_leaving_a_stream_early_abandons_it_and_drops_late_frames() -> None:
    more = trio.Event()
    sent = trio.Event()

    async def fetch(request: Request, responder: Responder) -> None:
        if client_id(request) != "x":
            return await echo(request, responder)
        await responder.send(messages.HeartbeatResponse(client_id="1"), end=False)
        await more.wait()
        await responder.send(messages.HeartbeatResponse(client_id="2"))
        sent.set()

    async with connected(serving(fetch)) as (client, _):
        async with client.stream(Opcode.HEARTBEAT, heartbeat("x")) as responses:
            async for response in responses:
                assert response.header.client_id == "1"
                break
        more.set()
        await sent.wait()
        assert (await client.request(Opcode.HEARTBEAT, heartbeat("after"))).header.client_id == (
            "after"
        )
        assert client.engine.discarded == {"late_response": 1}


async def test_timeout_cancels_only_that_request(autojump_clock: trio.abc.Clock) -> None:
    release = trio.Event()
    answered = trio.Event()

    async def slow(request: Request, responder: Responder) -> None:
        if client_id(request) != "x":
            return await echo(request, responder)
        await release.wait()
        await responder.send(messages.HeartbeatResponse(client_id="late"))
        answered.set()

    async with connected(serving(slow)) as (client, _):
        with pytest.raises(RequestTimeoutError):
            await client.request(Opcode.HEARTBEAT, heartbeat("x"), timeout=5)
        assert client.in_flight == 0
        # The connection carries on; the late answer is dropped quietly.
        assert (await client.request(Opcode.HEARTBEAT, heartbeat("ok"))).header.client_id == "ok"
        release.set()
        await answered.wait()
        await client.ping()
        assert client.engine.discarded == {"late_response": 1}
        assert not client.closed


async def test_each_request_times_out_at_its_own_deadline(autojump_clock: trio.abc.Clock) -> None:
    """One task of the connection expires the calls: a shorter timeout
    sent after a longer one still ends on time, and the longer one later."""

    async def never(request: Request, responder: Responder) -> None:
        await trio.sleep_forever()

    timed_out: dict[str, float] = {}

    async def ask(name: str, timeout: float) -> None:
        started = trio.current_time()
        with pytest.raises(RequestTimeoutError):
            await client.request(Opcode.HEARTBEAT, heartbeat(name), timeout=timeout)
        timed_out[name] = trio.current_time() - started

    async with connected(serving(never)) as (client, _):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "long", 100.0)
            await trio.sleep(1)
            nursery.start_soon(ask, "short", 2.0)
        assert client.in_flight == 0 and not client.closed
    assert timed_out["short"] == pytest.approx(2.0, abs=0.1)
    assert timed_out["long"] == pytest.approx(100.0, abs=0.1)


async def test_requests_are_expired_by_a_task_only_while_they_are_in_flight(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An idle connection runs no expiry task (10,000 idle ones would hold
    40 MB of them); a request with a deadline starts it, and it ends at the
    deadline once nothing is in flight."""

    def expiring(connection: Connection) -> bool:
        assert connection._nursery is not None
        return any("_expire_calls" in task.name for task in connection._nursery.child_tasks)

    async with connected(serving()) as (client, _):
        assert not expiring(client)
        await client.request(Opcode.HEARTBEAT, heartbeat("a"), timeout=5)
        assert expiring(client)  # until the deadline it woke for
        await trio.sleep(6)
        assert not expiring(client)
        # and it comes back for the next one
        await client.request(Opcode.HEARTBEAT, heartbeat("b"), timeout=5)
        assert expiring(client)


async def test_cancelled_request_is_abandoned() -> None:
    release = trio.Event()

    async def slow(request: Request, responder: Responder) -> None:
        if client_id(request) != "x":
            return await echo(request, responder)
        await release.wait()
        await responder.send(messages.HeartbeatResponse(client_id="late"))

    async with connected(serving(slow)) as (client, server):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.request, Opcode.HEARTBEAT, heartbeat("x"))
            await trio.testing.wait_all_tasks_blocked()
            assert server.serving == 1
            nursery.cancel_scope.cancel()
        assert client.in_flight == 0
        release.set()
        await client.ping()
        await client.ping()
        assert client.engine.discarded == {"late_response": 1}


@pytest.mark.parametrize("tcp", [False, True], ids=["memory", "tcp"])
async def test_connection_loss_fails_every_pending_request(tcp: bool) -> None:
    never = trio.Event()

    async def stuck(request: Request, responder: Responder) -> None:
        await never.wait()

    errors: list[BaseException] = []
    async with connected(serving(stuck), tcp=tcp) as (client, server):

        async def call() -> None:
            try:
                await client.request(Opcode.HEARTBEAT, heartbeat("x"))
            except ConnectionClosed as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            assert server.serving == 5
            await server.aclose()
        assert client.closed
        with pytest.raises(ConnectionClosed, match="connection to server closed"):
            await client.ping()
    assert len(errors) == 5
    assert all("connection to server closed" in str(error) for error in errors)


async def test_goaway_refuses_new_requests_and_lets_in_flight_finish() -> None:
    release = trio.Event()

    async def slow(request: Request, responder: Responder) -> None:
        if client_id(request) != "x":
            return await echo(request, responder)
        await release.wait()
        await responder.send(messages.HeartbeatResponse(client_id="done"))

    async with connected(serving(slow)) as (client, server):
        async with trio.open_nursery() as nursery:
            result: list[str] = []

            async def call() -> None:
                response = await client.request(Opcode.HEARTBEAT, heartbeat("x"))
                result.append(response.header.client_id)

            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            await server.send_goaway(ErrorCode.NONE, "restarting")
            await trio.testing.wait_all_tasks_blocked()
            assert client.goaway_received
            with pytest.raises(ShuttingDownError, match="restarting"):
                await client.request(Opcode.HEARTBEAT, heartbeat("new"))
            release.set()
        assert result == ["done"]
        # Nothing left in flight: the client closes its side.
        await client.wait_closed()
        assert "GOAWAY" in client.close_reason


async def test_handler_failures_answer_and_keep_the_connection() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        case = client_id(request)
        if case == "crash":
            raise ZeroDivisionError("boom")
        if case == "throttle":
            raise ThrottledError("slow down")
        if case == "silent":
            await responder.send(messages.HeartbeatResponse(client_id="x"), end=False)
            return
        if case == "too large":
            # a header over the 2^24 - 1 the frame can carry cannot be sent
            await responder.send(messages.HeartbeatResponse(client_id="x" * (1 << 24)))
            return
        await echo(request, responder)

    async with connected(serving(handler)) as (client, _):
        with pytest.raises(UnknownServerError, match="internal server error"):
            await client.request(Opcode.HEARTBEAT, heartbeat("crash"))
        # answered at once, not left to the request's deadline
        with trio.fail_after(5), pytest.raises(FrameTooLargeError, match="ask for fewer items"):
            await client.request(Opcode.HEARTBEAT, heartbeat("too large"), timeout=60)
        with pytest.raises(ThrottledError, match="slow down"):
            await client.request(Opcode.HEARTBEAT, heartbeat("throttle"))
        with pytest.raises(UnknownServerError, match="no complete response"):
            await client.request(Opcode.HEARTBEAT, heartbeat("silent"))
        with pytest.raises(UnsupportedOperationError, match="test does not serve APPEND"):
            await client.request(Opcode.APPEND, b"")
        assert (await client.request(Opcode.HEARTBEAT, heartbeat("ok"))).header.client_id == "ok"


async def test_a_connection_without_handler_answers_only_ping() -> None:
    async with connected(None) as (client, server):
        assert await server.ping() >= 0
        with pytest.raises(UnsupportedOperationError):
            await client.request(Opcode.HEARTBEAT, heartbeat("x"))


async def test_observer_sees_frames_and_requests() -> None:
    from sbp.observer import ConnectionObserver

    class Recorder(ConnectionObserver):
        def __init__(self) -> None:
            self.events: list[tuple[object, ...]] = []

        def connection_opened(self) -> None:
            self.events.append(("opened",))

        def connection_closed(self) -> None:
            self.events.append(("closed",))

        def frame_received(self, opcode: int, nbytes: int) -> None:
            self.events.append(("received", opcode, nbytes))

        def frame_sent(self, opcode: int, nbytes: int) -> None:
            self.events.append(("sent", opcode, nbytes))

        def request_started(self, opcode: int) -> None:
            self.events.append(("started", opcode))

        def request_finished(self, opcode: int, seconds: float, error_code: ErrorCode) -> None:
            self.events.append(("finished", opcode, error_code))

    recorder = Recorder()
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server = Connection(server_stream, side=Side.SERVER, observer=recorder)
    client = Connection(client_stream, side=Side.CLIENT)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        await client.request(Opcode.PING, b"", b"12345")
        with pytest.raises(UnsupportedOperationError):
            await client.request(Opcode.HEARTBEAT, heartbeat("x"))
        await server.aclose()
        nursery.cancel_scope.cancel()
    kinds = [event for event in recorder.events if event[0] != "sent"]
    assert kinds[:4] == [
        ("opened",),
        ("received", Opcode.PING, 25),
        ("started", Opcode.PING),
        ("finished", Opcode.PING, ErrorCode.NONE),
    ]
    assert ("finished", Opcode.HEARTBEAT, ErrorCode.UNSUPPORTED_OPERATION) in kinds
    assert kinds[-1] == ("closed",)
    assert ("sent", Opcode.PING, 25) in recorder.events


async def test_keepalive_detects_a_dead_peer(autojump_clock: trio.abc.Clock) -> None:
    # The peer's socket stays open but nothing answers: a hung process.
    client_stream, dead_stream = trio.testing.memory_stream_pair()
    limits = ConnectionLimits(keepalive_interval=30, keepalive_timeout=5)
    client = Connection(client_stream, side=Side.CLIENT, limits=limits, peer="dead")
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        with pytest.raises(ConnectionClosed, match="did not answer a keepalive PING within 5 s"):
            await client.request(Opcode.HEARTBEAT, heartbeat("x"))
        assert trio.current_time() == pytest.approx(35, abs=0.1)
    await dead_stream.aclose()


async def test_keepalive_keeps_a_live_idle_connection(autojump_clock: trio.abc.Clock) -> None:
    limits = ConnectionLimits(keepalive_interval=30, keepalive_timeout=5)
    async with connected(None, client_limits=limits) as (client, _):
        await trio.sleep(300)
        assert not client.closed
        assert await client.ping() >= 0


async def test_idle_timeout_closes_only_when_nothing_in_flight(
    autojump_clock: trio.abc.Clock,
) -> None:
    release = trio.Event()

    async def slow(request: Request, responder: Responder) -> None:
        if client_id(request) != "x":
            return await echo(request, responder)
        await release.wait()
        await responder.send(messages.HeartbeatResponse(client_id="done"))

    limits = ConnectionLimits(idle_timeout=60)
    async with connected(serving(slow), server_limits=limits) as (
        client,
        server,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.request, Opcode.HEARTBEAT, heartbeat("x"))
            await trio.sleep(200)
            assert not server.closed  # a request is in flight, however long
            release.set()
        await trio.sleep(59)
        assert not server.closed
        await server.wait_closed()
        assert server.close_reason == "idle for 60 s"
        assert trio.current_time() == pytest.approx(260, abs=0.5)


async def test_keepalive_traffic_does_not_count_as_activity(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Both ends ping each other every 10 s; only the server has an idle timeout.
    keepalive = ConnectionLimits(keepalive_interval=10, keepalive_timeout=5)
    limits = ConnectionLimits(idle_timeout=100, keepalive_interval=10, keepalive_timeout=5)
    async with connected(serving(), server_limits=limits, client_limits=keepalive) as (
        client,
        server,
    ):
        await client.request(Opcode.HEARTBEAT, heartbeat("x"))
        await client.ping()
        await server.wait_closed()
        assert server.close_reason == "idle for 100 s"
        assert trio.current_time() == pytest.approx(100, abs=0.5)


async def test_request_before_run_and_after_close() -> None:
    client_stream, _ = trio.testing.memory_stream_pair()
    client = Connection(client_stream, side=Side.CLIENT)
    with pytest.raises(RuntimeError, match="not running"):
        await client.request(Opcode.PING)
    await client.aclose()
    with pytest.raises(ConnectionClosed):
        await client.request(Opcode.PING)


def test_limits_validate() -> None:
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        ConnectionLimits(max_concurrent_requests=0)


async def test_a_throttle_in_an_answer_holds_the_next_request_of_its_kind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """SPEC §12 from both ends: an answer's throttle_time_ms makes the
    client send its next request of that opcode no sooner (others go at
    once), and a server's ``hold_reads`` reads nothing more meanwhile."""
    arrivals: list[tuple[str, float]] = []

    async def throttling(request: Request, responder: Responder) -> None:
        arrivals.append(("describe", trio.current_time()))
        await responder.send(messages.DescribeClusterResponse(throttle_time_ms=300))

    async def holding(request: Request, responder: Responder) -> None:
        arrivals.append((client_id(request), trio.current_time()))
        if client_id(request) == "hold":
            request.connection.hold_reads(0.5)
        await responder.send(messages.HeartbeatResponse(client_id=client_id(request)))

    dispatcher = serving(holding)
    dispatcher.register(Opcode.DESCRIBE_CLUSTER, throttling)
    async with connected(dispatcher) as (client, _):
        ask = messages.DescribeClusterRequest(timeout_ms=5000)
        await client.request(Opcode.DESCRIBE_CLUSTER, ask, timeout=5)
        await client.request(Opcode.HEARTBEAT, heartbeat("other"), timeout=5)  # not held
        await client.request(Opcode.DESCRIBE_CLUSTER, ask, timeout=5)
        (_, first), (_, other), (_, second) = arrivals
        assert other - first < 0.1
        assert second - first >= 0.3
        arrivals.clear()
        await client.request(Opcode.HEARTBEAT, heartbeat("hold"), timeout=5)
        await client.request(Opcode.HEARTBEAT, heartbeat("next"), timeout=5)
        (_, held), (_, after) = arrivals
        assert after - held >= 0.5


async def test_a_throttle_never_times_out_a_client_that_waits_as_told(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A throttle longer than a request's timeout: the next request of its
    kind waits it out and then has its whole timeout; a request already in
    flight on the connection (which the server does not read meanwhile)
    has its deadline moved out by the hold, so neither times out."""

    async def throttling(request: Request, responder: Responder) -> None:
        await responder.send(messages.DescribeClusterResponse(throttle_time_ms=5000))

    async def slow(request: Request, responder: Responder) -> None:
        await trio.sleep(2)
        await responder.send(messages.HeartbeatResponse(client_id=client_id(request)))

    dispatcher = serving(slow)
    dispatcher.register(Opcode.DESCRIBE_CLUSTER, throttling)
    async with connected(dispatcher) as (client, _):
        ask = messages.DescribeClusterRequest(timeout_ms=5000)
        answered: list[str] = []

        async def in_flight() -> None:
            response = await client.request(Opcode.HEARTBEAT, heartbeat("slow"), timeout=1.5)
            answered.append(response.header.client_id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_flight)
            await trio.sleep(0.1)
            await client.request(Opcode.DESCRIBE_CLUSTER, ask, timeout=5)
            told_at = trio.current_time()
        assert answered == ["slow"]
        await client.request(Opcode.DESCRIBE_CLUSTER, ask, timeout=1)  # 3 s later than asked
        assert trio.current_time() >= told_at + 5


class _SchedulingCounter(trio.abc.Instrument):
    """How many times the tasks named ``sender`` were woken."""

    def __init__(self) -> None:
        self.wakeups = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task.name == "sender":
            self.wakeups += 1


async def test_senders_over_the_high_water_mark_are_woken_one_at_a_time() -> None:
    """64 requests of 64 KiB in flight leave most of them waiting for room
    below the 1 MiB mark: room wakes one at a time, not all of them to find
    it taken again (that cost a client more CPU than sending)."""
    client, server, _ = await over_small_socket_buffers(echo)
    senders = 64
    payload = bytes(64 * 1024)
    answered: list[str] = []
    counter = _SchedulingCounter()

    async def sender(index: int) -> None:
        response = await client.request(Opcode.HEARTBEAT, heartbeat(str(index)), payload)
        answered.append(response.header.client_id)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        trio.lowlevel.add_instrument(counter)
        try:
            async with trio.open_nursery() as calls:
                for index in range(senders):
                    calls.start_soon(sender, index, name="sender")
        finally:
            trio.lowlevel.remove_instrument(counter)
        nursery.cancel_scope.cancel()
    assert sorted(answered, key=int) == [str(i) for i in range(senders)]
    # each sender runs when started, when woken with room (or once more,
    # finding it taken), and when its answer comes
    assert counter.wakeups <= 4 * senders
