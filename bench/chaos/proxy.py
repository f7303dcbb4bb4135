"""A TCP proxy on loopback whose behaviour the harness changes at run time.

One ``LinkProxy`` stands for one link of the cluster (clients to a data
node, a data node to the PM …): it listens on a port of its own and
forwards every connection it accepts to the real server. Each direction
(``up``: towards the server, ``down``: back to the caller) is in one mode:

========== ===================================================================
``pass``   bytes go through
``delay``  bytes go through ``delay_s`` late (order kept)
``drop``   bytes are read and thrown away: the stream is corrupt afterwards,
           as behind a middlebox that loses data
``hold``   nothing is read any more (a blackhole: the sender's TCP window
           fills and it stalls, as in a network partition)
========== ===================================================================

``cut()`` resets every connection (RST) and refuses new ones until
``heal()``; ``heal()`` also puts both directions back to ``pass``.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass, field

import trio

CHUNK = 64 * 1024


class Mode(enum.StrEnum):
    PASS = "pass"
    DELAY = "delay"
    DROP = "drop"
    HOLD = "hold"


@dataclass
class Direction:
    """The mode of one direction, and a wake-up for pumps waiting on it."""

    mode: Mode = Mode.PASS
    delay_s: float = 0.0
    changed: trio.Event = field(default_factory=trio.Event)

    def set(self, mode: Mode, delay_s: float = 0.0) -> None:
        self.mode, self.delay_s = mode, delay_s
        self.changed.set()
        self.changed = trio.Event()


class LinkProxy:
    """See the module docstring. Run it with ``await nursery.start(proxy.run)``;
    ``address`` is where callers connect instead of ``target``."""

    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target
        self.up = Direction()
        self.down = Direction()
        self.address = ""
        self.bytes_up = 0
        self.bytes_down = 0
        self._cut = False
        self._pairs: set[tuple[trio.SocketStream, trio.SocketStream]] = set()

    # -- control --------------------------------------------------------------

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        """Reset every connection and refuse new ones until ``heal``."""
        self._cut = True
        for pair in list(self._pairs):
            for stream in pair:
                _reset(stream)

    def heal(self) -> None:
        self._cut = False
        self.up.set(Mode.PASS)
        self.down.set(Mode.PASS)

    def set(self, mode: Mode, *, up: bool = True, down: bool = True, delay_s: float = 0.0) -> None:
        for flag, direction in ((up, self.up), (down, self.down)):
            if flag:
                direction.set(mode, delay_s)

    def retarget(self, target: str) -> None:
        """New connections go to ``target`` (a restarted server's new port)."""
        self.target = target

    # -- serving --------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        host, port = listeners[0].socket.getsockname()[:2]
        self.address = f"{host}:{port}"
        task_status.started(self.address)
        async with trio.open_nursery() as nursery:
            await trio.serve_listeners(
                lambda stream: self._serve(stream), listeners, handler_nursery=nursery
            )

    async def _serve(self, caller: trio.SocketStream) -> None:
        # cut, or the server it fronts has not said where it listens yet
        # (it registers with the PM under this proxy's address a moment
        # before that): refused, as a server that is not up refuses
        if self._cut or not self.target:
            _reset(caller)
            return
        host, _, port = self.target.rpartition(":")
        try:
            server = await trio.open_tcp_stream(host, int(port))
        except OSError:
            _reset(caller)
            return
        pair = (caller, server)
        self._pairs.add(pair)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, caller, server, self.up, True, nursery)
                nursery.start_soon(self._pump, server, caller, self.down, False, nursery)
        finally:
            self._pairs.discard(pair)
            for stream in pair:
                stream.socket.close()  # at once, whatever cancels this task

    async def _pump(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        direction: Direction,
        upward: bool,
        pair_nursery: trio.Nursery,
    ) -> None:
        """Copy one direction, honouring its mode; either side ending ends both."""
        try:
            while True:
                if direction.mode is Mode.HOLD:
                    await direction.changed.wait()
                    continue
                data = await source.receive_some(CHUNK)
                if not data:
                    break
                if direction.mode is Mode.DROP:
                    continue
                if direction.mode is Mode.DELAY and direction.delay_s:
                    await trio.sleep(direction.delay_s)
                await sink.send_all(data)
                if upward:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        pair_nursery.cancel_scope.cancel()


def _reset(stream: trio.SocketStream) -> None:
    """Close with RST (SO_LINGER 0), as a dropped link looks to both ends."""
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()
    except OSError:
        pass
