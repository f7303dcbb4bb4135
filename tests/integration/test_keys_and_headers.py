"""Records with keys, headers and timestamps (SPEC §4 magic 2, §13) on real
processes: both magics in one stream, stored and served byte for byte; the
client library and ``sbp`` carry keys, headers, record timestamps and
tombstones; a compacted stream takes no record without a key, and one that
holds such records is not turned into one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.consumer import Consumer
from client.producer import Producer
from sbp import messages
from sbp.batches import build_batch, build_records, stamp_base_offset
from sbp.enums import ErrorCode
from sbp.errors import InvalidRequestError

from .pm_cluster import PMCluster, pm_cluster, primary_address
from .procs import _child_env

pytestmark = [pytest.mark.integration, pytest.mark.deadline(120)]


def sbp(pm: str, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "client.cli", "--pm", pm, *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        env=_child_env(),
        check=False,
    )


async def fetch_all(cluster: PMCluster, rng: messages.Range, offset: int = 0) -> bytes:
    """The bytes of every batch from ``offset`` on, as FETCH serves them."""
    node = cluster.node_client(primary_address(rng))
    data = b""
    while True:
        info = messages.FetchInfo(
            stream_id=rng.stream_id, fetch_offset=offset, batch_max_bytes=1 << 20
        )
        async with node.fetch([info]) as results:
            got = b"".join([bytes(fetched.data) async for fetched in results])
        if not got:
            return data
        data += got
        from sbp.batches import batch_spans, peek_header

        start, _ = batch_spans(got)[-1]
        offset = peek_header(got, start).next_offset


async def test_the_library_carries_keys_headers_timestamps_and_tombstones(
    tmp_path: Path,
) -> None:
    async with pm_cluster(tmp_path, (1, 2)) as cluster:
        pm = cluster.pm_client()
        stream_id = (await pm.create_stream(2)).stream.stream_id  # type: ignore[union-attr]
        async with Producer(pm, stream_id, pool=cluster.pool) as producer:
            await producer.send(b"plain")  # magic 1: costs what it always did
            await producer.flush()
            await producer.send(b"v1", key=b"user-1", headers={"trace": b"t-1"}, timestamp=1000)
            await producer.send(None, key=b"user-2")  # a tombstone
            await producer.send_many(
                [b"a", b"b"],
                keys=[b"k", None],
                headers=[[("h", b"1"), ("h", b"2")], None],
                timestamps=[None, 2000],
            )
            await producer.flush()
        async with Consumer(pm, stream_id, pool=cluster.pool) as consumer:
            records = [record async for record in consumer.records()]
        assert [(r.offset, r.value, r.key, r.headers) for r in records] == [
            (0, b"plain", None, ()),
            (1, b"v1", b"user-1", (("trace", b"t-1"),)),
            (2, None, b"user-2", ()),
            (3, b"a", b"k", (("h", b"1"), ("h", b"2"))),
            (4, b"b", None, ()),
        ]
        assert records[1].timestamp == 1000 and records[4].timestamp == 2000
        assert records[2].timestamp == records[3].timestamp > 1_700_000_000_000


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.lists(
                st.tuples(
                    st.one_of(st.none(), st.binary(max_size=30)),
                    st.one_of(st.none(), st.binary(max_size=10)),
                    st.lists(st.tuples(st.text(max_size=5), st.binary(max_size=5)), max_size=2),
                ),
                min_size=1,
                max_size=8,
            ),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_any_batches_of_both_magics_round_trip_byte_for_byte(
    tmp_path_factory: pytest.TempPathFactory, batches: list[tuple[bool, list[tuple]]]
) -> None:
    """APPEND then FETCH gives back each batch as sent, its base offset stamped."""

    async def scenario() -> None:
        async with pm_cluster(tmp_path_factory.mktemp("roundtrip"), (1,)) as cluster:
            created = await cluster.pm_client().create_stream(1)
            assert created.range is not None
            node = cluster.node_client(primary_address(created.range))
            sent = []
            offset = 0
            for plain, records in batches:
                if plain:
                    batch = build_batch([v or b"" for v, _, _ in records], 7)
                else:
                    keys = [k if k is not None or v is not None else b"k" for v, k, _ in records]
                    batch = build_records(
                        [v for v, _, _ in records], 7, keys=keys, headers=[h for *_, h in records]
                    )
                result = await node.append_batch(created.range.stream_id, bytes(batch))
                assert result.base_offset == offset
                stamp_base_offset(batch, offset)
                sent.append(bytes(batch))
                offset += len(records)
            assert await fetch_all(cluster, created.range) == b"".join(sent)

    trio.run(scenario)


async def test_a_compacted_stream_takes_only_keyed_records(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_streams([messages.Stream(replica_nums=1, cleanup_policy=1)])
        assert created[0].error_code == ErrorCode.NONE and created[0].range is not None
        rng = created[0].range
        assert created[0].stream is not None and created[0].stream.cleanup_policy == 1
        node = cluster.node_client(primary_address(rng))
        keyed = build_records([b"v", None], 1, keys=[b"a", b"b"])
        assert (await node.append_batch(rng.stream_id, bytes(keyed))).base_offset == 0
        for keyless in (build_batch([b"x"], 1), build_records([b"y", b"z"], 1, keys=[b"a", None])):
            [refused] = await node.append([(rng.stream_id, bytes(keyless))])
            assert refused.error_code == ErrorCode.INVALID_RECORD_BATCH
            assert "every record needs a key" in refused.error_message
        assert len(await fetch_all(cluster, rng)) == len(keyed)

        # a stream that holds a record without a key is not made compacted
        plain = await pm.create_stream(1)
        assert plain.range is not None and plain.stream is not None
        await cluster.node_client(primary_address(plain.range)).append_batch(
            plain.stream.stream_id, bytes(build_batch([b"old"], 1))
        )
        with pytest.raises(InvalidRequestError, match="holds records without keys"):
            await pm.update_stream(
                messages.Stream(stream_id=plain.stream.stream_id, replica_nums=1, cleanup_policy=1)
            )
        assert (await pm.get_stream(plain.stream.stream_id)).cleanup_policy == 0
        # ... and an empty one is; bad settings are refused
        empty = await pm.create_stream(1)
        assert empty.stream is not None
        changed = await pm.update_stream(
            messages.Stream(stream_id=empty.stream.stream_id, cleanup_policy=2)
        )
        assert changed.cleanup_policy == 2
        for bad in (
            messages.Stream(replica_nums=1, cleanup_policy=3),
            messages.Stream(replica_nums=1, min_compaction_lag_ms=-1),
            messages.Stream(replica_nums=1, cleanup_policy=1, local_retention_ms=0),
            messages.Stream(replica_nums=1, local_retention_ms=60_000),  # no object store
            messages.Stream(replica_nums=1, table_interval_ms=50),
        ):
            [result] = await pm.create_streams([bad])
            assert result.error_code == ErrorCode.INVALID_REQUEST, bad


async def test_sbp_appends_and_reads_keys_and_headers(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:
        pm = cluster.pm_address

        def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
            return sbp(pm, *args, stdin=stdin)

        created = await trio.to_thread.run_sync(
            lambda: run("--json", "streams", "create", "--compact")
        )
        stream = str(json.loads(created.stdout)[0]["stream"]["stream_id"])
        shown = await trio.to_thread.run_sync(lambda: run("streams", "get", stream))
        assert b"compact" in shown.stdout
        appended = await trio.to_thread.run_sync(
            lambda: run(
                "append",
                stream,
                "--key-separator",
                "TAB",
                "--header",
                "src=cli",
                stdin=b"user-1\tclicked\nuser-2\tviewed\n",
            )
        )
        assert appended.returncode == 0, appended.stderr
        keyless = await trio.to_thread.run_sync(lambda: run("append", stream, stdin=b"no key\n"))
        assert keyless.returncode == 1 and b"every record needs a key" in keyless.stderr
        lines = (
            b'{"key": "user-3", "value": "bought", '
            b'"headers": [["src", "json"], ["src", {"base64": "/w=="}]]}\n'
            b'{"key_base64": "/w==", "value": null, "timestamp_ms": 5000}\n'
        )
        from_json = await trio.to_thread.run_sync(
            lambda: run("append", stream, "--input", "json", stdin=lines)
        )
        assert from_json.returncode == 0, from_json.stderr
        bad_json = await trio.to_thread.run_sync(
            lambda: run("append", stream, "--input", "json", stdin=b'{"key": "k"}\n')
        )
        assert bad_json.returncode == 2 and b"line 1: no value" in bad_json.stderr

        read = await trio.to_thread.run_sync(lambda: run("read", stream, "--keys", "--headers"))
        assert read.stdout.decode().splitlines() == [
            "src=cli\tuser-1\tclicked",
            "src=cli\tuser-2\tviewed",
            "src=json,src=\\xff\tuser-3\tbought",
            "\t\\xff\t",
        ]
        as_json = await trio.to_thread.run_sync(lambda: run("--json", "read", stream))
        records = [json.loads(line) for line in as_json.stdout.splitlines()]
        assert records[0]["key"] == "user-1" and records[0]["headers"] == [["src", "cli"]]
        assert records[2]["headers"] == [["src", "json"], ["src", {"base64": "/w=="}]]
        assert records[3] == {
            "offset": 3,
            "timestamp_ms": 5000,
            "value": None,
            "key_base64": "/w==",
        }
        # what read --json prints, append --input json takes back
        copy = await trio.to_thread.run_sync(
            lambda: run("--json", "streams", "create", "--compact")
        )
        other = str(json.loads(copy.stdout)[0]["stream"]["stream_id"])
        again = await trio.to_thread.run_sync(
            lambda: run("append", other, "--input", "json", stdin=as_json.stdout)
        )
        assert again.returncode == 0, again.stderr
        reread = await trio.to_thread.run_sync(lambda: run("--json", "read", other))
        assert [json.loads(line) for line in reread.stdout.splitlines()] == records
