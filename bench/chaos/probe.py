"""The crowd mode's probe, a process of its own: ``python -m bench.chaos.probe
ADDRESS STREAM SECONDS`` sends a PING and a small FETCH every 20 ms to one
data node and prints their latency percentiles as JSON."""

from __future__ import annotations

import json
import sys

import trio

from bench.harness import percentiles_ms
from client.datanode_client import DataNodeClient
from sbp import messages
from sbp.enums import Opcode

INTERVAL_S = 0.02


async def probe(address: str, stream_id: int, seconds: float) -> dict[str, object]:
    latencies: list[float] = []
    errors = 0
    fetch = messages.FetchRequest(
        max_wait_ms=0,
        min_bytes=1,
        fetch_requests=(
            messages.FetchInfo(
                stream_id=stream_id, request_index=0, fetch_offset=0, batch_max_bytes=1024
            ),
        ),
    )
    async with DataNodeClient(address) as node:
        await node.ping(timeout=10)
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            started = trio.current_time()
            try:
                await node.ping(timeout=5)
                await node.call(Opcode.FETCH, fetch, timeout=5)
                latencies.append(trio.current_time() - started)
            except Exception:  # counted: any failure is the result
                errors += 1
            await trio.sleep(INTERVAL_S)
    summary = percentiles_ms(latencies)
    return {
        "p50_ms": summary["p50"],
        "p99_ms": summary["p99"],
        "calls": len(latencies),
        "errors": errors,
    }


def main() -> None:
    address, stream_id, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    print(json.dumps(trio.run(probe, address, stream_id, seconds)))


if __name__ == "__main__":
    main()
