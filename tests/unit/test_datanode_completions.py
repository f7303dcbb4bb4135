"""Outcomes handed from the storage writer thread to trio: every one delivered
once, in order, with far fewer wake-ups than outcomes."""

from __future__ import annotations

import threading

import trio

from datanode.appends import _Completions

from ..eventually import eventually


class Recorder:
    """Stands in for the append path: records which ticket became durable."""

    def __init__(self, delivered: list[int]) -> None:
        self.delivered = delivered

    def durable(self, ticket: int, outcomes: list[object]) -> None:
        self.delivered.append(ticket)


async def test_every_outcome_arrives_once_in_order_in_few_wakeups() -> None:
    token = trio.lowlevel.current_trio_token()
    wakeups = 0

    class CountingToken:
        def run_sync_soon(self, fn, *args):  # type: ignore[no-untyped-def]
            nonlocal wakeups
            wakeups += 1
            token.run_sync_soon(fn, *args)

    completions = _Completions(CountingToken())  # type: ignore[arg-type]
    delivered: list[int] = []
    recorder = Recorder(delivered)
    total = 5000

    def writer() -> None:
        # bursts, as group commits complete several requests at once
        for start in range(0, total, 10):
            for index in range(start, start + 10):
                completions.put(recorder, index, [], durable=True)  # type: ignore[arg-type]

    thread = threading.Thread(target=writer)
    thread.start()
    await eventually(lambda: len(delivered) >= total, timeout=10)
    thread.join()
    await trio.sleep(0.01)
    assert delivered == list(range(total))
    assert wakeups < total
