"""Unary round trips per second on one TCP connection: SBP PING through
``net.Connection`` against a bare trio echo of 20-byte messages.

The server runs in a separate process (as in production); the client keeps
1 or N requests in flight on one connection. The bare echo has the same shape
as the SBP client — one task per outstanding request, one reader waking the
waiters in order — but no framing, no stream ids and no dispatch. It comes in
two kinds: each caller writing its own message under a lock (one send per
message), and callers queueing messages for one writer task that sends what
has piled up in one write, as ``net.Connection`` does. Each measurement is
repeated, alternating the kinds, and the median reported: the machine is shared.

    .venv/bin/python -m bench.rpc [--seconds 2] [--repeat 3] [--in-flight 1 64]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from net.connection import Connection
from net.server import Dispatcher, Server
from sbp.connection import Side
from sbp.enums import Opcode

ECHO_MESSAGE = bytes(20)  # a PING frame with no header and no payload is 20 bytes too
READY_PREFIX = "listening on "


# -- servers (run in the child process) ----------------------------------------


async def _serve_sbp() -> None:
    server = Server(Dispatcher("bench"))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        print(f"{READY_PREFIX}{host}:{port}", flush=True)


async def _echo(stream: trio.SocketStream) -> None:
    try:
        while data := await stream.receive_some(65536):
            await stream.send_all(data)
    except trio.BrokenResourceError:
        pass


async def _serve_echo() -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, _echo, 0)
        host, port = listeners[0].socket.getsockname()[:2]
        print(f"{READY_PREFIX}{host}:{port}", flush=True)


# -- clients -----------------------------------------------------------------


async def _drive(call: Callable[[], Awaitable[None]], in_flight: int, seconds: float) -> float:
    """Round trips per second with ``in_flight`` callers looping on ``call``."""
    done = 0

    async def caller() -> None:
        nonlocal done
        while True:
            await call()
            done += 1

    for _ in range(min(in_flight, 10)):  # warm-up
        await call()
    async with trio.open_nursery() as nursery:
        for _ in range(in_flight):
            nursery.start_soon(caller)
        started = trio.current_time()
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    return done / (trio.current_time() - started)


async def _sbp_client(port: int, in_flight: int, seconds: float) -> float:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    connection = Connection(stream, side=Side.CLIENT)
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)

        async def ping() -> None:
            await connection.request(Opcode.PING)

        rate = await _drive(ping, in_flight, seconds)
        await connection.aclose()
    return rate


async def _echo_client(port: int, in_flight: int, seconds: float) -> float:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    send_lock = trio.Lock()
    waiters: deque[trio.Event] = deque()

    async def reader() -> None:
        pending = 0
        while data := await stream.receive_some(65536):
            pending += len(data)
            while pending >= len(ECHO_MESSAGE):
                pending -= len(ECHO_MESSAGE)
                waiters.popleft().set()

    async def echo() -> None:
        event = trio.Event()
        async with send_lock:
            waiters.append(event)
            await stream.send_all(ECHO_MESSAGE)
        await event.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        rate = await _drive(echo, in_flight, seconds)
        nursery.cancel_scope.cancel()
    await stream.aclose()
    return rate


async def _echo_writer_client(port: int, in_flight: int, seconds: float) -> float:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    waiters: deque[trio.Event] = deque()
    send, receive = trio.open_memory_channel[bytes](in_flight)

    async def reader() -> None:
        pending = 0
        while data := await stream.receive_some(65536):
            pending += len(data)
            while pending >= len(ECHO_MESSAGE):
                pending -= len(ECHO_MESSAGE)
                waiters.popleft().set()

    async def writer() -> None:
        async for message in receive:
            batch = [message]
            while True:
                try:
                    batch.append(receive.receive_nowait())
                except trio.WouldBlock:
                    break
            await stream.send_all(b"".join(batch))

    async def echo() -> None:
        event = trio.Event()
        waiters.append(event)
        send.send_nowait(ECHO_MESSAGE)  # never full: at most in_flight messages queued
        await event.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        nursery.start_soon(writer)
        rate = await _drive(echo, in_flight, seconds)
        nursery.cancel_scope.cancel()
    await stream.aclose()
    return rate


# -- orchestration -------------------------------------------------------------


def _start_server(kind: str) -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.rpc", "--serve", kind], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line.startswith(READY_PREFIX):
        child.kill()
        raise RuntimeError(f"{kind} server did not start: {line!r}")
    return child, int(line.rsplit(":", 1)[1])


CLIENTS = {"echo": _echo_client, "echo-writer": _echo_writer_client, "sbp": _sbp_client}


def _measure(kind: str, in_flight: int, seconds: float) -> float:
    child, port = _start_server("sbp" if kind == "sbp" else "echo")
    try:
        return trio.run(CLIENTS[kind], port, in_flight, seconds)
    finally:
        child.terminate()
        child.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--serve", choices=["sbp", "echo"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        trio.run(_serve_sbp if args.serve == "sbp" else _serve_echo)
        return
    print(
        "| in flight | bare echo, send per message | bare echo, writer task "
        "| SBP PING | SBP / echo (per message) | SBP / echo (writer task) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for in_flight in args.in_flight:
        runs: dict[str, list[float]] = {kind: [] for kind in CLIENTS}
        for _ in range(args.repeat):
            for kind in CLIENTS:
                runs[kind].append(_measure(kind, in_flight, args.seconds))
        echo, writer, sbp = (statistics.median(runs[kind]) for kind in CLIENTS)
        print(
            f"| {in_flight} | {echo:,.0f} | {writer:,.0f} | {sbp:,.0f} "
            f"| {sbp / echo:.0%} | {sbp / writer:.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
