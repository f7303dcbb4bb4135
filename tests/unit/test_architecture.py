"""docs/architecture.md says what the code does: its package table names
every package and only those, each module it names exists, and neither
server's core authorizes (both authorize in their handlers)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def package_rows() -> dict[str, str]:
    """The package table: package path -> its "job" cell."""
    table = DOC.read_text().split("## Packages", 1)[1]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0].strip("`").rstrip("/")] = cells[1]
    return rows


def test_the_table_names_every_package_and_only_those() -> None:
    packages = {
        path.parent.name for path in ROOT.glob("*/__init__.py") if path.parent.name != "tests"
    } | {"dashboards"}
    named = {name for name in package_rows() if "/" not in name}
    assert named == packages


def test_every_module_the_table_names_exists() -> None:
    top_level = set(package_rows())
    missing = []
    for package, job in package_rows().items():
        for token in re.findall(r"`([^`]+)`", job):
            if not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", token):
                continue  # a command, a flag, a file name
            parts = token.removeprefix(f"{package}.").split(".")
            if parts[0] in top_level:
                continue  # another package
            module, folder = ROOT / package / f"{parts[0]}.py", ROOT / package / parts[0]
            if not module.exists() and not folder.is_dir():
                missing.append(f"{package}: {token}")
            elif len(parts) > 1 and module.exists():
                defined = rf"^(class|def|async def) {parts[1]}\b|^{parts[1]}\b"
                if not re.search(defined, module.read_text(), re.MULTILINE):
                    missing.append(f"{package}: {token}")
    assert missing == []


def test_neither_core_authorizes() -> None:
    """Who may ask is decided where the request is: the handlers."""
    for core in ("pm/manager.py", "datanode/node.py"):
        source = (ROOT / core).read_text()
        assert not re.search(r"\.check(_each|_internal|_on_cluster)?\(|\bprincipal:", source), core


def test_storage_changes_a_replica_only_as_its_rules_decide() -> None:
    """A seal's end, ``sealed_here`` and the fence are decided in
    ``storage/replica_transitions.py``; the commands and the writer persist
    what it returns."""
    for module in ("storage/commands.py", "storage/writer.py", "storage/engine.py"):
        source = (ROOT / module).read_text()
        assert "sealed_here=" not in source, module
        decided_inline = r"in ctx\.appended_ranges if|excess_from = info\.end_offset"
        assert not re.search(decided_inline, source), module
