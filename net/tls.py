"""TLS for SBP links: the settings a process is given (a CA, its own
certificate and key, as PEM files) and the ``ssl.SSLContext`` each end
builds from them. ``ConnectionPool`` dials with the client context and
``Server`` accepts with the server one; nothing else of the connection
changes (``Connection`` runs over any trio stream)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from .acl import load_acl


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


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """A server's security settings (``net.settings.security_options``)."""

    #: the SBP listener's TLS, and the links this server opens
    tls: TLSSettings | None = None
    acl_file: Path | None = None
    #: HTTPS for /metrics
    metrics_cert: Path | None = None
    metrics_key: Path | None = None

    def server_context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.server_context()

    def client_context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.client_context()

    def check(self) -> None:
        """Read every file once: raises ``OSError``, ``ssl.SSLError`` or
        ``ValueError`` (an unusable ACL file) naming the problem."""
        if self.tls is not None:
            for path in (self.tls.cert, self.tls.key, self.tls.ca):
                if path is not None and not path.is_file():
                    raise ValueError(f"TLS file {path} does not exist")
            try:
                self.tls.server_context()
                self.tls.client_context()
            except ssl.SSLError as error:
                raise ValueError(f"the TLS files cannot be used: {error}") from None
        if self.metrics_cert is not None:
            try:
                metrics = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                metrics.load_cert_chain(str(self.metrics_cert), str(self.metrics_key))
            except (OSError, ssl.SSLError) as error:
                raise ValueError(f"the metrics TLS files cannot be used: {error}") from None
        if self.acl_file is not None:
            load_acl(self.acl_file)


def describe_link_error(error: BaseException) -> str:
    """One line for a failed send, receive or handshake. trio raises
    ``BrokenResourceError`` with an empty message and the ``ssl`` error as
    its cause: the cause says what happened (``CERTIFICATE_VERIFY_FAILED``,
    a certificate the peer required, plain text on a TLS port …)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"TLS: the peer's certificate was refused: {seen.verify_message}"
        if isinstance(seen, ssl.SSLError):
            return f"TLS: {seen.reason or seen}"
        if str(seen):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return type(error).__name__
