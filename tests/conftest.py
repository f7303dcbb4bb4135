"""Suite-wide test configuration.

Every async test runs under a deadline (30 s unless marked
``@pytest.mark.deadline(seconds)``): the test body runs in a cancel scope that
a wall-clock timer cancels, and the test then fails with a message instead of
hanging CI. Wall-clock, so that trio's autojump clock (virtual time) neither
trips it early nor hides a hang. pytest-timeout's thread method (see
pyproject.toml) is only a last-resort backstop: its signal method breaks trio.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

import sbp.frames
from sbp.allocator import RECEIVE_BUFFERS, BufferPool

DEFAULT_DEADLINE_SECONDS = 30.0


class DeadlineExceeded(AssertionError):
    pass


def _with_deadline(
    test: Callable[..., Awaitable[Any]], nodeid: str, seconds: float
) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(test)
    async def run_with_deadline(*args: Any, **kwargs: Any) -> Any:
        token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:

            def expire() -> None:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(scope.cancel)

            timer = threading.Timer(seconds, expire)
            timer.daemon = True
            timer.start()
            try:
                result = await test(*args, **kwargs)
            finally:
                timer.cancel()
        if scope.cancelled_caught:
            raise DeadlineExceeded(
                f"{nodeid} ran past its {seconds:g} s deadline "
                "(mark it @pytest.mark.deadline(seconds) if that much time is expected)"
            )
        return result

    return run_with_deadline


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            marker = item.get_closest_marker("deadline")
            seconds = float(marker.args[0]) if marker else DEFAULT_DEADLINE_SECONDS
            item.obj = _with_deadline(item.obj, item.nodeid, seconds)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, except that the Spark tests (``tests/spark``) go
    to one worker together: they share a session-wide SparkSession and local
    cluster, which a second worker would start again beside the first (two
    JVMs on two cores)."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

    class SparkTestsTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/spark/"):
                return "tests/spark"
            return str(super()._split_scope(nodeid))

    return SparkTestsTogether(config, log)


@pytest.fixture
def own_buffer_pool(monkeypatch: pytest.MonkeyPatch) -> BufferPool:
    """Receive buffers kept in a pool of the test's own: free buffers that
    earlier tests in this worker left in the process-wide one would be
    taken first, and a take looks at a few kept buffers only."""
    pool = BufferPool(RECEIVE_BUFFERS.max_bytes, RECEIVE_BUFFERS.largest)
    monkeypatch.setattr(sbp.frames, "RECEIVE_BUFFERS", pool)
    return pool
