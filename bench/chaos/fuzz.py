"""Hostile input on live servers: mutated frames against a data node and the
PM, then proof that nothing was hurt.

Frames start as real requests of every opcode each server serves, then one
mutation each (chosen by the seed):

- ``flip``: 1 to 8 random bits flipped anywhere;
- ``truncate``: cut short, with frame_length fixed to match or left lying;
- ``fields``: a random frame_length, opcode, flags or stream id;
- ``header``: bytes of the FlatBuffers header changed, the checksum
  recomputed so that the frame reaches the decoders;
- ``vector``: a 4-byte word of the header set to a huge count
  (vector lengths, offsets), checksum recomputed.

Eight connections send them pipelined, each reading whatever comes back; a
connection the server closes (as it must for some frames) is opened again.
Afterwards the servers must answer PING, serve a correct APPEND and FETCH,
hold every record stored before the run unchanged, log no traceback, and
keep their memory (anonymous resident memory, the least of five samples)
within 10 % of what it was after a warm-up round of 150,000 frames.
"""

from __future__ import annotations

import random
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import trio
from zlib_ng.zlib_ng import crc32

from client.consumer import Consumer
from client.pm_client import PMClient
from client.producer import Producer
from sbp import messages
from sbp.batches import build_batch
from sbp.constants import (
    CHECKSUM,
    DEFAULT_MAX_FRAME_LENGTH,
    FIXED_HEADER_SIZE,
    HEADER_PRELUDE_SIZE,
    MIN_FRAME_LENGTH,
)
from sbp.enums import ClientRole, Opcode
from sbp.frames import Frame, FrameDecoder, encode_frame

from .cluster import ChaosCluster
from .report import write_verdict

CONNECTIONS = 8
#: how long a burst's PING may take to come back before the connection is replaced
BURST_TIMEOUT_S = 2.0
#: frames sent before memory is measured for the baseline (half of a
#: shorter run's frames)
WARMUP_FRAMES = 150_000
SEED_RECORDS = 2_000
MEMORY_TOLERANCE = 0.10
_HEADER_AT = FIXED_HEADER_SIZE + HEADER_PRELUDE_SIZE


def templates(stream_id: int, node: messages.DataNode) -> list[tuple[int, bytes, bytes]]:
    """Real requests, (opcode, header, payload), covering what both servers serve."""
    batch = bytes(build_batch([b"fuzz-record"] * 3, base_timestamp=1_700_000_000_000))
    range_id = messages.RangeId(stream_id=stream_id, range_index=0)
    wire_range = messages.Range(
        stream_id=stream_id + 1000,
        range_index=0,
        start_offset=0,
        end_offset=-1,
        replica_nodes=(messages.ReplicaNode(data_node=node, is_primary=True),),
    )
    requests: list[tuple[messages.Message, bytes]] = [
        (
            messages.AppendRequest(
                timeout_ms=1000,
                append_requests=(
                    messages.AppendInfo(
                        stream_id=stream_id + 1000, request_index=0, batch_length=len(batch)
                    ),
                ),
            ),
            batch,
        ),
        (  # an idempotent producer's batch (SPEC §10)
            messages.AppendRequest(
                timeout_ms=1000,
                append_requests=(
                    messages.AppendInfo(
                        stream_id=stream_id + 1000,
                        request_index=0,
                        batch_length=len(batch),
                        producer_id=7,
                        producer_epoch=1,
                        base_sequence=0,
                    ),
                ),
            ),
            batch,
        ),
        (
            messages.FetchRequest(
                max_wait_ms=0,
                min_bytes=1,
                fetch_requests=(
                    messages.FetchInfo(
                        stream_id=stream_id, request_index=0, fetch_offset=0, batch_max_bytes=4096
                    ),
                ),
            ),
            b"",
        ),
        (messages.ListRangesRequest(range_owners=(messages.RangeOwner(stream_id=stream_id),)), b""),
        (messages.DescribeRangesRequest(ranges=(range_id,)), b""),
        (
            messages.SyncRangesRequest(
                stream_ranges=(
                    messages.StreamRanges(stream_id=stream_id + 1000, ranges=(wire_range,)),
                )
            ),
            b"",
        ),
        (messages.HeartbeatRequest(client_id="fuzz", client_role=ClientRole.CLIENT), b""),
        # replica_nums 0 is refused: the decoder is fuzzed, but streams are
        # created only by the rare mutation that makes it valid (each one
        # is state the PM must keep, not memory it should give back)
        (
            messages.CreateStreamsRequest(streams=(messages.Stream(replica_nums=0),)),
            b"",
        ),
        (messages.GetStreamsRequest(stream_ids=(stream_id,)), b""),
        (messages.DescribeClusterRequest(), b""),
        (messages.InitProducerRequest(producer_name="", producer_epoch=-1), b""),
        (messages.ProducerStateRequest(stream_id=stream_id, as_of_offset=0), b""),
    ]
    return [(_opcode_of(message), message.encode(), payload) for message, payload in requests]


