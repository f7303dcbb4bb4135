"""A real S3 object store for the tests: SeaweedFS's ``weed mini`` on free
loopback ports, started as ``sbp-cluster --object-store`` starts it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from client.children import Child, start_child, stop_child
from client.object_store_child import (
    object_store_args,
    plan_object_store,
    use_local_credentials,
)
from tiering.store import ObjectStore, ObjectStoreSettings


@contextlib.asynccontextmanager
async def running_object_store(root: Path) -> AsyncIterator[tuple[Child, list[str]]]:
    """weed mini under ``root``, and the flags that point a server at it."""
    use_local_credentials()  # weed and every server the test starts sign with them
    store = plan_object_store(root, "127.0.0.1", 0, sys.executable)
    await start_child(store)
    try:
        yield store, object_store_args(store)
    finally:
        with trio.CancelScope(shield=True):
            await stop_child(store)


def client_for(args: list[str]) -> ObjectStore:
    """The store the flags name, as the servers reach it."""
    url = args[args.index("--object-store") + 1]
    endpoint = args[args.index("--object-store-endpoint") + 1]
    return ObjectStore(ObjectStoreSettings.parse(url, endpoint))
