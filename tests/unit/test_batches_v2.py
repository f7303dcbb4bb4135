"""Magic 2 record batches (SPEC §4 "Magic 2", §13): golden vectors for each
attribute combination, every malformed case, the columns they decode into,
and round trips of both magics mixed (Hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbp.batch_v2 import V2_HEADER_SIZE, build_batch_v2
from sbp.batches import (
    build_batch,
    build_records,
    decode_batches,
    peek_header,
    stamp_base_offset,
    validate_batch,
)
from sbp.errors import InvalidRecordBatchError

VECTORS = Path(__file__).parent.parent / "vectors" / "batches"
VALID: list[dict[str, Any]] = json.loads((VECTORS / "v2_valid.json").read_text())
INVALID: list[dict[str, Any]] = json.loads((VECTORS / "v2_invalid.json").read_text())


def _records_of(vector: dict[str, Any]) -> dict[str, list[Any]]:
    records = vector["records"]
    return {
        "values": [
            None if r["value_hex"] is None else bytes.fromhex(r["value_hex"]) for r in records
        ],
        "keys": [None if r["key_hex"] is None else bytes.fromhex(r["key_hex"]) for r in records],
        "headers": [[(n, bytes.fromhex(v)) for n, v in r["headers"]] for r in records],
        "timestamps": [r["timestamp"] for r in records],
        "offset_deltas": [r["offset"] - vector["base_offset"] for r in records],
    }


@pytest.mark.parametrize("vector", VALID, ids=[v["name"] for v in VALID])
def test_each_attribute_combination_builds_byte_for_byte(vector: dict[str, Any]) -> None:
    records = _records_of(vector)
    dense = not vector["attributes"] & 1
    batch = build_batch_v2(
        records["values"],
        vector["base_timestamp"],
        keys=records["keys"],
        headers=records["headers"],
        timestamps=records["timestamps"],
        offset_deltas=None if dense else records["offset_deltas"],
        last_offset_delta=None if dense else vector["last_offset_delta"],
    )
    stamp_base_offset(batch, vector["base_offset"])
    assert batch.hex() == vector["hex"]


@pytest.mark.parametrize("vector", VALID, ids=[v["name"] for v in VALID])
def test_each_attribute_combination_decodes_to_its_records(vector: dict[str, Any]) -> None:
    raw = bytes.fromhex(vector["hex"])
    header = validate_batch(raw)
    assert (header.magic, header.flags, header.record_count) == (2, vector["attributes"], 3)
    assert header.span == vector["last_offset_delta"] + 1
    assert header.next_offset == vector["base_offset"] + vector["last_offset_delta"] + 1
    decoded = decode_batches(raw)
    records = _records_of(vector)
    assert decoded.offsets.tolist() == [r["offset"] for r in vector["records"]]
    assert decoded.timestamps.tolist() == records["timestamps"]
    assert decoded.to_list() == records["values"]
    assert [decoded.key(i) for i in range(3)] == records["keys"]
    assert [decoded.headers_of(i) for i in range(3)] == records["headers"]
    assert (decoded.keys is None) == (not vector["attributes"] & 4)
    assert (decoded.headers is None) == (not vector["attributes"] & 8)


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_every_malformed_batch_is_refused_with_its_reason(vector: dict[str, Any]) -> None:
    raw = bytes.fromhex(vector["hex"])
    with pytest.raises(InvalidRecordBatchError, match=vector["reason"]):
        validate_batch(raw)
    with pytest.raises(InvalidRecordBatchError):
        decode_batches(raw)


def test_records_without_keys_headers_or_timestamps_cost_what_magic_1_does() -> None:
    values = [b"a" * 100] * 50
    assert build_records(values, 7) == build_batch(values, 7)
    assert build_records(values, 7, keys=[None] * 50, headers=[[]] * 50, timestamps=[7] * 50) == (
        build_batch(values, 7)
    )
    keyed = build_records(values, 7, keys=[b"k"] * 50)
    assert peek_header(keyed).magic == 2
    assert len(keyed) == len(build_batch(values, 7)) + (V2_HEADER_SIZE - 31) + 50 * (4 + 1)


def test_keys_and_headers_decode_into_arrow_columns() -> None:
    batch = build_batch_v2(
        [b"v0", None, b"v2"],
        100,
        keys=[b"k0", b"k1", None],
        headers=[[("a", b"1"), ("b", b"")], [], [("c", b"33")]],
    )
    decoded = decode_batches(batch)
    assert decoded.keys is not None and decoded.headers is not None
    assert decoded.keys.data.tobytes() == b"k0k1"
    assert decoded.keys.offsets.tolist() == [0, 2, 4, 4]
    assert decoded.keys.valid is not None and decoded.keys.valid.tolist() == [True, True, False]
    assert decoded.value_valid is not None and decoded.value_valid.tolist() == [True, False, True]
    assert decoded.headers.entry_offsets.tolist() == [0, 2, 2, 3]
    assert decoded.headers.names.data.tobytes() == b"abc"
    assert decoded.headers.values.data.tobytes() == b"133"
    assert decoded.headers.values.offsets.tolist() == [0, 1, 1, 3]


def test_a_stream_mixes_both_magics_in_one_payload() -> None:
    old = build_batch([b"x", b"y"], 5)
    stamp_base_offset(old, 10)
    new = build_records([b"z", None], 6, keys=[b"kz", b"ky"])
    stamp_base_offset(new, 12)
    decoded = decode_batches(bytes(old) + bytes(new) + bytes(old))
    assert decoded.offsets.tolist() == [10, 11, 12, 13, 10, 11]
    assert decoded.to_list() == [b"x", b"y", b"z", None, b"x", b"y"]
    assert [decoded.key(i) for i in range(6)] == [None, None, b"kz", b"ky", None, None]
    assert decoded.drop_first(3).to_list() == [None, b"x", b"y"]
    assert decoded.drop_first(3).key(0) == b"ky"


def test_a_compacted_batch_keeps_its_span_and_offsets() -> None:
    batch = build_batch_v2(
        [b"b", b"d"], 1, keys=[b"k", b"k"], offset_deltas=[1, 3], last_offset_delta=4
    )
    stamp_base_offset(batch, 20)
    header = validate_batch(batch)
    assert (header.record_count, header.span, header.next_offset) == (2, 5, 25)
    assert decode_batches(batch).offsets.tolist() == [21, 23]


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
_records = st.lists(
    st.tuples(
        st.one_of(st.none(), st.binary(max_size=20)),  # value
        st.one_of(st.none(), st.binary(max_size=8)),  # key
        st.lists(st.tuples(_names, st.binary(max_size=8)), max_size=3),  # headers
        st.integers(-1000, 1000),  # timestamp delta
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), _records), min_size=1, max_size=4))
def test_any_mix_of_batches_round_trips(batches: list[tuple[bool, list[Any]]]) -> None:
    payload = b""
    expected: list[tuple[Any, ...]] = []
    offset = 0
    for plain, records in batches:
        if plain:
            values = [v if v is not None else b"" for v, *_ in records]
            batch = build_batch(values, 50)
            expected += [(offset + i, 50, v, None, []) for i, v in enumerate(values)]
        else:
            values = [r[0] for r in records]
            batch = build_records(
                values,
                50,
                keys=[r[1] for r in records],
                headers=[r[2] for r in records],
                timestamps=[50 + r[3] for r in records],
            )
            expected += [(offset + i, 50 + t, v, k, h) for i, (v, k, h, t) in enumerate(records)]
        validate_batch(batch)
        stamp_base_offset(batch, offset)
        offset += len(records)
        payload += bytes(batch)
    decoded = decode_batches(payload)
    got = [
        (
            int(decoded.offsets[i]),
            int(decoded.timestamps[i]),
            decoded.value(i),
            decoded.key(i),
            decoded.headers_of(i),
        )
        for i in range(len(decoded))
    ]
    assert got == expected


def test_a_corrupted_magic_2_batch_raises_only_invalid_record_batch() -> None:
    batch = bytes(build_batch_v2([b"value"] * 3, 1, keys=[b"k"] * 3, headers=[[("h", b"v")]] * 3))
    rng = np.random.default_rng(7)
    for _ in range(2000):
        broken = bytearray(batch)
        for position in rng.integers(8, len(batch), size=rng.integers(1, 4)):
            broken[position] ^= 1 << int(rng.integers(0, 8))
        try:
            validate_batch(broken)
        except InvalidRecordBatchError:
            continue
        assert bytes(broken[12:]) == batch[12:]  # only an unchecked byte changed: none is


def test_a_batch_base_moves_to_its_earliest_record_when_deltas_would_not_fit() -> None:
    now, day = 1_795_000_000_000, 86_400_000
    stamps: list[int | None] = [now - 40 * day, now - 30 * day, now - 35 * day]
    batch = build_records([b"a", b"b", b"c"], now, keys=[b"k"] * 3, timestamps=stamps)
    assert validate_batch(batch).base_timestamp == now - 40 * day
    assert decode_batches(batch).timestamps.tolist() == stamps
    with pytest.raises(ValueError, match="batches of their own"):
        build_records([b"a", b"b"], now, keys=[b"k"] * 2, timestamps=[1000, None])


def test_a_producer_batch_holds_no_wider_span_of_timestamps_than_a_batch_can() -> None:
    from client.accumulator import PendingBatch

    now, day = 1_795_000_000_000, 86_400_000
    batch = PendingBatch(0)
    assert batch.takes_stamps(1000, 1000, now)  # an empty batch takes anything
    batch.add(b"v", None, None, None)  # stamped when the batch is made: about now
    assert batch.takes_stamps(now - 20 * day, now, now)
    assert not batch.takes_stamps(1000, 1000, now)
    batch.add(b"w", None, None, now - 20 * day)
    assert batch.stamps == (now - 20 * day, now - 20 * day)
    assert not batch.takes_stamps(now + 5 * day, now + 5 * day, now)


def test_columns_of_one_byte_headers_are_contiguous() -> None:
    """Alike headers are read as rows of a 2-D view; a one-byte name or
    value must still come out as a contiguous buffer (Arrow takes it as is)."""
    batch = build_batch_v2(
        [b"v"] * 10, 1, keys=[b"k"] * 10, headers=[[("n", b"%d" % i)] for i in range(10)]
    )
    stamp_base_offset(batch, 0)
    headers = decode_batches(bytes(batch)).headers
    assert headers is not None
    for column in (headers.names.data, headers.values.data):
        assert column.flags["C_CONTIGUOUS"]
    assert headers.values.data.tobytes() == b"0123456789"
