"""``sbp groups``: consumer groups' positions and lag (SPEC §11; docs/cli.md).

The PM keeps the positions and the end offset of each stream a group reads,
as it last learned it (every few seconds); ``describe`` dates the oldest
record a group has not read as the PM does (``client.lag``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from net.service import UsageError
from sbp import messages
from sbp.errors import GroupNotFoundError, SBPError

from . import format as fmt
from ._routing import ClientContext, replica_for_read
from .by_time import offset_at_time, stream_end
from .cli_commands import Env, _item_error
from .cli_defaults import EXIT_OK, EXIT_SERVER_ERROR
from .cluster_view import group_summaries
from .lag import lag_seconds, record_timestamp


async def cmd_groups_list(env: Env) -> int:
    """Every group, its streams and how far behind it is in all."""
    summaries = await group_summaries(env.pm)
    if env.json:
        env.emit_json(summaries)
        return EXIT_OK
    rows = [
        [
            g["group"],
            len(g["stream_ids"]),
            g["members"],
            "-" if g["lag_records"] is None else f"{g['lag_records']:,}",
            fmt.age_text(g["last_commit_ms"]),
        ]
        for g in summaries
    ]
    env.emit(
        fmt.table(["group", "streams", "members", "lag", "last commit"], rows)
        if rows
        else "no consumer groups"
    )
    return EXIT_OK


async def cmd_groups_describe(env: Env) -> int:
    """Per stream: the group's position, the stream's end, the lag in records
    and in seconds, the last commit and its metadata; then its members
    (SPEC §15): id, epoch, the streams each reads, its last heartbeat."""
    members = await env.pm.describe_members(env.args.group)
    try:
        positions = await env.pm.fetch_offsets(env.args.group)
    except GroupNotFoundError:
        if not members:
            raise
        positions = ()  # members that have not committed yet
    async with ClientContext(env.pm, env.pool, env.args.timeout) as context:
        ages = [await _lag_seconds(context, p) for p in positions]
    if env.json:
        holder = {s: m.member_id for m in members for s in m.streams}
        rows: list[dict[str, object]] = [
            {
                "stream_id": p.stream_id,
                "offset": p.offset,
                "end_offset": p.end_offset,
                "lag_records": p.lag_records,
                "lag_seconds": age,
                "commit_time_ms": p.commit_time_ms,
                "metadata": p.metadata,
                "member": holder.get(p.stream_id),
            }
            for p, age in zip(positions, ages, strict=True)
        ]
        known = {p.stream_id for p in positions}
        rows += [
            {"stream_id": s, "offset": -1, "member": member}
            for s, member in sorted(holder.items())
            if s not in known
        ]
        env.emit_json(rows)
        return EXIT_OK
    _print_members(env, members)
    if not positions:
        return EXIT_OK
    env.emit(
        fmt.table(
            ["stream", "offset", "end", "lag", "lag s", "last commit", "metadata"],
            [
                [
                    p.stream_id,
                    f"{p.offset:,}",
                    _known(p.end_offset),
                    _known(p.lag_records),
                    "-" if age is None else f"{age:.1f}",
                    fmt.age_text(p.commit_time_ms),
                    p.metadata,
                ]
                for p, age in zip(positions, ages, strict=True)
            ],
        )
    )
    return EXIT_OK


async def _lag_seconds(
    context: ClientContext, position: messages.GroupOffsetResult
) -> float | None:
    """The group's lag in seconds on one stream (``client.lag``, as the PM
    computes it); None when it cannot be known."""
    oldest: int | None = None
    if 0 <= position.offset < position.end_offset:
        ranges = await context.pm.list_stream_ranges(position.stream_id)
        rng = next((r for r in reversed(ranges) if r.start_offset <= position.offset), None)
        if rng is not None:
            try:
                oldest = await record_timestamp(
                    context.node(replica_for_read(rng, 0)), position.stream_id, position.offset
                )
            except (SBPError, OSError):
                oldest = None
    return lag_seconds(position.offset, position.end_offset, oldest, int(time.time() * 1000))


def _print_members(env: Env, members: Sequence[messages.MemberDescription]) -> None:
    if not members:
        env.emit("no members")
        return
    env.emit(
        fmt.table(
            ["member", "epoch", "streams", "last heartbeat"],
            [
                [
                    m.member_id,
                    m.member_epoch,
                    ",".join(str(s) for s in m.streams) or "-",
                    fmt.age_text(m.last_heartbeat_ms),
                ]
                for m in members
            ],
        )
    )


async def _remove_members(env: Env, group: str) -> bool:
    """``--force``: make every member of the group leave; whether there were any."""
    members = await env.pm.describe_members(group)
    for member in members:
        await env.pm.group_heartbeat(group, member.member_id, -1)
    if members and not env.json:
        print(
            f"sbp: removed {fmt.plural(len(members), 'member')} of group {group}: "
            + ", ".join(m.member_id for m in members),
            file=env.err,
        )
    return bool(members)


def _refuse_members(members: Sequence[messages.MemberDescription], group: str) -> None:
    if members:
        raise UsageError(
            f"group {group} has {fmt.plural(len(members), 'live member')} "
            f"({', '.join(m.member_id for m in members)}): they keep its positions; "
            "--force removes them first"
        )


def _known(value: int) -> str:
    return "-" if value < 0 else f"{value:,}"


async def cmd_groups_reset(env: Env) -> int:
    """Move the group's positions (on every stream it has one, or on
    --stream) to the earliest offset, the latest, an offset or a time. A
    group that does not exist is GROUP_NOT_FOUND (exit 1): a group comes
    into being with a reader's first commit."""
    group, target = env.args.group, env.args.to
    if not env.args.dry_run:
        if env.args.force:
            await _remove_members(env, group)
        else:
            _refuse_members(await env.pm.describe_members(group), group)
    held = await env.pm.fetch_offsets(group)  # GROUP_NOT_FOUND: nothing to reset
    stream_ids: Sequence[int] = (
        [env.args.stream] if env.args.stream is not None else [p.stream_id for p in held]
    )
    async with ClientContext(env.pm, env.pool, env.args.timeout) as context:
        offsets = [
            messages.GroupOffset(stream_id=s, offset=await _target(context, s, target))
            for s in stream_ids
        ]
    if env.args.dry_run:
        return _print_planned_reset(env, held, offsets)
    results = await env.pm.commit_offsets(group, offsets)
    if env.json:
        env.emit_json(results)
    failed = [r for r in results if r.error_code]
    stored = [r for r in results if not r.error_code]
    if stored and not env.json:
        env.emit(fmt.table(["stream", "offset"], [[r.stream_id, r.offset] for r in stored]))
    for result in failed:
        print(_item_error(result.error_code, result.error_message), file=env.err)
    return EXIT_SERVER_ERROR if failed else EXIT_OK


