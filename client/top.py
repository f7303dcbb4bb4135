"""``sbp top``: a live terminal view of the cluster for people without Grafana.

Every frame comes from one DESCRIBE_CLUSTER (and the consumer groups from
LIST_GROUPS and FETCH_OFFSETS): the PM holds each data node's
liveness, range count and latest REPORT_METRICS, whose rates and latencies
the node measured over its last report interval (datanode/report.py). The
screen is redrawn with plain ANSI escapes, each line cut to the terminal's
width rather than wrapped; ``q`` or Ctrl-C quits. ``--once`` prints one
frame without escapes, for scripts and tests; ``--json`` prints one JSON
object per frame (a line each), never escapes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import Any, Final

import trio

from . import format as fmt
from .cli_commands import Env
from .cluster_view import group_summaries, node_summary

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


#: consumer groups shown, those furthest behind first
TOP_GROUPS: Final = 5
#: groups whose lag is asked for per frame (one FETCH_OFFSETS each)
MAX_GROUPS_ASKED: Final = 100


def _state(row: dict[str, Any]) -> str:
    """DEAD, alive, or the drain state of a live node that is not active."""
    if not row["alive"]:
        return "DEAD"
    state = str(row.get("state", "active"))
    return "alive" if state == "active" else state


def render_frame(
    pm: str, rows: list[dict[str, Any]], now: float, groups: list[dict[str, Any]] | None = None
) -> str:
    """One screen: a cluster summary line, a row per data node, and the
    consumer groups furthest behind."""
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
                _state(row),
                fmt.age_text(row["last_heartbeat_ms"], now),
                row["ranges"],
                fmt.size_text(row["in_bytes_per_s"]),
                fmt.size_text(row["out_bytes_per_s"]),
                row["appends_per_s"],
                row["fetches_per_s"],
                row["append_ms"],
                row["fetch_ms"],
                row["commit_ms"],
                row["failed_per_s"],
                fmt.optional_size_text(row["disk_free_bytes"]),
            ]
            for row in rows
        ],
    )
    screen = f"{header}\n\n{body}" if rows else f"{header}\n\nthe PM knows no data nodes"
    if groups:
        behind = fmt.table(
            ["group", "streams", "members", "lag", "last commit"],
            [
                [
                    g["group"],
                    g["streams"],
                    g["members"],
                    f"{g['lag_records']:,}",
                    fmt.age_text(g["last_commit_ms"], now),
                ]
                for g in groups
            ],
        )
        screen += f"\n\nconsumer groups furthest behind\n{behind}"
    return screen


async def sample(env: Env) -> list[dict[str, Any]]:
    """One row per data node, from one DESCRIBE_CLUSTER."""
    now = time.time()
    return [node_summary(status, now) for status in await env.pm.describe_cluster()]


async def furthest_behind(env: Env) -> list[dict[str, Any]]:
    """The ``TOP_GROUPS`` consumer groups with the most records to read (of
    the first ``MAX_GROUPS_ASKED`` groups listed)."""
    found = [
        {
            "group": g["group"],
            "streams": len(g["stream_ids"]),
            "lag_records": g["lag_records"] or 0,
            "last_commit_ms": g["last_commit_ms"],
            "members": g["members"],
        }
        for g in await group_summaries(env.pm, MAX_GROUPS_ASKED)
    ]
    found.sort(key=lambda g: (-int(g["lag_records"]), str(g["group"])))
    return found[:TOP_GROUPS]


def fit_width(text: str, width: int) -> str:
    """Every line cut to ``width`` characters: a narrow terminal shows the
    first columns rather than wrapped rows."""
    return "\n".join(line[:width] for line in text.split("\n"))


@contextlib.contextmanager
def _keys_unbuffered(fd: int) -> Iterator[bool]:
    """Single keypresses from a terminal (cbreak mode, restored on exit);
    yields False when ``fd`` is not a terminal."""
    if not os.isatty(fd):
        yield False
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def cmd_top(env: Env) -> int:
    """A live view of the cluster, redrawn every --interval seconds."""
    if env.args.once:
        rows, groups = await sample(env), await furthest_behind(env)
        if env.json:
            env.emit_json({"pm": env.args.pm, "data_nodes": rows, "groups": groups})
        else:
            env.emit(render_frame(env.args.pm, rows, time.time(), groups))
        return 0
    stdin = sys.stdin.fileno()
    with (
        trio.open_signal_receiver(signal.SIGINT) as interrupts,
        _keys_unbuffered(stdin) as keys,
    ):
        async with trio.open_nursery() as nursery:

            async def stop_on_interrupt() -> None:
                async for _ in interrupts:
                    nursery.cancel_scope.cancel()
                    return

            async def stop_on_q() -> None:
                while True:
                    key = await trio.to_thread.run_sync(os.read, stdin, 1, abandon_on_cancel=True)
                    if key in (b"q", b"Q", b""):
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(stop_on_interrupt)
            if keys:
                nursery.start_soon(stop_on_q)
            while True:
                rows, groups = await sample(env), await furthest_behind(env)
                if env.json:
                    frame = {
                        "pm": env.args.pm,
                        "time": time.time(),
                        "data_nodes": rows,
                        "groups": groups,
                    }
                    env.emit(fmt.dumps(frame, one_line=True))
                else:
                    width = shutil.get_terminal_size().columns
                    screen = render_frame(env.args.pm, rows, time.time(), groups)
                    hint = "q or Ctrl-C quits" if keys else "Ctrl-C quits"
                    env.out.write(CLEAR + fit_width(screen, width) + f"\n\n{hint}\n")
                    env.out.flush()
                await trio.sleep(env.args.interval)
    return 0
