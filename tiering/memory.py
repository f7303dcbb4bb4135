"""An object store in memory (``MemoryObjectStore``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from sbp.errors import ObjectStoreUnavailableError

from .store import ObjectStore, ObjectStoreSettings

T = TypeVar("T")


class MemoryObjectStore(ObjectStore):
    """An object store in a dict, with the real class's checks on top: for
    the unit tests and for measuring the PM's own work (bench.tiering).
    ``down`` makes every call fail as a store that does not answer."""

    def __init__(self) -> None:  # no S3 client: nothing of the base's
        self.settings = ObjectStoreSettings("memory")
        self.timeout = 1.0
        self.objects: dict[str, bytes] = {}
        self.down = False

    async def run(self, call: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        if self.down:
            raise ObjectStoreUnavailableError("the store is down")
        await trio.lowlevel.checkpoint()
        return call(*args)

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = data

    def read_tail(self, key: str, length: int) -> tuple[int, bytes] | None:
        data = self.objects.get(key)
        return None if data is None else (len(data), data[-length:])

    def list(self, prefix: str) -> list[tuple[str, int]]:
        return [(k, len(v)) for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.objects.pop(key, None)
