"""prometheus-client's /metrics endpoint on an address, for both servers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import start_http_server

# -- /metrics -------------------------------------------------------------------------


class MetricsHTTPServer:
    """prometheus-client's HTTP exposition of ``registry`` on ``host:port``,
    served by a daemon thread (scrapes never touch the event loop)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        # Binds here, so a busy port fails start-up with an OSError.
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        bound = self._server.server_address
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    @classmethod
    @contextlib.contextmanager
    def running(
        cls, registry: CollectorRegistry, host: str, port: int
    ) -> Iterator[MetricsHTTPServer]:
        server = cls(registry, host, port)
        try:
            yield server
        finally:
            server.close()
