"""The result of a standalone benchmark (``python -m bench.<name>``): printed
as JSON, and written to ``--out`` too when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
