"""What the launcher does for ``sbp-cluster stop-node``, ``start-node``,
``add-node`` and ``list-nodes`` (``client.cluster_control`` carries the
requests): the running plan's data nodes, stopped, started or added."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

import trio

from sbp.errors import SBPError

from .children import READY_TIMEOUT_S, Child, ClusterError, start_child, wait_for_nodes
from .format import plural
from .pm_client import PMClient
from .supervisor import Supervisor


class NodeControl:
    """Answers the control requests of one running launcher: ``data_nodes``
    are its nodes (added to as nodes are), ``new_node(N)`` plans node N as
    the others were planned, up to node ``max_nodes``."""

    def __init__(
        self,
        data_nodes: list[Child],
        pm_addresses: str,
        supervisor: Supervisor,
        new_node: Callable[[int], Child],
        max_nodes: int,
        tls: ssl.SSLContext | None,
    ) -> None:
        self._nodes = data_nodes
        self._pm_addresses = pm_addresses
        self._supervisor = supervisor
        self._new_node = new_node
        self._max_nodes = max_nodes
        self._tls = tls

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        action = request.get("action")
        try:
            if action == "list-nodes":
                return {"ok": True, "lines": self._listing()}
            if action == "add-node":
                return await self._add()
            node = self._node(request.get("node"))
            if action == "stop-node":
                if self._supervisor.held(node) or not node.running:
                    return _fail(f"{node.name} is stopped already")
                held = await self._ranges_held(node)
                if held and not request.get("force"):
                    node_id = node.name.removeprefix("node-")
                    return _fail(
                        f"{node.name} holds {plural(held, 'range')}: stopping it leaves them "
                        "short of a "
                        f"replica, or unreadable; drain it first (sbp nodes drain {node_id} "
                        "--wait), or stop it anyway with --force"
                    )
                await self._supervisor.hold(node)
                return _done(f"{node.name} stopped; `sbp-cluster start-node` starts it again")
            if action == "start-node":
                if not self._supervisor.held(node):
                    return _fail(f"{node.name} was not stopped with stop-node")
                await self._supervisor.release(node)
                return _done(f"{node.name} is back on {node.address}")
        except ClusterError as error:
            return _fail(str(error))
        return _fail(f"unknown action {action!r}")

    async def _ranges_held(self, node: Child) -> int:
        """The ranges the PM places on the node (0 when it cannot say)."""
        node_id = int(node.name.removeprefix("node-"))
        try:
            async with PMClient(self._pm_addresses, tls=self._tls) as pm:
                statuses = await pm.describe_cluster(timeout=5.0)
        except (SBPError, OSError, trio.TooSlowError):
            return 0
        return sum(s.range_count for s in statuses if s.data_node.node_id == node_id)

    def _node(self, node_id: object) -> Child:
        for child in self._nodes:
            if child.name == f"node-{node_id}":
                return child
        known = ", ".join(c.name.removeprefix("node-") for c in self._nodes)
        raise ClusterError(f"the cluster has no data node {node_id} (it has {known})")

    def _listing(self) -> list[str]:
        lines = []
        for child in self._nodes:
            state = "stopped" if self._supervisor.held(child) else "running"
            if state == "running" and not child.running:
                state = "restarting"
            lines.append(f"{child.name:<8} {child.address:<22} {state}")
        return lines

    async def _add(self) -> dict[str, Any]:
        nodes = self._nodes
        node_id = max(int(c.name.removeprefix("node-")) for c in nodes) + 1
        if node_id > self._max_nodes:
            return _fail(f"a local cluster has at most {self._max_nodes} data nodes")
        child = self._new_node(node_id)
        await start_child(child, nodes[0].extra_args)
        nodes.append(child)
        self._supervisor.add(child)
        alive = await wait_for_nodes(self._pm_addresses, len(nodes), READY_TIMEOUT_S, self._tls)
        if alive < len(nodes):
            return _fail(f"{child.name} started on {child.address}; the PM does not see it alive")
        return _done(f"{child.name} is up on {child.address}")


def _done(message: str) -> dict[str, Any]:
    return {"ok": True, "message": message}


def _fail(message: str) -> dict[str, Any]:
    return {"ok": False, "message": message}
