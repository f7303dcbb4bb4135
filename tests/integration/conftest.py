"""Fixtures for integration tests: servers as real processes on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from net.connection import Connection
from sbp import messages
from sbp.connection import Side
from sbp.constants import OPEN_END_OFFSET
from sbp.enums import Opcode

from .procs import ServerProcess, start_server


class DataNodes:
    """Starts data nodes (``python -m datanode``) under one temporary
    directory; whatever is still running at the end of the test is killed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[ServerProcess] = []

    def data_dir(self, node_id: int) -> Path:
        return self.root / f"node-{node_id}"

    async def start(
        self,
        node_id: int = 1,
        *args: str,
        data_dir: Path | None = None,
        listen: str = "127.0.0.1:0",
    ) -> ServerProcess:
        argv: Sequence[str] = (
            "--listen",
            listen,
            "--node-id",
            str(node_id),
            "--data-dir",
            str(data_dir or self.data_dir(node_id)),
            *args,
        )
        node = await start_server(
            "datanode", argv, self.root / "logs", name=f"node-{node_id}-{len(self.started)}"
        )
        self.started.append(node)
        return node

    async def kill_all(self) -> None:
        for node in self.started:
            if node.running:
                await node.kill()


@pytest.fixture
async def datanodes(tmp_path: Path) -> AsyncIterator[DataNodes]:
    nodes = DataNodes(tmp_path)
    try:
        yield nodes
    finally:
        await nodes.kill_all()


# -- helpers for data node tests ------------------------------------------------


@asynccontextmanager
async def connect(address: str) -> AsyncIterator[Connection]:
    """A client ``net.Connection`` to ``address``, closed on exit."""
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with trio.open_nursery() as nursery:
        connection = Connection(stream, side=Side.CLIENT, peer=address)
        await nursery.start(connection.run)
        try:
            yield connection
        finally:
            await connection.aclose()


def hosted_range(
    stream_id: int,
    node: ServerProcess,
    node_id: int = 1,
    *,
    index: int = 0,
    start: int = 0,
    end: int = OPEN_END_OFFSET,
    primary: bool = True,
) -> messages.Range:
    """A range of ``stream_id`` placed on ``node`` (its primary unless told otherwise)."""
    return messages.Range(
        stream_id=stream_id,
        range_index=index,
        start_offset=start,
        end_offset=end,
        replica_nodes=(
            messages.ReplicaNode(
                data_node=messages.DataNode(node_id=node_id, advertise_addr=node.address),
                is_primary=primary,
            ),
        ),
    )


async def sync_ranges(
    connection: Connection, *ranges: messages.Range
) -> messages.SyncRangesResponse:
    """Tell the node about ``ranges`` (grouped by stream), as the PM would."""
    by_stream: dict[int, list[messages.Range]] = {}
    for wire in ranges:
        by_stream.setdefault(wire.stream_id, []).append(wire)
    request = messages.SyncRangesRequest(
        timeout_ms=10_000,
        stream_ranges=tuple(
            messages.StreamRanges(stream_id=stream_id, ranges=tuple(items))
            for stream_id, items in by_stream.items()
        ),
    )
    response = await connection.request(Opcode.SYNC_RANGES, request, timeout=10)
    header: messages.SyncRangesResponse = response.header
    assert [r.error_code for r in header.sync_responses] == [0] * len(by_stream)
    return header


def append_request(
    items: Sequence[tuple[int, bytes | bytearray]], timeout_ms: int = 10_000
) -> tuple[messages.AppendRequest, bytes]:
    """An APPEND header and payload for ``(stream_id, batch)`` items."""
    header = messages.AppendRequest(
        timeout_ms=timeout_ms,
        append_requests=tuple(
            messages.AppendInfo(stream_id=stream_id, request_index=i, batch_length=len(batch))
            for i, (stream_id, batch) in enumerate(items)
        ),
    )
    return header, b"".join(bytes(batch) for _, batch in items)


def fetch_request(
    *items: tuple[int, int], max_wait_ms: int = 0, min_bytes: int = 1, max_bytes: int = 1 << 20
) -> messages.FetchRequest:
    """A FETCH header for ``(stream_id, fetch_offset)`` items."""
    return messages.FetchRequest(
        max_wait_ms=max_wait_ms,
        min_bytes=min_bytes,
        fetch_requests=tuple(
            messages.FetchInfo(
                stream_id=stream_id,
                request_index=i,
                fetch_offset=offset,
                batch_max_bytes=max_bytes,
            )
            for i, (stream_id, offset) in enumerate(items)
        ),
    )


async def scrape(node: ServerProcess) -> dict[str, float]:
    """The node's /metrics samples by name, labels included as written
    (``sbp_requests_total{code="NONE",opcode="APPEND"}``)."""
    assert node.metrics_address is not None
    host, _, port = node.metrics_address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        body = b""
        while chunk := await stream.receive_some(65536):
            body += chunk
    samples: dict[str, float] = {}
    for line in body.decode().split("\r\n\r\n", 1)[1].splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
