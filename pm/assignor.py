"""Which member of a consumer group reads which stream (SPEC §15): a pure
function of the members' subscriptions and what each reads now.

Balanced: among members that subscribe to the same streams, their stream
counts differ by at most one (in general: no stream could move to a member
it is open to that has two fewer). Sticky: a member keeps what it reads
unless it no longer subscribes to it or holds more than its share; a new
stream goes to the least loaded member open to it. What moves is as little
as that allows: a join takes streams only from the members above the new
share, a leave gives only the leaver's streams away.

The target says who *should* read each stream; who *may* read it now is
the target less the streams another member still holds
(``answerable``): a stream moves only after its old member let go of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Set


def target_assignment(
    subscriptions: Mapping[str, Set[int]],
    current: Mapping[str, Set[int]],
    streams: Set[int] | None = None,
) -> dict[str, set[int]]:
    """Each member's streams: ``subscriptions`` by member id, ``current``
    what each reads (or should read) now; ``streams`` the streams that
    exist (None: all subscribed ones do)."""
    wanted = set().union(*subscriptions.values()) if subscriptions else set()
    if streams is not None:
        wanted &= streams
    targets: dict[str, set[int]] = {member: set() for member in subscriptions}
    taken: set[int] = set()
    # stickiness: what each reads now and still subscribes to, each stream once
    for member in sorted(subscriptions):
        for stream in sorted(current.get(member, set())):
            if stream in wanted and stream in subscriptions[member] and stream not in taken:
                targets[member].add(stream)
                taken.add(stream)
    # new streams to the least loaded member open to them
    for stream in sorted(wanted - taken):
        open_to = [m for m in subscriptions if stream in subscriptions[m]]
        chosen = min(open_to, key=lambda m: (len(targets[m]), m))
        targets[chosen].add(stream)
    _balance(subscriptions, targets)
    return targets


def _balance(subscriptions: Mapping[str, Set[int]], targets: dict[str, set[int]]) -> None:
    """Move streams one at a time from the most loaded members to members
    open to them with at least two fewer, until no such move is left (each
    move lowers the sum of squared counts, so this ends)."""
    while True:
        move = _best_move(subscriptions, targets)
        if move is None:
            return
        stream, giver, taker = move
        targets[giver].discard(stream)
        targets[taker].add(stream)


def _best_move(
    subscriptions: Mapping[str, Set[int]], targets: dict[str, set[int]]
) -> tuple[int, str, str] | None:
    by_load = sorted(targets, key=lambda m: (-len(targets[m]), m))
    for giver in by_load:
        load = len(targets[giver])
        for stream in sorted(targets[giver], reverse=True):  # newest streams move first
            takers = [
                m
                for m in subscriptions
                if stream in subscriptions[m] and len(targets[m]) <= load - 2
            ]
            if takers:
                return stream, giver, min(takers, key=lambda m: (len(targets[m]), m))
    return None


def answerable(member: str, target: Set[int], holders: Mapping[int, str]) -> set[int]:
    """What ``member`` may read now: its target, less the streams another
    member still holds (revoked from it, not yet let go of)."""
    return {stream for stream in target if holders.get(stream, member) == member}
