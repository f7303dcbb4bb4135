"""Deadlines for waits that have no task of their own to cancel.

An APPEND taken on the connection's immediate path waits for its group commit
as an object, not as a task inside a cancel scope. A ``TimeoutQueue`` holds
those objects by deadline; one task (``run``) sleeps until the earliest and
expires the ones still unfinished when it passes.

Most entries finish long before their deadline (an APPEND is durable in
milliseconds, its timeout is seconds), so finished entries are not searched
for and removed one by one: they are counted, and the heap is rebuilt without
them once they are most of it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Final, Protocol

import trio

#: finished entries tolerated in the heap before it may be rebuilt
COMPACT_AFTER: Final = 1024


class Expiring(Protocol):
    @property
    def finished(self) -> bool:
        """True once the entry no longer needs its deadline."""
        ...

    def expire(self) -> None:
        """Its deadline passed before it finished (called once, on trio's thread)."""
        ...


class TimeoutQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Expiring]] = []
        self._sequence = itertools.count()
        #: entries in the heap that called ``finished``
        self._finished = 0
        self._sleeping_until = math.inf
        self._wake = trio.Event()

    def __len__(self) -> int:
        """Entries held, finished ones not yet dropped included."""
        return len(self._heap)

    def add(self, deadline: float, entry: Expiring) -> None:
        """Expire ``entry`` at ``deadline`` (trio time) unless it finishes first,
        in which case it must call ``finished`` once."""
        heapq.heappush(self._heap, (deadline, next(self._sequence), entry))
        if deadline < self._sleeping_until:
            self._wake.set()

    def finished(self) -> None:
        """An entry added here finished before its deadline."""
        self._finished += 1
        heap = self._heap
        if self._finished > COMPACT_AFTER and 2 * self._finished > len(heap):
            live = [item for item in heap if not item[2].finished]
            heapq.heapify(live)
            self._heap = live
            self._finished = 0

    async def run(self) -> None:
        """Expire entries as their deadlines pass, until cancelled."""
        while True:
            heap = self._heap
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                _, _, entry = heapq.heappop(heap)
                if entry.finished:
                    self._finished -= 1
                else:
                    entry.expire()
            self._sleeping_until = heap[0][0] if heap else math.inf
            self._wake = trio.Event()
            with trio.move_on_at(self._sleeping_until):
                await self._wake.wait()
