"""How ``sbp read`` prints values: a batch at a time as UTF-8 lines, written
as bytes under a UTF-8 text stream, and a line at a time with escapes for
values that are not UTF-8."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace
from typing import Any

import pytest

from client.cli_read import RecordPrinter, _plain_lines, _write_utf8
from sbp.batches import DecodedRecords, build_batch, decode_batches, stamp_base_offset


def _records(*batches: list[bytes]) -> DecodedRecords:
    payload = bytearray()
    base = 0
    for values in batches:
        batch = build_batch(values, 1_000)
        stamp_base_offset(batch, base)
        payload += batch
        base += len(values)
    return decode_batches(bytes(payload))


def _line_at_a_time(values: list[bytes]) -> bytes:
    return b"".join(value + b"\n" for value in values)


@pytest.mark.parametrize(
    "batches",
    [
        [[b"x" * 98] * 300],  # one size: the reshape
        [[b"x" * 98] * 300, [b"y" * 98] * 7],  # one size across batches
        [[b"a", b"", b"bcd", "é".encode()], [b"", b""]],  # sizes vary, empty values
        [[b""] * 5],  # every value empty: width 0
        [[f"record {i} é".encode() for i in range(1_000)]],
    ],
)
def test_plain_lines_are_the_values_each_followed_by_a_newline(
    batches: list[list[bytes]],
) -> None:
    records = _records(*batches)
    values = [value for batch in batches for value in batch]
    for count in (1, len(values) // 2 or 1, len(values)):
        lines = _plain_lines(records, count)
        assert lines is not None
        assert lines.tobytes() == _line_at_a_time(values[:count])


def test_values_that_are_not_utf8_are_left_to_the_escaping_path() -> None:
    assert _plain_lines(_records([b"ok", b"\xff\xfe"]), 2) is None
    # a character split across two records is valid in the values joined,
    # but not once a newline stands between its halves
    split = "é".encode()
    assert _plain_lines(_records([b"a" + split[:1], split[1:] + b"b"]), 2) is None


class _Utf8Stdout(io.TextIOWrapper):
    def __init__(self, encoding: str) -> None:
        super().__init__(io.BytesIO(), encoding=encoding, newline="\n")

    def raw_bytes(self) -> bytes:
        self.flush()
        buffer: Any = self.buffer
        return bytes(buffer.getvalue())


def test_bytes_go_under_a_utf8_stream_after_what_was_written_as_text() -> None:
    out = _Utf8Stdout("utf-8")
    lines = _plain_lines(_records([b"one", "twö".encode()]), 2)
    assert lines is not None
    out.write("header é\n")  # still in the text layer's buffer
    _write_utf8(out, lines)
    out.write("after\n")
    assert out.raw_bytes() == "header é\none\ntwö\nafter\n".encode()


def test_streams_without_bytes_under_them_or_in_another_encoding_get_text() -> None:
    lines = _plain_lines(_records(["twö".encode()]), 1)
    assert lines is not None
    text = io.StringIO()
    _write_utf8(text, lines)
    assert text.getvalue() == "twö\n"
    latin = _Utf8Stdout("latin-1")
    _write_utf8(latin, lines)
    assert latin.raw_bytes() == "twö\n".encode("latin-1")


def test_the_printer_escapes_a_batch_that_is_not_utf8_and_prints_the_rest_plainly() -> None:
    out = _Utf8Stdout("utf-8")
    args = SimpleNamespace(
        json=False, offsets=False, hex=False, stats=False, keys=False, headers=False
    )
    env: Any = SimpleNamespace(args=args, out=out, json=False)
    printer = RecordPrinter(env, limit=None)
    printer.take(_records([b"plain", b"text"]))
    printer.take(_records([b"bad \xff", b"fine"]))
    assert out.raw_bytes() == b"plain\ntext\nbad \\xff\nfine\n"
    assert printer.records == 4


def test_json_keeps_bytes_and_their_escaped_text_apart() -> None:
    """The bytes \\xff\\xfe and the 8-character text \\xff\\xfe print differently."""
    out = io.StringIO()
    args = SimpleNamespace(
        json=True, offsets=False, hex=False, stats=False, keys=False, headers=False
    )
    env: Any = SimpleNamespace(args=args, out=out, json=True)
    printer = RecordPrinter(env, limit=None)
    printer.take(_records([b"\xff\xfe", b"\\xff\\xfe", "é".encode()]))
    printed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [{k: v for k, v in r.items() if k.startswith("value")} for r in printed] == [
        {"value_base64": "//4="},
        {"value": "\\xff\\xfe"},
        {"value": "é"},
    ]
    assert base64.b64decode(printed[0]["value_base64"]) == b"\xff\xfe"
