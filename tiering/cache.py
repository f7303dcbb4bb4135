"""A bounded disk cache of object chunks (``--object-cache-bytes``).

Chunks are files in one directory, named by object key and chunk number,
dropped least recently used first once they hold more than the bound. The
cache is not state: it starts empty (the directory is cleared), and a chunk
is only ever a copy of an object that does not change.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Final

from sbp.batches import Buffer

#: cached chunks kept mapped into memory (address space, not memory)
MAPPED_FILES: Final = 64


class ChunkCache:
    """See the module docstring. ``max_bytes`` 0 keeps nothing."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        #: (key, chunk) -> bytes, least recently used first
        self._sizes: OrderedDict[tuple[str, int], int] = OrderedDict()
        #: the chunks mapped into memory, most recently read last
        self._maps: OrderedDict[tuple[str, int], mmap.mmap] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def _file(self, key: str, chunk: int) -> Path:
        name = hashlib.blake2b(key.encode(), digest_size=12).hexdigest()
        return self.directory / f"{name}-{chunk}"

    def get(
        self, key: str, chunk: int, start: int = 0, length: int | None = None
    ) -> memoryview | None:
        """``length`` bytes of the chunk from ``start`` (all of it by
        default), a view of the file mapped into memory (no copy; it stays
        valid after the chunk leaves the cache); None when it is not here."""
        size = self._sizes.get((key, chunk))
        if size is None:
            self.misses += 1
            return None
        wanted = size - start if length is None else min(length, size - start)
        mapped = self._maps.get((key, chunk))
        if mapped is None:
            try:
                with self._file(key, chunk).open("rb") as file:
                    mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                self._forget(key, chunk)
                self.misses += 1
                return None
            self._maps[(key, chunk)] = mapped
            while len(self._maps) > MAPPED_FILES:
                self._maps.popitem(last=False)  # unmapped once no view of it is left
        else:
            self._maps.move_to_end((key, chunk))
        self._sizes.move_to_end((key, chunk))
        self.hits += 1
        return memoryview(mapped)[start : start + wanted]

    def put(self, key: str, chunk: int, data: Buffer) -> None:
        """Keep a chunk (``write`` then ``admit``, in one go)."""
        if self.write(key, chunk, data):
            self.admit(key, chunk, len(data))

    def write(self, key: str, chunk: int, data: Buffer) -> bool:
        """The chunk's file, written whole (any thread may call this);
        whether it is to be admitted."""
        if len(data) > self.max_bytes or (key, chunk) in self._sizes:
            return False
        path = self._file(key, chunk)
        partial = path.with_name(f"{path.name}.part")
        partial.write_bytes(data)
        os.replace(partial, path)
        return True

    def admit(self, key: str, chunk: int, size: int) -> None:
        """Count a written chunk in, dropping the least recently used ones
        to stay within the bound (the thread that reads, only)."""
        if (key, chunk) in self._sizes:
            return
        while self.bytes + size > self.max_bytes and self._sizes:
            old_key, old_chunk = next(iter(self._sizes))
            self._forget(old_key, old_chunk)
        self._sizes[(key, chunk)] = size
        self.bytes += size

    def forget_object(self, key: str) -> None:
        """Drop every chunk of an object (it was deleted)."""
        for cached_key, chunk in [k for k in self._sizes if k[0] == key]:
            self._forget(cached_key, chunk)

    def _forget(self, key: str, chunk: int) -> None:
        self.bytes -= self._sizes.pop((key, chunk), 0)
        self._maps.pop((key, chunk), None)
        self._file(key, chunk).unlink(missing_ok=True)

    def __contains__(self, item: object) -> bool:
        return item in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)
