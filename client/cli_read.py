"""``sbp read`` and ``sbp tail``: a stream's records printed as text, hex,
JSON Lines or a count (docs/cli.md). A module of its own, with numpy and the
consumer, so that the other commands load neither."""

from __future__ import annotations

import base64
import codecs
import json
from typing import IO, Any, Final

import numpy as np
import numpy.typing as npt

from net.service import UsageError
from sbp.batches import DecodedRecords

from . import format as fmt
from ._routing import ClientContext
from .by_time import offset_at_time, stream_end
from .cli_commands import Env
from .cli_defaults import EXIT_OK
from .consumer import DEFAULT_AUTO_COMMIT_INTERVAL, Consumer
from .group_member import GroupConsumer
from .progress import Progress

_NEWLINE: Final = np.uint8(ord("\n"))


# --------------------------------------------------------------------------- read / tail


class RecordPrinter:
    """Prints records as text lines (or JSON lines), or counts them (--stats),
    up to ``limit`` records and below ``end_offset``."""

    def __init__(self, env: Env, limit: int | None, end_offset: int | None = None) -> None:
        self.env = env
        self.limit = limit
        self.end_offset = end_offset
        #: a record at or past ``end_offset`` was seen
        self.past_end = False
        self.records = 0
        self.bytes = 0
        self.first_offset: int | None = None
        self.last_offset: int | None = None

    @property
    def done(self) -> bool:
        return self.past_end or (self.limit is not None and self.records >= self.limit)

    def take(self, batch: DecodedRecords, stream_id: int | None = None) -> None:
        """Print (or count) ``batch``; ``stream_id``: a member's, shown per record."""
        count = len(batch)
        if self.end_offset is not None:
            below = int(np.searchsorted(batch.offsets, self.end_offset))
            self.past_end = below < count
            count = below
        if self.limit is not None:
            count = min(count, self.limit - self.records)
        if count <= 0:
            return
        if self.first_offset is None:
            self.first_offset = int(batch.offsets[0])
        self.last_offset = int(batch.offsets[count - 1])
        self.records += count
        self.bytes += int(batch.value_offsets[count] - batch.value_offsets[0])
        if not self.env.args.stats:
            self._print(batch, count, stream_id)

    def _print(self, batch: DecodedRecords, count: int, stream_id: int | None = None) -> None:
        args, out = self.env.args, self.env.out
        shown_keys, shown_headers = args.keys, args.headers
        if not (self.env.json or args.offsets or args.hex or shown_keys or shown_headers):
            plain = _plain_lines(batch, count) if batch.value_valid is None else None
            if plain is not None:
                _write_utf8(out, plain)
                return
        lines = []
        text = _hex_text if args.hex else _text
        for i in range(count):
            raw = batch.value(i)
            offset = int(batch.offsets[i])
            if self.env.json:
                timestamp = int(batch.timestamps[i])
                record = _record_json(offset, timestamp, raw, hex_values=args.hex)
                if stream_id is not None:
                    record = {"stream_id": stream_id, **record}
                key = batch.key(i)
                if key is not None:
                    record.update(_bytes_json("key", key, hex_values=args.hex))
                headers = batch.headers_of(i)
                if headers:
                    record["headers"] = [[name, _header_json(v)] for name, v in headers]
                lines.append(json.dumps(record))
                continue
            where = str(offset) if stream_id is None else f"{stream_id}:{offset}"
            parts = [where] if args.offsets else []
            if shown_headers:
                parts.append(",".join(f"{n}={text(v)}" for n, v in batch.headers_of(i)))
            value = text(raw)
            if shown_keys:
                value = f"{text(batch.key(i))}{args.key_separator}{value}"
            parts.append(value)
            lines.append("\t".join(parts))
        out.write("\n".join(lines) + "\n")
        out.flush()

    def summary(self) -> dict[str, Any]:
        return {
            "stream_id": self.env.args.stream_id,
            "records": self.records,
            "bytes": self.bytes,
            "first_offset": self.first_offset,
            "last_offset": self.last_offset,
        }

    def print_stats(self) -> None:
        stats = self.summary()
        if self.env.json:
            self.env.emit_json(stats)
        else:
            span = (
                f"offsets {stats['first_offset']}..{stats['last_offset']}"
                if self.records
                else "no records"
            )
            source = (
                f"stream {stats['stream_id']}"
                if stats["stream_id"] is not None
                else f"group {self.env.args.group}"
            )
            self.env.emit(
                f"{source}: {fmt.plural(self.records, 'record')}, "
                f"{fmt.size_text(self.bytes)} of values, {span}"
            )


