"""``sbp-tables``' settings: flags, the config file under them, checked values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from net.address import parse_address
from net.service import UsageError
from net.settings import Option, build_parser, load_settings, positive_int
from net.sizes import parse_size

from .writer import DEFAULT_TARGET_BYTES

PROG: Final = "sbp-tables"
DESCRIPTION: Final = (
    "Keep every stream with table_interval_ms > 0 as the Iceberg table sbp.stream_<id> "
    "(SPEC §16), exactly once; several sbp-tables share the streams as members of one "
    "consumer group."
)
#: the consumer group sbp-tables processes share the streams in (SPEC §15)
DEFAULT_GROUP: Final = "sbp-tables"
DEFAULT_SESSION_TIMEOUT_MS: Final = 10_000
DEFAULT_MAINTENANCE_INTERVAL_MS: Final = 300_000
DEFAULT_MAX_GATHERED_BYTES: Final = 1 << 30


def _catalog(text: str) -> str:
    if not text.startswith(("sqlite:///", "http://", "https://")):
        raise ValueError(f"sqlite:///PATH or an Iceberg REST catalog's http(s)://URL, not {text!r}")
    return text


OPTIONS: Final = (
    Option("pm", "the placement manager HOST:PORT (several, comma-separated: PMs on etcd)"),
    Option(
        "catalog",
        "the Iceberg catalog: sqlite:///PATH (pyiceberg's SQL catalog) or an Iceberg REST "
        "catalog's http(s)://URL",
        _catalog,
        metavar="URI",
    ),
    Option(
        "warehouse",
        "where the tables' files go: a directory, or a URI such as s3://BUCKET/PREFIX",
        metavar="PATH_OR_URI",
    ),
    Option(
        "group",
        "the consumer group the sbp-tables processes share the streams in",
        default=DEFAULT_GROUP,
        metavar="NAME",
    ),
    Option("member-id", "this process's member id in the group (default: a new one)", metavar="ID"),
    Option(
        "session-timeout-ms",
        "a process silent this long loses its streams to the others (1 s to 30 min)",
        positive_int,
        default=str(DEFAULT_SESSION_TIMEOUT_MS),
        metavar="MS",
    ),
    Option(
        "target-file-bytes",
        "commit once a stream has gathered this much, whatever its table_interval_ms says, "
        "e.g. 128MiB",
        parse_size,
        default=f"{DEFAULT_TARGET_BYTES >> 20}MiB",
        metavar="BYTES",
    ),
    Option(
        "max-gathered-bytes",
        "stop reading the streams while this much is gathered and not committed (over "
        "every stream, e.g. while the catalog cannot be reached), e.g. 1GiB",
        parse_size,
        default=f"{DEFAULT_MAX_GATHERED_BYTES >> 20}MiB",
        metavar="BYTES",
    ),
    Option(
        "maintenance-interval-ms",
        "how often each table's small data files are rewritten as larger ones, its "
        "snapshots replaced over an hour ago expired, and the data files no snapshot names "
        "deleted",
        positive_int,
        default=str(DEFAULT_MAINTENANCE_INTERVAL_MS),
        metavar="MS",
    ),
    Option(
        "metrics-listen",
        "serve Prometheus /metrics on this address (port 0: a free one); printed as "
        "'metrics on HOST:PORT' and 'listening on HOST:PORT' once it runs",
        parse_address,
        default="127.0.0.1:0",
        metavar="HOST:PORT",
    ),
)


@dataclass(frozen=True, slots=True)
class TablesConfig:
    pm: str
    catalog: str
    warehouse: str
    group: str = DEFAULT_GROUP
    member_id: str | None = None
    session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_MS / 1000
    target_file_bytes: int = DEFAULT_TARGET_BYTES
    max_gathered_bytes: int = DEFAULT_MAX_GATHERED_BYTES
    maintenance_interval_s: float = DEFAULT_MAINTENANCE_INTERVAL_MS / 1000
    metrics_listen: tuple[str, int] = ("127.0.0.1", 0)
    log_level: str = "info"


def parse_config(argv: Sequence[str] | None = None) -> TablesConfig:
    parser = build_parser(PROG, DESCRIPTION, OPTIONS)
    values = load_settings(parser, OPTIONS, argv)
    for needed in ("pm", "catalog", "warehouse"):
        if not values[needed]:
            raise UsageError(f"--{needed} is needed (see {PROG} --help)")
    session_ms = values["session_timeout_ms"]
    if not 1000 <= session_ms <= 30 * 60_000:
        raise UsageError("--session-timeout-ms is 1000 to 1800000")
    return TablesConfig(
        pm=values["pm"],
        catalog=values["catalog"],
        warehouse=values["warehouse"],
        group=values["group"],
        member_id=values["member_id"],
        session_timeout_s=session_ms / 1000,
        target_file_bytes=values["target_file_bytes"],
        max_gathered_bytes=values["max_gathered_bytes"],
        maintenance_interval_s=values["maintenance_interval_ms"] / 1000,
        metrics_listen=values["metrics_listen"],
        log_level=values["log_level"],
    )
