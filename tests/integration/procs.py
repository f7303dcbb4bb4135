"""Servers as real processes, started exactly as a user starts them.

``start_server("datanode", [...])`` runs ``python -m datanode ...`` with
stdout and stderr going to files, waits for the ``listening on HOST:PORT``
line and returns a ``ServerProcess`` with the bound address. The PM's tests
use the same helpers with ``"pm"``. ``RawConnection`` talks to a server in
exact bytes, for wire-layout and bad-frame tests.
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

from net.service import LISTENING_PREFIX, METRICS_PREFIX
from sbp import messages
from sbp.frames import Frame, FrameDecoder, FrameEvent, encode_frame

#: how long a server gets to print its address
START_TIMEOUT_S = 20.0
#: how long a server gets to exit after SIGTERM
STOP_TIMEOUT_S = 20.0
_POLL_S = 0.02


class ServerStartError(AssertionError):
    """The server exited or stayed silent instead of reporting its address."""


@dataclass
class ServerProcess:
    """One running server and where its output goes."""

    module: str
    argv: list[str]
    process: trio.Process
    stdout_path: Path
    stderr_path: Path
    address: str = ""
    metrics_address: str | None = None

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    async def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait for the exit code (SIGKILL if it outlives ``timeout``)."""
        return await self.stop(signal.SIGTERM, timeout)

    async def stop(self, signum: int, timeout: float = STOP_TIMEOUT_S) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signum)
        with trio.move_on_after(timeout):
            return await self.process.wait()
        self.process.kill()
        await self.process.wait()
        raise AssertionError(
            f"{self.module} did not exit within {timeout:g} s of signal {signum}; "
            f"stderr:\n{self.stderr()[-4000:]}"
        )

    async def kill(self) -> int:
        """SIGKILL: no chance to clean up (a crash)."""
        if self.process.returncode is None:
            self.process.kill()
        return await self.process.wait()


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
    """Run ``python -m <module> <args>`` and wait for its ``listening on`` line."""
    log_dir.mkdir(parents=True, exist_ok=True)
    label = name or module
    stdout_path = log_dir / f"{label}.stdout"
    stderr_path = log_dir / f"{label}.stderr"
    argv = python_command(module, args)
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        process = await trio.lowlevel.open_process(
            argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=_child_env()
        )
    server = ServerProcess(module, argv, process, stdout_path, stderr_path)
    with trio.move_on_after(timeout):
        while True:
            for line in server.stdout().splitlines():
                if line.startswith(METRICS_PREFIX):
                    server.metrics_address = line[len(METRICS_PREFIX) :].strip()
                elif line.startswith(LISTENING_PREFIX):
                    server.address = line[len(LISTENING_PREFIX) :].strip()
            if server.address:
                return server
            if process.returncode is not None or process.poll() is not None:
                raise ServerStartError(
                    f"{label} exited with status {process.returncode} before listening; "
                    f"stderr:\n{server.stderr()[-4000:]}"
                )
            await trio.sleep(_POLL_S)
    process.kill()
    await process.wait()
    raise ServerStartError(
        f"{label} did not print its address within {timeout:g} s; "
        f"stderr:\n{server.stderr()[-4000:]}"
    )


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
