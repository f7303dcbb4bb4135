"""Calling the async client library from Spark's synchronous Python code.

Spark calls a data source's methods on plain threads, and a partition reader
is a generator that Spark pulls from; neither can sit inside ``trio.run``. A
``TrioPortal`` runs one trio event loop on a daemon thread, with one
``ConnectionPool`` kept open for its lifetime, and runs coroutines there on
behalf of the calling thread, so connections are reused across calls.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Self, TypeVar

import trio

from net.pool import ConnectionPool

T = TypeVar("T")

#: how long starting the event loop thread may take
_START_TIMEOUT_S = 10.0


class TrioPortal:
    """A trio event loop on its own thread; use as a context manager.

    ``call(fn, *args)`` runs ``await fn(*args)`` on the loop, blocks the
    calling thread until it finishes, and returns its result or raises its
    exception; ``submit`` starts one without waiting. ``pool`` is the loop's
    connection pool, for the clients those coroutines use.
    """

    def __init__(self) -> None:
        self._token: trio.lowlevel.TrioToken | None = None
        self._pool: ConnectionPool | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sbp-trio", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise RuntimeError("the trio event loop thread did not start")
        if self._failure is not None:
            raise RuntimeError("the trio event loop thread failed") from self._failure
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:  # reported to __enter__, or lost with the loop
            self._failure = error
            self._ready.set()

    async def _main(self) -> None:
        async with ConnectionPool() as pool, trio.open_nursery() as nursery:
            self._pool = pool
            self._nursery = nursery
            self._stop = trio.Event()
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()  # calls submitted and not awaited

    @property
    def pool(self) -> ConnectionPool:
        if self._pool is None:
            raise RuntimeError("the portal is not open")
        return self._pool

    def call(self, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        """Run ``fn(*args)`` on the event loop and wait for its result."""
        if self._token is None:
            raise RuntimeError("the portal is not open")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def submit(self, fn: Callable[..., Awaitable[T]], *args: object) -> Future[T]:
        """Start ``fn(*args)`` on the event loop and return at once; the
        future holds its result (for work that overlaps the caller's)."""
        if self._token is None or self._nursery is None:
            raise RuntimeError("the portal is not open")
        future: Future[T] = Future()

        async def run() -> None:
            try:
                future.set_result(await fn(*args))
            except Exception as error:
                future.set_exception(error)
            except BaseException:  # cancelled as the portal closes
                future.cancel()
                raise

        trio.from_thread.run_sync(self._nursery.start_soon, run, trio_token=self._token)
        return future

    def close(self) -> None:
        """Close the pool's connections and end the thread (idempotent)."""
        token, stop = self._token, self._stop
        if token is None or stop is None:
            return
        self._token = None
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(stop.set, trio_token=token)
        self._thread.join()
