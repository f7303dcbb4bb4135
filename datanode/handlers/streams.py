"""DELETE_STREAMS on a data node: mark deleted, refuse writes, free the data."""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial

import trio

from net.request import Request, Responder
from sbp import messages
from sbp.errors import ProtocolError
from storage import writes

from ..context import NodeContext, check_stream_id, prefetch_dropped, wait_future
from .ranges import error_code, timed_out


class StreamHandlers:
    def __init__(self, node: NodeContext) -> None:
        self._node = node

    async def delete_streams(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DeleteStreamsRequest)
        deadline = request.deadline(header.timeout_ms)
        engine = self._node.engine
        refusals: list[ProtocolError | None] = []
        for stream in header.streams:
            try:
                check_stream_id(stream.stream_id)
                refusals.append(
                    self._node.access.check(request.principal, "DELETE", stream.stream_id)
                )
            except ProtocolError as refused:
                refusals.append(refused)
        # every chunk of a deleted stream is freed: read them off the writer's path
        await prefetch_dropped(
            engine,
            [
                (stream.stream_id, [])
                for stream, refused in zip(header.streams, refusals, strict=True)
                if refused is None
            ],
        )
        futures: list[Future[None] | ProtocolError] = [
            refused
            if refused is not None
            else engine.submit_command(partial(writes.delete_stream, stream_id=stream.stream_id))
            for stream, refused in zip(header.streams, refusals, strict=True)
        ]
        results: list[messages.DeleteStreamResult] = []
        for stream, future in zip(header.streams, futures, strict=True):
            deleted = messages.Stream(stream_id=stream.stream_id)
            failure = await _outcome(future, deadline)
            if failure is None:
                # FETCHes waiting on the stream now get STREAM_DELETED.
                self._node.waiters.notify(stream.stream_id)
                results.append(messages.DeleteStreamResult(deleted_stream=deleted))
            else:
                results.append(
                    messages.DeleteStreamResult(
                        deleted_stream=deleted,
                        error_code=error_code(failure),
                        error_message=failure.message,
                    )
                )
        await responder.send(messages.DeleteStreamsResponse(delete_responses=tuple(results)))


async def _outcome(future: Future[None] | ProtocolError, deadline: float) -> ProtocolError | None:
    """The error an item failed with, or None once its change committed."""
    if isinstance(future, ProtocolError):
        return future
    try:
        with trio.fail_at(deadline):
            await wait_future(future)
    except trio.TooSlowError:
        return timed_out()
    except ProtocolError as error:
        return error
    return None
