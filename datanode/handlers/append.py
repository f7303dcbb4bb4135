"""APPEND on the wire (SPEC §5): the request's items to ``DataNode.append``
and its outcomes back as one AppendResponse, with the throttle of the
principal's quota (SPEC §12) when it is over it."""

from __future__ import annotations

import math
from collections.abc import Awaitable

import trio

from net.request import Request, Responder
from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import OutOfOrderSequenceError, ProtocolError
from storage.model import AppendItem, AppendOutcome

from ..items import failed, producer_stamp, split_payload
from ..node import DataNode


class AppendHandler:
    """Serves APPEND without a task per request: ``start`` is called by the
    connection's reader as soon as a request is decoded (so arrival order is
    submission order); the answer is sent from the core's completion."""

    def __init__(self, node: DataNode) -> None:
        self._node = node

    def start(self, request: Request, responder: Responder) -> Awaitable[None] | None:
        node = self._node
        header = request.header_as(messages.AppendRequest)
        infos = header.append_requests
        views = split_payload([info.batch_length for info in infos], request.payload)
        items = [
            AppendItem(info.stream_id, view, producer_stamp(info))
            for info, view in zip(infos, views, strict=True)
        ]

        # Charged as it arrives, and the connection held at once: the
        # requests behind it stay unread for the throttle, so what a client
        # pipelines cannot run past its rate before the first answer.
        throttle_ms = node.quotas.charge(request.principal, "append", len(request.payload))
        held_until = trio.current_time() + throttle_ms / 1000
        if throttle_ms:
            request.connection.hold_reads(throttle_ms / 1000)

        def answer(outcomes: list[AppendOutcome] | None) -> None:
            if responder.done:
                return
            if outcomes is None:
                responder.send_error_nowait(ErrorCode.UNKNOWN, "internal server error")
                return
            results = tuple(_result(info, o) for info, o in zip(infos, outcomes, strict=True))
            # what is left of the hold: the client's wait before its next APPEND
            left_ms = math.ceil((held_until - trio.current_time()) * 1000) if throttle_ms else 0
            responder.send_nowait(
                messages.AppendResponse(append_responses=results, throttle_time_ms=max(left_ms, 0))
            )

        access = node.access
        denials = (
            access.check_each(request.principal, "APPEND", [item.stream_id for item in items])
            if items and access.enabled
            else ()
        )
        return self._node.append(
            items,
            denials,
            request.connection,
            request.deadline(header.timeout_ms),
            request.received_at,
            answer,
        )


def _result(info: messages.AppendInfo, outcome: AppendOutcome) -> messages.AppendResult:
    if isinstance(outcome, ProtocolError):
        return failed(
            messages.AppendResult,
            outcome,
            stream_id=info.stream_id,
            request_index=info.request_index,
            base_offset=-1,
            next_sequence=(
                outcome.next_sequence if isinstance(outcome, OutOfOrderSequenceError) else -1
            ),
        )
    return messages.AppendResult(
        stream_id=info.stream_id,
        request_index=info.request_index,
        base_offset=outcome.base_offset,
        stream_append_time_ms=outcome.append_time_ms,
    )
