"""Servers as real processes, started exactly as a user starts them.

``start_server("datanode", [...])`` runs ``python -m datanode ...`` through
the launcher's ``start_child`` (the one way every cluster here starts a
server), waits for its ``listening on HOST:PORT`` line and returns a
``ServerProcess`` with the bound address. ``RawConnection`` talks to a
server in exact bytes, for wire-layout and bad-frame tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from client.children import Child, kill_child, signal_child, start_child
from sbp import messages
from sbp.frames import Frame, FrameDecoder, FrameEvent, encode_frame

#: how long a server gets to print its address
START_TIMEOUT_S = 20.0
#: how long a server gets to exit after SIGTERM
STOP_TIMEOUT_S = 20.0


@dataclass
class ServerProcess:
    """One running server; its output (stdout and stderr) goes to one log."""

    module: str
    child: Child

    @property
    def process(self) -> trio.Process:
        assert self.child.process is not None
        return self.child.process

    @property
    def address(self) -> str:
        return self.child.address

    @property
    def metrics_address(self) -> str | None:
        return self.child.metrics_address

    @property
    def host(self) -> str:
        return self.child.host

    @property
    def port(self) -> int:
        return self.child.port

    @property
    def running(self) -> bool:
        return self.child.running

    def log(self) -> str:
        return self.child.log()

    async def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait for the exit code (an error if it outlives ``timeout``)."""
        return await self.stop(signal.SIGTERM, timeout)

    async def stop(self, signum: int, timeout: float = STOP_TIMEOUT_S) -> int:
        code = await signal_child(self.child, signum, timeout)
        assert code is not None
        if code == -signal.SIGKILL and signum != signal.SIGKILL:
            raise AssertionError(
                f"{self.module} did not exit within {timeout:g} s of signal {signum}; "
                f"log:\n{self.log()[-4000:]}"
            )
        return code

    async def kill(self) -> int:
        """SIGKILL: no chance to clean up (a crash)."""
        code = await kill_child(self.child)
        assert code is not None
        return code


def python_command(module: str, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def start_server(
    module: str,
    args: Sequence[str],
    log_dir: Path,
    *,
    name: str | None = None,
    timeout: float = START_TIMEOUT_S,
) -> ServerProcess:
    """Run ``python -m <module> <args>`` and wait for its ``listening on`` line
    (``ClusterError`` with its last log line if it exits instead)."""
    label = name or module
    child = Child(label, python_command(module, args), log_dir / f"{label}.log")
    await start_child(child, timeout=timeout)
    return ServerProcess(module, child)


def run_cli(
    module: str, args: Sequence[str], timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Run a server command that is expected to exit by itself (bad flags,
    ``--help``) and capture its output."""
    return subprocess.run(
        python_command(module, args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_child_env(),
        stdin=subprocess.DEVNULL,
        check=False,
    )


# -- talking to a server byte by byte ---------------------------------------------


class RawConnection:
    """A bare TCP connection that sends exact bytes and decodes what comes
    back with the frame codec alone: for checking the wire layout and the
    bad-frame rules without the client library's own checks in the way."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(max_frame_length=1 << 30)
        self._events: list[FrameEvent] = []
        self._eof = False

    @classmethod
    async def open(cls, address: str) -> RawConnection:
        host, _, port = address.rpartition(":")
        return cls(await trio.open_tcp_stream(host, int(port)))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_frame(
        self,
        opcode: int,
        header: messages.Message | bytes = b"",
        payload: bytes = b"",
        *,
        stream_id: int = 1,
        flags: int = 0,
    ) -> None:
        raw = header if isinstance(header, bytes) else header.encode()
        await self.send(encode_frame(opcode, flags, stream_id, raw, payload))

    async def next_event(self, timeout: float = 10.0) -> FrameEvent | None:
        """The next decoded frame event; None once the server closed the connection."""
        with trio.fail_after(timeout):
            while not self._events:
                if self._eof:
                    return None
                data = await self.stream.receive_some(1 << 16)
                if not data:
                    self._eof = True
                    continue
                self._events.extend(self._decoder.feed(data))
        return self._events.pop(0)

    async def next_frame(self, timeout: float = 10.0) -> Frame:
        event = await self.next_event(timeout)
        assert isinstance(event, Frame), f"expected a frame, got {event!r}"
        return event

    async def call(
        self,
        opcode: int,
        header: messages.Message | bytes = b"",
        payload: bytes = b"",
        *,
        stream_id: int = 1,
        timeout: float = 10.0,
    ) -> list[Frame]:
        """Send one request and collect its response frames up to RESPONSE_END."""
        await self.send_frame(opcode, header, payload, stream_id=stream_id)
        frames: list[Frame] = []
        while True:
            frame = await self.next_frame(timeout)
            if frame.stream_id != stream_id or not frame.is_response:
                continue  # a GOAWAY or a keepalive PING from the server
            frames.append(frame)
            if frame.is_end:
                return frames

    async def wait_closed(self, timeout: float = 10.0) -> list[FrameEvent]:
        """Read until the server closes; the events received on the way."""
        seen: list[FrameEvent] = []
        while (event := await self.next_event(timeout)) is not None:
            seen.append(event)
        return seen

    async def aclose(self) -> None:
        await self.stream.aclose()
