"""What the PM's handlers share: an item's error code and message, and a
batch call made with the items the principal may ask for only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from sbp.enums import ErrorCode
from sbp.errors import ProtocolError

from .records import Outcome

T = TypeVar("T")
K = TypeVar("K")


def error_code(error: ProtocolError | None) -> ErrorCode | int:
    return ErrorCode.NONE if error is None else error.code


def error_message(error: ProtocolError | None) -> str:
    return "" if error is None else error.message


async def allowed_only(
    denials: Sequence[ProtocolError | None],
    items: Sequence[K],
    call: Callable[[list[K]], Awaitable[list[Outcome[T]]]],
) -> list[Outcome[T]]:
    """The manager's outcomes for the items not denied, the denials in place
    of the others (the manager is not called when every item is denied)."""
    allowed = [item for item, denied in zip(items, denials, strict=True) if denied is None]
    outcomes = iter(await call(allowed) if allowed else [])
    return [Outcome(error=denied) if denied else next(outcomes) for denied in denials]


async def ready(outcomes: list[Outcome[T]]) -> list[Outcome[T]]:
    return outcomes
