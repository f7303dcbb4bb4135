"""``sbp-cluster``: a local cluster — one PM and N data nodes as child processes
on loopback, with all data under one directory.

The layout under ``--data-dir`` is fixed (``pm/``, ``node-1/`` …, ``logs/``) and
the ports default to fixed values derived from ``--port-base``, so starting the
cluster again on the same directory finds every stream and record again, at
the same addresses. Ctrl-C or SIGTERM shuts the data nodes down gracefully
(each drains its connections and closes its storage), then the PM.

A child that dies on its own is started again after a backoff (1 s, doubling
to 30 s, back to 1 s once it has run for a minute), so the cluster keeps
serving while a node is down, as a failover test needs; ``--no-restart``
stops the whole cluster instead (``client.supervisor``). From another shell,
``sbp-cluster stop-node N``, ``start-node N``, ``add-node`` and
``list-nodes`` change the running cluster (``client.cluster_control``); the
launcher runs every ``node-N`` directory it finds, so an added node is run
again next time. The launcher holds a lock on the data
directory, so a second launcher there is refused with one line naming the
first one's pid, and it never leaves a child behind: every way out stops
them, and a child drains and exits by itself within a second of the
launcher's death, even by SIGKILL (``SBP_EXIT_WITH_PARENT``).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import ssl
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from net.address import free_ports
from net.dirlock import locked_dir
from net.service import ServiceError
from net.tls import TLSSettings
from tables.defaults import local_tables

from . import cluster_control
from .children import READY_TIMEOUT_S, Child, ClusterError, start_child, stop_child, wait_for_nodes
from .cluster_control import serve_control
from .node_control import NodeControl
from .object_store_child import (
    BUCKET,
    object_store_args,
    plan_object_store,
    use_local_credentials,
)
from .pki import LocalCA, local_cluster_pki
from .supervisor import Supervisor

DEFAULT_PORT_BASE = 7400
#: the port base when --port-base is not given (``make run PORT_BASE=9000``)
PORT_BASE_ENV = "SBP_PORT_BASE"
DEFAULT_NODES = 3
#: node ids a local cluster may have (their ports are port base + 1 … + 64)
MAX_NODES = 64
LOCK_FILE = "cluster.lock"


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
        plan_node(data_dir, i, host, port_base, sync, python) for i in range(1, nodes + 1)
    ]
    return pm, data_nodes


def plan_node(
    data_dir: Path, node_id: int, host: str, port_base: int, sync: str, python: str
) -> Child:
    """Data node ``node_id``: its port and metrics port from the base, its
    data in ``node-N``."""
    return Child(
        f"node-{node_id}",
        [
            python,
            "-m",
            "datanode",
            "--listen",
            f"{host}:{_port(port_base, node_id)}",
            "--node-id",
            str(node_id),
            "--data-dir",
            str(data_dir / f"node-{node_id}"),
            "--metrics-listen",
            f"{host}:{_port(port_base, 100 + node_id)}",
            "--sync",
            sync,
        ],
        data_dir / "logs" / f"node-{node_id}.log",
    )


def _another_node(
    plan: Plan, data_dir: Path, planned: tuple[int, str, int, str, str], node_id: int
) -> Child:
    """Node ``node_id`` planned as the plan's nodes were, with the TLS and
    ACL settings they were given (``secure_children``)."""
    _, host, port_base, sync, python = planned
    child = plan_node(data_dir, node_id, host, port_base, sync, python)
    plain = plan_node(data_dir, 1, host, port_base, sync, python)
    child.argv += plan.data_nodes[0].argv[len(plain.argv) :]
    return child


def nodes_to_run(data_dir: Path, asked: int) -> int:
    """``--nodes``, or more when the directory holds more (a node added with
    ``sbp-cluster add-node`` is run again)."""
    found = [
        int(p.name.removeprefix("node-"))
        for p in data_dir.glob("node-*")
        if p.is_dir() and p.name.removeprefix("node-").isdigit()
    ]
    return max([asked, *found])


@dataclass
class Plan:
    """The children of a local cluster: etcd members (``--ha``), PMs, data
    nodes, ``sbp-tables`` (SPEC §16) and the object store (SPEC §14)."""

    etcd: list[Child]
    pms: list[Child]
    data_nodes: list[Child]
    tables: list[Child] = field(default_factory=list)
    #: ``weed mini`` (``--object-store``, SPEC §14)
    object_store: list[Child] = field(default_factory=list)

    @property
    def pm_addresses(self) -> str:
        return ",".join(pm.address for pm in self.pms)

    @property
    def children(self) -> list[Child]:
        return [*self.object_store, *self.etcd, *self.pms, *self.data_nodes, *self.tables]


#: sbp-tables' /metrics, from --port-base
TABLES_METRICS_PORT = 98


def plan_tables(data_dir: Path, host: str, port_base: int, python: str) -> Child:
    """``sbp-tables`` with a SQL catalog and a warehouse under ``tables/``."""
    catalog, warehouse = local_tables(data_dir)
    return Child(
        "tables",
        [
            *(python, "-m", "tables"),
            *("--catalog", catalog),
            *("--warehouse", warehouse),
            *("--metrics-listen", f"{host}:{_port(port_base, TABLES_METRICS_PORT)}"),
        ],
        data_dir / "logs" / "tables.log",
    )


def tables_available() -> bool:
    """Whether sbp-tables can run here (the ``tables`` extra is installed)."""
    try:
        import pyiceberg  # noqa: F401
    except ImportError:
        return False
    return True


#: --ha: etcd members and PMs, and their port offsets from --port-base
HA_MEMBERS = 3
HA_PM_PORTS = (0, 90, 91)
HA_ETCD_CLIENT_PORTS = (80, 81, 82)
HA_ETCD_PEER_PORTS = (85, 86, 87)


def plan_ha(
    data_dir: Path,
    nodes: int,
    host: str,
    port_base: int,
    sync: str,
    python: str,
    *,
    scheme: str = "http",
) -> Plan:
    """Three etcd members, three PMs on them and the data nodes (``--ha``);
    ``scheme`` https for etcd with TLS (``secure_children`` gives it the
    certificates)."""
    _, data_nodes = plan_children(data_dir, nodes, host, port_base, sync, python)
    logs = data_dir / "logs"
    if port_base:
        clients = [port_base + offset for offset in HA_ETCD_CLIENT_PORTS]
        peers = [port_base + offset for offset in HA_ETCD_PEER_PORTS]
    else:  # etcd cannot take port 0
        ports = free_ports(len(HA_ETCD_CLIENT_PORTS) + len(HA_ETCD_PEER_PORTS), host)
        clients, peers = ports[: len(HA_ETCD_CLIENT_PORTS)], ports[len(HA_ETCD_CLIENT_PORTS) :]
    names = [f"etcd-{i}" for i in range(1, HA_MEMBERS + 1)]
    initial = ",".join(
        f"{name}={scheme}://{host}:{peer}" for name, peer in zip(names, peers, strict=True)
    )
    members = [
        Child(
            name,
            [
                # etcd cannot watch the launcher itself: it must not outlive it
                *(python, "-m", "client.with_parent", "etcd"),
                *("--name", name, "--data-dir", str(data_dir / name)),
                *("--listen-client-urls", f"{scheme}://{host}:{client}"),
                *("--advertise-client-urls", f"{scheme}://{host}:{client}"),
                *("--listen-peer-urls", f"{scheme}://{host}:{peer}"),
                *("--initial-advertise-peer-urls", f"{scheme}://{host}:{peer}"),
                *("--initial-cluster", initial, "--initial-cluster-state", "new"),
                *("--initial-cluster-token", f"sbp-{data_dir.name}"),
            ],
            logs / f"{name}.log",
            address=f"{host}:{client}",
            announces=False,
            ports=(client, peer),
        )
        for name, client, peer in zip(names, clients, peers, strict=True)
    ]
    endpoints = ",".join(f"{scheme}://{m.address}" for m in members)
    pms = [
        Child(
            f"pm-{i}",
            [
                python,
                *("-m", "pm", "--listen", f"{host}:{_port(port_base, offset)}"),
                *("--etcd", endpoints),
                *("--metrics-listen", f"{host}:{_port(port_base, 100 + offset)}"),
            ],
            logs / f"pm-{i}.log",
        )
        for i, offset in enumerate(HA_PM_PORTS, start=1)
    ]
    return Plan(members, pms, data_nodes)


def secure_children(plan: Plan, pki: Path, acl_file: Path | None) -> ssl.SSLContext:
    """Mutual TLS for every child (``--tls``): the local CA and certificates
    under ``pki`` (made once, kept), the PM's and the data nodes' names
    being their roles (SPEC §9), and etcd's members (``--ha``: clients and
    peers alike must present a certificate of the CA; the PMs present
    theirs); returns the launcher's own client context."""
    ca, issued = local_cluster_pki(pki)
    pms, data_nodes = plan.pms, plan.data_nodes
    for child, role in (*((pm, "pm") for pm in pms), *((node, "datanode") for node in data_nodes)):
        own = issued[role]
        child.argv += ["--tls-cert", str(own.cert), "--tls-key", str(own.key), "--tls-ca", str(ca)]
        if acl_file is not None:
            child.argv += ["--acl-file", str(acl_file)]
    if plan.etcd:
        etcd = LocalCA(pki).issue("etcd")
        for member in plan.etcd:
            member.argv += [
                *("--cert-file", str(etcd.cert), "--key-file", str(etcd.key)),
                *("--trusted-ca-file", str(ca), "--client-cert-auth"),
                *("--peer-cert-file", str(etcd.cert), "--peer-key-file", str(etcd.key)),
                *("--peer-trusted-ca-file", str(ca), "--peer-client-cert-auth"),
            ]
        own = issued["pm"]
        for pm in pms:
            pm.argv += ["--etcd-ca", str(ca), "--etcd-cert", str(own.cert)]
            pm.argv += ["--etcd-key", str(own.key)]
    # The launcher is the cluster's own tooling: it asks the PM as the PM would.
    return TLSSettings(ca=ca, cert=issued["pm"].cert, key=issued["pm"].key).client_context()