def _text(raw: bytes | None) -> str:
    """A value, key or header value as text: UTF-8, other bytes escaped; a
    missing one (a tombstone's value, a record without a key) as nothing."""
    return "" if raw is None else raw.decode("utf-8", "backslashreplace")


def _hex_text(raw: bytes | None) -> str:
    return "" if raw is None else raw.hex()


def _record_json(
    offset: int, timestamp: int, raw: bytes | None, *, hex_values: bool
) -> dict[str, object]:
    """One record as JSON, its value without loss: hex with ``--hex``, else
    the text when it is UTF-8, else ``value_base64`` (so the bytes
    ``\xff\xfe`` and the text ``\\xff\\xfe`` stay apart); null for a tombstone."""
    record: dict[str, object] = {"offset": offset, "timestamp_ms": timestamp}
    if raw is None:
        record["value"] = None
        return record
    record.update(_bytes_json("value", raw, hex_values=hex_values))
    return record


def _bytes_json(name: str, raw: bytes, *, hex_values: bool) -> dict[str, object]:
    """``{name: text}`` (or hex), or ``{name_base64: ...}`` when not UTF-8."""
    if hex_values:
        return {name: raw.hex()}
    try:
        return {name: raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {f"{name}_base64": base64.b64encode(raw).decode("ascii")}


def _header_json(raw: bytes) -> object:
    """A header value: its text, or ``{"base64": ...}`` when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode("ascii")}


def _plain_lines(batch: DecodedRecords, count: int) -> npt.NDArray[np.uint8] | None:
    """The first ``count`` values as UTF-8 text lines, built for the whole
    batch at once (never a Python step per record), or None when a value is
    not UTF-8 (those are printed with escapes, a line at a time)."""
    offsets = batch.value_offsets
    start, end = int(offsets[0]), int(offsets[count])
    values = batch.values[start:end]
    lengths = np.diff(offsets[: count + 1])
    lines: npt.NDArray[np.uint8]
    if (lengths == lengths[0]).all():
        # records of one size (a common export): a newline column after a
        # reshape, one strided copy (~10x np.insert's rate)
        width = int(lengths[0])
        table = np.empty((count, width + 1), dtype=np.uint8)
        table[:, :width] = values.reshape(count, width)
        table[:, width] = _NEWLINE
        lines = table.reshape(-1)
    else:
        ends = np.asarray(offsets[1 : count + 1], dtype=np.int64) - start
        lines = np.insert(values, ends, _NEWLINE)
    # ASCII is UTF-8; anything else is checked by decoding it once
    if values.size and values.max() >= 0x80:
        try:
            lines.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            return None
    return lines


def _write_utf8(out: IO[str], data: npt.NDArray[np.uint8]) -> None:
    """Write UTF-8 ``data`` to a text stream: to the bytes under it when it
    encodes UTF-8 (no decode to str and encode back), else as text."""
    binary = getattr(out, "buffer", None)
    encoding = getattr(out, "encoding", None) or "ascii"
    if binary is not None and codecs.lookup(encoding).name == "utf-8":
        out.flush()  # what was written as text goes first
        binary.write(data)
        binary.flush()
    else:
        out.write(data.tobytes().decode("utf-8"))
        out.flush()


async def _consume(
    env: Env,
    from_offset: int,
    *,
    tail: bool,
    progress: Progress | None = None,
    end_offset: int | None = None,
) -> int:
    printer = RecordPrinter(env, env.args.count, end_offset)
    group = getattr(env.args, "group", None)
    async with Consumer(
        env.pm,
        env.args.stream_id,
        from_offset,
        pool=env.pool,
        tail=tail,
        retry_timeout=env.args.timeout,
        request_timeout=env.args.timeout,
        group=group,
        auto_commit_interval=None,  # --commit stores the position once, at the end
    ) as consumer:
        if env.args.since is not None and (group is None or consumer.committed is None):
            await consumer.seek_to_time(env.args.since)
        if end_offset is not None and consumer.position >= end_offset:
            printer.past_end = True  # starts at or past where it is to stop
        while not printer.done:
            batch = await consumer.receive_batch()
            if batch is None:
                break
            printer.take(batch)
            if progress is not None:
                progress.update(printer.records, printer.bytes)
        if getattr(env.args, "commit", False) and printer.last_offset is not None:
            await consumer.commit(printer.last_offset + 1)
    if progress is not None:
        progress.update(printer.records, printer.bytes, final=True)
    if env.args.stats:
        printer.print_stats()
    return EXIT_OK


async def cmd_read(env: Env) -> int:
    """Read a stream from --from up to its end as it is now. On a terminal,
    while the records go to a file or a pipe (or with --stats), a progress
    line on stderr shows how far it is and how fast it goes."""
    if env.args.commit and env.args.group is None:
        raise UsageError("--commit needs --group")
    if env.args.subscribe is not None:
        return await _read_as_member(env)
    if env.args.stream_id is None:
        raise UsageError("read needs a STREAM (or --group G --subscribe STREAMS)")
    from_offset = env.args.from_offset
    if from_offset is None:  # the first record not trimmed away
        ranges = await env.pm.list_stream_ranges(env.args.stream_id)
        from_offset = ranges[0].start_offset if ranges else 0
    stop = await _stop_offset(env)
    progress = None
    shown = env.err.isatty() and (env.args.stats or not env.out.isatty())
    if env.args.progress or shown:
        end = await _end_offset(env, env.args.stream_id)
        if stop is not None:
            end = min(end, stop)
        wanted = max(0, end - from_offset)
        if env.args.count is not None:
            wanted = min(wanted, env.args.count)
        progress = Progress(env.err, True, total_records=wanted, verb="read")
    return await _consume(env, from_offset, tail=False, progress=progress, end_offset=stop)


async def _read_as_member(env: Env) -> int:
    """``read --group G --subscribe ...``: print what the PM assigns this
    member (SPEC §15) as it comes, until Ctrl-C or --count; each record with
    its stream (``S:O`` with --offsets, ``stream_id`` in JSON)."""
    args = env.args
    if args.group is None:
        raise UsageError("--subscribe needs --group")
    if args.stream_id is not None:
        raise UsageError("give a STREAM or --subscribe, not both")
    for flag, value in (
        ("--from", args.from_offset),
        ("--since", args.since),
        ("--to", args.to_offset),
        ("--until", args.until),
    ):
        if value is not None:
            raise UsageError(
                f"{flag} does not go with --subscribe: a member starts where the group stopped"
            )
    printer = RecordPrinter(env, args.count)
    async with GroupConsumer(
        env.pm,
        args.group,
        args.subscribe,
        pool=env.pool,
        request_timeout=args.timeout,
        auto_commit_interval=DEFAULT_AUTO_COMMIT_INTERVAL if args.commit else None,
    ) as member:
        while not printer.done:
            batch = await member.next_batch()
            printer.take(batch.records, batch.stream_id)
        if args.commit:
            await member.commit()
    if args.stats:
        printer.print_stats()
    return EXIT_OK


async def _stop_offset(env: Env) -> int | None:
    """Where ``read`` stops: --to, or the first offset appended at or after
    --until (the lower of the two); None for the stream's end."""
    stops = [] if env.args.to_offset is None else [env.args.to_offset]
    if env.args.until is not None:
        async with ClientContext(env.pm, env.pool, env.args.timeout) as context:
            stops.append(await offset_at_time(context, env.args.stream_id, env.args.until))
    return min(stops) if stops else None


async def cmd_tail(env: Env) -> int:
    """Follow a stream: print records as they are appended (Ctrl-C stops)."""
    from_offset = env.args.from_offset
    if from_offset is None and env.args.since is None:
        from_offset = await _end_offset(env, env.args.stream_id)
    return await _consume(env, from_offset or 0, tail=True)


async def _end_offset(env: Env, stream_id: int) -> int:
    """The offset the next append to a stream gets (``by_time.stream_end``)."""
    async with ClientContext(env.pm, env.pool, env.args.timeout) as context:
        return await stream_end(context, stream_id)
