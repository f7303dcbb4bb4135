"""The arithmetic of replication (SPEC §7), shared by the PM, the data node
and the tests: how many replicas acknowledge, where a range's commit offset
is, and where a sealed range ends. No I/O; every function is total over its
documented inputs."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidRequestError, NotEnoughReplicasError


def majority(replica_nums: int) -> int:
    """A majority of ``replica_nums`` replicas: ``R / 2 + 1``."""
    return replica_nums // 2 + 1


def effective_acks(replica_nums: int, ack_nums: int) -> int:
    """The ``ack_nums`` a stream runs with: 0 means a majority. A value above
    the replicas the range has (a degraded range) is capped at them, so a
    range placed on fewer nodes than ``replica_nums`` stays writable."""
    acks = majority(replica_nums) if ack_nums <= 0 else ack_nums
    return max(1, min(acks, replica_nums))


def check_acks(replica_nums: int, ack_nums: int) -> None:
    """Refuse a stream whose ``ack_nums`` is outside ``0`` or ``1..replica_nums``."""
    if ack_nums == 0:
        return
    if not 1 <= ack_nums <= replica_nums:
        raise InvalidRequestError(
            f"ack_nums must be 1 to replica_nums ({replica_nums}), or 0 for a majority; "
            f"got {ack_nums}"
        )


def commit_offset(replica_next_offsets: Sequence[int], ack_nums: int) -> int:
    """The highest offset below which at least ``ack_nums`` replicas hold every
    record: the ``ack_nums``-th largest durable next offset of the range's
    replicas, the primary's included. The caller gives one offset per replica
    (a follower not heard from counts as holding nothing of the range: its
    start offset)."""
    if not 1 <= ack_nums <= len(replica_next_offsets):
        raise ValueError(f"{ack_nums} acks of {len(replica_next_offsets)} replicas")
    return sorted(replica_next_offsets, reverse=True)[ack_nums - 1]


def seal_end(answered_next_offsets: Sequence[int], replica_nums: int, ack_nums: int) -> int:
    """The end offset of a range sealed after a failure (SPEC §7).

    ``answered_next_offsets`` are the durable next offsets of the replicas
    that answered the seal; at least ``R - A + 1`` are needed. Sorted
    ascending, the end is the answer at index ``R - A``, however many
    answered: an acknowledged record is held by ``A`` replicas, so by at
    least ``A - (R - k)`` of ``k`` answers, and the answer ``k - (A - R + k)
    = R - A`` from the bottom is at or above it. It is no higher than what
    one answering replica holds, so the range's records exist somewhere.
    """
    answers = len(answered_next_offsets)
    needed = replica_nums - ack_nums + 1
    if answers < needed:
        raise NotEnoughReplicasError(
            f"{answers} of {replica_nums} replicas answered the seal; {needed} are needed "
            f"with ack_nums {ack_nums}"
        )
    return sorted(answered_next_offsets)[replica_nums - ack_nums]
