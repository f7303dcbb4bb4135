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
import logging
import os
import ssl
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import trio

from net.address import parse_address_list
from net.pool import ConnectionPool
from net.service import UsageError
from net.tls import TLSSettings
from sbp.allocator import keep_freed_memory
from sbp.enums import ErrorCode
from sbp.errors import ConnectionClosed, ProtocolError, SBPError

from .cli_append import cmd_append
from .cli_commands import (
    DEFAULT_PM,
    DEFAULT_TIMEOUT_S,
    EXIT_CONNECT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SERVER_ERROR,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    LOCAL_PKI,
    Command,
    Env,
    cmd_acl_check,
    cmd_cluster_status,
    cmd_ping,
    cmd_ranges_describe,
    cmd_ranges_list,
    cmd_ranges_seal,
    cmd_read,
    cmd_streams_create,
    cmd_streams_delete,
    cmd_streams_get,
    cmd_streams_list,
    cmd_streams_trim,
    cmd_streams_update,
    cmd_tail,
)
from .pm_client import PMClient
from .top import cmd_top

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


def _stream_id(text: str) -> int:
    return _integer(text, 1, _INT64_MAX)


def _offset(text: str) -> int:
    return _integer(text, 0, _INT64_MAX)


def _replicas(text: str) -> int:
    return _integer(text, 1, 127)


