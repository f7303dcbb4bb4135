"""What the docs name, for the tests that hold the docs to the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the README and every page of docs/
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def named_in_docs(pattern: re.Pattern[str]) -> set[tuple[str, str]]:
    """Every (page, text) the pattern matches in the docs."""
    return {
        (str(doc.relative_to(ROOT)), found)
        for doc in DOCS
        for found in pattern.findall(doc.read_text())
    }
