"""FETCH on the wire (SPEC §5): whole record batches from an offset,
long-polling at the tail. What each item may read is ``DataNode.read``'s
to decide; this module shapes the answer frames and the wait, and charges
what each frame carries to the principal's quota (SPEC §12)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Final

import trio

from net.request import Request, Responder
from sbp import messages
from sbp.constants import FRAME_OVERHEAD
from sbp.errors import ConnectionClosed, ProtocolError
from storage.engine import BorrowedBatches, StorageEngine
from storage.model import RangeInfo

from ..items import failed
from ..node import DataNode

#: read transactions one FETCH pass keeps open while it answers
_MAX_BORROWED_READS: Final = 8
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

    def __init__(self, node: DataNode, max_frame_bytes: int) -> None:
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
            if infos:
                infos = await self._answer_denied(request.principal, infos, responder)
                if not infos:
                    return  # every item refused, answered
            quotas, principal = self._node.quotas, request.principal

            def charge(nbytes: int) -> int:
                throttle_ms = quotas.charge(principal, "fetch", nbytes)
                if throttle_ms:
                    request.connection.hold_reads(throttle_ms / 1000)
                return throttle_ms

            await self._serve(infos, deadline, max(header.min_bytes, 1), responder, charge)
        finally:
            elapsed = trio.current_time() - request.received_at
            counters.fetch_seconds += elapsed

    async def _answer_denied(
        self, principal: str, infos: Sequence[messages.FetchInfo], responder: Responder
    ) -> Sequence[messages.FetchInfo]:
        """Answer the items the principal may not FETCH (SPEC §9) in a frame
        of their own; the others are served as usual."""
        access = self._node.access
        if not access.enabled:
            return infos
        denials = access.check_each(principal, "FETCH", [i.stream_id for i in infos])
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
        charge: Callable[[int], int],
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
                pending, full = await self._pass(pending, deadline, min_bytes, responder, charge)
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
        charge: Callable[[int], int],
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
            from_store = await self._read_from_store(pending)
            with _Reads(from_store) as reads:
                # nothing from here to the answer waits: the batches are
                # borrowed from LMDB's map and written to the socket as
                # they are (``Responder.send_borrowed_nowait``)
                return self._read_and_answer(pending, deadline, min_bytes, responder, reads, charge)

    async def _read_from_store(
        self, pending: list[messages.FetchInfo]
    ) -> dict[int, BorrowedBatches | ProtocolError]:
        """The batches of the items whose offsets lie in ranges in the object
        store only (SPEC §14), read all at once, by ``id`` of the item; the
        store's error for those it could not read in time."""
        node = self._node
        found: dict[int, BorrowedBatches | ProtocolError] = {}
        tiering = node.tiering
        if tiering is None:
            return found
        where = {
            id(info): node.in_object_store(info.stream_id, info.fetch_offset) for info in pending
        }
        unknown = {info.stream_id for info in pending if where[id(info)] is True}
        for stream_id in unknown:
            # a range this node does not host: the PM may list it in the
            # store only (this node's view of the stream may be old)
            if tiering.may_look_up(stream_id):
                await node.learn_stream(stream_id)
        if unknown:
            for info in pending:
                if where[id(info)] is True:
                    where[id(info)] = node.in_object_store(info.stream_id, info.fetch_offset)
        wanted = [(info, rng) for info in pending if isinstance(rng := where[id(info)], RangeInfo)]
        if not wanted:
            return found

        async def read(info: messages.FetchInfo, rng: RangeInfo) -> None:
            max_bytes = min(max(info.batch_max_bytes, 1), self._payload_budget)
            try:
                found[id(info)] = await tiering.read(rng, info.fetch_offset, max_bytes)
            except ProtocolError as error:
                found[id(info)] = error

        if len(wanted) == 1:
            await read(*wanted[0])
            return found
        async with trio.open_nursery() as nursery:
            for info, rng in wanted:
                nursery.start_soon(read, info, rng)
        return found

    def _read_and_answer(
        self,
        pending: list[messages.FetchInfo],
        deadline: float,
        min_bytes: int,
        responder: Responder,
        reads: _Reads,
        charge: Callable[[int], int],
    ) -> tuple[list[messages.FetchInfo], bool]:
        expired = trio.current_time() >= deadline or self._node.draining
        answered: list[tuple[messages.FetchResult, BorrowedBatches | None]] = []
        with_data: list[tuple[messages.FetchInfo, BorrowedBatches]] = []
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
                data = reads.from_store(info)
                if data is None:
                    data = self._node.read(info.stream_id, info.fetch_offset, max_bytes, reads)
            except ProtocolError as error:
                self._counters.fetch_items_failed += 1
                answered.append((_failed(info, error), None))
                continue
            if data.size:
                with_data.append((info, data))
                read += data.size
            else:
                waiting.append(info)
        full = False
        if expired or unread or read >= min_bytes:
            budget = self._payload_budget
            for info, data in with_data:
                if answered and data.size > budget:
                    waiting.append(info)  # next frame
                    full = True
                    continue
                budget -= data.size
                answered.append((_found(info, data.size), data))
                self._count(data)
        else:
            waiting.extend(info for info, _ in with_data)
        if unread:
            waiting.extend(unread)
            full = True
        if expired and not full:
            answered.extend((_empty(info), None) for info in waiting)
            waiting = []
        if answered:
            payload = [piece for _, data in answered if data for piece in data.buffers()]
            size = sum(data.size for _, data in answered if data)
            header = messages.FetchResponse(
                fetch_responses=tuple(r for r, _ in answered),
                throttle_time_ms=charge(size) if size else 0,
            )
            if not responder.send_borrowed_nowait(header, payload, end=not waiting):
                raise ConnectionClosed("the connection closed during a FETCH")
        # keep the request order among the items still pending
        order = {id(info): i for i, info in enumerate(pending)}
        waiting.sort(key=lambda info: order[id(info)])
        return waiting, full

    def _count(self, data: BorrowedBatches) -> None:
        self._counters.fetched_records += data.record_count
        self._counters.fetched_bytes += data.size


