"""A real S3 object store for the tests: SeaweedFS's ``weed mini`` on free
loopback ports, started as ``sbp-cluster --object-store`` starts it."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from client.children import Child, start_child, stop_child
from client.object_store_child import (
    LOCAL_ACCESS_KEY,
    LOCAL_SECRET_KEY,
    object_store_args,
    plan_object_store,
)
from tiering.store import ObjectStore, ObjectStoreSettings


def use_test_credentials() -> None:
    """The credentials weed and every server of a test sign with."""
    os.environ["AWS_ACCESS_KEY_ID"] = LOCAL_ACCESS_KEY
    os.environ["AWS_SECRET_ACCESS_KEY"] = LOCAL_SECRET_KEY


@contextlib.asynccontextmanager
async def running_object_store(root: Path) -> AsyncIterator[tuple[Child, list[str]]]:
    """weed mini under ``root``, and the flags that point a server at it."""
    use_test_credentials()
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
