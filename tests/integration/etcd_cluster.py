"""Three etcd members on loopback, as real processes (Debian's
``etcd-server``), for the tests of the PM on etcd."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import trio

from client.children import Child, kill_child, start_child
from net.address import free_ports
from pm.etcd import Etcd, EtcdError

from ..eventually import eventually

READY_TIMEOUT_S = 20.0


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    child: Child | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def process(self) -> trio.Process | None:
        return None if self.child is None else self.child.process


@dataclass
class EtcdCluster:
    members: list[Member]
    initial_cluster: str
    token: str

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    async def start(self, member: Member, *, state: str = "new") -> None:
        """Start ``member`` through the launcher's ``start_child`` (up once its
        client port answers), with short heartbeats so that elections take
        a second. Not behind ``client.with_parent``: a test's SIGKILL must
        reach etcd itself."""
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
        member.child = Child(
            member.name,
            argv,
            member.log_path,
            address=f"127.0.0.1:{member.client_port}",
            announces=False,
        )
        await start_child(member.child, timeout=READY_TIMEOUT_S)

    async def kill(self, member: Member) -> None:
        if member.child is not None:
            await kill_child(member.child)

    async def wait_ready(self) -> None:
        """Until a write goes through (a leader is elected)."""
        async with Etcd(self.endpoints, timeout=1.0) as etcd:

            async def written() -> bool:
                try:
                    await etcd.put(b"/ready", b"1")
                except EtcdError:
                    return False
                return True

            await eventually(written, timeout=READY_TIMEOUT_S, what="a write to etcd")

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
