"""The commands of ``sbp`` (client/cli.py parses and runs them).

Every command is one async function taking an ``Env`` (the parsed
arguments, the PM client, the connection pool, the output streams) and
returning the exit code; failures are raised and turned into one line and
an exit code by ``client.cli.main``.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import trio

from net.acl import AclError, load_acl
from net.acl import describe as describe_acl
from net.pool import ConnectionPool
from net.service import UsageError
from sbp import messages
from sbp.errors import ConnectionClosed, ProtocolError, SBPError

from . import format as fmt
from ._base import SBPClient
from .cli_defaults import EXIT_OK, EXIT_SERVER_ERROR
from .cluster_view import node_summary
from .datanode_client import DataNodeClient
from .pm_client import PMClient


@dataclass
class Env:
    """What every command works with."""

    args: argparse.Namespace
    pm: PMClient
    pool: ConnectionPool
    out: IO[str]
    err: IO[str]

    @property
    def json(self) -> bool:
        return bool(self.args.json)

    def emit(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def emit_json(self, value: Any) -> None:
        self.emit(fmt.dumps(value))

    def emit_listing(
        self, items: Sequence[Any], render: Callable[[Sequence[Any]], str], empty: str
    ) -> None:
        """Items as JSON, or as a table, or a line saying there are none."""
        if self.json:
            self.emit_json(items)
        else:
            self.emit(render(items) if items else empty)


Command = Callable[[Env], Awaitable[int]]


# --------------------------------------------------------------------------- ping


async def cmd_ping(env: Env) -> int:
    """PING the PM, and with --all every data node it knows."""
    targets: list[tuple[str, str, SBPClient | None]] = [("pm", env.args.pm, env.pm)]
    if env.args.all:
        for status in await env.pm.describe_cluster():
            node = status.data_node
            targets.append((f"node-{node.node_id}", node.advertise_addr, None))
    results = []
    for name, address, client in targets:
        if client is None:
            client = DataNodeClient(address, pool=env.pool, timeout=env.args.timeout)
        try:
            rtt_ms: float | None = 1000 * await client.ping()
            error = ""
        except (ConnectionClosed, OSError) as failure:
            if name == "pm":
                raise
            rtt_ms, error = None, str(failure)
        results.append({"name": name, "address": address, "rtt_ms": rtt_ms, "error": error})
    if env.json:
        env.emit_json(results)
    else:
        for row in results:
            answer = f"{row['rtt_ms']:.2f} ms" if row["rtt_ms"] is not None else row["error"]
            env.emit(f"{row['name']} {row['address']}: {answer}")
    return EXIT_SERVER_ERROR if any(row["rtt_ms"] is None for row in results) else EXIT_OK


# --------------------------------------------------------------------------- streams


def _retention(stream: messages.Stream) -> str:
    """The stream's retention by time, and its size limit when it has one."""
    text = fmt.retention_text(stream.retention_period_ms)
    if stream.retention_bytes > 0:
        text += f", at most {fmt.size_text(stream.retention_bytes)}"
    return text


def _stream_rows(streams: Sequence[messages.Stream]) -> str:
    return fmt.table(
        ["stream", "replicas", "acks", "retention", "cleanup", "tiered", "table", "epoch"],
        [
            [
                s.stream_id,
                s.replica_nums,
                fmt.acks_text(s),
                _retention(s),
                fmt.cleanup_text(s),
                fmt.tiering_text(s),
                fmt.table_text(s),
                s.epoch,
            ]
            for s in streams
        ],
    )


async def cmd_streams_create(env: Env) -> int:
    """Create --count streams with --replicas replicas each, records
    acknowledged once --acks of them hold them (default: a majority)."""
    if env.args.acks > env.args.replicas:
        raise UsageError(f"--acks {env.args.acks} is more than --replicas {env.args.replicas}")
    retained = bool(env.args.retention_ms or env.args.retention_bytes)
    spec = messages.Stream(
        replica_nums=env.args.replicas,
        retention_period_ms=env.args.retention_ms,
        ack_nums=env.args.acks,
        retention_bytes=env.args.retention_bytes,
        cleanup_policy=(2 if retained else 1) if env.args.compact else 0,
        min_compaction_lag_ms=env.args.compact_lag,
        delete_retention_ms=env.args.delete_retention,
        table_interval_ms=env.args.table_interval,
        local_retention_ms=env.args.local_retention,
    )
    results = await env.pm.create_streams([spec] * env.args.count)
    failed = [r for r in results if r.error_code]
    created = [r for r in results if not r.error_code and r.stream is not None]
    if env.json:
        env.emit_json(results)
    else:
        rows = []
        for result in created:
            assert result.stream is not None
            rng = result.range
            rows.append(
                [
                    result.stream.stream_id,
                    result.stream.replica_nums,
                    fmt.acks_text(result.stream),
                    _retention(result.stream),
                    fmt.replicas_text(rng) if rng is not None else "-",
                ]
            )
        if rows:
            env.emit(
                fmt.table(["stream", "replicas", "acks", "retention", "nodes (* primary)"], rows)
            )
    for result in failed:
        print(_item_error(result.error_code, result.error_message), file=env.err)
    return EXIT_SERVER_ERROR if failed else EXIT_OK


