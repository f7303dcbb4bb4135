"""Data files no snapshot names (SPEC §16): a commit that did not land
(a crash between writing its files and committing them, or a commit that
met a newer snapshot) leaves its files in the table's ``data`` directory.
They are never read, since readers go by the snapshots; ``sweep`` deletes
them once they are older than any commit still under way could be."""

from __future__ import annotations

import logging
import time
from typing import Final
from urllib.parse import urlparse

from pyarrow import fs
from pyiceberg.table import Table

log = logging.getLogger(__name__)

#: a file younger than this may belong to a commit still under way
DEFAULT_GRACE_S: Final = 3600.0


def sweep(table: Table, grace_s: float = DEFAULT_GRACE_S) -> list[str]:
    """Delete the table's data files that no snapshot names and that are
    older than ``grace_s``; the paths deleted."""
    named = {_path(uri) for uri in table.inspect.all_files().column("file_path").to_pylist()}
    filesystem, root = fs.FileSystem.from_uri(f"{table.location().rstrip('/')}/data")
    found = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
    cutoff = time.time() - grace_s
    deleted = []
    for info in found:
        if info.type != fs.FileType.File or info.path in named:
            continue
        if info.mtime is not None and info.mtime.timestamp() > cutoff:
            continue
        filesystem.delete_file(info.path)
        deleted.append(info.path)
    if deleted:
        log.info("%s: deleted %d data files no snapshot names", table.name(), len(deleted))
    return deleted


def _path(uri: str) -> str:
    """A file's URI as pyarrow's filesystems name it (a local path, or
    ``bucket/key``)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return parsed.path
    return parsed.netloc + parsed.path
