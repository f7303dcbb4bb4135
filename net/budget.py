"""Byte budgets: how much memory all of a server's connections together may
hold for requests and for answers, so that no client, or set of clients,
can make a server grow without bound.

- ``ServerBudgets.requests`` counts bytes of requests received and not yet
  served: frames half received (a peer that announces 16 MiB and sends 15)
  and whole requests whose handler still runs. Once it is spent, a
  connection that already holds some of it is not read from until it is
  given back (as Kafka's ``queued.max.request.bytes``); a connection holding
  less than a read's worth may still read that much, so a small request is
  never starved by large ones.
- ``ServerBudgets.answers`` counts bytes a handler has read for an answer
  that is not yet written to the socket (FETCH). A handler takes its share
  before reading and gives it back once the answer is (nearly) sent, so a
  peer that does not read its answers holds at most its connection's share,
  and a connection holding next to nothing (``SMALL_ANSWER_BYTES``) may use
  a reserve past the budget (``SMALL_ANSWER_RESERVE``), so that the others
  do not make it wait.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

MiB = 1024 * 1024
#: node-wide bytes of requests being received or served
DEFAULT_REQUEST_BYTES = 256 * MiB
#: node-wide bytes of answers read but not yet written
DEFAULT_ANSWER_BYTES = 256 * MiB
#: what one connection may hold of the answer budget: two full frames
DEFAULT_CONNECTION_ANSWER_BYTES = 16 * MiB
#: a connection holding no more than this of the answer budget (reserved
#: and queued) may go past the budget by up to ``SMALL_ANSWER_RESERVE``
SMALL_ANSWER_BYTES = 64 * 1024
SMALL_ANSWER_RESERVE = 32 * MiB


class ByteBudget:
    """A count of bytes in use against a limit, with waiting for room.

    ``take`` never refuses a share larger than the whole limit when nothing
    is in use: one oversized request proceeds alone rather than never."""

    __slots__ = ("_room", "limit", "peak", "used")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a byte budget must be at least 1 byte")
        self.limit = limit
        self.used = 0
        #: the most in use at once since it was last set (to ``used``)
        self.peak = 0
        self._room = trio.lowlevel.ParkingLot()

    @property
    def spent(self) -> bool:
        return self.used >= self.limit

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer, when negative) without waiting."""
        if not nbytes:
            return
        self.used += nbytes
        if self.used > self.peak:
            self.peak = self.used
        if nbytes < 0 and self._room:
            self._room.unpark_all()

    async def wait_change(self) -> None:
        """Until some bytes are given back (the caller checks again)."""
        await self._room.park()

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit (or nothing is in use), then count them."""
        while self.used and self.used + nbytes > self.limit:
            await self._room.park()
        self.add(nbytes)

    def try_take(self, nbytes: int, allowance: int = 0) -> bool:
        """Count ``nbytes`` if they fit within the limit plus ``allowance``."""
        if self.used + nbytes > self.limit + allowance:
            return False
        self.add(nbytes)
        return True

    def give(self, nbytes: int) -> None:
        self.add(-nbytes)

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        await self.take(nbytes)
        try:
            yield
        finally:
            self.give(nbytes)


@dataclass(slots=True)
class ServerBudgets:
    """The byte budgets one server's connections share (see the module)."""

    requests: ByteBudget = field(default_factory=lambda: ByteBudget(DEFAULT_REQUEST_BYTES))
    answers: ByteBudget = field(default_factory=lambda: ByteBudget(DEFAULT_ANSWER_BYTES))
    #: each connection's own share of ``answers``
    connection_answer_bytes: int = DEFAULT_CONNECTION_ANSWER_BYTES

    @classmethod
    def of(cls, request_bytes: int, answer_bytes: int) -> ServerBudgets:
        return cls(
            requests=ByteBudget(request_bytes),
            answers=ByteBudget(answer_bytes),
            connection_answer_bytes=min(DEFAULT_CONNECTION_ANSWER_BYTES, answer_bytes),
        )


