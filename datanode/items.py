"""What every multi-item request of the data node shares: its payload cut
into one view per item, each item's own failure, and waiting for the
storage operations its items became."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import trio

from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import InvalidRequestError, ProtocolError, RequestTimeoutError
from sbp.producer_stamp import ProducerStamp
from storage.layout import MAX_STREAM_ID

T = TypeVar("T")
R = TypeVar("R", bound="ItemResult")


class ItemResult(Protocol):
    """A per-item result message: every one has an error code and message."""

    def __init__(self, *, error_code: int, error_message: str, **fields: Any) -> None: ...


def split_payload(lengths: Sequence[int], payload: memoryview) -> list[memoryview]:
    """One view of ``payload`` per item (no copy); a payload that is not
    exactly the items' batches end to end fails the whole request."""
    views: list[memoryview] = []
    position = 0
    size = len(payload)
    for length in lengths:
        end = position + length
        if length < 0 or end > size:
            break
        views.append(payload[position:end])
        position = end
    if len(views) != len(lengths) or position != size:
        raise InvalidRequestError(
            f"payload holds {size} bytes but the batch_lengths of {len(lengths)} items "
            f"sum to {sum(lengths)}"
        )
    return views


def error_code(error: ProtocolError) -> int:
    """The wire code for an item that failed with ``error`` (never NONE)."""
    return error.code if error.code != ErrorCode.NONE else ErrorCode.UNKNOWN


def failed(result: type[R], error: ProtocolError, **fields: Any) -> R:
    """The item's result message saying it failed with ``error``."""
    return result(error_code=error_code(error), error_message=error.message, **fields)


def timed_out() -> RequestTimeoutError:
    return RequestTimeoutError("not done before the request's timeout_ms")


def check_stream_id(stream_id: int) -> None:
    """Refuse a stream id the storage keys cannot hold, before it reaches the
    writer (where it would fail the whole group's transaction)."""
    if not 0 <= stream_id <= MAX_STREAM_ID:
        raise InvalidRequestError(f"stream id {stream_id} out of range")


async def wait_future(future: Future[T]) -> T:
    """Wait for a ``concurrent.futures.Future`` completed on another thread.

    The completing thread only schedules an event (``run_sync_soon`` is cheap
    and never blocks it); cancelling the wait leaves the operation running.
    """
    if not future.done():
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def on_done(_: Future[T]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(on_done)
        await done.wait()
    return future.result()


async def outcomes(
    submitted: Sequence[Future[T] | ProtocolError], deadline: float
) -> list[T | ProtocolError]:
    """Per item, what its storage operation returned, the error refusing it
    (already one when it was refused before storage), or TIMEOUT when the
    deadline came first (the operation still completes)."""
    done: list[T | ProtocolError] = []
    for item in submitted:
        if isinstance(item, ProtocolError):
            done.append(item)
            continue
        try:
            with trio.fail_at(deadline):
                result: T = await wait_future(item)
            done.append(result)
        except trio.TooSlowError:
            done.append(timed_out())
        except ProtocolError as error:
            done.append(error)
    return done


def producer_stamp(info: messages.AppendInfo | messages.ReplicateInfo) -> ProducerStamp | None:
    """An APPEND or REPLICATE item's idempotent producer fields (SPEC §10);
    None without a producer."""
    if info.producer_id == 0:
        return None
    return ProducerStamp(info.producer_id, info.producer_epoch, info.base_sequence)
