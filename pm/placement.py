"""Choosing the data nodes of a new range, and of new replicas of a sealed one.

A pure function of the candidates' loads, so that it is tested without a
cluster. The load of a node comes from its latest REPORT_METRICS (free disk,
append rate, active ranges) plus the ranges the PM placed on it since that
report, so a burst of placements between two reports spreads out instead of
piling onto the node that looked idle at the last report.

Scoring: each of the three measures is divided by its mean over the
candidates, so they weigh the same whatever their units, and the shares are
added (free disk counts inversely: less free space, more load). Ties, which
are the rule on a fresh cluster where every report is zero, go to the node
hosting the fewest ranges, then the lowest node id. The primary is the chosen
node that has been made primary the fewest times, so replica_nums equal to
the node count still rotates the primaries (and the append traffic).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sbp.errors import InvalidRequestError, NoAvailableDataNodeError


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What placement knows about one live data node."""

    node_id: int
    #: reported active ranges plus the ranges placed on the node since that report
    active_ranges: int = 0
    #: appends per second at the last report
    append_rate: int = 0
    #: bytes written to storage per second at the last report
    write_rate: int = 0
    #: bytes free at the last report; None before the first report
    disk_free_space: int | None = None
    #: every range the node hosts (the tie-break that spreads ranges evenly)
    hosted_ranges: int = 0
    #: how many ranges the PM has made this node primary of
    primaries: int = 0


def has_room(disk_free_space: int | None, min_free_space: int) -> bool:
    """Whether a node that reported ``disk_free_space`` may take new data: a
    node not heard from yet counts as having room. Below it, a node is full:
    it gets no new ranges, and the PM moves writes off it."""
    return disk_free_space is None or disk_free_space >= min_free_space


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _share(value: float, mean: float) -> float:
    return value / mean if mean > 0 else 0.0


def _scores(candidates: Sequence[NodeLoad]) -> dict[int, float]:
    mean_ranges = _mean([c.active_ranges for c in candidates])
    mean_rate = _mean([c.append_rate for c in candidates])
    reported_free = [c.disk_free_space for c in candidates if c.disk_free_space is not None]
    mean_free = _mean([float(f) for f in reported_free])
    scores: dict[int, float] = {}
    for c in candidates:
        if c.disk_free_space is None or mean_free <= 0:
            disk = 1.0 if mean_free > 0 else 0.0  # unknown: counted as average
        else:
            disk = mean_free / max(c.disk_free_space, 1)
        scores[c.node_id] = (
            _share(c.active_ranges, mean_ranges) + _share(c.append_rate, mean_rate) + disk
        )
    return scores


def place(
    candidates: Sequence[NodeLoad],
    replica_nums: int,
    *,
    min_free_space: int = 0,
    at_least: int | None = None,
) -> tuple[int, ...]:
    """The node ids for a new range of ``replica_nums`` replicas, primary first.

    ``candidates`` are the live nodes. A node that reported less free space
    than ``min_free_space`` is not eligible. Raises ``NoAvailableDataNodeError``
    when fewer than ``replica_nums`` nodes are eligible, or, with
    ``at_least``, fewer than that: a degraded placement then takes every
    eligible node (SPEC §7: the next range of a sealed one goes on as many
    live nodes as there are, down to ``ack_nums``).
    """
    if replica_nums < 1:
        raise InvalidRequestError(f"replica_nums must be at least 1, got {replica_nums}")
    eligible = [c for c in candidates if has_room(c.disk_free_space, min_free_space)]
    if at_least is not None and at_least <= len(eligible) < replica_nums:
        replica_nums = len(eligible)
    if len(eligible) < replica_nums:
        raise NoAvailableDataNodeError(
            f"{replica_nums} replicas wanted, {len(eligible)} live data nodes with free space"
        )
    scores = _scores(eligible)
    ranked = sorted(eligible, key=lambda c: (scores[c.node_id], c.hosted_ranges, c.node_id))
    chosen = ranked[:replica_nums]
    # min() keeps the first of equals, so ties stay in load order.
    primary = min(chosen, key=lambda c: c.primaries)
    return (primary.node_id, *(c.node_id for c in chosen if c is not primary))


def place_copies(
    candidates: Sequence[NodeLoad],
    count: int,
    size: int,
    incoming: Mapping[int, int],
    *,
    min_free_space: int = 0,
    write_horizon_s: float = 0.0,
) -> tuple[int, ...]:
    """The node ids for ``count`` new replicas of a sealed range of ``size``
    bytes (a drain moving it, a repair replacing a dead node): the nodes with
    the least to write, then the most free space, then the fewest ranges,
    among those left with ``min_free_space`` once this copy and theirs land.

    What a node has to write is what is already headed its way in this pass
    (``incoming`` by node id, in bytes, or in ranges where sizes are not
    known), plus, with ``incoming`` in bytes, what its appends write in
    ``write_horizon_s`` at its reported rate: a copy onto a node that takes
    a producer's appends slows those appends, so it goes to a node writing
    less while there is one. A sealed range takes no appends, so the append
    rate and open ranges that place new ranges do not apply, and copies
    spread by what is headed to each node rather than by free space, which
    is reported every few seconds and lags behind the copies of one pass.
    Evening out disk use is the rebalancer's. Fewer than ``count`` when
    fewer are eligible; NoAvailableDataNodeError when none is."""

    def room_after(c: NodeLoad) -> int | None:
        if c.disk_free_space is None:
            return None
        return c.disk_free_space - incoming.get(c.node_id, 0) - size

    eligible = [c for c in candidates if has_room(room_after(c), min_free_space)]
    if not eligible:
        raise NoAvailableDataNodeError("no live data node with room for a new replica")
    ranked = sorted(
        eligible,
        key=lambda c: (
            incoming.get(c.node_id, 0) + c.write_rate * write_horizon_s,
            -(c.disk_free_space or 0),
            c.hosted_ranges,
            c.node_id,
        ),
    )
    return tuple(c.node_id for c in ranked[:count])