def _banner(plan: Plan, data_dir: Path, tls: bool) -> str:
    lines = [
        "",
        f"SBP local cluster is up (data under {data_dir}, logs in {data_dir / 'logs'}):",
    ]
    scheme = "https" if tls else "http"
    lines += [f"  {member.name:<11} {scheme}://{member.address}" for member in plan.etcd]
    if len(plan.pms) == 1:
        lines.append(f"  PM          {plan.pms[0].address}")
    else:
        lines += [f"  {pm.name:<11} {pm.address}" for pm in plan.pms]
    lines += [f"  {node.name:<11} {node.address}" for node in plan.data_nodes]
    for store in plan.object_store:
        lines.append(
            f"  object store http://{store.address} (S3, SeaweedFS), bucket {BUCKET}: "
            "streams with --local-retention"
        )
    if plan.tables:
        catalog, warehouse = local_tables(data_dir)
        lines.append(
            f"  sbp-tables  catalog {catalog}, warehouse {warehouse} "
            "(streams with --table-interval)"
        )
    pm_arg = plan.pm_addresses
    if tls:
        pki = data_dir / "pki"
        lines += [
            "",
            f"Mutual TLS: CA and certificates in {pki}. `sbp` run from {data_dir.parent}",
            "finds them there; from elsewhere:",
            f"  export SBP_TLS_CA={pki / 'ca.pem'} SBP_TLS_CERT={pki / 'client.pem'} "
            f"SBP_TLS_KEY={pki / 'client.key'}",
        ]
    lines += [
        "",
        "Try:",
        f"  sbp --pm {pm_arg} cluster status",
        f"  sbp --pm {pm_arg} streams create",
        f"  seq 1 1000 | sbp --pm {pm_arg} append 1",
        f"  sbp --pm {pm_arg} read 1 --from 0",
        "",
        "Ctrl-C stops the cluster.",
    ]
    return "\n".join(lines)


