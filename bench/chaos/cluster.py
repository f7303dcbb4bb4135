"""The cluster under test: a PM and data nodes as real processes, every link
through a ``LinkProxy`` the harness controls.

=====================  ===========================================================
proxy                  carries
=====================  ===========================================================
``clients->pm``        the workload's calls to the PM
``node-N->pm``         data node N's heartbeats, reports and lookups
``->node-N``           every call to data node N (clients, the PM, other nodes):
                       the node advertises this proxy's address as its own
=====================  ===========================================================

With ``tables``, ``sbp-tables`` runs too, reaching the PM through
``clients->pm`` and the nodes through their proxies. With ``object_store``,
SeaweedFS's ``weed mini`` runs too (``object-store``), and the PM and the
nodes reach it through ``->object-store``.

A restarted server gets a new port; its proxies are pointed at it, so the
addresses everyone else knows stay the same.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import trio

from client.children import Child, start_child, stop_child, wait_for_nodes
from client.object_store_child import object_store_args, plan_object_store, use_local_credentials
from tables.defaults import local_tables

from .proxy import LinkProxy

#: the PM declares a silent node dead after this long
NODE_TIMEOUT_MS = 3000
HEARTBEAT_INTERVAL_MS = 500
#: the LMDB map of every node but the small one
NODE_MAP_SIZE = "2GiB"
#: the node meant to fill up: a minute of the default workload fills it
SMALL_MAP_SIZE = "3MiB"
#: sbp-tables' session: a killed one's streams go to its successor this soon
TABLES_SESSION_MS = 3000


@dataclass
class Server:
    """One server process and the proxies in front of it."""

    child: Child
    #: the proxies whose target is this server
    ingress: list[LinkProxy] = field(default_factory=list)
    stopped: bool = False  # SIGSTOPped

    @property
    def name(self) -> str:
        return self.child.name

    @property
    def running(self) -> bool:
        return self.child.running


class ChaosCluster:
    """Start with ``await cluster.start(nursery)``; ``stop_all`` at the end."""

    def __init__(
        self,
        root: Path,
        nodes: int,
        *,
        small_map_node: str | None = None,
        node_args: tuple[str, ...] = (),
        pm_args: tuple[str, ...] = (),
        tables: bool = False,
        object_store: bool = False,
    ) -> None:
        self.root = root
        self.node_count = nodes
        self.small_map_node = small_map_node
        python = sys.executable
        logs = root / "logs"
        self.pm = Server(
            Child(
                "pm",
                [
                    python,
                    "-m",
                    "pm",
                    "--listen",
                    "127.0.0.1:0",
                    "--data-dir",
                    str(root / "pm"),
                    "--node-timeout-ms",
                    str(NODE_TIMEOUT_MS),
                    *pm_args,
                ],
                logs / "pm.log",
            )
        )
        self.nodes: dict[str, Server] = {}
        self.pm_links: dict[str, LinkProxy] = {}
        self.client_pm = LinkProxy("clients->pm", "")
        self.pm.ingress.append(self.client_pm)
        for i in range(1, nodes + 1):
            name = f"node-{i}"
            link = LinkProxy(f"{name}->pm", "")
            self.pm_links[name] = link
            self.pm.ingress.append(link)
            ingress = LinkProxy(f"->{name}", "")
            map_size = SMALL_MAP_SIZE if name == small_map_node else NODE_MAP_SIZE
            child = Child(
                name,
                [
                    python,
                    "-m",
                    "datanode",
                    "--listen",
                    "127.0.0.1:0",
                    "--node-id",
                    str(i),
                    "--data-dir",
                    str(root / name),
                    "--map-size",
                    map_size,
                    "--heartbeat-interval-ms",
                    str(HEARTBEAT_INTERVAL_MS),
                    *node_args,
                ],
                logs / f"{name}.log",
            )
            self.nodes[name] = Server(child, [ingress])
        #: sbp-tables (SPEC §16), reaching the PM as the clients do
        catalog, warehouse = local_tables(root)
        self.tables = (
            Server(
                Child(
                    "tables",
                    [
                        python,
                        "-m",
                        "tables",
                        *("--catalog", catalog),
                        *("--warehouse", warehouse),
                        *("--session-timeout-ms", str(TABLES_SESSION_MS)),
                    ],
                    logs / "tables.log",
                )
            )
            if tables
            else None
        )
        #: the object store (SPEC §14), reached through its proxy
        self.object_store: Server | None = None
        if object_store:
            use_local_credentials()
            store = plan_object_store(root, "127.0.0.1", 0, python, with_parent=False)
            self.object_store = Server(store, [LinkProxy("->object-store", "")])
        self._nursery: trio.Nursery | None = None

    # -- addresses ------------------------------------------------------------

    @property
    def pm_address(self) -> str:
        """Where the workload reaches the PM (through its proxy)."""
        return self.client_pm.address

    def node_address(self, name: str) -> str:
        return self.nodes[name].ingress[0].address

    @property
    def proxies(self) -> list[LinkProxy]:
        store = [self.object_store.ingress[0]] if self.object_store else []
        return [self.client_pm, *self.pm_links.values(), *store] + [
            server.ingress[0] for server in self.nodes.values()
        ]

    def servers(self) -> list[Server]:
        store = [self.object_store] if self.object_store else []
        return [*store, self.pm, *self.nodes.values(), *([self.tables] if self.tables else [])]

    def server(self, name: str) -> Server:
        if name == "pm":
            return self.pm
        if name == "tables" and self.tables is not None:
            return self.tables
        if name == "object-store" and self.object_store is not None:
            return self.object_store
        return self.nodes[name]

    def _store_args(self) -> tuple[str, ...]:
        if self.object_store is None:
            return ()
        proxy = self.object_store.ingress[0]
        return tuple(object_store_args(self.object_store.child, proxy.address))

    # -- lifetime -------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        for proxy in self.proxies:
            await nursery.start(proxy.run)
        if self.object_store is not None:
            await self._start(self.object_store)
        await self._start(self.pm)
        for server in self.nodes.values():
            await self._start(server)
        if await wait_for_nodes(self.pm_address, len(self.nodes), 30) < len(self.nodes):
            raise RuntimeError(f"the data nodes did not all join the PM; logs in {self.root}")
        if self.tables is not None:
            await self._start(self.tables)

    def _node_args(self, name: str) -> tuple[str, ...]:
        return (
            *("--pm", self.pm_links[name].address, "--advertise", self.node_address(name)),
            *self._store_args(),
        )

    async def _start(self, server: Server) -> None:
        assert self._nursery is not None
        if server is self.pm:
            extra: tuple[str, ...] = self._store_args()
        elif server is self.object_store:
            extra = ()
        elif server is self.tables:
            extra = ("--pm", self.pm_address)
        else:
            extra = self._node_args(server.name)
        await start_child(server.child, extra)
        for proxy in server.ingress:
            proxy.retarget(server.child.address)
        server.stopped = False

    async def kill(self, name: str) -> None:
        """SIGKILL (a stopped process too)."""
        server = self.server(name)
        process = server.child.process
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()
        server.stopped = False

    async def restart(self, name: str) -> None:
        await self._start(self.server(name))

    def pause(self, name: str) -> None:
        self._signal(name, signal.SIGSTOP)
        self.server(name).stopped = True

    def resume(self, name: str) -> None:
        self._signal(name, signal.SIGCONT)
        self.server(name).stopped = False

    def _signal(self, name: str, signum: int) -> None:
        process = self.server(name).child.process
        if process is not None and process.returncode is None:
            os.kill(process.pid, signum)

    async def heal_all(self) -> None:
        """Every proxy back to pass, every paused server resumed, every dead
        one restarted: the state the final check reads in."""
        for proxy in self.proxies:
            proxy.heal()
        for server in self.servers():
            if server.stopped:
                self.resume(server.name)
            if not server.running:
                await self.restart(server.name)

    async def stop_all(self) -> None:
        with trio.CancelScope(shield=True):
            for server in reversed(self.servers()):
                if server.stopped:
                    self.resume(server.name)
                await stop_child(server.child)

    def log_tracebacks(self) -> dict[str, int]:
        """How many tracebacks each server's log holds."""
        counts: dict[str, int] = {}
        for server in self.servers():
            try:
                text = server.child.log_path.read_text(errors="replace")
            except OSError:
                continue
            counts[server.name] = text.count("Traceback (most recent call last)")
        return counts