def _acks(text: str) -> int:
    return _integer(text, 0, 127)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _command(parser: argparse.ArgumentParser, fn: Command) -> None:
    parser.set_defaults(command=fn)
    # Also after the command (`sbp streams list --json`); SUPPRESS keeps the
    # global flag's value when this one is not given.
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
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

    ping = commands.add_parser(
        "ping", help="check that the PM answers", description=cmd_ping.__doc__
    )
    ping.add_argument("--all", action="store_true", help="also PING every data node the PM knows")
    _command(ping, cmd_ping)

    streams = commands.add_parser("streams", help="create, list, change and delete streams")
    stream_commands = streams.add_subparsers(metavar="ACTION", required=True)
    create = stream_commands.add_parser(
        "create", help="create streams", description=cmd_streams_create.__doc__
    )
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
    create.add_argument("--count", type=_positive, default=1, help="streams to create (default: 1)")
    _command(create, cmd_streams_create)
    listing = stream_commands.add_parser(
        "list", help="list every stream", description=cmd_streams_list.__doc__
    )
    _command(listing, cmd_streams_list)
    get = stream_commands.add_parser(
        "get", help="show streams by id", description=cmd_streams_get.__doc__
    )
    get.add_argument("stream_ids", type=_stream_id, nargs="+", metavar="STREAM")
    _command(get, cmd_streams_get)
    update = stream_commands.add_parser(
        "update", help="change a stream's settings", description=cmd_streams_update.__doc__
    )
    update.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    update.add_argument("--replicas", type=_replicas, help="new replica count")
    update.add_argument("--acks", type=_acks, help="new acks (replicas holding a record)")
    update.add_argument("--retention-ms", type=_non_negative, metavar="MS", help="new retention")
    _command(update, cmd_streams_update)
    delete = stream_commands.add_parser(
        "delete", help="delete streams and their records", description=cmd_streams_delete.__doc__
    )
    delete.add_argument("stream_ids", type=_stream_id, nargs="+", metavar="STREAM")
    _command(delete, cmd_streams_delete)
    trim = stream_commands.add_parser(
        "trim", help="drop records below an offset", description=cmd_streams_trim.__doc__
    )
    trim.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    trim.add_argument("offset", type=_offset, metavar="OFFSET")
    _command(trim, cmd_streams_trim)

    ranges = commands.add_parser("ranges", help="list, describe and seal ranges")
    range_commands = ranges.add_subparsers(metavar="ACTION", required=True)
    list_ranges = range_commands.add_parser(
        "list", help="a stream's ranges, or a node's", description=cmd_ranges_list.__doc__
    )
    list_ranges.add_argument("stream_id", type=_stream_id, nargs="?", metavar="STREAM")
    list_ranges.add_argument("--node", type=_non_negative, metavar="NODE_ID", help="a data node")
    _command(list_ranges, cmd_ranges_list)
    describe = range_commands.add_parser(
        "describe", help="one range", description=cmd_ranges_describe.__doc__
    )
    describe.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    describe.add_argument("range_index", type=_non_negative, metavar="RANGE")
    _command(describe, cmd_ranges_describe)
    seal = range_commands.add_parser(
        "seal", help="seal a range and open the next", description=cmd_ranges_seal.__doc__
    )
    seal.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    seal.add_argument(
        "range_index", type=_non_negative, nargs="?", metavar="RANGE", help="default: the open one"
    )
    _command(seal, cmd_ranges_seal)

    append = commands.add_parser(
        "append",
        help="append lines of input as records",
        description=(
            "Append each line of FILE (or stdin) as one record; line ends are not stored. "
            "Prints the offsets given to the first and last record."
        ),
    )
    append.add_argument("stream_id", type=_stream_id, metavar="STREAM")
    append.add_argument("file", nargs="?", metavar="FILE", help="input file (default: stdin)")
    append.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr even when it is not a terminal",
    )
    _command(append, cmd_append)

    read = commands.add_parser(
        "read", help="print a stream's records", description=cmd_read.__doc__
    )
    tail = commands.add_parser(
        "tail", help="follow a stream as it grows", description=cmd_tail.__doc__
    )
    for sub, default_from, from_help in (
        (read, None, "first offset to read (default: the stream's first stored offset)"),
        (tail, None, "first offset (default: the stream's end, only new records)"),
    ):
        sub.add_argument("stream_id", type=_stream_id, metavar="STREAM")
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
    _command(read, cmd_read)
    _command(tail, cmd_tail)

    cluster = commands.add_parser("cluster", help="the cluster's data nodes")
    cluster_commands = cluster.add_subparsers(metavar="ACTION", required=True)
    status = cluster_commands.add_parser(
        "status", help="data nodes, liveness, load", description=cmd_cluster_status.__doc__
    )
    _command(status, cmd_cluster_status)

    top = commands.add_parser(
        "top", help="a live view of nodes, throughput, latency", description=cmd_top.__doc__
    )
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument(
        "--interval", type=_seconds, default=1.0, metavar="SECONDS", help="redraw every (1 s)"
    )
    _command(top, cmd_top)

    acl = commands.add_parser("acl", help="access control lists (SPEC §9)")
    acl_commands = acl.add_subparsers(metavar="ACTION", required=True)
    check = acl_commands.add_parser(
        "check", help="validate an ACL file", description=cmd_acl_check.__doc__
    )
    check.add_argument("file", metavar="FILE", help="the JSON file a server's --acl-file names")
    _command(check, cmd_acl_check)
    return parser


# --------------------------------------------------------------------------- main


