"""The object store: any S3 API (SeaweedFS, MinIO, Ceph, AWS S3), reached
through pyarrow's S3 filesystem.

pyarrow is already a dependency of the tables and Spark parts, does
multipart uploads on its own, and releases the GIL while it waits, so its
blocking calls run in worker threads without holding up the event loop.
Credentials come from the standard ``AWS_*`` environment variables.

Every call here blocks: callers run them with ``ObjectStore.run`` (a worker
thread, a deadline, and ``ObjectStoreUnavailableError`` when the store does
not answer in time or fails).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import trio

from sbp.errors import ObjectStoreUnavailableError

from .layout import TRAILER, RangeTrailer

T = TypeVar("T")

#: how long one call to the store may take before a read answers
#: OBJECT_STORE_UNAVAILABLE
DEFAULT_TIMEOUT_S: Final = 5.0
#: the region signed for when the endpoint is not AWS and none is set
_DEFAULT_REGION: Final = "us-east-1"
#: store calls running at once in one process
_MAX_CALLS: Final = 16


@dataclass(frozen=True, slots=True)
class ObjectStoreSettings:
    """``--object-store s3://BUCKET/PREFIX`` and ``--object-store-endpoint URL``."""

    bucket: str
    prefix: str = ""
    #: ``http://host:port`` of an S3 API other than AWS's; empty: AWS
    endpoint: str = ""

    @classmethod
    def parse(cls, url: str, endpoint: str = "") -> ObjectStoreSettings:
        """Settings from the flags' values; ValueError with a one-line reason."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"the object store is s3://BUCKET/PREFIX, not {url!r}")
        if endpoint:
            where = urlsplit(endpoint)
            if where.scheme not in ("http", "https") or not where.netloc:
                raise ValueError(
                    f"the object store endpoint is http(s)://HOST:PORT, not {endpoint!r}"
                )
        prefix = parts.path.strip("/")
        return cls(parts.netloc, f"{prefix}/" if prefix else "", endpoint.rstrip("/"))

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


class ObjectStore:
    """One bucket and prefix of an S3 object store. Keys are relative to the
    prefix."""

    def __init__(self, settings: ObjectStoreSettings, *, timeout: float = DEFAULT_TIMEOUT_S):
        from pyarrow import fs  # only processes with an object store load pyarrow

        self.settings = settings
        self.timeout = timeout
        options: dict[str, Any] = {
            "connect_timeout": min(timeout, 2.0),
            "request_timeout": timeout,
            "allow_bucket_creation": False,
            "allow_bucket_deletion": False,
            "check_directory_existence_before_creation": False,
        }
        if settings.endpoint:
            where = urlsplit(settings.endpoint)
            options["endpoint_override"] = where.netloc
            options["scheme"] = where.scheme
            options["region"] = (
                os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or _DEFAULT_REGION
            )
        self._fs = fs.S3FileSystem(**options)
        self._fs_module = fs
        self._limiter = trio.CapacityLimiter(_MAX_CALLS)

    def _path(self, key: str) -> str:
        return f"{self.settings.bucket}/{self.settings.prefix}{key}"

    async def run(self, call: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """``call(*args)`` in a worker thread; ``ObjectStoreUnavailableError``
        when it fails or runs past ``timeout`` (the store's by default). A
        call that runs late is abandoned, not waited for."""
        limit = self.timeout if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                return await trio.to_thread.run_sync(
                    call, *args, limiter=self._limiter, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            raise ObjectStoreUnavailableError(
                f"the object store ({self.settings.url}) did not answer within {limit:g} s"
            ) from None
        except OSError as error:
            raise ObjectStoreUnavailableError(
                f"the object store ({self.settings.url}): {_first_line(error)}"
            ) from error

    async def range_trailer(
        self, key: str, expected: tuple[int, int, int, int]
    ) -> RangeTrailer | None:
        """The trailer of the object at ``key`` when it is whole and is the
        copy of the range ``(stream id, range index, epoch, end offset)``;
        None when there is none or it is not. ``ObjectStoreUnavailableError``
        when the store does not answer."""
        found = await self.run(self.read_tail, key, TRAILER.size)
        if found is None:
            return None
        size, tail = found
        try:
            trailer = RangeTrailer.decode(tail)
        except ValueError:
            return None
        names = (trailer.stream_id, trailer.range_index, trailer.epoch, trailer.end_offset)
        if names != expected or size != trailer.object_bytes:
            return None
        return trailer

    # -- blocking calls (``run`` them) ---------------------------------------

    def open_writer(self, key: str) -> Any:
        """A stream writing the object ``key`` (multipart past a few MiB): it
        appears, whole, only when the stream closes without an error."""
        return self._fs.open_output_stream(self._path(key))

    def read(self, key: str, position: int, length: int) -> memoryview:
        """``length`` bytes of the object from ``position`` (one ranged GET),
        in the buffer the client read them into (not copied)."""
        with self._fs.open_input_file(self._path(key)) as source:
            data = source.read_at(length, position)
        if len(data) != length:
            raise OSError(
                f"{key}: asked for {length} bytes at {position}, the store returned {len(data)}"
            )
        return memoryview(data)

    def read_tail(self, key: str, length: int) -> tuple[int, bytes] | None:
        """The object's size and its last ``length`` bytes; None when there
        is no such object."""
        try:
            source = self._fs.open_input_file(self._path(key))
        except FileNotFoundError:
            return None
        with source:
            size = int(source.size())
            data = source.read_at(min(length, size), max(size - length, 0))
        return size, bytes(data)

    def list(self, prefix: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix`` (a "folder")."""
        selector = self._fs_module.FileSelector(
            self._path(prefix).rstrip("/"), recursive=True, allow_not_found=True
        )
        base = len(self._path(""))
        return [
            (info.path[base:], int(info.size))
            for info in self._fs.get_file_info(selector)
            if info.type == self._fs_module.FileType.File
        ]

    def delete(self, keys: Sequence[str]) -> None:
        """Delete the objects; one already gone is no error."""
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._fs.delete_file(self._path(key))


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
