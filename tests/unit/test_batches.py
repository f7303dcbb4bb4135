"""Record batches (SPEC §4): golden vectors, validation, decoding, properties."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbp.batches import (
    BATCH_HEADER_SIZE,
    batch_spans,
    build_batch,
    build_batch_from_arrays,
    crc32c,
    decode_batches,
    peek_header,
    stamp_base_offset,
    validate_batch,
)
from sbp.errors import InvalidRecordBatchError
from tests.vectors.make_frame_vectors import crc32c_bitwise

VECTORS = Path(__file__).parent.parent / "vectors" / "batches"


def _load(name: str) -> list[dict[str, Any]]:
    vectors: list[dict[str, Any]] = json.loads((VECTORS / name).read_text())
    return vectors


VALID = _load("valid.json")
INVALID = _load("invalid.json")


@pytest.mark.parametrize("vector", VALID, ids=[v["name"] for v in VALID])
def test_golden_vector_builds_byte_for_byte(vector: dict[str, Any]) -> None:
    values = [bytes.fromhex(r["value_hex"]) for r in vector["records"]]
    batch = build_batch(values, vector["base_timestamp"])
    stamp_base_offset(batch, vector["base_offset"])
    assert batch.hex() == vector["hex"]


@pytest.mark.parametrize("vector", VALID, ids=[v["name"] for v in VALID])
def test_golden_vector_decodes_to_its_fields(vector: dict[str, Any]) -> None:
    raw = bytes.fromhex(vector["hex"])
    header = validate_batch(raw)
    assert header.base_offset == vector["base_offset"]
    assert header.batch_length == vector["batch_length"]
    assert header.crc == vector["crc"]
    assert header.record_count == vector["record_count"]
    assert header.base_timestamp == vector["base_timestamp"]
    assert header.size == len(raw)
    decoded = decode_batches(raw)
    assert decoded.offsets.tolist() == [r["offset"] for r in vector["records"]]
    assert decoded.timestamps.tolist() == [vector["base_timestamp"]] * len(vector["records"])
    assert decoded.to_list() == [bytes.fromhex(r["value_hex"]) for r in vector["records"]]


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_invalid_vectors_are_rejected_with_a_reason(vector: dict[str, Any]) -> None:
    raw = bytes.fromhex(vector["hex"])
    with pytest.raises(InvalidRecordBatchError, match=vector["error_contains"]):
        validate_batch(raw)
    with pytest.raises(InvalidRecordBatchError):
        decode_batches(raw)


def test_header_layout_is_31_bytes_in_spec_order() -> None:
    batch = build_batch([b"xy", b"z"], base_timestamp=0x0102030405060708)
    stamp_base_offset(batch, 0x1122334455667788)
    assert BATCH_HEADER_SIZE == 31
    assert batch[0:8] == bytes.fromhex("1122334455667788")
    assert int.from_bytes(batch[8:12], "big") == len(batch) - 12 == 19 + 4 * 2 + 3
    assert batch[12] == 1
    assert int.from_bytes(batch[13:17], "big") == crc32c(bytes(batch[17:]))
    assert batch[17:19] == b"\x00\x00"
    assert int.from_bytes(batch[19:23], "big") == 2
    assert batch[23:31] == bytes.fromhex("0102030405060708")
    assert batch[31:39] == bytes.fromhex("00000002 00000001")
    assert batch[39:] == b"xyz"


def test_crc32c_is_castagnoli_for_every_length_alignment_and_buffer_type() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the catalogue's check value
    assert crc32c(b"") == 0
    data = bytes((i * 131 + 7) % 256 for i in range(600))
    # lengths across the SIMD block sizes, from unaligned starts
    for start in (0, 1, 3, 17):
        for length in (*range(0, 70), 127, 128, 129, 255, 256, 257, 511, 512, 583):
            if start + length > len(data):
                continue
            expected = crc32c_bitwise(data[start : start + length])
            assert crc32c(data, start, start + length) == expected
            assert crc32c(bytearray(data), start, start + length) == expected
            assert crc32c(memoryview(data)[start : start + length]) == expected


def test_crc32c_of_a_batch_sized_buffer_matches_the_definition() -> None:
    data = np.random.default_rng(5).integers(0, 256, 65_537, dtype=np.uint8).tobytes()
    assert crc32c(data) == crc32c_bitwise(data)
    assert crc32c(bytearray(data), 1, 65_536) == crc32c_bitwise(data[1:65_536])


def test_stamping_keeps_the_crc_valid() -> None:
    batch = build_batch([b"a" * 10], base_timestamp=5)
    crc_before = peek_header(batch).crc
    stamp_base_offset(memoryview(batch), 123456789)
    header = validate_batch(batch)
    assert header.base_offset == 123456789
    assert header.crc == crc_before
    assert header.next_offset == 123456790


def test_stamp_at_a_position_inside_a_payload() -> None:
    first = build_batch([b"a"], 1)
    second = build_batch([b"bb", b"c"], 2)
    payload = first + second
    stamp_base_offset(payload, 10, start=0)
    stamp_base_offset(payload, 11, start=len(first))
    decoded = decode_batches(payload)
    assert decoded.offsets.tolist() == [10, 11, 12]
    assert decoded.timestamps.tolist() == [1, 2, 2]
    assert decoded.to_list() == [b"a", b"bb", b"c"]


def test_build_from_arrays_matches_build_from_values() -> None:
    values = [b"alpha", b"", b"gamma-gamma"]
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    buffer = np.frombuffer(b"".join(values), dtype=np.uint8)
    assert build_batch_from_arrays(buffer, lengths, 99) == build_batch(values, 99)
    assert build_batch_from_arrays(b"".join(values), lengths, 99) == build_batch(values, 99)


def test_build_from_arrays_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ValueError, match="sum to 4"):
        build_batch_from_arrays(b"abc", [2, 2], 0)
    with pytest.raises(ValueError, match="at least one"):
        build_batch_from_arrays(b"", [], 0)
    with pytest.raises(ValueError, match="at least one"):
        build_batch([], 0)


def test_batch_spans_of_concatenated_batches() -> None:
    a, b, c = build_batch([b"1"], 0), build_batch([b"22", b"3"], 0), build_batch([b""], 0)
    payload = bytes(a + b + c)
    assert batch_spans(payload) == [
        (0, len(a)),
        (len(a), len(a) + len(b)),
        (len(a) + len(b), len(payload)),
    ]
    assert batch_spans(b"") == []


@pytest.mark.parametrize("cut", [1, 12, BATCH_HEADER_SIZE, BATCH_HEADER_SIZE + 3])
def test_batch_spans_rejects_a_partial_batch(cut: int) -> None:
    payload = bytes(build_batch([b"abcdef"], 0) * 2)
    with pytest.raises(InvalidRecordBatchError):
        batch_spans(payload[:-cut])


def test_batch_spans_rejects_a_batch_length_below_the_fixed_part() -> None:
    batch = build_batch([b"x"], 0)
    batch[8:12] = (18).to_bytes(4, "big")
    with pytest.raises(InvalidRecordBatchError, match="batch_length 18"):
        batch_spans(batch)


def test_decode_of_many_batches_gives_arrow_shaped_columns() -> None:
    batches = []
    expected_values: list[bytes] = []
    for b in range(5):
        values = [bytes([b, i]) * i for i in range(1, 4)]
        batch = build_batch(values, base_timestamp=1000 + b)
        stamp_base_offset(batch, 100 * b)
        batches.append(batch)
        expected_values += values
    decoded = decode_batches(b"".join(batches))
    assert decoded.offsets.dtype == np.int64
    assert decoded.offsets.tolist() == [100 * b + i for b in range(5) for i in range(3)]
    assert decoded.timestamps.tolist() == [1000 + b for b in range(5) for _ in range(3)]
    assert decoded.value_offsets.dtype == np.int32
    assert (
        decoded.value_offsets.tolist()
        == np.cumsum([0] + [len(v) for v in expected_values]).tolist()
    )
    assert decoded.values.tobytes() == b"".join(expected_values)
    assert len(decoded) == 15


def test_decode_of_one_batch_views_the_payload_without_copying() -> None:
    payload = bytes(build_batch([b"abc", b"defg"], 0))
    decoded = decode_batches(payload)
    assert not decoded.values.flags.owndata
    assert decoded.values.tobytes() == b"abcdefg"


def test_decode_of_an_empty_payload_is_empty() -> None:
    decoded = decode_batches(b"")
    assert len(decoded) == 0
    assert decoded.value_offsets.tolist() == [0]
    assert decoded.values.size == 0


def test_decode_can_skip_the_crc() -> None:
    batch = build_batch([b"abc"], 0)
    batch[13] ^= 0xFF
    with pytest.raises(InvalidRecordBatchError, match="CRC"):
        decode_batches(batch)
    assert decode_batches(batch, verify_crc=False).to_list() == [b"abc"]


def test_a_bad_batch_in_the_middle_fails_the_decode() -> None:
    good = build_batch([b"ok"], 0)
    bad = build_batch([b"no"], 0)
    bad[-1] ^= 1
    with pytest.raises(InvalidRecordBatchError, match="CRC"):
        decode_batches(good + bad + good)


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_a_decode_names_what_is_wrong_with_the_first_bad_batch(vector: dict[str, Any]) -> None:
    # Between good batches, and before a later bad one: decode_batches checks
    # every batch at once and names the first failure as validate_batch does.
    good = build_batch([b"ok"] * 3, 0)
    later_bad = build_batch([b"no"], 0)
    later_bad[12] = 9  # magic
    raw = bytes.fromhex(vector["hex"])
    try:
        batch_spans(good + raw + good)
    except InvalidRecordBatchError:
        return  # a length that breaks the framing: the spans name it
    with pytest.raises(InvalidRecordBatchError, match=vector["error_contains"]):
        decode_batches(good + raw + good + later_bad)


def test_validate_accepts_memoryview_and_bytes() -> None:
    batch = build_batch([b"v" * 100] * 100, 7)
    assert validate_batch(memoryview(batch)).record_count == 100
    assert validate_batch(bytes(batch)).record_count == 100


values_lists = st.lists(st.binary(max_size=64), min_size=1, max_size=40)


@given(st.lists(st.tuples(values_lists, st.integers(-(2**63), 2**63 - 1)), min_size=1, max_size=6))
@settings(max_examples=150, deadline=None)
def test_build_then_decode_round_trips(batches: list[tuple[list[bytes], int]]) -> None:
    payload = bytearray()
    expected_offsets: list[int] = []
    next_offset = 0
    for values, timestamp in batches:
        batch = build_batch(values, timestamp)
        stamp_base_offset(batch, next_offset)
        expected_offsets += range(next_offset, next_offset + len(values))
        next_offset += len(values)
        payload += batch
    decoded = decode_batches(bytes(payload))
    assert decoded.offsets.tolist() == expected_offsets
    assert decoded.timestamps.tolist() == [t for values, t in batches for _ in values]
    assert decoded.to_list() == [v for values, _ in batches for v in values]


@given(
    values_lists,
    st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(min_value=0, max_value=40),
)
@settings(max_examples=400, deadline=None)
def test_corruption_raises_only_invalid_record_batch(
    values: list[bytes], flips: list[tuple[int, int]], truncate: int
) -> None:
    batch = build_batch(values, 1)
    for position, byte in flips:
        batch[position % len(batch)] = byte
    corrupted = bytes(batch[: max(0, len(batch) - truncate)])
    for verify_crc in (True, False):
        try:
            decoded = decode_batches(corrupted, verify_crc=verify_crc)
        except InvalidRecordBatchError:
            continue
        # whatever decodes must be self-consistent
        assert decoded.value_offsets[-1] == len(decoded.values)
        assert len(decoded.timestamps) == len(decoded.offsets) == len(decoded.value_offsets) - 1