def _print_planned_reset(
    env: Env, held: Sequence[messages.GroupOffsetResult], offsets: list[messages.GroupOffset]
) -> int:
    """``reset --dry-run``: each position now and where it would move."""
    now = {p.stream_id: p.offset for p in held}
    rows = [(o.stream_id, now.get(o.stream_id, -1), o.offset) for o in offsets]
    if env.json:
        env.emit_json([{"stream_id": s, "offset": old, "new_offset": new} for s, old, new in rows])
        return EXIT_OK
    env.emit(
        fmt.table(
            ["stream", "offset", "new offset", "change"],
            [
                [s, _known(old), f"{new:,}", f"{new - old:+,}" if old >= 0 else "-"]
                for s, old, new in rows
            ],
        )
    )
    env.emit("dry run: nothing changed")
    return EXIT_OK


async def _target(context: ClientContext, stream_id: int, target: tuple[str, int]) -> int:
    kind, value = target
    if kind == "offset":
        return value
    if kind == "time":
        return await offset_at_time(context, stream_id, value)
    if kind == "latest":
        return await stream_end(context, stream_id)
    ranges = await context.pm.list_stream_ranges(stream_id)
    if not ranges:
        raise UsageError(f"stream {stream_id} has no ranges")
    return ranges[0].start_offset  # earliest


async def cmd_groups_delete(env: Env) -> int:
    """Forget whole groups; an unknown group is an error (exit 1)."""
    for group in env.args.groups:
        if env.args.force:
            await _remove_members(env, group)
        else:
            _refuse_members(await env.pm.describe_members(group), group)
    results = await env.pm.delete_groups(env.args.groups)
    if env.json:
        env.emit_json(results)
    failed = [r for r in results if r.error_code]
    for result in results:
        if not result.error_code and not env.json:
            env.emit(f"deleted group {result.group}")
    for result in failed:
        print(_item_error(result.error_code, result.error_message), file=env.err)
    return EXIT_SERVER_ERROR if failed else EXIT_OK
