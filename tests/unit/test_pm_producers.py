"""INIT_PRODUCER's rules (SPEC §10) on the PM's LMDB metadata: ids never
reused, names keep their id, epochs only grow, all of it across a restart.
The same rules on etcd: tests/integration/test_pm_etcd.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pm.metadata import FIRST_PRODUCER_ID, MetadataStore
from pm.producers import MAX_NAME_BYTES, ProducerIds
from pm.records import ProducerRecord
from sbp.errors import InvalidRequestError, ProducerFencedError


def _ids(store: MetadataStore) -> ProducerIds:
    return ProducerIds(store, store.commit)


async def test_unnamed_producers_get_new_ids_at_epoch_0_never_reused(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "meta", map_size=64 << 20)
    ids = _ids(store)
    first = await ids.init("", -1)
    second = await ids.init("", 7)
    assert (first.producer_id, first.epoch) == (FIRST_PRODUCER_ID, 0)
    assert (second.producer_id, second.epoch) == (FIRST_PRODUCER_ID + 1, 0)
    assert store.producers() == []  # unnamed: nothing kept but the high-water mark
    store.close()

    reopened = MetadataStore(tmp_path / "meta", map_size=64 << 20)
    third = await _ids(reopened).init("", -1)
    assert third.producer_id == FIRST_PRODUCER_ID + 2
    reopened.close()


async def test_a_name_keeps_its_id_and_its_epoch_only_grows(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "meta", map_size=64 << 20)
    ids = _ids(store)
    await ids.init("", -1)  # takes id 1
    started = await ids.init("billing", -1)
    assert started == ProducerRecord("billing", FIRST_PRODUCER_ID + 1, 0)
    assert (await ids.init("billing", -1)).epoch == 1  # a restart fences the old one
    assert (await ids.init("billing", 5)).epoch == 5  # a job's own attempt number
    assert (await ids.init("billing", 5)).epoch == 5  # the same attempt again
    with pytest.raises(ProducerFencedError, match="at epoch 5; 4 is fenced"):
        await ids.init("billing", 4)
    other = await ids.init("ledger", 3)
    assert other == ProducerRecord("ledger", FIRST_PRODUCER_ID + 2, 3)
    store.close()

    reopened = MetadataStore(tmp_path / "meta", map_size=64 << 20)
    again = _ids(reopened)
    assert await again.init("billing", -1) == ProducerRecord("billing", FIRST_PRODUCER_ID + 1, 6)
    assert (await again.init("", -1)).producer_id == FIRST_PRODUCER_ID + 3
    assert sorted(p.name for p in reopened.producers()) == ["billing", "ledger"]
    reopened.close()


async def test_bad_names_and_epochs_are_refused_and_change_nothing(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "meta", map_size=64 << 20)
    ids = _ids(store)
    with pytest.raises(InvalidRequestError, match="longer than 255 bytes"):
        await ids.init("é" * (MAX_NAME_BYTES // 2 + 1), -1)
    with pytest.raises(InvalidRequestError, match="below -1"):
        await ids.init("billing", -2)
    assert store.next_producer_id() == FIRST_PRODUCER_ID
    assert store.producers() == []
    store.close()
