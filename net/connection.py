"""One SBP connection over any trio stream, usable by either end: a thin trio
driver around the sans-IO engine (``sbp.connection.ConnectionEngine``), which
makes every protocol decision.

- One reader task hands received bytes to the engine and acts on its events:
  a request of the peer goes to the handler (``RequestHandler.start``), which
  answers at once or returns work for a task of its own; a response goes to
  the request of ours waiting for it.
- One writer task sends what the engine queued, small frames joined into one
  ``send_all`` (a system call per frame saved when many are in flight), a
  large answer's payload written as it is with its frame's head and
  checksum in one ``sendmsg`` (no copy of it; joined under TLS). A frame
  that is the connection's only business (one request in flight, nothing
  else queued) is written when it is queued, without waking the writer;
  so is a FETCH answer borrowed from LMDB's map whenever nothing waits
  ahead of it (``queue_borrowed_response``).
- Backpressure: the reader reads only while the engine ``wants_data``, that
  is while a request slot is free and no more than its high-water mark of
  bytes waits to be sent; ``Responder.send`` and our own requests wait for
  room below the mark. A peer that floods requests, or does not read its
  answers, waits in its own socket buffer, not in our memory.
- Server-wide byte budgets (``net.budget``): bytes of requests received and
  not yet served are counted against the server's request budget, and a
  connection holding some of a spent budget is not read from; handlers
  reserve answer bytes through ``Responder.answer_room``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import trio

from sbp.connection import (
    CallFailed,
    ConnectionEngine,
    ConnectionTerminated,
    Event,
    GoAwayReceived,
    RequestReceived,
    ResponseReceived,
    Side,
    describe_goaway,
)
from sbp.enums import ErrorCode
from sbp.errors import ConnectionClosed, ProtocolError, wire_code
from sbp.frames import READ_SIZE, Buffer
from sbp.observer import NULL_OBSERVER, ConnectionObserver

from .acl import ANONYMOUS
from .address import peer_name
from .budget import ConnectionBudget, ServerBudgets
from .calls import Caller
from .limits import CLIENT_LIMITS, ConnectionLimits
from .ratelog import RateLimitedLog
from .request import Request, RequestHandler, Responder, serve_in_task
from .timers import IdleClock, close_when_idle, keep_alive
from .tls import describe_link_error

logger = logging.getLogger(__name__)
#: frames that end a connection (FRAME_TOO_LARGE …): logged, but not a flood
_bad_frames = RateLimitedLog(logger)

#: bytes asked of a non-socket stream per read: the decoder's own read size
RECEIVE_CHUNK = READ_SIZE
#: reads a connection makes straight from its socket before it lets the event
#: loop run the other tasks once
READS_PER_YIELD: Final = 8
#: TCP states (linux/tcp_states.h) in which the peer will send nothing more:
#: CLOSE_WAIT and CLOSE
_PEER_GONE_STATES = frozenset({7, 8})
#: how often a connection waiting for the request budget checks its peer
_BUDGET_RECHECK_S = 1.0
#: queued frames are joined into one write up to this many bytes; larger
#: frames are written alone rather than copied again
COALESCE_BYTES = 64 * 1024
#: buffers one sendmsg takes at most (Linux's UIO_MAXIOV)
_MAX_IOV: Final = 1024
#: Linux's value, should the socket module not name it
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def _queue_whole_answers_in_the_kernel(stream: trio.abc.Stream) -> None:
    """Undo trio's 16 KiB ``TCP_NOTSENT_LOWAT`` on the TCP socket under
    ``stream`` (TLS or not): back to the kernel's default, where a send takes
    as much as the socket buffer holds.

    trio keeps unsent bytes low so that an application can reorder what it
    sends; this connection sends its frames in order anyway. With the low
    mark, a megabyte FETCH answer to a reader that is a little behind went
    out in pieces of about 160 KiB, each a system call and a round of the
    event loop: reading 64 KiB batches back took 587-633 µs of the data
    node's CPU per MB without it against 742-815 µs with it
    (docs/benchmarks.md, "Catch-up reads")."""
    tcp = getattr(stream, "transport_stream", stream)
    if isinstance(tcp, trio.SocketStream):
        # 0 means the system default; not TCP (a socketpair in tests) or not Linux: as is
        with contextlib.suppress(OSError):
            tcp.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, 0)


async def _send_gathered(sock: trio.socket.SocketType, pieces: list[Buffer]) -> None:
    """Write every piece, in order, with as few ``sendmsg`` calls as the
    socket buffer allows."""
    remaining = [memoryview(piece) for piece in pieces]
    while remaining:
        sent = await sock.sendmsg(remaining)
        while remaining and sent >= remaining[0].nbytes:
            sent -= remaining.pop(0).nbytes
        if sent:
            remaining[0] = remaining[0][sent:]


def _send_now(sock: trio.socket.SocketType, pieces: list[Buffer]) -> int:
    """Write as much of ``pieces`` as the socket takes without waiting, in
    ``sendmsg`` calls of at most ``_MAX_IOV`` buffers; the bytes written. An
    error writes nothing more and is left to the writer task to meet."""
    # trio's sendmsg always yields to the scheduler; this must not: the
    # buffers are valid only until the caller returns
    # (writev on trio's non-blocking descriptor: wrapping it in a socket
    # object for sendmsg cost a getsockname call per answer)
    fd = sock.fileno()
    if fd < 0:  # closed: the writer task reports it
        return 0
    sent = 0
    try:
        for first in range(0, len(pieces), _MAX_IOV):
            group = pieces[first : first + _MAX_IOV]
            taken = os.writev(fd, group)
            sent += taken
            if taken < sum(len(piece) for piece in group):
                break
    except OSError:  # BlockingIOError: the socket buffer is full
        pass
    return sent


def _unsent(pieces: list[Buffer], sent: int) -> list[Buffer]:
    """What is left of ``pieces`` once their first ``sent`` bytes are written."""
    for index, piece in enumerate(pieces):
        if sent < len(piece):
            return [memoryview(piece)[sent:], *pieces[index + 1 :]]
        sent -= len(piece)
    return []


def _peer_hung_up(sock: trio.socket.SocketType) -> bool:
    """Whether the peer has closed its end, without reading what it sent
    before (its FIN waits behind that data, so a peek would not see it):
    the kernel's TCP state is CLOSE_WAIT, or the socket is gone."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
    except OSError:
        return True
    return info[0] in _PEER_GONE_STATES


