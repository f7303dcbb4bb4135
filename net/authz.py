"""Who is asking, and whether they may (SPEC §9), for both servers.

- ``principal_of``: a connection's principal, from its peer's certificate
  (subject common name, else its first DNS name); ``ANONYMOUS`` without one.
- ``AccessControl``: the server's ACL (``net.acl``), reloaded on SIGHUP (a
  bad file is refused whole, one log line, the previous entries stay), and
  the checks handlers make. Without an ACL file everything is allowed.

The cluster's own processes present certificates named ``datanode`` and
``pm``: only they may send the cluster-internal requests (REPLICATE,
SYNC_RANGES and SEAL_RANGES to a data node, a data node's HEARTBEAT and
REPORT_METRICS to the PM), and they are not subject to entries: a data
node's own calls on the PM (its retention trims, looking a stream up) are
the cluster's work, not a user's.
"""

from __future__ import annotations

import collections
import logging
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sbp.errors import AuthorizationFailedError

from .acl import ANONYMOUS, Acl, AclError, load_acl, resource_of
from .ratelog import RateLimitedLog
from .service import ServiceError
from .tls import ServerSecurity

logger = logging.getLogger(__name__)
_denials = RateLimitedLog(logger, interval=10.0)

#: the principals of the cluster's own processes
CLUSTER_PRINCIPALS: Final = frozenset({"datanode", "pm"})


def principal_of(stream: trio.abc.Stream) -> str:
    """The principal of the peer at the other end of ``stream``."""
    if not isinstance(stream, trio.SSLStream):
        return ANONYMOUS
    return principal_of_certificate(stream.getpeercert())


def principal_of_certificate(certificate: dict[str, Any] | None) -> str:
    """Subject CN, else the first DNS subjectAltName (``ssl`` decoded form)."""
    if not certificate:
        return ANONYMOUS
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return str(value)
    for kind, value in certificate.get("subjectAltName", ()):
        if kind == "DNS" and value:
            return str(value)
    return ANONYMOUS


def access_control(security: ServerSecurity) -> AccessControl:
    """The server's ``AccessControl``; an ACL file that cannot be used stops
    start-up with one line."""
    try:
        return AccessControl(security.acl_file)
    except AclError as error:
        raise ServiceError(str(error)) from None


class AccessControl:
    """The ACL in force on one server (see the module docstring)."""

    def __init__(self, path: Path | None = None) -> None:
        #: raises AclError on a bad file: a server does not start on one
        self.path = path
        self._acl: Acl | None = load_acl(path) if path is not None else None
        #: denied items, by operation
        self.denied: collections.Counter[str] = collections.Counter()
        self.reloads = 0

    @property
    def enabled(self) -> bool:
        return self._acl is not None

    @property
    def entries(self) -> int:
        return len(self._acl) if self._acl is not None else 0

    def reload(self) -> bool:
        """Read the file again; a bad one changes nothing (logged)."""
        if self.path is None:
            return False
        try:
            acl = load_acl(self.path)
        except AclError as error:
            logger.error("ACL file refused, the previous %d entries stay: %s", self.entries, error)
            return False
        self._acl = acl
        self.reloads += 1
        logger.info("ACL file %s loaded: %d entries", self.path, len(acl))
        return True

    async def reload_on_sighup(self) -> None:
        """Runs until cancelled (only when an ACL file was given)."""
        if self.path is None:
            return
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                self.reload()

    def check(
        self, principal: str, operation: str, stream_id: int | None = None
    ) -> AuthorizationFailedError | None:
        """None when allowed, else the error to answer the item with."""
        if self.allows(principal, operation, stream_id):
            return None
        return self._deny(principal, operation, resource_of(operation, stream_id))

    def check_any(
        self, principal: str, operations: tuple[str, ...], stream_id: int | None = None
    ) -> AuthorizationFailedError | None:
        """Allowed when any of ``operations`` is (the first one is named
        when denied)."""
        if any(self.allows(principal, op, stream_id) for op in operations):
            return None
        return self._deny(principal, operations[0], resource_of(operations[0], stream_id))

    def allows(self, principal: str, operation: str, stream_id: int | None = None) -> bool:
        """Whether allowed, without counting or logging a denial (for listings)."""
        acl = self._acl
        return (
            acl is None
            or principal in CLUSTER_PRINCIPALS
            or acl.allows(principal, operation, stream_id)
        )

    def check_on_cluster(self, principal: str, operation: str) -> AuthorizationFailedError | None:
        """None when ``operation`` is allowed on the resource ``cluster``."""
        acl = self._acl
        if acl is None or principal in CLUSTER_PRINCIPALS:
            return None
        if acl.allows_on_cluster(principal, operation):
            return None
        return self._deny(principal, operation, "cluster")

    def check_some_stream(self, principal: str, operation: str) -> AuthorizationFailedError | None:
        """None when ``operation`` is allowed on at least one stream."""
        acl = self._acl
        if acl is None or principal in CLUSTER_PRINCIPALS:
            return None
        if acl.allows_some_stream(principal, operation):
            return None
        return self._deny(principal, operation, "any stream")

    def check_each(
        self, principal: str, operation: str, stream_ids: Iterable[int | None]
    ) -> list[AuthorizationFailedError | None]:
        """``check`` per item; all None (cheaply) when authorization is off."""
        if self._acl is None or principal in CLUSTER_PRINCIPALS:
            return [None for _ in stream_ids]
        return [self.check(principal, operation, stream_id) for stream_id in stream_ids]

    def check_internal(self, principal: str, what: str) -> AuthorizationFailedError | None:
        """A cluster-internal request: only ``datanode`` and ``pm`` may."""
        if self._acl is None or principal in CLUSTER_PRINCIPALS:
            return None
        return self._deny(principal, what, "cluster (datanode and pm only)")

    def _deny(self, principal: str, operation: str, resource: str) -> AuthorizationFailedError:
        self.denied[operation] += 1
        text = f"principal {principal!r} may not {operation} on {resource}"
        _denials.warning(f"{principal}:{operation}", "denied: %s", text)
        return AuthorizationFailedError(text)


def require(denied: AuthorizationFailedError | None) -> None:
    """Raise a check's denial: for a request refused whole, or an item
    answered with its error."""
    if denied is not None:
        raise denied


class AccessCollector(Collector):
    """The authorization metrics of a server (same names on both servers)."""

    def __init__(self, access: AccessControl) -> None:
        self._access = access

    def collect(self) -> Iterator[Metric]:
        access = self._access
        denied = CounterMetricFamily(
            "sbp_authorization_denied",
            "Request items refused AUTHORIZATION_FAILED, by operation",
            labels=["operation"],
        )
        for operation, count in sorted(dict(access.denied).items()):
            denied.add_metric([operation], count)
        yield denied
        yield GaugeMetricFamily(
            "sbp_acl_entries", "ACL entries in force (0: authorization is off)", access.entries
        )
        yield CounterMetricFamily(
            "sbp_acl_reloads", "ACL files read again on SIGHUP and taken", access.reloads
        )
