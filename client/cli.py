"""``sbp``: the command line of an SBP cluster, spoken to through its PM.

The commands live in ``client.cli_commands``; this module parses the
command line, runs the chosen command in ``trio.run`` and turns every
failure into one line on stderr and an exit code (docs/cli.md):

====  ==========================================================
0     success
1     the server answered with an error (its code's name is printed)
2     bad arguments or input
3     cannot connect to the PM or a data node
4     no answer within ``--timeout``
130   interrupted (Ctrl-C)
====  ==========================================================

``--timeout`` is the whole command's deadline, except for ``append``,
``read``, ``tail`` and ``top``, which may rightly run for long: there it
bounds each wait for the cluster (a batch not stored within it fails the
append; a read gives up after failing that long).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, NoReturn

from net.address import parse_address_list
from net.sizes import parse_size
from sbp.constants import MAX_GROUP_NAME_BYTES
from tables.defaults import default_catalog, default_warehouse

from .cli_defaults import DEFAULT_PM, DEFAULT_TIMEOUT_S, EXIT_INTERRUPTED, EXIT_USAGE, LOCAL_PKI

if TYPE_CHECKING:
    from .cli_commands import Command


@dataclass(frozen=True)
class CommandRef:
    """A command function by module and name, imported once it is run (or
    its ``--help`` shown): parsing the command line loads none of them."""

    module: str
    name: str

    def load(self) -> Command:
        command: Command = getattr(importlib.import_module(f"client.{self.module}"), self.name)
        return command


class _Parser(argparse.ArgumentParser):
    """Takes a command's description from its docstring, when shown; says a
    usage error in one line, and where the usage is, not the usage itself."""

    def format_help(self) -> str:
        ref = self._defaults.get("command")
        if isinstance(ref, CommandRef) and self.description is None:
            self.description = ref.load().__doc__
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------- parsing


def _addresses(text: str) -> str:
    """One PM's address, or several PMs on etcd, comma-separated."""
    try:
        parse_address_list(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def _integer(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high:,}" if high is not None else f">= {low}"
        raise argparse.ArgumentTypeError(f"must be {bound}: {text!r}")
    return value


def _non_negative(text: str) -> int:
    return _integer(text, 0)


def _positive(text: str) -> int:
    return _integer(text, 1)


#: stream ids and offsets are int64 on the wire
_INT64_MAX = (1 << 63) - 1


def _table_interval(text: str) -> int:
    """``--table-interval``: a duration of at least 100 ms, or ``off`` (-1)."""
    if text == "off":
        return -1
    value = _duration_ms(text)
    if value < 100:
        raise argparse.ArgumentTypeError(f"a table is committed at most every 100ms, not {text}")
    return value


def _local_retention(text: str) -> int:
    """``--local-retention``: a duration (0: leave the disks once copied),
    or ``off`` (-1: not tiered)."""
    if text == "off":
        return -1
    return _duration_ms(text)


def _subscription(text: str) -> list[int] | str:
    """``--subscribe``: stream ids, comma-separated, or ``all``."""
    if text == "all":
        return text
    try:
        ids = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"stream ids, comma-separated, or all: {text!r}") from None
    if not ids or ids[0] < 1:
        raise argparse.ArgumentTypeError(f"stream ids are at least 1: {text!r}")
    return ids


def _stream_id(text: str) -> int:
    return _integer(text, 1, _INT64_MAX)


def _size(text: str) -> int:
    """A byte count such as 1048576, 512MiB or 10GiB."""
    try:
        size = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size > _INT64_MAX:
        raise argparse.ArgumentTypeError(f"too large: {text!r}")
    return size


def _node_id(text: str) -> int:
    return _integer(text, 0, (1 << 31) - 1)


def _offset(text: str) -> int:
    return _integer(text, 0, _INT64_MAX)


def _replicas(text: str) -> int:
    return _integer(text, 1, 127)


def _acks(text: str) -> int:
    return _integer(text, 0, 127)


