"""The ``sbp`` source's options, checked once with errors that name the option.

Spark hands every option over as a string, with case-insensitive keys. Each
parser here turns one option into a typed value or raises
``SBPOptionError`` saying which option is wrong and what it accepts.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from sbp.constants import MAX_GROUP_NAME_BYTES

if TYPE_CHECKING:
    from net.tls import TLSSettings

#: ``streams`` value that selects every stream the PM knows
ALL_STREAMS: Final = "all"
#: offset spec values; in JSON, -2 stands for earliest and -1 for latest (as in Kafka)
EARLIEST: Final = "earliest"
LATEST: Final = "latest"
EARLIEST_CODE: Final = -2
LATEST_CODE: Final = -1

#: records one input partition reads at most (a long range becomes several)
DEFAULT_MAX_RECORDS_PER_PARTITION: Final = 1_000_000
#: records one micro-batch reads at most, over all streams (the default read limit)
DEFAULT_MAX_RECORDS_PER_TRIGGER: Final = 1_000_000
#: bytes one FETCH asks for; well under the 16 MiB frame limit
DEFAULT_FETCH_MAX_BYTES: Final = 1 << 20
#: bytes of values one appended record batch holds at most
DEFAULT_BATCH_MAX_BYTES: Final = 1 << 20
#: seconds one request to the PM or a data node may take
DEFAULT_TIMEOUT_S: Final = 30.0


class SBPOptionError(ValueError):
    """An option of the ``sbp`` source is missing, unknown or malformed."""


#: TLS to the cluster (SPEC §9): the CA that signed the servers' certificates,
#: and the certificate and key this job presents (mutual TLS)
TLS_OPTIONS: Final = ("tlsCa", "tlsCert", "tlsKey")
#: every option a read takes (docs/spark.md)
READ_OPTIONS: Final = (
    "pm",
    "streams",
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "endingTimestamp",
    "startingOffsetsByTimestamp",
    "endingOffsetsByTimestamp",
    "group",
    "failOnDataLoss",
    "maxRecordsPerPartition",
    "maxRecordsPerTrigger",
    "fetchMaxBytes",
    "timeoutMs",
    "includeHeaders",
    *TLS_OPTIONS,
)
#: every option a write takes
WRITE_OPTIONS: Final = ("pm", "stream", "batchMaxBytes", "timeoutMs", *TLS_OPTIONS)
#: Kafka source names with the same meaning here (offsets are dense, so
#: Kafka's offsets per trigger are records per trigger)
KAFKA_ALIASES: Final = {"maxOffsetsPerTrigger": "maxRecordsPerTrigger"}
#: keys Spark itself may pass along with the user's options
_SPARK_KEYS: Final = frozenset({"path", "checkpointlocation"})


def canonical_options(options: Mapping[str, str], known: Iterable[str]) -> dict[str, str]:
    """The options under their documented names (Spark lower-cases keys;
    Kafka's names become ours). An unknown option is an error that names the
    nearest known one: a misspelt limit must not silently read everything."""
    names = {name.lower(): name for name in known}
    names.update({alias.lower(): ours for alias, ours in KAFKA_ALIASES.items() if ours in known})
    result: dict[str, str] = {}
    for key, value in options.items():
        lowered = str(key).lower()
        if lowered in _SPARK_KEYS:
            continue
        name = names.get(lowered)
        if name is None:
            nearest = difflib.get_close_matches(lowered, list(names), n=1, cutoff=0.6)
            hint = f"; did you mean {names[nearest[0]]!r}?" if nearest else ""
            raise SBPOptionError(
                f"unknown option {key!r}{hint} (known: {', '.join(sorted(set(names.values())))})"
            )
        result[name] = value
    return result


def _required(options: Mapping[str, str], name: str) -> str:
    value = options.get(name)
    if value is None or not str(value).strip():
        raise SBPOptionError(f"option {name!r} is required")
    return str(value).strip()


def parse_pm(options: Mapping[str, str]) -> str:
    """The PM's ``host:port`` (option ``pm``), or several PMs on etcd,
    comma-separated."""
    from net.address import parse_address_list  # here: the net package brings trio along

    address = _required(options, "pm")
    try:
        parse_address_list(address)
    except ValueError as error:
        raise SBPOptionError(
            f"option 'pm' must be host:port (or several, comma-separated), got {address!r}"
        ) from error
    return address


def parse_tls(options: Mapping[str, str]) -> TLSSettings | None:
    """Options ``tlsCa``, ``tlsCert``, ``tlsKey``: files every executor can
    read at the same path. None (plain text) without any."""
    from net.tls import TLSSettings  # here: the net package brings trio along

    paths = {name: str(options[name]).strip() for name in TLS_OPTIONS if options.get(name)}
    if not paths:
        return None
    if ("tlsCert" in paths) != ("tlsKey" in paths):
        raise SBPOptionError("options 'tlsCert' and 'tlsKey' go together")
    for name, path in paths.items():
        if not Path(path).is_file():
            raise SBPOptionError(f"option {name!r}: no such file {path!r}")
    ca, cert, key = (Path(paths[name]) if name in paths else None for name in TLS_OPTIONS)
    return TLSSettings(ca=ca, cert=cert, key=key)


def _stream_id(text: str, option: str) -> int:
    try:
        stream_id = int(text)
    except ValueError:
        raise SBPOptionError(f"option {option!r}: {text!r} is not a stream id") from None
    if stream_id < 1:
        raise SBPOptionError(f"option {option!r}: stream ids start at 1, got {stream_id}")
    return stream_id


def parse_streams(options: Mapping[str, str]) -> tuple[int, ...] | None:
    """Stream ids of option ``streams`` (comma-separated), or None for ``all``."""
    text = _required(options, "streams")
    if text.lower() == ALL_STREAMS:
        return None
    ids = [_stream_id(part.strip(), "streams") for part in text.split(",") if part.strip()]
    if not ids:
        raise SBPOptionError("option 'streams' names no stream")
    return tuple(dict.fromkeys(ids))  # keep the order given, drop repeats


def parse_stream(options: Mapping[str, str]) -> int:
    """The one stream id of option ``stream`` (for writing)."""
    return _stream_id(_required(options, "stream"), "stream")


@dataclass(frozen=True)
class OffsetSpec:
    """Where reading starts or stops: ``default`` (EARLIEST_CODE or
    LATEST_CODE, or an offset) for every stream not in ``per_stream``."""

    default: int
    per_stream: Mapping[int, int] = field(default_factory=dict)

    def for_stream(self, stream_id: int) -> int:
        return self.per_stream.get(stream_id, self.default)


def parse_offsets(options: Mapping[str, str], name: str, default: str) -> OffsetSpec:
    """Option ``name``: ``earliest``, ``latest`` or JSON like ``{"1": 100}``.

    In the JSON, -2 means earliest and -1 latest for that stream; streams it
    leaves out take ``default``.
    """
    text = str(options.get(name, default)).strip()
    fallback = EARLIEST_CODE if default == EARLIEST else LATEST_CODE
    lowered = text.lower()
    if lowered == EARLIEST:
        return OffsetSpec(EARLIEST_CODE)
    if lowered == LATEST:
        return OffsetSpec(LATEST_CODE)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise SBPOptionError(
            f"option {name!r} must be 'earliest', 'latest' or a JSON object of stream id to "
            f'offset like {{"1": 100}}, got {text!r}'
        )
    per_stream: dict[int, int] = {}
    for key, value in parsed.items():
        stream_id = _stream_id(key, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < EARLIEST_CODE:
            raise SBPOptionError(
                f"option {name!r}: the offset of stream {stream_id} must be an integer >= 0 "
                f"(or -2 for earliest, -1 for latest), got {value!r}"
            )
        per_stream[stream_id] = value
    return OffsetSpec(fallback, per_stream)


@dataclass(frozen=True)
class TimeSpec:
    """Where reading starts or stops by time (SPEC §11): the first record
    appended at or after ``default`` ms (None: not by time) for every stream
    not in ``per_stream``."""

    default: int | None = None
    per_stream: Mapping[int, int] = field(default_factory=dict)

    def for_stream(self, stream_id: int) -> int | None:
        return self.per_stream.get(stream_id, self.default)

    @property
    def given(self) -> bool:
        return self.default is not None or bool(self.per_stream)


def _time_ms(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SBPOptionError(f"option {name!r} must be ms since the Unix epoch, got {value!r}")
    try:
        moment = int(str(value).strip())
    except ValueError:
        raise SBPOptionError(
            f"option {name!r} must be ms since the Unix epoch, got {value!r}"
        ) from None
    if moment < 0:
        raise SBPOptionError(f"option {name!r} must be ms since the Unix epoch, got {moment}")
    return moment


def parse_times(options: Mapping[str, str], every: str, by_stream: str) -> TimeSpec:
    """Options ``every`` (one time for every stream, as Kafka's
    ``startingTimestamp``) and ``by_stream`` (JSON of stream id to time, as
    Kafka's ``startingOffsetsByTimestamp``); the first wins where both apply."""
    default = _time_ms(options[every], every) if options.get(every) is not None else None
    per_stream: dict[int, int] = {}
    text = options.get(by_stream)
    if text is not None:
        try:
            parsed = json.loads(str(text))
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise SBPOptionError(
                f"option {by_stream!r} must be a JSON object of stream id to ms since the "
                f'Unix epoch like {{"1": 1795000000000}}, got {text!r}'
            )
        for key, value in parsed.items():
            per_stream[_stream_id(key, by_stream)] = _time_ms(value, by_stream)
    if default is not None:
        per_stream = {}  # one time for every stream wins, as in Kafka's source
    return TimeSpec(default, per_stream)


def parse_group(options: Mapping[str, str]) -> str | None:
    """Option ``group``: the consumer group a streaming query commits to."""
    text = options.get("group")
    if text is None:
        return None
    size = len(str(text).encode())
    if not 1 <= size <= MAX_GROUP_NAME_BYTES:
        raise SBPOptionError(
            f"option 'group' must be 1 to {MAX_GROUP_NAME_BYTES} bytes of UTF-8, got {size}"
        )
    return str(text)


def parse_positive_int(options: Mapping[str, str], name: str, default: int) -> int:
    text = options.get(name)
    if text is None:
        return default
    try:
        value = int(str(text).strip())
    except ValueError:
        raise SBPOptionError(f"option {name!r} must be a positive integer, got {text!r}") from None
    if value < 1:
        raise SBPOptionError(f"option {name!r} must be a positive integer, got {value}")
    return value


def parse_bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    text = options.get(name)
    if text is None:
        return default
    lowered = str(text).strip().lower()
    if lowered not in ("true", "false"):
        raise SBPOptionError(f"option {name!r} must be true or false, got {text!r}")
    return lowered == "true"


def parse_timeout(options: Mapping[str, str]) -> float:
    """Option ``timeoutMs``: the deadline of one request, in seconds."""
    return parse_positive_int(options, "timeoutMs", int(DEFAULT_TIMEOUT_S * 1000)) / 1000


@dataclass(frozen=True)
class ReadOptions:
    """Every option a reader (batch or streaming) uses."""

    pm: str
    streams: tuple[int, ...] | None
    starting: OffsetSpec
    ending: OffsetSpec
    max_records_per_partition: int
    max_records_per_trigger: int
    fetch_max_bytes: int
    timeout: float
    tls: TLSSettings | None = None
    #: offsets asked for that were trimmed away fail the query (as Kafka's
    #: option); false reads from the first record there is instead
    fail_on_data_loss: bool = True
    #: start and end by append time; where given they win over the offsets
    starting_times: TimeSpec = field(default_factory=TimeSpec)
    ending_times: TimeSpec = field(default_factory=TimeSpec)
    #: the consumer group a streaming query commits its processed ends to
    group: str | None = None
    #: rows carry a ``headers`` column (SPEC §13), as Kafka's option
    include_headers: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        options = canonical_options(options, READ_OPTIONS)
        return cls(
            pm=parse_pm(options),
            streams=parse_streams(options),
            starting=parse_offsets(options, "startingOffsets", EARLIEST),
            ending=parse_offsets(options, "endingOffsets", LATEST),
            max_records_per_partition=parse_positive_int(
                options, "maxRecordsPerPartition", DEFAULT_MAX_RECORDS_PER_PARTITION
            ),
            max_records_per_trigger=parse_positive_int(
                options, "maxRecordsPerTrigger", DEFAULT_MAX_RECORDS_PER_TRIGGER
            ),
            fetch_max_bytes=parse_positive_int(options, "fetchMaxBytes", DEFAULT_FETCH_MAX_BYTES),
            timeout=parse_timeout(options),
            tls=parse_tls(options),
            fail_on_data_loss=parse_bool(options, "failOnDataLoss", True),
            starting_times=parse_times(options, "startingTimestamp", "startingOffsetsByTimestamp"),
            ending_times=parse_times(options, "endingTimestamp", "endingOffsetsByTimestamp"),
            group=parse_group(options),
            include_headers=parse_bool(options, "includeHeaders", False),
        )


@dataclass(frozen=True)
class WriteOptions:
    """Every option the writer uses."""

    pm: str
    stream: int
    batch_max_bytes: int
    timeout: float
    tls: TLSSettings | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        options = canonical_options(options, WRITE_OPTIONS)
        return cls(
            pm=parse_pm(options),
            stream=parse_stream(options),
            batch_max_bytes=parse_positive_int(options, "batchMaxBytes", DEFAULT_BATCH_MAX_BYTES),
            timeout=parse_timeout(options),
            tls=parse_tls(options),
        )
