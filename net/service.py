"""Process plumbing shared by the servers (data node, PM).

(Flags and the config file are ``net.settings``, the /metrics endpoint
``net.metrics_http``, addresses ``net.address``.)

- ``configure_logging``, ``announce`` (the machine-readable address lines);
- ``run_main``: a ``main()`` wrapper that turns start-up failures into one
  line on stderr and an exit code, never a traceback;
- ``ShutdownSignals``: SIGTERM/SIGINT as trio events, and ``drain``, the
  graceful stop both servers make with them.

Exit codes: 0 clean stop, 1 a runtime failure (busy port, unusable data
directory), 2 a usage error (bad flag, bad config file), 130 interrupted
before the service could install its signal handlers.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sized
from types import TracebackType
from typing import Final, Protocol

import trio

from .address import format_address

logger = logging.getLogger(__name__)

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130

#: the prefix of the line a server prints once it accepts connections;
#: tools (tests, the local cluster) read the address that follows it
LISTENING_PREFIX: Final = "listening on "
#: the prefix of the line giving the /metrics address
METRICS_PREFIX: Final = "metrics on "

LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ServiceError(Exception):
    """A failure to report as one line and exit code 1 (no traceback)."""

    exit_code: int = EXIT_FAILURE


class UsageError(ServiceError):
    """A bad flag or config value: one line, exit code 2."""

    exit_code = EXIT_USAGE


# -- output -----------------------------------------------------------------------


def configure_logging(level: str) -> None:
    """Log records of ``level`` and above to stderr."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def announce(prefix: str, host: str, port: int) -> None:
    """Print ``<prefix>HOST:PORT`` on one line of stdout, flushed at once:
    the machine-readable form tools wait for.

    One ``write`` of the whole line: ``print`` writes the newline separately,
    and with unbuffered output (``PYTHONUNBUFFERED``) a log line sent to the
    same file in between would end up inside the address."""
    sys.stdout.write(f"{prefix}{format_address(host, port)}\n")
    sys.stdout.flush()


# -- main() -------------------------------------------------------------------------


#: the cyclic collector's thresholds for a server: a young generation of
#: 10,000 objects instead of 700. With 11,000 connections a server holds
#: over a million objects, and CPython's default collects often enough to
#: stall it for tens of milliseconds many times a second (``python -m bench
#: chaos --mode crowd`` shows it); a larger young generation lets tens of MB
#: of garbage wait for no gain.
SERVER_GC_THRESHOLDS = (10_000, 50, 1_000)


def run_main(prog: str, body: Callable[[], int]) -> int:
    """Run ``body`` (which parses its flags and runs the service) and turn the
    failures a user can fix into one line on stderr and an exit code."""
    # What is loaded by now lives as long as the process: out of the
    # collector's way for good.
    gc.freeze()
    gc.set_threshold(*SERVER_GC_THRESHOLDS)
    try:
        return body()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BaseException as raised:
        error = _reportable(raised)
        if error is None:
            raise
        print(f"{prog}: error: {_describe(error)}", file=sys.stderr, flush=True)
        return error.exit_code if isinstance(error, ServiceError) else EXIT_FAILURE


def _reportable(error: BaseException) -> ServiceError | OSError | None:
    """The one user-facing error inside ``error`` (unwrapping exception
    groups that trio's nurseries add), or None for anything else (a bug)."""
    if isinstance(error, ServiceError | OSError):
        return error
    if isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        return _reportable(error.exceptions[0])
    return None


def _describe(error: ServiceError | OSError) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror}{where}"
    return str(error)


# -- signals ------------------------------------------------------------------------


#: a launcher's pid, in its children's environment: they stop when it is gone
PARENT_ENV: Final = "SBP_EXIT_WITH_PARENT"
PARENT_CHECK_S: Final = 1.0


class ShutdownSignals:
    """SIGTERM and SIGINT as events: the first sets ``requested`` (drain
    gracefully), a second one sets ``forced`` (stop waiting for the drain).

    Use as ``with ShutdownSignals() as signals: nursery.start_soon(signals.watch)``;
    the handlers are installed on entry, so a signal that arrives during
    start-up is not lost.
    """

    def __init__(self) -> None:
        self.requested = trio.Event()
        self.forced = trio.Event()
        self.received: list[int] = []
        self._receiver: contextlib.AbstractContextManager[AsyncIterator[int]] | None = None
        self._channel: AsyncIterator[int] | None = None

    def __enter__(self) -> ShutdownSignals:
        receiver = trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
        self._channel = receiver.__enter__()
        self._receiver = receiver
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._receiver is not None:
            self._receiver.__exit__(exc_type, exc, tb)

    async def watch(self) -> None:
        """Turn received signals into the two events; runs until cancelled.

        A server started by a launcher that sets ``SBP_EXIT_WITH_PARENT`` to
        its pid (``sbp-cluster``) also drains when that process is gone, even
        killed with SIGKILL, so no server is left serving on its own.
        """
        if self._channel is None:
            raise RuntimeError("enter the ShutdownSignals context first")
        async with trio.open_nursery() as nursery:
            parent = os.environ.get(PARENT_ENV, "")
            if parent.isdigit():
                nursery.start_soon(self._watch_parent, int(parent))
            await self._watch_signals()
            nursery.cancel_scope.cancel()

    async def _watch_parent(self, parent: int) -> None:
        while os.getppid() == parent:
            await trio.sleep(PARENT_CHECK_S)
        if not self.requested.is_set():
            logger.warning("the launching process (pid %d) is gone: draining connections", parent)
            self.requested.set()

    async def _watch_signals(self) -> None:
        assert self._channel is not None
        async for signum in self._channel:
            self.received.append(signum)
            name = signal.Signals(signum).name
            if not self.requested.is_set():
                logger.info("%s received: draining connections", name)
                self.requested.set()
            else:
                logger.warning("%s received again: stopping without waiting", name)
                self.forced.set()


class Drainable(Protocol):
    """What a graceful stop needs of a server (``net.server.Server``)."""

    @property
    def connections(self) -> Sized: ...

    async def drain(self, timeout: float) -> None: ...


async def drain_on_signals(server: Drainable, signals: ShutdownSignals, timeout: float) -> None:
    """The graceful stop of a server: GOAWAY everywhere and requests in flight
    get up to ``timeout`` to finish, unless a second signal says stop now."""
    logger.info("draining %d connections (up to %g s)", len(server.connections), timeout)
    async with trio.open_nursery() as nursery:

        async def stop_when_forced() -> None:
            await signals.forced.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop_when_forced)
        await server.drain(timeout)
        nursery.cancel_scope.cancel()
