"""The PM's request handlers: wire messages in, ``PlacementManager`` calls,
wire messages out. One handler per opcode; nothing here decides anything
but who may ask (both servers authorize in their handlers, docs/architecture.md).

APPEND and FETCH are not registered: the dispatcher answers them (and any
other opcode the PM does not serve) with UNSUPPORTED_OPERATION.

With an ACL file (SPEC §9) each item is authorized before the manager sees
it: a denied item is answered AUTHORIZATION_FAILED and the others go on. A
data node's HEARTBEAT and REPORT_METRICS are taken only from the cluster's
own principals, DESCRIBE_CLUSTER needs CLUSTER, and DRAIN_DATA_NODES
CLUSTER on ``cluster``, as do REMOVE_DATA_NODES and REBALANCE
(implementation-private). Consumer groups' opcodes are served by
``pm.group_handlers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from net.authz import AccessControl, require
from net.request import Request, Responder, request_timeout
from net.server import Dispatcher
from sbp import messages
from sbp.answer_frames import list_ranges_frames
from sbp.enums import ClientRole, DataNodeState, ObjectState, Opcode
from sbp.errors import (
    AuthorizationFailedError,
    InvalidRequestError,
    ProducerFencedError,
    ProtocolError,
)

from .answers import allowed_only, error_code, error_message, ready
from .group_handlers import GroupHandlers
from .liveness import NodeState
from .manager import PlacementManager
from .records import Outcome, RangeRecord
from .tiering import serving_nodes
from .wire import (
    DataNodeCache,
    node_record,
    range_message,
    report_fields,
    report_message,
    stream_message,
    stream_record,
)

PM_CLIENT_ID: Final = "pm"


class PMHandlers:
    """Serves the PM's opcodes from one ``PlacementManager``."""

    def __init__(self, manager: PlacementManager, access: AccessControl | None = None) -> None:
        self._manager = manager
        self._data_node = DataNodeCache(manager.registry.address)
        self._access = access if access is not None else AccessControl()
        self._groups = GroupHandlers(manager, self._access)

    def dispatcher(self) -> Dispatcher:
        dispatcher = Dispatcher("placement manager")
        for opcode, handler in (
            (Opcode.HEARTBEAT, self.heartbeat),
            (Opcode.REPORT_METRICS, self.report_metrics),
            (Opcode.DESCRIBE_CLUSTER, self.describe_cluster),
            (Opcode.CREATE_STREAMS, self.create_streams),
            (Opcode.DELETE_STREAMS, self.delete_streams),
            (Opcode.UPDATE_STREAMS, self.update_streams),
            (Opcode.GET_STREAMS, self.get_streams),
            (Opcode.TRIM_STREAMS, self.trim_streams),
            (Opcode.LIST_RANGES, self.list_ranges),
            (Opcode.SEAL_RANGES, self.seal_ranges),
            (Opcode.DESCRIBE_RANGES, self.describe_ranges),
            (Opcode.INIT_PRODUCER, self.init_producer),
            (Opcode.COMMIT_OFFSETS, self._groups.commit_offsets),
            (Opcode.FETCH_OFFSETS, self._groups.fetch_offsets),
            (Opcode.LIST_GROUPS, self._groups.list_groups),
            (Opcode.DELETE_GROUPS, self._groups.delete_groups),
            (Opcode.DRAIN_DATA_NODES, self.drain_data_nodes),
            (Opcode.REMOVE_DATA_NODES, self.remove_data_nodes),
            (Opcode.REBALANCE, self.rebalance),
            (Opcode.GROUP_HEARTBEAT, self._groups.group_heartbeat),
            (Opcode.DESCRIBE_MEMBERS, self._groups.describe_members),
        ):
            dispatcher.register(opcode, handler)
        return dispatcher

    def _range(self, rng: RangeRecord) -> messages.Range:
        return self._ranges([rng])[0]

    def _ranges(self, ranges: Sequence[RangeRecord]) -> tuple[messages.Range, ...]:
        """The ranges for a reader: one in the object store only lists the
        live nodes that serve it from there (SPEC §14)."""
        if not any(rng.object_state == ObjectState.IN_STORE_ONLY for rng in ranges):
            return tuple(range_message(rng, self._data_node) for rng in ranges)
        live = self._manager.registry.live_ids()
        return tuple(
            range_message(
                rng,
                self._data_node,
                serving_nodes(rng, live) if rng.object_state == ObjectState.IN_STORE_ONLY else (),
            )
            for rng in ranges
        )

    # -- data nodes -----------------------------------------------------------

    async def heartbeat(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.HeartbeatRequest)
        if header.client_role == ClientRole.DATA_NODE:
            self._require_cluster(request, "HEARTBEAT as a data node")
            await self._manager.heartbeat(node_record(header.data_node))
        await responder.send(
            messages.HeartbeatResponse(client_id=header.client_id, client_role=ClientRole.PM)
        )

    async def report_metrics(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.ReportMetricsRequest)
        self._require_cluster(request, "REPORT_METRICS")
        await self._manager.report_metrics(node_record(header.data_node), report_fields(header))
        await responder.send(messages.ReportMetricsResponse(data_node=header.data_node))

    async def describe_cluster(self, request: Request, responder: Responder) -> None:
        request.header_as(messages.DescribeClusterRequest)
        require(self._access.check(request.principal, "CLUSTER"))
        statuses = tuple(self._status(state) for state in self._manager.cluster())
        await responder.send(messages.DescribeClusterResponse(data_nodes=statuses))

    async def drain_data_nodes(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DrainDataNodesRequest)
        denied = self._access.check_on_cluster(request.principal, "CLUSTER")
        if denied is not None:
            outcomes: list[Outcome[DataNodeState]] = [
                Outcome(error=denied) for _ in header.node_ids
            ]
        else:
            outcomes = await self._manager.drain_nodes(header.node_ids, cancel=header.cancel)
        results = tuple(
            messages.DrainResult(
                node_id=node_id,
                error_code=error_code(outcome.error),
                error_message=error_message(outcome.error),
                state=DataNodeState.ACTIVE if outcome.value is None else outcome.value,
            )
            for node_id, outcome in zip(header.node_ids, outcomes, strict=True)
        )
        await responder.send(messages.DrainDataNodesResponse(drain_responses=results))

    # -- producers ------------------------------------------------------------

    async def init_producer(self, request: Request, responder: Responder) -> None:
        """Refusals of this producer (a fenced epoch, a bad name, a principal
        that may append nowhere) are the response's error code; a deposed
        PM's NOT_LEADER and etcd's TIMEOUT stay SYSTEM_ERRORs, which the
        client follows and retries as for every other request."""
        header = request.header_as(messages.InitProducerRequest)
        try:
            require(self._access.check_some_stream(request.principal, "APPEND"))
            record = await self._manager.producers.init(header.producer_name, header.producer_epoch)
        except (AuthorizationFailedError, InvalidRequestError, ProducerFencedError) as error:
            await responder.send(
                messages.InitProducerResponse(error_code=error.code, error_message=error.message)
            )
            return
        await responder.send(
            messages.InitProducerResponse(
                producer_id=record.producer_id, producer_epoch=record.epoch
            )
        )

    async def remove_data_nodes(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.RemoveDataNodesRequest)
        denied = self._access.check_on_cluster(request.principal, "CLUSTER")
        if denied is not None:
            outcomes: list[ProtocolError | None] = [denied for _ in header.node_ids]
        else:
            outcomes = await self._manager.remove_nodes(header.node_ids)
        results = tuple(
            messages.RemoveResult(
                node_id=node_id,
                error_code=error_code(outcome),
                error_message=error_message(outcome),
            )
            for node_id, outcome in zip(header.node_ids, outcomes, strict=True)
        )
        await responder.send(messages.RemoveDataNodesResponse(remove_responses=results))

    async def rebalance(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.RebalanceRequest)
        denied = self._access.check_on_cluster(request.principal, "CLUSTER")
        if denied is not None:
            await responder.send(
                messages.RebalanceResponse(error_code=denied.code, error_message=denied.message)
            )
            return
        plan, pending = await self._manager.rebalance(dry_run=header.dry_run)
        moves = tuple(
            messages.RangeMove(
                stream_id=p.move.stream_id,
                range_index=p.move.range_index,
                from_node=p.move.from_node,
                to_node=p.move.to_node,
                bytes=p.size,
            )
            for p in plan
        )
        await responder.send(messages.RebalanceResponse(moves=moves, pending=pending))

    def _require_cluster(self, request: Request, what: str) -> None:
        """Requests without items: refused whole (a SYSTEM_ERROR)."""
        require(self._access.check_internal(request.principal, what))

    def _status(self, state: NodeState) -> messages.DataNodeStatus:
        node = messages.DataNode(node_id=state.node_id, advertise_addr=state.node.address)
        return messages.DataNodeStatus(
            data_node=node,
            alive=state.alive,
            last_heartbeat_ms=state.last_heartbeat_ms,
            metrics=report_message(node, state.metrics) if state.metrics else None,
            range_count=state.hosted_ranges,
            state=self._manager.drains.state(state.node_id),
            bytes_to_move=self._manager.drains.to_move(state.node_id),
        )

    # -- streams --------------------------------------------------------------

    async def create_streams(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.CreateStreamsRequest)
        timeout = request_timeout(header.timeout_ms)
        outcomes = await allowed_only(
            self._access.check_each(request.principal, "CREATE", [None] * len(header.streams)),
            [stream_record(s) for s in header.streams],
            lambda records: self._manager.create_streams(records, timeout),
        )
        results = []
        for asked, outcome in zip(header.streams, outcomes, strict=True):
            if outcome.value is None:
                results.append(
                    messages.CreateStreamResult(
                        stream=asked,
                        error_code=error_code(outcome.error),
                        error_message=error_message(outcome.error),
                    )
                )
                continue
            stream, first = outcome.value
            results.append(
                messages.CreateStreamResult(stream=stream_message(stream), range=self._range(first))
            )
        await responder.send(messages.CreateStreamsResponse(create_responses=tuple(results)))

    async def delete_streams(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DeleteStreamsRequest)
        timeout = request_timeout(header.timeout_ms)
        ids = [s.stream_id for s in header.streams]
        outcomes = await allowed_only(
            self._access.check_each(request.principal, "DELETE", ids),
            ids,
            lambda allowed: self._manager.delete_streams(allowed, timeout),
        )
        results = tuple(
            messages.DeleteStreamResult(
                deleted_stream=asked if outcome.value is None else stream_message(outcome.value),
                error_code=error_code(outcome.error),
                error_message=error_message(outcome.error),
            )
            for asked, outcome in zip(header.streams, outcomes, strict=True)
        )
        await responder.send(messages.DeleteStreamsResponse(delete_responses=results))

    async def update_streams(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.UpdateStreamsRequest)
        timeout = request_timeout(header.timeout_ms)
        outcomes = await allowed_only(
            self._access.check_each(
                request.principal, "ALTER", [s.stream_id for s in header.streams]
            ),
            [stream_record(s) for s in header.streams],
            lambda records: self._manager.update_streams(records, timeout),
        )
        results = tuple(
            messages.UpdateStreamResult(
                stream=asked if outcome.value is None else stream_message(outcome.value),
                error_code=error_code(outcome.error),
                error_message=error_message(outcome.error),
            )
            for asked, outcome in zip(header.streams, outcomes, strict=True)
        )
        await responder.send(messages.UpdateStreamsResponse(update_responses=results))

    async def get_streams(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.GetStreamsRequest)
        if header.stream_ids:
            outcomes = await allowed_only(
                self._access.check_each(request.principal, "DESCRIBE", header.stream_ids),
                header.stream_ids,
                lambda allowed: ready(self._manager.get_streams(allowed)),
            )
            results = tuple(
                messages.GetStreamResult(
                    stream=messages.Stream(stream_id=stream_id)
                    if outcome.value is None
                    else stream_message(outcome.value),
                    error_code=error_code(outcome.error),
                    error_message=error_message(outcome.error),
                )
                for stream_id, outcome in zip(header.stream_ids, outcomes, strict=True)
            )
        else:
            # A listing shows the streams the principal may describe.
            page = self._manager.list_streams(header.start_after, header.limit)
            results = tuple(
                messages.GetStreamResult(stream=stream_message(s))
                for s in page
                if self._access.allows(request.principal, "DESCRIBE", s.stream_id)
            )
        await responder.send(messages.GetStreamsResponse(get_responses=results))

    async def trim_streams(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.TrimStreamsRequest)
        timeout = request_timeout(header.timeout_ms)
        outcomes = await allowed_only(
            self._access.check_each(
                request.principal, "ALTER", [t.stream_id for t in header.trimmed_streams]
            ),
            [(t.stream_id, t.trim_offset) for t in header.trimmed_streams],
            lambda trims: self._manager.trim_streams(trims, timeout),
        )
        results = []
        for asked, outcome in zip(header.trimmed_streams, outcomes, strict=True):
            if outcome.value is None:
                results.append(
                    messages.TrimStreamResult(
                        trimmed_stream=messages.Stream(stream_id=asked.stream_id),
                        error_code=error_code(outcome.error),
                        error_message=error_message(outcome.error),
                    )
                )
                continue
            stream, first = outcome.value
            results.append(
                messages.TrimStreamResult(
                    trimmed_stream=stream_message(stream), range=self._range(first)
                )
            )
        await responder.send(messages.TrimStreamsResponse(trim_responses=tuple(results)))

    # -- ranges ---------------------------------------------------------------

    async def list_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.ListRangesRequest)
        results = tuple(
            self._list_one(owner, self._may_list(request.principal, owner))
            for owner in header.range_owners
        )
        await responder.send_sequence(list(list_ranges_frames(results)))

    def _may_list(self, principal: str, owner: messages.RangeOwner) -> ProtocolError | None:
        """A stream's ranges need DESCRIBE of it; a data node's, CLUSTER."""
        if owner.data_node is not None:
            return self._access.check(principal, "CLUSTER")
        return self._access.check(principal, "DESCRIBE", owner.stream_id)

    def _list_one(
        self, owner: messages.RangeOwner, denied: ProtocolError | None
    ) -> messages.ListRangesResult:
        try:
            if denied is not None:
                raise denied
            if owner.data_node is not None and owner.stream_id == 0:
                ranges = self._manager.node_ranges(owner.data_node.node_id)
            elif owner.data_node is None and owner.stream_id != 0:
                ranges = self._manager.stream_ranges(owner.stream_id)
            else:
                raise InvalidRequestError("a range owner sets exactly one of data_node, stream_id")
        except ProtocolError as exc:
            return messages.ListRangesResult(
                range_owner=owner, error_code=error_code(exc), error_message=error_message(exc)
            )
        return messages.ListRangesResult(range_owner=owner, ranges=self._ranges(ranges))

    async def seal_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.SealRangesRequest)
        timeout = request_timeout(header.timeout_ms)
        # A writer seals the range it cannot finish (SPEC §7): APPEND will do.
        outcomes = await allowed_only(
            [
                self._access.check_any(request.principal, ("ALTER", "APPEND"), r.stream_id)
                for r in header.ranges
            ],
            [(r.stream_id, r.range_index) for r in header.ranges],
            lambda keys: self._manager.seal_ranges(keys, timeout),
        )
        results = tuple(
            messages.SealRangesResult(
                stream_id=asked.stream_id,
                ranges=self._ranges(outcome.value or ()),
                error_code=error_code(outcome.error),
                error_message=error_message(outcome.error),
            )
            for asked, outcome in zip(header.ranges, outcomes, strict=True)
        )
        await responder.send(messages.SealRangesResponse(seal_responses=results))

    async def describe_ranges(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DescribeRangesRequest)
        outcomes: list[Outcome[RangeRecord]] = await allowed_only(
            self._access.check_each(
                request.principal, "DESCRIBE", [r.stream_id for r in header.ranges]
            ),
            [(r.stream_id, r.range_index) for r in header.ranges],
            lambda keys: ready(self._manager.describe_ranges(keys)),
        )
        results = tuple(
            messages.DescribeRangeResult(
                stream_id=asked.stream_id,
                range=None if outcome.value is None else self._range(outcome.value),
                error_code=error_code(outcome.error),
                error_message=error_message(outcome.error),
            )
            for asked, outcome in zip(header.ranges, outcomes, strict=True)
        )
        await responder.send(messages.DescribeRangesResponse(describe_responses=results))
