"""Writing a scenario's result: ``<name>.json`` (everything measured, with
the machine, versions and settings), ``<name>.md`` (the tables) and
``<name>.png`` (the plot), all into one output directory."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display

from matplotlib.figure import Figure

from bench.harness import Measurement
from bench.machine import machine_info, versions

#: the default output directory, committed with the docs
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


@dataclass
class Target:
    """A goal of the suite, measured: ``value`` against ``goal``."""

    name: str
    value: float
    goal: float
    unit: str
    higher_is_better: bool = True
    note: str = ""

    @property
    def met(self) -> bool:
        return self.value >= self.goal if self.higher_is_better else self.value < self.goal

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": round(self.value, 4),
            "goal": self.goal,
            "unit": self.unit,
            "met": self.met,
            "note": self.note,
        }


@dataclass
class ScenarioResult:
    """What a scenario hands the report writer."""

    name: str
    title: str
    settings: dict[str, Any]
    measurements: list[Measurement] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)  # markdown sections
    plot: Callable[[Figure], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, l or r (default: l, then r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def number(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def document(result: ScenarioResult, quick: bool) -> dict[str, Any]:
    return {
        "scenario": result.name,
        "title": result.title,
        "quick": quick,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": versions(),
        "settings": result.settings,
        "results": [m.to_json() for m in result.measurements],
        "targets": [t.to_json() for t in result.targets],
        **result.extra,
    }


def markdown(result: ScenarioResult, doc: dict[str, Any]) -> str:
    machine, vers = doc["machine"], doc["versions"]
    lines = [
        f"# {result.title}",
        "",
        f"Measured {doc['measured_at']}{' (--quick)' if doc['quick'] else ''} on "
        f"{machine['cpu_model']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"Linux {machine['kernel']} (load average at start {machine['load_average'][0]}).",
        "",
        "Versions: " + ", ".join(f"{name} {version}" for name, version in vers.items()) + ".",
        "",
        "Settings: " + ", ".join(f"{k} = {v}" for k, v in result.settings.items()) + ".",
        "",
    ]
    if result.targets:
        lines += [
            "## Targets",
            "",
            table(
                ["target", "measured", "goal", "met"],
                [
                    (
                        t.name,
                        f"{t.value:,.2f} {t.unit}",
                        f"{'≥' if t.higher_is_better else '<'} {t.goal:,} {t.unit}",
                        "yes" if t.met else "**no**",
                    )
                    for t in result.targets
                ],
                "lrrl",
            ),
            "",
        ]
    for section in result.tables:
        lines += [section, ""]
    if result.plot is not None:
        lines += [f"![{result.title}]({result.name}.png)", ""]
    return "\n".join(lines)


def write(result: ScenarioResult, out_dir: Path, quick: bool) -> dict[str, Any]:
    """Write the JSON, markdown and PNG of one scenario; returns the JSON document."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = document(result, quick)
    (out_dir / f"{result.name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / f"{result.name}.md").write_text(markdown(result, doc))
    if result.plot is not None:
        figure = Figure(figsize=(11, 5), layout="constrained")
        result.plot(figure)
        figure.savefig(out_dir / f"{result.name}.png", dpi=100)
    return doc
