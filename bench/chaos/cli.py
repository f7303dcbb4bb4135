"""``python -m bench chaos``: fault injection against a live cluster.

Modes:

- ``faults`` (the default): a PM and data nodes behind proxies, a workload
  of producers, tailing consumers, seals, trims and new streams, and a
  seeded schedule of kills, pauses, partitions and broken links; then
  every stream is read back and checked. Exit status 1 on any violation.
- ``fuzz``: mutated frames against a live data node and PM; then the
  servers must answer, serve correct data, hold their memory and log no
  traceback. Exit status 1 otherwise.
- ``crowd``: many busy connections, many idle ones and slow readers against
  one data node, while a probe client measures its latency. Exit status 1
  when memory or the probe's p99 runs past its bound.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import trio

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "reliability"


def build_parser() -> argparse.ArgumentParser:
    from .faults import KINDS

    parser = argparse.ArgumentParser(
        prog="python -m bench chaos",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Modes: faults (default), fuzz, crowd; see docs/reliability.md.",
    )
    parser.add_argument("--mode", choices=["faults", "fuzz", "crowd"], default="faults")
    parser.add_argument(
        "--seed", type=int, help="replay a run: the same schedule of faults (default: random)"
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, metavar="S", help="seconds of faults (default: 60)"
    )
    parser.add_argument("--nodes", type=int, default=3, help="data nodes (default: 3)")
    parser.add_argument(
        "--faults",
        default=",".join(KINDS),
        metavar="KINDS",
        help=f"comma-separated fault kinds (default: all: {','.join(KINDS)})",
    )
    parser.add_argument(
        "--producers", type=int, default=3, help="streams written at once (default: 3)"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="replicas of each stream (default: 1)"
    )
    parser.add_argument(
        "--compacted-keys",
        type=int,
        default=0,
        metavar="N",
        help="compacted streams (SPEC §13) whose values have N keys; the PM compacts every "
        "second, and a value may then go once a later one of its key is stored "
        "(default: 0, plain streams)",
    )
    parser.add_argument(
        "--tables",
        action="store_true",
        help="streams kept as Iceberg tables by sbp-tables (SPEC §16), which is killed and "
        "paused as the servers are; each table is checked against its stream at the end",
    )
    parser.add_argument(
        "--tiered",
        action="store_true",
        help="tiered streams (SPEC §14): an object store (weed mini) runs too, sealed ranges "
        "go there and leave the nodes at once, and the store is killed, paused and slowed "
        "as the servers are; reads of its ranges must lose nothing",
    )
    parser.add_argument(
        "--repair-after-ms",
        type=int,
        metavar="MS",
        help="the PM replaces a node dead this long in its ranges (a repair; default: the "
        "PM's own, 10 minutes): with a few seconds, long pauses and isolations end in "
        "repairs, and the node's return in its copies being dropped",
    )
    parser.add_argument(
        "--at-least-once",
        action="store_true",
        help="producers without idempotence: a value sent again may be stored twice "
        "(counted, not a violation); by default any value stored twice is one",
    )
    parser.add_argument(
        "--small-map-node",
        default="node-3",
        metavar="NAME",
        help="a node with a small LMDB map that fills up ('' for none; default: node-3)",
    )
    parser.add_argument(
        "--frames", type=int, default=1_000_000, help="fuzz: mutated frames (default: 1,000,000)"
    )
    parser.add_argument(
        "--memory-tolerance",
        type=float,
        default=10.0,
        metavar="PERCENT",
        help="fuzz: how much the servers' memory may grow (default: 10; short runs are noisier)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"where the report goes (default: {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the cluster's data and logs after the run"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1, 1 << 31)
    root = Path(tempfile.mkdtemp(prefix=f"chaos-{args.mode}-"))
    try:
        if args.mode == "faults":
            return _faults(args, seed, root)
        if args.mode == "fuzz":
            from . import fuzz

            tolerance = args.memory_tolerance / 100
            return trio.run(fuzz.main, seed, args.frames, root, args.out, tolerance)
        from . import crowd

        return trio.run(crowd.main, root, args.out)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"data and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _faults(args: argparse.Namespace, seed: int, root: Path) -> int:
    from . import report
    from .faults import KINDS
    from .run import RunSettings, plan, replay_command, run
    from .workload import WorkloadSettings

    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"chaos: unknown fault kind {unknown[0]!r} (see --help)", file=sys.stderr)
        return 2
    if args.nodes < 1 or args.duration < 10:
        print("chaos: at least one node and 10 seconds are needed", file=sys.stderr)
        return 2
    small = args.small_map_node or None
    if small is not None and small not in {f"node-{i}" for i in range(1, args.nodes + 1)}:
        small = None
    settings = RunSettings(
        seed=seed,
        duration_s=args.duration,
        nodes=args.nodes,
        kinds=kinds,
        small_map_node=small,
        workload=WorkloadSettings(
            producers=args.producers,
            replicas=args.replicas,
            idempotent=not args.at_least_once,
            compacted_keys=max(args.compacted_keys, 0),
            tables=args.tables,
            tiered=args.tiered,
        ),
        repair_after_ms=args.repair_after_ms,
    )
    schedule = plan(settings)
    print(f"chaos: seed {seed}, {args.duration:.0f} s, {len(schedule)} faults scheduled:")
    for fault in schedule:
        print(f"  {fault.describe()}")
    print(f"replay with: {replay_command(settings)}")
    result = trio.run(run, settings, root)
    doc = report.write(result, args.out)
    print(report.summary_line(doc))
    print(f"report: {args.out / 'chaos.md'}")
    return 0 if result.verdict.ok else 1
