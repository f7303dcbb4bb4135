"""Golden vectors of magic 2 record batches (SPEC §4, "Magic 2"), laid out
here byte by byte from the SPEC's table with struct and a bitwise CRC-32C,
independently of ``sbp.batch_v2``: one valid batch for each of the sixteen
attribute combinations, and one malformed batch for each rule.

    python -m tests.vectors.make_batch_v2_vectors   # rewrites batches/v2_*.json
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from tests.vectors.make_frame_vectors import crc32c_bitwise

OUT = Path(__file__).parent / "batches"

OFFSET_DELTAS, TIMESTAMP_DELTAS, KEYS, HEADERS = 1, 2, 4, 8

#: the records every valid vector holds (what a bit leaves out reads as its default)
RECORDS: list[dict[str, Any]] = [
    {
        "offset_delta": 0,
        "timestamp_delta": 0,
        "key": b"k0",
        "value": b"first",
        "headers": [("trace", b"t-1")],
    },
    {"offset_delta": 2, "timestamp_delta": -5, "key": None, "value": None, "headers": []},
    {
        "offset_delta": 5,
        "timestamp_delta": 1000,
        "key": b"",
        "value": b"",
        "headers": [("a", b"1"), ("a", b"\x00\xff")],
    },
]
BASE_OFFSET = 1000
BASE_TIMESTAMP = 1_795_000_000_000


def headers_block(headers: list[tuple[str | bytes, bytes]]) -> bytes:
    out = struct.pack(">H", len(headers))
    for name, value in headers:
        raw = name if isinstance(name, bytes) else name.encode()
        out += struct.pack(">H", len(raw)) + raw + struct.pack(">I", len(value)) + value
    return out


def layout(
    attributes: int,
    records: list[dict[str, Any]],
    *,
    last_offset_delta: int,
    base_offset: int = BASE_OFFSET,
    record_count: int | None = None,
    magic: int = 2,
    tail: bytes = b"",
    crc: int | None = None,
) -> bytes:
    """A batch as the SPEC's table lays it out (``tail``: bytes past the
    parts, ``crc``: a wrong one, for the malformed vectors)."""
    n = len(records)
    columns = b""

    def column(values: list[int], unsigned: bool = False) -> bytes:
        return struct.pack(f">{len(values)}{'I' if unsigned else 'i'}", *values)

    if attributes & OFFSET_DELTAS:
        columns += column([r["offset_delta"] for r in records])
    if attributes & TIMESTAMP_DELTAS:
        columns += column([r["timestamp_delta"] for r in records])
    if attributes & KEYS:
        columns += column([-1 if r["key"] is None else len(r["key"]) for r in records])
    columns += column([-1 if r["value"] is None else len(r["value"]) for r in records])
    blocks = [headers_block(r["headers"]) if r["headers"] else b"" for r in records]
    if attributes & HEADERS:
        columns += column([len(b) for b in blocks], unsigned=True)
    body = b"".join(r["key"] for r in records if attributes & KEYS and r["key"] is not None)
    body += b"".join(r["value"] for r in records if r["value"] is not None)
    if attributes & HEADERS:
        body += b"".join(blocks)
    covered = struct.pack(
        ">hiqi", attributes, n if record_count is None else record_count, BASE_TIMESTAMP,
        last_offset_delta,
    ) + columns + body + tail  # fmt: skip
    checksum = crc32c_bitwise(covered) if crc is None else crc
    batch_length = 1 + 4 + len(covered)
    return struct.pack(">qiBI", base_offset, batch_length, magic, checksum) + covered


def valid_vectors() -> list[dict[str, Any]]:
    vectors = []
    for attributes in range(16):
        records = [dict(r) for r in RECORDS]
        for i, r in enumerate(records):
            if not attributes & OFFSET_DELTAS:
                r["offset_delta"] = i
            if not attributes & TIMESTAMP_DELTAS:
                r["timestamp_delta"] = 0
            if not attributes & KEYS:
                r["key"] = None
            if not attributes & HEADERS:
                r["headers"] = []
        last = 6 if attributes & OFFSET_DELTAS else len(records) - 1
        raw = layout(attributes, records, last_offset_delta=last)
        vectors.append(
            {
                "name": f"attributes_{attributes:04b}",
                "attributes": attributes,
                "base_offset": BASE_OFFSET,
                "base_timestamp": BASE_TIMESTAMP,
                "last_offset_delta": last,
                "records": [
                    {
                        "offset": BASE_OFFSET + r["offset_delta"],
                        "timestamp": BASE_TIMESTAMP + r["timestamp_delta"],
                        "key_hex": None if r["key"] is None else r["key"].hex(),
                        "value_hex": None if r["value"] is None else r["value"].hex(),
                        "headers": [[name, value.hex()] for name, value in r["headers"]],
                    }
                    for r in records
                ],
                "hex": raw.hex(),
            }
        )
    return vectors


def invalid_vectors() -> list[dict[str, Any]]:
    everything = OFFSET_DELTAS | TIMESTAMP_DELTAS | KEYS | HEADERS

    def records(**changes: Any) -> list[dict[str, Any]]:
        out = [dict(r) for r in RECORDS]
        for index, change in changes.items():
            out[int(index[1:])].update(change)
        return out

    bad_name = records(r0={"headers": [(b"\xff", b"x")]})
    cases: list[tuple[str, bytes, str]] = [
        (
            "unknown_attribute_bit",
            layout(everything | 0x10, RECORDS, last_offset_delta=6),
            "attributes",
        ),
        ("no_records", layout(everything, [], last_offset_delta=0), "record_count 0"),
        (
            "count_above_the_records",
            layout(everything, RECORDS, last_offset_delta=6, record_count=4),
            "magic 2 record batch",
        ),
        (
            "span_below_the_records",
            layout(everything, RECORDS, last_offset_delta=1),
            "last_offset_delta 1",
        ),
        (
            "offset_deltas_not_increasing",
            layout(everything, records(r1={"offset_delta": 0}), last_offset_delta=6),
            "strictly increasing",
        ),
        (
            "negative_first_offset_delta",
            layout(everything, records(r0={"offset_delta": -1}), last_offset_delta=6),
            "offset deltas run",
        ),
        (
            "offset_delta_past_the_span",
            layout(everything, RECORDS, last_offset_delta=4),
            "offset deltas run",
        ),
        (
            "key_length_below_minus_one",
            layout(everything, records(r1={"key": b""}), last_offset_delta=6).replace(
                struct.pack(">iii", 2, 0, 0), struct.pack(">iii", 2, -2, 2), 1
            ),
            "key length",
        ),
        (
            "lengths_do_not_add_up",
            layout(everything, RECORDS, last_offset_delta=6, tail=b"\x00"),
            "add up",
        ),
        (
            "headers_block_holds_more",
            layout(
                everything, records(r0={"headers": [("trace", b"t-1")]}), last_offset_delta=6
            ).replace(b"\x00\x01\x00\x05trace", b"\x00\x00\x00\x05trace", 1),
            "holds more",
        ),
        (
            "header_value_past_its_block",
            layout(everything, RECORDS, last_offset_delta=6).replace(
                b"\x00\x00\x00\x03t-1", b"\x00\x00\x00\x09t-1", 1
            ),
            "runs past",
        ),
        ("header_name_not_utf8", layout(everything, bad_name, last_offset_delta=6), "UTF-8"),
        ("crc_mismatch", layout(everything, RECORDS, last_offset_delta=6, crc=0x1234), "CRC-32C"),
        ("magic_3", layout(everything, RECORDS, last_offset_delta=6, magic=3), "magic 3"),
    ]
    out = []
    for name, raw, reason in cases:
        if name in (
            "key_length_below_minus_one",
            "headers_block_holds_more",
            "header_value_past_its_block",
        ):
            # patched after the CRC was taken: take it again, so the rule itself is caught
            covered = raw[17:]
            raw = raw[:13] + struct.pack(">I", crc32c_bitwise(covered)) + covered
        out.append({"name": name, "hex": raw.hex(), "reason": reason})
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, vectors in (
        ("v2_valid.json", valid_vectors()),
        ("v2_invalid.json", invalid_vectors()),
    ):
        (OUT / name).write_text(json.dumps(vectors, indent=1) + "\n")


if __name__ == "__main__":
    main()
