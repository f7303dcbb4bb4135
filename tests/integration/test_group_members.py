"""Consumer group members (SPEC §15) against a real PM and data nodes:
members share a group's streams, balanced, each stream read by one member
at a time; a member that leaves or dies gives its streams away; a commit
from outside the members, or from a member that does not hold the stream,
is fenced; bad input changes nothing."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from client import GroupConsumer, Producer, SyncClient
from sbp import messages
from sbp.enums import ErrorCode
from sbp.errors import (
    FencedMemberEpochError,
    InvalidRequestError,
    StreamNotFoundError,
    UnknownMemberIdError,
)
from tests.eventually import eventually

from .pm_cluster import PMCluster, pm_cluster
from .procs import _child_env

pytestmark = [pytest.mark.integration, pytest.mark.deadline(120)]

SESSION = 3.0  # seconds: heartbeats every 0.3 s


async def make_streams(cluster: PMCluster, count: int) -> list[int]:
    pm = cluster.pm_client()
    created = await pm.create_streams([messages.Stream(replica_nums=1)] * count)
    assert all(c.error_code == ErrorCode.NONE for c in created)
    return [c.stream.stream_id for c in created if c.stream is not None]


async def read_into(member: GroupConsumer, seen: list[tuple[str, int, int]]) -> None:
    async for batch in member:
        for offset in batch.records.offsets.tolist():
            seen.append((member.member_id, batch.stream_id, offset))


async def test_members_share_streams_and_pass_them_on(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1, 2)) as cluster:
        streams = await make_streams(cluster, 6)
        pm = cluster.pm_client()
        async with Producer(pm, streams[0], pool=cluster.pool) as producer:
            await producer.send_many([b"x"] * 10)
        seen: list[tuple[str, int, int]] = []

        def member(name: str) -> GroupConsumer:
            return GroupConsumer(
                pm, "etl", streams, member_id=name, session_timeout=SESSION, pool=cluster.pool
            )

        async with trio.open_nursery() as nursery:
            a, _ = await nursery_member(nursery, member("a"), seen)
            b, _ = await nursery_member(nursery, member("b"), seen)

            await eventually(
                lambda: len(a.assignment) == len(b.assignment) == 3, timeout=20, what="3 each"
            )
            assert not a.assignment & b.assignment
            # a third member takes two streams, one from each
            c, c_reading = await nursery_member(nursery, member("c"), seen)

            before = {s: m for m in (a, b) for s in m.assignment}
            await eventually(
                lambda: [len(m.assignment) for m in (a, b, c)] == [2, 2, 2],
                timeout=20,
                what="2 each",
            )
            moved = sum(before.get(s) is not m for m in (a, b, c) for s in m.assignment)
            assert moved == 2
            described = await pm.describe_members("etl")
            assert sorted(d.member_id for d in described) == ["a", "b", "c"]
            assert sorted(s for d in described for s in d.streams) == sorted(streams)

            # a commit from outside the members is fenced
            [outside] = await pm.commit_offsets(
                "etl", [messages.GroupOffset(stream_id=streams[0], offset=1)]
            )
            assert outside.error_code == ErrorCode.FENCED_MEMBER_EPOCH
            assert "live members" in outside.error_message
            # ... as is one of a stream the member does not hold
            foreign = next(iter(b.assignment))
            [not_held] = await pm.commit_offsets(
                "etl",
                [messages.GroupOffset(stream_id=foreign, offset=0)],
                member_id="a",
                member_epoch=a.epoch,
            )
            assert not_held.error_code == ErrorCode.FENCED_MEMBER_EPOCH

            # closing leaves at once: its streams move well within a session
            left = set(c.assignment)
            c_reading.cancel()
            started = trio.current_time()

            await eventually(lambda: left <= a.assignment | b.assignment, timeout=20)
            assert trio.current_time() - started < SESSION
            nursery.cancel_scope.cancel()
        # the 10 records of stream 0 were read, each once at a time by one member
        offsets = sorted(o for _, s, o in seen if s == streams[0])
        assert offsets[: len(set(offsets))] == sorted(set(offsets)) and set(offsets) == set(
            range(10)
        )


async def nursery_member(
    nursery: trio.Nursery, member: GroupConsumer, seen: list[tuple[str, int, int]]
) -> tuple[GroupConsumer, trio.CancelScope]:
    """The member joined and reading in a task of its own; cancelling the
    scope ends its reading, and it closes (commits and leaves)."""
    scope = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[None]) -> None:
        async with member:
            task_status.started()
            with scope:
                await read_into(member, seen)

    await nursery.start(run)
    return member, scope


async def test_bad_membership_input_is_refused(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:
        [stream] = await make_streams(cluster, 1)
        pm = cluster.pm_client()
        with pytest.raises(InvalidRequestError, match="1 to 64 bytes"):
            await pm.group_heartbeat("g", "m" * 65, 0, streams=[stream])
        with pytest.raises(InvalidRequestError, match="1 to 64 bytes"):
            await pm.group_heartbeat("g", "", 0, streams=[stream])
        for timeout_ms in (999, 30 * 60_000 + 1):
            with pytest.raises(InvalidRequestError, match="session_timeout_ms"):
                await pm.group_heartbeat(
                    "g", "m", 0, streams=[stream], session_timeout_ms=timeout_ms
                )
        with pytest.raises(StreamNotFoundError, match="no stream 999"):
            await pm.group_heartbeat("g", "m", 0, streams=[stream, 999])
        assert await pm.describe_members("g") == ()
        with pytest.raises(UnknownMemberIdError):
            await pm.group_heartbeat("g", "m", 3, streams=[stream])
        joined = await pm.group_heartbeat("g", "m", 0, streams=[stream])
        assert joined.member_epoch == 1 and list(joined.assigned) == [stream]
        with pytest.raises(FencedMemberEpochError):
            await pm.group_heartbeat("g", "m", 7, owned=[stream])
        # a group with members is not deleted
        [deleted] = await pm.delete_groups(["g"])
        assert deleted.error_code == ErrorCode.INVALID_REQUEST
        left = await pm.group_heartbeat("g", "m", -1)
        assert left.member_epoch == -1 and await pm.describe_members("g") == ()


# A member in a process of its own: it prints, as JSON lines with the
# machine's monotonic clock, when streams are given and taken away and
# every batch of records it hands out (what its caller processes).
MEMBER_PROGRAM = r"""
import json, sys, time, trio
from client import GroupConsumer
pm, group, name, streams = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]

