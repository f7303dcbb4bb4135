"""The PM's settings: flags, the config file under them, checked values."""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from net.address import parse_address
from net.budget import DEFAULT_ANSWER_BYTES, DEFAULT_REQUEST_BYTES
from net.service import UsageError
from net.settings import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_IN_FLIGHT,
    Option,
    build_parser,
    check_storage_settings,
    listen_options,
    load_settings,
    non_negative_int,
    positive_int,
    security_options,
    security_settings,
    serving_limit_options,
)
from net.sizes import parse_size
from net.tls import ServerSecurity
from sbp.constants import DEFAULT_MAX_FRAME_LENGTH
from tiering.settings import object_store_options, object_store_settings
from tiering.store import ObjectStoreSettings

from .compaction import DEFAULT_INTERVAL_S as DEFAULT_COMPACTION_INTERVAL_S
from .compaction import DEFAULT_MAX_KEYS as DEFAULT_COMPACTION_MAX_KEYS
from .compaction import DEFAULT_ROLL_BYTES as DEFAULT_COMPACTION_ROLL_BYTES
from .compaction import CompactionSettings
from .metadata import DEFAULT_MAP_SIZE
from .tiering import DEFAULT_INTERVAL_S as DEFAULT_TIERING_INTERVAL_S
from .tiering import DEFAULT_ROLL_BYTES as DEFAULT_TIERED_ROLL_BYTES
from .tiering import DEFAULT_SWEEP_INTERVAL_S

PROG: Final = "sbp-pm"

DEFAULT_NODE_TIMEOUT_MS: Final = 5000
#: ten minutes: a node restarted after a crash or an upgrade is back well within it
DEFAULT_REPAIR_AFTER_MS: Final = 600_000
DEFAULT_END_OFFSETS_INTERVAL_MS: Final = 5_000
DEFAULT_SIZE_RETENTION_INTERVAL_MS: Final = 10_000
DEFAULT_REBALANCE_THRESHOLD: Final = 0.2
DEFAULT_REBALANCE_INTERVAL_MS: Final = 60_000
DEFAULT_RECONCILE_INTERVAL_MS: Final = 60_000
DEFAULT_COMPACTION_INTERVAL_MS: Final = int(DEFAULT_COMPACTION_INTERVAL_S * 1000)


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 10:
        raise ValueError(f"{text} is not a share such as 0.2 (more than 0, at most 10)")
    return value


DEFAULT_LAG_METRICS_MAX_SERIES: Final = 1_000
DEFAULT_LEASE_TTL_MS: Final = 3000


def parse_etcd_endpoints(text: str) -> tuple[str, ...]:
    """``http://host:port[,http://host:port...]`` (a bare host:port gets http://)."""
    endpoints = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        url = part if "://" in part else f"http://{part}"
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https"):
            raise ValueError(f"{part!r}: etcd URLs are http:// or https://")
        parse_address(rest.rstrip("/"))
        endpoints.append(url.rstrip("/"))
    if not endpoints:
        raise ValueError("no etcd URL given")
    return tuple(endpoints)


