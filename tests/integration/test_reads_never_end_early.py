"""A read never reports fewer records than the stream holds without an
error: restarted replicas, a dead primary, and offsets past the end, with a
PM and three data nodes as processes."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from client.consumer import Consumer
from sbp import messages
from sbp.batches import build_batch, decode_batches
from sbp.enums import ErrorCode
from sbp.errors import ConnectionClosed, NotPrimaryError, ProtocolError, SBPError, error_for

from ..eventually import eventually
from .pm_cluster import PMCluster, pm_cluster, primary_address
from .procs import _child_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECORDS = 1000


async def replicated_stream_of(cluster: PMCluster, count: int = RECORDS) -> messages.Range:
    """A new R = 3, A = 2 stream holding ``count`` records, every follower
    serving all of them (it knows the commit offset)."""
    created = await cluster.pm_client().create_stream(3, ack_nums=2)
    assert created.range is not None
    rng = created.range
    primary = cluster.node_client(primary_address(rng))
    for first in range(0, count, 100):
        batch = build_batch([f"v{i}".encode() for i in range(first, first + 100)], base_timestamp=1)
        [result] = await primary.append([(rng.stream_id, bytes(batch))])
        assert (result.error_code, result.base_offset) == (ErrorCode.NONE, first)
    for address in follower_addresses(rng):
        await eventually(
            functools.partial(served_once_known, cluster, rng, address),
            until=lambda got: len(got) >= count,
        )
    return rng


async def served_once_known(cluster: PMCluster, rng: messages.Range, address: str) -> list[bytes]:
    """``served``, with a follower's refusal while it does not know the
    commit offset yet (the ack quorum can leave one replica behind) read as
    nothing served yet."""
    try:
        return await served(cluster, rng, address)
    except NotPrimaryError:
        return []


def follower_addresses(rng: messages.Range) -> list[str]:
    return [r.data_node.advertise_addr for r in rng.replica_nodes if not r.is_primary]


def node_at(cluster: PMCluster, address: str) -> int:
    return next(n for n, p in cluster.nodes.items() if p.address == address)


async def served(cluster: PMCluster, rng: messages.Range, address: str) -> list[bytes]:
    """What one replica answers a FETCH at the range's start with (no long
    poll); an error answer raises."""
    info = messages.FetchInfo(stream_id=rng.stream_id, fetch_offset=0, batch_max_bytes=1 << 20)
    async with cluster.node_client(address).fetch([info]) as results:
        answers = [(fetched.result, bytes(fetched.data)) async for fetched in results]
    [(result, data)] = answers
    if result.error_code != ErrorCode.NONE:
        raise error_for(result.error_code, result.error_message)
    return decode_batches(data).to_list() if data else []


async def restart(cluster: PMCluster, address: str) -> None:
    """``kill -9`` the node at ``address`` and start it again on the same
    port, as ``sbp-cluster`` does."""
    node_id = node_at(cluster, address)
    await cluster.nodes[node_id].kill()
    await cluster.start_node(node_id, "--listen", address)


async def read_all(cluster: PMCluster, stream_id: int, **options: object) -> list[bytes]:
    values: list[bytes] = []
    async with Consumer(cluster.pm_address, stream_id, from_offset=0, **options) as consumer:  # type: ignore[arg-type]
        async for record in consumer.records():
            values.append(record.value)
    return values


def sbp(pm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "client.cli", "--pm", pm, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=_child_env(),
        check=False,
    )


@pytest.mark.deadline(90)
async def test_an_idle_follower_that_restarts_learns_the_commit_offset_at_once(
    tmp_path: Path,
) -> None:
    """The primary sends a reconnected follower the commit offset alone
    (SPEC §7); until it has, the follower refuses rather than answers with
    nothing, and a reader that prefers followers reads every record."""
    async with pm_cluster(tmp_path, (1, 2, 3), node_timeout_ms=60_000) as cluster:
        rng = await replicated_stream_of(cluster)
        values = [f"v{i}".encode() for i in range(RECORDS)]
        follower = follower_addresses(rng)[0]
        await trio.sleep(1)  # idle: nothing left to replicate
        await restart(cluster, follower)

        answers: list[str] = []

        async def records_or_refusal() -> list[bytes] | None:
            """What the follower answers: its records, or None for a refusal
            (recorded) or a connection the restart closed (not an answer)."""
            try:
                return await served(cluster, rng, follower)
            except ProtocolError as error:
                answers.append(str(error))
            except (ConnectionClosed, OSError):
                pass
            return None

        got = await eventually(records_or_refusal, until=lambda got: got is not None)
        assert got == values, f"{len(got or [])} records served after a restart"
        # anything but the records was a refusal that says why
        assert all("does not know the commit offset" in a for a in answers), answers
        described = await cluster.node_client(follower).describe_range(rng.stream_id, 0)
        assert (described.next_offset, described.commit_offset) == (RECORDS, RECORDS)

        await restart(cluster, follower)
        with trio.fail_after(30):
            assert await read_all(cluster, rng.stream_id, prefer_followers=True) == values


@pytest.mark.deadline(120)
async def test_a_read_that_cannot_reach_the_records_fails_instead_of_ending(
    tmp_path: Path,
) -> None:
    """The primary dead and both followers restarted (so none knows the
    commit offset, and the PM has not sealed yet): ``sbp read --stats`` and
    the library's consumer fail with a clear error, never report an empty
    stream. Once the PM seals the range, the same read gets every record."""
    async with pm_cluster(tmp_path, (1, 2, 3), node_timeout_ms=60_000) as cluster:
        rng = await replicated_stream_of(cluster)
        await cluster.nodes[node_at(cluster, primary_address(rng))].kill()
        for follower in follower_addresses(rng):
            await restart(cluster, follower)

        result = await trio.to_thread.run_sync(
            sbp, cluster.pm_address, "--timeout", "2", "read", str(rng.stream_id), "--stats"
        )
        assert result.returncode == 1, result.stderr
        assert result.stdout == ""
        [line] = result.stderr.splitlines()
        assert line.startswith(f"sbp: no replica of stream {rng.stream_id} range 0 serves its ")
        assert "does not know the commit offset" in line

        with pytest.raises(SBPError), trio.fail_after(30):
            await read_all(cluster, rng.stream_id, retry_timeout=1.0, request_timeout=1.0)

        # the PM seals the range on the followers' answers: every record is there
        sealed = await cluster.pm_client().seal_ranges(
            [messages.RangeId(stream_id=rng.stream_id, range_index=0)]
        )
        assert sealed[0].error_code == ErrorCode.NONE, sealed[0].error_message
        with trio.fail_after(30):
            assert len(await read_all(cluster, rng.stream_id)) == RECORDS


@pytest.mark.deadline(120)
async def test_a_primary_that_restarts_alone_does_not_take_its_start_for_the_end(
    tmp_path: Path,
) -> None:
    """Both followers down and the primary restarted: it holds every record
    but cannot know which are committed, so it neither serves them nor
    answers as if the stream were empty, and reports its commit offset as
    unknown (-1). A read fails with a clear error; once a follower is back,
    the commit offset is known again and the read gets every record."""
    async with pm_cluster(tmp_path, (1, 2, 3), node_timeout_ms=60_000) as cluster:
        rng = await replicated_stream_of(cluster)
        followers = follower_addresses(rng)
        for follower in followers:
            await cluster.nodes[node_at(cluster, follower)].kill()
        await restart(cluster, primary_address(rng))
        primary = cluster.node_client(primary_address(rng))
        described = await primary.describe_range(rng.stream_id, 0)
        assert (described.next_offset, described.commit_offset) == (RECORDS, -1)

        result = await trio.to_thread.run_sync(
            sbp, cluster.pm_address, "--timeout", "2", "read", str(rng.stream_id), "--stats"
        )
        assert result.returncode == 1, result.stderr
        assert "does not know the commit offset" in result.stderr

        await cluster.start_node(node_at(cluster, followers[0]), "--listen", followers[0])
        with trio.fail_after(30):
            assert len(await read_all(cluster, rng.stream_id)) == RECORDS
        described = await primary.describe_range(rng.stream_id, 0)
        assert described.commit_offset == RECORDS


@pytest.mark.deadline(90)
async def test_an_offset_past_the_end_is_refused_on_every_kind_of_stream(
    tmp_path: Path,
) -> None:
    """``--from`` past the end is OFFSET_OUT_OF_RANGE, exit 1, whether the
    stream has one replica, three, or a sealed range before its open one;
    ``sbp tail`` refuses it too instead of waiting in silence."""
    async with pm_cluster(tmp_path, (1, 2, 3)) as cluster:
        pm = cluster.pm_client()
        single = await pm.create_stream(1)
        assert single.stream is not None
        replicated = await replicated_stream_of(cluster, 100)
        sealed = await replicated_stream_of(cluster, 100)
        [seal] = await pm.seal_ranges([messages.RangeId(stream_id=sealed.stream_id)])
        assert seal.error_code == ErrorCode.NONE
        for stream_id in (single.stream.stream_id, replicated.stream_id, sealed.stream_id):
            for command in ("read", "tail"):
                result = await trio.to_thread.run_sync(
                    sbp, cluster.pm_address, "--timeout", "5", command, str(stream_id),
                    "--from", "99999999",
                )  # fmt: skip
                assert result.returncode == 1, (command, stream_id, result.stderr)
                assert result.stdout == ""
                expected = "0" if stream_id == single.stream.stream_id else "100"
                assert result.stderr.strip() == (
                    "sbp: OFFSET_OUT_OF_RANGE: offset 99999999 is above the next offset "
                    f"{expected} of stream {stream_id}"
                ), (command, stream_id)
        # the end itself is not past it: an empty read, exit 0
        result = await trio.to_thread.run_sync(
            sbp, cluster.pm_address, "read", str(replicated.stream_id), "--from", "100"
        )
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
