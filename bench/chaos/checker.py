"""The checker: what the streams hold at the end, against what the run was
told and what its consumers saw. Pure functions of the history and the
final reads, so that they can be tested on made-up histories.

Violations (each one makes the run fail):

==================  ===================================================================
``lost``            an acknowledged value is not at its offset (and was not trimmed)
``two-values``      two values acknowledged, or read, at one offset
``gap``             offsets missing between the first and last stored ones
``duplicate``       a value stored twice: with idempotent producers (SPEC §10) any
                    value; without, one that was never sent twice (not retried)
``backwards``       a consumer was handed an offset not above the one before
``dirty-read``      a consumer read a value at an offset that holds another at the end
``range-chain``     a range does not start where the one before it ended
``phantom``         a value stored that no producer sent
``replica``         a replica of a range holds other records than the stream reads
                    back for that range's offsets (streams with more than one replica)
``table``           with ``--tables`` (SPEC §16): a stream's Iceberg table holds an
                    offset twice, another value than the stream, an offset the
                    stream never stored, or misses one it stores, or did not reach
                    the stream's end (``tables_check``)
==================  ===================================================================

On compacted streams (``History.compacted_keys``) a value may be missing at
the end, from the stream and its replicas, only where a later value of its
key is stored (SPEC §13: the latest record of every key survives), and
offsets may have gaps.

With idempotent producers (the default) every ``unknown`` outcome must end
up stored once or not at all. Without them (``--at-least-once``),
duplicates of values that were sent more than once are allowed and counted.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from .history import History, key_of

KINDS = (
    "lost",
    "two-values",
    "gap",
    "duplicate",
    "backwards",
    "dirty-read",
    "range-chain",
    "phantom",
    "replica",
    "table",
)
#: examples kept per kind in the report
EXAMPLES = 10


@dataclass(frozen=True, slots=True)
class StoredStream:
    """One stream as read at the end: its records and its ranges."""

    stream_id: int
    records: list[tuple[int, bytes]]
    #: (start_offset, end_offset or -1 when open) of each range, in order
    ranges: list[tuple[int, int]]
    read_error: str = ""
    #: per "range R on node N": the range's [start, stop) and the records
    #: that replica holds of it
    replicas: dict[str, tuple[int, int, list[tuple[int, bytes]]]] = field(default_factory=dict)
    #: its ranges in the object store only (SPEC §14), read from there
    offloaded_ranges: int = 0


@dataclass
class Verdict:
    violations: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    allowed_duplicates: int = 0
    stored_records: int = 0
    unknown_stored: int = 0
    unknown_missing: int = 0
    read_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values()) and not self.read_errors

    def add(self, kind: str, example: str) -> None:
        self.violations[kind] += 1
        if len(self.examples[kind]) < EXAMPLES:
            self.examples[kind].append(example)


def check(history: History, stored: list[StoredStream]) -> Verdict:
    verdict = Verdict()
    by_stream = {s.stream_id: s for s in stored}
    outcomes_by_stream: dict[int, list] = defaultdict(list)
    for outcome in history.outcomes:
        outcomes_by_stream[outcome.stream_id].append(outcome)
    for stream_id in history.streams:
        final = by_stream.get(stream_id)
        if final is None or final.read_error:
            why = final.read_error if final else "not read"
            verdict.read_errors.append(f"stream {stream_id}: {why}")
            continue
        _check_stream(verdict, stream_id, final, outcomes_by_stream[stream_id], history)
    return verdict


def _check_stream(
    verdict: Verdict, stream_id: int, final: StoredStream, outcomes: list, history: History
) -> None:
    trimmed_to = history.trimmed_to.get(stream_id, 0)
    at: dict[int, bytes] = {}
    offsets_of: dict[bytes, list[int]] = defaultdict(list)
    for offset, value in final.records:
        if offset in at:
            verdict.add("two-values", f"stream {stream_id} offset {offset} read twice at the end")
        at[offset] = value
        offsets_of[value].append(offset)
    verdict.stored_records += len(at)
    superseded = _superseded(at, history.compacted_keys)
    # gaps: the stored offsets run without a hole from the first to the last
    if at and not history.compacted_keys:
        first, last = min(at), max(at)
        missing = (last - first + 1) - len(at)
        if missing:
            hole = next(o for o in range(first, last + 1) if o not in at)
            verdict.add("gap", f"stream {stream_id}: {missing} offsets missing, first {hole}")
    sent = {o.value: o for o in outcomes}
    acked_at: dict[int, bytes] = {}
    for outcome in outcomes:
        if outcome.status == "ack":
            other = acked_at.get(outcome.offset)
            if other is not None and other != outcome.value:
                verdict.add(
                    "two-values",
                    f"stream {stream_id} offset {outcome.offset}: acknowledged for "
                    f"{other!r} and {outcome.value!r}",
                )
            acked_at[outcome.offset] = outcome.value
            if outcome.offset < trimmed_to:
                continue
            stored = at.get(outcome.offset)
            if stored is None and superseded(outcome.offset, outcome.value):
                continue  # compacted away: a later value of its key is stored
            if stored != outcome.value:
                verdict.add(
                    "lost",
                    f"stream {stream_id}: {outcome.value!r} acknowledged at {outcome.offset}, "
                    f"which holds {stored!r}",
                )
        elif outcome.status == "unknown":
            if outcome.value in offsets_of:
                verdict.unknown_stored += 1
            else:
                verdict.unknown_missing += 1
        elif outcome.value in offsets_of:
            verdict.add("phantom", f"stream {stream_id}: {outcome.value!r} failed but is stored")
    for value, offsets in offsets_of.items():
        origin = sent.get(value)
        if origin is None:
            verdict.add("phantom", f"stream {stream_id}: {value!r} at {offsets[0]} never sent")
        elif len(offsets) > 1:
            retried = origin.attempts > 1 or origin.status == "unknown"
            if retried and not history.idempotent:
                verdict.allowed_duplicates += len(offsets) - 1
            else:
                verdict.add("duplicate", f"stream {stream_id}: {value!r} at {offsets}, sent once")
    observed = history.observed.get(stream_id, [])
    _check_reads(verdict, stream_id, observed, at, trimmed_to, superseded)
    _check_ranges(verdict, stream_id, final.ranges)
    _check_replicas(verdict, stream_id, final.replicas, at, superseded)


def _superseded(at: dict[int, bytes], keys: int) -> Callable[[int, bytes], bool]:
    """Whether the value at an offset may be gone: on a compacted stream
    with ``keys`` keys, when a later value of its key is stored."""
    if not keys:
        return lambda offset, value: False
    latest: dict[bytes, int] = {}
    for offset, value in at.items():
        key = key_of(value, keys)
        latest[key] = max(latest.get(key, -1), offset)
    return lambda offset, value: latest.get(key_of(value, keys), -1) > offset


def _check_reads(
    verdict: Verdict,
    stream_id: int,
    observed: list[tuple[int, bytes]],
    at: dict[int, bytes],
    trimmed_to: int,
    superseded: Callable[[int, bytes], bool],
) -> None:
    previous = -1
    for offset, value in observed:
        if offset <= previous:
            verdict.add("backwards", f"stream {stream_id}: read offset {offset} after {previous}")
        previous = max(previous, offset)
        if offset < trimmed_to:
            continue
        stored = at.get(offset)
        if stored is None and superseded(offset, value):
            continue
        if stored != value:
            verdict.add(
                "dirty-read",
                f"stream {stream_id}: read {value!r} at {offset}, which holds {stored!r}",
            )


def _check_ranges(verdict: Verdict, stream_id: int, ranges: list[tuple[int, int]]) -> None:
    for (_, end), (start, _) in itertools.pairwise(ranges):
        if end != start:
            verdict.add(
                "range-chain",
                f"stream {stream_id}: a range ends at {end}, the next starts at {start}",
            )


def _check_replicas(
    verdict: Verdict,
    stream_id: int,
    replicas: dict[str, tuple[int, int, list[tuple[int, bytes]]]],
    at: dict[int, bytes],
    superseded: Callable[[int, bytes], bool],
) -> None:
    for where, (start, stop, records) in replicas.items():
        # a replica not compacted yet may still hold what others removed
        held = {o: v for o, v in records if o in at or not superseded(o, v)}
        expected = {o: v for o, v in at.items() if start <= o < stop}
        if held != expected:
            verdict.add(
                "replica",
                f"stream {stream_id}: {where} holds {len(held)} records of [{start}, {stop}), "
                f"the stream {len(expected)}",
            )
