"""The items of a batch request run at once, each to its own outcome: one
item's error never fails the others, and those not done by the request's
deadline are TIMEOUT."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import trio

from sbp.errors import ProtocolError, RequestTimeoutError

from .records import Outcome

T = TypeVar("T")


async def each_outcome(
    deadline: float, items: Sequence[Callable[[], Awaitable[T]]]
) -> list[Outcome[T]]:
    """See the module docstring; the outcomes in the items' order."""
    results: list[Outcome[T] | None] = [None] * len(items)

    async def run(index: int, item: Callable[[], Awaitable[T]]) -> None:
        with trio.move_on_at(deadline):
            try:
                results[index] = Outcome(await item())
            except ProtocolError as exc:
                results[index] = Outcome(error=exc)

    async with trio.open_nursery() as nursery:
        for index, item in enumerate(items):
            nursery.start_soon(run, index, item)
    timeout = RequestTimeoutError("the request's deadline passed")
    return [Outcome(error=timeout) if r is None else r for r in results]