class Connection:
    """One SBP connection; see the module docstring.

    ``handler`` serves the peer's requests (a ``net.server.Dispatcher``);
    without one every request but PING is answered UNSUPPORTED_OPERATION.
    Start it with ``await nursery.start(connection.run)``.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        side: Side,
        handler: RequestHandler | None = None,
        limits: ConnectionLimits = CLIENT_LIMITS,
        observer: ConnectionObserver | None = None,
        peer: str = "",
        budgets: ServerBudgets | None = None,
        principal: str = ANONYMOUS,
    ) -> None:
        self.side = side
        self.peer = peer or peer_name(stream)
        #: who the peer is, from its certificate (``net.authz``)
        self.principal = principal
        self.limits = limits
        self._stream = stream
        #: the plain TCP socket under ``stream``, None under TLS
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        #: reads made since the reader last yielded to the event loop
        self._reads_unyielded = 0
        _queue_whole_answers_in_the_kernel(stream)
        self._handler = handler
        self._observer = observer or NULL_OBSERVER
        self._engine = ConnectionEngine(
            side,
            max_frame_length=limits.max_frame_length,
            max_concurrent_requests=limits.max_concurrent_requests,
            serves_requests=handler is not None,
            observer=self._observer,
            peer=self.peer,
        )
        self.caller = Caller(self)
        # Requests of ours: ``Caller.request`` (a whole response sequence),
        # ``Caller.stream`` (its frames as they arrive) and ``Caller.ping``.
        self.request = self.caller.request
        self.stream = self.caller.stream
        self.ping = self.caller.ping
        self.idle = IdleClock(self._engine)
        self._nursery: trio.Nursery | None = None
        self._started = self._closed = False
        self._close_reason = ""
        self._data_queued = trio.Event()  # wakes the writer
        #: the reader waits here for the engine to want data
        self._room = trio.lowlevel.ParkingLot()
        #: senders wait here for room below the high-water mark, woken one
        #: at a time (``wait_room``)
        self._send_room = trio.lowlevel.ParkingLot()
        self._quiet = trio.lowlevel.ParkingLot()  # wait_quiet
        self._writer_done = trio.Event()
        #: the writer task is writing frames it took from the engine
        self._writing = False
        self._finished = trio.Event()
        self.last_received = 0.0
        #: nothing is read from the peer before this trio time (a quota's throttle)
        self._reads_held_until = 0.0
        #: what this connection holds of the server's byte budgets
        self.budget = ConnectionBudget(budgets, RECEIVE_CHUNK) if budgets else None

    # -- public state ---------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def goaway_received(self) -> bool:
        """The peer sent GOAWAY: no new requests may go out on this connection."""
        return self._engine.goaway_received is not None

    @property
    def in_flight(self) -> int:
        """Our requests awaiting responses plus the peer's requests being served."""
        return len(self.caller.calls) + self._engine.serving

    @property
    def serving(self) -> int:
        return self._engine.serving

    @property
    def close_reason(self) -> str:
        return self._close_reason

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Connection {self.side.value} peer={self.peer} {state} in_flight={self.in_flight}>"

    # -- lifetime -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until the connection ends; then every pending request fails
        with ``ConnectionClosed``. Network failures end it quietly."""
        if self._started:
            raise RuntimeError("a connection runs once")
        self._started = True
        self.last_received = self.idle.last = trio.current_time()
        self._observer.connection_opened()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._write_loop)
                if self.limits.keepalive_interval is not None:
                    nursery.start_soon(
                        keep_alive,
                        self,
                        self.limits.keepalive_interval,
                        self.limits.keepalive_timeout,
                    )
                if self.limits.idle_timeout is not None:
                    nursery.start_soon(close_when_idle, self, self.limits.idle_timeout)
                task_status.started()
                await self._read_loop()
                # No answer can arrive any more: fail what waits for one, then
                # let what is queued (a GOAWAY) go out.
                self._mark_closed(self._close_reason)
                with trio.move_on_after(self.limits.drain_timeout):
                    await self._writer_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._mark_closed(self._close_reason or "connection ended")
            self._engine.release_buffers()
            if self.budget is not None:
                self.budget.release()
            await trio.aclose_forcefully(self._stream)
            self._finished.set()
            self._observer.connection_closed()

    async def aclose(self) -> None:
        """Close now: queued frames get a moment to go out, requests in flight fail."""
        if not self._started:
            self._started = True
            self._mark_closed("closed before it ran")
            await trio.aclose_forcefully(self._stream)
            self._finished.set()
            return
        if not self._finished.is_set():
            self._set_reason("closed locally")
            self._mark_closed(self._close_reason)
            with trio.move_on_after(min(1.0, self.limits.drain_timeout)):
                await self._writer_done.wait()
            self.shutdown(self._close_reason)
            await self._finished.wait()

    async def drain(self, timeout: float | None = None) -> None:
        """Graceful close: GOAWAY, wait (at most ``timeout``) for requests in
        flight in either direction, then close."""
        if self._closed:
            return
        if not self._engine.goaway_sent:
            self._engine.send_goaway(ErrorCode.SHUTTING_DOWN, "shutting down")
            self._data_queued.set()
        with trio.move_on_after(self.limits.drain_timeout if timeout is None else timeout):
            await self.wait_quiet()
        await self.aclose()

    async def send_goaway(self, code: ErrorCode = ErrorCode.NONE, message: str = "") -> None:
        """Tell the peer to send no new requests here (see ``drain``)."""
        self.check_open()
        self._engine.send_goaway(code, message)
        self._data_queued.set()

    async def wait_quiet(self) -> None:
        """Return once nothing is in flight (or the connection is closed)."""
        while self.in_flight and not self._closed:
            await self._quiet.park()

    async def wait_closed(self) -> None:
        await self._finished.wait()

    # -- answers (through ``Responder``) --------------------------------------

    def queue_response(
        self,
        responder: Responder,
        header: bytes,
        payload: bytes | bytearray | memoryview,
        *,
        end: bool,
        system_error: bool = False,
    ) -> bool:
        """Queue a response frame; False when the connection is gone (nobody
        to answer). The request is over once its last frame is queued."""
        self._engine.send_response(
            responder.stream_id, header, payload, end=end, system_error=system_error
        )
        self._write_or_wake_writer()
        return self._answer_queued(responder, end)

    def queue_borrowed_response(
        self, responder: Responder, header: bytes, payload: Sequence[Buffer], *, end: bool
    ) -> bool:
        """``queue_response`` for a payload in buffers valid during this call
        only (record batches in LMDB's map): written to the socket at once
        when nothing else waits to be, so those bytes are never copied in
        this process; what the socket does not take, and the whole payload
        when frames wait ahead of it or under TLS, is copied and queued."""
        engine = self._engine
        if self._socket is None or self._writing or engine.outgoing_bytes or self._closed:
            return self.queue_response(responder, header, b"".join(payload), end=end)
        pieces = engine.send_borrowed_response(responder.stream_id, header, payload, end=end)
        self._write_at_once(self._socket, pieces, copy_rest=True)
        return self._answer_queued(responder, end)

    def _answer_queued(self, responder: Responder, end: bool) -> bool:
        """Bookkeeping once an answer frame is queued or written; False when
        the connection is gone."""
        if self.budget is not None:
            self.budget.hold_outgoing(self._engine.outgoing_bytes)
        if end:
            self._request_done(responder)
        return not self._closed

    async def wait_room(self) -> None:
        """Until no more than the high-water mark of bytes waits to be sent.

        Room wakes one sender, and each sender that finds room wakes the
        next as it goes: a client with 64 requests of 64 KiB in flight has
        most of them waiting here, and waking them all whenever a write
        made room cost it more CPU than sending the requests."""
        engine = self._engine
        while engine.outgoing_bytes > engine.high_water and not self._closed:
            await self._send_room.park()
        if self._send_room:
            # this one queues its bytes before the next runs: the next
            # finds room only if there is room for both
            self._send_room.unpark()

    def _made_room(self) -> None:
        """Bytes were written or a slot came free: the reader and a sender
        may go on."""
        if self._room:
            self._room.unpark_all()
        if self._send_room and self._engine.outgoing_bytes <= self._engine.high_water:
            self._send_room.unpark()

    def _request_done(self, responder: Responder) -> None:
        if responder.charge and self.budget is not None:
            self.budget.request_done(responder.charge)
            responder.charge = 0
        self._observer.request_finished(
            responder.opcode, trio.current_time() - responder.started, responder.error_code
        )
        self.after_request()
        self._made_room()

    # -- writing --------------------------------------------------------------

    async def _write_loop(self) -> None:
        engine = self._engine
        try:
            while True:
                frames = engine.data_to_send(COALESCE_BYTES)
                if not frames:
                    if self._closed:
                        return
                    self._data_queued = trio.Event()
                    self._made_room()
                    await self._data_queued.wait()
                    continue
                self.idle.note()
                self._writing = True
                try:
                    await self._send(frames)
                finally:
                    self._writing = False
                if self.budget is not None:
                    self.budget.hold_outgoing(engine.outgoing_bytes)
                if engine.outgoing_bytes <= engine.high_water:
                    self._made_room()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.shutdown(f"send failed: {describe_link_error(exc)}")
        finally:
            self._writer_done.set()

    async def _send(self, pieces: list[Buffer]) -> None:
        """Write what ``data_to_send(COALESCE_BYTES)`` took: small frames
        joined; a frame larger than that, which it takes alone, as its head,
        payload and checksum in one ``sendmsg`` on a plain socket (no copy of
        the payload), or joined under TLS."""
        if len(pieces) == 1:
            await self._stream.send_all(pieces[0])
            return
        if self._socket is None or sum(len(piece) for piece in pieces) <= COALESCE_BYTES:
            await self._stream.send_all(b"".join(pieces))
            return
        try:
            await _send_gathered(self._socket, pieces)
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    # -- reading --------------------------------------------------------------

    async def _read_loop(self) -> None:
        engine = self._engine
        stream = self._stream
        # TCP is read straight into the decoder's buffer (readv): one copy
        # of each received byte fewer than receive_some + feed.
        sock = self._socket
        events: list[Event] = []
        while True:
            await self._wait_reads_held()
            for index, event in enumerate(events):
                if index and self._reads_held_until:
                    # a request this read brought put the peer over its
                    # quota: the ones after it wait as unread ones do
                    await self._wait_reads_held()
                self._on_event(event)
            events = []
            if engine.outgoing_bytes:
                self._data_queued.set()
            if engine.terminated is not None:
                return
            while not engine.wants_data and not self._closed:
                # Backpressure: every slot taken, or the peer is not reading.
                await self._room.park()
                events = engine.next_events()  # a request waiting for a slot
                if events:
                    break
            if events:
                continue
            budget = self.budget
            if budget is not None and not budget.may_read(engine.growth):
                # The server's budget of request bytes is spent, or has no
                # room for the next read of the frame being received: read
                # on once some are given back. A peer that hangs up
                # meanwhile is noticed within a second.
                with trio.move_on_after(_BUDGET_RECHECK_S):
                    await budget.wait_requests_given_back()
                if sock is not None and _peer_hung_up(sock):
                    self._set_reason(f"{self.peer} closed the connection")
                    return
                continue
            try:
                if sock is not None:
                    nbytes, events = await self._receive_into_engine(sock)
                else:
                    data = await stream.receive_some(RECEIVE_CHUNK)
                    nbytes = len(data)
                    events = engine.feed(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._set_reason(f"receive failed: {describe_link_error(exc)}")
                return
            if not nbytes:
                self._set_reason(f"{self.peer} closed the connection")
                return
            if self.budget is not None:
                self.budget.hold_partial(engine.holding)
            self.last_received = trio.current_time()
            self.idle.note()

    async def _wait_reads_held(self) -> None:
        """SPEC §12: over a quota, nothing more from the peer is taken in
        until the hold ends (answers served meanwhile may hold it longer)."""
        if self._reads_held_until:
            while (until := self._reads_held_until) > trio.current_time():
                await trio.sleep_until(until)
            self._reads_held_until = 0.0

    async def _receive_into_engine(self, sock: trio.socket.SocketType) -> tuple[int, list[Event]]:
        """One read from the socket straight into the engine's buffer (whose
        size adapts to the traffic: a connection that only ever sends small
        requests, or none, holds 4 KiB, not 64)."""
        engine = self._engine
        target = engine.receive_buffer()
        if self.budget is not None:
            # counted before the read waits, so that readers after this one
            # see the room it just took
            self.budget.hold_partial(engine.holding)
        # What the socket holds already is read without a round of the event
        # loop per read (trio's recv_into yields after every read): with many
        # requests in flight, that round was most of a request's scheduling
        # cost. The loop still runs the other tasks every READS_PER_YIELD reads.
        if self._reads_unyielded >= READS_PER_YIELD:
            self._reads_unyielded = 0
            await trio.lowlevel.checkpoint()
        while True:
            try:
                nbytes = os.readv(sock.fileno(), (target,))
                break
            except BlockingIOError:
                self._reads_unyielded = 0
                await trio.lowlevel.wait_readable(sock)
        self._reads_unyielded += 1
        return nbytes, engine.received(nbytes)

    def _on_event(self, event: Event) -> None:
        match event:
            case RequestReceived():
                self._serve(event)
            case ResponseReceived(stream_id, frame):
                self.caller.calls[stream_id].put(frame)
            case CallFailed(stream_id, error):
                call = self.caller.calls.get(stream_id)
                if call is not None:
                    call.ended = True
                    call.fail(error)
            case GoAwayReceived(code, text):
                self._set_reason(describe_goaway(self.peer, code, text))
                self.after_request()
            case ConnectionTerminated(code, text):
                self._set_reason(f"bad frame from {self.peer}: {text}")
                _bad_frames.warning(
                    code.name, "%s from %s: %s; closing the connection", code.name, self.peer, text
                )

    def _serve(self, event: RequestReceived) -> None:
        assert self._handler is not None  # the engine answers when there is none
        request = Request(self, event, self.last_received)
        responder = Responder(self, event.opcode, event.stream_id)
        if self.budget is not None:
            responder.charge = self.budget.request_received(len(event.header) + len(event.payload))
        try:
            work = self._handler.start(request, responder)
        except ProtocolError as exc:
            responder.send_error_nowait(
                wire_code(exc.code), exc.message, leader_addr=getattr(exc, "leader_addr", "")
            )
            return
        except Exception:
            logger.exception("%s handler failed (peer %s)", event.opcode.name, self.peer)
            responder.send_error_nowait(ErrorCode.UNKNOWN, "internal server error")
            return
        if work is not None:
            assert self._nursery is not None
            self._nursery.start_soon(serve_in_task, work, request, responder)

    # -- closing --------------------------------------------------------------

    @property
    def engine(self) -> ConnectionEngine:
        """The protocol engine this connection drives."""
        return self._engine

    def start_task(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` in a task of the connection's (ended with it)."""
        assert self._nursery is not None  # a running connection's
        self._nursery.start_soon(fn)

    def wake_writer(self) -> None:
        """A request of ours was queued."""
        self._write_or_wake_writer()

    def _write_or_wake_writer(self) -> None:
        """Write the frame just queued at once when it is the connection's
        only business (one request in flight, nothing else queued, the
        writer task idle): no round of the event loop between it and the
        socket, which is most of a lone request's time in Python. Otherwise
        wake the writer task, which joins the small frames queued meanwhile
        into one write."""
        engine = self._engine
        sock = self._socket
        if (
            sock is None
            or self._writing
            or self._closed
            or engine.queued_frames != 1
            or self.in_flight > 1
        ):
            self._data_queued.set()
            return
        self._write_at_once(sock, engine.data_to_send(), copy_rest=False)

    def _write_at_once(
        self, sock: trio.socket.SocketType, pieces: list[Buffer], *, copy_rest: bool
    ) -> None:
        """Write what the socket takes of ``pieces`` now; queue the rest first
        for the writer task (copied when the pieces are borrowed)."""
        unsent = _unsent(pieces, _send_now(sock, pieces))
        self.idle.note()
        if unsent:
            self._engine.queue_unsent((b"".join(unsent),) if copy_rest else unsent)
            self._data_queued.set()

    def hold_reads(self, seconds: float) -> None:
        """Read nothing more from the peer for ``seconds`` (a quota's throttle,
        SPEC §12); what was read already is served."""
        self._reads_held_until = max(self._reads_held_until, trio.current_time() + seconds)

    def check_open(self) -> None:
        if not self._started:
            raise RuntimeError("the connection is not running; start it with nursery.start(run)")
        if self._closed:
            raise ConnectionClosed(self._closed_message())

    def after_request(self) -> None:
        """Bookkeeping when a request in either direction finishes."""
        if self.in_flight:
            return
        self._quiet.unpark_all()
        if self._engine.goaway_received is not None and not self._closed:
            # The peer is going away and nothing is left to finish here.
            self.shutdown(self._close_reason)

    def _set_reason(self, reason: str) -> None:
        if not self._close_reason:
            self._close_reason = reason

    def shutdown(self, reason: str) -> None:
        self._mark_closed(reason)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _mark_closed(self, reason: str) -> None:
        if self._closed:
            return
        self._set_reason(reason)
        self._closed = True
        self.caller.fail_all(ConnectionClosed(self._closed_message()))
        self._data_queued.set()
        self._room.unpark_all()
        self._send_room.unpark_all()
        self._quiet.unpark_all()

    def _closed_message(self) -> str:
        return f"connection to {self.peer} closed: {self._close_reason or 'closed'}"
