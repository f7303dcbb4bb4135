"""Property (SPEC §10): whatever the interleaving of sends, resends, lost
requests, lost answers, seals and restarts, a producer that resends what was
not answered, under the same sequences, leaves every record in the stream
exactly once, in sequence order.

The storage engine is the real one; the producer is a model of the client
library's rules: sequences are given once, a batch is sent again until it is
answered, at most 64 batches are unanswered, and an OUT_OF_ORDER_SEQUENCE
or UNKNOWN_PRODUCER behind an unanswered older batch is sent again later.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from sbp.batches import build_batch, decode_batches
from sbp.errors import OutOfOrderSequenceError, UnknownProducerError
from storage import AppendItem, AppendOutcome, AppendResult, ProducerStamp, StorageEngine
from storage.model import RangeInfo

PID = 3
WINDOW = 64

Op = tuple[str, int]


@dataclass
class Batch:
    base_sequence: int
    values: list[bytes]
    stored_at: int | None = None  # the answer the producer got


@dataclass
class Model:
    engine: StorageEngine
    path: Path
    next_sequence: int = 0
    #: batches not answered yet, oldest first
    unanswered: list[Batch] = field(default_factory=list)
    ranges: list[RangeInfo] = field(default_factory=list)

    def send(self, batch: Batch, answer_lost: bool) -> None:
        done: Future[list[AppendOutcome]] = Future()
        stamp = ProducerStamp(PID, 0, batch.base_sequence)
        payload = build_batch(batch.values, 1)
        self.engine.submit([AppendItem(1, payload, stamp)], done.set_result)
        (outcome,) = done.result(10)
        if isinstance(outcome, OutOfOrderSequenceError | UnknownProducerError):
            # only ever behind an older batch that is still unanswered
            assert self.unanswered and self.unanswered[0].base_sequence < batch.base_sequence
            if isinstance(outcome, OutOfOrderSequenceError):
                assert outcome.next_sequence < batch.base_sequence
            return
        assert isinstance(outcome, AppendResult), outcome
        if not answer_lost:
            batch.stored_at = outcome.base_offset
            self.unanswered.remove(batch)

    def new_batch(self, records: int) -> Batch | None:
        if len(self.unanswered) >= WINDOW:
            return None
        values = [b"%d" % (self.next_sequence + i) for i in range(records)]
        batch = Batch(self.next_sequence, values)
        self.next_sequence += records
        self.unanswered.append(batch)
        return batch

    def seal(self) -> None:
        last = self.ranges[-1]
        end = self.engine.next_offset(1)
        assert end is not None
        sealed = RangeInfo(1, last.range_index, last.start_offset, end)
        self.ranges = [*self.ranges[:-1], sealed, RangeInfo(1, last.range_index + 1, end)]
        self.engine.sync_ranges(1, self.ranges).result()

    def restart(self) -> None:
        self.engine.close()
        self.engine = StorageEngine(self.path, map_size=64 << 20)


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["send", "send-request-lost", "send-answer-lost", "resend", "seal", "restart"]
        ),
        st.integers(1, 4),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_every_record_is_stored_once_in_sequence_order(ops: list[Op]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data"
        model = Model(StorageEngine(path, map_size=64 << 20), path)
        model.ranges = [RangeInfo(1, 0, 0)]
        model.engine.sync_ranges(1, model.ranges).result()
        try:
            for op, n in ops:
                if op.startswith("send"):
                    batch = model.new_batch(n)
                    if batch is not None and op != "send-request-lost":
                        model.send(batch, answer_lost=op == "send-answer-lost")
                elif op == "resend" and model.unanswered:
                    model.send(model.unanswered[min(n, len(model.unanswered)) - 1], False)
                elif op == "seal":
                    model.seal()
                elif op == "restart":
                    model.restart()
            # the producer sends what is unanswered again, oldest first, until done
            for _ in range(WINDOW + 1):
                if not model.unanswered:
                    break
                model.send(model.unanswered[0], False)
            assert not model.unanswered
            values: list[bytes] = []
            while stored := model.engine.read(1, len(values), 1 << 30):  # range by range
                values += decode_batches(stored).to_list()
            assert values == [b"%d" % i for i in range(model.next_sequence)]
        finally:
            model.engine.close()
