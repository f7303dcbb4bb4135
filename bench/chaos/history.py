"""What a run did and saw, as the checker and the report read it.

Every value a producer sends is unique (``p<producer>-<seq>``) and ends with
one outcome (on compacted streams it has a key, ``key_of`` the value):

=========== ===================================================================
``ack``     stored at ``offset`` (the node answered NONE)
``failed``  refused before it left the client: it cannot be stored
``unknown`` sent at least once, then failed (a lost connection, a timeout):
            it may or may not be stored
=========== ===================================================================

``attempts`` counts the APPEND requests that carried it; more than one means
the producer sent it again, so it may be stored twice.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any


def key_of(value: bytes, keys: int) -> bytes:
    """The key a value of a compacted stream is sent with: one of ``keys``,
    a function of the value alone, so the checker needs nothing else."""
    return b"k%d" % (zlib.crc32(value) % keys)


@dataclass(frozen=True, slots=True)
class Outcome:
    stream_id: int
    value: bytes
    status: str  # ack | failed | unknown
    offset: int  # -1 unless ack
    attempts: int
    sent_at: float
    done_at: float
    error: str = ""


@dataclass(frozen=True, slots=True)
class FaultSpan:
    """A fault as injected: from ``start`` until healed at ``end`` (run seconds)."""

    kind: str
    target: str
    start: float
    end: float
    detail: str = ""


@dataclass
class History:
    """Everything recorded during a run (times in seconds from its start)."""

    outcomes: list[Outcome] = field(default_factory=list)
    #: per stream, what tailing consumers were handed, in order: (offset, value)
    observed: dict[int, list[tuple[int, bytes]]] = field(default_factory=lambda: defaultdict(list))
    #: per stream, the highest offset it was trimmed to (data below may go)
    trimmed_to: dict[int, int] = field(default_factory=dict)
    faults: list[FaultSpan] = field(default_factory=list)
    #: side operations: (time, what, stream, result)
    operations: list[tuple[float, str, int, str]] = field(default_factory=list)
    streams: list[int] = field(default_factory=list)
    #: the producers were idempotent: nothing may be stored twice
    idempotent: bool = True
    #: the streams are compacted (SPEC §13), their values sent with this many
    #: keys (``key_of``); 0: plain streams
    compacted_keys: int = 0

    def record_trim(self, stream_id: int, offset: int) -> None:
        self.trimmed_to[stream_id] = max(offset, self.trimmed_to.get(stream_id, 0))

    def counts(self) -> dict[str, int]:
        totals = {"ack": 0, "failed": 0, "unknown": 0, "retried": 0}
        for outcome in self.outcomes:
            totals[outcome.status] += 1
            totals["retried"] += outcome.attempts > 1
        return totals

    def timeline(self, seconds: int) -> dict[str, list[int]]:
        """Per second of the run: values acknowledged, and values that failed
        or whose outcome is unknown (by when their outcome was known)."""
        acks = [0] * (seconds + 1)
        errors = [0] * (seconds + 1)
        for outcome in self.outcomes:
            second = min(int(outcome.done_at), seconds)
            if outcome.status == "ack":
                acks[second] += 1
            else:
                errors[second] += 1
        return {"acks": acks, "errors": errors}

    def fault_json(self) -> list[dict[str, Any]]:
        return [asdict(span) for span in self.faults]
