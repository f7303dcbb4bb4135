"""Consumer group members (SPEC §15): joins, heartbeats, leaves and
expired sessions, which member reads which stream, and the fencing of
commits.

A member holds a stream from the heartbeat whose answer gave it the stream
until a heartbeat of its own no longer lists it in ``owned`` (or it leaves,
or its session expires). The assignment (``pm.assignor``) says who should
read each stream; a member's answer is its share less what another member
still holds, so no stream is ever held by two members. A member's epoch
rises whenever its answer changes; members, epochs, subscriptions and
holdings are in the metadata (LMDB or etcd), sessions in memory: a PM that
takes over starts every member's session clock again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final

import trio

from sbp.errors import (
    FencedMemberEpochError,
    InvalidRequestError,
    ProtocolError,
    StreamNotFoundError,
    UnknownMemberIdError,
)

from .assignor import answerable, target_assignment
from .changes import Change, DeleteMember, Metadata, PutMember
from .records import MemberRecord

log = logging.getLogger(__name__)

DEFAULT_SESSION_TIMEOUT_MS: Final = 45_000
MIN_SESSION_TIMEOUT_MS: Final = 1_000
MAX_SESSION_TIMEOUT_MS: Final = 30 * 60_000
MAX_MEMBER_ID_BYTES: Final = 64
#: members are asked to send a heartbeat this often: a tenth of the session,
#: within these bounds, so that a dead member's streams move soon after its
#: session ends
MIN_HEARTBEAT_INTERVAL_MS: Final = 100
MAX_HEARTBEAT_INTERVAL_MS: Final = 3_000
#: how often sessions are checked
EXPIRY_CHECK_S: Final = 0.1


def heartbeat_interval_ms(session_timeout_ms: int) -> int:
    return max(MIN_HEARTBEAT_INTERVAL_MS, min(MAX_HEARTBEAT_INTERVAL_MS, session_timeout_ms // 10))


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A GROUP_HEARTBEAT as the PM takes it."""

    group: str
    member_id: str
    epoch: int
    streams: tuple[int, ...] = ()
    owned: tuple[int, ...] = ()
    session_timeout_ms: int = 0


@dataclass(frozen=True, slots=True)
class HeartbeatAnswer:
    epoch: int
    interval_ms: int
    assigned: tuple[int, ...]


@dataclass(slots=True)
class Member:
    """A member as the leader keeps it: its record and when it was last
    heard from (``time.monotonic``: /metrics reads it from another thread)."""

    record: MemberRecord
    last_heard: float


