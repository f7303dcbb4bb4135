"""Random appends, seals, new ranges, trims, reads and reopens against a simple
in-memory model of what the engine must hold."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sbp.batches import build_batch, decode_batches
from sbp.errors import (
    OffsetOutOfRangeError,
    ProtocolError,
    RangeNotFoundError,
    RangeSealedError,
)
from storage import AppendItem, AppendOutcome, AppendResult, RangeInfo, ReplicaInfo, StorageEngine

NODE = 1
STREAMS = (1, 2)
MAP_SIZE = 32 * 1024 * 1024


@dataclass
class StreamModel:
    #: (base_offset, values, stored size) of every batch still stored
    batches: list[tuple[int, list[bytes], int]] = field(default_factory=list)
    ranges: list[RangeInfo] = field(default_factory=list)
    first_offset: int = 0
    next_offset: int = 0
    last_index: int = 0

    @property
    def open(self) -> bool:
        return bool(self.ranges) and self.ranges[-1].is_open


def new_range(stream_id: int, index: int, start: int) -> RangeInfo:
    return RangeInfo(stream_id, index, start, replicas=(ReplicaInfo(NODE, "n1", True),))


class StorageMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="storage-model-")
        self.engine = self._open()
        self.model: dict[int, StreamModel] = {}
        for stream_id in STREAMS:
            first = new_range(stream_id, 0, 0)
            self.engine.sync_ranges(stream_id, [first]).result()
            self.model[stream_id] = StreamModel(ranges=[first])

    def _open(self) -> StorageEngine:
        return StorageEngine(self.dir, map_size=MAP_SIZE, node_id=NODE, sync="never")

    @rule(
        stream_id=st.sampled_from(STREAMS),
        batches=st.lists(
            st.lists(st.binary(max_size=40), min_size=1, max_size=6), min_size=1, max_size=4
        ),
    )
    def append(self, stream_id: int, batches: list[list[bytes]]) -> None:
        """One request of several batches: one transaction, so one stored chunk."""
        model = self.model[stream_id]
        built = [build_batch(values, 0) for values in batches]
        done: Future[list[AppendOutcome]] = Future()
        self.engine.submit([AppendItem(stream_id, b) for b in built], done.set_result)
        outcomes = done.result()
        if not model.open:
            expected: type[ProtocolError] = RangeSealedError if model.ranges else RangeNotFoundError
            assert all(type(outcome) is expected for outcome in outcomes), outcomes
            return
        for values, batch, outcome in zip(batches, built, outcomes, strict=True):
            assert isinstance(outcome, AppendResult), outcome
            assert outcome.base_offset == model.next_offset
            model.batches.append((model.next_offset, values, len(batch)))
            model.next_offset += len(values)

    @precondition(lambda self: any(m.open for m in self.model.values()))
    @rule(data=st.data())
    def seal(self, data: st.DataObject) -> None:
        stream_id = data.draw(st.sampled_from([s for s, m in self.model.items() if m.open]))
        model = self.model[stream_id]
        sealed = self.engine.seal_range(stream_id, model.last_index).result()
        assert sealed.end_offset == model.next_offset
        model.ranges[-1] = dataclasses.replace(model.ranges[-1], end_offset=model.next_offset)

    @precondition(lambda self: any(not m.open for m in self.model.values()))
    @rule(data=st.data())
    def open_next_range(self, data: st.DataObject) -> None:
        stream_id = data.draw(st.sampled_from([s for s, m in self.model.items() if not m.open]))
        model = self.model[stream_id]
        model.last_index += 1
        model.ranges.append(new_range(stream_id, model.last_index, model.next_offset))
        synced = self.engine.sync_ranges(stream_id, model.ranges).result()
        assert [r.range_index for r in synced] == [r.range_index for r in model.ranges]

    @rule(stream_id=st.sampled_from(STREAMS), trim_offset=st.integers(0, 80))
    def trim(self, stream_id: int, trim_offset: int) -> None:
        model = self.model[stream_id]
        expected = max(model.first_offset, min(trim_offset, model.next_offset))
        assert self.engine.trim(stream_id, trim_offset).result() == expected
        if expected == model.first_offset:
            return
        model.first_offset = expected
        model.batches = [b for b in model.batches if b[0] + len(b[1]) > expected]
        model.ranges = [r for r in model.ranges if not (not r.is_open and r.end_offset <= expected)]

    @rule(
        stream_id=st.sampled_from(STREAMS),
        offset=st.integers(-1, 90),
        max_bytes=st.integers(1, 600),
    )
    def read(self, stream_id: int, offset: int, max_bytes: int) -> None:
        model = self.model[stream_id]
        try:
            payload = self.engine.read(stream_id, offset, max_bytes)
        except ProtocolError as error:
            assert type(error) is self._expected_error(model, offset)
            return
        assert self._expected_error(model, offset) is None
        decoded = decode_batches(payload)
        if offset == model.next_offset:
            assert len(decoded) == 0
            return
        holder = next(r for r in model.ranges if r.holds(offset))
        stop = holder.end_offset if not holder.is_open else model.next_offset
        expected: list[tuple[int, bytes]] = []
        total = 0
        for base, values, size in model.batches:
            if base + len(values) <= offset or base >= stop:
                continue
            if expected and total + size > max_bytes:
                break
            expected += [(base + i, v) for i, v in enumerate(values)]
            total += size
        assert list(zip(decoded.offsets.tolist(), decoded.to_list(), strict=True)) == expected

    @staticmethod
    def _expected_error(model: StreamModel, offset: int) -> type[ProtocolError] | None:
        if offset < model.first_offset or not model.ranges or offset > model.next_offset:
            return OffsetOutOfRangeError
        if offset == model.next_offset and not model.open:
            return RangeSealedError
        return None

    @rule()
    def reopen(self) -> None:
        self.engine.close()
        self.engine = self._open()

    @invariant()
    def offsets_match(self) -> None:
        for stream_id, model in self.model.items():
            assert self.engine.next_offset(stream_id) == model.next_offset
            assert self.engine.first_offset(stream_id) == model.first_offset

    def teardown(self) -> None:
        self.engine.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StorageMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_storage_matches_model = StorageMachine.TestCase