async def run_cluster(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()
    try:
        with locked_dir(data_dir, LOCK_FILE, "sbp-cluster"):
            return await _run_locked(args, data_dir)
    except ServiceError as error:
        print(f"sbp-cluster: {error}", file=sys.stderr, flush=True)
        return 1


async def _run_locked(args: argparse.Namespace, data_dir: Path) -> int:
    node_count = nodes_to_run(data_dir, args.nodes)
    planned = (node_count, args.host, args.port_base, args.sync, sys.executable)
    if args.ha:
        if shutil.which("etcd") is None:
            print(
                "sbp-cluster: --ha needs etcd (Debian's etcd-server: "
                "scripts/install-system-deps.sh installs it)",
                file=sys.stderr,
            )
            return 2
        plan = plan_ha(data_dir, *planned, scheme="https" if args.tls else "http")
    else:
        pm, nodes = plan_children(data_dir, *planned)
        plan = Plan([], [pm], nodes)
    mixed = _mode_conflict(data_dir, ha=args.ha)
    if mixed:
        print(f"sbp-cluster: {mixed}", file=sys.stderr)
        return 2
    pki = data_dir / "pki"
    if not args.tls and (pki / "ca.pem").exists():
        # `sbp` would speak TLS to it (it finds var/pki): a directory's
        # cluster is run one way.
        print(
            f"sbp-cluster: the cluster in {data_dir} was run with --tls: run it with --tls "
            f"again, or remove {pki} to run it without",
            file=sys.stderr,
        )
        return 2
    if args.tls and plan.etcd and any(data_dir.glob("etcd-*")) and not (pki / "ca.pem").exists():
        # etcd keeps its members' http:// peer addresses
        print(
            f"sbp-cluster: the cluster in {data_dir} was made without --tls: run it without",
            file=sys.stderr,
        )
        return 2
    if args.object_store:
        try:
            add_object_store(plan, data_dir, args.host, args.port_base)
        except FileNotFoundError as error:
            print(f"sbp-cluster: {error}", file=sys.stderr)
            return 2
    tls = secure_children(plan, pki, args.acl_file) if args.tls else None
    if not args.no_tables and tls is None and tables_available():
        plan.tables = [plan_tables(data_dir, args.host, args.port_base, sys.executable)]
    children = plan.children
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            try:
                with trio.CancelScope() as running:
                    nursery.start_soon(_cancel_on_signal, signals, running)
                    what = f"{len(plan.pms)} PMs on {len(plan.etcd)} etcd members"
                    what = what if plan.etcd else "PM"
                    print(
                        f"starting {what} and {len(plan.data_nodes)} data nodes under {data_dir} …",
                        flush=True,
                    )
                    await start_plan(plan, data_dir, tls)
                    print(_banner(plan, data_dir, tls is not None), flush=True)
                    supervisor = Supervisor(children, restart=not args.no_restart)
                    control = NodeControl(
                        plan.data_nodes,
                        plan.pm_addresses,
                        supervisor,
                        functools.partial(_another_node, plan, data_dir, planned),
                        MAX_NODES,
                        tls,
                    )
                    await nursery.start(serve_control, data_dir, control.handle)
                    if args.ready_file:
                        Path(args.ready_file).write_text(plan.pm_addresses + "\n")
                    await supervisor.run()
            except ClusterError as error:
                print(f"sbp-cluster: {error}", file=sys.stderr, flush=True)
                if "in use" in str(error):
                    print(
                        "sbp-cluster: another cluster runs on these ports? Run this one on "
                        f"others: --port-base 9000 (or {PORT_BASE_ENV}=9000, make run "
                        "PORT_BASE=9000)",
                        file=sys.stderr,
                        flush=True,
                    )
                return 1
            finally:
                # Every way out stops the children, an unexpected error too.
                with trio.CancelScope(shield=True):
                    print("stopping the cluster …", flush=True)
                    await stop_plan(plan)
                nursery.cancel_scope.cancel()
    # etcd ends on SIGTERM by the signal itself: a clean stop too
    clean = {0, None, -signal.SIGTERM}
    failed = [c.name for c in children if c.process and c.process.returncode not in clean]
    if failed:
        print(f"sbp-cluster: {', '.join(failed)} did not stop cleanly", file=sys.stderr)
        return 1
    print("cluster stopped", flush=True)
    return 0


def _mode_conflict(data_dir: Path, *, ha: bool) -> str:
    """Why the directory cannot be run in this mode ("" if it can): one PM
    keeps its metadata in ``pm/`` (LMDB), PMs on etcd in ``etcd-N/``, and
    the data nodes' ranges are placed by one or the other. Run the other
    way, a PM with none of that metadata would hand out the stream ids the
    nodes already hold, and the nodes would refuse the PM of the older
    term."""
    one_pm = (data_dir / "pm").is_dir()
    on_etcd = any(data_dir.glob("etcd-*"))
    if one_pm and on_etcd:
        return (
            f"{data_dir} holds the metadata of both one PM ({data_dir / 'pm'}) and PMs on "
            "etcd (etcd-*): it was run both ways; keep the one that placed the data and "
            "move the other away"
        )
    if ha and one_pm:
        return (
            f"the cluster in {data_dir} was made with one PM (its metadata in LMDB under "
            f"{data_dir / 'pm'}): run it without --ha, or move that metadata into etcd with "
            "`sbp-pm migrate --from-data-dir DIR/pm --etcd URLS` first (docs/pm.md)"
        )
    if not ha and on_etcd:
        return (
            f"the cluster in {data_dir} was made with --ha (its metadata in etcd under "
            f"{data_dir}/etcd-*): run it with --ha again"
        )
    return ""


async def _cancel_on_signal(signals: AsyncIterator[int], scope: trio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return


def add_object_store(plan: Plan, data_dir: Path, host: str, port_base: int) -> None:
    """``weed mini`` for the plan, and the PMs and data nodes pointed at it."""
    use_local_credentials()
    store = plan_object_store(data_dir, host, port_base, sys.executable)
    plan.object_store = [store]
    for child in [*plan.pms, *plan.data_nodes]:
        child.argv += object_store_args(store)


async def start_plan(plan: Plan, data_dir: Path, tls: ssl.SSLContext | None) -> None:
    """Start the object store and etcd, the PMs, then the data nodes, and
    wait until the PM sees every data node alive."""
    data_nodes = plan.data_nodes
    await _start_together(plan.object_store)
    await _start_together(plan.etcd)
    await _start_together(plan.pms)
    await _start_together(data_nodes, ("--pm", plan.pm_addresses))
    alive = await wait_for_nodes(plan.pm_addresses, len(data_nodes), READY_TIMEOUT_S, tls)
    if alive < len(data_nodes):
        raise ClusterError(
            f"the PM sees {alive} of {len(data_nodes)} data nodes alive; "
            f"see the logs in {data_dir / 'logs'}"
        )
    await _start_together(plan.tables, ("--pm", plan.pm_addresses))


@asynccontextmanager
async def running_plan(
    plan: Plan, data_dir: Path, tls: ssl.SSLContext | None = None
) -> AsyncIterator[Plan]:
    """The plan's cluster, started and ready inside the block and stopped
    (gracefully) however the block ends: what the benchmarks run on."""
    try:
        await start_plan(plan, data_dir, tls)
        yield plan
    finally:
        with trio.CancelScope(shield=True):
            await stop_plan(plan)


async def _start_together(children: list[Child], extra_args: tuple[str, ...] = ()) -> None:
    """Start the children at once. The first failure stops the others; the
    error names every child that failed by then, in the children's order
    (several etcd members may find a port taken in the same instant)."""
    failures: dict[int, ClusterError] = {}

    async def start(index: int, child: Child) -> None:
        try:
            await start_child(child, extra_args)
        except ClusterError as error:
            failures[index] = error
            raise

    try:
        async with trio.open_nursery() as starting:
            for index, child in enumerate(children):
                starting.start_soon(start, index, child)
    except BaseExceptionGroup:
        if not failures:
            raise
        raise ClusterError("; ".join(str(failures[i]) for i in sorted(failures))) from None


async def stop_plan(plan: Plan) -> None:
    # sbp-tables first (its last commits and its leaving the group need the
    # cluster), then the data nodes, so they can still reach the PM while
    # they drain; etcd last.
    for group in (plan.tables, plan.data_nodes, plan.pms):
        async with trio.open_nursery() as nursery:
            for child in group:
                nursery.start_soon(stop_child, child)
    # etcd members one after another: a leader stopped together with its
    # followers hands its leadership to one that is stopping too, and waits
    # for that to time out (7 s) before it exits.
    for member in plan.etcd:
        await stop_child(member)
    for store in plan.object_store:
        await stop_child(store)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1 or value > MAX_NODES:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_NODES}")
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
            "the same directory finds every stream and record again. From another shell, "
            "`sbp-cluster stop-node N`, `start-node N`, `add-node` and `list-nodes` change "
            "the running cluster (`sbp-cluster stop-node --help`)."
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
        default=None,
        help=(
            "PM on this port, data node i on port+i, metrics on port+100 (PM) and port+100+i; "
            f"0 picks free ports (default: ${PORT_BASE_ENV}, else {DEFAULT_PORT_BASE})"
        ),
    )
    parser.add_argument(
        "--sync",
        choices=("always", "never"),
        default="always",
        help="data node durability: sync every group commit (default) or never (benchmarks only)",
    )
    parser.add_argument(
        "--no-restart",
        action="store_true",
        help="stop the whole cluster when one server dies (default: start it again)",
    )
    parser.add_argument(
        "--ha",
        action="store_true",
        help="three etcd members and three PMs on them instead of one PM (SPEC §8): PMs on "
        "port-base, +90 and +91, etcd clients on +80..+82; the data nodes and `sbp` follow the "
        "leader",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS everywhere: a local CA and certificates are made under "
        "DATA_DIR/pki (kept for the next run), where `sbp` finds them",
    )
    parser.add_argument(
        "--acl-file",
        type=Path,
        metavar="FILE",
        help="authorize requests by this ACL file on the PM and every data node (needs --tls; "
        "`sbp` presents the principal 'client'); see docs/security.md",
    )
    parser.add_argument(
        "--no-tables",
        action="store_true",
        help="do not run sbp-tables, which keeps the streams with a table_interval_ms as "
        "Iceberg tables under DATA_DIR/tables (docs/tables.md; not run with --tls)",
    )
    parser.add_argument(
        "--object-store",
        action="store_true",
        help="run an S3 object store (SeaweedFS's `weed mini`, data under "
        "DATA_DIR/object-store, S3 on port-base+170) and keep tiered streams' sealed ranges "
        "there (SPEC §14; docs/operations.md#tiered-storage)",
    )
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if any(word in cluster_control.COMMANDS for word in given):
        return cluster_control.main(given)
    parser = build_parser()
    args = parser.parse_args(given)
    if args.port_base is None:
        try:
            args.port_base = _port_base(os.environ.get(PORT_BASE_ENV) or str(DEFAULT_PORT_BASE))
        except (ValueError, argparse.ArgumentTypeError) as error:
            parser.error(f"${PORT_BASE_ENV}: {error or 'not a port'}")
    if args.acl_file is not None:
        if not args.tls:
            parser.error("--acl-file needs --tls (principals come from client certificates)")
        args.acl_file = args.acl_file.resolve()
    try:
        return trio.run(run_cluster, args)
    except KeyboardInterrupt:
        return 130
    except OSError as error:
        print(f"sbp-cluster: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
