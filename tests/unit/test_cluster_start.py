"""Starting a local cluster's children together (client.launcher)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from client.children import Child, ClusterError
from client.launcher import _start_together


async def test_every_member_whose_port_is_taken_is_named_in_order(tmp_path: Path) -> None:
    """Two etcd members find their ports taken in the same instant: the
    error names both, first member first, whichever failed first."""
    with socket.socket() as first, socket.socket() as second:
        for holder in (first, second):
            holder.bind(("127.0.0.1", 0))
            holder.listen()
        ports = [first.getsockname()[1], second.getsockname()[1]]
        for _ in range(10):  # trio runs the starting tasks in either order
            children = [
                Child(
                    f"etcd-{n}",
                    ["true"],
                    tmp_path / f"etcd-{n}.log",
                    address=f"127.0.0.1:{port}",
                    announces=False,
                    ports=(port,),
                )
                for n, port in enumerate(ports, start=1)
            ]
            with pytest.raises(ClusterError) as failed:
                await _start_together(children)
            message = str(failed.value)
            assert message.startswith(f"etcd-1 cannot listen on 127.0.0.1 port {ports[0]}: in use")
            assert f"; etcd-2 cannot listen on 127.0.0.1 port {ports[1]}: in use" in message
            assert all(child.process is None for child in children)
