"""Starting and stopping the peer servers (``redis-server`` and
``nats-server``) as child processes on loopback, with their data in a
temporary directory."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

READY_TIMEOUT_S = 20.0


class ServerNotInstalled(RuntimeError):
    """The peer's binary is not on PATH (``make system-deps`` installs it)."""


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """A server binary run in a temp directory until the context exits.

    ``argv`` is built by ``make_argv(port, directory)``; the server counts as
    ready once ``ready(port)`` returns True.
    """

    def __init__(
        self,
        binary: str,
        make_argv: Callable[[int, Path], list[str]],
        ready: Callable[[int], bool],
        parent: Path | None = None,
    ) -> None:
        if shutil.which(binary) is None:
            raise ServerNotInstalled(f"{binary} is not installed")
        self.binary = binary
        self.directory = Path(tempfile.mkdtemp(prefix=f"{Path(binary).name}-", dir=parent))
        self.port = free_port()
        self._argv = make_argv(self.port, self.directory)
        self._ready = ready
        self.process: subprocess.Popen[bytes] | None = None
        #: how the results of this server are labelled (its durability)
        self.label = ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> Self:
        log = (self.directory / "server.log").open("wb")
        self.process = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                tail = (self.directory / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.binary} did not start:\n{tail}")
            time.sleep(0.05)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
