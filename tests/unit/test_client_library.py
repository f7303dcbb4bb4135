"""Producer, Consumer and SyncClient against an in-process fake cluster whose
faults are scripted: a seal under the producer, errors, a corrupt batch."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import numpy as np
import pytest
import trio

from client import Consumer, PMClient, Producer, Record, SyncClient
from net.pool import ConnectionPool
from net.server import Dispatcher, Request, Responder, Server
from sbp import messages as m
from sbp.batches import build_batch, decode_batches, peek_header, stamp_base_offset
from sbp.enums import ErrorCode, Opcode
from sbp.errors import (
    InvalidRecordBatchError,
    NotPrimaryError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    ProtocolError,
    RequestTimeoutError,
    StreamDeletedError,
)
from sbp.producer_stamp import ProducerStamp
from storage.producers import ProducerState, SequenceEntry, decide

from ..eventually import eventually

#: a linger longer than any test: batches are cut by count and flush
#: alone, however slowly a loaded machine runs the test
NO_LINGER = 600.0
STREAM = 1


class FakeCluster:
    """A PM and one data node in one server, holding one stream in memory.

    ``append_faults`` are error codes answered, one per APPEND request (to
    all of its items: a data node applies a request in one commit), before
    appends succeed again; RANGE_SEALED also seals the open range, as a PM
    sealing under the producer would.
    """

    def __init__(self) -> None:
        self.address = ""
        self.batches: list[bytearray] = []
        self.next_offset = 0
        self.range_starts = [0]
        self.append_faults: list[ErrorCode] = []
        self.always_fail: ErrorCode | None = None
        self.corrupt_fetches = False
        self.list_calls = 0
        self.appended = trio.Event()
        #: FETCHes being answered now, the most at once, and every offset asked
        self.fetching = 0
        self.most_fetching = 0
        self.fetched_at: list[int] = []
        #: offsets whose first FETCH is refused (a node that failed over)
        self.refuse_once: set[int] = set()
        #: seconds each FETCH takes to answer (a node at work)
        self.fetch_delay = 0.0
        #: idempotent producers (SPEC §10), decided as the data node decides
        self.producers: dict[int, ProducerState] = {}
        self.stamps: list[tuple[int, int, int]] = []
        self.producer_epoch = 0
        self.producer_ids = 0
        #: APPEND requests stored whose answer is then lost (answered TIMEOUT)
        self.lose_answers = 0

    def dispatcher(self) -> Dispatcher:
        dispatcher = Dispatcher("fake")
        dispatcher.register(Opcode.LIST_RANGES, self.list_ranges)
        dispatcher.register(Opcode.CREATE_STREAMS, self.create_streams)
        dispatcher.register(Opcode.APPEND, self.append)
        dispatcher.register(Opcode.FETCH, self.fetch)
        dispatcher.register(Opcode.INIT_PRODUCER, self.init_producer)
        return dispatcher

    async def init_producer(self, request: Request, responder: Responder) -> None:
        request.header_as(m.InitProducerRequest)
        self.producer_ids += 1  # unnamed: a new id each time, as the PM gives
        epoch = self.producer_epoch
        await responder.send(
            m.InitProducerResponse(producer_id=self.producer_ids, producer_epoch=epoch)
        )

    def ranges(self) -> tuple[m.Range, ...]:
        node = m.DataNode(node_id=1, advertise_addr=self.address)
        ends = [*self.range_starts[1:], -1]
        return tuple(
            m.Range(
                stream_id=STREAM,
                range_index=i,
                start_offset=start,
                end_offset=end,
                replica_nodes=(m.ReplicaNode(data_node=node, is_primary=True),),
            )
            for i, (start, end) in enumerate(zip(self.range_starts, ends, strict=True))
        )

    def seal(self) -> None:
        self.range_starts.append(self.next_offset)

    async def list_ranges(self, request: Request, responder: Responder) -> None:
        self.list_calls += 1
        owner = request.header_as(m.ListRangesRequest).range_owners[0]
        result = m.ListRangesResult(range_owner=owner, ranges=self.ranges())
        await responder.send(m.ListRangesResponse(list_responses=(result,)))

    async def create_streams(self, request: Request, responder: Responder) -> None:
        stream = m.Stream(stream_id=STREAM, replica_nums=1)
        result = m.CreateStreamResult(stream=stream, range=self.ranges()[-1])
        await responder.send(m.CreateStreamsResponse(create_responses=(result,)))

    async def append(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.AppendRequest)
        results = []
        position = 0
        code = self.always_fail
        if code is None and self.append_faults:
            code = self.append_faults.pop(0)
            if code == ErrorCode.RANGE_SEALED:
                self.seal()
        for info in header.append_requests:
            batch = bytearray(request.payload[position : position + info.batch_length])
            position += info.batch_length
            if code is not None:
                results.append(
                    m.AppendResult(
                        request_index=info.request_index, base_offset=-1, error_code=code
                    )
                )
                continue
            count = peek_header(batch).record_count
            if info.producer_id:
                stamp = ProducerStamp(info.producer_id, info.producer_epoch, info.base_sequence)
                self.stamps.append(stamp)
                try:
                    stored = decide(self.producers.get(info.producer_id), stamp, count, 0, 1 << 60)
                except ProtocolError as error:
                    next_sequence = getattr(error, "next_sequence", -1)
                    results.append(
                        m.AppendResult(
                            request_index=info.request_index,
                            base_offset=-1,
                            error_code=error.code,
                            error_message=error.message,
                            next_sequence=next_sequence,
                        )
                    )
                    continue
                if stored is not None:
                    results.append(
                        m.AppendResult(
                            request_index=info.request_index, base_offset=stored.base_offset
                        )
                    )
                    continue
                entry = SequenceEntry(stamp.epoch, stamp.base_sequence, count, self.next_offset)
                held = self.producers.get(info.producer_id)
                self.producers[info.producer_id] = (
                    ProducerState.first(entry, 0) if held is None else held.with_batch(entry, 0)
                )
            stamp_base_offset(batch, self.next_offset)
            results.append(
                m.AppendResult(request_index=info.request_index, base_offset=self.next_offset)
            )
            self.next_offset += count
            self.batches.append(batch)
        self.appended.set()
        self.appended = trio.Event()
        if self.lose_answers:
            self.lose_answers -= 1
            results = [
                m.AppendResult(request_index=r.request_index, error_code=ErrorCode.TIMEOUT)
                for r in results
            ]
        await responder.send(m.AppendResponse(append_responses=tuple(results)))

    async def fetch(self, request: Request, responder: Responder) -> None:
        self.fetching += 1
        self.most_fetching = max(self.most_fetching, self.fetching)
        try:
            await self._fetch(request, responder)
        finally:
            self.fetching -= 1

    async def _fetch(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.FetchRequest)
        info = header.fetch_requests[0]
        self.fetched_at.append(info.fetch_offset)
        await trio.sleep(self.fetch_delay)
        if info.fetch_offset in self.refuse_once:
            self.refuse_once.discard(info.fetch_offset)
            refused = m.FetchResult(
                request_index=info.request_index, error_code=ErrorCode.NOT_PRIMARY
            )
            await responder.send(m.FetchResponse(fetch_responses=(refused,)))
            return
        if info.fetch_offset >= self.next_offset and header.max_wait_ms > 0:
            with trio.move_on_after(header.max_wait_ms / 1000):
                await self.appended.wait()
        data = bytearray()
        for batch in self.batches:
            first = peek_header(batch)
            if first.next_offset > info.fetch_offset and len(data) < info.batch_max_bytes:
                data += batch
        if self.corrupt_fetches and data:
            data[-1] ^= 0xFF  # a value byte: only the CRC-32C can tell
        result = m.FetchResult(request_index=info.request_index, batch_length=len(data))
        await responder.send(m.FetchResponse(fetch_responses=(result,)), bytes(data))

    def batch_sizes(self) -> list[int]:
        return [peek_header(batch).record_count for batch in self.batches]


@pytest.fixture
async def fake() -> AsyncIterator[FakeCluster]:
    cluster = FakeCluster()
    server = Server(cluster.dispatcher())
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(functools.partial(server.serve, "127.0.0.1", 0))
        cluster.address = f"{host}:{port}"
        yield cluster
        nursery.cancel_scope.cancel()


def values(count: int, size: int = 8) -> list[bytes]:
    return [b"%0*d" % (size, i) for i in range(count)]


async def read_values(fake: FakeCluster, start: int = 0) -> list[Record]:
    async with Consumer(fake.address, STREAM, start) as consumer:
        return [record async for record in consumer.records()]


# -- producer -----------------------------------------------------------------


async def test_send_many_splits_at_batch_records_and_reports_offsets(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, linger=NO_LINGER, batch_records=10) as producer:
        first = await producer.send(b"first")
        many = await producer.send_many(values(25))
        await producer.flush()
        assert await first.offset() == 0
        np.testing.assert_array_equal(await many.offsets(), np.arange(1, 26))
    assert fake.batch_sizes() == [10, 10, 6]


async def test_batch_bytes_caps_each_batch(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, batch_bytes=1000) as producer:
        await producer.send_many(values(50, size=96))
    # 96 bytes + a 4-byte length per record: the 10th record reaches 1000 bytes
    assert fake.batch_sizes() == [10, 10, 10, 10, 10]


async def test_linger_sends_a_lone_record_without_flush(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, linger=0.01) as producer:
        handle = await producer.send(b"alone")
        assert await handle.offset() == 0
        assert handle.done


async def test_a_seal_under_the_producer_is_retried_in_order(fake: FakeCluster) -> None:
    fake.append_faults = [ErrorCode.RANGE_SEALED, ErrorCode.NOT_PRIMARY]
    async with Producer(fake.address, STREAM, batch_records=5) as producer:
        handle = await producer.send_many(values(20))
        await producer.flush()
        np.testing.assert_array_equal(await handle.offsets(), np.arange(20))
    assert fake.list_calls >= 3  # the first listing and one per failure
    assert len(fake.ranges()) == 2
    assert [record.value for record in await read_values(fake)] == values(20)


async def test_a_non_retriable_error_fails_the_records(fake: FakeCluster) -> None:
    fake.always_fail = ErrorCode.STREAM_DELETED
    async with Producer(fake.address, STREAM) as producer:
        handle = await producer.send(b"lost")
        with pytest.raises(StreamDeletedError):
            await producer.flush()
        with pytest.raises(StreamDeletedError):
            await handle.offset()


async def test_retries_stop_at_the_delivery_timeout(fake: FakeCluster) -> None:
    fake.always_fail = ErrorCode.NOT_PRIMARY
    async with Producer(fake.address, STREAM, delivery_timeout=0.3) as producer:
        handle = await producer.send_many(values(3))
        with pytest.raises(NotPrimaryError):
            await producer.flush()
        with pytest.raises(NotPrimaryError):
            await handle.wait()
        assert producer.buffered_bytes == 0


async def test_send_batch_goes_as_built_between_the_records_around_it(
    fake: FakeCluster,
) -> None:
    built = build_batch(values(5), base_timestamp=1_700_000_000_000)
    async with Producer(fake.address, STREAM, linger=NO_LINGER, batch_records=100) as producer:
        before = await producer.send_many(values(3))
        batch = await producer.send_batch(built)
        after = await producer.send(b"after")
        await producer.flush()
        assert len(batch) == 5
        np.testing.assert_array_equal(await before.offsets(), np.arange(3))
        np.testing.assert_array_equal(await batch.offsets(), np.arange(3, 8))
        assert await after.offset() == 8
    assert fake.batch_sizes() == [3, 5, 1]
    # the same bytes but the base offset, which the data node stamps
    assert fake.batches[1][8:] == built[8:]
    assert peek_header(fake.batches[1]).base_timestamp == 1_700_000_000_000


async def test_send_batch_is_retried_in_order_after_a_seal(fake: FakeCluster) -> None:
    fake.append_faults = [ErrorCode.RANGE_SEALED]
    async with Producer(fake.address, STREAM) as producer:
        first = await producer.send_batch(build_batch(values(4), 0))
        second = await producer.send_batch(memoryview(build_batch(values(6)[4:], 0)))
        await producer.flush()
        np.testing.assert_array_equal(await first.offsets(), np.arange(4))
        np.testing.assert_array_equal(await second.offsets(), np.arange(4, 6))
    assert len(fake.ranges()) == 2
    assert [record.value for record in await read_values(fake)] == values(6)


async def test_send_batch_refuses_a_malformed_or_oversized_batch(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, max_request_bytes=100) as producer:
        with pytest.raises(InvalidRecordBatchError, match="batch_length"):
            await producer.send_batch(build_batch(values(2), 0)[:-1])
        with pytest.raises(ValueError, match="max_request_bytes"):
            await producer.send_batch(build_batch(values(10), 0))
        assert producer.buffered_bytes == 0
    assert fake.batches == []


# -- consumer -----------------------------------------------------------------


async def test_consumer_starts_mid_batch_and_reads_to_the_end(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, batch_records=10) as producer:
        await producer.send_many(values(30))
    records = await read_values(fake, start=13)
    assert [record.offset for record in records] == list(range(13, 30))
    assert [record.value for record in records] == values(30)[13:]


async def test_consumer_batches_are_numpy_columns(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, batch_records=7) as producer:
        await producer.send_many(values(20))
    async with Consumer(fake.address, STREAM, fetch_bytes=1) as consumer:
        batches = [records async for records in consumer]
        assert consumer.position == 20
    assert [len(records) for records in batches] == [7, 7, 6]
    assert batches[1].value_offsets[0] == 0
    np.testing.assert_array_equal(batches[1].offsets, np.arange(7, 14))
    assert batches[2].to_list() == values(20)[14:]


async def test_consumer_reads_ahead_with_several_fetches_in_flight(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, batch_records=10) as producer:
        await producer.send_many(values(400))
    fake.fetch_delay = 0.005
    batch_bytes = len(fake.batches[0])
    async with Consumer(fake.address, STREAM, fetch_bytes=2 * batch_bytes) as consumer:
        records = [record async for record in consumer.records()]
    assert [record.offset for record in records] == list(range(400))
    assert [record.value for record in records] == values(400)
    assert fake.most_fetching == 3  # DEFAULT_READ_AHEAD
    # every prediction landed: each offset asked for once, two batches apart
    # (and those past the end, which come back empty)
    assert len(fake.fetched_at) == len(set(fake.fetched_at))
    assert set(fake.fetched_at) >= set(range(0, 420, 20))
    assert all(offset % 20 == 0 for offset in fake.fetched_at)


async def test_consumer_read_ahead_off_fetches_one_at_a_time(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, batch_records=10) as producer:
        await producer.send_many(values(100))
    fake.fetch_delay = 0.005
    batch_bytes = len(fake.batches[0])
    async with Consumer(
        fake.address, STREAM, fetch_bytes=2 * batch_bytes, read_ahead=0
    ) as consumer:
        records = [record async for record in consumer.records()]
    assert [record.offset for record in records] == list(range(100))
    assert fake.most_fetching == 1


async def test_consumer_reads_every_record_once_when_predictions_miss(
    fake: FakeCluster,
) -> None:
    # batches of 3, 11, 5, 17 ... records: an answer rarely holds as many as the last
    sizes = [3, 11, 5, 17, 1, 8, 13, 2, 21, 4] * 4
    async with Producer(fake.address, STREAM) as producer:
        for size in sizes:
            await producer.send_batch(build_batch(values(size), 0))
    total = sum(sizes)
    fake.fetch_delay = 0.002
    async with Consumer(fake.address, STREAM, fetch_bytes=200) as consumer:
        records = [record async for record in consumer.records()]
    assert [record.offset for record in records] == list(range(total))
    assert [record.value for record in records] == [v for n in sizes for v in values(n)]
    assert fake.most_fetching > 1  # it did read ahead, and dropped what missed


async def test_a_refused_fetch_sent_ahead_is_asked_again(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, batch_records=10) as producer:
        await producer.send_many(values(200))
    fake.fetch_delay = 0.002
    batch_bytes = len(fake.batches[0])
    fake.refuse_once = {40, 80, 100}  # offsets the walk asks for ahead
    async with Consumer(fake.address, STREAM, fetch_bytes=2 * batch_bytes) as consumer:
        records = [record async for record in consumer.records()]
    assert [record.offset for record in records] == list(range(200))
    assert not fake.refuse_once
    assert fake.fetched_at.count(40) == 2  # refused ahead, then asked again


async def test_a_corrupt_batch_raises_and_is_never_skipped(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM) as producer:
        await producer.send_many(values(10))
    fake.corrupt_fetches = True
    with pytest.raises(InvalidRecordBatchError, match="CRC-32C"):
        await read_values(fake)


async def test_tail_mode_waits_for_new_records(fake: FakeCluster) -> None:
    got: list[Record] = []

    async def read_three(consumer: Consumer) -> None:
        async for record in consumer.records():
            got.append(record)
            if len(got) == 3:
                return

    async with (
        Consumer(fake.address, STREAM, tail=True, max_wait_ms=200) as consumer,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(read_three, consumer)
        await trio.sleep(0.05)  # the consumer waits at the tail before anything is sent
        async with Producer(fake.address, STREAM) as producer:
            await producer.send_many([b"a", b"b", b"c"])
    assert [(record.offset, record.value) for record in got] == [(0, b"a"), (1, b"b"), (2, b"c")]


async def test_producer_and_consumer_share_a_pool(fake: FakeCluster) -> None:
    async with ConnectionPool() as pool:
        async with Producer(fake.address, STREAM, pool=pool) as producer:
            await producer.send_many(values(5))
        async with Consumer(fake.address, STREAM, pool=pool) as consumer:
            assert sum([len(records) async for records in consumer]) == 5
        assert pool.connection(fake.address) is not None


# -- sync facade ----------------------------------------------------------------


async def test_sync_client_round_trip_from_a_plain_thread(fake: FakeCluster) -> None:
    def script() -> tuple[int, list[int], list[Record], int]:
        with SyncClient(pm=fake.address) as client:
            stream = client.create_stream()
            with client.producer(stream.stream_id, batch_records=4, linger=NO_LINGER) as producer:
                one = producer.send(b"one")
                many = producer.send_many(values(9))
                producer.flush()
                offsets = many.offsets().tolist()
            consumer = client.consumer(stream.stream_id, from_offset=0)
            records = list(consumer)
            ranges = len(client.list_ranges(stream.stream_id))
            return one.offset(), offsets, records, ranges

    first, offsets, records, ranges = await trio.to_thread.run_sync(script)
    assert first == 0
    assert offsets == list(range(1, 10))
    assert [record.value for record in records] == [b"one", *values(9)]
    assert ranges == 1
    assert fake.batch_sizes() == [4, 4, 2]


async def test_sync_producer_sends_built_batches(fake: FakeCluster) -> None:
    def script() -> list[list[int]]:
        with SyncClient(pm=fake.address) as client, client.producer(STREAM) as producer:
            handles = [producer.send_batch(build_batch(values(n), 0)) for n in (2, 3)]
            producer.flush()
            return [handle.offsets().tolist() for handle in handles]

    assert await trio.to_thread.run_sync(script) == [[0, 1], [2, 3, 4]]
    assert fake.batch_sizes() == [2, 3]


async def test_sync_client_submit_runs_on_the_loop_with_its_pool(fake: FakeCluster) -> None:
    async def fail(message: str) -> None:
        raise StreamDeletedError(message)

    def script() -> tuple[int, bool, BaseException | None]:
        with SyncClient(pm=fake.address) as client:
            pm = PMClient(fake.address, pool=client.pool)
            ranges = client.submit(pm.list_stream_ranges, STREAM).result(timeout=10)
            shared = client.pool.connection(fake.address) is not None
            return len(ranges), shared, client.submit(fail, "gone").exception(timeout=10)

    count, shared, error = await trio.to_thread.run_sync(script)
    assert count == 1
    assert shared  # the PM call went through the client's own pool
    assert isinstance(error, StreamDeletedError)
    assert str(error) == "STREAM_DELETED: gone"


def test_reads_go_to_the_primary_first_or_to_the_followers_first() -> None:
    from client._routing import replica_for_read

    def node(node_id: int) -> m.DataNode:
        return m.DataNode(node_id=node_id, advertise_addr=f"127.0.0.1:{7500 + node_id}")

    rng = m.Range(
        stream_id=STREAM,
        range_index=0,
        start_offset=0,
        end_offset=-1,
        replica_nodes=(
            m.ReplicaNode(data_node=node(1)),
            m.ReplicaNode(data_node=node(2), is_primary=True),
            m.ReplicaNode(data_node=node(3)),
        ),
    )
    primary_first = [replica_for_read(rng, attempt).node_id for attempt in range(4)]
    assert primary_first == [2, 1, 3, 2]
    followers_first = [
        replica_for_read(rng, attempt, prefer_followers=True).node_id for attempt in range(4)
    ]
    assert followers_first == [1, 3, 2, 1]


# -- idempotent producers (SPEC §10) --------------------------------------------


@pytest.mark.parametrize(
    ("idempotent", "stored", "first"), [(True, 1, 0), (False, 2, 3)], ids=["idempotent", "not"]
)
async def test_a_batch_whose_answer_was_lost_is_stored_once_when_idempotent(
    fake: FakeCluster, idempotent: bool, stored: int, first: int
) -> None:
    fake.lose_answers = 1  # stored, answered TIMEOUT: the producer sends it again
    async with Producer(fake.address, STREAM, idempotent=idempotent) as producer:
        handle = await producer.send_many(values(3))
        offsets = await handle.offsets()
    assert offsets.tolist() == [first, first + 1, first + 2]  # where the last copy went
    assert len(fake.batches) == stored
    if idempotent:
        assert producer.producer == (1, 0)
        assert fake.stamps == [ProducerStamp(1, 0, 0), ProducerStamp(1, 0, 0)]
    else:
        assert fake.stamps == []  # no producer fields on the wire


async def test_sequences_count_records_in_the_order_sent(fake: FakeCluster) -> None:
    async with Producer(fake.address, STREAM, batch_records=4) as producer:
        await producer.send_many(values(10))
        await producer.send_batch(build_batch(values(3), 0))
    assert [s.base_sequence for s in fake.stamps] == [0, 4, 8, 10]
    assert fake.next_offset == 13


async def test_out_of_order_with_nothing_in_front_fails_and_is_not_resent(
    fake: FakeCluster,
) -> None:
    """The stream expects sequence 100 of this producer (it lost track): the
    batch fails with the error, and is never sent under another sequence."""
    fake.producers[1] = ProducerState.first(SequenceEntry(0, 90, 10, 0), 0)
    with pytest.raises(OutOfOrderSequenceError) as raised:
        async with Producer(fake.address, STREAM) as producer:
            handle = await producer.send(b"x")
            await handle.offset()
    assert raised.value.code == ErrorCode.OUT_OF_ORDER_SEQUENCE
    assert fake.stamps == [ProducerStamp(1, 0, 0)]
    assert fake.next_offset == 0


async def test_a_fenced_producer_fails_and_refuses_more_records(fake: FakeCluster) -> None:
    fake.producers[1] = ProducerState.first(SequenceEntry(3, 0, 1, 0), 0)  # epoch 3 wrote
    async with Producer(fake.address, STREAM) as producer:
        handle = await producer.send(b"x")
        with pytest.raises(ProducerFencedError):
            await handle.offset()
        with pytest.raises(ProducerFencedError, match="epoch 0 is fenced: epoch 3"):
            await producer.send(b"y")


async def test_batches_refused_behind_a_failed_first_one_are_sent_again_after_it(
    fake: FakeCluster,
) -> None:
    """The first request fails (nothing stored); the ones in flight behind it
    reach a node with no state for the producer (UNKNOWN_PRODUCER) or a gap
    (OUT_OF_ORDER_SEQUENCE): they go again after it, every record once, in order."""
    fake.append_faults = [ErrorCode.TIMEOUT]
    async with Producer(
        fake.address, STREAM, batch_records=1, max_in_flight=5, max_request_bytes=64
    ) as producer:  # one batch per request
        handle = await producer.send_many(values(6))
        offsets = await handle.offsets()
    assert offsets.tolist() == list(range(6))
    sent = [stamp.base_sequence for stamp in fake.stamps]
    assert sent.count(1) > 1  # refused behind the first, then sent again
    stored = [v for batch in fake.batches for v in decode_batches(batch).to_list()]
    assert stored == values(6)


async def test_after_a_batch_fails_for_good_the_producer_goes_on_under_a_new_id(
    fake: FakeCluster,
) -> None:
    """A lost batch leaves a gap in the sequences the stream expects: the
    producer takes a new id and numbers what it sends next from 0, instead
    of being refused for ever after."""
    fake.always_fail = ErrorCode.TIMEOUT
    async with Producer(fake.address, STREAM, delivery_timeout=0.3) as producer:
        lost = await producer.send(b"lost")
        with pytest.raises(RequestTimeoutError):
            await lost.offset()
        fake.always_fail = None
        kept = await producer.send(b"kept")
        assert await kept.offset() == 0
    assert fake.stamps[-1] == ProducerStamp(2, 0, 0)
    assert [v for batch in fake.batches for v in decode_batches(batch).to_list()] == [b"kept"]


async def test_a_producer_pinned_to_its_epoch_stops_after_a_lost_batch(
    fake: FakeCluster,
) -> None:
    """With ``epoch`` given (resume semantics) it never numbers again: the
    next send raises the error that lost the batch."""
    fake.always_fail = ErrorCode.TIMEOUT
    async with Producer(fake.address, STREAM, delivery_timeout=0.3, epoch=0) as producer:
        lost = await producer.send(b"lost")
        with pytest.raises(RequestTimeoutError):
            await lost.offset()
        fake.always_fail = None
        await eventually(lambda: producer._sender is not None and producer._sender.fenced)
        with pytest.raises(RequestTimeoutError):
            await producer.send(b"never")
