"""Process plumbing shared by the servers (data node, PM).

- ``Option`` lists and ``load_settings``: command-line flags, a TOML config
  file under them (``--config``), every value checked by the same parser
  whether it came from a flag or the file;
- ``parse_address`` / ``parse_size``: ``HOST:PORT`` and ``8GiB``;
- ``configure_logging``, ``announce`` (the machine-readable address lines);
- ``run_main``: a ``main()`` wrapper that turns start-up failures into one
  line on stderr and an exit code, never a traceback;
- ``ShutdownSignals``: SIGTERM/SIGINT as trio events, for a graceful drain;
- ``MetricsHTTPServer``: prometheus-client's /metrics endpoint on an address.

Exit codes: 0 clean stop, 1 a runtime failure (busy port, unusable data
directory), 2 a usage error (bad flag, bad config file), 130 interrupted
before the service could install its signal handlers.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import tomllib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import start_http_server

from sbp.constants import DEFAULT_MAX_FRAME_LENGTH, MIN_FRAME_LENGTH

logger = logging.getLogger(__name__)

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130

#: the prefix of the line a server prints once it accepts connections;
#: tools (tests, the local cluster) read the address that follows it
LISTENING_PREFIX: Final = "listening on "
#: the prefix of the line giving the /metrics address
METRICS_PREFIX: Final = "metrics on "

LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ServiceError(Exception):
    """A failure to report as one line and exit code 1 (no traceback)."""

    exit_code: int = EXIT_FAILURE


class UsageError(ServiceError):
    """A bad flag or config value: one line, exit code 2."""

    exit_code = EXIT_USAGE


# -- values ---------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS: Final = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) as ``(host, port)``; port 0
    means any free port."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} is outside 0-65535")
    return host, port


def format_address(host: str, port: int) -> str:
    """The inverse of ``parse_address``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_size(text: str) -> int:
    """A byte count: ``1048576``, ``64KiB``, ``512MiB``, ``8GiB`` (binary units;
    ``8G`` and ``8GB`` mean the same)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size such as 65536, 512MiB or 8GiB")
    number, unit = match.groups()
    return int(number) * _SIZE_UNITS[(unit or "")[:1].lower()]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{value} is negative")
    return value


# -- flags and config file ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Option:
    """One setting, given as ``--name VALUE`` or as ``name = VALUE`` in the
    config file (dashes or underscores alike). ``parse`` turns the
    text into the value and raises ``ValueError`` on a bad one; a value from
    the config file goes through the same ``parse``."""

    name: str
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    choices: Sequence[str] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


#: the defaults both servers use for the settings below
DEFAULT_MAX_CONNECTIONS: Final = 1024
DEFAULT_MAX_IN_FLIGHT: Final = 256
DEFAULT_DRAIN_TIMEOUT_S: Final = 10


def listen_options() -> tuple[Option, Option]:
    """``--listen`` and ``--metrics-listen``, as both servers take them."""
    return (
        Option(
            "listen",
            "address to serve SBP on; port 0 picks a free port, and the bound address is "
            "printed on stdout as 'listening on HOST:PORT'",
            parse_address,
            default="127.0.0.1:0",
            metavar="HOST:PORT",
        ),
        Option(
            "metrics-listen",
            "serve Prometheus /metrics on this address; the bound address is printed as "
            "'metrics on HOST:PORT' (default: no metrics endpoint)",
            parse_address,
            metavar="HOST:PORT",
        ),
    )


def serving_limit_options() -> tuple[Option, ...]:
    """The limits of serving SBP, as both servers take them."""
    return (
        Option(
            "max-frame-bytes",
            "largest frame accepted; a larger one closes the connection",
            parse_size,
            default=str(DEFAULT_MAX_FRAME_LENGTH),
            metavar="BYTES",
        ),
        Option(
            "max-connections",
            "connections served at once; more are refused with GOAWAY",
            positive_int,
            default=str(DEFAULT_MAX_CONNECTIONS),
            metavar="N",
        ),
        Option(
            "max-in-flight",
            "requests served at once per connection; at the limit the server stops reading "
            "from that connection (backpressure, nothing is dropped)",
            positive_int,
            default=str(DEFAULT_MAX_IN_FLIGHT),
            metavar="N",
        ),
        Option(
            "drain-timeout-s",
            "on SIGTERM, how long requests in flight get to finish",
            non_negative_int,
            default=str(DEFAULT_DRAIN_TIMEOUT_S),
            metavar="SECONDS",
        ),
    )


def check_storage_settings(values: dict[str, Any]) -> None:
    """The checks both servers make: a data directory, sane frame and map sizes."""
    if values["data_dir"] is None:
        raise UsageError("--data-dir is required (or data-dir in the config file)")
    if values["max_frame_bytes"] < MIN_FRAME_LENGTH:
        raise UsageError(f"--max-frame-bytes must be at least {MIN_FRAME_LENGTH}")
    if values["map_size"] < 1 << 20:
        raise UsageError("--map-size must be at least 1MiB")


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors become ``UsageError`` (one line)."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{message} (see --help)")


def build_parser(
    prog: str, description: str, options: Sequence[Option], epilog: str | None = None
) -> argparse.ArgumentParser:
    """The argument parser for ``options`` plus ``--config`` and ``--log-level``."""
    parser = _Parser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file with any of the settings below (keys are flag names without "
        "the dashes); flags given on the command line override it",
    )
    for option in options:
        default = f" (default: {option.default})" if option.default is not None else ""
        parser.add_argument(
            f"--{option.name}",
            dest=option.dest,
            metavar=option.metavar or _metavar(option),
            type=_checked(option),
            help=option.help + default,
        )
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        help="log verbosity on stderr (default: info)",
    )
    return parser


def _metavar(option: Option) -> str:
    if option.choices is not None:
        return "{" + ",".join(option.choices) + "}"
    return option.dest.upper()


def _checked(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if option.choices is not None and text not in option.choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(option.choices)}")
        try:
            return option.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = option.name
    return convert


def load_settings(
    parser: argparse.ArgumentParser, options: Sequence[Option], argv: Sequence[str] | None
) -> dict[str, Any]:
    """Every option's value, by ``dest``: the flag when given, else the config
    file's key, else the default (parsed too, when written as text). Also
    ``log_level`` and ``config``."""
    given = vars(parser.parse_args(argv))
    # Defaults may be written as text (as --help shows them) and go through
    # the same parser as a flag would.
    settings: dict[str, Any] = {
        option.dest: option.parse(option.default)
        if isinstance(option.default, str)
        else option.default
        for option in options
    }
    settings["log_level"] = "info"
    settings["config"] = given.get("config")
    if given.get("config"):
        settings.update(read_config_file(Path(given["config"]), options))
    settings.update({key: value for key, value in given.items() if value is not None})
    return settings


def read_config_file(path: Path, options: Sequence[Option]) -> dict[str, Any]:
    """The settings in a TOML file, each checked by its option's parser.
    An unknown key is an error (a typo must not be silently ignored)."""
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except OSError as error:
        raise UsageError(f"cannot read config file {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"config file {path} is not valid TOML: {error}") from None
    by_key = {option.dest: option for option in options}
    settings: dict[str, Any] = {}
    for key, value in document.items():
        dest = key.replace("-", "_")
        if dest == "log_level":
            if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
                raise UsageError(f"{path}: log-level must be one of {', '.join(LOG_LEVELS)}")
            settings[dest] = value.lower()
            continue
        option = by_key.get(dest)
        if option is None:
            raise UsageError(f"{path}: unknown key {key!r}")
        if isinstance(value, dict | list | bool):
            raise UsageError(f"{path}: {key} must be a string or a number")
        try:
            settings[dest] = _checked(option)(str(value))
        except argparse.ArgumentTypeError as error:
            raise UsageError(f"{path}: {key}: {error}") from None
    return settings


# -- output -----------------------------------------------------------------------


def configure_logging(level: str) -> None:
    """Log records of ``level`` and above to stderr."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def announce(prefix: str, host: str, port: int) -> None:
    """Print ``<prefix>HOST:PORT`` on one line of stdout, flushed at once:
    the machine-readable form tools wait for.

    One ``write`` of the whole line: ``print`` writes the newline separately,
    and with unbuffered output (``PYTHONUNBUFFERED``) a log line sent to the
    same file in between would end up inside the address."""
    sys.stdout.write(f"{prefix}{format_address(host, port)}\n")
    sys.stdout.flush()


