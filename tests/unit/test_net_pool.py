"""net.pool: one shared connection per address, reconnect with backoff."""

from __future__ import annotations

import random

import pytest
import trio

from net.address import parse_address
from net.pool import BACKOFF_MAX, ConnectionPool, backoff_delay
from net.server import Dispatcher, Server
from sbp.enums import ErrorCode
from sbp.errors import ConnectionClosed

from ..eventually import eventually


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:7400") == ("127.0.0.1", 7400)
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("h:0") == ("h", 0)  # any free port, for a listener
    for bad in ("localhost", ":80", "host:", "host:http", "host:70000"):
        with pytest.raises(ValueError, match=r"not HOST:PORT|is not a number|outside 0-65535"):
            parse_address(bad)


def test_backoff_grows_exponentially_with_full_jitter() -> None:
    random.seed(1)
    assert backoff_delay(0) == 0.0
    for failures, ceiling in [(1, 0.05), (2, 0.1), (3, 0.2), (8, 5.0), (30, BACKOFF_MAX)]:
        delays = [backoff_delay(failures) for _ in range(200)]
        assert all(0.0 <= delay <= ceiling for delay in delays)
        assert max(delays) > ceiling * 0.9  # jitter spreads over the whole window


async def free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port: int = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    return port


async def test_one_shared_connection_per_address() -> None:
    server = Server(Dispatcher("test"))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        address = f"{host}:{port}"
        async with ConnectionPool() as pool:
            got: list[object] = []

            async def get() -> None:
                got.append(await pool.get(address))

            async with trio.open_nursery() as callers:
                for _ in range(10):
                    callers.start_soon(get)
            assert len(got) == 10 and len(set(map(id, got))) == 1
            assert len(server.connections) == 1
            assert pool.connection(address) is got[0]
        nursery.cancel_scope.cancel()


async def test_reconnects_after_close_and_after_goaway() -> None:
    server = Server(Dispatcher("test"))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        address = f"{host}:{port}"
        async with ConnectionPool() as pool:
            first = await pool.get(address)
            await first.aclose()
            second = await pool.get(address)
            assert second is not first and not second.closed
            await second.ping()
            (served,) = server.connections
            await served.send_goaway(ErrorCode.NONE, "moving")
            await eventually(lambda: second.goaway_received, timeout=5)
            third = await pool.get(address)
            assert third is not second
            await third.ping()
        assert third.closed
        nursery.cancel_scope.cancel()


async def test_connect_failure_backs_off_then_raises(autojump_clock: trio.abc.Clock) -> None:
    address = f"127.0.0.1:{await free_port()}"
    async with ConnectionPool(connect_attempts=4) as pool:
        started = trio.current_time()
        with pytest.raises(ConnectionClosed, match=f"cannot connect to {address} after 4 attempts"):
            await pool.get(address)
        # Three waits between four attempts, each at most 0.05 * 2**(n-1).
        assert 0 < trio.current_time() - started <= 0.05 + 0.1 + 0.2


async def test_get_outside_the_context_fails() -> None:
    pool = ConnectionPool()
    with pytest.raises(RuntimeError, match="not open"):
        await pool.get("127.0.0.1:1")


async def test_an_error_in_the_body_propagates_as_it_is() -> None:
    """A caller catching ConnectionClosed around ``async with`` a pool gets
    it, not an ExceptionGroup of the pool's nursery."""
    server = Server(Dispatcher("test"))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        with pytest.raises(ConnectionClosed):
            async with ConnectionPool() as pool:
                await pool.get(f"{host}:{port}")
                raise ConnectionClosed("gone")
        nursery.cancel_scope.cancel()
