"""REPLICATE (SPEC §7): a follower stores the batches its range's primary sends.

Each item is a batch the primary stored, its base offset stamped, or only the
primary's commit offset (``batch_length`` 0). The batches are checked here
(their structure, and that the stamped offset is the item's), then go to the
storage writer in one command, in arrival order, where the accept rules of
``storage.writes.replicate`` decide each: stored at the range's next offset,
accepted again when already held, OUT_OF_ORDER with the offset to resend from
past a gap. Each item is answered after that command is durable, with this
replica's next offset of the range. The commit offset an accepted item
carries is what FETCH on this replica may serve up to.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from concurrent.futures import Future

import trio

from net.request import Request, Responder
from sbp import messages
from sbp.batches import validate_batch
from sbp.enums import ErrorCode
from sbp.errors import InvalidRecordBatchError, InvalidRequestError, OutOfOrderError, ProtocolError
from storage.writes import ReplicaBatch

from ..context import NodeContext, check_stream_id, wait_future
from .ranges import error_code, timed_out

#: a REPLICATE's batches in the storage writer: per item, a next offset or an error
Stored = Future[list[int | ProtocolError]]


class ReplicateHandler:
    """Serves REPLICATE; submitted as the request arrives, so one primary's
    frames reach storage in the order it sent them."""

    def __init__(self, node: NodeContext) -> None:
        self._node = node

    def start(self, request: Request, responder: Responder) -> Awaitable[None]:
        header = request.header_as(messages.ReplicateRequest)
        infos = header.replicate_requests
        denied = self._node.access.check_internal(request.principal, "REPLICATE")
        if denied is not None:  # only a range's primary, a data node, may
            return responder.send(
                messages.ReplicateResponse(
                    replicate_responses=tuple(_failed(info, denied) for info in infos)
                )
            )
        checked = _check_items(infos, request.payload)
        deadline = request.deadline(header.timeout_ms)
        node = self._node
        unknown = {i.stream_id for i in infos if not node.knows(i.stream_id)}
        if unknown:
            return self._learn_then_store(infos, checked, unknown, deadline, responder)
        return self._answer(infos, checked, self._submit(checked), deadline, responder)

    def _submit(self, checked: list[ReplicaBatch | ProtocolError]) -> Stored | None:
        batches = [item for item in checked if isinstance(item, ReplicaBatch) and item.record_count]
        return self._node.engine.submit_replicas(batches) if batches else None

    async def _learn_then_store(
        self,
        infos: Sequence[messages.ReplicateInfo],
        checked: list[ReplicaBatch | ProtocolError],
        unknown: set[int],
        deadline: float,
        responder: Responder,
    ) -> None:
        with trio.move_on_at(deadline):
            for stream_id in sorted(unknown):
                await self._node.learn_stream(stream_id)
        await self._answer(infos, checked, self._submit(checked), deadline, responder)

    async def _answer(
        self,
        infos: Sequence[messages.ReplicateInfo],
        checked: list[ReplicaBatch | ProtocolError],
        submitted: Stored | None,
        deadline: float,
        responder: Responder,
    ) -> None:
        outcomes: list[int | ProtocolError] = []
        stored_items = [c for c in checked if isinstance(c, ReplicaBatch) and c.record_count]
        if submitted is not None:
            try:
                with trio.fail_at(deadline):
                    outcomes = await wait_future(submitted)
            except trio.TooSlowError:
                outcomes = [timed_out()] * len(stored_items)
        stored = iter(outcomes)
        results: list[messages.ReplicateResult] = []
        relearn: set[int] = set()
        for info, item in zip(infos, checked, strict=True):
            outcome: int | ProtocolError
            if not isinstance(item, ReplicaBatch):
                outcome = item
            elif item.record_count:
                outcome = next(stored)
            else:
                # Only the primary's commit offset: answered from what is
                # durable now, without a trip through the storage writer.
                try:
                    outcome = self._node.engine.replica_position(item)
                except ProtocolError as error:
                    outcome = error
            if isinstance(outcome, ProtocolError):
                if outcome.code == ErrorCode.RANGE_NOT_FOUND and info.stream_id >= 0:
                    relearn.add(info.stream_id)
                results.append(_failed(info, outcome))
                continue
            self._node.commits.advance(info.stream_id, info.range_index, info.commit_offset)
            results.append(
                messages.ReplicateResult(
                    stream_id=info.stream_id, range_index=info.range_index, next_offset=outcome
                )
            )
        # A range this node has not heard of yet (SYNC_RANGES still on its
        # way): ask the PM now, so that the primary's next try finds it.
        with trio.move_on_at(deadline):
            for stream_id in sorted(relearn):
                await self._node.learn_stream(stream_id)
        await responder.send(messages.ReplicateResponse(replicate_responses=tuple(results)))


def _check_items(
    infos: Sequence[messages.ReplicateInfo], payload: memoryview
) -> list[ReplicaBatch | ProtocolError]:
    """Each item as a ``ReplicaBatch`` (a view of the payload), or the error
    refusing it alone; a payload that is not the items' batches end to end
    fails the whole request."""
    checked: list[ReplicaBatch | ProtocolError] = []
    position = 0
    for info in infos:
        length = info.batch_length
        if length < 0 or position + length > len(payload):
            break
        view = payload[position : position + length]
        position += length
        try:
            check_stream_id(info.stream_id)
            if info.range_index < 0 or info.base_offset < 0:
                raise InvalidRequestError(
                    f"REPLICATE of stream {info.stream_id}: range {info.range_index}, "
                    f"offset {info.base_offset}"
                )
            count = 0
            if length:
                # The structure only: the frame's checksum proved these are the
                # bytes the primary sent, and it checked their CRC-32C on APPEND.
                batch = validate_batch(view, verify_crc=False)
                if batch.base_offset != info.base_offset:
                    raise InvalidRecordBatchError(
                        f"batch stamped at {batch.base_offset}, item says {info.base_offset}"
                    )
                count = batch.record_count
            checked.append(
                ReplicaBatch(
                    info.stream_id, info.range_index, info.epoch, info.base_offset, view, count
                )
            )
        except ProtocolError as error:
            checked.append(error)
    if len(checked) != len(infos) or position != len(payload):
        total = sum(info.batch_length for info in infos)
        raise InvalidRequestError(
            f"payload holds {len(payload)} bytes but the batch_lengths of {len(infos)} items "
            f"sum to {total}"
        )
    return checked


def _failed(info: messages.ReplicateInfo, error: ProtocolError) -> messages.ReplicateResult:
    next_offset = error.next_offset if isinstance(error, OutOfOrderError) else -1
    return messages.ReplicateResult(
        stream_id=info.stream_id,
        range_index=info.range_index,
        error_code=error_code(error),
        error_message=error.message,
        next_offset=next_offset,
    )
