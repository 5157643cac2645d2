"""Exporting traces for other tools: Perfetto's UI (gzipped Chrome JSON) and Holistic Trace Analysis.

HTA gets a folder, one file per rank.

Both exports re-encode the trace event by event (streamed, never loaded whole, as in `tracefile`), so
the output is strict JSON whatever the input was: NaN and Infinity (which Python's decoder accepts
but JSON forbids) become null, undecodable bytes become U+FFFD, and a truncated input is refused
instead of copied. Every event and every top-level key is kept, in order.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from vlmdoctor.errors import UsageError
from vlmdoctor.files import atomic_writer
from vlmdoctor.inputs import read_json
from vlmdoctor.trace.read import TRACE_SUFFIXES, iter_events, read_metadata, trace_files

#: the names export_hta_folder writes; --force replaces these and nothing else
OURS = re.compile(r"rank\d+\.pt\.trace\.json\.gz")
FLUSH = 4096  # events serialized before each write
COMPRESSLEVEL = 6  # gzip's default of 9 is several times slower for a few % smaller output


def trace_of_report(src: Path) -> Path:
    """The trace to export: `src` itself, or the trace a profile report names (`trace.path`).

    A report's trace is looked for only where the user pointed: inside the report's folder (the path
    as written, relative to that folder, or the file of that name next to the report). A path that
    leads out of the folder, by `..`, an absolute path or a link, is refused: a report handed over
    by someone else must not make export read an arbitrary file.
    """
    if not (src.suffix == ".json" and not src.name.endswith(".pt.trace.json") and src.is_file()):
        return src

    report = read_json(src, "report", max_bytes=512 * 2**20)
    if not isinstance(report, dict) or "traceEvents" in report:
        return src  # a trace named *.json, read as one
    info = report.get("trace")
    if info is not None and not isinstance(info, dict):
        raise UsageError(f"{src}: its trace must be an object with a path, got {type(info).__name__}")
    kept = (info or {}).get("path")
    if kept is not None and not isinstance(kept, str):
        raise UsageError(f"{src}: its trace.path is not a path (a {type(kept).__name__})")
    if not kept:
        raise UsageError(f"{src}: the report kept no trace; run profile with --trace-dir DIR")
    if "\x00" in kept or len(kept) > 4096:
        raise UsageError(f"{src}: its trace.path is not a path")
    home = src.parent.resolve()
    outside = False
    for candidate in (src.parent / kept, src.parent / Path(kept).name):
        try:
            where = candidate.resolve()
        except (OSError, RuntimeError):
            continue
        if where.exists() and where.is_relative_to(home):
            return where
        outside = outside or (where.exists() and candidate == src.parent / kept)
    if outside:
        raise UsageError(
            f"{src}: its trace {kept} lies outside the report's folder; export reads a report's trace only "
            "next to the report: pass the trace itself"
        )
    raise UsageError(f"{src}: its trace {kept} is not here (recorded on another machine, or moved)")


def _finite(v: Any) -> Any:
    """NaN and +-Infinity (not JSON) as null, anywhere in a value."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _dumps(v: Any) -> str:
    try:
        return json.dumps(v, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(v), separators=(",", ":"), allow_nan=False)