def emit(**fields):
    print(json.dumps({"t": time.monotonic(), "m": name, **fields}), flush=True)

async def main():
    async with GroupConsumer(
        pm, group, [int(s) for s in streams.split(",")], member_id=name,
        session_timeout=float(sys.argv[5]), auto_commit_interval=0.2,
        on_assigned=lambda s: emit(ev="assigned", streams=s),
        on_revoked=lambda s: emit(ev="revoked", streams=s),
    ) as member:
        emit(ev="joined")
        async for batch in member:
            emit(ev="records", s=batch.stream_id, o=batch.records.offsets.tolist())

trio.run(main)
"""

PROCESS_SESSION = 2.0


class MemberProcess:
    """A ``MEMBER_PROGRAM`` child and what it printed."""

    def __init__(self, process: trio.Process, name: str) -> None:
        self.process = process
        self.name = name
        self.events: list[dict[str, object]] = []

    async def collect(self) -> None:
        assert self.process.stdout is not None
        buffered = b""
        async for chunk in self.process.stdout:
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            self.events += [json.loads(line) for line in lines if line.strip()]

    def last_time(self) -> float:
        return max((float(e["t"]) for e in self.events), default=0.0)  # type: ignore[arg-type]


async def start_member(
    nursery: trio.Nursery, pm: str, name: str, streams: list[int]
) -> MemberProcess:
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-c",
            MEMBER_PROGRAM,
            pm,
            "shared",
            name,
            ",".join(map(str, streams)),
            str(PROCESS_SESSION),
        ],
        stdout=subprocess.PIPE,
        env=_child_env(),
    )
    member = MemberProcess(process, name)
    nursery.start_soon(member.collect)
    return member


def reading_periods(members: list[MemberProcess]) -> dict[int, list[tuple[float, float, str]]]:
    """Per stream, each member's period of reading it: from its first record
    after being given the stream to its last before it was taken away (or
    it died). A period that spans a pause (SIGSTOP) ends at its last record
    before the pause: a paused member reads nothing."""
    periods: dict[int, list[tuple[float, float, str]]] = {}
    for member in members:
        open_at: dict[int, list[float]] = {}
        for event in member.events:
            t = float(event["t"])  # type: ignore[arg-type]
            if event["ev"] == "records":
                stream = int(event["s"])  # type: ignore[call-overload]
                open_at.setdefault(stream, []).append(t)
            elif event["ev"] == "revoked":
                for stream in event["streams"]:  # type: ignore[attr-defined]
                    times = open_at.pop(stream, [])
                    if times:
                        periods.setdefault(stream, []).append((times[0], times[-1], member.name))
        for stream, times in open_at.items():
            periods.setdefault(stream, []).append((times[0], times[-1], member.name))
    return periods


async def test_processes_share_streams_through_a_kill_a_pause_and_a_join(
    tmp_path: Path,
) -> None:
    """Three member processes read 12 streams while a producer appends; one
    is SIGKILLed (its streams move within a session and a heartbeat), one
    is SIGSTOPped past its session and resumed (it rejoins); with the
    killed one replaced, a fourth joins (3 streams move, one from each).
    Every record is handed out at least once, and no stream is read by two
    members at once."""
    async with pm_cluster(tmp_path, (1, 2)) as cluster:
        streams = await make_streams(cluster, 12)
        pm = cluster.pm_client()
        written: dict[int, int] = dict.fromkeys(streams, 0)
        stop_writing = trio.Event()

        async def produce() -> None:
            async with trio.open_nursery() as producers:
                for stream in streams:
                    producers.start_soon(produce_one, stream)

        async def produce_one(stream: int) -> None:
            async with Producer(pm, stream, pool=cluster.pool, linger=0.01) as producer:
                while not stop_writing.is_set():
                    await producer.send_many(
                        [b"v%d" % i for i in range(written[stream], written[stream] + 5)]
                    )
                    written[stream] += 5
                    await trio.sleep(0.05)

        async def holders() -> dict[int, str]:
            return {s: d.member_id for d in await pm.describe_members("shared") for s in d.streams}

        members: list[MemberProcess] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                members += [
                    await start_member(nursery, cluster.pm_address, f"p{i}", streams)
                    for i in range(3)
                ]
                await eventually(
                    lambda: len(members) and holders(),
                    until=lambda h: len(h) == 12,
                    timeout=30,
                    what="12 streams held",
                )

                # SIGKILL: its streams are read again within a session and a heartbeat
                victim = members[0]
                lost = {s for s, m in (await holders()).items() if m == victim.name}
                victim.process.send_signal(signal.SIGKILL)
                killed_at = trio.current_time()
                await eventually(
                    holders,
                    until=lambda h: lost <= h.keys() and victim.name not in h.values(),
                    timeout=30,
                    what="the killed member's streams taken over",
                )
                assert trio.current_time() - killed_at < PROCESS_SESSION + 1.0

                # SIGSTOP past the session, then SIGCONT: fenced, it drops its streams and rejoins
                paused = members[1]
                paused.process.send_signal(signal.SIGSTOP)
                await trio.sleep(PROCESS_SESSION + 1.0)
                assert paused.name not in (await holders()).values()
                paused.process.send_signal(signal.SIGCONT)
                resumed_at = time.monotonic()
                await eventually(
                    lambda: [
                        e
                        for e in paused.events
                        if e["ev"] == "assigned" and float(e["t"]) > resumed_at
                    ],
                    timeout=30,
                    what="the paused member rejoins",
                )  # type: ignore[arg-type]

                # the killed member's place taken again, then a fourth joins: at most 3 streams move
                members.append(await start_member(nursery, cluster.pm_address, "p3", streams))

                def balanced(held: dict[int, str], each: int) -> bool:
                    counts = [list(held.values()).count(m) for m in set(held.values())]
                    return len(held) == 12 and counts == [each] * (12 // each)

                before = await eventually(holders, until=lambda h: balanced(h, 4), timeout=30)
                members.append(await start_member(nursery, cluster.pm_address, "p4", streams))
                after = await eventually(holders, until=lambda h: balanced(h, 3), timeout=30)
                assert sum(before[s] != after[s] for s in streams) == 3

                stop_writing.set()

                def all_read() -> bool:
                    seen = {
                        (int(e["s"]), o)
                        for m in members
                        for e in m.events
                        if e["ev"] == "records"
                        for o in e["o"]
                    }  # type: ignore[call-overload, union-attr]
                    return all((s, o) in seen for s in streams for o in range(written[s]))

                await eventually(all_read, timeout=60, what="every record handed out")
                nursery.cancel_scope.cancel()
        finally:
            for member in members:
                with trio.CancelScope(shield=True):
                    if member.process.returncode is None:
                        member.process.kill()
                    await member.process.wait()
                    if member.process.stdout is not None:
                        await member.process.stdout.aclose()

        for stream, spans in reading_periods(members).items():
            for (start, end, who), (other_start, other_end, other) in itertools.combinations(
                spans, 2
            ):
                assert who == other or end < other_start or other_end < start, (stream, spans)


async def test_the_sync_face_reads_as_a_member(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:
        streams = await make_streams(cluster, 2)
        for stream in streams:
            async with Producer(cluster.pm_client(), stream, pool=cluster.pool) as producer:
                await producer.send_many([b"%d-%d" % (stream, i) for i in range(3)])

        def read_six() -> list[tuple[int, int, bytes | None]]:
            with (
                SyncClient(cluster.pm_address) as client,
                client.group_consumer("sync", streams, session_timeout=SESSION) as member,
            ):
                records = []
                for record in member:
                    records.append((record.stream_id, record.offset, record.value))
                    if len(records) == 6:
                        break
                member.commit()
                assert member.assignment == frozenset(streams)
                return records

        records = await trio.to_thread.run_sync(read_six)
        assert sorted(records) == [(s, i, b"%d-%d" % (s, i)) for s in streams for i in range(3)]
        positions = await cluster.pm_client().fetch_offsets("sync")
        assert {p.stream_id: p.offset for p in positions} == dict.fromkeys(streams, 3)
        assert await cluster.pm_client().describe_members("sync") == ()  # it left on close


async def test_sbp_reads_as_a_member_and_describes_the_members(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:
        streams = await make_streams(cluster, 2)
        for stream in streams:
            async with Producer(cluster.pm_client(), stream, pool=cluster.pool) as producer:
                await producer.send_many([b"%d-%d" % (stream, i) for i in range(3)])
        subscribe = ",".join(map(str, streams))

        def sbp(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "client.cli", "--pm", cluster.pm_address, *args],
                capture_output=True,
                text=True,
                timeout=60,
                env=_child_env(),
                check=False,
            )

        read = await trio.to_thread.run_sync(
            lambda: sbp(
                "--json",
                "read",
                "--group",
                "cli",
                "--subscribe",
                subscribe,
                "--count",
                "6",
                "--commit",
            )
        )
        assert read.returncode == 0, read.stderr
        records = [json.loads(line) for line in read.stdout.splitlines()]
        assert sorted((r["stream_id"], r["offset"]) for r in records) == [
            (s, i) for s in streams for i in range(3)
        ]
        # a member holding the streams: reset and delete refuse it without --force
        joined = await cluster.pm_client().group_heartbeat("cli", "worker-1", 0, streams=streams)
        assert sorted(joined.assigned) == streams
        described = await trio.to_thread.run_sync(lambda: sbp("groups", "describe", "cli"))
        assert "worker-1" in described.stdout and described.returncode == 0
        refused = await trio.to_thread.run_sync(
            lambda: sbp("groups", "reset", "cli", "--to", "earliest")
        )
        assert (
            refused.returncode == 2 and "worker-1" in refused.stderr and "--force" in refused.stderr
        )
        forced = await trio.to_thread.run_sync(
            lambda: sbp("groups", "reset", "cli", "--to", "earliest", "--force")
        )
        assert forced.returncode == 0, forced.stderr
        assert await cluster.pm_client().describe_members("cli") == ()
        bad = await trio.to_thread.run_sync(lambda: sbp("read", "--subscribe", subscribe))
        assert bad.returncode == 2 and "--group" in bad.stderr
