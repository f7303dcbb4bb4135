"""What consumer group members (SPEC §15) cost the PM, and how soon a dead
member's streams are read again.

    .venv/bin/python -m bench.members [--quick] [--members 1000] [--groups 100]

A PM and one data node run as real processes. ``--members`` members in
``--groups`` groups (each group subscribing to 10 streams) join and send a
heartbeat every 3 s (the default session of 45 s asks for that) from this
process, each listing what its last answer gave it; once every member has
its streams, the PM's CPU is measured over ``--seconds``.

Then a group of two members with a 3 s session: one a ``GroupConsumer``
reading, the other a member that holds half the streams and then stops
sending heartbeats (a dead process). Reported: the time from its last
heartbeat to the first batch the other member reads from one of its
streams, against the session timeout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import trio

from bench.output import emit
from client.group_member import GroupConsumer
from client.launcher import Plan, plan_children, running_plan
from client.pm_client import PMClient
from client.producer import Producer
from net.pool import ConnectionPool
from sbp import messages

STREAMS_PER_GROUP = 10
DEAD_SESSION_S = 3.0


async def _member(
    pm: PMClient, group: str, name: str, streams: list[int], joined: list[str]
) -> None:
    """Join, then a heartbeat every interval the PM asks for, owning what it was given."""
    answer = await pm.group_heartbeat(group, name, 0, streams=streams)
    joined.append(name)
    while True:
        await trio.sleep(answer.heartbeat_interval_ms / 1000)
        answer = await pm.group_heartbeat(group, name, answer.member_epoch, owned=answer.assigned)


async def _heartbeat_cost(pm: PMClient, pm_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    per_group = args.members // args.groups
    created = await pm.create_streams(
        [messages.Stream(replica_nums=1)] * (args.groups * STREAMS_PER_GROUP), timeout=60
    )
    ids = [c.stream.stream_id for c in created if c.stream is not None]
    joined: list[str] = []
    async with trio.open_nursery() as nursery:
        for g in range(args.groups):
            streams = ids[g * STREAMS_PER_GROUP : (g + 1) * STREAMS_PER_GROUP]
            for m in range(per_group):
                nursery.start_soon(_member, pm, f"g{g}", f"m{g}-{m}", streams, joined)
        while len(joined) < per_group * args.groups:
            await trio.sleep(0.1)
        # streams move a heartbeat after their old member let go of them
        with trio.move_on_after(120):
            while (held := await _held(pm, args.groups)) < len(ids):
                await trio.sleep(1)
        process = psutil.Process(pm_pid)
        before = process.cpu_times()
        started = time.perf_counter()
        await trio.sleep(args.seconds)
        after = process.cpu_times()
        wall = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    cpu = (after.user + after.system - before.user - before.system) / wall
    return {
        "members": per_group * args.groups,
        "groups": args.groups,
        "streams_held": held,
        "streams": len(ids),
        "pm_cpu_share_of_a_core": cpu,
        "heartbeats_per_s": per_group * args.groups / 3.0,
    }


async def _held(pm: PMClient, groups: int) -> int:
    held = 0
    for g in range(groups):
        held += sum(len(d.streams) for d in await pm.describe_members(f"g{g}"))
    return held


async def _dead_member(pm: PMClient, pool: ConnectionPool) -> dict[str, Any]:
    created = await pm.create_streams([messages.Stream(replica_nums=1)] * 4)
    streams = [c.stream.stream_id for c in created if c.stream is not None]
    for stream in streams:
        async with Producer(pm, stream, pool=pool) as producer:
            await producer.send_many([b"record"] * 10)
    session_ms = int(DEAD_SESSION_S * 1000)
    # the member that dies holds every stream first; the reader joins after
    dead = await pm.group_heartbeat(
        "dead", "dying", 0, streams=streams, session_timeout_ms=session_ms
    )
    last_beat = trio.current_time()
    found_at: dict[int, float] = {}
    async with GroupConsumer(
        pm, "dead", streams, member_id="reader", session_timeout=DEAD_SESSION_S, pool=pool
    ) as reader:
        with trio.fail_after(60):
            async for batch in reader:
                found_at.setdefault(batch.stream_id, trio.current_time())
                if set(found_at) >= set(dead.assigned):
                    break
    first = min(found_at[s] for s in dead.assigned)
    return {
        "session_timeout_s": DEAD_SESSION_S,
        "read_again_after_s": first - last_beat,
        "over_the_session_s": first - last_beat - DEAD_SESSION_S,
    }


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    pm_child, nodes = plan_children(root, 1, "127.0.0.1", 0, "always", sys.executable)
    async with running_plan(Plan([], [pm_child], nodes), root), ConnectionPool() as pool:
        assert nodes[0].process is not None and pm_child.process is not None
        pm = PMClient(pm_child.address, pool=pool, timeout=30)
        cost = await _heartbeat_cost(pm, pm_child.process.pid, args)
        result: dict[str, Any] = {"heartbeats": cost}
        runs = [await _dead_member(pm, pool) for _ in range(args.rounds)]
        result["dead_member"] = {
            "runs": runs,
            "median_read_again_after_s": statistics.median(r["read_again_after_s"] for r in runs),
        }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.members", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--members", type=int, default=1000, help="members in all (default: 1,000)")
    parser.add_argument("--groups", type=int, default=100, help="groups (default: 100)")
    parser.add_argument("--seconds", type=float, default=30.0, help="PM CPU measured this long")
    parser.add_argument("--rounds", type=int, default=3, help="dead-member runs")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.members, args.groups, args.seconds, args.rounds = 50, 5, 4.0, 1
    with tempfile.TemporaryDirectory(prefix="bench-members-") as tmp:
        result = trio.run(run, args, Path(tmp))
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
