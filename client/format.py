"""Output of the ``sbp`` command: aligned tables for people, JSON for scripts.

Messages are frozen dataclasses; ``to_jsonable`` turns them (and anything
nesting them) into plain dicts and lists, with error codes as their names.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sbp import messages
from sbp.enums import ObjectState
from sbp.replication import effective_acks


def to_jsonable(value: Any) -> Any:
    """Plain JSON values for messages, enums, tuples and numpy scalars."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: to_jsonable(getattr(value, field.name))
            for field in dataclasses.fields(value)
        }
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Mapping):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(item) for item in value]
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def dumps(value: Any, *, one_line: bool = False) -> str:
    """JSON text of ``value``: indented, or on one line (JSON lines)."""
    if one_line:
        return json.dumps(to_jsonable(value), separators=(",", ":"))
    return json.dumps(to_jsonable(value), indent=2, sort_keys=False)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numbers aligned right."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [len(header) for header in headers]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))
    numeric = [
        all(isinstance(row[i], int | float) for row in rows) if rows else False
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            value.rjust(width) if right else value.ljust(width)
            for value, width, right in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), *(line(row) for row in cells)])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def plural(count: int, noun: str) -> str:
    """``1 record``, ``2,000 records``."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def replicas_text(rng: messages.Range) -> str:
    """``node 1* (127.0.0.1:7401), node 2`` … with the primary starred."""
    parts = []
    for replica in rng.replica_nodes:
        node = replica.data_node
        star = "*" if replica.is_primary else ""
        parts.append(f"{node.node_id}{star}@{node.advertise_addr}")
    return ",".join(parts) or "-"


def acks_text(stream: messages.Stream) -> str:
    """A stream's ``ack_nums``: ``majority (2)`` for 0, else the number."""
    if stream.ack_nums > 0:
        return str(stream.ack_nums)
    return f"majority ({effective_acks(stream.replica_nums, 0)})"


def end_text(rng: messages.Range) -> str:
    return "open" if rng.is_open else str(rng.end_offset)


def retention_text(ms: int) -> str:
    if ms <= 0:
        return "forever"
    seconds = ms / 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def age_text(epoch_ms: int, now: float | None = None) -> str:
    """How long ago an epoch-milliseconds time was (``-`` when never)."""
    if epoch_ms <= 0:
        return "never"
    seconds = max(0.0, (now if now is not None else time.time()) - epoch_ms / 1000)
    if seconds < 60:
        return f"{seconds:.1f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def cleanup_text(stream: messages.Stream) -> str:
    """A stream's cleanup policy (SPEC §13): delete, compact, or both."""
    return {0: "delete", 1: "compact", 2: "compact+delete"}.get(
        stream.cleanup_policy, str(stream.cleanup_policy)
    )


def table_text(stream: messages.Stream) -> str:
    """How often a stream's table is committed (SPEC §16), ``-`` for none."""
    if stream.table_interval_ms <= 0:
        return "-"
    return f"every {retention_text(stream.table_interval_ms)}"


def tiering_text(stream: messages.Stream) -> str:
    """Whether a stream is tiered (SPEC §14) and how long its ranges stay
    on the nodes, ``-`` when it is not."""
    if stream.local_retention_ms < 0:
        return "-"
    return f"local {retention_text(stream.local_retention_ms)}"


#: where a range is, by its object_state (SPEC §14)
_WHERE: dict[int, str] = {
    ObjectState.ON_NODES: "nodes",
    ObjectState.IN_STORE_TOO: "nodes+store",
    ObjectState.IN_STORE_ONLY: "store",
}


def where_text(rng: messages.Range) -> str:
    """Where a range's records are: on the data nodes, also in the object
    store, or in the store only."""
    return _WHERE.get(rng.object_state, f"state {rng.object_state}")


def duration_text(seconds: float) -> str:
    """A span of time, to the second: ``45s``, ``3m 20s``, ``2h 05m``."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    return f"{whole // 3600}h {whole % 3600 // 60:02d}m"


def optional_size_text(value: float | None) -> str:
    """``size_text``, or ``-`` for a size not known yet."""
    return "-" if value is None else size_text(value)


def size_text(value: float) -> str:
    """Bytes in binary units: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
