"""Byte budgets: how much memory all of a server's connections together may
hold for requests and for answers, so that no client, or set of clients,
can make a server grow without bound.

- ``ServerBudgets.requests`` counts bytes of requests received and not yet
  served: frames half received (a peer that announces 16 MiB and sends 15)
  and whole requests whose handler still runs. Once it is spent, a
  connection that already holds some of it is not read from until it is
  given back (as Kafka's ``queued.max.request.bytes``); a connection holding
  none may still read, so a small request is never starved by large ones.
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
