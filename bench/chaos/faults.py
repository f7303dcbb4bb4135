"""Faults and their seeded schedule.

A schedule is drawn entirely from the seed before the run starts and is
printed, so any run can be replayed with ``--seed``: the same faults, on the
same targets, at the same times and for as long (what the cluster does in
between still varies with the machine).

========================  ==========================================================
kind                      what happens to the target, for the fault's duration
========================  ==========================================================
``kill``                  SIGKILL, then a restart on the same data directory
``pause``                 SIGSTOP, then SIGCONT
``partition-node-pm``     the node's link to the PM holds every byte (both ways)
``isolate-node``          every link to the node is reset and refused
``partition-clients-pm``  the workload's link to the PM is reset and refused
``slow-link``             one link delays every chunk by 50 to 300 ms
``corrupt-link``          one link throws bytes away for half a second: every
                          connection on it turns to garbage mid-frame
``drop-answers``          the link to a node carries requests but loses every
                          answer, then resets its connections: the requests
                          were served, their clients never hear (what
                          idempotent producers are for)
``drain``                 the node is drained (SPEC §12), then the drain is
                          cancelled after a while, or once the node is
                          drained (it is made active again either way)
========================  ==========================================================

A full disk is not scheduled: one node runs with a small LMDB map
(``--small-map-node``) and fills up during the run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from client import retry
from client.pm_client import PMClient
from sbp.enums import DataNodeState
from sbp.errors import SBPError

from .cluster import ChaosCluster
from .history import FaultSpan, History
from .proxy import LinkProxy, Mode

KINDS = (
    "kill",
    "pause",
    "partition-node-pm",
    "isolate-node",
    "partition-clients-pm",
    "slow-link",
    "corrupt-link",
    "drop-answers",
    "drain",
)
#: a "drain" fault that lets the drain finish waits for it at most this many
#: times its drawn duration (a drain that cannot finish, too few nodes for
#: three replicas, is cancelled then)
DRAIN_FINISH_FACTOR = 4.0


@dataclass(frozen=True, slots=True)
class Fault:
    at: float  # seconds from the start of the run
    kind: str
    target: str  # "pm", "node-N", or a link name
    duration: float
    delay_s: float = 0.0
    #: a "drain" that waits for the node to be drained (else cancelled after ``duration``)
    finish: bool = False

    def describe(self) -> str:
        extra = f" +{self.delay_s * 1000:.0f} ms" if self.delay_s else ""
        if self.kind == "drain":
            extra = " until drained" if self.finish else " then cancelled"
        return f"{self.at:7.1f}s  {self.kind:<21} {self.target:<12} for {self.duration:.1f}s{extra}"


def draw_schedule(
    seed: int,
    run_s: float,
    nodes: list[str],
    links: list[str],
    kinds: tuple[str, ...] = KINDS,
    mean_gap_s: float = 3.0,
    quiet_tail_s: float = 5.0,
    others: Sequence[str] = (),
) -> list[Fault]:
    """Faults one after another (never two at once, so that each one's
    effect can be read from the timeline), from ``seed`` alone; ``others``
    are processes besides the PM and the nodes to kill and pause."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = rng.uniform(2.0, 4.0)
    while True:
        kind = rng.choice(kinds)
        duration = rng.uniform(1.0, 3.0) if kind == "kill" else rng.uniform(2.0, 8.0)
        delay = 0.0
        finish = False
        if kind == "drain":
            target = rng.choice(nodes)
            finish = rng.random() < 0.5
            duration = rng.uniform(3.0, 15.0)
        elif kind in ("kill", "pause"):
            target = rng.choice([*nodes, "pm", *others])
        elif kind in ("partition-node-pm", "isolate-node"):
            target = rng.choice(nodes)
        elif kind == "partition-clients-pm":
            target = "clients->pm"
        elif kind == "drop-answers":
            target = f"->{rng.choice(nodes)}"
            duration = rng.uniform(0.5, 2.0)
        else:
            target = rng.choice(links)
            if kind == "slow-link":
                delay = rng.uniform(0.05, 0.3)
            else:
                duration = 0.5
        if at + duration > run_s - quiet_tail_s:
            return faults
        faults.append(
            Fault(round(at, 2), kind, target, round(duration, 2), round(delay, 3), finish)
        )
        at += duration + rng.expovariate(1 / mean_gap_s) + 0.5


