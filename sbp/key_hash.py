"""16-byte hashes of record keys, computed for a whole column of keys at
once, and compaction's map of each key's latest offset (SPEC §13), which
the PM builds and the data nodes compact by.

Two 64-bit lanes take the key 8 bytes at a time, each lane multiplied and
folded (as xxHash and wyhash mix), the key's length mixed in first and a
final avalanche at the end; the work is one numpy pass per 8 bytes of the
longest key, never a Python step per key. Equal keys have equal hashes on
every node, which is what lets replicas compact alike. Two different keys
share a hash with a chance of about n² / 2^129 for n keys: none in practice.
A writer could forge a colliding key, but one that may append to a stream
may as well append a tombstone for any key of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

#: bytes of one hash
HASH_BYTES: Final = 16
#: a hash as numpy holds it, sortable and searchable
HASH_DTYPE: Final = np.dtype("S16")

_SEEDS: Final = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F))
_PRIMES: Final = (np.uint64(0x87C37B91114253D5), np.uint64(0x4CF5AD432745937F))
_AVALANCHE: Final = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))


def _fold(value: npt.NDArray[np.uint64], prime: np.uint64) -> npt.NDArray[np.uint64]:
    value = value * prime
    return value ^ (value >> np.uint64(29))


def _avalanche(value: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    value = value ^ (value >> np.uint64(33))
    value = value * _AVALANCHE[0]
    value = value ^ (value >> np.uint64(33))
    value = value * _AVALANCHE[1]
    return value ^ (value >> np.uint64(33))


def key_hashes(
    data: npt.NDArray[np.uint8], offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64]
) -> npt.NDArray[np.void]:
    """The hash of each key ``data[offsets[i]:offsets[i + 1]]``, as an array
    of ``HASH_DTYPE`` (null keys: give their rows no bytes and skip them)."""
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    lengths = np.asarray(offsets[1:], dtype=np.int64) - starts
    n = len(starts)
    with np.errstate(over="ignore"):
        lanes = [np.full(n, seed, dtype=np.uint64) for seed in _SEEDS]
        length_mix = lengths.astype(np.uint64) * _PRIMES[1]
        lanes = [
            _fold(lane ^ length_mix, prime) for lane, prime in zip(lanes, _PRIMES, strict=True)
        ]
        padded = np.concatenate([data, np.zeros(8, dtype=np.uint8)])
        words = int((lengths.max() + 7) // 8) if n else 0
        for word in range(words):
            rows = np.nonzero(lengths > 8 * word)[0]
            at = starts[rows] + 8 * word
            index = at[:, None] + np.arange(8, dtype=np.int64)
            taken = padded[index]
            # bytes past the key's end are zeros
            taken[np.arange(8)[None, :] >= (lengths[rows] - 8 * word)[:, None]] = 0
            value = taken.view("<u8").reshape(-1)
            for lane, prime in zip(lanes, _PRIMES, strict=True):
                lane[rows] = _fold(lane[rows] ^ value, prime) + np.uint64(word + 1)
        first = _avalanche(lanes[0] ^ (lanes[1] >> np.uint64(7)))
        second = _avalanche(lanes[1] ^ first)
    out = np.empty((n, 2), dtype=">u8")
    out[:, 0], out[:, 1] = first, second
    return out.view(HASH_DTYPE).reshape(n)


@dataclass(frozen=True, slots=True)
class KeyMap:
    """Key hashes (sorted, unique) and the latest offset of each."""

    hashes: npt.NDArray[np.void]
    offsets: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.hashes)

    def latest_of(self, hashes: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
        """The latest offset of each of these hashes; -1 where the map has none."""
        if not len(self.hashes) or not len(hashes):
            return np.full(len(hashes), -1, dtype=np.int64)
        at = np.searchsorted(self.hashes, hashes)
        found = np.minimum(at, len(self.hashes) - 1)
        hit = (at < len(self.hashes)) & (self.hashes[found] == hashes)
        return np.where(hit, self.offsets[found], -1)

    def encode(self) -> bytes:
        """The map as a payload: the hashes end to end, then the offsets
        (big-endian int64), in hash order."""
        return self.hashes.tobytes() + self.offsets.astype(">i8").tobytes()

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> KeyMap:
        data = bytes(payload)
        if len(data) % (HASH_BYTES + 8):
            raise ValueError(f"a key map of {len(data)} bytes is not whole entries")
        count = len(data) // (HASH_BYTES + 8)
        hashes = np.frombuffer(data, dtype=HASH_DTYPE, count=count)
        offsets = np.frombuffer(data, dtype=">i8", count=count, offset=count * HASH_BYTES)
        if count > 1 and not bool((hashes[1:] > hashes[:-1]).all()):
            raise ValueError("a key map's hashes are not sorted and unique")
        return cls(hashes, offsets.astype(np.int64))

    @classmethod
    def latest(cls, hashes: npt.NDArray[np.void], offsets: npt.NDArray[np.int64]) -> KeyMap:
        """Each hash once, with the highest of its offsets."""
        if not len(hashes):
            return cls(np.empty(0, HASH_DTYPE), np.empty(0, np.int64))
        order = np.lexsort((offsets, hashes))
        hashes, offsets = hashes[order], offsets[order]
        last = np.ones(len(hashes), dtype=np.bool_)
        last[:-1] = hashes[1:] != hashes[:-1]
        return cls(hashes[last], offsets[last])
