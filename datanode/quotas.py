"""Per-principal byte-rate quotas (SPEC §12): APPEND payload and FETCH
answers, read from a JSON file (``--quota-file``)::

    {"quotas": [
      {"principal": "etl", "append_bytes_per_s": "20MiB", "fetch_bytes_per_s": "100MiB"},
      {"principal": "*", "append_bytes_per_s": "5MiB"}
    ]}

A principal without an entry of its own gets ``*``'s limits, each principal
its own allowance; a kind left out is not limited. Sizes are bytes or
``512KiB``-style strings. The cluster's own principals (``datanode``,
``pm``) are never limited.

A request over the rate is served in full; its answer then carries
``throttle_time_ms``, how long the connection's next request of that kind
must wait, and the server reads nothing more from that connection for that
time. Each (principal, kind) has a token bucket of one second's worth of
bytes: a request takes its bytes, and the time the bucket needs to be back
above zero is the throttle time. A client that waits as told thus settles
at the rate.

The file is read again on SIGHUP; one that does not parse changes nothing.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from net.authz import CLUSTER_PRINCIPALS
from net.service import ServiceError
from net.sizes import parse_size

logger = logging.getLogger(__name__)

KINDS: Final = ("append", "fetch")
_KEYS: Final = frozenset({"principal", *(f"{kind}_bytes_per_s" for kind in KINDS)})
#: the longest throttle a request is told (a huge request on a tiny quota)
MAX_THROTTLE_MS: Final = 30_000


class QuotaError(ValueError):
    """A quota file that cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bytes per second by kind; a kind absent is not limited."""

    rates: dict[str, int]


def load_quotas(path: Path) -> dict[str, Limits]:
    """The file's limits by principal (``*`` for any other)."""
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise QuotaError(f"{path}: {error}") from None
    entries = document.get("quotas") if isinstance(document, dict) else None
    if not isinstance(entries, list) or set(document) != {"quotas"}:
        raise QuotaError(f'{path}: expected {{"quotas": [...]}}')
    found: dict[str, Limits] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: quota {index + 1}"
        if not isinstance(entry, dict) or not set(entry) <= _KEYS:
            raise QuotaError(f"{where}: keys are {', '.join(sorted(_KEYS))}")
        principal = entry.get("principal")
        if not isinstance(principal, str) or not principal:
            raise QuotaError(f"{where}: a principal name, or * for any other")
        if principal in found:
            raise QuotaError(f"{where}: {principal} has a quota already")
        rates = {}
        for kind in KINDS:
            value = entry.get(f"{kind}_bytes_per_s")
            if value is not None:
                rates[kind] = _rate(value, f"{where}: {kind}_bytes_per_s")
        found[principal] = Limits(rates)
    return found


def _rate(value: Any, where: str) -> int:
    try:
        rate = value if isinstance(value, int) and not isinstance(value, bool) else None
        if isinstance(value, str):
            rate = parse_size(value)
    except ValueError as error:
        raise QuotaError(f"{where}: {error}") from None
    if rate is None or rate < 1:
        raise QuotaError(f"{where}: a positive byte count such as 1048576 or 10MiB")
    return rate


class _Bucket:
    __slots__ = ("at", "rate", "tokens")

    def __init__(self, rate: int, now: float) -> None:
        self.rate = rate
        self.tokens = float(rate)
        self.at = now


class Quotas:
    """The quotas in force on a data node (see the module docstring)."""

    def __init__(self, path: Path | None = None, clock: Callable[[], float] | None = None) -> None:
        #: raises QuotaError on a bad file: a server does not start on one
        self.path = path
        self._limits: dict[str, Limits] = load_quotas(path) if path is not None else {}
        self._clock = clock or trio.current_time
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        #: seconds of throttle told, by (principal, kind)
        self.throttled_seconds: dict[tuple[str, str], float] = {}
        self.reloads = 0

    @property
    def principals(self) -> int:
        return len(self._limits)

    def reload(self) -> bool:
        """Read the file again; a bad one changes nothing (logged)."""
        if self.path is None:
            return False
        try:
            limits = load_quotas(self.path)
        except QuotaError as error:
            logger.error("quota file refused, the previous quotas stay: %s", error)
            return False
        self._limits = limits
        self._buckets.clear()
        self.reloads += 1
        logger.info("quota file %s loaded: %d principals", self.path, len(limits))
        return True

    def charge(self, principal: str, kind: str, nbytes: int) -> int:
        """Count ``nbytes`` of ``kind`` served to ``principal``: the ms its
        connection must wait before its next such request (0: none)."""
        if not self._limits or principal in CLUSTER_PRINCIPALS:
            return 0
        limits = self._limits.get(principal) or self._limits.get("*")
        rate = None if limits is None else limits.rates.get(kind)
        if rate is None:
            return 0
        now = self._clock()
        bucket = self._buckets.get((principal, kind))
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[(principal, kind)] = _Bucket(rate, now)
        bucket.tokens = min(bucket.tokens + (now - bucket.at) * rate, float(rate)) - nbytes
        bucket.at = now
        if bucket.tokens >= 0:
            return 0
        throttle_ms = min(math.ceil(-bucket.tokens / rate * 1000), MAX_THROTTLE_MS)
        key = (principal, kind)
        self.throttled_seconds[key] = self.throttled_seconds.get(key, 0.0) + throttle_ms / 1000
        return throttle_ms


def quotas_from(path: Path | None) -> Quotas:
    """The node's ``Quotas``; a quota file that cannot be used stops start-up
    with one line."""
    try:
        return Quotas(path)
    except QuotaError as error:
        raise ServiceError(str(error)) from None


class QuotaCollector(Collector):
    """What the quotas did, on /metrics."""

    def __init__(self, quotas: Quotas) -> None:
        self._quotas = quotas

    def collect(self) -> Iterator[Metric]:
        throttled = CounterMetricFamily(
            "sbp_quota_throttle_seconds",
            "throttle time told to clients over their byte-rate quota, by principal and kind",
            labels=["principal", "kind"],
        )
        for (principal, kind), seconds in sorted(dict(self._quotas.throttled_seconds).items()):
            throttled.add_metric([principal, kind], seconds)
        yield throttled
        yield GaugeMetricFamily(
            "sbp_quota_principals",
            "principals (and *) with a quota in force (0: no quotas)",
            value=self._quotas.principals,
        )
        yield CounterMetricFamily(
            "sbp_quota_reloads",
            "quota files read again on SIGHUP and taken",
            value=self._quotas.reloads,
        )
