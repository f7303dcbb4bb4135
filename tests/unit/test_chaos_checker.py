"""The chaos checker on made-up histories: each violation it names is found,
and what is allowed (trims, duplicates of values sent again) is not one."""

from __future__ import annotations

import itertools

from bench.chaos.checker import StoredStream, check
from bench.chaos.faults import KINDS, draw_schedule
from bench.chaos.history import History, Outcome
from bench.chaos.tables_check import check_tables

S = 7


def ack(value: str, offset: int, attempts: int = 1) -> Outcome:
    return Outcome(S, value.encode(), "ack", offset, attempts, 0.0, 0.1)


def unknown(value: str, attempts: int = 1) -> Outcome:
    return Outcome(S, value.encode(), "unknown", -1, attempts, 0.0, 0.1, "lost connection")


def history(*outcomes: Outcome, observed: list[tuple[int, str]] | None = None) -> History:
    h = History(outcomes=list(outcomes), streams=[S])
    h.observed[S] = [(o, v.encode()) for o, v in observed or []]
    return h


def stored(*records: tuple[int, str], ranges: list[tuple[int, int]] | None = None) -> StoredStream:
    return StoredStream(S, [(o, v.encode()) for o, v in records], ranges or [(0, -1)])


def test_a_clean_history_passes() -> None:
    verdict = check(
        history(ack("a", 0), ack("b", 1), unknown("c"), observed=[(0, "a"), (1, "b")]),
        [stored((0, "a"), (1, "b"), (2, "c"))],
    )
    assert verdict.ok and verdict.unknown_stored == 1 and verdict.stored_records == 3


def test_a_lost_acknowledged_value_is_found() -> None:
    verdict = check(history(ack("a", 0), ack("b", 1)), [stored((0, "a"))])
    assert verdict.violations["lost"] == 1 and not verdict.ok
    assert "b'b' acknowledged at 1" in verdict.examples["lost"][0]


def test_two_values_acknowledged_at_one_offset() -> None:
    verdict = check(history(ack("a", 0), ack("b", 0)), [stored((0, "a"))])
    assert verdict.violations["two-values"] == 1


def test_a_gap_in_offsets() -> None:
    verdict = check(history(ack("a", 0), ack("c", 2)), [stored((0, "a"), (2, "c"))])
    assert verdict.violations["gap"] == 1
    assert "first 1" in verdict.examples["gap"][0]


def test_at_least_once_allows_duplicates_only_of_values_sent_again() -> None:
    h = history(ack("a", 1, attempts=2))
    h.idempotent = False
    sent_again = check(h, [stored((0, "a"), (1, "a"))])
    assert sent_again.ok and sent_again.allowed_duplicates == 1
    h = history(ack("a", 1))
    h.idempotent = False
    sent_once = check(h, [stored((0, "a"), (1, "a"))])
    assert sent_once.violations["duplicate"] == 1


def test_idempotent_producers_may_store_nothing_twice() -> None:
    """SPEC §10: a value sent again, or whose outcome is unknown, is stored
    once or not at all; twice is a violation however often it was sent."""
    sent_again = check(history(ack("a", 1, attempts=3)), [stored((0, "a"), (1, "a"))])
    assert sent_again.violations["duplicate"] == 1 and sent_again.allowed_duplicates == 0
    unknown = Outcome(S, b"b", "unknown", -1, 2, 0.0, 1.0)
    once = check(history(unknown), [stored((0, "b"))])
    assert once.ok and once.unknown_stored == 1
    twice = check(history(unknown), [stored((0, "b"), (1, "b"))])
    assert twice.violations["duplicate"] == 1


def test_reads_that_go_backwards_or_were_later_lost() -> None:
    verdict = check(
        history(ack("a", 0), ack("b", 1), observed=[(1, "b"), (0, "a"), (1, "x")]),
        [stored((0, "a"), (1, "b"))],
    )
    assert verdict.violations["backwards"] == 2
    assert verdict.violations["dirty-read"] == 1


def test_trimmed_offsets_are_neither_lost_nor_dirty() -> None:
    h = history(ack("a", 0), ack("b", 1), ack("c", 2), observed=[(0, "a")])
    h.record_trim(S, 2)
    verdict = check(h, [stored((2, "c"), ranges=[(2, -1)])])
    assert verdict.ok


def test_ranges_must_chain_and_nothing_unsent_is_stored() -> None:
    verdict = check(
        history(ack("a", 0)),
        [stored((0, "a"), (1, "zzz"), ranges=[(0, 5), (6, -1)])],
    )
    assert verdict.violations["range-chain"] == 1
    assert verdict.violations["phantom"] == 1