# -- main() -------------------------------------------------------------------------


def run_main(prog: str, body: Callable[[], int]) -> int:
    """Run ``body`` (which parses its flags and runs the service) and turn the
    failures a user can fix into one line on stderr and an exit code."""
    try:
        return body()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BaseException as raised:
        error = _reportable(raised)
        if error is None:
            raise
        print(f"{prog}: error: {_describe(error)}", file=sys.stderr, flush=True)
        return error.exit_code if isinstance(error, ServiceError) else EXIT_FAILURE


def _reportable(error: BaseException) -> ServiceError | OSError | None:
    """The one user-facing error inside ``error`` (unwrapping exception
    groups that trio's nurseries add), or None for anything else (a bug)."""
    if isinstance(error, ServiceError | OSError):
        return error
    if isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        return _reportable(error.exceptions[0])
    return None


def _describe(error: ServiceError | OSError) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror}{where}"
    return str(error)


# -- signals ------------------------------------------------------------------------


#: a launcher's pid, in its children's environment: they stop when it is gone
PARENT_ENV: Final = "SBP_EXIT_WITH_PARENT"
PARENT_CHECK_S: Final = 1.0


class ShutdownSignals:
    """SIGTERM and SIGINT as events: the first sets ``requested`` (drain
    gracefully), a second one sets ``forced`` (stop waiting for the drain).

    Use as ``with ShutdownSignals() as signals: nursery.start_soon(signals.watch)``;
    the handlers are installed on entry, so a signal that arrives during
    start-up is not lost.
    """

    def __init__(self) -> None:
        self.requested = trio.Event()
        self.forced = trio.Event()
        self.received: list[int] = []
        self._receiver: contextlib.AbstractContextManager[AsyncIterator[int]] | None = None
        self._channel: AsyncIterator[int] | None = None

    def __enter__(self) -> ShutdownSignals:
        receiver = trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
        self._channel = receiver.__enter__()
        self._receiver = receiver
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._receiver is not None:
            self._receiver.__exit__(exc_type, exc, tb)

    async def watch(self) -> None:
        """Turn received signals into the two events; runs until cancelled.

        A server started by a launcher that sets ``SBP_EXIT_WITH_PARENT`` to
        its pid (``sbp-cluster``) also drains when that process is gone, even
        killed with SIGKILL, so no server is left serving on its own.
        """
        if self._channel is None:
            raise RuntimeError("enter the ShutdownSignals context first")
        async with trio.open_nursery() as nursery:
            parent = os.environ.get(PARENT_ENV, "")
            if parent.isdigit():
                nursery.start_soon(self._watch_parent, int(parent))
            await self._watch_signals()
            nursery.cancel_scope.cancel()

    async def _watch_parent(self, parent: int) -> None:
        while os.getppid() == parent:
            await trio.sleep(PARENT_CHECK_S)
        if not self.requested.is_set():
            logger.warning("the launching process (pid %d) is gone: draining connections", parent)
            self.requested.set()

    async def _watch_signals(self) -> None:
        assert self._channel is not None
        async for signum in self._channel:
            self.received.append(signum)
            name = signal.Signals(signum).name
            if not self.requested.is_set():
                logger.info("%s received: draining connections", name)
                self.requested.set()
            else:
                logger.warning("%s received again: stopping without waiting", name)
                self.forced.set()


# -- /metrics -------------------------------------------------------------------------


class MetricsHTTPServer:
    """prometheus-client's HTTP exposition of ``registry`` on ``host:port``,
    served by a daemon thread (scrapes never touch the event loop)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        # Binds here, so a busy port fails start-up with an OSError.
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        bound = self._server.server_address
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    @classmethod
    @contextlib.contextmanager
    def running(
        cls, registry: CollectorRegistry, host: str, port: int
    ) -> Iterator[MetricsHTTPServer]:
        server = cls(registry, host, port)
        try:
            yield server
        finally:
            server.close()
