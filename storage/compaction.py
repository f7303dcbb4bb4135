"""Compaction of sealed ranges on a data node (SPEC §13), as pure functions
of a range's stored chunks: what the range holds of each key, and a chunk
rewritten by the PM's map of each key's latest offset in the stream.

The map says, for each key hash the pass looked at, the highest offset of a
record with that key in the stream's sealed ranges. A record is removed when
the map names a later offset for its key; a tombstone that is its key's
latest is removed too when the PM says its range has kept it long enough
(``drop_tombstones``). Records without keys, and keys the map does not name,
stay. Everything here depends only on the bytes and the map, so every
replica of a range makes the same chunks.

A batch left with no record goes; so that what a replica holds stays
contiguous, the offsets it covered are kept by a gap marker
(``sbp.batch_v2.gap_marker``, never sent on the wire), consecutive ones
merged into one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sbp.batch_v2 import MAGIC_V2, compact_batch, gap_marker, is_gap_marker, record_keys
from sbp.batches import batch_span, batch_spans
from sbp.key_hash import HASH_DTYPE, KeyMap, key_hashes


def _keyed_records(
    chunk: bytes | memoryview, start: int, end: int, base_offset: int
) -> tuple[
    npt.NDArray[np.void], npt.NDArray[np.int64], npt.NDArray[np.bool_], npt.NDArray[np.bool_]
]:
    """Of the magic 2 batch at ``chunk[start:end]`` (at ``base_offset``): the
    key hash and offset of every record (hashes of keyless records are
    meaningless), which have keys, and which are tombstones."""
    keys, deltas, tombstones = record_keys(chunk, start, end)
    offsets = base_offset + deltas
    if keys is None:
        n = len(deltas)
        return np.empty(n, HASH_DTYPE), offsets, np.zeros(n, np.bool_), tombstones
    keyed = np.ones(len(deltas), np.bool_) if keys.valid is None else keys.valid
    return key_hashes(keys.data, keys.offsets), offsets, keyed, tombstones


@dataclass(slots=True)
class RangeKeys:
    """What one range holds of each key: its latest offset there."""

    keys: KeyMap
    records: int = 0
    bytes: int = 0


def scan_keys(chunks: Iterable[tuple[int, bytes | memoryview]]) -> RangeKeys:
    """``RangeKeys`` of a range from its chunks ``(base offset, value)``."""
    hashes: list[npt.NDArray[np.void]] = []
    offsets: list[npt.NDArray[np.int64]] = []
    records = size = 0
    for base_offset, chunk in chunks:
        size += len(chunk)
        position = base_offset
        for start, end in batch_spans(chunk):
            span = batch_span(chunk, start)
            if chunk[start + 12] == MAGIC_V2 and not is_gap_marker(chunk, start):
                found, at, keyed, _ = _keyed_records(chunk, start, end, position)
                hashes.append(found[keyed])
                offsets.append(at[keyed])
                records += int(keyed.sum())
            position += span
    if not hashes:
        return RangeKeys(KeyMap.latest(np.empty(0, HASH_DTYPE), np.empty(0, np.int64)), 0, size)
    return RangeKeys(KeyMap.latest(np.concatenate(hashes), np.concatenate(offsets)), records, size)


@dataclass(slots=True)
class ChunkRewrite:
    """A chunk compacted: its new value (None: nothing changed) and counts."""

    base_offset: int
    old_size: int
    value: bytearray | None = None
    batches: int = 0
    records_removed: int = 0
    tombstones_removed: int = 0


def rewrite_chunk(
    base_offset: int, chunk: bytes | memoryview, keys: KeyMap, drop_tombstones: bool
) -> ChunkRewrite:
    """The chunk at ``base_offset`` without the records ``keys`` says are
    superseded (and, with ``drop_tombstones``, the tombstones that are their
    keys' latest); see the module docstring."""
    parts: list[bytes | memoryview | bytearray] = []
    rewrite = ChunkRewrite(base_offset, len(chunk))
    gap = 0  # offsets of dropped batches not yet given a marker
    changed = False
    position = base_offset
    view = memoryview(chunk)
    for start, end in batch_spans(chunk):
        span = batch_span(chunk, start)
        keep: npt.NDArray[np.bool_] | None = None
        if is_gap_marker(chunk, start):
            gap += span
            position += span
            continue
        if chunk[start + 12] == MAGIC_V2:
            hashes, offsets, keyed, tombstones = _keyed_records(chunk, start, end, position)
            latest = keys.latest_of(hashes)
            superseded = keyed & (latest > offsets)
            expired = keyed & tombstones & (latest <= offsets) & drop_tombstones
            keep = ~(superseded | expired)
            rewrite.records_removed += int(superseded.sum() + expired.sum())
            rewrite.tombstones_removed += int((tombstones & (superseded | expired)).sum())
        if keep is not None and not keep.all():
            changed = True
            if not keep.any():
                gap += span
                position += span
                continue
        if gap:
            parts.append(gap_marker(gap))
            rewrite.batches += 1
            gap = 0
        if keep is None or keep.all():
            parts.append(view[start:end])
        else:
            parts.append(compact_batch(chunk, start, end, keep))
        rewrite.batches += 1
        position += span
    if gap:
        parts.append(gap_marker(gap))
        rewrite.batches += 1
    if changed:
        rewrite.value = bytearray(b"".join(parts))
    return rewrite
