"""A PM and data nodes as real processes on loopback, for the PM's tests and
its scale benchmark: started as a user starts them, with short heartbeat
intervals and node timeout so that liveness changes show within seconds."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

import trio

from client.datanode_client import DataNodeClient
from client.pm_client import PMClient
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch, decode_batches

from ..eventually import eventually
from .procs import ServerProcess, start_server

NODE_TIMEOUT_MS = 1500
HEARTBEAT_MS = 200
REPORT_MS = 500
READY_TIMEOUT_S = 20.0


@dataclass
class PMCluster:
    """One PM and its data nodes; ``pool`` serves every client of a test."""

    root: Path
    pool: ConnectionPool
    pm: ServerProcess | None = None
    nodes: dict[int, ServerProcess] = field(default_factory=dict)
    node_timeout_ms: int = NODE_TIMEOUT_MS

    @property
    def pm_address(self) -> str:
        assert self.pm is not None
        return self.pm.address

    def pm_client(self, timeout: float = 10.0) -> PMClient:
        return PMClient(self.pm_address, pool=self.pool, timeout=timeout)

    def node_client(self, address: str, timeout: float = 10.0) -> DataNodeClient:
        return DataNodeClient(address, pool=self.pool, timeout=timeout)

    async def start_pm(self, listen: str = "127.0.0.1:0", *extra: str) -> ServerProcess:
        args = [
            "--listen",
            listen,
            "--data-dir",
            str(self.root / "pm"),
            "--node-timeout-ms",
            str(self.node_timeout_ms),
            *extra,
        ]
        self.pm = await start_server("pm", args, self.root / "logs", name="pm")
        return self.pm

    async def start_node(self, node_id: int, *extra: str) -> ServerProcess:
        args = [
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(self.root / f"node-{node_id}"),
            "--node-id",
            str(node_id),
            "--pm",
            self.pm_address,
            "--heartbeat-interval-ms",
            str(HEARTBEAT_MS),
            "--metrics-interval-ms",
            str(REPORT_MS),
            *extra,
        ]
        node = await start_server("datanode", args, self.root / "logs", name=f"node-{node_id}")
        self.nodes[node_id] = node
        return node

    async def start_nodes(self, node_ids: Sequence[int], *extra: str) -> None:
        async with trio.open_nursery() as nursery:
            for node_id in node_ids:
                nursery.start_soon(self.start_node, node_id, *extra)
        await self.wait_alive(set(node_ids))

    async def wait_alive(
        self, alive: AbstractSet[int], dead: AbstractSet[int] = frozenset()
    ) -> None:
        """Until DESCRIBE_CLUSTER shows ``alive`` alive and ``dead`` dead."""
        pm = self.pm_client()

        async def shown() -> bool:
            statuses = await pm.describe_cluster()
            live = {s.data_node.node_id for s in statuses if s.alive}
            gone = {s.data_node.node_id for s in statuses if not s.alive}
            return alive <= live and dead <= gone

        what = f"nodes {sorted(alive)} alive and {sorted(dead)} dead"
        await eventually(shown, timeout=READY_TIMEOUT_S, interval=0.05, what=what)

    async def stop_all(self) -> None:
        for node in self.nodes.values():
            await node.kill()
        if self.pm is not None:
            await self.pm.kill()


@contextlib.asynccontextmanager
async def pm_cluster(
    root: Path,
    node_ids: Sequence[int] = (1, 2, 3),
    node_timeout_ms: int = NODE_TIMEOUT_MS,
    pm_args: Sequence[str] = (),
    node_args: Sequence[str] = (),
) -> AsyncIterator[PMCluster]:
    """A running PM (with ``pm_args``) and ``node_ids`` registered and alive
    (each with ``node_args``)."""
    async with ConnectionPool() as pool:
        cluster = PMCluster(root, pool, node_timeout_ms=node_timeout_ms)
        try:
            await cluster.start_pm("127.0.0.1:0", *pm_args)
            await cluster.start_nodes(node_ids, *node_args)
            yield cluster
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


def primary_address(rng: messages.Range) -> str:
    for replica in rng.replica_nodes:
        if replica.is_primary:
            return replica.data_node.advertise_addr
    raise AssertionError(f"range {rng} has no primary")


async def append_values(cluster: PMCluster, rng: messages.Range, values: Sequence[bytes]) -> int:
    """Append one batch of ``values`` to the range's primary; its base offset."""
    client = cluster.node_client(primary_address(rng))
    result = await client.append_batch(rng.stream_id, bytes(build_batch(values, base_timestamp=1)))
    return int(result.base_offset)


async def read_stream(cluster: PMCluster, stream_id: int) -> list[bytes]:
    """Every value of a stream, read range by range from each range's primary.
    A fetch returns whole batches, so records below the offset asked for (a
    batch cut by a trim) are skipped, as consumers do."""
    ranges = await cluster.pm_client().list_stream_ranges(stream_id)
    values: list[bytes] = []
    offset = ranges[0].start_offset
    for rng in ranges:
        client = cluster.node_client(primary_address(rng))
        while rng.end_offset < 0 or offset < rng.end_offset:
            info = messages.FetchInfo(
                stream_id=stream_id, fetch_offset=offset, batch_max_bytes=1 << 20
            )
            async with client.fetch([info]) as results:
                data = b"".join([bytes(fetched.data) async for fetched in results])
            if not data:
                break
            records = decode_batches(data)
            for i in range(len(records)):
                if records.offsets[i] >= offset:
                    values.append(records.value(i))
            offset = int(records.offsets[-1]) + 1
    return values
