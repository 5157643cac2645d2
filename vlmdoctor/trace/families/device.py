"""The device: its name and compute capability (8.9 and up have FP8 tensor cores)."""

from __future__ import annotations

from typing import Any

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading

PRODUCES = by_producer(__name__)


def produce(r: Reading, facts: dict[str, Any]) -> None:
    """The GPU's compute capability (8.9 and up have FP8 tensor cores): the profiler's deviceProperties, else
    the environment vlmdoctor recorded with the run."""
    props = r.t.meta.get("deviceProperties") or []
    if props and isinstance(props[0], dict) and props[0].get("totalGlobalMem"):
        facts["device.name"] = props[0].get("name")
    major, minor = (
        (props[0].get("computeMajor"), props[0].get("computeMinor"))
        if props and isinstance(props[0], dict)
        else (None, None)
    )
    if isinstance(major, int) and isinstance(minor, int) and major > 0:
        facts["device.compute_capability"] = major + minor / 10
        return
    cc = env_capability(r.vmeta)
    if cc is not None:
        facts["device.compute_capability"] = cc


def env_capability(meta: dict[str, Any]) -> float | None:
    """The compute capability vlmdoctor recorded with a run (run/envinfo.py: "9.0"), if any."""
    env = meta.get("env") if isinstance(meta.get("env"), dict) else {}
    try:
        return float(str(env["compute_capability"]))
    except (KeyError, ValueError):
        return None
