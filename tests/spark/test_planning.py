"""The source's pure parts: option parsing, partition planning, read-limit
shares and Arrow columns cut into record batches (no Spark, no cluster)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from sbp import messages
from sbp.batches import decode_batches
from spark_jobs.arrow import (
    ARROW_SCHEMA,
    ARROW_SCHEMA_WITH_HEADERS,
    column_to_batches,
    headers_column,
    key_column,
    records_to_arrow,
    value_column,
)
from spark_jobs.layout import DataLossError, StreamLayout, plan_slices
from spark_jobs.options import (
    EARLIEST_CODE,
    LATEST_CODE,
    OffsetSpec,
    ReadOptions,
    SBPOptionError,
    WriteOptions,
)
from spark_jobs.source import SBPBatchReader, _fair_shares


def wire_range(index: int, start: int, end: int, node: str) -> messages.Range:
    replica = messages.ReplicaNode(
        data_node=messages.DataNode(node_id=1, advertise_addr=node), is_primary=True
    )
    return messages.Range(
        stream_id=7, range_index=index, start_offset=start, end_offset=end, replica_nodes=(replica,)
    )


LAYOUT = StreamLayout(
    7,
    (wire_range(0, 0, 10, "n1:1"), wire_range(1, 10, 25, "n2:2"), wire_range(2, 25, -1, "n1:1")),
    31,
)


def test_options_parse_with_defaults() -> None:
    options = ReadOptions.parse({"pm": "127.0.0.1:7400", "streams": "3, 1,3"})
    assert options.streams == (3, 1)
    assert options.starting == OffsetSpec(EARLIEST_CODE)
    assert options.ending == OffsetSpec(LATEST_CODE)
    parsed = ReadOptions.parse(
        {"pm": "h:1", "streams": "ALL", "startingOffsets": '{"2": 5, "3": -1}'}
    )
    assert parsed.streams is None
    assert parsed.starting.for_stream(2) == 5
    assert parsed.starting.for_stream(3) == LATEST_CODE
    assert parsed.starting.for_stream(4) == EARLIEST_CODE


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pm": "h:1"}, "option 'streams' is required"),
        ({"pm": "h:1", "streams": "0"}, "stream ids start at 1"),
        ({"pm": "h:1", "streams": ","}, "names no stream"),
        ({"pm": "h:1", "streams": "1", "endingOffsets": '{"1": "x"}'}, "must be an integer"),
        ({"pm": "h:1", "streams": "1", "endingOffsets": "[1]"}, "JSON object"),
        ({"pm": "h:1", "streams": "1", "fetchMaxBytes": "lots"}, "'fetchMaxBytes'"),
        ({"pm": "h:1", "streams": "1", "startingTimestamp": "noon"}, "ms since the Unix epoch"),
        ({"pm": "h:1", "streams": "1", "endingTimestamp": "-5"}, "ms since the Unix epoch"),
        ({"pm": "h:1", "streams": "1", "startingOffsetsByTimestamp": "[1]"}, "JSON object"),
        ({"pm": "h:1", "streams": "1", "group": ""}, "1 to 255 bytes"),
        ({"pm": "h:1", "streams": "1", "group": "g" * 256}, "1 to 255 bytes"),
    ],
)
def test_bad_options(options: dict[str, str], message: str) -> None:
    with pytest.raises(SBPOptionError, match=message):
        ReadOptions.parse(options)


def test_times_and_group_parse() -> None:
    options = ReadOptions.parse(
        {
            "pm": "h:1",
            "streams": "1,2",
            "startingOffsetsByTimestamp": '{"2": 1795000000000}',
            "endingTimestamp": "1795000009000",
            "group": "etl",
        }
    )
    assert options.starting_times.for_stream(2) == 1795000000000
    assert options.starting_times.for_stream(1) is None
    assert options.ending_times.for_stream(1) == 1795000009000
    assert options.group == "etl"
    assert not ReadOptions.parse({"pm": "h:1", "streams": "1"}).starting_times.given


@pytest.mark.parametrize(
    ("key", "nearest"),
    [
        ("maxRecordPerTrigger", "maxRecordsPerTrigger"),
        ("startingoffset", "startingOffsets"),
        ("failondataloss_", "failOnDataLoss"),
    ],
)
def test_unknown_options_are_refused_naming_the_nearest(key: str, nearest: str) -> None:
    with pytest.raises(SBPOptionError, match=f"unknown option '{key}'; did you mean '{nearest}'"):
        ReadOptions.parse({"pm": "h:1", "streams": "1", key: "5"})


def test_options_are_case_insensitive_and_take_kafkas_names() -> None:
    # Spark lower-cases the keys it hands over.
    parsed = ReadOptions.parse(
        {"pm": "h:1", "streams": "1", "maxoffsetspertrigger": "7", "failondataloss": "false"}
    )
    assert parsed.max_records_per_trigger == 7
    assert parsed.fail_on_data_loss is False
    assert ReadOptions.parse({"pm": "h:1", "streams": "1"}).fail_on_data_loss is True
    with pytest.raises(SBPOptionError, match="true or false"):
        ReadOptions.parse({"pm": "h:1", "streams": "1", "failOnDataLoss": "maybe"})
    with pytest.raises(SBPOptionError, match="unknown option 'streams'"):
        WriteOptions.parse({"pm": "h:1", "stream": "1", "streams": "1"})


TRIMMED = StreamLayout(7, (wire_range(2, 25, -1, "n1:1"),), 31)


def test_tls_options(tmp_path: Path) -> None:
    """tlsCa, tlsCert and tlsKey name files every executor reads (SPEC §9)."""
    for name in ("ca.pem", "me.pem", "me.key"):
        (tmp_path / name).write_text("")
    base = {"pm": "127.0.0.1:7400", "stream": "1"}
    assert WriteOptions.parse(base).tls is None
    paths = {"tlsCa": str(tmp_path / "ca.pem"), "tlsCert": str(tmp_path / "me.pem")}
    tls = WriteOptions.parse({**base, **paths, "tlsKey": str(tmp_path / "me.key")}).tls
    assert tls is not None and (tls.ca, tls.key) == (tmp_path / "ca.pem", tmp_path / "me.key")
    read = {"pm": "127.0.0.1:7400", "streams": "1", "tlsca": paths["tlsCa"]}
    assert ReadOptions.parse(read).tls is not None
    with pytest.raises(SBPOptionError, match="'tlsCert' and 'tlsKey' go together"):
        WriteOptions.parse({**base, **paths})
    with pytest.raises(SBPOptionError, match="option 'tlsCa': no such file"):
        WriteOptions.parse({**base, "tlsCa": str(tmp_path / "missing.pem")})


def test_fail_on_data_loss_refuses_trimmed_offsets() -> None:
    with pytest.raises(DataLossError, match=r"offset 3 of stream 7 was trimmed away.*starts at 25"):
        TRIMMED.bound(3, fail_on_data_loss=True)
    assert TRIMMED.bound(3) == 25
    assert TRIMMED.bound(EARLIEST_CODE, fail_on_data_loss=True) == 25


def test_starting_after_ending_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("spark_jobs.source._layouts", lambda options, ids: {7: LAYOUT})
    options = ReadOptions.parse(
        {"pm": "h:1", "streams": "7", "startingOffsets": '{"7": 20}', "endingOffsets": '{"7": 10}'}
    )
    with pytest.raises(
        SBPOptionError, match=r"stream 7: startingOffsets \(20\) is after endingOffsets \(10\)"
    ):
        SBPBatchReader(options).partitions()
    fine = ReadOptions.parse({"pm": "h:1", "streams": "7", "startingOffsets": '{"7": 10}'})
    assert sum(p.records for p in SBPBatchReader(fine).partitions()) == 21


def test_layout_resolves_and_clamps_offsets() -> None:
    assert (LAYOUT.first_offset, LAYOUT.next_offset) == (0, 31)
    assert LAYOUT.bound(EARLIEST_CODE) == 0
    assert LAYOUT.bound(LATEST_CODE) == 31
    assert LAYOUT.bound(100) == 31


def test_plan_one_slice_per_range_cut_by_max_records() -> None:
    slices = plan_slices(LAYOUT, 5, 31, max_records=8)
    assert [(s.range_index, s.start, s.end, s.replicas) for s in slices] == [
        (0, 5, 10, ("n1:1",)),
        (1, 10, 18, ("n2:2",)),
        (1, 18, 25, ("n2:2",)),
        (2, 25, 31, ("n1:1",)),
    ]
    assert plan_slices(LAYOUT, 12, 12, max_records=8) == []


def test_fair_shares_split_a_budget_evenly() -> None:
    assert _fair_shares({"1": 100, "2": 100}, 50) == {"1": 25, "2": 25}
    assert _fair_shares({"1": 5, "2": 100, "3": 0}, 50) == {"1": 5, "2": 45, "3": 0}
    assert _fair_shares({"1": 3, "2": 4}, 50) == {"1": 3, "2": 4}


def test_column_cut_into_batches_and_decoded_back() -> None:
    values = [b"v" * (i % 50) for i in range(200)]
    column = pa.array(values, pa.binary()).slice(3)  # a slice: its offsets do not start at 0
    batches = list(column_to_batches(column, batch_max_bytes=500, base_timestamp=42))
    assert all(count >= 1 for _, count in batches)
    assert sum(count for _, count in batches) == 197
    decoded = decode_batches(b"".join(batch for batch, _ in batches))
    assert decoded.to_list() == values[3:]
    # each batch holds at most 500 bytes of values unless one value is larger
    assert max(len(batch) - 31 - 4 * count for batch, count in batches) <= 500


def test_strings_are_appended_as_their_utf8_bytes() -> None:
    column = pa.array(["héllo", "", "wörld"], pa.large_string())
    (batch, count), *_ = column_to_batches(column, batch_max_bytes=1 << 20, base_timestamp=1)
    assert count == 3
    assert decode_batches(batch).to_list() == ["héllo".encode(), b"", "wörld".encode()]


def test_records_become_an_arrow_batch_of_the_source_schema() -> None:
    (batch, _), *_ = column_to_batches(pa.array([b"a", b"bc"]), 1 << 20, base_timestamp=1500)
    batch[0:8] = (40).to_bytes(8, "big")  # the base offset a data node assigns
    arrow = records_to_arrow(7, decode_batches(batch))
    assert arrow.schema.equals(ARROW_SCHEMA)
    assert arrow.to_pydict()["offset"] == [40, 41]
    assert arrow.column("timestamp").cast(pa.int64()).to_pylist() == [1_500_000, 1_500_000]
    assert arrow.column("value").to_pylist() == [b"a", b"bc"]


def test_keys_headers_and_tombstones_become_arrow_columns() -> None:
    from sbp.batches import build_records

    batch = build_records(
        [b"v", None, b"w"],
        1500,
        keys=[b"k", b"gone", None],
        headers=[[("a", b"1"), ("b", b"2")], None, [("a", b"3")]],
        timestamps=[1000, None, 2000],
    )
    batch[0:8] = (10).to_bytes(8, "big")
    arrow = records_to_arrow(7, decode_batches(batch), include_headers=True)
    assert arrow.schema.equals(ARROW_SCHEMA_WITH_HEADERS)
    assert arrow.column("key").to_pylist() == [b"k", b"gone", None]
    assert arrow.column("value").to_pylist() == [b"v", None, b"w"]
    assert arrow.column("headers").to_pylist() == [
        [("a", b"1"), ("b", b"2")],
        [],
        [("a", b"3")],
    ]
    assert arrow.column("timestamp").cast(pa.int64()).to_pylist() == [
        1_000_000,
        1_500_000,
        2_000_000,
    ]
    keyed = pa.record_batch(
        [
            pa.array([b"v", None]),
            pa.array([b"k", b"gone"]),
            pa.array([[("h", b"x")], []], pa.map_(pa.string(), pa.binary())),
        ],
        names=["value", "key", "headers"],
    )
    (built, count), *_ = column_to_batches(
        value_column(keyed), 1 << 20, keys=key_column(keyed), headers=headers_column(keyed)
    )
    decoded = decode_batches(built)
    assert (count, decoded.to_list()) == (2, [b"v", None])
    assert [decoded.key(i) for i in range(2)] == [b"k", b"gone"]
    assert [decoded.headers_of(i) for i in range(2)] == [[("h", b"x")], []]
