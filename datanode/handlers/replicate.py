"""REPLICATE on the wire (SPEC §7): a follower stores the batches its
range's primary sends.

Each item is a batch the primary stored, its base offset stamped, or only
the primary's commit offset (``batch_length`` 0). The batches' structure is
checked here, and that the stamped offset is the item's; ``DataNode.replicate``
then stores them, in arrival order, and answers each item with this
replica's next offset of the range (the accept rules are
``storage.commands.replicate``'s: stored at the range's next offset,
accepted again when already held, OUT_OF_ORDER with the offset to resend
from past a gap).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence

from net.request import Request, Responder
from sbp import messages
from sbp.batches import validate_batch
from sbp.errors import InvalidRecordBatchError, InvalidRequestError, OutOfOrderError, ProtocolError
from storage.model import ReplicaBatch

from ..items import check_stream_id, failed, producer_stamp, split_payload
from ..node import DataNode


class ReplicateHandler:
    """Serves REPLICATE; started as the request arrives, so one primary's
    frames reach storage in the order it sent them."""

    def __init__(self, node: DataNode) -> None:
        self._node = node

    def start(self, request: Request, responder: Responder) -> Awaitable[None]:
        header = request.header_as(messages.ReplicateRequest)
        infos = header.replicate_requests
        # only a range's primary, a data node, may send REPLICATE (SPEC §9)
        denied = self._node.access.check_internal(request.principal, "REPLICATE")
        if denied is not None:
            refused = tuple(_failed(info, denied) for info in infos)
            return responder.send(messages.ReplicateResponse(replicate_responses=refused))
        views = split_payload([info.batch_length for info in infos], request.payload)
        checked = [
            (_check(info, view), info.commit_offset)
            for info, view in zip(infos, views, strict=True)
        ]
        return self._answer(infos, checked, request.deadline(header.timeout_ms), responder)

    async def _answer(
        self,
        infos: Sequence[messages.ReplicateInfo],
        checked: list[tuple[ReplicaBatch | ProtocolError, int]],
        deadline: float,
        responder: Responder,
    ) -> None:
        outcomes = await self._node.replicate(checked, deadline)
        results = tuple(
            _failed(info, outcome)
            if isinstance(outcome, ProtocolError)
            else messages.ReplicateResult(
                stream_id=info.stream_id, range_index=info.range_index, next_offset=outcome
            )
            for info, outcome in zip(infos, outcomes, strict=True)
        )
        await responder.send(messages.ReplicateResponse(replicate_responses=results))


def _check(info: messages.ReplicateInfo, view: memoryview) -> ReplicaBatch | ProtocolError:
    """The item as a ``ReplicaBatch`` (a view of the payload), or the error refusing it alone."""
    try:
        check_stream_id(info.stream_id)
        if info.range_index < 0 or info.base_offset < 0:
            raise InvalidRequestError(
                f"REPLICATE of stream {info.stream_id}: range {info.range_index}, "
                f"offset {info.base_offset}"
            )
        count = 0
        if len(view):
            # The structure only: the frame's checksum proved these are the
            # bytes the primary sent, and it checked their CRC-32C on APPEND.
            batch = validate_batch(view, verify_crc=False)
            if batch.base_offset != info.base_offset:
                raise InvalidRecordBatchError(
                    f"batch stamped at {batch.base_offset}, item says {info.base_offset}"
                )
            count = batch.span
    except ProtocolError as error:
        return error
    stamp = producer_stamp(info) if count else None
    return ReplicaBatch(
        info.stream_id, info.range_index, info.epoch, info.base_offset, view, count, stamp
    )


def _failed(info: messages.ReplicateInfo, error: ProtocolError) -> messages.ReplicateResult:
    return failed(
        messages.ReplicateResult,
        error,
        stream_id=info.stream_id,
        range_index=info.range_index,
        next_offset=error.next_offset if isinstance(error, OutOfOrderError) else -1,
    )
