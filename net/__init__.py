"""The trio connection machinery shared by every SBP link: ``Connection`` (both
ends of a connection), the request ``Dispatcher`` and TCP ``Server``, and the
client ``ConnectionPool``."""

from sbp.observer import ConnectionObserver

from .calls import Response
from .connection import Connection
from .limits import SERVER_LIMITS, ConnectionLimits
from .pool import ConnectionPool
from .request import Request, RequestHandler, Responder
from .server import Dispatcher, Server

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
