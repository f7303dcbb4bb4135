"""Every Python example of docs/client.md, run as written against a real
PM and data nodes, so the user's guide cannot drift from the library.

The examples name the local cluster's default PM address; it is replaced by
the address of the cluster started here. Each example runs in a fresh
interpreter, as a user would run it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from .pm_cluster import pm_cluster

pytestmark = pytest.mark.integration

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "client.md"
DOCUMENTED_PM = "127.0.0.1:7400"
EXAMPLE_TIMEOUT_S = 60


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


def test_the_guide_has_examples_for_each_part() -> None:
    code = "\n".join(examples())
    assert len(examples()) >= 5
    for name in ("Producer(", "Consumer(", "SyncClient(", "tail=True", "OffsetOutOfRangeError"):
        assert name in code
    assert all(DOCUMENTED_PM in example for example in examples())


@pytest.mark.deadline(240)
async def test_every_example_runs_against_a_real_cluster(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1, 2)) as cluster:
        for number, example in enumerate(examples(), start=1):
            code = example.replace(DOCUMENTED_PM, cluster.pm_address)
            with trio.fail_after(EXAMPLE_TIMEOUT_S):
                result = await trio.run_process(
                    [sys.executable, "-c", code],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    stdin=subprocess.DEVNULL,
                )
            assert result.returncode == 0, (
                f"example {number} of {GUIDE.name} failed:\n{example}\n"
                f"stderr:\n{result.stderr.decode(errors='replace')[-4000:]}"
            )
            assert result.stdout, f"example {number} printed nothing"
