"""The producer fields of an APPEND or REPLICATE item (SPEC §10)."""

from __future__ import annotations

from typing import NamedTuple


class ProducerStamp(NamedTuple):
    """An idempotent producer's id, its epoch, and the sequence of the
    batch's first record. Items without one carry producer_id 0."""

    producer_id: int
    epoch: int
    base_sequence: int
