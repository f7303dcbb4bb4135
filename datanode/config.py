"""The data node's settings: flags, the config file under them, checked values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from datanode.compaction import DEFAULT_COMPACTION_BYTES_PER_S
from net.address import format_address, parse_address, parse_address_list
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
from storage.engine import DEFAULT_PAGE_CACHE_WINDOW
from storage.producers import DEFAULT_EXPIRY_MS
from tiering.settings import object_store_options, object_store_settings
from tiering.store import DEFAULT_TIMEOUT_S as DEFAULT_STORE_TIMEOUT_S
from tiering.store import ObjectStoreSettings

PROG: Final = "sbp-datanode"

#: LMDB reserves address space, not disk: a large map costs nothing up front,
#: and LMDB's own default (10 MiB) would fill after a few hundred batches
DEFAULT_MAP_SIZE: Final = 8 << 30
DEFAULT_IDLE_TIMEOUT_S: Final = 600
DEFAULT_HEARTBEAT_MS: Final = 1000
DEFAULT_METRICS_REPORT_MS: Final = 5000
DEFAULT_RETENTION_INTERVAL_MS: Final = 30_000

#: how fast a node copies ranges to the object store, by default
DEFAULT_UPLOAD_BYTES_PER_S: Final = 100 << 20
#: the disk cache of ranges read from the object store, by default
DEFAULT_OBJECT_CACHE_BYTES: Final = 1 << 30

OPTIONS: Final = (
    *listen_options(),
    *security_options(),
    Option(
        "advertise",
        "address given to the PM and clients (default: the bound listen address)",
        parse_address,
        metavar="HOST:PORT",
    ),
    Option("node-id", "this node's id in the cluster (required)", positive_int, metavar="N"),
    Option("data-dir", "directory of the node's LMDB environment (required)", Path, metavar="DIR"),
    Option(
        "pm",
        "the placement manager to register with, or several PMs on etcd, comma-separated "
        "(the leader is followed); without it the node serves the ranges SYNC_RANGES gives it",
        parse_address_list,
        metavar="HOST:PORT[,HOST:PORT...]",
    ),
    Option(
        "sync",
        "'always': fsync every group commit before answering; 'never': leave it to the "
        "OS (fast, loses the last writes on a machine crash)",
        default="always",
        choices=("always", "never"),
    ),
    Option(
        "map-size",
        "largest size of the data (LMDB map size), e.g. 64GiB",
        parse_size,
        default="8GiB",
        metavar="BYTES",
    ),
    Option(
        "page-cache-window",
        "keep the newest BYTES written in the OS page cache and drop older written pages "
        "once synced, so new writes reuse the memory; 0 leaves the cache to the OS",
        parse_size,
        default="256MiB",
        metavar="BYTES",
    ),
    Option(
        "idle-timeout-s",
        "close a connection idle this long; 0 never",
        non_negative_int,
        default=str(DEFAULT_IDLE_TIMEOUT_S),
        metavar="SECONDS",
    ),
    *serving_limit_options(),
    Option(
        "heartbeat-interval-ms",
        "HEARTBEAT period to the PM",
        positive_int,
        default=str(DEFAULT_HEARTBEAT_MS),
        metavar="MS",
    ),
    Option(
        "metrics-interval-ms",
        "REPORT_METRICS period to the PM",
        positive_int,
        default=str(DEFAULT_METRICS_REPORT_MS),
        metavar="MS",
    ),
    Option(
        "retention-interval-ms",
        "drop batches older than their stream's retention period this often (also soon "
        "after the PM changes a stream)",
        positive_int,
        default=str(DEFAULT_RETENTION_INTERVAL_MS),
        metavar="MS",
    ),
    *object_store_options(),
    Option(
        "max-upload-bytes-per-s",
        "copy sealed ranges to the object store at most this fast (SPEC §14), e.g. "
        "100MiB; 0: no limit",
        parse_size,
        default=str(DEFAULT_UPLOAD_BYTES_PER_S),
        metavar="BYTES",
    ),
    Option(
        "object-store-timeout-ms",
        "how long a read of a range in the object store only waits for the store before it "
        "answers OBJECT_STORE_UNAVAILABLE (retriable)",
        positive_int,
        default=str(int(DEFAULT_STORE_TIMEOUT_S * 1000)),
        metavar="MS",
    ),
    Option(
        "object-cache-bytes",
        "keep at most this much of the object store's ranges in a disk cache under "
        "--data-dir, for reads of ranges no longer on the nodes, e.g. 1GiB",
        parse_size,
        default=str(DEFAULT_OBJECT_CACHE_BYTES),
        metavar="BYTES",
    ),
    Option(
        "compaction-bytes-per-s",
        "read and rewrite sealed ranges of compacted streams at most this fast (SPEC §13), "
        "e.g. 200MiB; 0: no limit",
        parse_size,
        default=str(DEFAULT_COMPACTION_BYTES_PER_S),
        metavar="BYTES",
    ),
    Option(
        "producer-expiry-ms",
        "forget an idempotent producer's state on a stream once it has not appended there "
        "this long; its next batch must then start at sequence 0 (SPEC §10)",
        positive_int,
        default=str(DEFAULT_EXPIRY_MS),
        metavar="MS",
    ),
    Option(
        "quota-file",
        "per-principal byte rates of APPEND and FETCH (JSON; see docs/operations.md); "
        "read again on SIGHUP",
        Path,
        metavar="FILE",
    ),
)

DESCRIPTION: Final = """\
Run an SBP data node: it stores the record batches of the stream ranges it
hosts in LMDB and serves APPEND, FETCH and the range operations over TCP.

