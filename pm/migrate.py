"""``sbp-pm migrate --from-data-dir DIR --etcd URL,...``: copy an LMDB PM's
metadata into etcd, so that a cluster that outgrew one PM keeps its streams
when it moves to PMs on etcd (SPEC §8).

What is copied: every stream, every range (sealed ends, replicas, epochs),
every data node, and the next stream id, so that no id is handed out twice.
It refuses, changing nothing, when the LMDB directory is in use by a running
PM, when etcd already holds metadata under the prefix, or when a PM leads
there; the writes themselves are guarded by "no PM leads", so a PM started
on etcd meanwhile makes the migration fail rather than mix with it.
"""

from __future__ import annotations

import argparse
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from net.dirlock import locked_dir
from net.service import UsageError, run_main
from sbp.constants import MAX_GROUP_COMMIT_ITEMS
from sbp.errors import NotLeaderError, RequestTimeoutError

from .changes import (
    Change,
    MarkForeignStream,
    PutGroupOffsets,
    PutMember,
    PutMove,
    PutNode,
    PutProducer,
    PutRange,
    PutStream,
    RaiseNextProducerId,
    RaiseNextStreamId,
    SetDraining,
)
from .config import EtcdTLS, parse_etcd_endpoints
from .etcd import Etcd, EtcdError, version_is
from .etcd_metadata import EtcdMetadataStore
from .metadata import MetadataError, MetadataStore
from .server import LOCK_FILE

PROG = "sbp-pm migrate"
PAGE = 1000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Copy an LMDB PM's metadata (streams, ranges, data nodes, the next "
        "stream id) into etcd, for PMs on etcd (SPEC §8). Changes nothing when the "
        "directory is in use, the prefix already holds keys, or a PM leads there.",
    )
    parser.add_argument(
        "--from-data-dir", type=Path, required=True, metavar="DIR", help="the LMDB PM's directory"
    )
    parser.add_argument(
        "--etcd", required=True, metavar="URL[,URL...]", help="the etcd cluster's client URLs"
    )
    parser.add_argument(
        "--etcd-prefix", default="/sbp/", metavar="PREFIX", help="key prefix (default: /sbp/)"
    )
    parser.add_argument("--etcd-ca", type=Path, metavar="FILE", help="etcd's CA (https:// URLs)")
    parser.add_argument("--etcd-cert", type=Path, metavar="FILE", help="a client certificate")
    parser.add_argument("--etcd-key", type=Path, metavar="FILE", help="its private key")
    return parser


def main(argv: Sequence[str]) -> int:
    def body() -> int:
        args = build_parser().parse_args(argv)
        try:
            endpoints = parse_etcd_endpoints(args.etcd)
        except ValueError as error:
            raise UsageError(f"--etcd: {error}") from None
        if (args.etcd_cert is None) != (args.etcd_key is None):
            raise UsageError("--etcd-cert and --etcd-key go together")
        tls = None
        if args.etcd_ca or args.etcd_cert:
            tls = EtcdTLS(args.etcd_ca, args.etcd_cert, args.etcd_key).context()
        copied = trio.run(migrate, args.from_data_dir, endpoints, args.etcd_prefix.encode(), tls)
        streams, ranges, nodes = copied
        print(
            f"copied {streams:,} streams, {ranges:,} ranges and {nodes:,} data nodes "
            f"into etcd under {args.etcd_prefix}"
        )
        return 0

    return run_main(PROG, body)


async def migrate(
    data_dir: Path,
    endpoints: Sequence[str],
    prefix: bytes,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, int, int]:
    """Copy the metadata; (streams, ranges, nodes) copied."""
    if not (data_dir / "data.mdb").is_file():
        raise UsageError(f"{data_dir} holds no PM metadata (no data.mdb)")
    with locked_dir(data_dir, LOCK_FILE, "PM"):
        try:
            source = MetadataStore(data_dir)
        except MetadataError as error:
            raise UsageError(str(error)) from None
        try:
            changes = _everything(source)
        finally:
            source.close()
    leader_key = prefix + b"leader"
    async with Etcd(endpoints, tls=tls) as etcd:
        try:
            held, _ = await etcd.get_prefix(prefix)
            if held:
                raise UsageError(
                    f"etcd already holds {len(held)} keys under {prefix.decode()}: "
                    "migrate into an empty prefix (or choose another with --etcd-prefix)"
                )
            target = EtcdMetadataStore(etcd, prefix, lambda: [version_is(leader_key, 0)])
            await target.commit(changes)
        except NotLeaderError:
            raise UsageError(
                "a PM started leading on this etcd during the migration: stop it, "
                "delete the prefix and migrate again"
            ) from None
        except (EtcdError, RequestTimeoutError) as error:
            raise UsageError(f"etcd: {error}") from None
        counts = target.counts()
    return counts.streams, counts.ranges, counts.nodes


def _everything(source: MetadataStore) -> list[Change]:
    changes: list[Change] = [PutNode(node) for node in source.nodes()]
    changes += [SetDraining(node_id, True) for node_id in sorted(source.draining_nodes())]
    changes.append(RaiseNextStreamId(source.next_stream_id()))
    changes += [MarkForeignStream(stream_id) for stream_id in sorted(source.foreign_streams())]
    changes.append(RaiseNextProducerId(source.next_producer_id()))
    changes += [PutProducer(producer) for producer in source.producers()]
    start_after = 0
    while page := source.streams(start_after=start_after, limit=PAGE):
        for stream in page:
            changes.append(PutStream(stream))
            changes += [PutRange(rng) for rng in source.ranges(stream.stream_id)]
        start_after = page[-1].stream_id
    changes += [PutMove(move) for move in source.moves()]
    positions = source.all_group_offsets()
    changes += [
        PutGroupOffsets(tuple(positions[i : i + MAX_GROUP_COMMIT_ITEMS]))
        for i in range(0, len(positions), MAX_GROUP_COMMIT_ITEMS)
    ]
    changes += [PutMember(member) for member in source.all_members()]
    return changes


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
