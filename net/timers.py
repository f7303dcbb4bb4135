"""A connection's two timers: keepalive (PING a peer that has gone quiet;
no answer in time means it is dead) and the idle timeout (close after a
while with no frame but PINGs and nothing in flight)."""

from __future__ import annotations

from typing import Protocol

import trio

from sbp.connection import ConnectionEngine
from sbp.errors import ConnectionClosed

from .calls import Caller


class IdleClock:
    """When the connection last carried a frame other than PING, read off the
    engine's ``activity`` count whenever ``note`` is called."""

    def __init__(self, engine: ConnectionEngine) -> None:
        self._engine = engine
        self._seen = engine.activity
        self.last = trio.current_time()

    def note(self) -> None:
        if self._engine.activity != self._seen:
            self._seen = self._engine.activity
            self.last = trio.current_time()


class TimedConnection(Protocol):
    """What the timers need of a connection (``net.connection.Connection``)."""

    @property
    def peer(self) -> str: ...

    @property
    def last_received(self) -> float: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def caller(self) -> Caller: ...

    @property
    def idle(self) -> IdleClock: ...

    def shutdown(self, reason: str) -> None: ...


async def keep_alive(connection: TimedConnection, interval: float, timeout: float) -> None:
    """PING after ``interval`` without receiving anything; close when the
    PING goes unanswered for ``timeout``."""
    while True:
        await trio.sleep_until(connection.last_received + interval)
        if trio.current_time() - connection.last_received < interval:
            continue
        try:
            answered = await connection.caller.keepalive_ping(timeout)
        except ConnectionClosed:
            return
        if not answered:
            connection.shutdown(
                f"{connection.peer} did not answer a keepalive PING within {timeout:g} s"
            )
            return


async def close_when_idle(connection: TimedConnection, idle_timeout: float) -> None:
    """Close after ``idle_timeout`` with nothing in flight and no frame but PINGs."""
    clock = connection.idle
    while True:
        await trio.sleep_until(clock.last + idle_timeout)
        clock.note()
        now = trio.current_time()
        if connection.in_flight > connection.caller.pings:
            clock.last = now
        elif now - clock.last >= idle_timeout:
            connection.shutdown(f"idle for {idle_timeout:g} s")
            return