OPTIONS: Final = (
    *listen_options(),
    *security_options(),
    Option(
        "data-dir",
        "directory of the PM's metadata (LMDB; required without --etcd)",
        Path,
        metavar="DIR",
    ),
    Option(
        "etcd",
        "keep the metadata in etcd instead, at these client URLs (comma-separated); several "
        "PMs on the same etcd and prefix form one cluster, one of them leading (SPEC §8)",
        parse_etcd_endpoints,
        metavar="URL[,URL...]",
    ),
    Option(
        "etcd-ca",
        "with --etcd: check etcd's certificate against this CA (https:// URLs; default: "
        "the system's CAs)",
        Path,
        metavar="FILE",
    ),
    Option(
        "etcd-cert",
        "with --etcd: present this client certificate to etcd (its --client-cert-auth)",
        Path,
        metavar="FILE",
    ),
    Option(
        "etcd-key",
        "with --etcd: the private key of --etcd-cert",
        Path,
        metavar="FILE",
    ),
    Option(
        "advertise",
        "with --etcd: the address other PMs give clients to find this one when it leads "
        "(default: the bound listen address)",
        parse_address,
        metavar="HOST:PORT",
    ),
    Option(
        "etcd-prefix",
        "with --etcd: the key prefix of this cluster's metadata",
        str,
        default="/sbp/",
        metavar="PREFIX",
    ),
    Option(
        "lease-ttl-ms",
        "with --etcd: the leader's lease; a leader that cannot renew it for two thirds of "
        "this steps down, and another PM takes over within about this long",
        positive_int,
        default=str(DEFAULT_LEASE_TTL_MS),
        metavar="MS",
    ),
    Option(
        "node-timeout-ms",
        "a data node that sends no HEARTBEAT for this long is dead and gets no new ranges",
        positive_int,
        default=str(DEFAULT_NODE_TIMEOUT_MS),
        metavar="MS",
    ),
    Option(
        "repair-after-ms",
        "a data node dead for this long gets each replicated range it held placed on a "
        "live node, which copies it from a surviving replica (SPEC §7)",
        positive_int,
        default=str(DEFAULT_REPAIR_AFTER_MS),
        metavar="MS",
    ),
    Option(
        "end-offsets-interval-ms",
        "how often the PM asks the primaries for the end offset of every stream a consumer "
        "group has a position on (the lag in FETCH_OFFSETS and on /metrics)",
        positive_int,
        default=str(DEFAULT_END_OFFSETS_INTERVAL_MS),
        metavar="MS",
    ),
    Option(
        "lag-metrics-max-series",
        "consumer group lag on /metrics: at most this many (group, stream) pairs, the "
        "furthest behind first",
        positive_int,
        default=str(DEFAULT_LAG_METRICS_MAX_SERIES),
        metavar="N",
    ),
    Option(
        "min-free-space",
        "data nodes reporting less free space than this (free disk, or room left in their "
        "LMDB map when that is less) get no new ranges, e.g. 1GiB",
        parse_size,
        default="1MiB",
        metavar="BYTES",
    ),
    Option(
        "rebalance-threshold",
        "move sealed ranges between live data nodes while their bytes, or their range "
        "counts, differ by more than this share of the mean, e.g. 0.2",
        _share,
        default=str(DEFAULT_REBALANCE_THRESHOLD),
        metavar="SHARE",
    ),
    Option(
        "rebalance-interval-ms",
        "how often the PM checks the balance on its own (0: only when asked, "
        "sbp cluster rebalance)",
        non_negative_int,
        default=str(DEFAULT_REBALANCE_INTERVAL_MS),
        metavar="MS",
    ),
    Option(
        "reconcile-interval-ms",
        "how often the PM compares each live data node's ranges with the metadata and "
        "sends it what differs, as it does when a node comes back (0: only then)",
        non_negative_int,
        default=str(DEFAULT_RECONCILE_INTERVAL_MS),
        metavar="MS",
    ),
    Option(
        "size-retention-interval-ms",
        "how often streams with a size limit (retention_bytes) are sized and trimmed",
        positive_int,
        default=str(DEFAULT_SIZE_RETENTION_INTERVAL_MS),
        metavar="MS",
    ),
    Option(
        "compaction-interval-ms",
        "how often the sealed ranges of compacted streams are compacted (SPEC §13)",
        positive_int,
        default=str(DEFAULT_COMPACTION_INTERVAL_MS),
        metavar="MS",
    ),
    Option(
        "compaction-max-keys",
        "keys in one compaction pass's map at most (24 bytes each, sent to every node "
        "holding a replica); a stream with more is compacted a prefix per pass",
        positive_int,
        default=str(DEFAULT_COMPACTION_MAX_KEYS),
        metavar="N",
    ),
    Option(
        "compaction-roll-bytes",
        "seal a compacted stream's open range once it holds this much, so that it can be "
        "compacted (0: never), e.g. 64MiB",
        parse_size,
        default=f"{DEFAULT_COMPACTION_ROLL_BYTES >> 20}MiB",
        metavar="BYTES",
    ),
    *object_store_options(),
    Option(
        "tiering-interval-ms",
        "how often tiered streams' ranges are moved on (SPEC §14): full open ranges sealed, "
        "sealed ranges copied to the object store, copied ones dropped from the nodes",
        positive_int,
        default=str(int(DEFAULT_TIERING_INTERVAL_S * 1000)),
        metavar="MS",
    ),
    Option(
        "tiered-roll-bytes",
        "seal a tiered stream's open range once it holds this much, so that it is copied "
        "to the object store (0: never), e.g. 64MiB",
        parse_size,
        default=f"{DEFAULT_TIERED_ROLL_BYTES >> 20}MiB",
        metavar="BYTES",
    ),
    Option(
        "object-sweep-interval-ms",
        "how often the object store is listed for objects no range names (an upload a "
        "crash cut short), which are deleted",
        positive_int,
        default=str(int(DEFAULT_SWEEP_INTERVAL_S * 1000)),
        metavar="MS",
    ),
    Option(
        "max-move-bytes-per-s",
        "draining nodes: start copies of their ranges no faster than this on average "
        "(0: no limit), e.g. 100MiB",
        parse_size,
        default="100MiB",
        metavar="BYTES",
    ),
    Option(
        "map-size",
        "largest size of the metadata (LMDB map size; sparse, costs no disk up front)",
        parse_size,
        default=f"{DEFAULT_MAP_SIZE >> 30}GiB",
        metavar="BYTES",
    ),
    *serving_limit_options(),
)

