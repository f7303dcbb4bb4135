"""The chaos proxy against an echo server: each mode does to the bytes what
it says, and cut/heal reset and restore the link."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from bench.chaos.proxy import LinkProxy, Mode

_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


async def echo(stream: trio.SocketStream) -> None:
    async with stream:
        try:
            async for data in stream:
                await stream.send_all(data)
        except _BROKEN:
            pass


async def received(stream: trio.SocketStream, size: int, timeout: float = 2.0) -> bytes:
    """Up to ``size`` bytes, whatever arrives within ``timeout``; b"" once the
    link is closed or reset."""
    got = b""
    with trio.move_on_after(timeout):
        try:
            while len(got) < size:
                chunk = await stream.receive_some(1024)
                if not chunk:
                    break
                got += chunk
        except _BROKEN:
            pass
    return got


async def open_through(proxy: LinkProxy) -> trio.SocketStream:
    host, _, port = proxy.address.rpartition(":")
    return await trio.open_tcp_stream(host, int(port))


@pytest.fixture
async def proxy() -> AsyncIterator[LinkProxy]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, echo, 0)
        port = listeners[0].socket.getsockname()[1]
        link = LinkProxy("test", f"127.0.0.1:{port}")
        await nursery.start(link.run)
        yield link
        nursery.cancel_scope.cancel()


async def test_pass_and_delay(proxy: LinkProxy) -> None:
    stream = await open_through(proxy)
    await stream.send_all(b"hello")
    assert await received(stream, 5) == b"hello"
    proxy.set(Mode.DELAY, delay_s=0.2)
    started = trio.current_time()
    await stream.send_all(b"late")
    assert await received(stream, 4) == b"late"
    assert trio.current_time() - started >= 0.4  # delayed both ways
    await stream.aclose()


async def test_hold_keeps_the_bytes_until_healed(proxy: LinkProxy) -> None:
    stream = await open_through(proxy)
    proxy.set(Mode.HOLD)
    await stream.send_all(b"held")
    assert await received(stream, 4, timeout=0.3) == b""
    proxy.heal()
    assert await received(stream, 4) == b"held"
    await stream.aclose()


async def test_drop_loses_the_bytes(proxy: LinkProxy) -> None:
    stream = await open_through(proxy)
    proxy.set(Mode.DROP, down=False)
    await stream.send_all(b"gone")
    assert await received(stream, 4, timeout=0.3) == b""
    proxy.heal()
    await stream.send_all(b"next")
    assert await received(stream, 4) == b"next"
    await stream.aclose()


async def test_cut_resets_and_refuses_until_healed(proxy: LinkProxy) -> None:
    stream = await open_through(proxy)
    await stream.send_all(b"x")
    assert await received(stream, 1) == b"x"
    proxy.cut()
    assert await received(stream, 1) == b""  # reset
    refused = await open_through(proxy)
    assert await received(refused, 1, timeout=1) == b""
    proxy.heal()
    healed = await open_through(proxy)
    await healed.send_all(b"back")
    assert await received(healed, 4) == b"back"
    for each in (stream, refused, healed):
        await trio.aclose_forcefully(each)
