"""``sbp append``: input lines become records, as they arrive.

Input is read in chunks of whatever has arrived (a worker thread blocks on
the file descriptor, never the event loop), so a live pipe such as
``tail -F app.log | sbp append 7`` stores each line within the producer's
linger (50 ms) of its arrival, and a file is read in 1 MiB chunks.

The count shown and printed is of records the cluster acknowledged. Ctrl-C
stops reading, waits for what was read to be stored (a second Ctrl-C gives
up at once), reports it and exits 130. On a failure the command says which
offsets were stored before it, so that nobody appends the same input twice
to find out.

Each record is stored once however often the cluster's answers are lost
(an idempotent producer, SPEC §10). Across runs, ``--producer-name NAME
--resume`` continues NAME's last run at the same epoch: the stream says how
many records that run stored (``Producer.resume``), those input lines are
skipped, and the rest is stored once, for the same input.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Final

import trio

from net.service import UsageError
from sbp.errors import SBPError

from . import format as fmt
from .cli_commands import Env
from .cli_defaults import EXIT_INTERRUPTED, EXIT_OK
from .producer import Producer, RecordsHandle, RecordTooLargeError
from .progress import Progress
from .record_input import records_of

#: bytes asked of the input per read; a pipe returns what it has
READ_CHUNK_BYTES: Final = 1 << 20
#: records wait this long for more before they are sent (the producer's linger)
APPEND_LINGER_S: Final = 0.05


class LineReader:
    """Complete input lines, without their line ends, as they arrive.

    A line ends at ``\\n``; one ``\\r`` before it goes too (CRLF input),
    any other ``\\r`` stays part of the value. A last line without ``\\n``
    is a record too. A line longer than ``max_line`` is refused as soon as
    it is seen, before it fills memory.
    """

    def __init__(self, fd: int, max_line: int) -> None:
        self._fd = fd
        self._max_line = max_line
        self._pending = b""
        self.eof = False
        #: the complete lines returned so far (names a line refused)
        self._lines_done = 0
        #: lines read past those ``skip`` skipped, and their bytes
        self._carry: tuple[list[bytes], int] | None = None

    async def skip(self, count: int) -> int:
        """Read past the first ``count`` lines; how many there were (fewer
        when the input ends first)."""
        skipped = 0
        while skipped < count:
            lines, _ = await self.next_lines()
            if not lines:
                break
            take = min(count - skipped, len(lines))
            skipped += take
            if take < len(lines):
                rest = lines[take:]
                self._carry = (rest, sum(len(line) + 1 for line in rest))
        return skipped

    async def next_lines(self) -> tuple[list[bytes], int]:
        """The lines completed by the next read and the bytes they took;
        ``([], 0)`` once the input has ended (``eof``)."""
        if self._carry is not None:
            carried, self._carry = self._carry, None
            return carried
        while not self.eof:
            data = await trio.to_thread.run_sync(
                os.read, self._fd, READ_CHUNK_BYTES, abandon_on_cancel=True
            )
            if not data:
                self.eof = True
                last, self._pending = self._pending, b""
                return ([last], len(last)) if last else ([], 0)
            text = self._pending + data if self._pending else data
            end = text.rfind(b"\n")
            if end < 0:
                self._pending = text
                self._check(len(text), 0)
                continue
            lines = text[:end].split(b"\n")
            if b"\r" in text:
                lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
            for index, line in enumerate(lines):
                self._check(len(line), index)
            self._pending = text[end + 1 :]
            self._check(len(self._pending), len(lines))
            self._lines_done += len(lines)
            return lines, end + 1
        return [], 0

    def _check(self, length: int, index: int) -> None:
        """Refuse line ``index`` of those after the lines returned so far."""
        if length > self._max_line:
            raise UsageError(
                f"line {self._lines_done + index + 1:,} is longer than the largest record a "
                f"request can carry ({self._max_line:,} bytes)"
            )


@dataclass
class Tally:
    """What the cluster acknowledged, followed in the order sent."""

    records: int = 0
    input_bytes: int = 0
    value_bytes: int = 0
    first_offset: int | None = None
    last_offset: int | None = None
    failed: int = 0
    failure: BaseException | None = None
    #: input lines a resumed run skipped: the stream held them already
    skipped: int = 0
    #: after a failure: how many input lines the stream holds, asked of it
    #: (``Producer.stored``); None when that is not known
    held_lines: int | None = None

    async def follow(
        self,
        handles: trio.MemoryReceiveChannel[tuple[RecordsHandle, int, int]],
        progress: Progress,
    ) -> None:
        async for handle, input_bytes, value_bytes in handles:
            stored, failure = await handle.settle()
            count = sum(n for _, n in stored)
            if failure is None:
                self.input_bytes += input_bytes
                self.value_bytes += value_bytes
            else:
                self.failure = self.failure or failure
                self.failed += len(handle) - count
            self.records += count
            for first, n in stored:
                if self.first_offset is None:
                    self.first_offset = first
                self.last_offset = first + n - 1
            progress.update(self.records, self.value_bytes, done_bytes=self.input_bytes)

    def stored_text(self, stream_id: int) -> str:
        """What the stream holds of the input, exactly when the stream said
        (``held_lines``), else what it acknowledged."""
        span = f"offsets {self.first_offset}..{self.last_offset}"
        if self.held_lines is None:
            if not self.records:
                return f"nothing acknowledged in stream {stream_id} (more may be stored)"
            return (
                f"{fmt.plural(self.records, 'record')} acknowledged in stream {stream_id}, "
                f"{span} (more may be stored)"
            )
        new = self.held_lines - self.skipped
        if new <= 0:
            return f"nothing of this run was stored in stream {stream_id}"
        lines = fmt.plural(self.held_lines, "line")
        text = f"stored the first {lines} of the input in stream {stream_id}"
        if new == self.records:
            return f"{text}, {span}"
        if not self.records:
            return f"{text} (their answers were lost)"
        lost = new - self.records
        return f"{text} ({self.records:,} acknowledged, {span}; {lost:,} answers were lost)"

    def rest_hint(self, stream_id: int, producer_name: str, path: str | None = None) -> str | None:
        """How to store the rest of the input (``path``, or stdin) once,
        when that is known."""
        if self.held_lines is None:
            return None
        if producer_name:
            return "sbp: run it again with --resume to store the rest once"
        return (
            f"sbp: to store the rest once, append from line {self.held_lines + 1}: "
            f"tail -n +{self.held_lines + 1} {path or 'INPUT'} | sbp append {stream_id}"
        )


def _open_input(path: str | None) -> tuple[int, int | None, bool]:
    """The input's file descriptor, its size when it is a file, and whether
    to close it."""
    if path in (None, "-"):
        return sys.stdin.buffer.fileno(), None, False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    return fd, os.fstat(fd).st_size, True


async def cmd_append(env: Env) -> int:
    """Append each input line as one record."""
    args = env.args
    if args.resume and not args.producer_name:
        raise UsageError("--resume needs --producer-name: the producer whose run to continue")
    # a stream that is not there is said before any input is read (an
    # empty input would otherwise "append nothing" to it and succeed)
    await env.pm.get_stream(args.stream_id)
    separator = None if args.key_separator is None else args.key_separator.encode()
    if separator is not None and args.input == "json":
        raise UsageError("--key-separator is for lines; JSON input carries each record's key")
    fd, total, close = _open_input(args.file)
    progress = Progress(env.err, args.progress or env.err.isatty(), total_bytes=total)
    tally = Tally()
    refused: UsageError | None = None
    interrupted = False
    started = time.monotonic()
    try:
        with trio.open_signal_receiver(signal.SIGINT) as interrupts, trio.CancelScope() as whole:
            async with Producer(
                env.pm,
                args.stream_id,
                pool=env.pool,
                linger=APPEND_LINGER_S,
                request_timeout=args.timeout,
                # --timeout bounds each wait for the cluster: a batch not
                # stored within it fails the append
                delivery_timeout=args.timeout,
                name=args.producer_name,
                # a resumed run keeps the epoch (and so the sequences) of the run before
                epoch=0 if args.resume else -1,
                # a lost batch ends the run: what is stored is then the
                # input's first lines, and a failure can say how many
                stop_after_loss=True,
            ) as producer:
                reader = LineReader(fd, producer.max_record_bytes)
                if args.resume:
                    skip = await producer.resume()
                    tally.skipped = await reader.skip(skip)
                    if tally.skipped < skip:
                        raise UsageError(
                            f"the stream holds {skip} records of producer "
                            f"{args.producer_name!r}'s last run, the input only "
                            f"{tally.skipped} lines: is it the same input?"
                        )
                send, receive = trio.open_memory_channel[tuple[RecordsHandle, int, int]](math.inf)
                reading = trio.CancelScope()

                async def read_and_send() -> None:
                    nonlocal refused
                    async with send:
                        with reading:
                            try:
                                line_number = tally.skipped + 1
                                while not reader.eof:
                                    lines, nbytes = await reader.next_lines()
                                    if lines:
                                        records = records_of(
                                            lines,
                                            separator=separator,
                                            headers=args.header,
                                            as_json=args.input == "json",
                                            first_line=line_number,
                                        )
                                        line_number += len(lines)
                                        handle = await producer.send_many(
                                            records.values,
                                            records.keys,
                                            records.headers,
                                            records.timestamps,
                                        )
                                        await send.send((handle, nbytes, records.value_bytes))
                            except (UsageError, RecordTooLargeError) as error:
                                # What was sent before is still stored and reported.
                                refused = UsageError(str(error))
                            except SBPError:
                                # a batch was lost and the producer stopped: the
                                # handles sent before report it, and no more is read
                                return

                async def on_interrupt() -> None:
                    nonlocal interrupted
                    async for _ in interrupts:
                        if interrupted:
                            whole.cancel()  # a second Ctrl-C: stop waiting
                            return
                        interrupted = True
                        reading.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(on_interrupt)
                    nursery.start_soon(read_and_send)
                    # Until every record sent is stored or failed for good.
                    await tally.follow(receive, progress)
                    nursery.cancel_scope.cancel()
                if tally.failure is not None:
                    # the stream knows what it holds, answers lost or not
                    with trio.move_on_after(args.timeout):
                        tally.held_lines = await producer.stored()
                elif refused is not None:
                    # every record sent before the refused line was answered
                    tally.held_lines = tally.skipped + tally.records
    except (SBPError, OSError, trio.TooSlowError) as error:
        _report_partial(env, tally)
        raise error from None
    finally:
        if close:
            os.close(fd)
    progress.update(tally.records, tally.value_bytes, done_bytes=tally.input_bytes, final=True)
    failure = refused or tally.failure
    if failure is not None:
        _report_partial(env, tally)
        raise failure
    return _summarize(env, tally, time.monotonic() - started, interrupted)


def _report_partial(env: Env, tally: Tally) -> None:
    print(f"sbp: {tally.stored_text(env.args.stream_id)} before the error", file=env.err)
    path = env.args.file if env.args.file not in (None, "-") else None
    hint = tally.rest_hint(env.args.stream_id, env.args.producer_name, path)
    if hint is not None:
        print(hint, file=env.err)


def _summarize(env: Env, tally: Tally, seconds: float, interrupted: bool) -> int:
    stream_id = env.args.stream_id
    summary = {
        "stream_id": stream_id,
        "records": tally.records,
        "bytes": tally.value_bytes,
        "first_offset": tally.first_offset,
        "last_offset": tally.last_offset,
        "seconds": round(seconds, 3),
        "interrupted": interrupted,
        "skipped": tally.skipped,
    }
    if env.json:
        env.emit_json(summary)
    elif tally.records:
        env.emit(
            f"appended {fmt.plural(tally.records, 'record')} ({fmt.size_text(tally.value_bytes)}) "
            f"to stream {stream_id}, offsets {tally.first_offset}..{tally.last_offset}, "
            f"in {seconds:.2f} s"
        )
    elif tally.skipped:
        env.emit(f"nothing appended to stream {stream_id}: it holds all of the input")
    else:
        env.emit(f"no input: nothing appended to stream {stream_id}")
    if tally.skipped and not env.json:
        env.emit(
            f"skipped the first {fmt.plural(tally.skipped, 'line')}: "
            "the stream holds them from the producer's last run"
        )
    if interrupted:
        print("sbp: interrupted; what was read before is stored", file=env.err)
        return EXIT_INTERRUPTED
    return EXIT_OK
