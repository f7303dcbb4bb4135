"""The trio connection machinery shared by every SBP link: ``Connection`` (both
ends of a connection), the request ``Dispatcher`` and TCP ``Server``, and the
client ``ConnectionPool``."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sbp.observer import ConnectionObserver

    from .calls import Response
    from .connection import Connection
    from .limits import SERVER_LIMITS, ConnectionLimits
    from .pool import ConnectionPool
    from .request import Request, RequestHandler, Responder
    from .server import Dispatcher, Server

#: where each public name lives; imported on first use, so that what needs
#: only a small module of the package (``net.address``, the command line's
#: argument parsing) does not load trio and the connection machinery
_LOCATIONS = {
    "SERVER_LIMITS": ".limits",
    "Connection": ".connection",
    "ConnectionLimits": ".limits",
    "ConnectionObserver": "sbp.observer",
    "ConnectionPool": ".pool",
    "Dispatcher": ".server",
    "Request": ".request",
    "RequestHandler": ".request",
    "Responder": ".request",
    "Response": ".calls",
    "Server": ".server",
}


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'net' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)


__all__ = [
    "SERVER_LIMITS",
    "Connection",
    "ConnectionLimits",
    "ConnectionObserver",
    "ConnectionPool",
    "Dispatcher",
    "Request",
    "RequestHandler",
    "Responder",
    "Response",
    "Server",
]
