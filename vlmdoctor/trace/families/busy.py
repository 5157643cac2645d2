"""GPU busy and idle time: the union of every kernel, copy and memset inside the steps."""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading
from vlmdoctor.trace.intervals import _measure, total

PRODUCES = by_producer(__name__)


def produce(r: Reading, facts: dict[str, Any]) -> None:
    ws, we = np.array([s for s, _ in r.windows]), np.array([e for _, e in r.windows])
    busy, n = r.busy, r.n
    facts["gpu.busy_ms"] = total(busy) / 1e3 / n
    facts["gpu.busy_ms_list"] = [round(x, 3) for x in ((_measure(busy, we) - _measure(busy, ws)) / 1e3).tolist()]
    facts["gpu.idle_ms"] = total(r.idle) / 1e3 / n
    facts["gpu.busy_frac"] = total(busy) / max(total(r.span), 1e-9)
