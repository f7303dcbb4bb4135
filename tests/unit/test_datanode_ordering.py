"""APPEND handlers of one connection reach the storage engine in arrival
order, whatever order trio starts their tasks in."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from datanode.ordering import ArrivalOrder


class _Connection:
    """A stand-in connection (the gate keys on it weakly)."""


@dataclass
class _Request:
    connection: _Connection
    arrival: int


async def test_turns_follow_arrival_even_when_tasks_start_in_reverse() -> None:
    order = ArrivalOrder()
    connection = _Connection()
    passed: list[int] = []

    async def handler(arrival: int) -> None:
        async with order.turn(_Request(connection, arrival)):  # type: ignore[arg-type]
            passed.append(arrival)
            await trio.sleep(0)  # a turn may yield; later ones still wait

    async with trio.open_nursery() as nursery:
        for arrival in reversed(range(8)):
            nursery.start_soon(handler, arrival)
    assert passed == list(range(8))


async def test_connections_do_not_wait_for_each_other() -> None:
    order = ArrivalOrder()
    slow, fast = _Connection(), _Connection()
    release = trio.Event()
    passed: list[str] = []

    async def hold_first_turn() -> None:
        async with order.turn(_Request(slow, 0)):  # type: ignore[arg-type]
            await release.wait()
            passed.append("slow")

    async def other_connection() -> None:
        async with order.turn(_Request(fast, 5)):  # type: ignore[arg-type]
            passed.append("fast")
        release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold_first_turn)
        await trio.sleep(0)
        nursery.start_soon(other_connection)
    assert passed == ["fast", "slow"]


async def test_a_cancelled_waiter_leaves_the_line() -> None:
    order = ArrivalOrder()
    connection = _Connection()
    release = trio.Event()
    passed: list[int] = []

    async def first() -> None:
        async with order.turn(_Request(connection, 0)):  # type: ignore[arg-type]
            await release.wait()
            passed.append(0)

    async def gives_up() -> None:
        with trio.move_on_after(0.01):
            async with order.turn(_Request(connection, 1)):  # type: ignore[arg-type]
                passed.append(1)

    async def third() -> None:
        async with order.turn(_Request(connection, 2)):  # type: ignore[arg-type]
            passed.append(2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.sleep(0)
        nursery.start_soon(gives_up)
        nursery.start_soon(third)
        await trio.sleep(0.05)
        release.set()
    assert passed == [0, 2]
