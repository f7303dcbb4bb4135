"""FETCH: whole record batches from an offset, long-polling at the tail."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import trio

from net.request import Request, Responder
from sbp import messages
from sbp.batches import batch_spans
from sbp.constants import FRAME_OVERHEAD
from sbp.enums import ErrorCode
from sbp.errors import OffsetOutOfRangeError, ProtocolError

from ..context import NodeContext

#: record_count inside a batch header (SPEC §4)
_RECORD_COUNT: Final = struct.Struct(">i")
_RECORD_COUNT_AT: Final = 19
#: room left in a response frame for its FlatBuffers header
_HEADER_ALLOWANCE: Final = 64 * 1024


class FetchHandler:
    """Serves FETCH (SPEC §5).

    Each pass reads every unanswered item (reads are short LMDB cursor scans
    on the event loop). Items with an error are answered at once; items with
    data once their bytes reach ``min_bytes``; the rest wait, subscribed to
    their streams, until an append of one of them becomes durable or
    ``max_wait_ms`` runs out (then they are answered empty, NONE). Every pass
    that answers something sends one response frame; the last one ends the
    sequence. A client that goes away cancels the wait with its connection.
    """

    def __init__(self, node: NodeContext, max_frame_bytes: int) -> None:
        self._node = node
        self._counters = node.metrics.counters
        self._payload_budget = max(max_frame_bytes - FRAME_OVERHEAD - _HEADER_ALLOWANCE, 1)

    async def __call__(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.FetchRequest)
        counters = self._counters
        counters.fetch_requests += 1
        counters.fetch_items += len(header.fetch_requests)
        deadline = request.received_at + max(header.max_wait_ms, 0) / 1000
        infos: Sequence[messages.FetchInfo] = header.fetch_requests
        try:
            if self._node.access.enabled:
                infos = await self._answer_denied(request.principal, infos, responder)
                if not infos:
                    return
            await self._serve(infos, deadline, max(header.min_bytes, 1), responder)
        finally:
            elapsed = trio.current_time() - request.received_at
            counters.fetch_seconds += elapsed

    async def _answer_denied(
        self, principal: str, infos: Sequence[messages.FetchInfo], responder: Responder
    ) -> Sequence[messages.FetchInfo]:
        """Answer the items the principal may not FETCH (SPEC §9) in a frame
        of their own; the others are served as usual."""
        denials = self._node.access.check_each(principal, "FETCH", [i.stream_id for i in infos])
        refused = [_failed(i, d) for i, d in zip(infos, denials, strict=True) if d is not None]
        if not refused:
            return infos
        allowed = [i for i, d in zip(infos, denials, strict=True) if d is None]
        self._counters.fetch_items_failed += len(refused)
        answer = messages.FetchResponse(fetch_responses=tuple(refused))
        await responder.send(answer, end=not allowed)
        return allowed

    async def _serve(
        self,
        infos: Sequence[messages.FetchInfo],
        deadline: float,
        min_bytes: int,
        responder: Responder,
    ) -> None:
        node = self._node
        for stream_id in {info.stream_id for info in infos}:
            if not node.knows(stream_id):
                await node.learn_stream(stream_id)
        pending = list(infos)
        if not pending:
            await responder.send(messages.FetchResponse())
            return
        while True:
            # Subscribed before reading: an append that commits while this
            # pass reads or sends still sets the event.
            with node.waiters.subscribe({info.stream_id for info in pending}) as new_data:
                pending, full = await self._pass(pending, deadline, min_bytes, responder)
                if not pending:
                    return
                if not full:
                    with trio.move_on_at(deadline):
                        await new_data.wait()

    async def _pass(
        self,
        pending: list[messages.FetchInfo],
        deadline: float,
        min_bytes: int,
        responder: Responder,
    ) -> tuple[list[messages.FetchInfo], bool]:
        """Read the pending items (no more than one frame's worth) and answer
        what is ready; returns the items still unanswered and whether a full
        frame left some of them behind.

        The read happens inside the responder's answer room: the bytes are
        counted against the connection's and the server's answer budgets
        from before they are read until they are written, so a peer that
        does not read its answers makes this wait, not the node grow."""
        budget = self._payload_budget
        wanted = sum(min(max(info.batch_max_bytes, 1), budget) for info in pending)
        async with responder.answer_room(min(wanted, budget)):
            return await self._read_and_answer(pending, deadline, min_bytes, responder)

    async def _read_and_answer(
        self,
        pending: list[messages.FetchInfo],
        deadline: float,
        min_bytes: int,
        responder: Responder,
    ) -> tuple[list[messages.FetchInfo], bool]:
        expired = trio.current_time() >= deadline or self._node.draining
        answered: list[tuple[messages.FetchResult, bytes | bytearray]] = []
        with_data: list[tuple[messages.FetchInfo, bytearray]] = []
        waiting: list[messages.FetchInfo] = []
        unread: list[messages.FetchInfo] = []  # past one frame's worth: next pass
        read = 0
        for info in pending:
            if read >= self._payload_budget:
                unread.append(info)
                continue
            try:
                # Never more than fits one frame, whatever batch_max_bytes says
                # (the engine still returns at least one whole batch).
                max_bytes = min(max(info.batch_max_bytes, 1), self._payload_budget - read)
                data = self._read(info, max_bytes)
            except ProtocolError as error:
                self._counters.fetch_items_failed += 1
                answered.append((_failed(info, error), b""))
                continue
            if data:
                with_data.append((info, data))
                read += len(data)
            else:
                waiting.append(info)
        full = False
        if expired or unread or read >= min_bytes:
            budget = self._payload_budget
            for info, data in with_data:
                if answered and len(data) > budget:
                    waiting.append(info)  # next frame
                    full = True
                    continue
                budget -= len(data)
                answered.append((_found(info, data), data))
                self._count(data)
        else:
            waiting.extend(info for info, _ in with_data)
        if unread:
            waiting.extend(unread)
            full = True
        if expired and not full:
            answered.extend((_empty(info), b"") for info in waiting)
            waiting = []
        if answered:
            # one item's batches go out as read (no copy: see
            # GATHERED_PAYLOAD_BYTES); several items' are joined
            payloads = [data for _, data in answered if data]
            await responder.send(
                messages.FetchResponse(fetch_responses=tuple(result for result, _ in answered)),
                payloads[0] if len(payloads) == 1 else b"".join(payloads),
                end=not waiting,
            )
        # keep the request order among the items still pending
        order = {id(info): i for i, info in enumerate(pending)}
        waiting.sort(key=lambda info: order[id(info)])
        return waiting, full

    def _read(self, info: messages.FetchInfo, max_bytes: int) -> bytearray:
        """The item's batches; in a replicated open range only those below the
        commit offset (SPEC §7). A follower behind the primary waits for an
        offset the primary already has instead of refusing it."""
        node = self._node
        limit = node.read_limit(info.stream_id)
        try:
            return node.engine.read(info.stream_id, info.fetch_offset, max_bytes, limit)
        except OffsetOutOfRangeError:
            if limit is None or info.fetch_offset < (node.engine.first_offset(info.stream_id) or 0):
                raise
            return bytearray()

    def _count(self, data: bytearray) -> None:
        records = 0
        for start, _end in batch_spans(data):
            records += _RECORD_COUNT.unpack_from(data, start + _RECORD_COUNT_AT)[0]
        self._counters.fetched_records += records
        self._counters.fetched_bytes += len(data)


def _found(info: messages.FetchInfo, data: bytearray) -> messages.FetchResult:
    return messages.FetchResult(
        stream_id=info.stream_id, request_index=info.request_index, batch_length=len(data)
    )


def _empty(info: messages.FetchInfo) -> messages.FetchResult:
    return messages.FetchResult(stream_id=info.stream_id, request_index=info.request_index)


def _failed(info: messages.FetchInfo, error: ProtocolError) -> messages.FetchResult:
    return messages.FetchResult(
        stream_id=info.stream_id,
        request_index=info.request_index,
        error_code=error.code if error.code != ErrorCode.NONE else ErrorCode.UNKNOWN,
        error_message=error.message,
    )
