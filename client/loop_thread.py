"""A trio event loop on a thread of its own, for synchronous callers.

Scripts, Spark's Python workers and the blocking ``SyncClient`` cannot sit
inside ``trio.run``. A ``LoopThread`` runs one trio loop on a daemon thread
with one ``ConnectionPool`` open for its lifetime, and runs coroutines there
on behalf of the calling thread, so that connections are reused from call to
call. Create it in the process that uses it: a forked child (a Spark Python
worker is one) does not inherit the thread.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Self, TypeVar

import trio

from net.pool import ConnectionPool

T = TypeVar("T")
#: how long close() waits for the loop thread to finish
JOIN_TIMEOUT_S = 30.0


class LoopThread:
    """A running trio loop with a connection pool; use as a context manager
    or call ``close()``. Its methods may be called from any thread but the
    loop's own."""

    def __init__(self, name: str = "sbp-loop", *, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._pool: ConnectionPool | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def _run_loop(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:  # reported to the constructor
            self._startup_error = error
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._stop = trio.Event()
        async with ConnectionPool(tls=self._tls) as pool, trio.open_nursery() as nursery:
            self._pool = pool
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()  # tasks submitted and not finished

    @property
    def pool(self) -> ConnectionPool:
        """The loop's connection pool, for clients whose coroutines run here."""
        if self._pool is None:
            raise RuntimeError("the loop is not running")
        return self._pool

    @property
    def nursery(self) -> trio.Nursery:
        """The loop's nursery (use from coroutines running on the loop)."""
        if self._nursery is None:
            raise RuntimeError("the loop is not running")
        return self._nursery

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` on the loop; block until it returns or raises."""
        if self._token is None:
            raise RuntimeError("the loop is closed")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """Start ``await fn(*args)`` on the loop and return at once; the future
        holds its outcome (for work that overlaps the caller's)."""
        if self._token is None or self._nursery is None:
            raise RuntimeError("the loop is closed")
        future: Future[T] = Future()

        async def run() -> None:
            try:
                future.set_result(await fn(*args))
            except Exception as error:
                future.set_exception(error)
            except BaseException:  # cancelled as the loop closes
                future.cancel()
                raise

        # queued without waiting for the loop to take it: the caller goes on
        # at once (waiting for the loop thread cost a Spark reader about a
        # sixth of its time, in GIL hand-overs)
        self._token.run_sync_soon(self._nursery.start_soon, run)
        return future

    def close(self) -> None:
        """Close the pool's connections and end the thread (idempotent)."""
        token, stop = self._token, self._stop
        if token is None or stop is None:
            return
        self._token = None
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(stop.set, trio_token=token)
        self._thread.join(JOIN_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