def _leaf_errors(error: BaseException) -> Iterator[BaseException]:
    """The errors inside (nested) exception groups, in order."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaf_errors(inner)
    else:
        yield error


def describe_failure(error: BaseException) -> tuple[int, str] | None:
    """The exit code and one-line message for an error, or None if unexpected."""
    for leaf in _leaf_errors(error):
        if isinstance(leaf, UsageError):
            return EXIT_USAGE, str(leaf)
        if isinstance(leaf, ProtocolError):
            if leaf.code == ErrorCode.TIMEOUT:
                return EXIT_TIMEOUT, str(leaf)
            return EXIT_SERVER_ERROR, str(leaf)
        if isinstance(leaf, ConnectionClosed | OSError):
            return EXIT_CONNECT, f"cannot connect: {leaf}"
        if isinstance(leaf, trio.TooSlowError):
            return EXIT_TIMEOUT, "no answer in time (see --timeout)"
        if isinstance(leaf, SBPError):
            return EXIT_SERVER_ERROR, str(leaf)
        if isinstance(leaf, KeyboardInterrupt):
            return EXIT_INTERRUPTED, "interrupted"
    return None


#: commands that may rightly run for long: --timeout bounds each wait, not the whole
LONG_RUNNING: frozenset[Command] = frozenset({cmd_append, cmd_read, cmd_tail, cmd_top})
#: a one-shot command's server is given --timeout; its answer may take this much longer
ANSWER_GRACE_S = 0.25


def client_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS the command speaks: the flags (or ``SBP_TLS_*``); without any,
    the local cluster's certificates when ``sbp-cluster --tls`` made them."""
    if args.no_tls:
        return None
    ca, cert, key = args.tls_ca, args.tls_cert, args.tls_key
    if ca is None and cert is None and key is None:
        local = Path(LOCAL_PKI)
        if not (local / "ca.pem").is_file():
            return None
        ca, cert, key = local / "ca.pem", local / "client.pem", local / "client.key"
    if (cert is None) != (key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    settings = TLSSettings(
        ca=Path(ca) if ca else None,
        cert=Path(cert) if cert else None,
        key=Path(key) if key else None,
    )
    try:
        return settings.client_context()
    except (OSError, ssl.SSLError) as error:
        raise UsageError(f"cannot use the TLS files: {error}") from None


async def run_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    async with ConnectionPool(tls=client_tls(args)) as pool:
        pm = PMClient(args.pm, pool=pool, timeout=args.timeout)
        command: Command = args.command
        env = Env(args, pm, pool, out, err)
        if command in LONG_RUNNING:
            return await command(env)
        with trio.fail_after(args.timeout + ANSWER_GRACE_S):
            return await command(env)


def main(argv: Sequence[str] | None = None, *, out: IO[str] | None = None) -> int:
    """Run ``sbp``; returns the exit code (see the module docstring)."""
    out = out or sys.stdout
    err = sys.stderr
    args = build_parser().parse_args(argv)
    # What the library logs (a bad frame from a peer, say) is said again,
    # in one line, by the error the command ends with.
    logging.getLogger().addHandler(logging.NullHandler())
    keep_freed_memory()  # `sbp read` receives a megabyte per FETCH (sbp/allocator.py)
    try:
        return trio.run(run_command, args, out, err)
    except BaseException as error:  # one line for the user, never a traceback
        if any(isinstance(leaf, BrokenPipeError) for leaf in _leaf_errors(error)):
            # The reader went away (`sbp read 1 | head`): not an error.
            _silence_stdout()
            return EXIT_OK
        failure = describe_failure(error)
        if failure is None:
            if isinstance(error, SystemExit):
                raise
            failure = (EXIT_SERVER_ERROR, f"unexpected error: {error!r}")
        code, message = failure
        if code == EXIT_CONNECT:
            message += _tls_hint(message, tls_source(args))
        print(f"sbp: {message}", file=err)
        return code


def tls_source(args: argparse.Namespace) -> str:
    """Where the command's TLS settings came from ("" when it speaks plain SBP)."""
    if args.no_tls:
        return ""
    for flag, env in (("--tls-ca", "SBP_TLS_CA"), ("--tls-cert", "SBP_TLS_CERT")):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:
            return env if os.environ.get(env) == value else flag
    if (Path(LOCAL_PKI) / "ca.pem").is_file():
        return f"{LOCAL_PKI}/ in this directory (made by `sbp-cluster --tls`; --no-tls ignores it)"
    return ""


def _tls_hint(message: str, source: str) -> str:
    """What a connection that failed at once most likely means (SPEC §9: a
    TLS port closes a plain-text connection; a mutual-TLS one refuses a
    client without an acceptable certificate; a plain port answers a TLS
    handshake with an SBP frame)."""
    if not source and "closed the connection" in message:
        return " (if the server requires TLS, give --tls-ca, or set SBP_TLS_CA)"
    if source and "WRONG_VERSION_NUMBER" in message:
        return f" (the server speaks plain SBP, not TLS; the TLS settings came from {source})"
    if source and ("UNEXPECTED_EOF" in message or "CERTIFICATE" in message.upper()):
        return " (the server refused this client's certificate, or wants one: see --tls-cert)"
    return ""


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that exiting does not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