def _separator(text: str) -> str:
    """A key separator: TAB names a tab (hard to type in a shell)."""
    separator = {"TAB": "\t", "\\t": "\t"}.get(text, text)
    if not separator or "\n" in separator:
        raise argparse.ArgumentTypeError("a key separator is one or more characters, not a newline")
    return separator


def _header(text: str) -> tuple[str, bytes]:
    from .record_input import parse_header

    try:
        return parse_header(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _group(text: str) -> str:
    size = len(text.encode())
    if not 1 <= size <= MAX_GROUP_NAME_BYTES:
        raise argparse.ArgumentTypeError(
            f"a group name is 1 to {MAX_GROUP_NAME_BYTES} bytes, not {size}"
        )
    return text


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _moment(text: str) -> int:
    """A time as ms since the Unix epoch: a duration ago (``10m``) or an ISO
    date and time (local unless it names a zone); never in the future."""
    now = time.time()
    duration = _DURATION.match(text.strip())
    if duration is not None:
        moment = now - float(duration.group(1)) * _UNIT_S[duration.group(2)]
    else:
        try:
            parsed = datetime.datetime.fromisoformat(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a duration (10m, 2h) or a date and time (2026-11-27T10:00): {text!r}"
            ) from None
        moment = parsed.timestamp()  # a naive time is local time
    if moment > now + 1:
        raise argparse.ArgumentTypeError(f"{text!r} is in the future")
    return int(moment * 1000)


def _duration_ms(text: str) -> int:
    """A span of time as ms: 250ms, 90s, 10m, 2h, 1d, or a number of ms."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    duration = _DURATION.match(text)
    if duration is None:
        raise argparse.ArgumentTypeError(f"not a duration (250ms, 90s, 10m, 2h, 1d): {text!r}")
    return int(float(duration.group(1)) * _UNIT_S[duration.group(2)] * 1000)


def _reset_target(text: str) -> tuple[str, int]:
    if text in ("earliest", "latest"):
        return text, 0
    if text.isdigit():
        return "offset", _offset(text)
    return "time", _moment(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _command(parser: argparse.ArgumentParser, module: str, name: str) -> None:
    parser.set_defaults(command=CommandRef(module, name))
    # Also after the command (`sbp streams list --json`); SUPPRESS keeps the
    # global flag's value when this one is not given.
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="sbp",
        formatter_class=formatter,
        description="Work with an SBP cluster through its placement manager (PM).",
        epilog=(
            "exit codes: 0 ok, 1 the server answered with an error, 2 bad arguments or input,\n"
            "3 cannot connect, 4 no answer within --timeout, 130 interrupted.\n"
            "See docs/cli.md. Start a local cluster with `sbp-cluster` (or `make run`)."
        ),
    )
    parser.add_argument(
        "--pm",
        type=_addresses,
        default=os.environ.get("SBP_PM", DEFAULT_PM),
        metavar="HOST:PORT[,HOST:PORT...]",
        help=f"the PM's address, or several PMs on etcd, comma-separated (the leader is found "
        f"and followed; default: $SBP_PM, else {DEFAULT_PM}, the local cluster's)",
    )
    parser.add_argument(
        "--tls-ca",
        default=os.environ.get("SBP_TLS_CA"),
        metavar="FILE",
        help="speak TLS, checking the servers against this CA certificate (default: "
        f"$SBP_TLS_CA; else {LOCAL_PKI}/ca.pem when it exists, as `sbp-cluster --tls` makes it)",
    )
    parser.add_argument(
        "--tls-cert",
        default=os.environ.get("SBP_TLS_CERT"),
        metavar="FILE",
        help="present this client certificate (mutual TLS; default: $SBP_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key",
        default=os.environ.get("SBP_TLS_KEY"),
        metavar="FILE",
        help="the private key of --tls-cert (default: $SBP_TLS_KEY)",
    )
    parser.add_argument(
        "--no-tls",
        action="store_true",
        help=f"speak plain SBP, whatever the TLS flags, variables or {LOCAL_PKI}/ say",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"give up on an answer after this long (default: {DEFAULT_TIMEOUT_S:g})",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    ping = commands.add_parser("ping", help="check that the PM answers")
    ping.add_argument("--all", action="store_true", help="also PING every data node the PM knows")
    _command(ping, "cli_commands", "cmd_ping")

    streams = commands.add_parser("streams", help="create, list, change and delete streams")
    stream_commands = streams.add_subparsers(metavar="ACTION", required=True)
    create = stream_commands.add_parser("create", help="create streams")
    create.add_argument("--replicas", type=_replicas, default=1, help="replicas (default: 1)")
    create.add_argument(
        "--acks",
        type=_acks,
        default=0,
        help="replicas that must hold a record before it is acknowledged (default: 0, "
        "a majority of --replicas)",
    )
    create.add_argument(
        "--retention-ms",
        type=_non_negative,
        default=0,
        metavar="MS",
        help="drop records older than this; 0 keeps them forever (default)",
    )
    create.add_argument(
        "--retention-bytes",
        type=_size,
        default=0,
        metavar="SIZE",
        help="keep at most about this many bytes, dropping the oldest records first, "
        "e.g. 10GiB; 0 sets no limit (default)",
    )
    create.add_argument(
        "--compact",
        action="store_true",
        help="keep each key's latest record, not a history (SPEC §13; records need keys); "
        "with --retention-ms or --retention-bytes, retention applies too",
    )
    create.add_argument("--count", type=_positive, default=1, help="streams to create (default: 1)")
    _command(create, "cli_commands", "cmd_streams_create")
    listing = stream_commands.add_parser("list", help="list every stream")
    _command(listing, "cli_commands", "cmd_streams_list")
    describe = stream_commands.add_parser(
        "describe", help="a stream's settings and its ranges, with where each one is"
    )
    describe.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    _command(describe, "cli_commands", "cmd_streams_describe")
    get = stream_commands.add_parser("get", help="show streams by id")
    get.add_argument("stream_ids", type=_stream_id, nargs="+", metavar="STREAM")
    _command(get, "cli_commands", "cmd_streams_get")
    update = stream_commands.add_parser("update", help="change a stream's settings")
    update.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    update.add_argument("--replicas", type=_replicas, help="new replica count")
    update.add_argument("--acks", type=_acks, help="new acks (replicas holding a record)")
    update.add_argument("--retention-ms", type=_non_negative, metavar="MS", help="new retention")
    update.add_argument(
        "--retention-bytes",
        type=_size,
        metavar="SIZE",
        help="new size limit, e.g. 10GiB; 0 removes it",
    )
    update.add_argument(
        "--compact",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="turn compaction on (refused while the stream holds records without keys) "
        "or off (--no-compact)",
    )
    _command(update, "cli_commands", "cmd_streams_update")
    for sub, defaults in ((create, True), (update, False)):
        sub.add_argument(
            "--compact-lag",
            type=_duration_ms,
            default=0 if defaults else None,
            metavar="DURATION",
            help="a record stays uncompacted at least this long (90s, 10m, 1h, 1d or ms"
            + ("; default 0)" if defaults else ")"),
        )
        sub.add_argument(
            "--delete-retention",
            type=_duration_ms,
            default=86_400_000 if defaults else None,
            metavar="DURATION",
            help="a tombstone is kept this long once it is its key's latest record"
            + (" (default 1d)" if defaults else ""),
        )
        sub.add_argument(
            "--table-interval",
            type=_table_interval,
            default=-1 if defaults else None,
            metavar="DURATION",
            help="keep the stream also as the Iceberg table sbp.stream_<id>, committed this "
            "often (at least 100ms; 1m, 10s …; off turns it off; docs/tables.md)",
        )
        sub.add_argument(
            "--local-retention",
            type=_local_retention,
            default=-1 if defaults else None,
            metavar="DURATION",
            help="tier the stream: copy its sealed ranges to the object store and drop them "
            "from the data nodes once this old (0, 1h, 7d …; off: not tiered; needs a cluster "
            "with an object store; docs/operations.md#tiered-storage)",
        )
    delete = stream_commands.add_parser("delete", help="delete streams and their records")
    delete.add_argument("stream_ids", type=_stream_id, nargs="+", metavar="STREAM")
    _command(delete, "cli_commands", "cmd_streams_delete")
    trim = stream_commands.add_parser("trim", help="drop records below an offset")
    trim.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    trim.add_argument("offset", type=_offset, metavar="OFFSET")
    _command(trim, "cli_commands", "cmd_streams_trim")

    ranges = commands.add_parser("ranges", help="list, describe and seal ranges")
    range_commands = ranges.add_subparsers(metavar="ACTION", required=True)
    list_ranges = range_commands.add_parser("list", help="a stream's ranges, or a node's")
    list_ranges.add_argument("stream_id", type=_stream_id, nargs="?", metavar="STREAM")
    list_ranges.add_argument("--node", type=_non_negative, metavar="NODE_ID", help="a data node")
    _command(list_ranges, "cli_commands", "cmd_ranges_list")
    describe = range_commands.add_parser("describe", help="one range")
    describe.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    describe.add_argument("range_index", type=_non_negative, metavar="RANGE")
    _command(describe, "cli_commands", "cmd_ranges_describe")
    seal = range_commands.add_parser("seal", help="seal a range and open the next")
    seal.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    seal.add_argument(
        "range_index", type=_non_negative, nargs="?", metavar="RANGE", help="default: the open one"
    )
    _command(seal, "cli_commands", "cmd_ranges_seal")

    append = commands.add_parser(
        "append",
        help="append lines of input as records",
        description=(
            "Append each line of FILE (or stdin) as one record; line ends are not stored. "
            "Prints the offsets given to the first and last record. Each record is stored "
            "once however often the cluster's answers are lost (an idempotent producer). "
            "To run the same input again after an interruption without storing twice, "
            "give every run the same --producer-name and --resume: the stream says how "
            "many records that producer stored, and those lines are skipped."
        ),
    )
    append.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    append.add_argument("file", nargs="?", metavar="FILE", help="input file (default: stdin)")
    append.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr even when it is not a terminal",
    )
    append.add_argument(
        "--key-separator",
        type=_separator,
        metavar="SEP",
        help="each line is KEY<SEP>VALUE (TAB names a tab); a line without SEP has no key",
    )
    append.add_argument(
        "--header",
        type=_header,
        action="append",
        metavar="NAME=VALUE",
        help="add this header to every record (again for more; names may repeat)",
    )
    append.add_argument(
        "--input",
        choices=("lines", "json"),
        default="lines",
        help="lines (default): each line a value; json: each line a JSON object with "
        "value, key, headers and timestamp_ms, as `sbp read --json` prints them",
    )
    append.add_argument(
        "--producer-name",
        metavar="NAME",
        default="",
        help="append as the named producer: it keeps its id, and a new run fences one "
        "still running",
    )
    append.add_argument(
        "--resume",
        action="store_true",
        help="with --producer-name: continue the named producer's last run over the same "
        "input, skipping the lines the stream already holds from it",
    )
    _command(append, "cli_append", "cmd_append")

    read = commands.add_parser("read", help="print a stream's records")
    tail = commands.add_parser("tail", help="follow a stream as it grows")
    for sub, default_from, from_help in (
        (read, None, "first offset to read (default: the stream's first stored offset)"),
        (tail, None, "first offset (default: the stream's end, only new records)"),
    ):
        sub.add_argument(
            "stream_id",
            type=_stream_id,
            metavar="STREAM",
            nargs="?" if sub is read else None,
            help="the stream (read --group G --subscribe: none)" if sub is read else None,
        )
        sub.add_argument(
            "--from",
            dest="from_offset",
            type=_offset,
            default=default_from,
            metavar="OFFSET",
            help=from_help,
        )
        sub.add_argument("--count", type=_positive, metavar="N", help="stop after N records")
        sub.add_argument("--hex", action="store_true", help="print values as hex")
        sub.add_argument("--offsets", action="store_true", help="print OFFSET<TAB>VALUE")
        sub.add_argument(
            "--keys",
            action="store_true",
            help="print KEY<SEP>VALUE (SEP: --key-separator, a tab by default)",
        )
        sub.add_argument(
            "--headers",
            action="store_true",
            help="print each record's headers first, as name=value,name=value<TAB>",
        )
        sub.add_argument(
            "--key-separator",
            type=_separator,
            default="\t",
            metavar="SEP",
            help="what --keys puts between key and value (TAB, the default, names a tab)",
        )
        sub.add_argument(
            "--stats",
            action="store_true",
            help="print only a count of records and bytes and the offset span",
        )
    read.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr even when it is not a terminal (shown on a terminal "
        "when the records go to a file or a pipe, or with --stats)",
    )
    _command(read, "cli_read", "cmd_read")
    _command(tail, "cli_read", "cmd_tail")

    read.add_argument(
        "--group",
        type=_group,
        metavar="GROUP",
        help="start where this consumer group stopped (else at --from, --since or the start)",
    )
    read.add_argument(
        "--commit",
        action="store_true",
        help="with --group: store the offset after the last record printed as its position "
        "(with --subscribe: every 5 s and on the way out)",
    )
    read.add_argument(
        "--subscribe",
        type=_subscription,
        metavar="STREAMS",
        help="with --group, instead of STREAM: read as a member of the group the streams "
        "the PM assigns it of these (1,2,3, or all), sharing them with the group's other "
        "members, until Ctrl-C or --count (SPEC §15)",
    )
    read.add_argument(
        "--to",
        dest="to_offset",
        type=_offset,
        metavar="OFFSET",
        help="stop before OFFSET (the records below it; default: the stream's end now)",
    )
    read.add_argument(
        "--until",
        type=_moment,
        metavar="TIME",
        help="stop before the first record appended at or after TIME (as --since takes it)",
    )
    for sub in (read, tail):
        sub.add_argument(
            "--since",
            type=_moment,
            metavar="TIME",
            help="start at the first record appended at or after TIME: a duration ago "
            "(90s, 10m, 2h, 1d) or a date and time (2026-11-27T10:00, local time unless it "
            "names a zone such as Z or +01:00)",
        )

    tables = commands.add_parser(
        "tables", help="streams kept as Iceberg tables: their end offsets and lag"
    )
    table_commands = tables.add_subparsers(metavar="ACTION", required=True)
    table_list = table_commands.add_parser("list", help="every tabled stream and its table")
    table_describe = table_commands.add_parser("describe", help="one stream's table")
    table_describe.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    for sub in (table_list, table_describe):
        sub.add_argument(
            "--catalog",
            default=default_catalog(),
            metavar="URI",
            help="the Iceberg catalog sbp-tables writes to (default: $SBP_CATALOG, else the "
            "local cluster's sqlite:///var/tables/catalog.db)",
        )
        sub.add_argument(
            "--warehouse",
            default=default_warehouse(),
            metavar="PATH_OR_URI",
            help="its warehouse (default: $SBP_WAREHOUSE, else var/tables/warehouse)",
        )
    _command(table_list, "cli_tables", "cmd_tables_list")
    _command(table_describe, "cli_tables", "cmd_tables_describe")

    groups = commands.add_parser("groups", help="consumer groups: positions and lag")
    group_commands = groups.add_subparsers(metavar="ACTION", required=True)
    group_list = group_commands.add_parser("list", help="groups, their streams and total lag")
    _command(group_list, "cli_groups", "cmd_groups_list")
    group_describe = group_commands.add_parser(
        "describe", help="a group's position, end and lag per stream"
    )
    group_describe.add_argument("group", type=_group, metavar="GROUP")
    _command(group_describe, "cli_groups", "cmd_groups_describe")
    group_reset = group_commands.add_parser(
        "reset",
        help="move a group's positions",
        description="Move the group's position on every stream it has one on (or on "
        "--stream) to the earliest offset, the latest (skip everything), an offset, or the "
        "first record appended at or after a time.",
    )
    group_reset.add_argument("group", type=_group, metavar="GROUP")
    group_reset.add_argument(
        "--to",
        type=_reset_target,
        required=True,
        metavar="WHERE",
        help="earliest, latest, an OFFSET, or a TIME as for read --since",
    )
    group_reset.add_argument("--stream", type=_stream_id, metavar="STREAM", help="this stream only")
    group_reset.add_argument(
        "--force",
        action="store_true",
        help="a group with live members: remove them first (they stop reading and join again)",
    )
    group_reset.add_argument(
        "--dry-run",
        action="store_true",
        help="print each position and where it would move; change nothing",
    )
    _command(group_reset, "cli_groups", "cmd_groups_reset")
    group_delete = group_commands.add_parser("delete", help="forget consumer groups")
    group_delete.add_argument("groups", type=_group, nargs="+", metavar="GROUP")
    group_delete.add_argument(
        "--force", action="store_true", help="groups with live members: remove them first"
    )
    _command(group_delete, "cli_groups", "cmd_groups_delete")

    cluster = commands.add_parser("cluster", help="the cluster's data nodes")
    cluster_commands = cluster.add_subparsers(metavar="ACTION", required=True)
    status = cluster_commands.add_parser("status", help="data nodes, liveness, load")
    _command(status, "cli_commands", "cmd_cluster_status")
    rebalance = cluster_commands.add_parser(
        "rebalance",
        help="move sealed ranges to even out the data nodes",
        description="Plan the moves of sealed ranges that bring the live data nodes' bytes "
        "and range counts within the PM's --rebalance-threshold, and start them. Each "
        "range is copied to its new node before it leaves the old one. See "
        "docs/operations.md.",
    )
    rebalance.add_argument("--dry-run", action="store_true", help="print the plan only")
    _command(rebalance, "cli_nodes", "cmd_cluster_rebalance")

    nodes = commands.add_parser("nodes", help="retire data nodes (SPEC §12)")
    node_commands = nodes.add_subparsers(metavar="ACTION", required=True)
    drain = node_commands.add_parser(
        "drain",
        help="move every range off data nodes so that they can be stopped",
        description="Mark data nodes draining: the PM places nothing new on them, seals "
        "their open ranges and copies each of their ranges to other live nodes before "
        "dropping them from its replicas. A drained node holds no range: stopping it "
        "loses nothing. See docs/operations.md.",
    )
    drain.add_argument("node_ids", type=_node_id, nargs="+", metavar="NODE")
    drain.add_argument(
        "--wait", action="store_true", help="follow the drain until every node is drained"
    )
    drain.add_argument("--cancel", action="store_true", help="make the nodes active again")
    drain.add_argument(
        "--progress",
        action="store_true",
        help="with --wait: show progress on stderr even when it is not a terminal",
    )
    _command(drain, "cli_nodes", "cmd_nodes_drain")
    remove = node_commands.add_parser(
        "remove",
        help="forget stopped data nodes that hold no range",
        description="Forget data nodes that are stopped (dead to the PM) and hold no range: "
        "drained ones, or ones never given a range. A node that still holds ranges, or "
        "that is alive, is refused.",
    )
    remove.add_argument("node_ids", type=_node_id, nargs="+", metavar="NODE")
    _command(remove, "cli_nodes", "cmd_nodes_remove")

    top = commands.add_parser("top", help="a live view of nodes, throughput, latency")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument(
        "--interval", type=_seconds, default=1.0, metavar="SECONDS", help="redraw every (1 s)"
    )
    _command(top, "top", "cmd_top")

    acl = commands.add_parser("acl", help="access control lists (SPEC §9)")
    acl_commands = acl.add_subparsers(metavar="ACTION", required=True)
    check = acl_commands.add_parser("check", help="validate an ACL file")
    check.add_argument("file", metavar="FILE", help="the JSON file a server's --acl-file names")
    _command(check, "cli_commands", "cmd_acl_check")
    return parser


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None, *, out: IO[str] | None = None) -> int:
    """Run ``sbp``; returns the exit code (see the module docstring)."""
    try:
        args = build_parser().parse_args(argv)
        command = args.command.load()
        from .cli_run import run
    except KeyboardInterrupt:  # Ctrl-C while the command's modules load
        print("sbp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return run(args, command, out or sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