Signals: SIGTERM or SIGINT drains (GOAWAY on every connection, requests in
flight finish within --drain-timeout-s), closes the storage and exits 0; a
second signal stops without waiting.
Exit codes: 0 clean stop, 1 runtime failure (busy port, unusable data
directory), 2 bad flags or config file."""


@dataclass(frozen=True, slots=True)
class DataNodeConfig:
    """Checked settings of one data node."""

    node_id: int
    data_dir: Path
    listen: tuple[str, int] = ("127.0.0.1", 0)
    advertise: tuple[str, int] | None = None
    pm: tuple[tuple[str, int], ...] | None = None
    metrics_listen: tuple[str, int] | None = None
    sync: bool = True
    map_size: int = DEFAULT_MAP_SIZE
    page_cache_window: int = DEFAULT_PAGE_CACHE_WINDOW
    max_frame_bytes: int = DEFAULT_MAX_FRAME_LENGTH
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: server-wide byte budgets (net.budget)
    max_request_bytes: int = DEFAULT_REQUEST_BYTES
    max_answer_bytes: int = DEFAULT_ANSWER_BYTES
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_MS / 1000
    metrics_interval_s: float = DEFAULT_METRICS_REPORT_MS / 1000
    retention_interval_s: float = DEFAULT_RETENTION_INTERVAL_MS / 1000
    producer_expiry_ms: int = DEFAULT_EXPIRY_MS
    #: how fast compaction reads and rewrites (SPEC §13); 0: no limit
    compaction_bytes_per_s: int = DEFAULT_COMPACTION_BYTES_PER_S
    #: the S3 bucket and prefix of tiered streams' ranges (SPEC §14)
    object_store: ObjectStoreSettings | None = None
    #: how fast ranges are copied to the object store; 0: no limit
    max_upload_bytes_per_s: int = DEFAULT_UPLOAD_BYTES_PER_S
    #: the disk cache of ranges read from the object store
    object_cache_bytes: int = DEFAULT_OBJECT_CACHE_BYTES
    #: how long a read waits for the object store
    object_store_timeout_s: float = DEFAULT_STORE_TIMEOUT_S
    #: per-principal byte rates (SPEC §12), None: none
    quota_file: Path | None = None
    #: TLS, mutual TLS and the ACL file (SPEC §9)
    security: ServerSecurity = field(default_factory=ServerSecurity)
    log_level: str = "info"

    @property
    def pm_address(self) -> str | None:
        """The PM (or PMs, comma-separated) as the client library takes them."""
        return None if self.pm is None else ",".join(format_address(*a) for a in self.pm)


def parse_config(argv: Sequence[str] | None = None) -> DataNodeConfig:
    """Settings from the command line (and the ``--config`` file it names);
    raises ``UsageError`` with a one-line message on anything wrong."""
    parser = build_parser(PROG, DESCRIPTION, OPTIONS)
    values = load_settings(parser, OPTIONS, argv)
    if values["node_id"] is None:
        raise UsageError("--node-id is required (or node-id in the config file)")
    check_storage_settings(values)
    idle = values["idle_timeout_s"]
    return DataNodeConfig(
        node_id=values["node_id"],
        data_dir=values["data_dir"],
        listen=values["listen"],
        advertise=values["advertise"],
        pm=values["pm"],
        metrics_listen=values["metrics_listen"],
        sync=values["sync"] == "always",
        map_size=values["map_size"],
        page_cache_window=values["page_cache_window"],
        max_frame_bytes=values["max_frame_bytes"],
        max_connections=values["max_connections"],
        max_request_bytes=values["max_request_bytes"],
        max_answer_bytes=values["max_answer_bytes"],
        max_in_flight=values["max_in_flight"],
        idle_timeout_s=float(idle) if idle else None,
        drain_timeout_s=float(values["drain_timeout_s"]),
        heartbeat_interval_s=values["heartbeat_interval_ms"] / 1000,
        metrics_interval_s=values["metrics_interval_ms"] / 1000,
        retention_interval_s=values["retention_interval_ms"] / 1000,
        producer_expiry_ms=values["producer_expiry_ms"],
        compaction_bytes_per_s=values["compaction_bytes_per_s"],
        object_store=object_store_settings(values),
        max_upload_bytes_per_s=values["max_upload_bytes_per_s"],
        object_cache_bytes=values["object_cache_bytes"],
        object_store_timeout_s=values["object_store_timeout_ms"] / 1000,
        quota_file=values["quota_file"],
        security=security_settings(values),
        log_level=values["log_level"],
    )