class _Reads:
    """The read transactions a pass holds open until its answer is written,
    at most ``_MAX_BORROWED_READS`` (each takes one of LMDB's reader
    slots); the batches of items read past that are copied out at once."""

    def __init__(self, from_store: dict[int, BorrowedBatches | ProtocolError]) -> None:
        self._open = contextlib.ExitStack()
        self._held = 0
        #: what was read from the object store, by ``id`` of the item
        self._from_store = from_store

    def from_store(self, info: messages.FetchInfo) -> BorrowedBatches | None:
        """The item's batches read from the object store (raised: the
        store's error); None for an item read here."""
        found = self._from_store.get(id(info))
        if isinstance(found, ProtocolError):
            raise found
        return found

    def __enter__(self) -> _Reads:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._open.close()

    def borrow(
        self, engine: StorageEngine, stream_id: int, offset: int, max_bytes: int, limit: int | None
    ) -> BorrowedBatches:
        """``StorageEngine.borrow``'s batches, valid until this closes."""
        if self._held < _MAX_BORROWED_READS:
            found = self._open.enter_context(engine.borrow(stream_id, offset, max_bytes, limit))
            self._held += 1
            return found
        with engine.borrow(stream_id, offset, max_bytes, limit) as found:
            return found.detach()


def _found(info: messages.FetchInfo, size: int) -> messages.FetchResult:
    return messages.FetchResult(
        stream_id=info.stream_id, request_index=info.request_index, batch_length=size
    )


def _empty(info: messages.FetchInfo) -> messages.FetchResult:
    return messages.FetchResult(stream_id=info.stream_id, request_index=info.request_index)


def _failed(info: messages.FetchInfo, error: ProtocolError) -> messages.FetchResult:
    return failed(
        messages.FetchResult, error, stream_id=info.stream_id, request_index=info.request_index
    )