def test_an_unreadable_stream_fails_the_run() -> None:
    verdict = check(history(ack("a", 0)), [StoredStream(S, [], [], "TimeoutError: no answer")])
    assert not verdict.ok and verdict.read_errors


def test_the_schedule_is_a_function_of_the_seed() -> None:
    nodes, links = ["node-1", "node-2"], ["->node-1", "node-1->pm"]
    first = draw_schedule(42, 300, nodes, links)
    assert first == draw_schedule(42, 300, nodes, links)
    assert first != draw_schedule(43, 300, nodes, links)
    assert {fault.kind for fault in first} <= set(KINDS)
    # one fault at a time, all over before the quiet end of the run
    for before, after in itertools.pairwise(first):
        assert before.at + before.duration <= after.at
    assert first[-1].at + first[-1].duration <= 300 - 5


def test_a_replica_that_differs_from_the_stream_is_found() -> None:
    good = [(0, b"a"), (1, b"b")]
    final = StoredStream(
        S,
        [(0, b"a"), (1, b"b")],
        [(0, -1)],
        replicas={"range 0 on node 1": (0, 2, good), "range 0 on node 2": (0, 2, [])},
    )
    verdict = check(history(ack("a", 0), ack("b", 1)), [final])
    assert verdict.violations["replica"] == 1
    assert "node 2 holds 0 records of [0, 2), the stream 2" in verdict.examples["replica"][0]


def compacted(*outcomes: Outcome, observed: list[tuple[int, str]] | None = None) -> History:
    h = history(*outcomes, observed=observed)
    h.compacted_keys = 1  # every value has the one key k0
    return h


def test_on_a_compacted_stream_only_the_latest_of_a_key_must_stay() -> None:
    from bench.chaos.history import key_of

    assert key_of(b"a", 1) == key_of(b"b", 1) == b"k0"
    h = compacted(ack("a", 0), ack("b", 1), ack("c", 2), observed=[(0, "a"), (1, "b")])
    replicas = {"range 0 on node 1": (0, 3, [(1, b"b"), (2, b"c")])}
    verdict = check(h, [StoredStream(S, [(2, b"c")], [(0, -1)], replicas=replicas)])
    assert verdict.ok, verdict.examples
    # the latest acknowledged value of the key gone: lost
    verdict = check(compacted(ack("a", 0), ack("b", 1)), [stored((0, "a"))])
    assert verdict.violations["lost"] == 1
    # another value where one was read is still a dirty read
    verdict = check(compacted(ack("b", 1), observed=[(0, "a")]), [stored((0, "z"), (1, "b"))])
    assert verdict.violations["dirty-read"] == 1


def table_rows(*rows: tuple[int, str]) -> list[tuple[int, bytes]]:
    return [(offset, value.encode()) for offset, value in rows]


def test_a_table_is_checked_against_its_stream() -> None:
    h = history(ack("a", 0), ack("b", 1), ack("c", 2))
    final = [stored((0, "a"), (1, "b"), (2, "c"))]

    def table_verdict(end: int, *rows: tuple[int, str]) -> list[str]:
        verdict = check(h, final)
        check_tables(verdict, h, final, {S: (end, table_rows(*rows))})
        return verdict.examples.get("table", [])

    assert table_verdict(3, (0, "a"), (1, "b"), (2, "c")) == []
    assert table_verdict(3, (0, "a"), (1, "b"), (1, "b"), (2, "c")) == [
        f"stream {S} offset 1: 2 rows in the table"
    ]
    assert table_verdict(3, (0, "a"), (2, "c")) == [f"stream {S} offset 1: missing from the table"]
    assert table_verdict(3, (0, "a"), (1, "x"), (2, "c")) == [f"stream {S} offset 1: another value"]
    assert table_verdict(2, (0, "a"), (1, "b")) == [f"stream {S}: the table ends at 2, not 3"]
    assert table_verdict(4, (0, "a"), (1, "b"), (2, "c"), (3, "d")) == [
        f"stream {S} offset 3: not in the stream"
    ]
    # tabled before a trim: in the table only, and fine
    trimmed = history(ack("a", 0), ack("b", 1), ack("c", 2))
    trimmed.trimmed_to[S] = 2
    verdict = check(trimmed, [stored((2, "c"))])
    check_tables(
        verdict, trimmed, [stored((2, "c"))], {S: (3, table_rows((0, "a"), (1, "b"), (2, "c")))}
    )
    assert not verdict.examples.get("table")


def test_the_tables_process_is_killed_and_paused_when_asked() -> None:
    nodes, links = ["node-1"], ["->node-1"]
    schedule = draw_schedule(5, 600, nodes, links, ("kill", "pause"), others=["tables"])
    assert "tables" in {fault.target for fault in schedule}
    assert "tables" not in {f.target for f in draw_schedule(5, 600, nodes, links, ("kill",))}
