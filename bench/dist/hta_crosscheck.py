"""vlmdoctor's overlap, GPU-idle and straggler facts cross-checked against traceinsight (Holistic Trace Analysis).

    python bench/dist/hta_crosscheck.py FOLDER [FOLDER ...] [--markdown] [--json OUT.json]

Per rank folder (one trace per rank of one job), one table:
  - HTA overlap %: `TraceAnalysis(trace_dir=FOLDER, include_last_profiler_step=True).get_comm_comp_overlap()`,
    the steps vlmdoctor reads; "HTA default" is the same with HTA's default (the last ProfilerStep's kernels
    dropped).
  - vlmdoctor overlap %: the rank's `comm.overlap_frac` (comm.hidden_ms / comm.ms).
  - HTA idle %: `get_temporal_breakdown()` idle_time_pctg (include_last_profiler_step=True).
  - vlmdoctor GPU idle %: the GPU-idle side of the rank's step accounts (trace/accounts.py), which is
    gpu.idle_ms / step.ms.
  - HTA straggler: `get_potential_stragglers(num_candidates=1)` as shipped; where it fails (it looks for
    kernels named `ncclKernel*`, and NCCL >= 2.19 names them `ncclDevKernel_*`), HTA's own algorithm
    (find_stragglers_with_late_start_comm_kernels) run again with `ncclDevKernel*` read as `ncclKernel*`.
    Its votes per rank are shown: the iterations in which the rank started the decisive collective last.
  - vlmdoctor slowest: `dist.straggler.rank` (most busy time: step less its wait for late ranks) and
    `dist.straggler.cause`; per rank its busy ms.
  - two columns that explain most disagreements, read from the traces with vlmdoctor's reader:
    "early NCCL" counts the NCCL kernels whose launch is not in the trace (launched in the profiler's warm-up
    step, run inside the first traced step), "GPU tail ms" is how long the rank's GPU ran after the host
    closed the last ProfilerStep.

HTA reads a folder's every .json/.gz file and takes each file's rank from the first line matching
`"rank": N`; when that does not give one file per rank (other files in the folder, no distributedInfo),
the traces are exported into a temporary folder first (vlmdoctor's export_hta_folder). The fixtures are
never modified. vlmdoctor's own embedded HTA call (cross_rank.hta) is switched off here: this script runs
HTA itself. Why the two differ, per definition: docs/distributed.md ("Cross-checked against Holistic Trace
Analysis").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from vlmdoctor.trace import facts as vfacts  # noqa: E402
from vlmdoctor.trace.comms import rank_comms, rank_of  # noqa: E402
from vlmdoctor.trace.read import trace_files  # noqa: E402
from vlmdoctor.trace.tables import load_tables  # noqa: E402

DEV = re.compile(r"^ncclDevKernel")


@contextlib.contextmanager
def quiet():
    """HTA logs and prints a lot (warnings per file); keep the table readable."""
    sink = io.StringIO()
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield sink
    finally:
        logging.disable(level)


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}".rstrip(": ")


# ---------------------------------------------------------------- HTA


def hta_folder(folder: Path, files: list[Path], ranks: list[Any], tmp: Path) -> tuple[Path, str]:
    """The folder to give TraceAnalysis(trace_dir=...), and how it was made."""
    from hta.common.trace_file import create_rank_to_trace_dict

    others = [p for p in folder.iterdir() if p.is_file() and p.name.endswith((".gz", ".json")) and p not in files]
    with quiet():
        ok, seen = create_rank_to_trace_dict([str(f) for f in files])
    if (
        ok
        and not others
        and all(isinstance(r, int) for r in ranks)
        and sorted(seen) == sorted(ranks)
        and len(seen) == len(files)
    ):
        return folder, "the folder as it is"
    from vlmdoctor.trace.export import export_hta_folder

    out = tmp / "hta"
    export_hta_folder(files, out)
    why = "other .json/.gz files in it" if others else "HTA's rank search did not find one file per rank"
    return out, f"exported to a temporary folder ({why})"


class _DevAsKernel:
    """HTA's symbol table with `ncclDevKernel*` names read as `ncclKernel*` (same ids), for its straggler metric."""

    def __init__(self, st):
        self.st = st
        self.table = [DEV.sub("ncclKernel", s) for s in st.get_sym_table()]
        self.map = {s: i for i, s in enumerate(self.table)}

    def get_sym_table(self):
        return self.table

    def get_sym_id_map(self):
        return self.map

    def __getattr__(self, name):
        return getattr(self.st, name)