def _opcode_of(message: messages.Message) -> int:
    for opcode in Opcode:
        if messages.request_type(opcode) is type(message):
            return int(opcode)
    raise ValueError(type(message).__name__)


def mutate(rng: random.Random, opcode: int, header: bytes, payload: bytes) -> tuple[str, bytes]:
    """One mutated frame from a template, and the mutation's name."""
    stream_id = rng.randrange(1, 1 << 31)
    frame = bytearray(encode_frame(opcode, 0, stream_id, header, payload))
    kind = rng.choice(("flip", "truncate", "fields", "header", "vector"))
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        cut = rng.randrange(4, len(frame))
        frame = frame[:cut]
        if rng.random() < 0.5:
            struct.pack_into(">I", frame, 0, cut - 4)
    elif kind == "fields":
        field_name = rng.choice(("length", "opcode", "flags", "stream"))
        if field_name == "length":
            struct.pack_into(
                ">I", frame, 0, rng.choice((0, 1, 11, 12, 1 << 24, rng.getrandbits(32)))
            )
        elif field_name == "opcode":
            struct.pack_into(">H", frame, 5, rng.getrandbits(16))
        elif field_name == "flags":
            frame[7] = rng.getrandbits(8)
        else:
            struct.pack_into(">I", frame, 8, rng.getrandbits(32))
    elif header:
        body = bytearray(header)
        if kind == "header":
            for _ in range(rng.randint(1, 6)):
                body[rng.randrange(len(body))] = rng.getrandbits(8)
        else:
            at = rng.randrange(0, max(len(body) - 3, 1)) & ~3
            huge = rng.choice((0x7FFFFFFF, 0xFFFFFFFF, 0x10000000, len(body) * 1000))
            struct.pack_into("<I", body, min(at, len(body) - 4), huge)
        frame[_HEADER_AT : _HEADER_AT + len(body)] = body
        CHECKSUM.pack_into(frame, len(frame) - 4, crc32(payload) if payload else 0)
    return kind, bytes(frame)


@dataclass
class FuzzStats:
    sent: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    reconnects: int = 0
    answers: int = 0


def breaks_the_stream(frame: bytes, max_frame_length: int = DEFAULT_MAX_FRAME_LENGTH) -> bool:
    """Whether the server cannot read on after this frame: its length field
    does not match its bytes (the next frame would be misread) or is out of
    bounds (the server must close the connection)."""
    (length,) = struct.unpack_from(">I", frame, 0)
    return length != len(frame) - 4 or not MIN_FRAME_LENGTH <= length <= max_frame_length


async def _hammer(
    address: str, frames: int, rng: random.Random, stats: FuzzStats, pool: list[Any]
) -> None:
    """Send ``frames`` mutated frames on one connection, in bursts that end
    with a PING: its answer proves the server read and handled the burst.
    A frame after which the server cannot read on goes last, alone, and the
    connection is closed and opened again."""
    host, _, port = address.rpartition(":")
    left = frames
    marker = 0x7FFF_0000
    while left > 0:
        try:
            stream = await trio.open_tcp_stream(host, int(port))
        except OSError:
            await trio.sleep(0.05)
            continue
        decoder = FrameDecoder(max_frame_length=1 << 30)
        async with stream:
            try:
                while left > 0:
                    burst: list[bytes] = []
                    breaking = b""
                    while len(burst) < 64 and len(burst) < left:
                        opcode, header, payload = rng.choice(pool)
                        kind, frame = mutate(rng, opcode, header, payload)
                        stats.by_kind[kind] = stats.by_kind.get(kind, 0) + 1
                        if breaks_the_stream(frame):
                            breaking = frame
                            break
                        burst.append(frame)
                    marker += 1
                    ping = encode_frame(Opcode.PING, 0, marker, b"", b"fuzz")
                    # A burst's requests may hold every slot of the connection
                    # (long polls): the server then stops reading it, by
                    # design; such a connection is given up and replaced.
                    with trio.fail_after(BURST_TIMEOUT_S):
                        await stream.send_all(b"".join(burst) + ping)
                        await _until_answered(stream, decoder, marker, stats)
                    left -= len(burst)
                    stats.sent += len(burst)
                    if breaking:
                        await stream.send_all(breaking)
                        left -= 1
                        stats.sent += 1
                        break
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, trio.TooSlowError):
                pass
        stats.reconnects += 1


