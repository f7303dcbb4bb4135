"""A group member against a scripted PM, on trio's autojump clock: what its
heartbeats list as owned while a stream is being started, and how old an
answer that arrives late is taken to be. The PM gives a stream away as
soon as a heartbeat leaves it out, and counts a member's session from its
own clock: the member must never read a stream after either."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio

from client.group_member import GroupConsumer, _Reading
from client.pm_client import PMClient
from sbp import messages

from ..eventually import eventually


class ScriptedPM(PMClient):
    """Answers heartbeats with ``assigned``; FETCH_OFFSETS waits for
    ``offsets_gate``; the next heartbeat's answer can be delayed."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:1")
        self.assigned: tuple[int, ...] = (1,)
        self.owned_per_beat: list[tuple[int, ...]] = []
        self.offsets_gate = trio.Event()
        self.offsets_asked = trio.Event()
        self.next_delay = 0.0
        self.next_interval_ms = 100
        self.epoch = 0

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
        self.owned_per_beat.append(tuple(owned))
        assigned, interval = self.assigned, self.next_interval_ms
        delay, self.next_delay = self.next_delay, 0.0
        await trio.sleep(delay)
        self.epoch += 1
        return messages.GroupHeartbeatResponse(
            member_epoch=self.epoch, heartbeat_interval_ms=interval, assigned=assigned
        )

    async def fetch_offsets(
        self, group: str, stream_ids: Sequence[int] = (), *, timeout: float | None = None
    ) -> tuple[messages.GroupOffsetResult, ...]:
        self.offsets_asked.set()
        await self.offsets_gate.wait()
        return ()

    async def commit_offsets(
        self, group: str, offsets: Sequence[messages.GroupOffset], **_: object
    ) -> tuple[messages.GroupOffsetResult, ...]:
        return ()


class QuietMember(GroupConsumer):
    """Reads nothing: a stream's reading is a task that waits."""

    async def _read(self, stream_id: int, start: int | None, reading: _Reading) -> None:
        with reading.scope:
            await trio.sleep_forever()
        reading.done.set()


async def test_a_stream_being_started_stays_owned_until_the_member_lets_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pm = ScriptedPM()
    given: list[list[int]] = []
    async with (
        QuietMember(
            pm, "g", [1, 2], session_timeout=10, auto_commit_interval=None, on_assigned=given.append
        ) as member,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(member.next_batch)
        await pm.offsets_asked.wait()  # stream 1 is being started
        pm.assigned = (2,)  # ... and the PM moves it away meanwhile
        beats_before = len(pm.owned_per_beat)
        await trio.sleep(0.5)
        during = pm.owned_per_beat[beats_before:]
        assert len(during) >= 3
        assert all(1 in owned for owned in during), during
        pm.offsets_gate.set()
        await eventually(lambda: member.assignment == {2})
        assert given == [[2]]  # stream 1 was never read
        await trio.sleep(0.5)
        assert all(1 not in owned for owned in pm.owned_per_beat[-3:]), pm.owned_per_beat
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("late_by", [1.5, 3.0])
async def test_an_answer_read_late_counts_from_when_its_heartbeat_left(
    autojump_clock: trio.testing.MockClock, late_by: float
) -> None:
    pm = ScriptedPM()
    pm.offsets_gate.set()
    async with (
        QuietMember(pm, "g", [1], session_timeout=1, auto_commit_interval=None) as member,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(member.next_batch)
        await eventually(lambda: member.holds(1))
        # the next heartbeat's answer arrives late (a pause, a slow link);
        # the one after it is far away
        pm.next_delay, pm.next_interval_ms = late_by, 60_000
        beats = len(pm.owned_per_beat)
        await eventually(lambda: len(pm.owned_per_beat) > beats)
        sent_at = trio.current_time()
        await trio.sleep(late_by + 0.1)  # the answer is in
        assert trio.current_time() - sent_at > member.session_timeout
        assert not member.holds(1)
        nursery.cancel_scope.cancel()
