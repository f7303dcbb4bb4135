"""The servers' settings: ``Option`` lists and ``load_settings`` (command-line
flags, a TOML config file under them with ``--config``, every value checked
by the same parser whether it came from a flag or the file), the values'
parsers (``parse_size`` …) and the checks both servers make (frame and LMDB
map sizes)."""

from __future__ import annotations

import argparse
import ssl
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sbp.constants import DEFAULT_MAX_FRAME_LENGTH, MIN_FRAME_LENGTH

from .address import parse_address
from .service import LOG_LEVELS, UsageError
from .sizes import parse_size
from .tls import ServerSecurity, TLSSettings

# -- values ---------------------------------------------------------------------


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


def security_options() -> tuple[Option, ...]:
    """TLS, mutual TLS and ACLs (SPEC §9), as both servers take them."""
    return (
        Option(
            "tls-cert",
            "serve TLS with this certificate (PEM); the connections this server opens "
            "present it too",
            Path,
            metavar="FILE",
        ),
        Option("tls-key", "the private key of --tls-cert (PEM)", Path, metavar="FILE"),
        Option(
            "tls-ca",
            "require client certificates signed by this CA (mutual TLS), and check the "
            "servers this one connects to against it",
            Path,
            metavar="FILE",
        ),
        Option(
            "acl-file",
            "authorize each request by the ACL entries of this JSON file (needs --tls-ca); "
            "SIGHUP reads it again",
            Path,
            metavar="FILE",
        ),
        Option(
            "metrics-tls-cert",
            "serve /metrics over HTTPS with this certificate (PEM)",
            Path,
            metavar="FILE",
        ),
        Option("metrics-tls-key", "the private key of --metrics-tls-cert", Path, metavar="FILE"),
    )


def security_settings(values: dict[str, Any]) -> ServerSecurity:
    """The checked security settings: files that go together are given
    together, and every file is read now, so that a bad one stops start-up
    with one line rather than the first handshake."""
    cert, key, ca = values["tls_cert"], values["tls_key"], values["tls_ca"]
    if (cert is None) != (key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    if ca is not None and cert is None:
        raise UsageError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
    if values["acl_file"] is not None and ca is None:
        raise UsageError(
            "--acl-file needs mutual TLS (--tls-ca): without client certificates every "
            "peer is anonymous"
        )
    metrics_cert, metrics_key = values["metrics_tls_cert"], values["metrics_tls_key"]
    if (metrics_cert is None) != (metrics_key is None):
        raise UsageError("--metrics-tls-cert and --metrics-tls-key go together")
    if metrics_cert is not None and values["metrics_listen"] is None:
        raise UsageError("--metrics-tls-cert needs --metrics-listen")
    security = ServerSecurity(
        tls=TLSSettings(ca=ca, cert=cert, key=key) if cert is not None else None,
        acl_file=values["acl_file"],
        metrics_cert=metrics_cert,
        metrics_key=metrics_key,
    )
    try:
        security.check()
    except (OSError, ssl.SSLError, ValueError) as error:
        raise UsageError(str(error)) from None
    return security


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
            "max-request-bytes",
            "bytes of requests all connections together may hold while they are received "
            "or served (half-sent frames included); past it, connections holding some are "
            "not read from until requests finish",
            parse_size,
            default="256MiB",
            metavar="BYTES",
        ),
        Option(
            "max-answer-bytes",
            "bytes of answers all connections together may hold read but not yet written "
            "(FETCH data for peers slow to read); past it, reads for answers wait",
            parse_size,
            default="256MiB",
            metavar="BYTES",
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
    for name in ("max_request_bytes", "max_answer_bytes"):
        if values[name] < values["max_frame_bytes"]:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be at least --max-frame-bytes")
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