class Injector:
    """Plays a schedule against a cluster and records each fault's span."""

    def __init__(self, cluster: ChaosCluster, history: History, started_at: float) -> None:
        self.cluster = cluster
        self.history = history
        self.started_at = started_at

    def _now(self) -> float:
        return trio.current_time() - self.started_at

    def _link(self, name: str) -> LinkProxy:
        return next(proxy for proxy in self.cluster.proxies if proxy.name == name)

    async def play(self, schedule: list[Fault]) -> None:
        for fault in schedule:
            await trio.sleep_until(self.started_at + fault.at)
            start = self._now()
            detail = await self._inject(fault)
            self.history.faults.append(
                FaultSpan(fault.kind, fault.target, round(start, 2), round(self._now(), 2), detail)
            )
            print(f"  fault {fault.describe()}  {detail}".rstrip(), flush=True)

    async def _inject(self, fault: Fault) -> str:
        cluster = self.cluster
        match fault.kind:
            case "kill":
                await cluster.kill(fault.target)
                await trio.sleep(fault.duration)
                await cluster.restart(fault.target)
                return "restarted"
            case "pause":
                cluster.pause(fault.target)
                await trio.sleep(fault.duration)
                cluster.resume(fault.target)
                return ""
            case "partition-node-pm":
                link = cluster.pm_links[fault.target]
                link.set(Mode.HOLD)
                await trio.sleep(fault.duration)
                link.heal()
                return ""
            case "isolate-node":
                link = cluster.nodes[fault.target].ingress[0]
                link.cut()
                await trio.sleep(fault.duration)
                link.heal()
                return ""
            case "partition-clients-pm":
                cluster.client_pm.cut()
                await trio.sleep(fault.duration)
                cluster.client_pm.heal()
                return ""
            case "slow-link":
                link = self._link(fault.target)
                link.set(Mode.DELAY, delay_s=fault.delay_s)
                await trio.sleep(fault.duration)
                link.heal()
                return ""
            case "corrupt-link":
                link = self._link(fault.target)
                link.set(Mode.DROP, down=False)
                await trio.sleep(fault.duration)
                link.heal()
                return ""
            case "drop-answers":
                link = self._link(fault.target)
                link.set(Mode.DROP, up=False)
                await trio.sleep(fault.duration)
                link.cut()  # the connections are mid-frame now: reset them
                link.heal()
                return ""
            case "drain":
                return await self._drain(fault)
        raise ValueError(f"unknown fault kind {fault.kind!r}")

    async def _drain(self, fault: Fault) -> str:
        """DRAIN_DATA_NODES of the target, then its cancel: after the fault's
        duration, or once the node is drained (``finish``)."""
        node_id = int(fault.target.removeprefix("node-"))
        started = trio.current_time()
        async with PMClient(self.cluster.pm_address, timeout=10) as pm:
            with trio.fail_after(30):
                await retry.until_deadline(lambda: pm.drain_data_nodes([node_id]), "drain")
            outcome = f"cancelled after {fault.duration:.1f}s"
            if fault.finish:
                patience = fault.duration * DRAIN_FINISH_FACTOR
                outcome = f"not drained in {patience:.0f}s: cancelled"
                with trio.move_on_after(patience):
                    while not await _drained(pm, node_id):
                        await trio.sleep(0.5)
                    outcome = f"drained in {trio.current_time() - started:.1f}s"
            else:
                await trio.sleep(fault.duration)
            with trio.fail_after(30):
                await retry.until_deadline(
                    lambda: pm.drain_data_nodes([node_id], cancel=True), "cancel"
                )
        return outcome


async def _drained(pm: PMClient, node_id: int) -> bool:
    try:
        statuses = await pm.describe_cluster()
    except (SBPError, OSError):
        return False
    return any(
        s.data_node.node_id == node_id and s.state == DataNodeState.DRAINED for s in statuses
    )
