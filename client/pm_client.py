"""``PMClient``: every request the placement manager serves (SPEC §2, §5).

Batch methods (``create_streams``, ``seal_ranges`` …) return the per-item
results as the PM sent them, each with its own ``error_code``. One-item
conveniences (``create_stream``, ``get_stream``, ``seal_range`` …) raise the
exception for a non-NONE code instead (``sbp.errors.error_for``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from sbp import messages
from sbp.answer_frames import join_fetch_offsets, join_list_groups
from sbp.enums import Opcode
from sbp.errors import StreamNotFoundError, raise_for_code

from ._base import single
from ._ranges import RangeCalls

#: streams per GET_STREAMS page when listing them all
DEFAULT_PAGE_SIZE = 500


class PMClient(RangeCalls):
    """A client of the placement manager (see ``SBPClient`` for how it connects).

    Range calls (``list_ranges``, ``seal_ranges``, ``describe_ranges``) and
    ``delete_streams`` come from ``RangeCalls``: the PM and the data node
    serve them with the same tables."""

    # -- streams ----------------------------------------------------------------

    async def create_streams(
        self, streams: Sequence[messages.Stream], *, timeout: float | None = None
    ) -> tuple[messages.CreateStreamResult, ...]:
        """CREATE_STREAMS: each result holds the stream (id assigned) and its range 0."""
        request = messages.CreateStreamsRequest(
            timeout_ms=self.timeout_ms(timeout), streams=tuple(streams)
        )
        header = await self.call_for(
            messages.CreateStreamsResponse, Opcode.CREATE_STREAMS, request, timeout=timeout
        )
        return header.create_responses

    async def create_stream(
        self,
        replica_nums: int,
        *,
        retention_period_ms: int = 0,
        ack_nums: int = 0,
        timeout: float | None = None,
    ) -> messages.CreateStreamResult:
        """Create one stream; the result has ``stream`` and its first writable
        ``range``. ``ack_nums`` 0 acknowledges once a majority of the
        replicas hold a record (SPEC §7)."""
        stream = messages.Stream(
            replica_nums=replica_nums, retention_period_ms=retention_period_ms, ack_nums=ack_nums
        )
        result = single(await self.create_streams([stream], timeout=timeout), "CREATE_STREAMS")
        raise_for_code(result.error_code, result.error_message)
        return result

    async def update_streams(
        self, streams: Sequence[messages.Stream], *, timeout: float | None = None
    ) -> tuple[messages.UpdateStreamResult, ...]:
        request = messages.UpdateStreamsRequest(
            timeout_ms=self.timeout_ms(timeout), streams=tuple(streams)
        )
        header = await self.call_for(
            messages.UpdateStreamsResponse, Opcode.UPDATE_STREAMS, request, timeout=timeout
        )
        return header.update_responses

    async def update_stream(
        self, stream: messages.Stream, *, timeout: float | None = None
    ) -> messages.Stream:
        """Update one stream's settings; returns the stream as stored."""
        result = single(await self.update_streams([stream], timeout=timeout), "UPDATE_STREAMS")
        raise_for_code(result.error_code, result.error_message)
        return _present(result.stream, stream.stream_id)

    async def get_streams(
        self, stream_ids: Sequence[int], *, timeout: float | None = None
    ) -> tuple[messages.GetStreamResult, ...]:
        """GET_STREAMS by id (a result per id, in order)."""
        request = messages.GetStreamsRequest(
            timeout_ms=self.timeout_ms(timeout), stream_ids=tuple(stream_ids)
        )
        header = await self.call_for(
            messages.GetStreamsResponse, Opcode.GET_STREAMS, request, timeout=timeout
        )
        return header.get_responses

    async def get_stream(self, stream_id: int, *, timeout: float | None = None) -> messages.Stream:
        result = single(await self.get_streams([stream_id], timeout=timeout), "GET_STREAMS")
        raise_for_code(result.error_code, result.error_message)
        return _present(result.stream, stream_id)

    async def get_streams_page(
        self, *, start_after: int = 0, limit: int = DEFAULT_PAGE_SIZE, timeout: float | None = None
    ) -> tuple[messages.Stream, ...]:
        """One page of the listing of every stream: ids above ``start_after``."""
        request = messages.GetStreamsRequest(
            timeout_ms=self.timeout_ms(timeout), start_after=start_after, limit=limit
        )
        header = await self.call_for(
            messages.GetStreamsResponse, Opcode.GET_STREAMS, request, timeout=timeout
        )
        streams = []
        for result in header.get_responses:
            raise_for_code(result.error_code, result.error_message)
            if result.stream is not None:
                streams.append(result.stream)
        return tuple(streams)

    def list_streams(
        self, *, page_size: int = DEFAULT_PAGE_SIZE, timeout: float | None = None
    ) -> AsyncIterator[messages.Stream]:
        """Every stream, in id order, fetched a page at a time as iteration goes."""
        return _StreamListing(self, page_size, timeout)

    async def trim_streams(
        self, trims: Sequence[messages.TrimmedStream], *, timeout: float | None = None
    ) -> tuple[messages.TrimStreamResult, ...]:
        request = messages.TrimStreamsRequest(
            timeout_ms=self.timeout_ms(timeout), trimmed_streams=tuple(trims)
        )
        header = await self.call_for(
            messages.TrimStreamsResponse, Opcode.TRIM_STREAMS, request, timeout=timeout
        )
        return header.trim_responses

    async def trim_stream(
        self, stream_id: int, trim_offset: int, *, timeout: float | None = None
    ) -> messages.TrimStreamResult:
        """Drop records below ``trim_offset``; the result has the stream's new first range."""
        trim = messages.TrimmedStream(stream_id=stream_id, trim_offset=trim_offset)
        result = single(await self.trim_streams([trim], timeout=timeout), "TRIM_STREAMS")
        raise_for_code(result.error_code, result.error_message)
        return result

    # -- cluster ----------------------------------------------------------------

    async def report_metrics(
        self, report: messages.ReportMetricsRequest, *, timeout: float | None = None
    ) -> messages.ReportMetricsResponse:
        """REPORT_METRICS: a data node's load report."""
        header = await self.call_for(
            messages.ReportMetricsResponse, Opcode.REPORT_METRICS, report, timeout=timeout
        )
        return header

    async def describe_cluster(
        self, *, timeout: float | None = None
    ) -> tuple[messages.DataNodeStatus, ...]:
        """DESCRIBE_CLUSTER: the data nodes the PM knows, their liveness and load."""
        request = messages.DescribeClusterRequest(timeout_ms=self.timeout_ms(timeout))
        header = await self.call_for(
            messages.DescribeClusterResponse, Opcode.DESCRIBE_CLUSTER, request, timeout=timeout
        )
        raise_for_code(header.error_code, header.error_message)
        return header.data_nodes

    async def drain_data_nodes(
        self, node_ids: Sequence[int], *, cancel: bool = False, timeout: float | None = None
    ) -> tuple[messages.DrainResult, ...]:
        """DRAIN_DATA_NODES (SPEC §12): mark nodes draining, or with
        ``cancel`` active again; each node's result and state."""
        request = messages.DrainDataNodesRequest(
            timeout_ms=self.timeout_ms(timeout), node_ids=tuple(node_ids), cancel=cancel
        )
        header = await self.call_for(
            messages.DrainDataNodesResponse, Opcode.DRAIN_DATA_NODES, request, timeout=timeout
        )
        return header.drain_responses

    async def remove_data_nodes(
        self, node_ids: Sequence[int], *, timeout: float | None = None
    ) -> tuple[messages.RemoveResult, ...]:
        """REMOVE_DATA_NODES (implementation-private): forget data nodes that
        are stopped and hold no range."""
        request = messages.RemoveDataNodesRequest(
            timeout_ms=self.timeout_ms(timeout), node_ids=tuple(node_ids)
        )
        header = await self.call_for(
            messages.RemoveDataNodesResponse, Opcode.REMOVE_DATA_NODES, request, timeout=timeout
        )
        return header.remove_responses

    async def rebalance(
        self, *, dry_run: bool = False, timeout: float | None = None
    ) -> messages.RebalanceResponse:
        """REBALANCE (implementation-private): the moves that even out the
        data nodes, started unless ``dry_run``."""
        request = messages.RebalanceRequest(timeout_ms=self.timeout_ms(timeout), dry_run=dry_run)
        header = await self.call_for(
            messages.RebalanceResponse, Opcode.REBALANCE, request, timeout=timeout
        )
        raise_for_code(header.error_code, header.error_message)
        return header

    # -- producers ------------------------------------------------------------

    async def init_producer(
        self, name: str = "", epoch: int = -1, *, timeout: float | None = None
    ) -> tuple[int, int]:
        """INIT_PRODUCER (SPEC §10): ``(producer_id, epoch)`` for idempotent
        appends. An empty ``name`` gets a new id at epoch 0; a name keeps its
        id, and epoch -1 fences the instance before it. ``ProducerFencedError``
        when ``epoch`` is below the one the PM holds."""
        request = messages.InitProducerRequest(
            timeout_ms=self.timeout_ms(timeout), producer_name=name, producer_epoch=epoch
        )
        header = await self.call_for(
            messages.InitProducerResponse, Opcode.INIT_PRODUCER, request, timeout=timeout
        )
        raise_for_code(header.error_code, header.error_message)
        return header.producer_id, header.producer_epoch

    # -- consumer groups (SPEC §11) ---------------------------------------------

    async def commit_offsets(
        self,
        group: str,
        offsets: Sequence[messages.GroupOffset],
        *,
        member_id: str = "",
        member_epoch: int = -1,
        timeout: float | None = None,
    ) -> tuple[messages.GroupOffsetResult, ...]:
        """COMMIT_OFFSETS: store the group's next offsets, all at once; one
        result per item (its own error code when it was refused). A group
        member gives its id and epoch (SPEC §15)."""
        request = messages.CommitOffsetsRequest(
            timeout_ms=self.timeout_ms(timeout),
            group=group,
            offsets=tuple(offsets),
            member_id=member_id,
            member_epoch=member_epoch,
        )
        header = await self.call_for(
            messages.CommitOffsetsResponse, Opcode.COMMIT_OFFSETS, request, timeout=timeout
        )
        return header.commit_responses

    async def commit_offset(
        self,
        group: str,
        stream_id: int,
        offset: int,
        metadata: str = "",
        *,
        timeout: float | None = None,
    ) -> messages.GroupOffsetResult:
        """Commit one position; raises its error."""
        item = messages.GroupOffset(stream_id=stream_id, offset=offset, metadata=metadata)
        result = single(await self.commit_offsets(group, [item], timeout=timeout), "COMMIT_OFFSETS")
        raise_for_code(result.error_code, result.error_message)
        return result

    async def fetch_offsets(
        self, group: str, stream_ids: Sequence[int] = (), *, timeout: float | None = None
    ) -> tuple[messages.GroupOffsetResult, ...]:
        """FETCH_OFFSETS: the group's positions (all of them when no stream
        is named; offset -1 where it has none), with each stream's end and
        the lag. ``GroupNotFoundError`` for an unknown group."""
        request = messages.FetchOffsetsRequest(
            timeout_ms=self.timeout_ms(timeout), group=group, stream_ids=tuple(stream_ids)
        )
        header = join_fetch_offsets(
            await self.call_for_frames(
                messages.FetchOffsetsResponse, Opcode.FETCH_OFFSETS, request, timeout=timeout
            )
        )
        raise_for_code(header.error_code, header.error_message)
        return header.fetch_responses

    async def list_groups(
        self, *, timeout: float | None = None
    ) -> tuple[messages.GroupListing, ...]:
        """LIST_GROUPS: every group, with the streams it has positions on."""
        request = messages.ListGroupsRequest(timeout_ms=self.timeout_ms(timeout))
        header = join_list_groups(
            await self.call_for_frames(
                messages.ListGroupsResponse, Opcode.LIST_GROUPS, request, timeout=timeout
            )
        )
        raise_for_code(header.error_code, header.error_message)
        return header.groups

    async def group_heartbeat(
        self,
        group: str,
        member_id: str,
        member_epoch: int,
        *,
        streams: Sequence[int] = (),
        owned: Sequence[int] = (),
        session_timeout_ms: int = 0,
        timeout: float | None = None,
    ) -> messages.GroupHeartbeatResponse:
        """GROUP_HEARTBEAT (SPEC §15): join (epoch 0), stay, or leave (-1);
        the answer's ``assigned`` are the streams the member may read.
        Raises ``FencedMemberEpochError``, ``UnknownMemberIdError`` …"""
        request = messages.GroupHeartbeatRequest(
            timeout_ms=self.timeout_ms(timeout),
            group=group,
            member_id=member_id,
            member_epoch=member_epoch,
            streams=tuple(streams),
            owned=tuple(owned),
            session_timeout_ms=session_timeout_ms,
        )
        header = await self.call_for(
            messages.GroupHeartbeatResponse, Opcode.GROUP_HEARTBEAT, request, timeout=timeout
        )
        raise_for_code(header.error_code, header.error_message)
        return header

    async def describe_members(
        self, group: str, *, timeout: float | None = None
    ) -> tuple[messages.MemberDescription, ...]:
        """DESCRIBE_MEMBERS (implementation-private): a group's members."""
        request = messages.DescribeMembersRequest(timeout_ms=self.timeout_ms(timeout), group=group)
        header = await self.call_for(
            messages.DescribeMembersResponse, Opcode.DESCRIBE_MEMBERS, request, timeout=timeout
        )
        raise_for_code(header.error_code, header.error_message)
        return header.members

    async def delete_groups(
        self, groups: Sequence[str], *, timeout: float | None = None
    ) -> tuple[messages.DeleteGroupResult, ...]:
        """DELETE_GROUPS: forget whole groups; one result per group."""
        request = messages.DeleteGroupsRequest(
            timeout_ms=self.timeout_ms(timeout), groups=tuple(groups)
        )
        header = await self.call_for(
            messages.DeleteGroupsResponse, Opcode.DELETE_GROUPS, request, timeout=timeout
        )
        return header.delete_responses


class _StreamListing:
    """Pages through GET_STREAMS with empty ``stream_ids`` (SPEC §3): each
    page starts after the last id of the one before; a short page is the last."""

    __slots__ = ("_client", "_done", "_last_id", "_page", "_page_size", "_timeout")

    def __init__(self, client: PMClient, page_size: int, timeout: float | None) -> None:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        self._client = client
        self._page_size = page_size
        self._timeout = timeout
        self._page: list[messages.Stream] = []
        self._last_id = 0
        self._done = False

    def __aiter__(self) -> _StreamListing:
        return self

    async def __anext__(self) -> messages.Stream:
        if not self._page and not self._done:
            page = await self._client.get_streams_page(
                start_after=self._last_id, limit=self._page_size, timeout=self._timeout
            )
            self._done = len(page) < self._page_size
            if page:
                self._last_id = page[-1].stream_id
            self._page = list(reversed(page))
        if not self._page:
            raise StopAsyncIteration
        return self._page.pop()


def _present(stream: messages.Stream | None, stream_id: int) -> messages.Stream:
    if stream is None:
        raise StreamNotFoundError(f"stream {stream_id}: the PM sent no stream")
    return stream
