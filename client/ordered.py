"""Requests to a data node that must arrive in the order they were made,
with many in flight on one connection: a producer's APPENDs (a data node
applies one connection's requests in arrival order) and a primary's
REPLICATEs to a follower (which stores a range's batches in offset order).

Each request takes a turn (``SendOrder.turn``) when it is made and is sent
by a task of its own; its frame is queued on the connection only after the
frame of the request made before it, and its answers are then awaited
alongside the others'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from net.calls import Response
from net.connection import Connection
from sbp import messages
from sbp.enums import Opcode
from sbp.producer_stamp import ProducerStamp


class SendOrder:
    """The order of one connection's requests; see the module docstring."""

    def __init__(self) -> None:
        self._last_sent = trio.Event()
        self._last_sent.set()

    def turn(self) -> Turn:
        """The next request's turn: after every turn taken before."""
        previous, self._last_sent = self._last_sent, trio.Event()
        return Turn(previous, self._last_sent)


class Turn:
    """A request's place in its connection's order."""

    __slots__ = ("_previous", "_sent")

    def __init__(self, previous: trio.Event, sent: trio.Event) -> None:
        self._previous = previous
        self._sent = sent

    async def request(
        self,
        connection: Connection,
        opcode: Opcode,
        header: messages.Message,
        payload: bytes | memoryview,
        *,
        timeout: float,
    ) -> list[Response[Any]]:
        """Send once the request before it is on its way, and gather every
        answer frame. The next turn goes as soon as this frame is queued,
        or this one failed (never later: a failure must not stall it)."""
        try:
            await self._previous.wait()
            async with connection.stream(opcode, header, payload, timeout=timeout) as responses:
                self._sent.set()
                return [response async for response in responses]
        finally:
            self._sent.set()


def append_request(
    items: Sequence[tuple[int, int] | tuple[int, int, ProducerStamp | None]], timeout_ms: int
) -> messages.AppendRequest:
    """An APPEND of ``(stream_id, batch_length[, producer stamp])`` items,
    numbered in order; the payload is their batches end to end."""
    return messages.AppendRequest(
        timeout_ms=timeout_ms,
        append_requests=tuple(_append_info(index, item) for index, item in enumerate(items)),
    )


def _append_info(
    index: int, item: tuple[int, int] | tuple[int, int, ProducerStamp | None]
) -> messages.AppendInfo:
    stamp = item[2] if len(item) == 3 else None
    if stamp is None:
        return messages.AppendInfo(stream_id=item[0], request_index=index, batch_length=item[1])
    return messages.AppendInfo(
        stream_id=item[0],
        request_index=index,
        batch_length=item[1],
        producer_id=stamp.producer_id,
        producer_epoch=stamp.epoch,
        base_sequence=stamp.base_sequence,
    )


def replicate_request(
    items: Sequence[messages.ReplicateInfo], timeout_ms: int
) -> messages.ReplicateRequest:
    """A REPLICATE of a range's items (SPEC §7), in offset order; the
    payload is their batches end to end."""
    return messages.ReplicateRequest(timeout_ms=timeout_ms, replicate_requests=tuple(items))
