"""What ``sbp append`` says it stored when it fails: exactly what the
stream holds of the input when the stream could say (``Producer.stored``),
else what was acknowledged, marked as possibly short."""

from __future__ import annotations

import pytest

from client.cli_append import Tally


@pytest.mark.parametrize(
    ("tally", "text", "hint"),
    [
        (
            Tally(records=550_000, first_offset=0, last_offset=549_999, held_lines=550_000),
            "stored the first 550,000 lines of the input in stream 19, offsets 0..549999",
            "tail -n +550001 INPUT | sbp append 19",
        ),
        (
            # answers lost (a timeout) for records the stream holds all the same
            Tally(records=470_000, first_offset=0, last_offset=469_999, held_lines=550_000),
            "stored the first 550,000 lines of the input in stream 19 "
            "(470,000 acknowledged, offsets 0..469999; 80,000 answers were lost)",
            "tail -n +550001 INPUT | sbp append 19",
        ),
        (
            Tally(held_lines=1_000),
            "stored the first 1,000 lines of the input in stream 19 (their answers were lost)",
            "tail -n +1001 INPUT",
        ),
        (Tally(held_lines=0), "nothing of this run was stored in stream 19", "tail -n +1 INPUT"),
        (
            Tally(records=10, first_offset=5, last_offset=14),
            "10 records acknowledged in stream 19, offsets 5..14 (more may be stored)",
            None,
        ),
        (Tally(), "nothing acknowledged in stream 19 (more may be stored)", None),
    ],
)
def test_a_failed_append_says_exactly_what_the_stream_holds(
    tally: Tally, text: str, hint: str | None
) -> None:
    assert tally.stored_text(19) == text
    told = tally.rest_hint(19, "")
    assert (told is None) == (hint is None)
    if hint is not None:
        assert told is not None and hint in told


def test_a_named_producer_is_told_to_resume() -> None:
    tally = Tally(records=3, first_offset=0, last_offset=2, held_lines=7, skipped=4)
    assert tally.stored_text(2) == "stored the first 7 lines of the input in stream 2, offsets 0..2"
    assert tally.rest_hint(2, "loader") == "sbp: run it again with --resume to store the rest once"
