"""The launcher's watch over its children: a child that dies on its own is
started again after a backoff (1 s, doubling to 30 s, back to 1 s once it
has run for a minute); one stopped on purpose (``sbp-cluster stop-node``)
stays stopped until it is released; children may be added while it runs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import trio

from .children import Child, ClusterError, start_child, stop_child

#: a dead child is started again after this, doubling per quick death up to the cap
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
#: a child that ran this long before it died starts the backoff afresh
RESTART_RESET_S = 60.0


@dataclass
class _Hold:
    """A child stopped on purpose: set ``release`` to start it again; ``back``
    is set once it is."""

    release: trio.Event = field(default_factory=trio.Event)
    back: trio.Event = field(default_factory=trio.Event)


class Supervisor:
    """Runs in a nursery of its own (``run``); see the module docstring.
    Without ``restart``, the first child to die ends ``run``."""

    def __init__(self, children: list[Child], *, restart: bool) -> None:
        self.children = list(children)
        self.restart = restart
        #: children stopped on purpose, by name
        self._held: dict[str, _Hold] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        async with trio.open_nursery() as watchers:
            self._nursery = watchers
            for child in self.children:
                watchers.start_soon(self._watch, child)

    def held(self, child: Child) -> bool:
        return child.name in self._held

    async def hold(self, child: Child) -> None:
        """Stop ``child`` gracefully and keep it stopped until ``release``."""
        self._held.setdefault(child.name, _Hold())
        await stop_child(child)

    async def release(self, child: Child) -> None:
        """Start a held child again; returns once it is back."""
        hold = self._held.get(child.name)
        if hold is None:
            return
        hold.release.set()
        await hold.back.wait()

    def add(self, child: Child) -> None:
        """Watch a child started after ``run`` began."""
        assert self._nursery is not None, "the supervisor is not running"
        self.children.append(child)
        self._nursery.start_soon(self._watch, child)

    async def _watch(self, child: Child) -> None:
        delay = RESTART_BACKOFF_S
        while True:
            assert child.process is not None
            code = await child.process.wait()
            ran = trio.current_time() - child.started_at
            hold = self._held.get(child.name)
            if hold is not None:
                print(f"sbp-cluster: {child.name} stopped; start-node starts it again", flush=True)
                await hold.release.wait()
                await self._start_again(child, 0.0)
                del self._held[child.name]
                hold.back.set()
                delay = RESTART_BACKOFF_S
                continue
            print(
                f"sbp-cluster: {child.name} exited with status {code}; see {child.log_path}",
                file=sys.stderr,
                flush=True,
            )
            if not self.restart:
                assert self._nursery is not None
                self._nursery.cancel_scope.cancel()
                return
            if ran >= RESTART_RESET_S:
                delay = RESTART_BACKOFF_S
            delay = await self._start_again(child, delay)

    async def _start_again(self, child: Child, delay: float) -> float:
        """Start the child where it listened before, after ``delay`` and
        again with backoff until it starts; the next delay."""
        keep_address(child)
        while True:
            if delay:
                print(f"sbp-cluster: restarting {child.name} in {delay:g} s", flush=True)
                await trio.sleep(delay)
            delay = min(max(delay, RESTART_BACKOFF_S) * 2, RESTART_BACKOFF_MAX_S)
            try:
                await start_child(child, child.extra_args)
            except ClusterError as error:
                print(f"sbp-cluster: {error}", file=sys.stderr, flush=True)
                continue
            print(f"sbp-cluster: {child.name} is back on {child.address}", flush=True)
            return delay


def keep_address(child: Child) -> None:
    """Listen where the child listened before, so that its peers (and, for
    the PM, the data nodes started with its address) find it again."""
    if child.address and "--listen" in child.argv:
        child.argv[child.argv.index("--listen") + 1] = child.address
