"""The PM on etcd against the PM on LMDB (SPEC §8), in the same run: stream
creates (CREATE_STREAMS of 100) and seals (SEAL_RANGES of 100 open ranges)
per second, one request in flight, each cluster with one data node; then the
failover time of the etcd cluster (three etcd members, three PMs): from
SIGKILL of the leading PM to the first CREATE_STREAMS answered by the next,
through a client given every PM, with the default 3 s lease.

The two clusters are measured in alternating order, two rounds.
"""

from __future__ import annotations

import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import trio
from matplotlib.figure import Figure

from bench.report import ScenarioResult, Target, number, table
from bench.scenarios.options import Options
from client.launcher import Plan, plan_children, plan_ha, running_plan
from client.pm_client import PMClient
from net.pool import ConnectionPool
from sbp import messages

NAME = "pm_ha"
BATCH: Final = 100
BACKENDS: Final = ("LMDB", "etcd")


@asynccontextmanager
async def cluster(parent: Path, backend: str) -> AsyncIterator[Plan]:
    data_dir = Path(tempfile.mkdtemp(prefix=f"pm-{backend.lower()}-", dir=parent))
    planned = (1, "127.0.0.1", 0, "always", sys.executable)
    if backend == "etcd":
        plan = plan_ha(data_dir, *planned)
    else:
        pm, nodes = plan_children(data_dir, *planned)
        plan = Plan([], [pm], nodes)
    async with running_plan(plan, data_dir):
        yield plan


async def _rates(plan: Plan, seconds: float) -> tuple[float, float]:
    """(streams created per second, ranges sealed per second)."""
    async with ConnectionPool() as pool:
        pm = PMClient(plan.pm_addresses, pool=pool, timeout=30)
        created: list[int] = []
        started = trio.current_time()
        while trio.current_time() - started < seconds:
            results = await pm.create_streams([messages.Stream(replica_nums=1)] * BATCH)
            created += [r.stream.stream_id for r in results if r.stream is not None]
        create_rate = len(created) / (trio.current_time() - started)
        sealed = 0
        started = trio.current_time()
        while sealed < len(created) and trio.current_time() - started < seconds:
            chunk = created[sealed : sealed + BATCH]
            await pm.seal_ranges([messages.RangeId(stream_id=s, range_index=0) for s in chunk])
            sealed += len(chunk)
        seal_rate = sealed / (trio.current_time() - started)
        await pm.delete_streams(created)
    return create_rate, seal_rate


async def _failover(plan: Plan) -> float:
    """Seconds from SIGKILL of the leading PM to a create on the next one."""
    async with ConnectionPool() as pool:
        pm = PMClient(plan.pm_addresses, pool=pool, timeout=30)
        await pm.create_streams([messages.Stream(replica_nums=1)])
        leader = next(p for p in plan.pms if p.address == pm.address)
        assert leader.process is not None
        leader.process.send_signal(signal.SIGKILL)
        killed = trio.current_time()
        await pm.create_streams([messages.Stream(replica_nums=1)])
        return trio.current_time() - killed


async def _run(options: Options) -> dict[str, list[tuple[float, float]]]:
    rounds = 1 if options.quick else 2
    seconds = options.seconds
    rates: dict[str, list[tuple[float, float]]] = {b: [] for b in BACKENDS}
    failovers: list[float] = []
    async with cluster(options.scratch, "LMDB") as lmdb, cluster(options.scratch, "etcd") as ha:
        plans = {"LMDB": lmdb, "etcd": ha}
        for round_number in range(rounds):
            order = BACKENDS if round_number % 2 == 0 else tuple(reversed(BACKENDS))
            for backend in order:
                rates[backend].append(await _rates(plans[backend], seconds))
        failovers.append(await _failover(ha))
    rates["failover"] = [(s, 0.0) for s in failovers]
    return rates


def _plot(rates: dict[str, list[tuple[float, float]]]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        axes = figure.subplots(1, 1)
        for backend in BACKENDS:
            creates = [c for c, _ in rates[backend]]
            axes.plot(range(1, len(creates) + 1), creates, "o-", label=f"{backend} creates/s")
        axes.set_xlabel("round")
        axes.legend(fontsize=8)
        axes.set_ylim(bottom=0)

    return draw


def run(options: Options) -> ScenarioResult:
    started = time.monotonic()
    rates = trio.run(_run, options)
    creates = {b: statistics.median(c for c, _ in rates[b]) for b in BACKENDS}
    seals = {b: statistics.median(s for _, s in rates[b]) for b in BACKENDS}
    failover = rates["failover"][0][0]
    rows = [
        (backend, index + 1, number(create), number(seal))
        for backend in BACKENDS
        for index, (create, seal) in enumerate(rates[backend])
    ]
    return ScenarioResult(
        name=NAME,
        title="PM on etcd",
        settings=options.as_settings() | {"batch": BATCH, "data_nodes": 1, "etcd_members": 3},
        measurements=[],
        targets=[
            Target(
                f"stream creates per second on etcd, CREATE_STREAMS of {BATCH}",
                creates["etcd"],
                2000,
                "/s",
            ),
            Target(
                "failover: SIGKILL of the leader to the first create on the next, 3 s lease",
                failover,
                6.0,
                "s",
                higher_is_better=False,
            ),
        ],
        tables=[
            "## Creates and seals per second\n\n"
            + table(["backend", "round", "creates/s", "seals/s"], rows, "lrrr"),
            "## Medians\n\n"
            + table(
                ["backend", "creates/s", "seals/s"],
                [(b, number(creates[b]), number(seals[b])) for b in BACKENDS],
                "lrr",
            ),
        ],
        plot=_plot(rates),
        extra={
            "creates_per_s": creates,
            "seals_per_s": seals,
            "failover_s": failover,
            "seconds": time.monotonic() - started,
        },
    )
