"""A run's report: ``chaos.json`` (everything), ``chaos.md`` (what a person
reads first: the verdict, the counts, the schedule) and ``chaos.png``
(throughput and errors per second, faults shaded)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.machine import machine_info, versions
from bench.report import table

from . import checker
from .run import RunResult, replay_command

#: shading of each fault kind on the timeline
COLOURS = {
    "kill": "tab:red",
    "pause": "tab:orange",
    "partition-node-pm": "tab:purple",
    "isolate-node": "tab:brown",
    "partition-clients-pm": "tab:pink",
    "slow-link": "tab:olive",
    "corrupt-link": "tab:cyan",
}


def document(result: RunResult) -> dict[str, Any]:
    settings = result.settings
    verdict = result.verdict
    ends = [o.done_at for o in result.history.outcomes] or [settings.duration_s]
    seconds = int(max(ends)) + 1
    return {
        "verdict": "pass" if verdict.ok else "FAIL",
        "seed": settings.seed,
        "settings": {
            "duration_s": settings.duration_s,
            "nodes": settings.nodes,
            "fault_kinds": list(settings.kinds),
            "small_map_node": settings.small_map_node,
            "workload": asdict(settings.workload),
        },
        "elapsed_s": round(result.elapsed_s, 1),
        "outcomes": result.history.counts(),
        "streams": len(result.history.streams),
        "stored_records": verdict.stored_records,
        "observed_by_consumers": sum(len(v) for v in result.history.observed.values()),
        "unknown_stored": verdict.unknown_stored,
        "unknown_missing": verdict.unknown_missing,
        "allowed_duplicates": verdict.allowed_duplicates,
        "table_rows": result.table_rows,
        "offloaded_ranges": sum(stream.offloaded_ranges for stream in result.stored),
        "violations": {kind: verdict.violations.get(kind, 0) for kind in checker.KINDS},
        "examples": dict(verdict.examples),
        "read_errors": verdict.read_errors,
        "server_tracebacks": result.tracebacks,
        "faults": result.history.fault_json(),
        "operations": [
            {"at": round(at, 2), "what": what, "stream": stream, "result": res}
            for at, what, stream, res in result.history.operations
        ],
        "timeline": result.history.timeline(seconds),
        "machine": machine_info(),
        "versions": versions(),
    }


def markdown(result: RunResult, doc: dict[str, Any]) -> str:
    outcomes = doc["outcomes"]
    operations: dict[str, int] = {}
    for op in doc["operations"]:
        operations[op["what"]] = operations.get(op["what"], 0) + 1
    lines = [
        f"# Chaos run: {doc['verdict']}",
        "",
        f"Seed {doc['seed']}, {doc['settings']['duration_s']:.0f} s of faults on a PM and "
        f"{doc['settings']['nodes']} data nodes ({doc['elapsed_s']:.0f} s in all). "
        f"Replay: `{replay_command(result.settings)}`.",
        "",
        "## What the workload did",
        "",
        table(
            ["values sent", "acknowledged", "unknown", "failed", "sent again"],
            [
                [
                    sum(outcomes[k] for k in ("ack", "unknown", "failed")),
                    outcomes["ack"],
                    outcomes["unknown"],
                    outcomes["failed"],
                    outcomes["retried"],
                ]
            ],
            "rrrrr",
        ),
        "",
        f"{doc['streams']} streams; {doc['stored_records']:,} records stored at the end; "
        f"{doc['observed_by_consumers']:,} records handed to tailing consumers. "
        f"Of the values with an unknown outcome, {doc['unknown_stored']:,} were stored and "
        f"{doc['unknown_missing']:,} were not. Duplicates of values sent again: "
        f"{doc['allowed_duplicates']:,}. Side operations: "
        + (", ".join(f"{n} {what}" for what, n in sorted(operations.items())) or "none")
        + "."
        + (
            f" The streams' Iceberg tables held {doc['table_rows']:,} rows at the end."
            if doc["table_rows"] is not None
            else ""
        )
        + (
            f" {doc['offloaded_ranges']:,} ranges were in the object store only, read from there."
            if doc["offloaded_ranges"]
            else ""
        ),
        "",
        "## Violations",
        "",
        table(["check", "found"], [[k, v] for k, v in doc["violations"].items()], "lr"),
        "",
    ]
    for kind, examples in doc["examples"].items():
        lines += [f"{kind}:", "", *(f"- {e}" for e in examples), ""]
    if doc["read_errors"]:
        lines += ["Streams that could not be read back:", ""]
        lines += [f"- {e}" for e in doc["read_errors"]] + [""]
    tracebacks = {k: v for k, v in doc["server_tracebacks"].items() if v}
    lines += [
        "Tracebacks in server logs: "
        + (", ".join(f"{k}: {v}" for k, v in tracebacks.items()) if tracebacks else "none"),
        "",
        "## Faults",
        "",
        table(
            ["start s", "end s", "fault", "target", "note"],
            [[f["start"], f["end"], f["kind"], f["target"], f["detail"]] for f in doc["faults"]],
            "rrlll",
        ),
        "",
        "![timeline](chaos.png)",
        "",
    ]
    return "\n".join(lines)


def plot(result: RunResult, doc: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    timeline = doc["timeline"]
    figure = Figure(figsize=(11, 4))
    axes = figure.add_subplot()
    seconds = list(range(len(timeline["acks"])))
    axes.plot(seconds, timeline["acks"], label="acknowledged / s", color="tab:green")
    axes.plot(seconds, timeline["errors"], label="failed or unknown / s", color="tab:red")
    seen: set[str] = set()
    for fault in doc["faults"]:
        kind = fault["kind"]
        axes.axvspan(
            fault["start"],
            max(fault["end"], fault["start"] + 0.3),
            color=COLOURS.get(kind, "grey"),
            alpha=0.2,
            label=None if kind in seen else kind,
        )
        seen.add(kind)
    axes.set_xlabel("seconds into the run")
    axes.set_ylabel("values per second")
    axes.set_title(f"chaos run, seed {doc['seed']}: {doc['verdict']}")
    axes.legend(loc="upper right", fontsize="small", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def write(result: RunResult, out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = document(result)
    (out_dir / "chaos.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out_dir / "chaos.md").write_text(markdown(result, doc))
    plot(result, doc, out_dir / "chaos.png")
    return doc


def summary_line(doc: dict[str, Any]) -> str:
    found = sum(doc["violations"].values())
    return (
        f"chaos: {doc['verdict']}: {doc['outcomes']['ack']:,} acknowledged, "
        f"{len(doc['faults'])} faults, {found} violations"
        + (f", {len(doc['read_errors'])} streams unreadable" if doc["read_errors"] else "")
    )


def write_verdict(name: str, result: dict[str, Any], out_dir: Path, summary: str) -> int:
    """Write a fuzz or crowd result as ``<name>.json``, print its summary line
    and failures; the exit status (0 on a pass)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{name}: {result['verdict']}: {summary}")
    for failure in result["failures"]:
        print(f"  FAILED: {failure}")
    return 0 if result["verdict"] == "pass" else 1
