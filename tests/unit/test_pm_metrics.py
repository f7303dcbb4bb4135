"""The PM's names for REPORT_METRICS fields follow Prometheus' conventions."""

from __future__ import annotations

import re

from pm.metrics import REPORTED
from pm.wire import REPORT_FIELDS

#: suffixes of base units (and of rates of them) Prometheus' conventions name
UNIT_SUFFIXES = ("_bytes", "_seconds", "_per_second", "_ranges", "_appends")


def test_every_reported_field_has_a_well_named_metric() -> None:
    assert sorted(field for field, *_ in REPORTED) == sorted(REPORT_FIELDS)
    for field, name, _, scale in REPORTED:
        assert re.fullmatch(r"[a-z_]+", name)
        assert name.endswith(UNIT_SUFFIXES), name
        assert not any(word in name for word in ("uring", "avg", "_cnt", "_rate")), name
        # the wire's milliseconds become seconds
        assert scale == (0.001 if field.endswith("avg_latency") else 1), field