async def _until_answered(
    stream: trio.SocketStream, decoder: FrameDecoder, marker: int, stats: FuzzStats
) -> None:
    """Read answers until the PING with ``marker`` comes back."""
    while True:
        data = await stream.receive_some(1 << 16)
        if not data:
            raise trio.BrokenResourceError("the server closed the connection")
        for event in decoder.feed(data):
            stats.answers += 1
            if (
                isinstance(event, Frame)
                and event.opcode == Opcode.PING
                and event.stream_id == marker
            ):
                return


async def _settled_rss(pids: dict[str, int]) -> dict[str, int]:
    """Each process's memory as the least of five samples over two seconds:
    garbage waiting for the collector comes and goes, what is live stays."""
    samples: dict[str, list[int]] = {name: [] for name in pids}
    for _ in range(5):
        await trio.sleep(0.5)
        for name, pid in pids.items():
            samples[name].append(_rss(pid))
    return {name: min(values) for name, values in samples.items()}


def _rss(pid: int) -> int:
    """The process's anonymous resident memory (its heap): file pages it
    maps are left out, the LMDB data file's above all, which reads bring in
    and the kernel may drop at will; a leak shows in the heap."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return int(psutil.Process(pid).memory_info().rss)


async def main(
    seed: int, frames: int, root: Path, out_dir: Path, memory_tolerance: float = MEMORY_TOLERANCE
) -> int:
    rng = random.Random(seed)
    print(f"fuzz: seed {seed}, {frames:,} mutated frames against a data node and the PM")
    cluster = ChaosCluster(root, 1)
    async with trio.open_nursery() as nursery:
        try:
            await cluster.start(nursery)
            result = await _fuzz(cluster, rng, frames, memory_tolerance)
        finally:
            await cluster.stop_all()
            nursery.cancel_scope.cancel()
    result["seed"] = seed
    result["server_tracebacks"] = cluster.log_tracebacks()
    if any(result["server_tracebacks"].values()):
        result["verdict"] = "FAIL"
        result["failures"].append("tracebacks in the server logs")
    return write_verdict(
        "fuzz",
        result,
        out_dir,
        f"{result['frames']:,} frames in {result['seconds']:.0f} s, "
        f"memory node {result['rss_mb']['node'][0]:.0f}->{result['rss_mb']['node'][1]:.0f} MB, "
        f"PM {result['rss_mb']['pm'][0]:.0f}->{result['rss_mb']['pm'][1]:.0f} MB, "
        f"{result['ranges_on_node']:,} ranges on the node",
    )


async def _fuzz(
    cluster: ChaosCluster, rng: random.Random, frames: int, memory_tolerance: float
) -> dict[str, Any]:
    node = cluster.nodes["node-1"]
    node_address, pm_address = node.child.address, cluster.pm.child.address
    assert node.child.process is not None and cluster.pm.child.process is not None
    pids = {"node": node.child.process.pid, "pm": cluster.pm.child.process.pid}
    # The frames name a decoy stream, never the one checked afterwards: a
    # mutation that still decodes may legitimately seal, trim or delete the
    # stream it names (an opcode changed to DELETE_STREAMS under another
    # header …). Small numbers abound in mutated headers, so the decoy gets
    # the first id and the checked stream one thousands away from it.
    decoy, _ = await _seed_stream(pm_address)
    async with PMClient(pm_address) as pm:
        for _ in range(4):
            await pm.create_streams([messages.Stream(replica_nums=1)] * 1000, timeout=60)
    stream_id, before = await _seed_stream(pm_address)
    pool = templates(decoy, messages.DataNode(node_id=1, advertise_addr=node_address))
    stats = FuzzStats()
    warmup = min(WARMUP_FRAMES, frames // 2)
    await _round(node_address, pm_address, warmup, rng, stats, pool)
    print(f"  warm-up: {warmup:,} frames", flush=True)
    start_rss = await _settled_rss(pids)
    print(f"  {await _state(node_address):,} ranges on the node after the warm-up", flush=True)
    started = time.monotonic()
    done = warmup
    #: memory after every step: a leak grows with the frames, a step of the
    #: allocator's high-water mark does not
    progress: list[dict[str, float]] = []
    while done < frames:
        step = min(100_000, frames - done)
        await _round(node_address, pm_address, step, rng, stats, pool)
        done += step
        sample = {name: _rss(pid) for name, pid in pids.items()}
        progress.append({"frames": done, **{k: round(v / 1e6, 1) for k, v in sample.items()}})
        memory = "  ".join(f"{name} {value / 1e6:.0f} MB" for name, value in sample.items())
        print(f"  {done:,} frames  ({time.monotonic() - started:.0f} s)  {memory}", flush=True)
    seconds = time.monotonic() - started
    end_rss = await _settled_rss(pids)
    created = await _state(node_address)
    failures = await _still_correct(pm_address, node_address, stream_id, before)
    for name in pids:
        if end_rss[name] > start_rss[name] * (1 + memory_tolerance):
            failures.append(
                f"{name} memory grew {start_rss[name] / 1e6:.0f} -> {end_rss[name] / 1e6:.0f} MB"
            )
    return {
        "verdict": "FAIL" if failures else "pass",
        "frames": stats.sent,
        "by_mutation": stats.by_kind,
        "reconnects": stats.reconnects,
        "answers": stats.answers,
        "seconds": round(seconds, 1),
        "rss_mb": {
            name: [round(start_rss[name] / 1e6, 1), round(end_rss[name] / 1e6, 1)] for name in pids
        },
        "failures": failures,
        # valid requests among the mutated ones leave state behind (ranges
        # of new stream ids on the node): memory a server must keep
        "ranges_on_node": created,
        "memory_mb_by_frames": progress,
    }


async def _state(node_address: str) -> int:
    """How many ranges the data node hosts."""
    from client.datanode_client import DataNodeClient

    async with DataNodeClient(node_address) as node:
        hosted = await node.list_node_ranges(messages.DataNode(node_id=1), timeout=30)
    return len(hosted)


async def _round(
    node: str, pm: str, frames: int, rng: random.Random, stats: FuzzStats, pool: list[Any]
) -> None:
    """``frames`` frames over ``CONNECTIONS`` connections, split between the
    node (three quarters) and the PM."""
    per = frames // CONNECTIONS
    async with trio.open_nursery() as nursery:
        for i in range(CONNECTIONS):
            target = pm if i % 4 == 3 else node
            nursery.start_soon(
                _hammer, target, per, random.Random(rng.getrandbits(64)), stats, pool
            )


async def _seed_stream(pm_address: str) -> tuple[int, list[tuple[int, bytes]]]:
    async with PMClient(pm_address) as pm:
        stream_id = (await pm.create_stream(replica_nums=1, timeout=10)).stream.stream_id
    async with Producer(pm_address, stream_id) as producer:
        for i in range(SEED_RECORDS):
            await producer.send(f"seed-{i}".encode())
    return stream_id, await _read_all(pm_address, stream_id)


async def _read_all(pm_address: str, stream_id: int) -> list[tuple[int, bytes]]:
    async with Consumer(pm_address, stream_id, from_offset=0) as consumer:
        return [(r.offset, r.value) async for r in consumer.records()]


async def _still_correct(
    pm_address: str, node_address: str, stream_id: int, before: list[tuple[int, bytes]]
) -> list[str]:
    """PING both, the stored records unchanged, a fresh APPEND read back."""
    failures: list[str] = []
    try:
        with trio.fail_after(30):
            async with PMClient(pm_address) as pm:
                await pm.ping(timeout=5)
            from client.datanode_client import DataNodeClient

            async with DataNodeClient(node_address) as node:
                await node.ping(timeout=5)
            after = await _read_all(pm_address, stream_id)
            if after[: len(before)] != before:
                changed = next(
                    (b, a) for b, a in zip(before, [*after, None] * 1, strict=False) if b != a
                )
                failures.append(
                    f"records stored before the run changed: {len(before)} records, "
                    f"{len(after)} read back; first difference {changed[0]} -> {changed[1]}"
                )
            async with PMClient(pm_address) as pm:
                fresh = (await pm.create_stream(replica_nums=1, timeout=10)).stream.stream_id
            async with Producer(pm_address, fresh) as producer:
                handles = [await producer.send(f"after-{i}".encode()) for i in range(100)]
            offsets = [await h.offset() for h in handles]
            back = await _read_all(pm_address, fresh)
            if back != [(o, f"after-{i}".encode()) for i, o in enumerate(offsets)]:
                failures.append("an APPEND after the run did not read back as written")
    except Exception as error:  # any failure here is the verdict, not a crash
        failures.append(f"servers not serving after the run: {type(error).__name__}: {error}")
    return failures
