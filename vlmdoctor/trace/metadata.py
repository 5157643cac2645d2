"""A trace's top-level metadata, type-checked before any fact reads it.

Kineto writes `deviceProperties`, `distributedInfo` and `host_name` before the events; vlmdoctor's own
runs add a `vlmdoctor` block (the run config, the model, the environment, the timed window's metrics).
The fact families read these with plain lookups and arithmetic, so a hand-edited or foreign trace with a
string where an object belongs, or a number no machine holds, is refused here with the field named
(exit 2), never met later as an internal error. Keys vlmdoctor does not read are not checked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec

from vlmdoctor.trace.read import TraceError

Number = int | float


class _Device(msgspec.Struct):
    name: str | None = None
    totalGlobalMem: Number | None = None  # noqa: N815 (Kineto's spelling)
    computeMajor: int | None = None  # noqa: N815
    computeMinor: int | None = None  # noqa: N815


class _Distributed(msgspec.Struct):
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None


class _Env(msgspec.Struct):
    compute_capability: str | Number | None = None
    cpu_capability: str | None = None
    cpu_matmul_gflops: dict[str, Any] | None = None  # each value checked by _numbers, by name


class _Model(msgspec.Struct):
    params: dict[str, Any] | None = None


class _Vlmdoctor(msgspec.Struct):
    config: dict[str, Any] | None = None
    env: _Env | None = None
    model: _Model | None = None
    metrics: dict[str, Any] | None = None  # each value checked by _numbers, by name


class _Meta(msgspec.Struct):
    vlmdoctor: _Vlmdoctor | None = None
    deviceProperties: list[_Device] | None = None  # noqa: N815
    distributedInfo: _Distributed | None = None  # noqa: N815
    host_name: str | None = None


def check_metadata(meta: dict[str, Any], path: Path) -> None:
    """Refuse (TraceError, exit 2) metadata whose fields the facts read have another type than Kineto and
    vlmdoctor write: an object, a list, a string, a finite number of at most 64 bits, a computed knob's type."""
    try:
        msgspec.convert(meta, _Meta, strict=True)
    except msgspec.ValidationError as e:
        raise TraceError(f"{path}: the trace's metadata is not as torch.profiler writes it: {_where(e)}") from None
    for where, v in _numbers(meta):
        if not (v is None or isinstance(v, (bool, int, float))):
            raise TraceError(f"{path}: the trace's metadata has a {type(v).__name__} at {where}, not a number")
        if not _sane(v):
            raise TraceError(f"{path}: the trace's metadata holds a number out of range at {where}")
    config = (meta.get("vlmdoctor") or {}).get("config")
    if config:
        _check_knobs(config, path)


def _where(e: msgspec.ValidationError) -> str:
    text = str(e)
    what, _, at = text.partition(" - at `$")
    return f"{what} at {at.rstrip('`').lstrip('.')}" if at else text


def _numbers(meta: dict[str, Any]) -> list[tuple[str, Any]]:
    """The numbers the facts compute with: device sizes, ranks, the run's metrics and environment."""
    out: list[tuple[str, Any]] = []
    for i, d in enumerate(meta.get("deviceProperties") or []):
        out += [(f"deviceProperties[{i}].{k}", d.get(k)) for k in ("totalGlobalMem", "computeMajor", "computeMinor")]
    info = meta.get("distributedInfo") or {}
    out += [(f"distributedInfo.{k}", info.get(k)) for k in ("rank", "world_size")]
    v = meta.get("vlmdoctor") or {}
    out += [(f"vlmdoctor.metrics.{k}", x) for k, x in (v.get("metrics") or {}).items()]
    gflops = (v.get("env") or {}).get("cpu_matmul_gflops") or {}
    out += [(f"vlmdoctor.env.cpu_matmul_gflops.{k}", x) for k, x in gflops.items()]
    params = (v.get("model") or {}).get("params") or {}
    out += [(f"vlmdoctor.model.params.{k}", x) for k, x in params.items() if isinstance(x, (int, float))]
    return out


def _sane(v: Any) -> bool:
    if v is None or isinstance(v, bool):
        return True
    if isinstance(v, int):
        return -(2**63) <= v < 2**63
    return not isinstance(v, float) or math.isfinite(v)


#: the recorded knobs the facts compute with (trace/families/identity.py, flops.py), and the types they need
COMPUTED_KNOBS = {
    "stage": int,
    "model": str,
    "vision": str,
    "llm": str,
    "projector": str,
    "pixel_shuffle": int,
    "train": str,
}


def _check_knobs(config: dict[str, Any], path: Path) -> None:
    """The run config recorded in the trace: the knobs the facts compute with have their types (or are
    null: not known). The others are kept as they are, as `config.*` facts: a rule that compares one of
    another type is a rule problem, never a crash, and a user's own loop may record what it likes."""
    for name, kind in COMPUTED_KNOBS.items():
        value = config.get(name)
        if value is None:
            continue
        ok = isinstance(value, kind) and not isinstance(value, bool) and _sane(value)
        if not ok:
            raise TraceError(
                f"{path}: the run config in the trace's metadata has {name}={str(value)[:40]!r}, not {kind.__name__}"
            )
