"""A stand-in PM served by a test (``net.Dispatcher``): enough of every
opcode the PM serves for the clients' and the data node's tests. It keeps
the requests it was sent, in order."""

from __future__ import annotations

from typing import TypeVar

from net.request import Request, Responder
from net.server import Dispatcher
from sbp import messages as m
from sbp.enums import ClientRole, ErrorCode, Opcode

T = TypeVar("T")

NODE = m.DataNode(node_id=7, advertise_addr="127.0.0.1:9000")


def replica_range(stream_id: int, index: int, start: int, end: int = -1) -> m.Range:
    return m.Range(
        stream_id=stream_id,
        range_index=index,
        start_offset=start,
        end_offset=end,
        next_offset=start if end < 0 else end,
        replica_nodes=(m.ReplicaNode(data_node=NODE, is_primary=True),),
    )


class FakePM:
    """Enough of a PM to answer every opcode it serves. LIST_RANGES of a
    stream answers its ``ranges`` if set, else a sealed range 0..10 and an
    open one after it; with ``known_ranges_only``, a stream not in
    ``ranges`` is not found."""

    def __init__(self, *, known_ranges_only: bool = False) -> None:
        self.streams: dict[int, m.Stream] = {}
        self.ranges: dict[int, list[m.Range]] = {}
        self.known_ranges_only = known_ranges_only
        self.requests: list[object] = []

    def sent(self, kind: type[T]) -> list[T]:
        """The requests of one kind, in order."""
        return [r for r in self.requests if isinstance(r, kind)]

    @property
    def heartbeats(self) -> list[m.HeartbeatRequest]:
        return self.sent(m.HeartbeatRequest)

    @property
    def reports(self) -> list[m.ReportMetricsRequest]:
        return self.sent(m.ReportMetricsRequest)

    @property
    def lookups(self) -> list[int]:
        """The streams LIST_RANGES asked for, in order."""
        return [
            owner.stream_id
            for request in self.sent(m.ListRangesRequest)
            for owner in request.range_owners
            if owner.data_node is None
        ]

    def dispatcher(self) -> Dispatcher:
        dispatcher = Dispatcher("PM")
        for opcode, handler in {
            Opcode.HEARTBEAT: self.heartbeat,
            Opcode.CREATE_STREAMS: self.create,
            Opcode.DELETE_STREAMS: self.delete,
            Opcode.UPDATE_STREAMS: self.update,
            Opcode.GET_STREAMS: self.get,
            Opcode.TRIM_STREAMS: self.trim,
            Opcode.LIST_RANGES: self.list_ranges,
            Opcode.SEAL_RANGES: self.seal,
            Opcode.DESCRIBE_RANGES: self.describe,
            Opcode.REPORT_METRICS: self.report,
            Opcode.DESCRIBE_CLUSTER: self.cluster,
        }.items():
            dispatcher.register(opcode, handler)
        return dispatcher

    async def heartbeat(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.HeartbeatRequest)
        self.requests.append(header)
        await responder.send(
            m.HeartbeatResponse(client_id=header.client_id, client_role=ClientRole.PM)
        )

    async def create(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.CreateStreamsRequest)
        self.requests.append(header)
        results = []
        for stream in header.streams:
            if stream.replica_nums > 3:
                results.append(
                    m.CreateStreamResult(
                        error_code=ErrorCode.NO_AVAILABLE_DATA_NODE, error_message="need more"
                    )
                )
                continue
            stream_id = len(self.streams) + 1
            created = m.Stream(
                stream_id=stream_id,
                replica_nums=stream.replica_nums,
                retention_period_ms=stream.retention_period_ms,
            )
            self.streams[stream_id] = created
            results.append(
                m.CreateStreamResult(stream=created, range=replica_range(stream_id, 0, 0))
            )
        await responder.send(m.CreateStreamsResponse(create_responses=tuple(results)))

    def _missing(self, stream_id: int) -> tuple[ErrorCode, str]:
        return ErrorCode.STREAM_NOT_FOUND, f"no stream {stream_id}"

    async def delete(self, request: Request, responder: Responder) -> None:
        results = []
        for stream in request.header_as(m.DeleteStreamsRequest).streams:
            if self.streams.pop(stream.stream_id, None) is None:
                code, text = self._missing(stream.stream_id)
                results.append(m.DeleteStreamResult(error_code=code, error_message=text))
            else:
                results.append(m.DeleteStreamResult(deleted_stream=stream))
        await responder.send(m.DeleteStreamsResponse(delete_responses=tuple(results)))

    async def update(self, request: Request, responder: Responder) -> None:
        results = []
        for stream in request.header_as(m.UpdateStreamsRequest).streams:
            if stream.stream_id in self.streams:
                self.streams[stream.stream_id] = stream
                results.append(m.UpdateStreamResult(stream=stream))
            else:
                code, text = self._missing(stream.stream_id)
                results.append(m.UpdateStreamResult(error_code=code, error_message=text))
        await responder.send(m.UpdateStreamsResponse(update_responses=tuple(results)))

    async def get(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.GetStreamsRequest)
        self.requests.append(header)
        if header.stream_ids:
            results = []
            for stream_id in header.stream_ids:
                if stream_id in self.streams:
                    results.append(m.GetStreamResult(stream=self.streams[stream_id]))
                else:
                    code, text = self._missing(stream_id)
                    results.append(m.GetStreamResult(error_code=code, error_message=text))
        else:
            ids = sorted(i for i in self.streams if i > header.start_after)[: header.limit]
            results = [m.GetStreamResult(stream=self.streams[i]) for i in ids]
        await responder.send(m.GetStreamsResponse(get_responses=tuple(results)))

    async def trim(self, request: Request, responder: Responder) -> None:
        results = tuple(
            m.TrimStreamResult(
                trimmed_stream=self.streams[trim.stream_id],
                range=replica_range(trim.stream_id, 1, trim.trim_offset),
            )
            for trim in request.header_as(m.TrimStreamsRequest).trimmed_streams
        )
        await responder.send(m.TrimStreamsResponse(trim_responses=results))

    async def list_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.ListRangesRequest)
        self.requests.append(header)
        results = []
        for owner in header.range_owners:
            if owner.data_node is not None:
                ranges = tuple(replica_range(i, 0, 0) for i in sorted(self.streams))
            elif owner.stream_id in self.ranges:
                ranges = tuple(self.ranges[owner.stream_id])
            elif self.known_ranges_only:
                code, text = self._missing(owner.stream_id)
                results.append(
                    m.ListRangesResult(range_owner=owner, error_code=code, error_message=text)
                )
                continue
            else:
                ranges = (
                    replica_range(owner.stream_id, 0, 0, 10),
                    replica_range(owner.stream_id, 1, 10),
                )
            results.append(m.ListRangesResult(range_owner=owner, ranges=ranges))
        await responder.send(m.ListRangesResponse(list_responses=tuple(results)))

    async def seal(self, request: Request, responder: Responder) -> None:
        results = []
        for range_id in request.header_as(m.SealRangesRequest).ranges:
            if range_id.range_index > 0:
                results.append(
                    m.SealRangesResult(
                        stream_id=range_id.stream_id,
                        error_code=ErrorCode.RANGE_SEALED,
                        error_message="sealed already",
                    )
                )
                continue
            sealed = replica_range(range_id.stream_id, 0, 0, 10)
            opened = replica_range(range_id.stream_id, 1, 10)
            results.append(
                m.SealRangesResult(stream_id=range_id.stream_id, ranges=(sealed, opened))
            )
        await responder.send(m.SealRangesResponse(seal_responses=tuple(results)))

    async def describe(self, request: Request, responder: Responder) -> None:
        results = tuple(
            m.DescribeRangeResult(
                stream_id=range_id.stream_id,
                range=replica_range(range_id.stream_id, range_id.range_index, 0),
            )
            for range_id in request.header_as(m.DescribeRangesRequest).ranges
        )
        await responder.send(m.DescribeRangesResponse(describe_responses=results))

    async def report(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.ReportMetricsRequest)
        self.requests.append(header)
        await responder.send(m.ReportMetricsResponse(data_node=header.data_node))

    async def cluster(self, request: Request, responder: Responder) -> None:
        status = m.DataNodeStatus(data_node=NODE, alive=True, range_count=len(self.streams))
        await responder.send(m.DescribeClusterResponse(data_nodes=(status,)))