DESCRIPTION: Final = """\
Run the SBP placement manager: it keeps the metadata of streams, ranges and
data nodes in LMDB, places each new range on the least loaded live data
nodes, and tells the data nodes (SYNC_RANGES, SEAL_RANGES, DELETE_STREAMS).
Data nodes register with their first HEARTBEAT.

Every change is committed and synced before it is acknowledged: a PM killed
at any moment restarts with everything it acknowledged.

Signals: SIGTERM or SIGINT drains (GOAWAY on every connection, requests in
flight finish within --drain-timeout-s), closes the metadata and exits 0; a
second signal stops without waiting.
With --etcd, several PMs share the metadata in etcd and one of them leads
(docs/pm.md). `sbp-pm migrate --from-data-dir DIR --etcd URL,...` copies an
LMDB PM's metadata into etcd.

Exit codes: 0 clean stop, 1 runtime failure (busy port, unusable data
directory), 2 bad flags or config file."""


@dataclass(frozen=True, slots=True)
class EtcdTLS:
    """How a PM speaks TLS to etcd (``--etcd-ca``, ``--etcd-cert``, ``--etcd-key``)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def context(self) -> ssl.SSLContext:
        """The client context; raises ``UsageError`` on files that cannot be used."""
        try:
            context = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
            if self.cert is not None and self.key is not None:
                context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as error:
            raise UsageError(f"cannot use the etcd TLS files: {error}") from None
        return context


def _etcd_tls(values: dict[str, Any]) -> EtcdTLS | None:
    ca, cert, key = values["etcd_ca"], values["etcd_cert"], values["etcd_key"]
    if ca is None and cert is None and key is None:
        return None
    if not values["etcd"]:
        raise UsageError("--etcd-ca, --etcd-cert and --etcd-key go with --etcd")
    if (cert is None) != (key is None):
        raise UsageError("--etcd-cert and --etcd-key go together")
    if any(url.startswith("http://") for url in values["etcd"]):
        raise UsageError("etcd TLS settings need https:// etcd URLs")
    tls = EtcdTLS(ca, cert, key)
    tls.context()  # refused at start-up, not at the first etcd call
    return tls


@dataclass(frozen=True, slots=True)
class PMConfig:
    """Checked settings of one PM."""

    data_dir: Path | None
    listen: tuple[str, int] = ("127.0.0.1", 0)
    #: the metadata in etcd (SPEC §8) rather than in ``data_dir``
    etcd: tuple[str, ...] = ()
    #: TLS towards etcd: the CA, the client certificate and its key
    etcd_tls: EtcdTLS | None = None
    advertise: tuple[str, int] | None = None
    etcd_prefix: str = "/sbp/"
    lease_ttl_s: float = DEFAULT_LEASE_TTL_MS / 1000
    metrics_listen: tuple[str, int] | None = None
    node_timeout_s: float = DEFAULT_NODE_TIMEOUT_MS / 1000
    repair_after_s: float = DEFAULT_REPAIR_AFTER_MS / 1000
    end_offsets_interval_s: float = DEFAULT_END_OFFSETS_INTERVAL_MS / 1000
    lag_metrics_max_series: int = DEFAULT_LAG_METRICS_MAX_SERIES
    min_free_space: int = 1 << 20
    max_move_bytes_per_s: int = 100 << 20
    size_retention_interval_s: float = DEFAULT_SIZE_RETENTION_INTERVAL_MS / 1000
    rebalance_threshold: float = DEFAULT_REBALANCE_THRESHOLD
    rebalance_interval_s: float = DEFAULT_REBALANCE_INTERVAL_MS / 1000
    reconcile_interval_s: float = DEFAULT_RECONCILE_INTERVAL_MS / 1000
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    #: the S3 bucket and prefix of tiered streams' ranges (SPEC §14)
    object_store: ObjectStoreSettings | None = None
    object_sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S
    tiered_roll_bytes: int = DEFAULT_TIERED_ROLL_BYTES
    tiering_interval_s: float = DEFAULT_TIERING_INTERVAL_S
    map_size: int = DEFAULT_MAP_SIZE
    max_frame_bytes: int = DEFAULT_MAX_FRAME_LENGTH
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: server-wide byte budgets (net.budget)
    max_request_bytes: int = DEFAULT_REQUEST_BYTES
    max_answer_bytes: int = DEFAULT_ANSWER_BYTES
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    #: TLS, mutual TLS and the ACL file (SPEC §9)
    security: ServerSecurity = field(default_factory=ServerSecurity)
    log_level: str = "info"


def parse_config(argv: Sequence[str] | None = None) -> PMConfig:
    """Settings from the command line (and the ``--config`` file it names);
    raises ``UsageError`` with a one-line message on anything wrong."""
    parser = build_parser(PROG, DESCRIPTION, OPTIONS)
    values = load_settings(parser, OPTIONS, argv)
    etcd_tls = _etcd_tls(values)
    if values["etcd"]:
        if values["data_dir"] is not None:
            raise UsageError("give --data-dir (LMDB) or --etcd, not both")
        if not values["etcd_prefix"].startswith("/"):
            raise UsageError("--etcd-prefix must start with /")
        values["data_dir"] = Path(".")  # only so that the shared checks pass
        check_storage_settings(values)
        values["data_dir"] = None
    else:
        check_storage_settings(values)
    return PMConfig(
        data_dir=values["data_dir"],
        etcd=values["etcd"] or (),
        etcd_tls=etcd_tls,
        advertise=values["advertise"],
        etcd_prefix=values["etcd_prefix"],
        lease_ttl_s=values["lease_ttl_ms"] / 1000,
        listen=values["listen"],
        metrics_listen=values["metrics_listen"],
        node_timeout_s=values["node_timeout_ms"] / 1000,
        repair_after_s=values["repair_after_ms"] / 1000,
        end_offsets_interval_s=values["end_offsets_interval_ms"] / 1000,
        lag_metrics_max_series=values["lag_metrics_max_series"],
        min_free_space=values["min_free_space"],
        max_move_bytes_per_s=values["max_move_bytes_per_s"],
        size_retention_interval_s=values["size_retention_interval_ms"] / 1000,
        rebalance_threshold=values["rebalance_threshold"],
        rebalance_interval_s=values["rebalance_interval_ms"] / 1000,
        reconcile_interval_s=values["reconcile_interval_ms"] / 1000,
        compaction=CompactionSettings(
            interval=values["compaction_interval_ms"] / 1000,
            max_keys=values["compaction_max_keys"],
            roll_bytes=values["compaction_roll_bytes"],
        ),
        object_store=object_store_settings(values),
        object_sweep_interval_s=values["object_sweep_interval_ms"] / 1000,
        tiered_roll_bytes=values["tiered_roll_bytes"],
        tiering_interval_s=values["tiering_interval_ms"] / 1000,
        map_size=values["map_size"],
        max_frame_bytes=values["max_frame_bytes"],
        max_connections=values["max_connections"],
        max_request_bytes=values["max_request_bytes"],
        max_answer_bytes=values["max_answer_bytes"],
        max_in_flight=values["max_in_flight"],
        drain_timeout_s=float(values["drain_timeout_s"]),
        security=security_settings(values),
        log_level=values["log_level"],
    )
