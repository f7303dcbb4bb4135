"""Arrival order for the appends of one connection served by tasks.

SPEC §5: batches of one stream on one connection are applied in request
order. Most APPENDs are submitted by the connection's reader itself, in order
(``AppendHandler.start_nowait``); the ones that must wait first (for the PM)
are served each in its own task, and trio does not promise to start tasks in
the order they were spawned (it runs a batch of ready tasks forwards or
backwards at random), so the order in which those reach the storage engine
must be restored explicitly.

A request's place is ``Request.arrival``, its position among the requests
read from its connection. Each handler registers its place, yields once (so
every request spawned in the same scheduler batch has registered too), then
waits until no earlier request of its connection is still before the gate.
Only the short step up to the engine submission is serialized; the waits for
durability overlap freely.
"""

from __future__ import annotations

import heapq
from weakref import WeakKeyDictionary

import trio

from net.request import Request


class _ConnectionGate:
    __slots__ = ("events", "places")

    def __init__(self) -> None:
        self.places: list[int] = []  # a heap: the earliest place first
        self.events: dict[int, trio.Event] = {}

    def wake_first(self) -> None:
        if self.places:
            event = self.events.pop(self.places[0], None)
            if event is not None:
                event.set()


class ArrivalOrder:
    """Per-connection gates; ``async with order.turn(request):`` runs its body
    for the requests of one connection in the order they arrived."""

    def __init__(self) -> None:
        self._gates: WeakKeyDictionary[object, _ConnectionGate] = WeakKeyDictionary()

    def turn(self, request: Request) -> _Turn:
        gate = self._gates.get(request.connection)
        if gate is None:
            gate = self._gates[request.connection] = _ConnectionGate()
        return _Turn(gate, request.arrival)


class _Turn:
    """One request's turn at its connection's gate. A plain class: entered
    once per APPEND, it costs 4.9 µs against 6.4 µs as a generator-based
    context manager (most of either is the one checkpoint)."""

    __slots__ = ("gate", "place")

    def __init__(self, gate: _ConnectionGate, place: int) -> None:
        self.gate = gate
        self.place = place

    async def __aenter__(self) -> None:
        gate, place = self.gate, self.place
        heapq.heappush(gate.places, place)
        try:
            await trio.lowlevel.checkpoint()
            while gate.places[0] != place:
                event = gate.events.setdefault(place, trio.Event())
                await event.wait()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._leave()

    def _leave(self) -> None:
        gate, place = self.gate, self.place
        gate.events.pop(place, None)
        if gate.places[0] == place:
            heapq.heappop(gate.places)
        else:  # cancelled while waiting: leave the line
            gate.places.remove(place)
            heapq.heapify(gate.places)
        gate.wake_first()
