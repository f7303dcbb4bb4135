"""``HOST:PORT`` addresses, the one parser every flag, option and client uses."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) as ``(host, port)``; port 0
    means any free port."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} is outside 0-65535")
    return host, port


def parse_address_list(text: str) -> tuple[tuple[str, int], ...]:
    """``HOST:PORT[,HOST:PORT...]``: several PMs on etcd (SPEC §8), in order."""
    addresses = tuple(parse_address(part.strip()) for part in text.split(",") if part.strip())
    if not addresses:
        raise ValueError("no address given")
    return addresses


def format_address(host: str, port: int) -> str:
    """The inverse of ``parse_address``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_name(stream: object) -> str:
    """``host:port`` of a socket stream's peer, else the stream's type name."""
    socket = getattr(stream, "socket", None)
    if socket is not None:
        try:
            host, port = socket.getpeername()[:2]
        except OSError:
            return "unknown peer"
        return f"{host}:{port}"
    return type(stream).__name__


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` now, for a server that cannot
    be told port 0 (etcd, Prometheus), picked below the kernel's ephemeral
    range: a port probed with bind(0) and released is the kernel's to give
    again, to the next server told port 0 or the next outgoing connection,
    before the server it was meant for binds it. Outside that range only
    another caller of this function could pick the same port."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(max(1024, low - 16384), low)
        if port not in ports and port_free(host, port):
            ports.append(port)
    return ports


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (nothing listens
    there; a connection of the past in TIME_WAIT does not count, as servers
    set SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to bind(0) and connect."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
