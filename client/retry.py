"""The one retry policy of every SBP caller: the client library, the PM's
calls to data nodes and the data node's calls to the PM.

An error is worth retrying when trying again may succeed: a retriable wire
code (SPEC §6), a lost or refused connection, a deadline passed. Retries
back off exponentially with full jitter, and stop at the caller's deadline
(its cancel scope), never on a count.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import trio

from net.pool import backoff_delay
from sbp.errors import ConnectionClosed, ProtocolError

T = TypeVar("T")

log = logging.getLogger(__name__)

#: first retry delay after a failure, doubling up to the cap (full jitter)
RETRY_INITIAL_S: Final = 0.02
RETRY_MAX_S: Final = 1.0


def is_transient(error: BaseException) -> bool:
    """Whether trying again may succeed: a retriable wire error, a lost
    connection or a deadline passed."""
    if isinstance(error, ProtocolError):
        return error.retriable
    return isinstance(error, ConnectionClosed | OSError | trio.TooSlowError)


def retry_delay(
    failures: int, *, initial: float = RETRY_INITIAL_S, cap: float = RETRY_MAX_S
) -> float:
    """Seconds to wait before retry number ``failures`` (1 for the first)."""
    return backoff_delay(failures, initial=initial, cap=cap)


async def until_deadline(
    attempt: Callable[[], Awaitable[T]],
    what: str,
    *,
    initial: float = RETRY_INITIAL_S,
    cap: float = RETRY_MAX_S,
) -> T:
    """``attempt()`` again after each transient failure, with backoff, until it
    succeeds, fails for good (raised), or the caller's cancel scope ends it."""
    failures = 0
    while True:
        try:
            return await attempt()
        except (ProtocolError, ConnectionClosed, OSError, trio.TooSlowError) as error:
            if not is_transient(error):
                raise
            failures += 1
            log.debug("%s failed (%s); retrying", what, error)
        await trio.sleep(retry_delay(failures, initial=initial, cap=cap))
