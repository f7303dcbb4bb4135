"""The settings every scenario runs with: full size or ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.harness import Load

#: the concurrency of the comparisons; the sweep covers the others
DEFAULT_IN_FLIGHT = 64
SWEEP_IN_FLIGHT = (1, 4, 16, 64)


@dataclass(frozen=True)
class Options:
    """``quick`` shrinks every measurement so that a scenario runs in well
    under a minute (its numbers are only good for checking the harness)."""

    quick: bool
    scratch: Path  # temporary data of the servers and the raw limits

    @property
    def seconds(self) -> float:
        """The measured window of one throughput run."""
        return 0.3 if self.quick else 3.0

    @property
    def warmup(self) -> float:
        return 0.1 if self.quick else 0.5

    def load(self, in_flight: int = DEFAULT_IN_FLIGHT) -> Load:
        return Load(in_flight, self.seconds, self.warmup)

    def as_settings(self) -> dict[str, object]:
        return {
            "quick": self.quick,
            "window_s": self.seconds,
            "warmup_s": self.warmup,
            "in_flight": DEFAULT_IN_FLIGHT,
            "in_flight_sweep": list(SWEEP_IN_FLIGHT),
        }
