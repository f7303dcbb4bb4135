"""A bounded disk cache of object chunks (``--object-cache-bytes``).

Chunks are files in one directory, named by object key and chunk number,
dropped least recently used first once they hold more than the bound. The
cache is not state: it starts empty (the directory is cleared), and a chunk
is only ever a copy of an object that does not change.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import OrderedDict
from pathlib import Path


class ChunkCache:
    """See the module docstring. ``max_bytes`` 0 keeps nothing."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        #: (key, chunk) -> bytes, least recently used first
        self._sizes: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def _file(self, key: str, chunk: int) -> Path:
        name = hashlib.blake2b(key.encode(), digest_size=12).hexdigest()
        return self.directory / f"{name}-{chunk}"

    def get(self, key: str, chunk: int) -> bytes | None:
        if (key, chunk) not in self._sizes:
            self.misses += 1
            return None
        try:
            data = self._file(key, chunk).read_bytes()
        except OSError:
            self._forget(key, chunk)
            self.misses += 1
            return None
        self._sizes.move_to_end((key, chunk))
        self.hits += 1
        return data

    def put(self, key: str, chunk: int, data: bytes) -> None:
        if len(data) > self.max_bytes or (key, chunk) in self._sizes:
            return
        while self.bytes + len(data) > self.max_bytes and self._sizes:
            old_key, old_chunk = next(iter(self._sizes))
            self._forget(old_key, old_chunk)
        path = self._file(key, chunk)
        partial = path.with_suffix(".part")
        partial.write_bytes(data)
        os.replace(partial, path)
        self._sizes[(key, chunk)] = len(data)
        self.bytes += len(data)

    def forget_object(self, key: str) -> None:
        """Drop every chunk of an object (it was deleted)."""
        for cached_key, chunk in [k for k in self._sizes if k[0] == key]:
            self._forget(cached_key, chunk)

    def _forget(self, key: str, chunk: int) -> None:
        self.bytes -= self._sizes.pop((key, chunk), 0)
        self._file(key, chunk).unlink(missing_ok=True)

    def __contains__(self, item: object) -> bool:
        return item in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)
