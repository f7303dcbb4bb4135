"""The arithmetic of SPEC §7: acks, commit offsets and the seal rule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbp.errors import InvalidRequestError, NotEnoughReplicasError
from sbp.replication import check_acks, commit_offset, effective_acks, majority, seal_end


@pytest.mark.parametrize(("replicas", "expected"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_majority(replicas: int, expected: int) -> None:
    assert majority(replicas) == expected


def test_effective_acks_zero_is_a_majority_and_caps_at_the_replicas() -> None:
    assert effective_acks(3, 0) == 2
    assert effective_acks(3, 3) == 3
    assert effective_acks(2, 3) == 2  # a degraded range of a 3-replica stream
    assert effective_acks(1, 0) == 1


def test_check_acks() -> None:
    check_acks(3, 0)
    check_acks(3, 1)
    check_acks(3, 3)
    for bad in (-1, 4):
        with pytest.raises(InvalidRequestError, match="ack_nums"):
            check_acks(3, bad)


def test_seal_end_takes_index_r_minus_a_of_the_sorted_answers() -> None:
    # AutoMQ Elastic Stream's examples: answers 1, 2, 3 of three replicas
    assert seal_end([3, 1, 2], 3, 1) == 3
    assert seal_end([3, 1, 2], 3, 2) == 2
    assert seal_end([3, 1, 2], 3, 3) == 1


def test_seal_end_with_the_fewest_answers_takes_the_highest() -> None:
    assert seal_end([5, 9], 3, 2) == 9
    assert seal_end([4], 3, 3) == 4


@pytest.mark.parametrize(("answers", "replicas", "acks"), [([], 3, 2), ([1], 3, 2), ([1, 2], 3, 1)])
def test_seal_end_with_too_few_answers(answers: list[int], replicas: int, acks: int) -> None:
    with pytest.raises(NotEnoughReplicasError, match="answered the seal"):
        seal_end(answers, replicas, acks)


def test_commit_offset_is_the_a_th_largest() -> None:
    assert commit_offset([10, 4, 7], 1) == 10
    assert commit_offset([10, 4, 7], 2) == 7
    assert commit_offset([10, 4, 7], 3) == 4
    with pytest.raises(ValueError):
        commit_offset([10], 2)


@given(
    holdings=st.lists(st.integers(0, 50), min_size=1, max_size=5),
    acks_seed=st.integers(0, 10),
    data=st.data(),
)
def test_the_seal_never_ends_below_a_committed_offset(
    holdings: list[int], acks_seed: int, data: st.DataObject
) -> None:
    """Whatever subset of at least R - A + 1 replicas answers, the end is at or
    above the commit offset (every acknowledged record survives) and at most
    what some answering replica holds (every record below the end exists)."""
    replicas = len(holdings)
    acks = 1 + acks_seed % replicas
    committed = commit_offset(holdings, acks)
    size = data.draw(st.integers(replicas - acks + 1, replicas))
    for answering in itertools.combinations(holdings, size):
        end = seal_end(list(answering), replicas, acks)
        assert committed <= end <= max(answering)