async def cmd_streams_list(env: Env) -> int:
    """Every stream, in id order."""
    streams = [stream async for stream in env.pm.list_streams()]
    env.emit_listing(streams, _stream_rows, "no streams")
    return EXIT_OK


async def cmd_streams_get(env: Env) -> int:
    """The streams with these ids; an unknown id is an error (exit 1)."""
    results = await env.pm.get_streams(env.args.stream_ids)
    found = [r.stream for r in results if not r.error_code and r.stream is not None]
    if env.json:
        env.emit_json(results)
    elif found:
        env.emit(_stream_rows(found))
    failed = [r for r in results if r.error_code]
    for result in failed:
        print(_item_error(result.error_code, result.error_message), file=env.err)
    return EXIT_SERVER_ERROR if failed else EXIT_OK


async def cmd_streams_describe(env: Env) -> int:
    """A stream's settings, then its ranges with where each one is: on the
    data nodes, also in the object store, or there only (SPEC §14)."""
    stream = await env.pm.get_stream(env.args.stream_id)
    ranges = list(await env.pm.list_stream_ranges(env.args.stream_id))
    if env.json:
        env.emit_json({"stream": stream, "ranges": ranges})
        return EXIT_OK
    env.emit(_stream_rows([stream]))
    env.emit("")
    env.emit_listing(ranges, _range_rows, "no ranges")
    where = Counter(fmt.where_text(r) for r in ranges)
    env.emit(
        f"{len(ranges)} ranges: "
        + ", ".join(f"{where[w]} {w}" for w in ("nodes", "nodes+store", "store") if where[w])
    )
    return EXIT_OK


async def cmd_streams_update(env: Env) -> int:
    """Change a stream's settings; those not given stay as they are."""
    args = env.args
    asked = (
        args.replicas,
        args.retention_ms,
        args.acks,
        args.retention_bytes,
        args.compact,
        args.compact_lag,
        args.delete_retention,
        args.table_interval,
        args.local_retention,
    )
    if all(value is None for value in asked):
        raise UsageError(
            "nothing to update: give --replicas, --acks, --retention-ms, --retention-bytes, "
            "--compact or --no-compact, --compact-lag, --delete-retention, --table-interval "
            "and/or --local-retention"
        )
    size_limit = args.retention_bytes
    if size_limit == 0:
        size_limit = -1  # on the wire, 0 keeps the limit and -1 removes it
    current = await env.pm.get_stream(args.stream_id)
    policy = current.cleanup_policy
    if args.compact is not None:
        retained = (args.retention_ms or current.retention_period_ms) or (
            size_limit != -1 and (size_limit or current.retention_bytes)
        )
        policy = (2 if retained else 1) if args.compact else 0
    # the settings of SPEC §13-§16 go as they are to be (pm.stream_settings)
    wanted = replace(
        current,
        replica_nums=args.replicas if args.replicas is not None else current.replica_nums,
        retention_period_ms=(
            args.retention_ms if args.retention_ms is not None else current.retention_period_ms
        ),
        ack_nums=args.acks if args.acks is not None else current.ack_nums,
        retention_bytes=size_limit or 0,
        cleanup_policy=policy,
        min_compaction_lag_ms=(
            args.compact_lag if args.compact_lag is not None else current.min_compaction_lag_ms
        ),
        delete_retention_ms=(
            args.delete_retention
            if args.delete_retention is not None
            else current.delete_retention_ms
        ),
        table_interval_ms=(
            args.table_interval if args.table_interval is not None else current.table_interval_ms
        ),
        local_retention_ms=(
            args.local_retention if args.local_retention is not None else current.local_retention_ms
        ),
    )
    stream = await env.pm.update_stream(wanted)
    env.emit_json(stream) if env.json else env.emit(_stream_rows([stream]))
    return EXIT_OK


