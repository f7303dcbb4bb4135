"""``sbp top``: a live terminal view of the cluster for people without Grafana.

Every frame comes from one DESCRIBE_CLUSTER: the PM holds each data node's
liveness, range count and latest REPORT_METRICS, whose rates and latencies
the node measured over its last report interval (datanode/report.py). The
screen is redrawn with plain ANSI escapes; ``--once`` prints one frame
without them, for scripts and tests.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Final

import trio

from . import format as fmt
from .cli_commands import Env, node_summary

#: cursor home and clear screen
CLEAR: Final = "\x1b[H\x1b[2J"

COLUMNS: Final = (
    "node",
    "address",
    "state",
    "heartbeat",
    "ranges",
    "in/s",
    "out/s",
    "appends/s",
    "fetches/s",
    "append ms",
    "fetch ms",
    "commit ms",
    "errors/s",
    "disk free",
)


def render_frame(pm: str, rows: list[dict[str, Any]], now: float) -> str:
    """One screen: a cluster summary line and a row per data node."""
    alive = [row for row in rows if row["alive"]]
    total_in = sum(row["in_bytes_per_s"] for row in alive)
    total_out = sum(row["out_bytes_per_s"] for row in alive)
    appends = sum(row["appends_per_s"] for row in alive)
    fetches = sum(row["fetches_per_s"] for row in alive)
    errors = sum(row["failed_per_s"] for row in alive)
    clock = time.strftime("%H:%M:%S", time.localtime(now))
    header = (
        f"sbp top  {clock}  PM {pm}  nodes {len(alive)}/{len(rows)} alive  "
        f"in {fmt.size_text(total_in)}/s  out {fmt.size_text(total_out)}/s  "
        f"appends {appends:,}/s  fetches {fetches:,}/s  errors {errors:,}/s"
    )
    body = fmt.table(
        COLUMNS,
        [
            [
                row["node_id"],
                row["address"],
                "alive" if row["alive"] else "DEAD",
                row["last_heartbeat"],
                row["ranges"],
                fmt.size_text(row["in_bytes_per_s"]),
                fmt.size_text(row["out_bytes_per_s"]),
                row["appends_per_s"],
                row["fetches_per_s"],
                row["append_ms"],
                row["fetch_ms"],
                row["commit_ms"],
                row["failed_per_s"],
                fmt.size_text(row["disk_free_bytes"]),
            ]
            for row in rows
        ],
    )
    return f"{header}\n\n{body}" if rows else f"{header}\n\nthe PM knows no data nodes"


async def sample(env: Env) -> list[dict[str, Any]]:
    """One row per data node, from one DESCRIBE_CLUSTER."""
    now = time.time()
    return [node_summary(status, now) for status in await env.pm.describe_cluster()]


async def run_top(env: Env) -> int:
    if env.args.once:
        rows = await sample(env)
        if env.json:
            env.emit_json({"pm": env.args.pm, "data_nodes": rows})
        else:
            env.emit(render_frame(env.args.pm, rows, time.time()))
        return 0
    with trio.open_signal_receiver(signal.SIGINT) as interrupts:
        async with trio.open_nursery() as nursery:

            async def stop_on_interrupt() -> None:
                async for _ in interrupts:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_interrupt)
            while True:
                rows = await sample(env)
                env.out.write(CLEAR + render_frame(env.args.pm, rows, time.time()) + "\n")
                env.out.write("\nCtrl-C to quit\n")
                env.out.flush()
                await trio.sleep(env.args.interval)
    return 0
