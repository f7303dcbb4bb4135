"""DELETE_STREAMS on the wire: each stream to ``DataNode.delete``, each
answered alone (DELETE of it, with an ACL file, SPEC §9); PRODUCER_STATE
(between data nodes, the cluster's principals only): a stream's producer
state from ``DataNode.producer_snapshot``."""

from __future__ import annotations

from net.request import Request, Responder
from sbp import messages

from ..items import failed
from ..node import DataNode


class StreamHandlers:
    def __init__(self, node: DataNode) -> None:
        self._node = node

    async def delete_streams(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DeleteStreamsRequest)
        stream_ids = [stream.stream_id for stream in header.streams]
        access = self._node.access
        denials = [access.check(request.principal, "DELETE", s) for s in stream_ids]
        deleted = await self._node.delete(stream_ids, denials, request.deadline(header.timeout_ms))
        results = tuple(
            messages.DeleteStreamResult(deleted_stream=messages.Stream(stream_id=stream_id))
            if failure is None
            else failed(
                messages.DeleteStreamResult,
                failure,
                deleted_stream=messages.Stream(stream_id=stream_id),
            )
            for stream_id, failure in zip(stream_ids, deleted, strict=True)
        )
        await responder.send(messages.DeleteStreamsResponse(delete_responses=results))

    async def producer_state(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.ProducerStateRequest)
        denied = self._node.access.check_internal(request.principal, "PRODUCER_STATE")
        if denied is not None:
            await responder.send(failed(messages.ProducerStateResponse, denied))
            return
        await responder.send(self._node.producer_snapshot(header.stream_id, header.as_of_offset))
