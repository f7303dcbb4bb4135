"""Property tests of the header codec: every message round-trips, and no
corruption of an encoded header escapes as anything but HeaderDecodeError."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbp import messages
from sbp.errors import HeaderDecodeError
from tests.unit.message_strategies import MESSAGE_TYPES, messages_of

_SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: the headers on the data path get more examples than the rest
_HOT_TYPES = [
    messages.AppendRequest,
    messages.AppendResponse,
    messages.FetchRequest,
    messages.FetchResponse,
]


def _decode_or_reject(cls: type[messages.Message], buf: bytes) -> None:
    """Decoding garbage may succeed (FlatBuffers has no checksum) or raise
    HeaderDecodeError; a success must be a value that encodes again."""
    try:
        decoded = cls.decode(buf)
    except HeaderDecodeError:
        return
    assert isinstance(decoded, cls)
    # Fixed-width fields and strictly decoded UTF-8 hold only encodable values.
    assert cls.decode(decoded.encode()) == decoded


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@_SETTINGS
@given(data=st.data())
def test_every_message_round_trips(cls: type[messages.Message], data: st.DataObject) -> None:
    message = data.draw(messages_of(cls))
    encoded = message.encode()
    decoded = cls.decode(encoded)
    assert decoded == message
    assert decoded.encode() == encoded
    assert cls.decode(memoryview(encoded)) == message


def _corruptions(encoded: bytes) -> st.SearchStrategy[bytes]:
    flips = st.lists(
        st.tuples(st.integers(0, len(encoded) - 1), st.integers(0, 7)), min_size=1, max_size=4
    )

    def flip(positions: list[tuple[int, int]]) -> bytes:
        corrupted = bytearray(encoded)
        for at, bit in positions:
            corrupted[at] ^= 1 << bit
        return bytes(corrupted)

    def overwrite(args: tuple[int, bytes]) -> bytes:
        at, junk = args
        return encoded[:at] + junk + encoded[at + len(junk) :]

    return st.one_of(
        flips.map(flip),
        st.integers(0, len(encoded) - 1).map(lambda n: encoded[:n]),
        st.tuples(st.integers(0, len(encoded)), st.binary(min_size=1, max_size=8)).map(overwrite),
        st.binary(max_size=64),
    )


def _check_corruption(cls: type[messages.Message], data: st.DataObject) -> None:
    encoded = data.draw(messages_of(cls)).encode()
    _decode_or_reject(cls, data.draw(_corruptions(encoded)))


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@_SETTINGS
@given(data=st.data())
def test_corrupted_headers_raise_only_header_decode_error(
    cls: type[messages.Message], data: st.DataObject
) -> None:
    _check_corruption(cls, data)


@pytest.mark.parametrize("cls", _HOT_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corrupted_hot_headers_raise_only_header_decode_error(
    cls: type[messages.Message], data: st.DataObject
) -> None:
    _check_corruption(cls, data)


@given(st.binary(max_size=256))
@settings(max_examples=300, deadline=None)
def test_random_bytes_raise_only_header_decode_error(junk: bytes) -> None:
    for cls in _HOT_TYPES:
        _decode_or_reject(cls, junk)