def hta_side(folder: Path, files: list[Path], ranks: list[Any]) -> dict[str, Any]:
    try:
        from hta.analyzers.straggler import find_stragglers_with_late_start_comm_kernels
        from hta.trace_analysis import TraceAnalysis
    except Exception as e:  # noqa: BLE001
        return {"error": f"traceinsight (hta) not importable: {_err(e)}"}
    out: dict[str, Any] = {"ranks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        where, how = hta_folder(folder, files, ranks, Path(tmp))
        out["read"] = how
        for include_last in (True, False):
            t0 = time.perf_counter()
            try:
                with quiet():
                    ta = TraceAnalysis(trace_dir=str(where), include_last_profiler_step=include_last)
            except Exception as e:  # noqa: BLE001
                out["error" if include_last else "error_default"] = f"TraceAnalysis: {_err(e)}"
                continue
            key = "" if include_last else "_default"
            try:
                with quiet():
                    ov = ta.get_comm_comp_overlap(visualize=False)
                for r, v in zip(ov["rank"], ov["comp_comm_overlap_pctg"]):
                    out["ranks"].setdefault(int(r), {})["overlap" + key] = None if np.isnan(v) else float(v)
            except Exception as e:  # noqa: BLE001
                out["overlap_error" + key] = _err(e)
            if include_last:
                try:
                    with quiet():
                        tb = ta.get_temporal_breakdown(visualize=False)
                    for _, row in tb.iterrows():
                        d = out["ranks"].setdefault(int(row["rank"]), {})
                        d["idle"] = float(row["idle_time_pctg"])
                        d["compute"] = float(row["compute_time_pctg"])
                        d["kernel_span_ms"] = float(row["kernel_time(us)"]) / 1e3
                except Exception as e:  # noqa: BLE001
                    out["idle_error"] = _err(e)
                try:
                    with quiet():
                        out["steps"] = [int(s) for s in ta.get_profiler_steps()]
                except Exception as e:  # noqa: BLE001
                    out["steps_error"] = _err(e)
                try:
                    with quiet():
                        out["straggler"] = ta.get_potential_stragglers(num_candidates=1)
                except Exception as e:  # noqa: BLE001
                    out["straggler_error"] = _err(e)
                    votes: dict[str, Any] = {}

                    def impl(df, st, n, visualize, votes=votes):
                        s = find_stragglers_with_late_start_comm_kernels(df, _DevAsKernel(st), n, visualize)
                        votes["s"] = s
                        return s

                    try:
                        with quiet():
                            out["straggler_dev"] = ta.get_potential_stragglers(
                                num_candidates=1, straggler_identification_impl=impl
                            )
                        for r, v in votes["s"].items():
                            out["ranks"].setdefault(int(r), {})["votes"] = int(v)
                    except Exception as e2:  # noqa: BLE001
                        out["straggler_dev_error"] = _err(e2)
            out["load_s" + key] = round(time.perf_counter() - t0, 1)
            del ta
    return out


# ---------------------------------------------------------------- vlmdoctor


def vlm_side(folder: Path) -> dict[str, Any]:
    saved = vfacts.hta_overlap
    vfacts.hta_overlap = lambda path: {"skipped": "run by bench/dist/hta_crosscheck.py itself"}
    try:
        doc = vfacts.analyze(folder, workers=1)
    finally:
        vfacts.hta_overlap = saved
    out: dict[str, Any] = {"ranks": {}}
    for entry in doc["files"]:
        f, a = entry["facts"], entry.get("accounts")
        r = entry.get("rank", rank_of(entry.get("meta") or {}, Path(entry["file"]).name))
        idle = None
        if a:
            idle = sum(x["share"] for x in a["rows"] if x["side"] == "GPU idle") + a["unattributed_share"]
        ov = f.get("comm.overlap_frac")
        out["ranks"][r] = {"overlap": None if ov is None else 100 * ov, "idle": None if idle is None else 100 * idle}
    cr = doc.get("cross_rank") or {}
    if "skipped" in cr:
        out["cross_rank_skipped"] = cr["skipped"]
    cf = cr.get("facts") or {}
    for row in cr.get("ranks") or []:
        d = out["ranks"].setdefault(row["rank"], {})
        d["busy_ms"], d["wait_ms"], d["step_ms"] = row.get("busy_ms"), row.get("wait_ms"), row.get("step_ms")
    for k in (
        "dist.straggler.rank",
        "dist.straggler.cause",
        "dist.step_skew_frac",
        "dist.late_wait_ms",
        "dist.parallel",
    ):
        if k in cf:
            out[k] = cf[k]
    return out


def timing_side(files: list[Path]) -> dict[Any, dict[str, Any]]:
    """Per rank: NCCL kernels whose launch the trace lacks, and the GPU's run past the last ProfilerStep."""
    out: dict[Any, dict[str, Any]] = {}  # rank (the file name where it has none) -> facts
    for f in files:
        t = load_tables(f)
        rc = rank_comms(t)
        w = rc.work
        early = int((w["issue"] == w["ts"]).sum()) if rc.backend == "nccl" and len(w) else 0
        tail = None
        if len(t.steps) and len(t.gpu):
            tail = max(float(t.gpu["end"].max() - t.steps["end"].max()) / 1e3, 0.0)
        out[rc.rank if rc.rank is not None else f.name] = {"early_nccl": early, "tail_ms": tail, "backend": rc.backend}
    return out


# ---------------------------------------------------------------- table


def num(v: Any, spec: str = ".1f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not (isinstance(v, float) and np.isnan(v)) else "-"


def diff(a: Any, b: Any) -> str:
    return num(b - a, "+.1f") if isinstance(a, (int, float)) and isinstance(b, (int, float)) else "-"


def check(folder: Path) -> dict[str, Any]:
    files = trace_files(folder)
    per = timing_side(files)
    ranks = list(per)  # in file order: vlmdoctor's reading of each file's rank
    return {
        "folder": str(folder),
        "files": [f.name for f in files],
        "vlmdoctor": vlm_side(folder),
        "hta": hta_side(folder, files, ranks),
        "timing": per,
    }


HEAD = (
    "rank",
    "HTA overlap %",
    "HTA default %",
    "vlmdoctor overlap %",
    "Δ overlap",
    "HTA idle %",
    "vlmdoctor GPU idle %",
    "Δ idle",
    "HTA straggler votes",
    "vlmdoctor busy ms",
    "early NCCL",
    "GPU tail ms",
)


def render(res: dict[str, Any], markdown: bool) -> str:
    v, h, tm = res["vlmdoctor"], res["hta"], res["timing"]
    ranks = sorted({*v["ranks"], *h.get("ranks", {}), *tm}, key=lambda r: (not isinstance(r, int), r))
    rows = []
    for r in ranks:
        a, b, t = h.get("ranks", {}).get(r, {}), v["ranks"].get(r, {}), tm.get(r, {})
        slow = " ◀" if r == v.get("dist.straggler.rank") else ""
        rows.append(
            (
                str(r),
                num(a.get("overlap")),
                num(a.get("overlap_default")),
                num(b.get("overlap")),
                diff(a.get("overlap"), b.get("overlap")),
                num(a.get("idle")),
                num(b.get("idle")),
                diff(a.get("idle"), b.get("idle")),
                num(a.get("votes"), "d"),
                num(b.get("busy_ms")) + slow,
                num(t.get("early_nccl"), "d"),
                num(t.get("tail_ms")),
            )
        )
    lines = []
    title = f"{res['folder']} ({len(res['files'])} ranks, {v.get('dist.parallel', '?')})"
    if markdown:
        lines += [f"#### {title}", "", "| " + " | ".join(HEAD) + " |", "|" + "---:|" * len(HEAD)]
        lines += ["| " + " | ".join(x) + " |" for x in rows]
        lines.append("")
    else:
        w = [max(len(HEAD[i]), *(len(x[i]) for x in rows)) for i in range(len(HEAD))]
        lines += [title, "  ".join(c.rjust(n) for c, n in zip(HEAD, w))]
        lines += ["  ".join(c.rjust(n) for c, n in zip(x, w)) for x in rows]
    gpu = any(x.get("backend") == "nccl" for x in tm.values())
    hs = h.get("straggler")
    if hs is not None:
        hta_says = f"rank {hs[0]}" if hs else "none"
    elif "straggler_dev" in h:
        hs = h["straggler_dev"]
        hta_says = (
            f"as shipped: {h['straggler_error']} (it reads only `ncclKernel*` names); "
            f"its algorithm on `ncclDevKernel*`: rank {hs[0] if hs else 'none'}"
        )
    elif not gpu:
        hta_says = "nothing to read (no NCCL kernels)"
        hs = None
    elif "straggler_dev_error" in h:
        why = h["straggler_dev_error"]
        if "NA values" in why:  # std over ranks of the decisive kernel's duration: one rank has such kernels
            why += " (fewer than two ranks have a collective >= 1% of the iteration: nothing to compare)"
        hta_says = (
            f"as shipped: {h['straggler_error']} (it reads only `ncclKernel*` names); "
            f"its algorithm on `ncclDevKernel*`: {why}"
        )
        hs = None
    else:
        hta_says = "; ".join(str(h[k]) for k in ("error", "straggler_error") if k in h) or "-"
        hs = None
    vr = v.get("dist.straggler.rank")
    agree = "-"
    if hs and vr is not None:
        agree = "agree" if hs[0] == vr else "DIFFER"
    skew = v.get("dist.step_skew_frac")
    notes = [
        f"HTA straggler: {hta_says}",
        f"vlmdoctor slowest: rank {vr} (cause {v.get('dist.straggler.cause', '-')}, skew "
        f"{num(100 * skew if isinstance(skew, float) else None)}% of the step, late wait "
        f"{num(v.get('dist.late_wait_ms'))} ms/step) → {agree}",
    ]
    if not gpu:
        notes.append(
            "HTA reads GPU kernels only: these traces ran their collectives on the CPU (gloo), so HTA has no "
            f"overlap (NaN), no temporal breakdown ({h.get('idle_error', '-')}) and no straggler"
        )
    for k in ("error", "overlap_error", "idle_error", "error_default", "overlap_error_default"):
        if k in h and gpu:
            notes.append(f"HTA {k.replace('_', ' ')}: {h[k]}")
    if "cross_rank_skipped" in v:
        notes.append(f"vlmdoctor cross-rank: {v['cross_rank_skipped']}")
    notes.append(f"HTA read {h.get('read', '-')}; steps {h.get('steps', '-')}; load {h.get('load_s', '-')} s")
    lines += [("- " if markdown else "  ") + n for n in notes]
    return "\n".join(lines) + "\n"


def summary(done: list[dict[str, Any]], markdown: bool, within: float = 5.0) -> str:
    """How many ranks agree within `within` points, and how many folders name the same slowest rank."""
    n = ov = idle = 0
    picks = same = 0
    for res in done:
        h, v = res["hta"], res["vlmdoctor"]
        for r, a in h.get("ranks", {}).items():
            b = v["ranks"].get(r, {})
            if not isinstance(a.get("overlap"), float) or not isinstance(b.get("overlap"), float):
                continue
            n += 1
            ov += abs(a["overlap"] - b["overlap"]) <= within
            idle += (
                isinstance(a.get("idle"), float)
                and isinstance(b.get("idle"), float)
                and (abs(a["idle"] - b["idle"]) <= within)
            )
        hs = h.get("straggler") or h.get("straggler_dev")
        if hs and v.get("dist.straggler.rank") is not None:
            picks += 1
            same += hs[0] == v["dist.straggler.rank"]
    lead = "- " if markdown else ""
    return (
        f"{lead}ranks with GPU collectives: {n}; overlap within {within:g} points: {ov}; GPU idle within "
        f"{within:g} points: {idle}\n{lead}folders where HTA (its algorithm on `ncclDevKernel*`) names a "
        f"straggler: {picks} of {len(done)}; the same rank as vlmdoctor's slowest: {same}\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--markdown", action="store_true", help="markdown tables")
    ap.add_argument("--json", type=Path, help="also write every number here")
    a = ap.parse_args()
    done = []
    for folder in a.folders:
        res = check(folder)
        done.append(res)
        print(render(res, a.markdown), flush=True)
    if len(done) > 1:
        print(("### Summary\n\n" if a.markdown else "Summary\n") + summary(done, a.markdown))
    if a.json:
        a.json.write_text(json.dumps(done, indent=1, default=str))


if __name__ == "__main__":
    main()
