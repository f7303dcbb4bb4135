"""``sbp nodes``: retire data nodes (SPEC §12; docs/operations.md).

``drain`` asks the PM to move every range off the nodes; ``--wait`` follows
the drain with a progress line (ranges and bytes left on the nodes, and the
rate they leave at) until every node is drained. ``drain --cancel`` makes
them active again. ``remove`` forgets stopped nodes that hold no range.
"""

from __future__ import annotations

import collections
import time

import trio

from sbp import messages
from sbp.enums import DataNodeState

from . import format as fmt
from .cli_commands import Env, _item_error
from .cli_defaults import EXIT_OK, EXIT_SERVER_ERROR
from .cluster_view import state_name

#: how often ``drain --wait`` asks the PM how far the drain is
POLL_S = 1.0
#: the drain's rate is what left the nodes over this long
RATE_WINDOW_S = 10.0


async def cmd_nodes_drain(env: Env) -> int:
    """Drain nodes (or cancel their drain); with --wait, until they are drained."""
    node_ids: list[int] = env.args.node_ids
    results = await env.pm.drain_data_nodes(node_ids, cancel=env.args.cancel)
    failed = [r for r in results if r.error_code]
    if env.json and not env.args.wait:
        env.emit_json(results)
    else:
        for result in results:
            if result.error_code:
                print(_item_error(result.error_code, result.error_message), file=env.err)
            else:
                env.emit(f"node {result.node_id}: {state_name(result.state)}")
    if failed:
        return EXIT_SERVER_ERROR
    if env.args.wait and not env.args.cancel:
        statuses = await _wait_drained(env, node_ids)
        if env.json:
            env.emit_json(statuses)
        else:
            env.emit(f"{fmt.plural(len(node_ids), 'node')} drained: they can be stopped")
    return EXIT_OK


async def cmd_nodes_remove(env: Env) -> int:
    """Forget stopped nodes that hold no range."""
    results = await env.pm.remove_data_nodes(env.args.node_ids)
    if env.json:
        env.emit_json(results)
    for result in results:
        if result.error_code:
            print(_item_error(result.error_code, result.error_message), file=env.err)
        elif not env.json:
            env.emit(f"node {result.node_id}: removed")
    return EXIT_SERVER_ERROR if any(r.error_code for r in results) else EXIT_OK


async def cmd_cluster_rebalance(env: Env) -> int:
    """Print the moves that even out the data nodes; start them unless --dry-run."""
    answer = await env.pm.rebalance(dry_run=env.args.dry_run)
    if env.json:
        env.emit_json(answer)
        return EXIT_OK
    if answer.pending:
        env.emit(
            f"{fmt.plural(answer.pending, 'move')} of an earlier plan still under way: "
            "no new plan until they are done"
        )
        return EXIT_OK
    if not answer.moves:
        env.emit("the data nodes are balanced: nothing to move")
        return EXIT_OK
    env.emit(
        fmt.table(
            ["stream", "range", "from", "to", "size"],
            [
                [m.stream_id, m.range_index, m.from_node, m.to_node, fmt.size_text(m.bytes)]
                for m in answer.moves
            ],
        )
    )
    total = fmt.size_text(sum(m.bytes for m in answer.moves))
    verb = "would move" if env.args.dry_run else "moving"
    env.emit(f"{verb} {fmt.plural(len(answer.moves), 'range')}, {total}")
    return EXIT_OK


class LeftRate:
    """How fast what is left goes down, over the last ``window`` seconds of
    samples; a sample above the one before (the PM learned sizes it did not
    know, or more to move came) starts the window again."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def note(self, now: float, left: int) -> None:
        samples = self._samples
        if samples and left > samples[-1][1]:
            samples.clear()
        samples.append((now, left))
        while len(samples) > 2 and now - samples[1][0] >= self.window:
            samples.popleft()

    @property
    def per_second(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (first_at, first), (last_at, last) = self._samples[0], self._samples[-1]
        return max(first - last, 0) / max(last_at - first_at, 1e-6)

    def eta_text(self) -> str:
        """Seconds until nothing is left at the current rate, as text."""
        rate, left = self.per_second, self._samples[-1][1] if self._samples else 0
        if not left:
            return "done"
        if rate <= 0:
            return "ETA unknown"
        return f"ETA {fmt.duration_text(left / rate)}"


async def _wait_drained(env: Env, node_ids: list[int]) -> list[messages.DataNodeStatus]:
    """Poll DESCRIBE_CLUSTER until every node is drained, drawing progress on stderr."""
    rate = LeftRate()
    draw = env.err.isatty() or env.args.progress
    while True:
        watched = [s for s in await env.pm.describe_cluster() if s.data_node.node_id in node_ids]
        ranges = sum(s.range_count for s in watched)
        left = sum(s.bytes_to_move for s in watched)
        rate.note(time.monotonic(), left)
        done = all(s.state == DataNodeState.DRAINED for s in watched)
        if draw:
            line = (
                f"draining {fmt.plural(len(watched), 'node')}: "
                f"{fmt.plural(ranges, 'range')} and {fmt.size_text(left)} left, "
                f"{fmt.size_text(rate.per_second)}/s, {rate.eta_text()}"
            )
            print(f"\r{line}\x1b[K", end="\n" if done else "", file=env.err, flush=True)
        if done:
            return watched
        await trio.sleep(POLL_S)
