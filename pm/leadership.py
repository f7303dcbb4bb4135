"""Which PM leads (SPEC §8): a leader key created only if absent, attached to
a lease this PM keeps alive.

- **Campaign.** Grant a lease, then one transaction: if the leader key is
  absent, put it (its value is this PM's address) with the lease; else read
  it. Whoever created it leads; the key's creation revision is the **PM
  term**, which every metadata write checks (``guard``) and every
  SYNC_RANGES and SEAL_RANGES carries to the data nodes.
- **Holding.** The lease is renewed every third of its TTL. A renewal that
  fails (etcd lost its majority, or the lease is gone), or none that
  succeeded for two thirds of the TTL, ends the term here at once, before
  etcd lets another PM take the key; so does a guarded write that etcd
  refused (``step_down``).
- **Waiting.** A PM that does not lead looks at the key every third of the
  TTL, knows the leader's address (NOT_LEADER answers name it), and
  campaigns again once the key is gone.

``run`` calls ``lead(term)`` for each term won and cancels it when the term
ends; ``lead`` is where the PM serves as leader.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from net.ratelog import RateLimitedLog

from .etcd import Etcd, EtcdError, create_revision_is, get_op, put_op, version_is

log = logging.getLogger(__name__)
#: etcd unreachable is retried every RETRY_S: said once in a while
_etcd_trouble = RateLimitedLog(log, interval=30.0)

#: pause after etcd failed before campaigning again
RETRY_S: Final = 0.5


class Leadership:
    def __init__(self, etcd: Etcd, prefix: bytes, advertise: str, ttl_s: float) -> None:
        self._etcd = etcd
        self.key = prefix + b"leader"
        self.advertise = advertise
        self.ttl_s = ttl_s
        #: the term this PM leads in (the leader key's creation revision), or None
        self.term: int | None = None
        #: the leader's address as last seen ("" unknown)
        self.leader_addr = ""
        #: terms won and ended here (metrics)
        self.terms_won = 0
        self._term_scope: trio.CancelScope | None = None

    @property
    def is_leader(self) -> bool:
        return self.term is not None

    def guard(self) -> list[dict[str, Any]]:
        """The compare every metadata write carries: the leader key is ours."""
        # With no term, a compare no key can satisfy: the write fails.
        return [create_revision_is(self.key, self.term if self.term is not None else -1)]

    def step_down(self, why: str) -> None:
        """End this PM's term now (a guarded write failed, or a renewal did)."""
        if self.term is not None:
            log.warning("stepping down from term %d: %s", self.term, why)
            self.term = None
            self.leader_addr = ""
        if self._term_scope is not None:
            self._term_scope.cancel()

    async def run(self, lead: Callable[[int], Awaitable[None]]) -> None:
        """Campaign, lead, wait, forever (until cancelled)."""
        while True:
            failure: EtcdError | None = None
            try:
                await self._campaign_once(lead)
            # (grouped when it comes out of the term's nursery: a new leader
            # that cannot read the metadata, say)
            except* EtcdError as group:
                failure = _first(group)
            if failure is not None:
                self.step_down(f"etcd: {failure}")
                _etcd_trouble.warning("etcd", "cannot campaign or lead: %s", failure)
                await trio.sleep(RETRY_S)

    async def _campaign_once(self, lead: Callable[[int], Awaitable[None]]) -> None:
        etcd = self._etcd
        lease = await etcd.lease_grant(max(1, round(self.ttl_s)))
        result = await etcd.txn(
            [version_is(self.key, 0)],
            [put_op(self.key, self.advertise.encode(), lease)],
            [get_op(self.key)],
        )
        if not result.succeeded:
            await etcd.lease_revoke(lease)
            held = result.responses[0].get("response_range", {}).get("kvs", [])
            await self._follow(int(held[0]["create_revision"]) if held else 0)
            return
        term = result.revision
        self.term, self.leader_addr = term, self.advertise
        self.terms_won += 1
        log.info("leading the cluster as %s, term %d", self.advertise, term)
        try:
            with trio.CancelScope() as self._term_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._keep_alive, lease, term)
                    await lead(term)
                    nursery.cancel_scope.cancel()
        finally:
            self._term_scope = None
            self.step_down("the term ended")
            # Let the next leader in at once (else the lease expires by itself).
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(self.ttl_s / 3),
                contextlib.suppress(EtcdError),
            ):
                await etcd.lease_revoke(lease)

    async def _keep_alive(self, lease: int, term: int) -> None:
        renewed = trio.current_time()
        while self.term == term:
            await trio.sleep(self.ttl_s / 3)
            try:
                with trio.fail_after(self.ttl_s / 3):
                    alive = await self._etcd.lease_keepalive(lease)
            except (EtcdError, trio.TooSlowError) as error:
                if trio.current_time() - renewed >= self.ttl_s * 2 / 3:
                    self.step_down(f"the lease could not be renewed: {error}")
                    return
                continue
            if not alive:
                self.step_down("the lease expired")
                return
            renewed = trio.current_time()

    async def _follow(self, leader_revision: int) -> None:
        """Until the leader key is gone (or held by another term)."""
        while True:
            held = await self._etcd.get(self.key)
            if held is None or held.create_revision != leader_revision:
                return
            self.leader_addr = held.value.decode()
            await trio.sleep(self.ttl_s / 3)


def _first(group: BaseExceptionGroup[EtcdError]) -> EtcdError:
    """The first etcd error of a (possibly nested) group."""
    error = group.exceptions[0]
    return _first(error) if isinstance(error, BaseExceptionGroup) else error