async def cmd_streams_delete(env: Env) -> int:
    """Delete streams, their ranges and their records on the data nodes."""
    stream_ids = list(env.args.stream_ids)
    repeated = sorted({s for s in stream_ids if stream_ids.count(s) > 1})
    if repeated:
        # a repeated id is most likely a typo for another stream: nothing is deleted
        raise UsageError(
            f"stream {', '.join(map(str, repeated))} named more than once: nothing deleted"
        )
    results = await env.pm.delete_streams(stream_ids)
    failed = [r for r in results if r.error_code]
    if env.json:
        env.emit_json(results)
    else:
        deleted = [
            stream_id for stream_id, r in zip(stream_ids, results, strict=False) if not r.error_code
        ]
        if deleted:
            noun = "stream" if len(deleted) == 1 else "streams"
            env.emit(f"deleted {noun} " + ", ".join(str(s) for s in deleted))
    for result in failed:
        print(_item_error(result.error_code, result.error_message), file=env.err)
    return EXIT_SERVER_ERROR if failed else EXIT_OK


async def cmd_streams_trim(env: Env) -> int:
    """Drop a stream's records below an offset."""
    stream_id, offset = env.args.stream_id, env.args.offset
    before = await env.pm.list_stream_ranges(stream_id)
    first_before = before[0].start_offset if before else 0
    result = await env.pm.trim_stream(stream_id, offset)
    if env.json:
        env.emit_json(result)
    elif offset <= first_before:
        env.emit(
            f"nothing changed: stream {stream_id} already starts at offset {first_before}, "
            f"not below {offset}"
        )
    else:
        env.emit(f"trimmed stream {stream_id} below offset {offset}")
    return EXIT_OK


# --------------------------------------------------------------------------- ranges


def _range_rows(ranges: Sequence[messages.Range]) -> str:
    return fmt.table(
        [
            "stream",
            "range",
            "start",
            "end",
            "next",
            "commit",
            "epoch",
            "where",
            "nodes (* primary)",
        ],
        [
            [
                r.stream_id,
                r.range_index,
                r.start_offset,
                fmt.end_text(r),
                r.next_offset,
                _commit_text(r.commit_offset),
                r.epoch,
                fmt.where_text(r),
                fmt.replicas_text(r),
            ]
            for r in ranges
        ],
    )


def _commit_text(commit_offset: int) -> str | int:
    """-1: no replica that answered knows the commit offset (they restarted
    and have not heard from each other yet)."""
    return "unknown" if commit_offset < 0 else commit_offset


async def cmd_ranges_list(env: Env) -> int:
    """The ranges of a stream, or (--node) every range on one data node. For
    a stream's open range the replicas are asked too: their next and commit
    offsets are shown as the replicas' state (``down`` when one does not
    answer)."""
    if (env.args.stream_id is None) == (env.args.node is None):
        raise UsageError("give a stream id or --node NODE_ID (one of them)")
    if env.args.stream_id is not None:
        ranges = list(await env.pm.list_stream_ranges(env.args.stream_id))
        if ranges and ranges[-1].is_open:
            ranges[-1], states = await _live_range(env, ranges[-1])
            if not env.json:
                env.emit_listing(ranges, _range_rows, "no ranges")
                env.emit(f"replicas of the open range: {states}")
                return EXIT_OK
    else:
        node = await _find_node(env, env.args.node)
        ranges = list(await env.pm.list_node_ranges(node))
    env.emit_listing(ranges, _range_rows, "no ranges")
    return EXIT_OK


async def _live_range(env: Env, rng: messages.Range) -> tuple[messages.Range, str]:
    """The open range with the next and commit offsets its replicas report,
    and each replica's state as text."""
    states = []
    next_offset, commit = rng.next_offset, -1  # the PM's snapshot of an open range is its start
    for replica in rng.replica_nodes:
        node = replica.data_node
        timeout = min(env.args.timeout, 2.0)
        client = DataNodeClient(node.advertise_addr, pool=env.pool, timeout=timeout)
        star = "*" if replica.is_primary else ""
        try:
            live = await client.describe_range(rng.stream_id, rng.range_index)
        except (SBPError, OSError, trio.TooSlowError) as error:
            states.append(f"{node.node_id}{star} down ({error or 'no answer'})")
            continue
        states.append(
            f"{node.node_id}{star} next {live.next_offset} "
            f"commit {_commit_text(live.commit_offset)}"
        )
        next_offset = max(next_offset, live.next_offset) if replica.is_primary else next_offset
        commit = max(commit, live.commit_offset)
    return replace(rng, next_offset=next_offset, commit_offset=commit), "; ".join(states)