class GroupMembers:
    """See the module docstring. ``commit`` is the manager's (HA's guard)."""

    def __init__(
        self,
        store: Metadata,
        commit: Callable[[Sequence[Change]], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._commit = commit
        self._clock = clock
        #: group -> member id -> member
        self._groups: dict[str, dict[str, Member]] = {}
        now = clock()
        for record in store.all_members():
            # a new leader starts every session's clock again (SPEC §15);
            # what a member held it holds until it says otherwise
            self._groups.setdefault(record.group, {})[record.member_id] = Member(record, now)
        self._locks: dict[str, trio.Lock] = {}
        #: answers that changed a member's streams, by group (metrics)
        self.rebalances: Counter[str] = Counter()
        #: (group, stream) -> when a member last held it (metrics)
        self._last_held: dict[tuple[str, int], float] = {}
        #: by group: the last assignment and what it was computed from
        self._assignments: dict[str, tuple[object, dict[str, set[int]]]] = {}
        #: deletions of streams seen: an assignment made before is stale
        self._streams_gone = 0

    # -- questions --------------------------------------------------------------

    def members(self, group: str) -> list[Member]:
        held = dict(self._groups.get(group, {}))  # a copy: /metrics reads from its thread
        return [held[m] for m in sorted(held)]

    def groups(self) -> list[str]:
        return sorted(list(self._groups))

    def has_members(self, group: str) -> bool:
        return bool(self._groups.get(group))

    def unowned(self) -> list[tuple[str, int, float]]:
        """(group, stream, seconds since a member last held it) for every
        stream a member subscribes to that none holds now."""
        now = self._clock()
        found = []
        for group, members in list(self._groups.items()):
            records = [m.record for m in list(members.values())]
            held = {s for r in records for s in r.held}
            subscribed = {s for r in records for s in r.subscribed}
            for stream in sorted(subscribed - held):
                if self._store.stream(stream) is None:
                    continue
                since = self._last_held.get((group, stream))
                found.append((group, stream, 0.0 if since is None else now - since))
        return found

    def check_commit(
        self, group: str, member_id: str, epoch: int, stream_ids: Sequence[int]
    ) -> list[ProtocolError | None]:
        """Per stream, why a COMMIT_OFFSETS may not store it (SPEC §15), or None."""
        members = self._groups.get(group, {})
        if not member_id:
            if not members:
                return [None] * len(stream_ids)
            error: ProtocolError = FencedMemberEpochError(
                f"group {group!r} has {len(members)} live members: only they commit to it "
                "(an operator removes them first: sbp groups reset --force)"
            )
            return [error] * len(stream_ids)
        member = members.get(member_id)
        if member is None:
            error = UnknownMemberIdError(f"group {group!r} has no member {member_id!r}")
            return [error] * len(stream_ids)
        current = member.record.epoch
        if epoch not in (current, current - 1):
            error = FencedMemberEpochError(
                f"member {member_id!r} of group {group!r} is at epoch {current}, not {epoch}"
            )
            return [error] * len(stream_ids)
        held = set(member.record.held)
        return [
            None
            if stream in held
            else FencedMemberEpochError(
                f"member {member_id!r} of group {group!r} does not hold stream {stream}"
            )
            for stream in stream_ids
        ]

    # -- heartbeats -------------------------------------------------------------

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatAnswer:
        """Join, stay or leave (SPEC §15); raises the ProtocolError to answer."""
        _check_member_id(beat.member_id)
        session = beat.session_timeout_ms or DEFAULT_SESSION_TIMEOUT_MS
        if not MIN_SESSION_TIMEOUT_MS <= session <= MAX_SESSION_TIMEOUT_MS:
            raise InvalidRequestError(
                f"session_timeout_ms {beat.session_timeout_ms} is outside "
                f"{MIN_SESSION_TIMEOUT_MS} to {MAX_SESSION_TIMEOUT_MS}"
            )
        async with self._lock(beat.group):
            if beat.epoch == -1:
                await self.remove(beat.group, [beat.member_id], locked=True)
                return HeartbeatAnswer(-1, heartbeat_interval_ms(session), ())
            members = self._groups.setdefault(beat.group, {})
            member = members.get(beat.member_id)
            if beat.epoch == 0:
                if not beat.streams:
                    raise InvalidRequestError("a member joins with the streams it subscribes to")
                self._check_streams(beat.streams)
                member = self._join(beat, member, session)
            else:
                member = self._known(beat, member)
                if beat.streams and tuple(sorted(set(beat.streams))) != member.record.subscribed:
                    self._check_streams(beat.streams)
                    member.record = replace(member.record, subscribed=_sorted(beat.streams))
            member.last_heard = self._clock()
            return await self._answer(beat, member, session)

    def _join(self, beat: Heartbeat, member: Member | None, session: int) -> Member:
        """A new member, or one that lost its state (epoch 0 again): it
        keeps what it still reads and its epochs go on from where they were,
        so that nothing it sent before counts."""
        old = None if member is None else member.record
        held = () if old is None else _sorted(set(old.held) & set(beat.owned))
        record = MemberRecord(
            beat.group,
            beat.member_id,
            0 if old is None else old.epoch,
            session,
            _sorted(beat.streams),
            held,
        )
        joined = Member(record, self._clock())
        self._groups[beat.group][beat.member_id] = joined
        if old is None:
            log.info("group %r: member %r joined", beat.group, beat.member_id)
        return joined

    def _known(self, beat: Heartbeat, member: Member | None) -> Member:
        if member is None:
            raise UnknownMemberIdError(
                f"group {beat.group!r} has no member {beat.member_id!r} (it left, or its "
                "session expired): join again with epoch 0"
            )
        current = member.record.epoch
        if beat.epoch not in (current, current - 1):
            raise FencedMemberEpochError(
                f"member {beat.member_id!r} of group {beat.group!r} is at epoch {current}, "
                f"not {beat.epoch}: drop its streams and join again"
            )
        return member

    async def _answer(self, beat: Heartbeat, member: Member, session: int) -> HeartbeatAnswer:
        group = beat.group
        members = self._groups[group]
        record = member.record
        # what it still reads of what it held; the rest it has let go of
        still = set(record.held) & set(beat.owned)
        holders = {
            stream: other_id
            for other_id, other in members.items()
            if other_id != beat.member_id
            for stream in other.record.held
        }
        targets = self._targets(group, members)
        assigned = answerable(beat.member_id, targets.get(beat.member_id, set()), holders)
        held = _sorted(still | assigned)
        epoch = record.epoch
        if _sorted(assigned) != record.assigned or beat.epoch == 0:
            epoch += 1
            self.rebalances[group] += 1
        changed = replace(
            record, epoch=epoch, held=held, assigned=_sorted(assigned), session_timeout_ms=session
        )
        if changed != record or beat.epoch == 0:
            await self._commit([PutMember(changed)])
        member.record = changed
        now = self._clock()
        for stream in held:
            self._last_held[group, stream] = now
        return HeartbeatAnswer(epoch, heartbeat_interval_ms(session), _sorted(assigned))

    def _targets(self, group: str, members: dict[str, Member]) -> dict[str, set[int]]:
        """The group's assignment (``pm.assignor``), computed again only when
        a member, a subscription or a holding changed, or a stream went."""
        key = (
            self._streams_gone,
            tuple(
                (m, member.record.subscribed, member.record.held) for m, member in members.items()
            ),
        )
        cached = self._assignments.get(group)
        if cached is not None and cached[0] == key:
            return cached[1]
        subscribed = {s for member in members.values() for s in member.record.subscribed}
        targets = target_assignment(
            {m: set(member.record.subscribed) for m, member in members.items()},
            {m: set(member.record.held) for m, member in members.items()},
            {s for s in subscribed if self._exists(s)},
        )
        self._assignments[group] = (key, targets)
        return targets

    # -- leaving ----------------------------------------------------------------

    async def remove(self, group: str, member_ids: Iterable[str], *, locked: bool = False) -> int:
        """Forget these members (a leave, an expired session, an operator's
        reset); their streams are free at once. How many there were."""
        if not locked:
            async with self._lock(group):
                return await self.remove(group, member_ids, locked=True)
        members = self._groups.get(group, {})
        gone = [m for m in member_ids if m in members]
        if not gone:
            return 0
        await self._commit([DeleteMember(group, m) for m in gone])
        now = self._clock()
        for member_id in gone:
            for stream in members.pop(member_id).record.held:
                self._last_held[group, stream] = now
        if not members:
            del self._groups[group]
        return len(gone)

    async def expire(self) -> None:
        """Every ``EXPIRY_CHECK_S``, forget the members whose session ended."""
        while True:
            await trio.sleep(EXPIRY_CHECK_S)
            now = self._clock()
            for group, members in list(self._groups.items()):
                late = [
                    member_id
                    for member_id, member in members.items()
                    if now - member.last_heard > member.record.session_timeout_ms / 1000
                ]
                if late:
                    log.info(
                        "group %r: %s left, no heartbeat within the session",
                        group,
                        ", ".join(repr(m) for m in late),
                    )
                    await self.remove(group, late)

    async def forget_streams(self, stream_ids: Iterable[int]) -> None:
        """Deleted streams: no member holds or subscribes to them any more."""
        gone = set(stream_ids)
        self._streams_gone += 1
        changes: list[Change] = []
        for members in self._groups.values():
            for member in members.values():
                record = member.record
                if gone & (set(record.held) | set(record.subscribed)):
                    member.record = replace(
                        record,
                        held=_sorted(set(record.held) - gone),
                        subscribed=_sorted(set(record.subscribed) - gone),
                    )
                    changes.append(PutMember(member.record))
        if changes:
            await self._commit(changes)

    # -- helpers ----------------------------------------------------------------

    def _lock(self, group: str) -> trio.Lock:
        return self._locks.setdefault(group, trio.Lock())

    def _exists(self, stream_id: int) -> bool:
        return self._store.stream(stream_id) is not None

    def _check_streams(self, stream_ids: Sequence[int]) -> None:
        missing = sorted(s for s in set(stream_ids) if not self._exists(s))
        if missing:
            raise StreamNotFoundError(
                f"no stream {', '.join(str(s) for s in missing)}: a member subscribes to "
                "streams that exist"
            )


def _check_member_id(member_id: str) -> None:
    size = len(member_id.encode())
    if not 1 <= size <= MAX_MEMBER_ID_BYTES:
        raise InvalidRequestError(f"a member id is 1 to {MAX_MEMBER_ID_BYTES} bytes; {size} given")


def _sorted(streams: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(streams)))
