"""The docs name only flags that exist: every command-line flag a doc names
is declared by one of the project's commands."""

from __future__ import annotations

import re

from ..docs_text import ROOT, named_in_docs

CODE = sorted(
    path
    for package in (
        "sbp",
        "storage",
        "net",
        "client",
        "datanode",
        "pm",
        "spark_jobs",
        "tables",
        "tiering",
        "bench",
    )
    for path in (ROOT / package).rglob("*.py")
)

#: flags of other programs the docs show beside ours
OTHER_PROGRAMS_FLAGS = frozenset({"--client-cert-auth"})  # etcd's

FLAG_IN_DOC = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
FLAG_DECLARED = re.compile(r"""(?:add_argument\(\s*|Option\(\s*)["'](?:--)?([a-z][a-z0-9-]+)["']""")


def _code_text() -> str:
    return "\n".join(path.read_text() for path in CODE)


def test_every_flag_a_doc_names_is_declared() -> None:
    code = _code_text()
    declared = {f"--{name}" for name in FLAG_DECLARED.findall(code)}
    # argparse.BooleanOptionalAction declares --no-NAME beside --NAME
    declared |= {
        f"--no-{name}"
        for name in re.findall(
            r"""["']--([a-z][a-z0-9-]+)["'],\s*action=argparse\.BooleanOptionalAction""", code
        )
    }
    declared |= {"--help"}
    assert len(declared) > 50  # the scan finds the parsers
    unknown = {
        f"{page}: {flag}"
        for page, flag in named_in_docs(FLAG_IN_DOC)
        if flag not in declared and flag not in OTHER_PROGRAMS_FLAGS
    }
    assert not unknown, sorted(unknown)
