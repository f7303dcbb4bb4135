"""``HOST:PORT`` addresses, the one parser every flag, option and client uses."""

from __future__ import annotations


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
