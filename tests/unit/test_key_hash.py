"""Key hashes and compaction's key map (sbp.key_hash)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sbp.key_hash import HASH_DTYPE, KeyMap, key_hashes


def hashes_of(keys: list[bytes]) -> np.ndarray:
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return key_hashes(np.frombuffer(b"".join(keys), dtype=np.uint8), offsets)


def test_equal_keys_hash_alike_wherever_they_sit_in_the_column() -> None:
    first = hashes_of([b"alpha", b"beta", b"gamma-longer-than-eight"])
    second = hashes_of([b"x" * 40, b"gamma-longer-than-eight", b"alpha"])
    assert first[0] == second[2] and first[2] == second[1]
    assert first.dtype == HASH_DTYPE


def test_different_keys_hash_apart() -> None:
    rng = random.Random(7)
    keys = {rng.randbytes(rng.randint(0, 40)) for _ in range(100_000)}
    # keys that differ only in length or trailing zero bytes are different keys
    keys |= {b"", b"\0", b"\0" * 8, b"\0" * 9, b"a", b"a\0", b"abcdefgh", b"abcdefgh\0"}
    hashes = hashes_of(sorted(keys))
    assert len(np.unique(hashes)) == len(keys)


def test_a_map_keeps_each_keys_highest_offset_and_travels_intact() -> None:
    hashes = hashes_of([b"a", b"b", b"a", b"c", b"b"])
    keys = KeyMap.latest(hashes, np.array([0, 1, 2, 3, 4], dtype=np.int64))
    assert len(keys) == 3
    assert keys.latest_of(hashes_of([b"a", b"b", b"c", b"d"])).tolist() == [2, 4, 3, -1]
    again = KeyMap.decode(keys.encode())
    assert again.hashes.tobytes() == keys.hashes.tobytes()
    assert again.offsets.tolist() == keys.offsets.tolist()


def test_a_malformed_map_is_refused() -> None:
    keys = KeyMap.latest(hashes_of([b"a", b"b"]), np.array([0, 1], dtype=np.int64))
    with pytest.raises(ValueError, match="whole entries"):
        KeyMap.decode(keys.encode()[:-1])
    swapped = keys.hashes[::-1].tobytes() + keys.offsets.astype(">i8").tobytes()
    with pytest.raises(ValueError, match="sorted"):
        KeyMap.decode(swapped)
