"""Byte counts as people write them (``512MiB``, ``10GiB``), for the servers'
flags and the command line alike; imports nothing heavy."""

from __future__ import annotations

import re
from typing import Final

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS: Final = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """A byte count: ``1048576``, ``64KiB``, ``512MiB``, ``8GiB`` (binary units;
    ``8G`` and ``8GB`` mean the same)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size such as 65536, 512MiB or 8GiB")
    number, unit = match.groups()
    return int(number) * _SIZE_UNITS[(unit or "")[:1].lower()]
