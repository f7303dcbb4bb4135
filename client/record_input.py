"""How ``sbp append`` turns input lines into records with keys and headers
(SPEC §13): ``KEY<SEP>VALUE`` lines (``--key-separator``), headers added to
every record (``--header name=value``), or JSON Lines (``--input json``),
one record per line as ``sbp read --json`` prints it::

    {"key": "user-7", "value": "clicked", "headers": [["trace", "a1"]], "timestamp_ms": 1795…}

``value`` (or ``value_base64``) null is a tombstone; ``key_base64`` for a
key that is not UTF-8; headers as ``[[name, value], …]`` (names may repeat;
a value as ``{"base64": …}`` when it is not UTF-8) or ``{name: value}``.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from net.service import UsageError
from sbp.batch_v2 import Header


@dataclass
class Records:
    """Input lines as the columns ``Producer.send_many`` takes."""

    values: list[bytes | None]
    keys: list[bytes | None] | None = None
    headers: list[list[Header] | None] | None = None
    timestamps: list[int | None] | None = None
    #: the bytes of the records' values (what the summary counts)
    value_bytes: int = field(default=0)


def parse_header(text: str) -> Header:
    """``name=value`` for ``--header``."""
    name, found, value = text.partition("=")
    if not found or not name:
        raise ValueError(f"a header is NAME=VALUE, not {text!r}")
    return name, value.encode()


def records_of(
    lines: Sequence[bytes],
    *,
    separator: bytes | None,
    headers: list[Header] | None,
    as_json: bool,
    first_line: int,
) -> Records:
    """The records of these input lines (``first_line``: the number of the
    first, for errors that name a line)."""
    if as_json:
        records = _from_json(lines, first_line)
    elif separator is not None:
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        for line in lines:
            key, found, value = line.partition(separator)
            if found:
                keys.append(key)
                values.append(value)
            else:  # no separator: a record without a key
                keys.append(None)
                values.append(line)
        records = Records(values, keys)
    else:
        records = Records(list(lines))
    if headers:
        if records.headers is None:
            records.headers = [headers] * len(lines)
        else:
            records.headers = [[*headers, *(own or [])] for own in records.headers]
    records.value_bytes = sum(len(v) for v in records.values if v is not None)
    return records


def _bytes_field(record: dict[str, Any], name: str, where: str) -> tuple[bool, bytes | None]:
    """``name`` or ``name_base64`` of a JSON record: whether it was there,
    and its bytes (None for null)."""
    if name in record:
        text = record[name]
        if text is None:
            return True, None
        if not isinstance(text, str):
            raise UsageError(f"{where}: {name} is a string or null")
        return True, text.encode()
    encoded = f"{name}_base64"
    if encoded in record:
        try:
            return True, base64.b64decode(record[encoded], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise UsageError(f"{where}: {encoded} is not base64") from None
    return False, None


def _header_value(value: Any, where: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict) and set(value) == {"base64"}:
        try:
            return base64.b64decode(value["base64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise UsageError(f"{where}: a header value's base64 does not decode") from None
    raise UsageError(f'{where}: a header value is a string or {{"base64": ...}}')


def _json_headers(given: Any, where: str) -> list[Header] | None:
    if given is None:
        return None
    if isinstance(given, dict):
        pairs = list(given.items())
    elif isinstance(given, list) and all(isinstance(p, list) and len(p) == 2 for p in given):
        pairs = [(p[0], p[1]) for p in given]
    else:
        raise UsageError(f"{where}: headers are [[name, value], ...] or {{name: value}}")
    out: list[Header] = []
    for name, value in pairs:
        if not isinstance(name, str):
            raise UsageError(f"{where}: a header name is a string")
        out.append((name, _header_value(value, where)))
    return out or None


def _from_json(lines: Sequence[bytes], first_line: int) -> Records:
    values: list[bytes | None] = []
    keys: list[bytes | None] = []
    headers: list[list[Header] | None] = []
    timestamps: list[int | None] = []
    for index, line in enumerate(lines):
        where = f"line {first_line + index:,}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise UsageError(f"{where} is not JSON: {error}") from None
        if not isinstance(record, dict):
            raise UsageError(f"{where}: a record is a JSON object")
        has_value, value = _bytes_field(record, "value", where)
        _, key = _bytes_field(record, "key", where)
        if not has_value:
            raise UsageError(f"{where}: no value (null for a tombstone)")
        if value is None and key is None:
            raise UsageError(f"{where}: a null value (a tombstone) needs a key")
        timestamp = record.get("timestamp_ms")
        if timestamp is not None and (not isinstance(timestamp, int) or timestamp < 0):
            raise UsageError(f"{where}: timestamp_ms is ms since the Unix epoch")
        values.append(value)
        keys.append(key)
        headers.append(_json_headers(record.get("headers"), where))
        timestamps.append(timestamp)
    return Records(
        values,
        keys if any(k is not None for k in keys) else None,
        headers if any(headers) else None,
        timestamps if any(t is not None for t in timestamps) else None,
    )