def _check_output(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise UsageError(f"{out} exists; pass --force to overwrite it")
    if out.exists() and out.is_dir():
        raise UsageError(f"{out} is a folder; give a file name ending in .json.gz")


def _write(src: Path, head: dict[str, Any], out: Path, first: dict[str, Any] | None = None) -> int:
    """Gzipped Chrome JSON: `first` keys, then the input's keys before traceEvents, the events, the keys
    after them. Written through the one writer (temp file beside `out`, renamed into place when complete)."""

    out.parent.mkdir(parents=True, exist_ok=True)
    tail: dict[str, Any] = {}
    count = 0
    with atomic_writer(out) as raw, gzip.open(raw, "wt", encoding="utf-8", compresslevel=COMPRESSLEVEL) as f:
        head = {**(first or {}), **{k: v for k, v in head.items() if k not in (first or {})}}
        f.write("{\n")
        for k, v in head.items():  # one key a line: HTA finds distributedInfo's rank by a line-wise search
            f.write(f"{json.dumps(k)}: {json.dumps(_finite(v), allow_nan=False)},\n")
        f.write('"traceEvents": [\n')
        lines: list[str] = []
        for count, ev in enumerate(iter_events(src, tail=tail), start=1):
            lines.append(("" if count == 1 else ",\n") + _dumps(ev))
            if len(lines) >= FLUSH:
                f.write("".join(lines))
                lines.clear()
        f.write("".join(lines))
        f.write("\n]")
        for k, v in tail.items():
            if k not in head:
                f.write(f",\n{json.dumps(k)}: {json.dumps(_finite(v), allow_nan=False)}")
        f.write("\n}\n")
    return count


def _one_file(trace: Path) -> Path:
    files = trace_files(trace)  # TraceError (a UsageError) naming the path when missing or not a trace
    if Path(trace).is_dir():
        raise UsageError(
            f"{trace} is a folder of {len(files)} trace file(s); export one file, or all of them with "
            "the HTA folder export"
        )
    return files[0]


def export_chrome(trace: Path, out: Path, force: bool = False) -> Path:
    """Write `trace` (.json or .json.gz) as gzipped Chrome trace JSON that Perfetto's UI opens.

    Every event and top-level key (deviceProperties, the `vlmdoctor` run config, ...) is kept. `out`
    must end in .json.gz (or .gz); an existing file is overwritten only with `force`. Returns `out`.
    """
    src, out = _one_file(Path(trace)), Path(out)
    if not out.name.endswith(".gz"):
        raise UsageError(f"{out}: the export is gzipped; give a name ending in .json.gz")
    _check_output(out, force)
    if out.exists() and out.resolve() == src.resolve():
        raise UsageError(f"{out} is the input trace; write the export to another file")
    _write(src, read_metadata(src, strict=True), out)
    return out


def _rank_of(info: Any) -> int | None:
    if isinstance(info, dict) and isinstance(info.get("rank"), int) and not isinstance(info["rank"], bool):
        return info["rank"] if info["rank"] >= 0 else None
    return None


def export_hta_folder(traces: list[Path], out_dir: Path, force: bool = False) -> Path:
    """A folder that Holistic Trace Analysis (`hta.trace_analysis.TraceAnalysis(trace_dir=...)`) reads:
    one gzipped file per rank, `rank{R}.pt.trace.json.gz`, each with `distributedInfo.rank` set.

    `traces` are trace files, or folders of them (each file one rank). A trace that already says its
    rank keeps its distributedInfo as recorded; the others get {"rank": i, "world_size": n, "backend":
    "nccl"} (keeping any other keys they have), with i the lowest free rank, in the order given. Two
    traces claiming the same rank are refused: they are not ranks of one run. HTA reads every .json and .gz file
    in the folder, so a folder that already holds trace
    files is refused unless `force`, which removes those files first. Returns `out_dir`.
    """
    files: list[Path] = []
    for t in traces:
        files.extend(trace_files(t))
    if not files:
        raise UsageError("no trace files given")
    if len({f.resolve() for f in files}) != len(files):
        raise UsageError("the same trace file is given twice")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir} exists and is not a folder")
    if any(f.resolve().parent == out_dir.resolve() for f in files):
        raise UsageError(f"{out_dir} holds the input traces; export to another folder")
    present = [p for p in out_dir.iterdir() if p.name.endswith((*TRACE_SUFFIXES, ".gz"))] if out_dir.is_dir() else []
    old = [p for p in present if OURS.fullmatch(p.name) and p.is_file() and not p.is_symlink()]
    foreign = sorted(p.name for p in present if p not in old)
    if foreign:  # --force replaces what this export wrote before, never someone else's archives
        raise UsageError(
            f"{out_dir} holds {len(foreign)} file(s) vlmdoctor did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}) that HTA would read too; move them or choose "
            "another folder"
        )
    if old and not force:
        raise UsageError(
            f"{out_dir} already holds {len(old)} trace file(s) (HTA would read them too); pass --force "
            "to replace them, or choose another folder"
        )

    heads = [read_metadata(f, strict=True) for f in files]  # the events are read once, while writing
    given = [_rank_of(h.get("distributedInfo")) for h in heads]
    seen: dict[int, Path] = {}
    for f, r in zip(files, given):
        if r is not None and r in seen:
            raise UsageError(f"{seen[r]} and {f} both say rank {r}; HTA needs one trace per rank of one run")
        if r is not None:
            seen[r] = f
    free = (r for r in range(len(files) + len(seen)) if r not in seen)
    ranks = [r if r is not None else next(free) for r in given]
    width = len(str(max(ranks)))
    out_dir.mkdir(parents=True, exist_ok=True)
    # the new export is written complete into a staging folder first: a bad rank half-way leaves the old export
    stage = Path(tempfile.mkdtemp(dir=out_dir, prefix=".vlmdoctor-export-"))
    try:
        names = []
        for f, h, r, g in zip(files, heads, ranks, given):
            info = dict(h.get("distributedInfo") or {}) if isinstance(h.get("distributedInfo"), dict) else {}
            if g is None:  # no usable rank: set it, keeping what else the trace says (backend, process groups)
                info = {
                    **info,
                    "rank": r,
                    "world_size": info.get("world_size") or len(files),
                    "backend": info.get("backend") or "nccl",
                }
            name = f"rank{r:0{width}d}.pt.trace.json.gz"
            _write(f, h, stage / name, first={"distributedInfo": info})
            names.append(name)
        for p in old:  # only files this export wrote before, and only now that the new one is complete
            if p.name not in names:
                p.unlink()
        for name in names:
            os.replace(stage / name, out_dir / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out_dir