class ConnectionBudget:
    """What one connection holds of its server's budgets, in one place:

    - of the request budget: the frame half received (``hold_partial``) and
      the requests being served (``request_received`` .. ``request_done``);
    - of the answer budget: the frames queued and not yet written
      (``hold_outgoing``), and room taken to read an answer (``answer_room``)
      out of the connection's own share.

    ``release`` gives everything back when the connection ends."""

    __slots__ = ("_outgoing", "_partial", "_read_size", "_requests", "_server", "own_answers")

    def __init__(self, server: ServerBudgets, read_size: int) -> None:
        self._server = server
        self._read_size = read_size
        #: this connection's share of the server's answer budget
        self.own_answers = ByteBudget(server.connection_answer_bytes)
        self._partial = 0
        self._requests = 0
        self._outgoing = 0

    @property
    def requests_spent(self) -> bool:
        return self._server.requests.spent

    async def wait_requests_given_back(self) -> None:
        await self._server.requests.wait_change()

    @property
    def holds_requests(self) -> bool:
        """Whether a read's worth (``read_size``) of the request budget or
        more is held here: below that a connection may read on, so a small
        request of a client with a long poll in flight is never stuck
        behind others' bytes."""
        return self._partial + self._requests >= self._read_size

    def may_read(self, growth: int) -> bool:
        """Whether the next read, which grows the frame held here by
        ``growth``, may go ahead: it fits in the server's budget (or nothing
        else holds any of it), or this connection holds less than a read's
        worth and the read adds no more than that. A small request is never
        stuck behind others' bytes, and a connection held back holds a
        read's worth past the budget at most, not the first MiB of a large
        frame."""
        if not self.requests_spent and self.room_for(growth):
            return True
        return not self.holds_requests and growth <= self._read_size

    def room_for(self, growth: int) -> bool:
        """Whether this connection may hold ``growth`` more bytes of a frame:
        they fit in the server's budget, or nothing else holds any of it (a
        frame larger than the whole budget proceeds alone)."""
        requests = self._server.requests
        others = requests.used - self._partial - self._requests
        return requests.used + growth <= requests.limit or others <= 0

    def hold_partial(self, holding: int) -> None:
        """Count the memory held for a frame not yet whole."""
        self._server.requests.add(holding - self._partial)
        self._partial = holding

    def request_received(self, nbytes: int) -> int:
        """A whole request is being served; its charge, for ``request_done``."""
        self._server.requests.add(nbytes)
        self._requests += nbytes
        return nbytes

    def request_done(self, charge: int) -> None:
        if charge and self._requests:  # not yet given back by ``release``
            self._server.requests.give(charge)
            self._requests -= charge

    def hold_outgoing(self, outgoing: int) -> None:
        """Count the bytes queued to send."""
        self._server.answers.add(outgoing - self._outgoing)
        self._outgoing = outgoing

    @asynccontextmanager
    async def answer_room(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` of this connection's share and of the server's
        answer budget while an answer is read and queued."""
        server = self._server.answers
        async with self.own_answers.hold(nbytes):
            small = self.own_answers.used + self._outgoing <= SMALL_ANSWER_BYTES
            if small and server.try_take(nbytes, SMALL_ANSWER_RESERVE):
                # A connection holding next to nothing does not wait for the
                # server's budget while its reserve lasts: peers that do not
                # read (and hold the budget) cannot starve a small FETCH of
                # a client that does.
                try:
                    yield
                finally:
                    server.give(nbytes)
            else:
                async with server.hold(nbytes):
                    yield

    def release(self) -> None:
        """The connection ended: its half frame is dropped and its handler
        tasks have ended (an answer queued later finds the connection closed
        and gives nothing back twice)."""
        self.hold_partial(0)
        self._server.requests.give(self._requests)
        self._requests = 0
        self._server.answers.give(self._outgoing)
        self._outgoing = 0
