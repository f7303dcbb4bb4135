"""The PM's consumer group handlers (SPEC §11, §15): positions committed,
fetched, listed and deleted, and members' heartbeats and descriptions.

A position on a stream needs FETCH of it, and so does a member's
subscription; LIST_GROUPS shows the streams the principal may describe;
DELETE_GROUPS needs DELETE on ``cluster``.
"""

from __future__ import annotations

import time

from net.authz import AccessControl, require
from net.request import Request, Responder
from sbp import messages
from sbp.answer_frames import fetch_offsets_frames, list_groups_frames
from sbp.errors import GroupNotFoundError, InvalidRequestError, ProtocolError

from .answers import allowed_only, error_code, error_message
from .groups import OffsetItem, check_group_name, wall_clock_ms
from .manager import PlacementManager
from .members import Heartbeat


class GroupHandlers:
    def __init__(self, manager: PlacementManager, access: AccessControl) -> None:
        self._manager = manager
        self._access = access

    async def commit_offsets(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.CommitOffsetsRequest)
        items = header.offsets
        outcomes = await allowed_only(
            self._access.check_each(request.principal, "FETCH", [i.stream_id for i in items]),
            [OffsetItem(i.stream_id, i.offset, i.metadata) for i in items],
            lambda allowed: self._manager.groups.commit(
                header.group, allowed, header.member_id, header.member_epoch
            ),
        )
        results = tuple(
            messages.GroupOffsetResult(
                stream_id=item.stream_id,
                error_code=error_code(outcome.error),
                error_message=error_message(outcome.error),
            )
            if outcome.value is None
            else messages.GroupOffsetResult(
                stream_id=item.stream_id,
                offset=outcome.value.offset,
                metadata=outcome.value.metadata,
                commit_time_ms=outcome.value.commit_time_ms,
            )
            for item, outcome in zip(items, outcomes, strict=True)
        )
        await responder.send(messages.CommitOffsetsResponse(commit_responses=results))

    async def fetch_offsets(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.FetchOffsetsRequest)
        try:
            positions = self._manager.groups.fetch(header.group, header.stream_ids)
        except (GroupNotFoundError, InvalidRequestError) as error:
            await responder.send(
                messages.FetchOffsetsResponse(error_code=error.code, error_message=error.message)
            )
            return
        results = []
        for position in positions:
            record = position.record
            denied = self._access.check(request.principal, "FETCH", record.stream_id)
            if denied is not None:
                if header.stream_ids:  # asked by name: say why not
                    results.append(
                        messages.GroupOffsetResult(
                            stream_id=record.stream_id,
                            error_code=denied.code,
                            error_message=denied.message,
                        )
                    )
                continue  # a listing shows what the principal may read
            results.append(
                messages.GroupOffsetResult(
                    stream_id=record.stream_id,
                    offset=record.offset,
                    metadata=record.metadata,
                    commit_time_ms=record.commit_time_ms,
                    end_offset=position.end_offset,
                    lag_records=position.lag_records,
                )
            )
        await responder.send_sequence(list(fetch_offsets_frames(results)))

    async def list_groups(self, request: Request, responder: Responder) -> None:
        request.header_as(messages.ListGroupsRequest)
        streams: dict[str, list[int]] = {}
        last_commit: dict[str, int] = {}
        for record in self._manager.groups.records():
            if not self._access.allows(request.principal, "DESCRIBE", record.stream_id):
                continue
            streams.setdefault(record.group, []).append(record.stream_id)
            last_commit[record.group] = max(last_commit.get(record.group, 0), record.commit_time_ms)
        listings = tuple(
            messages.GroupListing(
                group=group, stream_ids=tuple(ids), last_commit_ms=last_commit[group]
            )
            for group, ids in streams.items()
        )
        await responder.send_sequence(list(list_groups_frames(listings)))

    async def delete_groups(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DeleteGroupsRequest)
        denied = self._access.check_on_cluster(request.principal, "DELETE")
        if denied is not None:
            outcomes: list[ProtocolError | None] = [denied for _ in header.groups]
        else:
            outcomes = await self._manager.groups.delete(header.groups)
        results = tuple(
            messages.DeleteGroupResult(
                group=group, error_code=error_code(outcome), error_message=error_message(outcome)
            )
            for group, outcome in zip(header.groups, outcomes, strict=True)
        )
        await responder.send(messages.DeleteGroupsResponse(delete_responses=results))

    async def group_heartbeat(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.GroupHeartbeatRequest)
        beat = Heartbeat(
            header.group,
            header.member_id,
            header.member_epoch,
            tuple(header.streams),
            tuple(header.owned),
            header.session_timeout_ms,
        )
        try:
            for stream_id in beat.streams:  # a member reads what it subscribes to
                require(self._access.check(request.principal, "FETCH", stream_id))
            check_group_name(beat.group)
            answer = await self._manager.members.heartbeat(beat)
        except ProtocolError as error:
            await responder.send(
                messages.GroupHeartbeatResponse(error_code=error.code, error_message=error.message)
            )
            return
        await responder.send(
            messages.GroupHeartbeatResponse(
                member_epoch=answer.epoch,
                heartbeat_interval_ms=answer.interval_ms,
                assigned=answer.assigned,
            )
        )

    async def describe_members(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.DescribeMembersRequest)
        try:
            check_group_name(header.group)
        except ProtocolError as error:
            await responder.send(
                messages.DescribeMembersResponse(error_code=error.code, error_message=error.message)
            )
            return
        now, wall = time.monotonic(), wall_clock_ms()
        members = tuple(
            messages.MemberDescription(
                member_id=member.record.member_id,
                member_epoch=member.record.epoch,
                streams=member.record.held,
                subscribed=member.record.subscribed,
                last_heartbeat_ms=wall - int((now - member.last_heard) * 1000),
                session_timeout_ms=member.record.session_timeout_ms,
            )
            for member in self._manager.members.members(header.group)
        )
        await responder.send(messages.DescribeMembersResponse(members=members))
