"""Three etcd members on loopback, as real processes (Debian's
``etcd-server``), for the tests of the PM on etcd."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from net.address import free_ports
from pm.etcd import Etcd, EtcdError

READY_TIMEOUT_S = 20.0


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: trio.Process | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


@dataclass
class EtcdCluster:
    members: list[Member]
    initial_cluster: str
    token: str
    started: list[trio.Process] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    async def start(self, member: Member, *, state: str = "new") -> None:
        member.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            "etcd",
            *("--name", member.name, "--data-dir", str(member.data_dir)),
            *("--listen-client-urls", member.client_url),
            *("--advertise-client-urls", member.client_url),
            *("--listen-peer-urls", member.peer_url),
            *("--initial-advertise-peer-urls", member.peer_url),
            *("--initial-cluster", self.initial_cluster),
            *("--initial-cluster-state", state, "--initial-cluster-token", self.token),
            *("--heartbeat-interval", "50", "--election-timeout", "500"),
        ]
        with member.log_path.open("ab") as log:
            member.process = await trio.lowlevel.open_process(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.started.append(member.process)

    async def kill(self, member: Member) -> None:
        if member.process is not None and member.process.returncode is None:
            member.process.kill()
            await member.process.wait()

    async def wait_ready(self) -> None:
        """Until a write goes through (a leader is elected)."""
        async with Etcd(self.endpoints, timeout=1.0) as etcd:
            with trio.fail_after(READY_TIMEOUT_S):
                while True:
                    try:
                        await etcd.put(b"/ready", b"1")
                        return
                    except EtcdError:
                        await trio.sleep(0.1)

    async def stop_all(self) -> None:
        for member in self.members:
            await self.kill(member)


@contextlib.asynccontextmanager
async def etcd_cluster(root: Path, size: int = 3) -> AsyncIterator[EtcdCluster]:
    if shutil.which("etcd") is None:
        raise AssertionError("etcd is not installed: run scripts/install-system-deps.sh")
    ports = free_ports(2 * size)
    members = [
        Member(
            f"m{i}",
            ports[2 * i - 2],
            ports[2 * i - 1],
            root / f"etcd-m{i}",
            root / "logs" / f"etcd-m{i}.log",
        )
        for i in range(1, size + 1)
    ]
    cluster = EtcdCluster(
        members,
        ",".join(f"{m.name}={m.peer_url}" for m in members),
        f"sbp-test-{members[0].client_port}",
    )
    try:
        for member in members:
            await cluster.start(member)
        await cluster.wait_ready()
        yield cluster
    finally:
        with trio.CancelScope(shield=True):
            await cluster.stop_all()
