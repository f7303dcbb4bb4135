"""SYNC_RANGES to a data node one call at a time, the streams of the calls
that come meanwhile going together in the next (pm.node_syncs)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio
import trio.testing

from pm.node_syncs import NodeSyncs
from sbp.errors import ShuttingDownError


class Nodes:
    """A fake ``send``: records each call; call ``i`` (counted over all
    nodes) waits for ``releases[i]`` if there is one, and fails when it
    carries a stream of ``failing``. Records what ``on_failure`` hears."""

    def __init__(self, *held: int) -> None:
        #: (node, streams) of each call; a DELETE_STREAMS call's node is negative
        self.calls: list[tuple[int, list[int]]] = []
        self.releases = {i: trio.Event() for i in held}
        self.failing: set[int] = set()
        self.failures: list[tuple[int, list[int], str]] = []

    async def send(self, node_id: int, stream_ids: Sequence[int]) -> None:
        index = len(self.calls)
        self.calls.append((node_id, list(stream_ids)))
        if index in self.releases:
            await self.releases[index].wait()
        if self.failing & set(stream_ids):
            raise OSError("connection reset")

    def on_failure(self, node_id: int, stream_ids: Sequence[int], error: Exception) -> None:
        self.failures.append((node_id, list(stream_ids), str(error)))

    async def delete(self, node_id: int, stream_ids: Sequence[int]) -> None:
        await self.send(-node_id, stream_ids)

    def syncs(self) -> NodeSyncs:
        return NodeSyncs(self.send, self.on_failure, delete=self.delete)


async def test_calls_that_come_while_one_is_under_way_go_together() -> None:
    nodes = Nodes(0)
    syncs = nodes.syncs()
    done: list[int] = []

    async def sync(stream_id: int) -> None:
        await syncs.sync(1, [stream_id])
        done.append(stream_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sync, 1)
        await trio.testing.wait_all_tasks_blocked()
        for stream_id in range(2, 51):
            nursery.start_soon(sync, stream_id)
        await trio.testing.wait_all_tasks_blocked()
        assert nodes.calls == [(1, [1])]
        assert done == []
        nodes.releases[0].set()
    assert nodes.calls == [(1, [1]), (1, list(range(2, 51)))]
    assert sorted(done) == list(range(1, 51))


async def test_calls_made_together_go_in_one() -> None:
    nodes = Nodes()
    syncs = nodes.syncs()
    async with trio.open_nursery() as nursery:
        for stream_id in range(1, 11):
            nursery.start_soon(syncs.sync, 1, [stream_id])
    assert nodes.calls == [(1, list(range(1, 11)))]


async def test_a_slow_node_holds_up_only_its_own_calls() -> None:
    nodes = Nodes(0)
    syncs = nodes.syncs()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(syncs.sync, 1, [7])
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(1):
            await syncs.sync(2, [7, 8])
        nodes.releases[0].set()
    assert nodes.calls == [(1, [7]), (2, [7, 8])]


async def test_every_change_in_a_failed_call_hears_of_it_and_it_is_reported_once() -> None:
    nodes = Nodes(0)
    nodes.failing = {2}
    syncs = nodes.syncs()
    outcomes: dict[int, str] = {}

    async def sync(stream_id: int) -> None:
        try:
            await syncs.sync(1, [stream_id])
            outcomes[stream_id] = "taken"
        except OSError as error:
            outcomes[stream_id] = str(error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sync, 1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(sync, 2)
        nursery.start_soon(sync, 3)
        await trio.testing.wait_all_tasks_blocked()
        nodes.releases[0].set()
    assert nodes.calls == [(1, [1]), (1, [2, 3])]
    assert outcomes == {1: "taken", 2: "connection reset", 3: "connection reset"}
    assert nodes.failures == [(1, [2, 3], "connection reset")]


async def test_a_change_that_stops_waiting_still_has_its_streams_sent() -> None:
    """Its deadline passed while a call was under way: nothing else comes,
    and its streams go all the same, in the next call."""
    nodes = Nodes(0)
    syncs = nodes.syncs()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(syncs.sync, 1, [1])
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.01) as waited:
            await syncs.sync(1, [2])
        assert waited.cancelled_caught
        nodes.releases[0].set()
    await trio.testing.wait_all_tasks_blocked()
    assert nodes.calls == [(1, [1]), (1, [2])]
    assert nodes.failures == []


async def test_stop_ends_the_call_under_way_and_sends_no_more() -> None:
    nodes = Nodes(0)
    syncs = nodes.syncs()
    raised: list[str] = []

    async def sync(stream_id: int) -> None:
        try:
            await syncs.sync(1, [stream_id])
        except ShuttingDownError as error:
            raised.append(str(error))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sync, 1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(sync, 2)
        await trio.testing.wait_all_tasks_blocked()
        syncs.stop()
    with pytest.raises(ShuttingDownError):
        await syncs.sync(1, [3])
    assert nodes.calls == [(1, [1])]
    assert len(raised) == 2
    assert [failure[1] for failure in nodes.failures] == [[1]]


@pytest.mark.parametrize("streams", [[5, 3, 5], [3]])
async def test_a_call_sends_each_stream_once_in_order(streams: list[int]) -> None:
    nodes = Nodes()
    await nodes.syncs().sync(4, streams)
    assert nodes.calls == [(4, sorted(set(streams)))]


async def test_deletions_go_in_the_same_queue_first_and_a_deleted_stream_is_not_synced() -> None:
    """Behind a call under way, syncs of streams 1-3 and the deletion of
    stream 2 wait together: DELETE_STREAMS of 2 goes first, then SYNC_RANGES
    of 1 and 3 only; a deletion never overtakes a sync queued before it."""
    nodes = Nodes(0)
    syncs = nodes.syncs()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(syncs.sync, 1, [9])
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(syncs.sync, 1, [1, 2, 3])
        nursery.start_soon(syncs.delete, 1, [2])
        await trio.testing.wait_all_tasks_blocked()
        assert nodes.calls == [(1, [9])]
        nodes.releases[0].set()
    assert nodes.calls == [(1, [9]), (-1, [2]), (1, [1, 3])]


async def test_a_failed_deletion_is_reported_and_raised() -> None:
    nodes = Nodes()
    nodes.failing = {4}
    with pytest.raises(OSError):
        await nodes.syncs().delete(2, [4])
    assert nodes.failures == [(2, [4], "connection reset")]
