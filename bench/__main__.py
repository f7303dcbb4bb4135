"""The benchmark suite: ``python -m bench <scenario> [--quick] [--out DIR]``.

Each scenario starts what it needs (a local cluster with one data node, the
peer servers), runs, and writes ``<scenario>.json``, ``.md`` and ``.png`` into
the output directory (default ``docs/benchmarks/``). ``all`` runs every
scenario in turn. ``--quick`` shrinks every measurement so that a scenario
runs in well under a minute; its numbers only check the harness.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import report
from bench.peers.servers import ServerNotInstalled
from bench.scenarios import append, catch_up, latency, pm_ha, replication, spark, tail, tls
from bench.scenarios.options import Options
from sbp.allocator import keep_freed_memory

SCENARIOS: dict[str, Callable[[Options], report.ScenarioResult]] = {
    append.NAME: append.run,
    tail.NAME: tail.run,
    latency.NAME: latency.run,
    catch_up.NAME: catch_up.run,
    spark.NAME: spark.run,
    replication.NAME: replication.run,
    tls.NAME: tls.run,
    pm_ha.NAME: pm_ha.run,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "scenario",
        choices=[*SCENARIOS, "all", "chaos"],
        help="a benchmark, all of them, or chaos (the fault-injection harness: "
        "python -m bench chaos --help)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (under a minute each)")
    parser.add_argument(
        "--out",
        type=Path,
        default=report.DEFAULT_OUT,
        help=f"where the results go (default: {report.DEFAULT_OUT})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["chaos"]:
        # the fault-injection harness has options of its own
        from bench.chaos import cli

        signal.signal(signal.SIGTERM, signal.default_int_handler)
        return cli.main(argv[1:])
    args = build_parser().parse_args(argv)
    # the benchmark process is the client of every system, as `sbp` would be
    keep_freed_memory()
    # SIGTERM unwinds like Ctrl-C, so that the servers started (in sessions of
    # their own, out of reach of the terminal's signals) are stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for name in names:
        scratch = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        started = time.perf_counter()
        print(f"bench {name}{' --quick' if args.quick else ''} …", flush=True)
        try:
            result = SCENARIOS[name](Options(quick=args.quick, scratch=scratch))
        except ServerNotInstalled as missing:
            print(
                f"bench {name}: {missing}; `make system-deps` installs the peer servers",
                file=sys.stderr,
            )
            return 2
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        report.write(result, args.out, args.quick)
        print(
            f"bench {name}: done in {time.perf_counter() - started:.0f} s -> "
            f"{args.out / (name + '.md')}",
            flush=True,
        )
        for target in result.targets:
            verdict = "met" if target.met else "MISSED"
            print(f"  {verdict:>6}: {target.name}: {target.value:,.2f} {target.unit}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
