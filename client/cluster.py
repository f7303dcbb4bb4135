"""``sbp-cluster``: a local cluster — one PM and N data nodes as child processes
on loopback, with all data under one directory.

The layout under ``--data-dir`` is fixed (``pm/``, ``node-1/`` …, ``logs/``) and
the ports default to fixed values derived from ``--port-base``, so starting the
cluster again on the same directory finds every stream and record again, at
the same addresses. Ctrl-C or SIGTERM shuts the data nodes down gracefully
(each drains its connections and closes its storage), then the PM.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

DEFAULT_PORT_BASE = 7400
DEFAULT_NODES = 3
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
LISTENING_PREFIX = "listening on "


class ClusterError(Exception):
    """A child failed to start; the message says which and where its log is."""


@dataclass
class Child:
    """One server process of the cluster."""

    name: str
    argv: list[str]
    log_path: Path
    address: str = ""
    process: trio.Process | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


def _port(base: int, offset: int) -> int:
    """Fixed ports from a base; base 0 means any free port (for tests)."""
    return 0 if base == 0 else base + offset


def plan_children(
    data_dir: Path, nodes: int, host: str, port_base: int, sync: str, python: str
) -> tuple[Child, list[Child]]:
    """The PM and the data nodes, with their command lines (not started)."""
    logs = data_dir / "logs"
    pm = Child(
        "pm",
        [
            python,
            "-m",
            "pm",
            "--listen",
            f"{host}:{_port(port_base, 0)}",
            "--data-dir",
            str(data_dir / "pm"),
            "--metrics-listen",
            f"{host}:{_port(port_base, 100)}",
        ],
        logs / "pm.log",
    )
    data_nodes = [
        Child(
            f"node-{i}",
            [
                python,
                "-m",
                "datanode",
                "--listen",
                f"{host}:{_port(port_base, i)}",
                "--node-id",
                str(i),
                "--data-dir",
                str(data_dir / f"node-{i}"),
                "--metrics-listen",
                f"{host}:{_port(port_base, 100 + i)}",
                "--sync",
                sync,
            ],
            logs / f"node-{i}.log",
        )
        for i in range(1, nodes + 1)
    ]
    return pm, data_nodes


async def start_child(child: Child, nursery: trio.Nursery, extra_args: Sequence[str] = ()) -> None:
    """Start a child and wait for the line that gives its bound address.

    The child's stdout is read for ``listening on HOST:PORT``; everything it
    writes (stdout and stderr) also goes to its log file.
    """
    child.log_path.parent.mkdir(parents=True, exist_ok=True)
    log = child.log_path.open("ab", buffering=0)
    argv = [*child.argv, *extra_args]
    child.process = await trio.lowlevel.open_process(
        argv, stdout=subprocess.PIPE, stderr=log, start_new_session=True
    )
    assert child.process.stdout is not None
    ready = trio.Event()

    async def pump_output() -> None:
        assert child.process is not None and child.process.stdout is not None
        pending = b""
        async for chunk in child.process.stdout:
            log.write(chunk)
            if ready.is_set():
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line.decode("utf-8", "replace").strip()
                if text.startswith(LISTENING_PREFIX) and not ready.is_set():
                    child.address = text[len(LISTENING_PREFIX) :].split()[0]
                    ready.set()
        log.close()

    nursery.start_soon(pump_output)
    with trio.move_on_after(READY_TIMEOUT_S):
        while not ready.is_set():
            if child.process.returncode is not None:
                break
            with trio.move_on_after(0.1):
                await ready.wait()
    if not ready.is_set():
        code = child.process.poll()
        why = f"exited with status {code}" if code is not None else "did not report its address"
        raise ClusterError(f"{child.name} {why}; see {child.log_path}")


async def stop_child(child: Child) -> int | None:
    """SIGTERM, wait for a graceful exit, SIGKILL as a last resort."""
    process = child.process
    if process is None or process.returncode is not None:
        return None if process is None else process.returncode
    process.send_signal(signal.SIGTERM)
    with trio.move_on_after(STOP_TIMEOUT_S):
        return await process.wait()
    process.kill()
    return await process.wait()


async def wait_for_nodes(pm_address: str, expected: int, timeout: float) -> int:
    """Wait until the PM sees ``expected`` live data nodes; returns how many it saw."""
    from client.pm_client import PMClient

    alive = 0
    with trio.move_on_after(timeout):
        async with PMClient(pm_address) as pm:
            while True:
                try:
                    statuses = await pm.describe_cluster(timeout=2.0)
                    alive = sum(1 for status in statuses if status.alive)
                except Exception:  # the PM may still be starting up
                    alive = 0
                if alive >= expected:
                    return alive
                await trio.sleep(0.2)
    return alive


def _banner(pm: Child, data_nodes: list[Child], data_dir: Path) -> str:
    lines = [
        "",
        f"SBP local cluster is up (data under {data_dir}, logs in {data_dir / 'logs'}):",
        f"  PM          {pm.address}",
    ]
    lines += [f"  {node.name:<11} {node.address}" for node in data_nodes]
    lines += [
        "",
        "Try:",
        f"  sbp --pm {pm.address} cluster status",
        f"  sbp --pm {pm.address} streams create",
        f"  seq 1 1000 | sbp --pm {pm.address} append 1",
        f"  sbp --pm {pm.address} read 1 --from 0",
        "",
        "Ctrl-C stops the cluster.",
    ]
    return "\n".join(lines)


async def run_cluster(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    pm, data_nodes = plan_children(
        data_dir, args.nodes, args.host, args.port_base, args.sync, sys.executable
    )
    children = [pm, *data_nodes]
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            try:
                print(
                    f"starting PM and {len(data_nodes)} data nodes under {data_dir} …", flush=True
                )
                await start_child(pm, nursery)
                async with trio.open_nursery() as starting:
                    for node in data_nodes:
                        starting.start_soon(start_child, node, nursery, ("--pm", pm.address))
                alive = await wait_for_nodes(pm.address, len(data_nodes), READY_TIMEOUT_S)
                if alive < len(data_nodes):
                    raise ClusterError(
                        f"the PM sees {alive} of {len(data_nodes)} data nodes alive; "
                        f"see the logs in {data_dir / 'logs'}"
                    )
                print(_banner(pm, data_nodes, data_dir), flush=True)
                if args.ready_file:
                    Path(args.ready_file).write_text(pm.address + "\n")
                await _wait_for_stop(signals, children)
            except ClusterError as error:
                print(f"sbp-cluster: {error}", file=sys.stderr, flush=True)
                await _stop_all(pm, data_nodes)
                nursery.cancel_scope.cancel()
                return 1
            print("stopping the cluster …", flush=True)
            await _stop_all(pm, data_nodes)
            nursery.cancel_scope.cancel()
    failed = [c.name for c in children if c.process and c.process.returncode not in (0, None)]
    if failed:
        print(f"sbp-cluster: {', '.join(failed)} did not stop cleanly", file=sys.stderr)
        return 1
    print("cluster stopped", flush=True)
    return 0


async def _wait_for_stop(signals: AsyncIterator[int], children: list[Child]) -> None:
    """Until a signal arrives, or a child dies on its own (then stop all)."""
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return

        async def on_child_exit(child: Child) -> None:
            assert child.process is not None
            code = await child.process.wait()
            print(
                f"sbp-cluster: {child.name} exited with status {code}; see {child.log_path}",
                file=sys.stderr,
                flush=True,
            )
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        for child in children:
            nursery.start_soon(on_child_exit, child)


async def _stop_all(pm: Child, data_nodes: list[Child]) -> None:
    # Data nodes first, so they can still reach the PM while they drain.
    async with trio.open_nursery() as nursery:
        for node in data_nodes:
            nursery.start_soon(stop_child, node)
    await stop_child(pm)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1 or value > 64:
        raise argparse.ArgumentTypeError("must be between 1 and 64")
    return value


def _port_base(text: str) -> int:
    value = int(text)
    if value != 0 and not 1 <= value <= 65535 - 200:
        raise argparse.ArgumentTypeError("must be 0 (any free ports) or between 1 and 65335")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sbp-cluster",
        description=(
            "Run a local SBP cluster: one placement manager and N data nodes as child "
            "processes on loopback, all data under one directory. Starting it again on "
            "the same directory finds every stream and record again."
        ),
    )
    parser.add_argument(
        "--data-dir", default="./var", help="where all data and logs live (default: ./var)"
    )
    parser.add_argument(
        "--nodes", type=_positive, default=DEFAULT_NODES, help="number of data nodes (default: 3)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--port-base",
        type=_port_base,
        default=DEFAULT_PORT_BASE,
        help=(
            "PM on this port, data node i on port+i, metrics on port+100 (PM) and port+100+i; "
            f"0 picks free ports (default: {DEFAULT_PORT_BASE})"
        ),
    )
    parser.add_argument(
        "--sync",
        choices=("always", "never"),
        default="always",
        help="data node durability: sync every group commit (default) or never (benchmarks only)",
    )
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return trio.run(run_cluster, args)
    except KeyboardInterrupt:
        return 130
    except OSError as error:
        print(f"sbp-cluster: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
