"""Per-connection limits and timers, and the defaults of each end."""

from __future__ import annotations

from dataclasses import dataclass

from sbp.constants import DEFAULT_MAX_FRAME_LENGTH

#: servers ping a silent peer after this long, so a dead one frees its slot
KEEPALIVE_INTERVAL_S = 30.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Per-connection limits and timers (seconds)."""

    #: largest frame_length accepted; a larger one ends the connection
    max_frame_length: int = DEFAULT_MAX_FRAME_LENGTH
    #: requests served at once; at the limit the reader stops reading
    max_concurrent_requests: int = 256
    #: close after this long with no traffic and nothing in flight (None: never)
    idle_timeout: float | None = None
    #: PING the peer after this long without receiving anything (None: never)
    keepalive_interval: float | None = None
    #: how long a keepalive PING may go unanswered before the peer is dead
    keepalive_timeout: float = 10.0
    #: how long a graceful close waits for requests in flight
    drain_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")


#: clients send no keepalive: their calls find a dead connection soon enough
CLIENT_LIMITS = ConnectionLimits()
#: servers ping idle peers so that a dead one does not hold its slot forever
SERVER_LIMITS = ConnectionLimits(keepalive_interval=KEEPALIVE_INTERVAL_S)
