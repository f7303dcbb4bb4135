"""TLS for SBP links: the settings a process is given (a CA, its own
certificate and key, as PEM files) and the ``ssl.SSLContext`` each end
builds from them. ``ConnectionPool`` dials with the client context and
``Server`` accepts with the server one; nothing else of the connection
changes (``Connection`` runs over any trio stream)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TLSSettings:
    """PEM files. ``ca`` verifies the peer (for a server: client certificates
    are then required, mutual TLS); ``cert`` and ``key`` are this end's."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def client_context(self) -> ssl.SSLContext:
        """For dialing: verify the server against ``ca`` (the system's CAs
        without one) and present ``cert`` when given."""
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(self.ca) if self.ca else None
        )
        if self.cert is not None:
            context.load_cert_chain(str(self.cert), str(self.key) if self.key else None)
        return context

    def server_context(self) -> ssl.SSLContext:
        """For accepting: present ``cert``; with ``ca``, require a client
        certificate it signed."""
        if self.cert is None:
            raise ValueError("a TLS server needs a certificate and its key")
        context = ssl.create_default_context(
            ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca) if self.ca else None
        )
        context.load_cert_chain(str(self.cert), str(self.key) if self.key else None)
        if self.ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
        return context
