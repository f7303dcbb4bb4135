"""The one way a test waits for a condition: ``eventually`` in async tests,
``eventually_blocking`` in blocking ones. Both poll, return the condition's
first value that holds (truthy, or accepted by ``until``), and fail with
what was awaited and its last value."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import trio

T = TypeVar("T")

#: how often a condition is looked at
POLL_S = 0.05


@overload
async def eventually(
    condition: Callable[[], Awaitable[T]],
    *,
    until: Callable[[T], object] = ...,
    timeout: float = ...,
    what: str = ...,
    interval: float = ...,
) -> T: ...


@overload
async def eventually(
    condition: Callable[[], T],
    *,
    until: Callable[[T], object] = ...,
    timeout: float = ...,
    what: str = ...,
    interval: float = ...,
) -> T: ...


async def eventually(
    condition: Callable[[], Any],
    *,
    until: Callable[[Any], object] = bool,
    timeout: float = 10.0,
    what: str = "",
    interval: float = POLL_S,
) -> Any:
    """Until ``until(condition())`` holds (``condition`` a function, sync or
    async); that value. On trio's clock, so an autojump clock makes the wait
    instant."""
    deadline = trio.current_time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if until(value):
            return value
        if trio.current_time() >= deadline:
            raise AssertionError(
                f"{what or getattr(condition, '__name__', 'the condition')} did not hold "
                f"within {timeout:g} s (last: {value!r})"
            )
        await trio.sleep(interval)


def eventually_blocking(
    condition: Callable[[], T],
    *,
    until: Callable[[T], object] = bool,
    timeout: float = 30.0,
    what: str = "",
    interval: float = POLL_S,
) -> T:
    """``eventually`` for tests without an event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if until(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"{what or getattr(condition, '__name__', 'the condition')} did not hold "
                f"within {timeout:g} s (last: {value!r})"
            )
        time.sleep(interval)
