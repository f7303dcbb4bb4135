"""What byte-rate quotas (SPEC §12) cost a data node per APPEND:

    .venv/bin/python -m bench.quota [--rounds 5] [--seconds 5] [--out FILE]

One PM and one data node (``client.launcher``, sync always) with a
``--quota-file`` that SIGHUP switches between no quota and one for every
principal (``*``: these clients are ANONYMOUS) far above the load, so that
each request is charged and none is throttled. The load: 64 KiB batches,
one per APPEND, 64 in flight, for ``--seconds``. The two alternate within
each round, on the same process; the result is the median over the rounds
of the node's CPU per APPEND with the quota over without.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from bench.output import emit
from client.launcher import Plan, plan_children, running_plan

from .harness import Load, LocalCluster, one_stream_64k
from .peers.sbp import measure_appends

QUOTAS = {"quotas": [{"principal": "*", "append_bytes_per_s": "100GiB"}]}
NO_QUOTAS: dict[str, list[Any]] = {"quotas": []}


async def measure(root: Path, rounds: int, seconds: float) -> dict[str, Any]:
    pm, nodes = plan_children(root, 1, "127.0.0.1", 0, "always", sys.executable)
    path = root / "quotas.json"
    path.write_text(json.dumps(NO_QUOTAS))
    nodes[0].argv += ["--quota-file", str(path)]
    ratios: list[float] = []
    on: list[float] = []
    off: list[float] = []
    async with running_plan(Plan([], [pm], nodes), root):
        process = nodes[0].process
        assert process is not None
        cluster = LocalCluster(pm.address, nodes[0].address, process.pid, root)
        load = Load(in_flight=64, seconds=seconds, warmup=1.0)

        async def cpu_per_append_us(quotas: bool) -> float:
            path.write_text(json.dumps(QUOTAS if quotas else NO_QUOTAS))
            process.send_signal(signal.SIGHUP)
            await trio.sleep(0.5)
            measured = await measure_appends(cluster, "always", one_stream_64k(), load)
            assert measured.server_cpu is not None and measured.requests
            return measured.server_cpu * measured.seconds / measured.requests * 1e6

        for index in range(rounds):
            first = index % 2 == 0  # which goes first alternates
            results = {}
            for quotas in (first, not first):
                results[quotas] = await cpu_per_append_us(quotas)
            on.append(results[True])
            off.append(results[False])
            ratios.append(results[True] / results[False])
            print(
                f"round {index + 1}: {results[False]:.0f} µs without, {results[True]:.0f} µs "
                f"with quotas ({ratios[-1]:.3f}x)",
                flush=True,
            )
    return {
        "rounds": rounds,
        "node_cpu_us_per_append_without": round(statistics.median(off), 1),
        "node_cpu_us_per_append_with": round(statistics.median(on), 1),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quota", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-quota-") as root:
        result = trio.run(measure, Path(root), args.rounds, args.seconds)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
