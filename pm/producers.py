"""INIT_PRODUCER (SPEC §10): producer ids and epochs, kept in the metadata.

- An empty name gets a new id with epoch 0. Ids are never handed out twice:
  every new id raises the stored high-water mark in the same commit that
  answers it, as stream ids do.
- A name maps to one id forever. Epoch -1 asks for the stored epoch + 1
  (a restarted service fences its old instance); E >= 0 asks for
  max(stored, E) (a job numbering its own attempts); E below the stored
  epoch is ``PRODUCER_FENCED``.

Calls are serialised: two instances of one name starting at once get
different epochs, never the same one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import trio

from sbp.errors import InvalidRequestError, ProducerFencedError

from .changes import Change, Metadata, PutProducer, RaiseNextProducerId
from .records import ProducerRecord

#: producer names are at most this many bytes of UTF-8
MAX_NAME_BYTES: Final = 255
#: the epoch is an int32 on the wire
MAX_EPOCH: Final = (1 << 31) - 1


class ProducerIds:
    """Hands out producer ids and epochs from ``store``, committing through
    ``commit`` (the manager's, so that HA's leader guard applies)."""

    def __init__(self, store: Metadata, commit: Callable[[Sequence[Change]], Awaitable[None]]):
        self._store = store
        self._commit = commit
        self._lock = trio.Lock()

    async def init(self, name: str, epoch: int) -> ProducerRecord:
        """The id and epoch now in force for ``name`` (a new id when empty)."""
        if len(name.encode()) > MAX_NAME_BYTES:
            raise InvalidRequestError(f"producer_name is longer than {MAX_NAME_BYTES} bytes")
        if epoch < -1:
            raise InvalidRequestError(f"producer_epoch {epoch} is below -1")
        async with self._lock:
            if not name:
                return await self._new("", 0, named=False)
            stored = self._store.producer(name)
            if stored is None:
                return await self._new(name, max(epoch, 0), named=True)
            if epoch == -1:
                wanted = stored.epoch + 1
            elif epoch < stored.epoch:
                raise ProducerFencedError(
                    f"producer {name!r} is at epoch {stored.epoch}; {epoch} is fenced"
                )
            else:
                wanted = epoch
            if wanted > MAX_EPOCH:
                raise InvalidRequestError(f"producer {name!r} has used every epoch")
            if wanted == stored.epoch:
                return stored
            raised = ProducerRecord(name, stored.producer_id, wanted)
            await self._commit([PutProducer(raised)])
            return raised

    async def _new(self, name: str, epoch: int, *, named: bool) -> ProducerRecord:
        producer_id = self._store.next_producer_id()
        record = ProducerRecord(name, producer_id, epoch)
        changes: list[Change] = [RaiseNextProducerId(producer_id + 1)]
        if named:
            changes.append(PutProducer(record))
        await self._commit(changes)
        return record
