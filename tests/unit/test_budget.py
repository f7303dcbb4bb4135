"""net.budget: counting bytes against a limit, and waiting for room."""

from __future__ import annotations

import trio
import trio.testing

from net.budget import ByteBudget, ConnectionBudget, ServerBudgets


async def test_take_waits_for_room_and_give_wakes_it() -> None:
    budget = ByteBudget(100)
    await budget.take(70)
    taken = trio.Event()

    async def take_more() -> None:
        await budget.take(50)
        taken.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take_more)
        await trio.testing.wait_all_tasks_blocked()
        assert not taken.is_set() and budget.used == 70
        budget.give(70)
        await taken.wait()
    assert budget.used == 50 and budget.peak == 70


async def test_a_share_larger_than_the_limit_proceeds_alone() -> None:
    budget = ByteBudget(10)
    async with budget.hold(1_000):
        assert budget.used == 1_000 and budget.spent
    assert budget.used == 0 and not budget.spent


def test_a_connection_share_never_exceeds_the_server_budget() -> None:
    budgets = ServerBudgets.of(request_bytes=1 << 20, answer_bytes=4 << 20)
    assert budgets.connection_answer_bytes == 4 << 20
    assert budgets.requests.limit == 1 << 20


def test_a_connection_held_back_by_a_spent_budget_reads_a_small_read_at_most() -> None:
    """Past a spent budget a connection holding less than a read's worth
    may read a read's worth, for a small request's sake, but not the first
    MiB of a large frame: 40 such connections held 40 MiB past the budget."""
    budgets = ServerBudgets.of(request_bytes=1 << 20, answer_bytes=1 << 20)
    holder = ConnectionBudget(budgets, read_size=64 * 1024)
    holder.hold_partial(1 << 20)
    newcomer = ConnectionBudget(budgets, read_size=64 * 1024)
    assert newcomer.may_read(0) and newcomer.may_read(64 * 1024)
    assert not newcomer.may_read((1 << 20) + 4096)
    newcomer.hold_partial(64 * 1024)
    assert not newcomer.may_read(4096)
    holder.hold_partial(0)  # alone, a frame may even outgrow the budget
    assert newcomer.may_read(1 << 20)
