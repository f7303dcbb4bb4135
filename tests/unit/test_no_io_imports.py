"""The protocol package and storage/ are sans-IO: importing them must not pull
in an I/O framework (the trio layers in client/, datanode/ and pm/ move bytes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = ("trio", "asyncio", "socket", "selectors", "ssl", "anyio")


@pytest.mark.parametrize(
    "package",
    ["sbp", "sbp.frames", "sbp.connection", "sbp.errors", "sbp.batches", "sbp.messages", "storage"],
)
def test_package_imports_no_io_framework(package: str) -> None:
    probe = (
        "import importlib, json, sys\n"
        f"before = set(sys.modules)\n"
        f"importlib.import_module({package!r})\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout
    loaded = json.loads(out)
    offenders = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert offenders == [], f"{package} imports {offenders}"
