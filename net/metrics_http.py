"""prometheus-client's /metrics endpoint on an address, for both servers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import start_http_server

from .address import format_address
from .service import ServiceError
from .tls import ServerSecurity

# -- /metrics -------------------------------------------------------------------------


class MetricsHTTPServer:
    """prometheus-client's HTTP exposition of ``registry`` on ``host:port``,
    served by a daemon thread (scrapes never touch the event loop)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        certfile: Path | None = None,
        keyfile: Path | None = None,
    ) -> None:
        # Binds here, so a busy port fails start-up with an OSError. With a
        # certificate it serves HTTPS only.
        self._server, self._thread = start_http_server(
            port,
            addr=host,
            registry=registry,
            certfile=str(certfile) if certfile else None,
            keyfile=str(keyfile) if keyfile else None,
        )
        bound = self._server.server_address
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    @classmethod
    @contextlib.contextmanager
    def running(
        cls,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        certfile: Path | None = None,
        keyfile: Path | None = None,
    ) -> Iterator[MetricsHTTPServer]:
        server = cls(registry, host, port, certfile=certfile, keyfile=keyfile)
        try:
            yield server
        finally:
            server.close()


@contextlib.contextmanager
def bound_metrics(
    address: tuple[str, int], registry: CollectorRegistry, security: ServerSecurity
) -> Iterator[MetricsHTTPServer]:
    """/metrics on ``address`` (HTTPS with the metrics certificate), for as
    long as the block runs; a port that cannot be bound is one line."""
    try:
        server = MetricsHTTPServer(
            registry, *address, certfile=security.metrics_cert, keyfile=security.metrics_key
        )
    except OSError as error:
        raise ServiceError(
            f"cannot serve metrics on {format_address(*address)}: {error.strerror or error}"
        ) from None
    try:
        yield server
    finally:
        server.close()
