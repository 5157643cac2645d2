"""Copies: bytes and time by direction, and the copies from pageable (unpinned) host memory."""

from __future__ import annotations

from typing import Any

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading
from vlmdoctor.trace.kernels import memcpy_direction

PRODUCES = by_producer(__name__)
#: (bytes, ms) of each direction trace/kernels.py's memcpy_direction names
DIRECTION_FACTS = {
    "HtoD": ("memcpy.HtoD.bytes", "memcpy.HtoD.ms"),
    "DtoH": ("memcpy.DtoH.bytes", "memcpy.DtoH.ms"),
    "DtoD": ("memcpy.DtoD.bytes", "memcpy.DtoD.ms"),
    "HtoH": ("memcpy.HtoH.bytes", "memcpy.HtoH.ms"),
    "PtoP": ("memcpy.PtoP.bytes", "memcpy.PtoP.ms"),
    "other": ("memcpy.other.bytes", "memcpy.other.ms"),
}


def produce(r: Reading, facts: dict[str, Any]) -> None:
    g, n = r.t.gpu, r.n
    mc = g[g["cat"] == "gpu_memcpy"]
    for direction, grp in mc.groupby(mc["name"].map(memcpy_direction)):
        nbytes, ms = DIRECTION_FACTS.get(direction) or (f"memcpy.{direction}.bytes", f"memcpy.{direction}.ms")
        facts[nbytes] = float(grp["bytes"].sum()) / n
        facts[ms] = float(grp["dur"].sum()) / 1e3 / n
    facts["memcpy.pageable_count"] = int(mc["name"].str.contains("Pageable").sum()) / n