async def cmd_ranges_describe(env: Env) -> int:
    """One range as the PM holds it."""
    rng = await env.pm.describe_range(env.args.stream_id, env.args.range_index)
    env.emit_json(rng) if env.json else env.emit(_range_rows([rng]))
    return EXIT_OK


async def cmd_ranges_seal(env: Env) -> int:
    """Seal a stream's open range (or the given one) and open the next."""
    index = env.args.range_index
    if index is None:
        ranges = await env.pm.list_stream_ranges(env.args.stream_id)
        if not ranges or not ranges[-1].is_open:
            raise UsageError(f"stream {env.args.stream_id} has no open range")
        index = ranges[-1].range_index
    result = await env.pm.seal_range(env.args.stream_id, index)
    if env.json:
        env.emit_json(result)
    else:
        env.emit(_range_rows(result.ranges))
    return EXIT_OK


async def _find_node(env: Env, node_id: int) -> messages.DataNode:
    for status in await env.pm.describe_cluster():
        if status.data_node.node_id == node_id:
            return status.data_node
    raise UsageError(f"the PM knows no data node {node_id}")


# --------------------------------------------------------------------------- cluster


async def cmd_cluster_status(env: Env) -> int:
    """The data nodes the PM knows: liveness, ranges and latest load report."""
    statuses = await env.pm.describe_cluster()
    # the PM that answered: with several (on etcd), the leader, found by the client
    leader = env.pm.address
    now = time.time()
    rows = [node_summary(status, now) for status in statuses]
    if env.json:
        env.emit_json({"pm": env.args.pm, "pm_leader": leader, "data_nodes": rows})
        return EXIT_OK
    alive = sum(1 for row in rows if row["alive"])
    if len(env.pm.addresses) > 1:
        env.emit(f"PM leader {leader} (of {env.args.pm})")
    env.emit(f"PM {leader}: {alive} of {len(rows)} data nodes alive")
    missing = sum(row["under_replicated"] for row in rows if row["alive"])
    dead_ranges = sum(row["ranges"] for row in rows if not row["alive"])
    env.emit(
        f"under-replicated ranges: {missing} reported by live nodes"
        + (f"; {fmt.plural(dead_ranges, 'range')} on dead nodes" if dead_ranges else "")
    )
    if rows:
        env.emit(
            fmt.table(
                [
                    "node",
                    "address",
                    "alive",
                    "state",
                    "heartbeat",
                    "ranges",
                    "open",
                    "under-replicated",
                    "in/s",
                    "free",
                ],
                [
                    [
                        row["node_id"],
                        row["address"],
                        row["alive"],
                        _state_text(row),
                        fmt.age_text(row["last_heartbeat_ms"], now),
                        row["ranges"],
                        row["active_ranges"],
                        row["under_replicated"],
                        fmt.size_text(row["in_bytes_per_s"]),
                        fmt.optional_size_text(row["disk_free_bytes"]),
                    ]
                    for row in rows
                ],
            )
        )
    return EXIT_OK


def _state_text(row: dict[str, Any]) -> str:
    if row["state"] == "draining":
        return f"draining ({fmt.size_text(row['bytes_to_move'])} left)"
    return str(row["state"])


def _item_error(code: int, message: str) -> str:
    return f"sbp: {ProtocolError(message, code=code)}"


# --------------------------------------------------------------------------- acl


async def cmd_acl_check(env: Env) -> int:
    """Check an ACL file as the servers read it (SPEC §9): print its entries,
    or the first problem (exit 2). Speaks to no server."""
    try:
        acl = load_acl(Path(env.args.file))
    except AclError as error:
        raise UsageError(str(error)) from None
    if env.json:
        env.emit_json(
            [
                {
                    "principal": e.principal,
                    "operations": sorted(e.operations),
                    "resource": str(e.resource),
                    "effect": "allow" if e.allow else "deny",
                }
                for e in acl.entries
            ]
        )
        return EXIT_OK
    env.emit(f"{env.args.file}: {len(acl)} entries, valid")
    for line in describe_acl(acl):
        env.emit(f"  {line}")
    return EXIT_OK
