"""Running one ``sbp`` command: ``trio.run``, the connections it needs, and
every failure turned into one line on stderr and an exit code (docs/cli.md).
``client.cli`` parses the command line and imports this only then, so that
``sbp --help`` and a bad argument load none of it."""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import trio

from net.pool import ConnectionPool
from net.service import UsageError
from net.tls import TLSSettings
from sbp.allocator import keep_freed_memory
from sbp.enums import ErrorCode
from sbp.errors import ConnectionClosed, ProtocolError, RecordsUnreachableError, SBPError

from .cli_commands import Command, Env
from .cli_defaults import (
    EXIT_CONNECT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SERVER_ERROR,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    LOCAL_PKI,
)
from .pm_client import PMClient


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
        if isinstance(leaf, RecordsUnreachableError) and leaf.unreachable:
            return EXIT_CONNECT, str(leaf)
        if isinstance(leaf, trio.TooSlowError):
            return EXIT_TIMEOUT, "no answer in time (see --timeout)"
        if isinstance(leaf, SBPError):
            return EXIT_SERVER_ERROR, str(leaf)
        if isinstance(leaf, KeyboardInterrupt):
            return EXIT_INTERRUPTED, "interrupted"
    return None


#: commands that may rightly run for long: --timeout bounds each wait, not the whole
LONG_RUNNING: frozenset[str] = frozenset(
    {"cmd_append", "cmd_read", "cmd_tail", "cmd_top", "cmd_nodes_drain"}
)
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


async def run_command(
    args: argparse.Namespace, command: Command, out: IO[str], err: IO[str]
) -> int:
    async with ConnectionPool(tls=client_tls(args)) as pool:
        pm = PMClient(args.pm, pool=pool, timeout=args.timeout)
        env = Env(args, pm, pool, out, err)
        if command.__name__ in LONG_RUNNING:
            return await command(env)
        with trio.fail_after(args.timeout + ANSWER_GRACE_S):
            return await command(env)


def run(args: argparse.Namespace, command: Command, out: IO[str]) -> int:
    """Run the parsed command; its exit code (see ``client.cli``)."""
    err = sys.stderr
    # What the library logs (a bad frame from a peer, say) is said again,
    # in one line, by the error the command ends with.
    logging.getLogger().addHandler(logging.NullHandler())
    keep_freed_memory()  # `sbp read` receives a megabyte per FETCH (sbp/allocator.py)
    try:
        return trio.run(run_command, args, command, out, err)
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
