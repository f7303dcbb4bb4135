"""The object layout of a range in the object store (SPEC §14): keys, the
index and the trailer."""

from __future__ import annotations

import pytest

from sbp.batches import build_batch, stamp_base_offset
from sbp.crc32c import crc32c
from tiering import layout
from tiering.layout import IndexBuilder, RangeIndex, RangeTrailer
from tiering.store import ObjectStoreSettings


def batches(base: int, sizes: list[int]) -> tuple[bytearray, list[tuple[int, int]]]:
    """Whole batches of ``sizes`` records from ``base``, each with its base
    offset, and (base offset, position) of each."""
    out = bytearray()
    where = []
    for count in sizes:
        batch = build_batch([b"x" * 10] * count, 0)
        stamp_base_offset(batch, base)
        where.append((base, len(out)))
        out += batch
        base += count
    return out, where


def test_a_key_names_the_range_and_its_epoch_and_parses_back() -> None:
    key = layout.object_key(12, 3, 7)
    assert key == "streams/12/0000000003-7.range"
    assert layout.parse_key(key) == (12, 3, 7)
    assert layout.parse_key("streams/12/notes.txt") is None
    assert layout.parse_key("other/12/0000000003-7.range") is None


def test_the_index_finds_whole_batches_from_any_offset() -> None:
    data, where = batches(100, [5, 5, 10, 1])
    builder = IndexBuilder()
    assert builder.add(data[: where[2][1]]) == where[1][1]  # the last batch of the piece
    builder.add(data[where[2][1] :])
    encoded = builder.encode(121)
    trailer = RangeTrailer(1, 0, 0, 100, 121, len(data), 5, builder.batch_count, crc32c(encoded))
    index = RangeIndex(trailer, encoded)
    assert index.offsets.tolist() == [100, 105, 110, 120, 121]
    assert index.positions.tolist() == [p for _, p in where] + [len(data)]
    # an offset inside a batch starts at that batch; at least one batch
    assert index.span(107, 1) == (where[1][1], where[2][1], 5)
    # as many whole batches as fit
    assert index.span(100, where[3][1]) == (0, where[3][1], 20)
    assert index.span(120, 1 << 20) == (where[3][1], len(data), 1)


def test_a_trailer_round_trips_and_refuses_what_is_not_one() -> None:
    trailer = RangeTrailer(5, 2, 3, 10, 20, 1000, 123456, 4, 99)
    encoded = b"batches and index" + trailer.encode()
    assert RangeTrailer.decode(encoded) == trailer
    assert trailer.object_bytes == 1000 + 5 * 16 + layout.TRAILER.size
    with pytest.raises(ValueError, match="not a range object"):
        RangeTrailer.decode(b"\0" * layout.TRAILER.size)
    with pytest.raises(ValueError, match="no trailer"):
        RangeTrailer.decode(b"short")


def test_a_torn_index_is_refused() -> None:
    data, _ = batches(0, [3, 3])
    builder = IndexBuilder()
    builder.add(data)
    encoded = builder.encode(6)
    trailer = RangeTrailer(1, 0, 0, 0, 6, len(data), 0, 2, crc32c(encoded))
    torn = bytearray(encoded)
    torn[3] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        RangeIndex(trailer, bytes(torn))
    with pytest.raises(ValueError, match="bytes"):
        RangeIndex(trailer, encoded[:-16])


@pytest.mark.parametrize(
    ("url", "endpoint", "expected"),
    [
        ("s3://sbp/cluster1", "", ("sbp", "cluster1/", "")),
        ("s3://sbp", "http://127.0.0.1:8333/", ("sbp", "", "http://127.0.0.1:8333")),
        ("s3://b/a/b/", "https://s3.example:443", ("b", "a/b/", "https://s3.example:443")),
    ],
)
def test_the_object_store_flags_parse(url: str, endpoint: str, expected: tuple) -> None:
    settings = ObjectStoreSettings.parse(url, endpoint)
    assert (settings.bucket, settings.prefix, settings.endpoint) == expected


@pytest.mark.parametrize(
    ("url", "endpoint", "message"),
    [
        ("sbp/cluster", "", "s3://BUCKET/PREFIX"),
        ("s3:///prefix", "", "s3://BUCKET/PREFIX"),
        ("s3://sbp", "127.0.0.1:8333", "http"),
    ],
)
def test_bad_object_store_flags_say_what_is_expected(url: str, endpoint: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ObjectStoreSettings.parse(url, endpoint)
