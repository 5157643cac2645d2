"""The reliability probe: hundreds of hostile but realistic uses of every vlmdoctor command, the Python API and the
Trainer callback, each judged in the classes of "First, do no harm" (docs/reliability.md).

    sudo python bench/probe/probe.py                      # every case; JSONL under bench/results/, the table in
                                                          # docs/reliability.md
    python bench/probe/probe.py --only 'analyze/' --jobs 2 --no-table
    python bench/probe/probe.py --first bench/results/2026-11-27-probe/first.jsonl   # the first run's column

Root is needed for the cases that mount a small tmpfs (a full disk) or a read-only one; without it those
cases are skipped and said. Each case runs in a folder of its own under a scratch folder (removed after,
unless --keep), with TMPDIR inside it; see harness.py for what is observed and how it is judged.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import all_cases  # noqa: E402
from harness import CLASSES, OK, ROOT, Result, aims, default_signals, load_jsonl, run_case  # noqa: E402

BEGIN, END = "<!-- probe-table: begin -->", "<!-- probe-table: end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the JSONL (default: bench/results/DATE-probe)")
    ap.add_argument("--only", help="a regular expression the case ids must match")
    ap.add_argument("--fast", action="store_true", help="skip the cases that run training steps")
    ap.add_argument("--jobs", type=int, default=2, help="cases at once (default 2)")
    ap.add_argument("--keep", action="store_true", help="keep the folder of every case that shows a defect")
    ap.add_argument("--first", help="the JSONL of the first run: the table's 'found on the first run' and 'fixed'")
    ap.add_argument("--name", default="probe.jsonl", help="the JSONL's name in --out")
    ap.add_argument("--no-table", action="store_true", help="do not write the table into docs/reliability.md")
    ap.add_argument("--list", action="store_true", help="list the cases and stop")
    args = ap.parse_args()
    default_signals()

    cases = all_cases()
    if args.only:
        cases = [c for c in cases if re.search(args.only, c.id)]
    if args.fast:
        cases = [c for c in cases if not c.heavy]
    if args.list:
        for c in cases:
            print(f"{c.id:50s} {c.input:16s} {c.expect}")
        print(f"{len(cases)} cases")
        return
    day = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"{day}-probe"
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / args.name
    scratch = Path(tempfile.mkdtemp(prefix="vlmdoctor-probe-"))
    t0 = time.time()
    results: list[Result] = []
    # heavy cases first, so that the fast ones fill in around them
    order = sorted(cases, key=lambda c: not c.heavy)
    with open(jsonl, "w") as f, ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_case, c, scratch, args.keep): c for c in order}
        for n, fut in enumerate(as_completed(futures), 1):
            c = futures[fut]
            try:
                r = fut.result()
            except Exception as e:  # the probe's own failure on this case: recorded, the others go on
                r = Result(c, None, [], setup_error=f"probe error: {type(e).__name__}: {e}")
            results.append(r)
            rec = r.record()
            rec["aims"] = aims(c)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            mark = "  " if r.verdict == OK and not r.setup_error else "!!"
            why = r.skipped or r.setup_error or "; ".join(f"{k}: {w}" for k, w in r.defects)[:160]
            wall = f"{r.obs.wall_s:5.1f}s" if r.obs else "  -   "
            print(f"{mark} [{n:3d}/{len(order)}] {wall} {c.id:48s} {r.verdict:28s} {why}", flush=True)
    os.rmdir(scratch) if not any(scratch.iterdir()) else None
    took = time.time() - t0
    print(f"{len(results)} cases in {took / 60:.1f} min; JSONL: {jsonl}")
    by = collections.Counter(r.verdict for r in results)
    for cls in (*CLASSES, OK):
        print(f"  {cls:32s} {by.get(cls, 0)}")
    errors = [r for r in results if r.setup_error]
    if errors:
        print(f"  probe errors (not judged): {len(errors)}")
    skipped = [r for r in results if r.skipped]
    if skipped:
        print(f"  skipped (no tmpfs mount here): {len(skipped)}")
    if not args.no_table:
        first = load_jsonl(Path(args.first)) if args.first else None
        write_table([r for r in results if not r.skipped], first, jsonl, took, len(skipped))


def _machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPU cores ({cpu}), {mem:.0f} GiB RAM, no GPU; {platform.system()} {platform.release()}"


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "vlmdoctor"], capture_output=True, text=True
        )
        return head.stdout.strip() + (" with uncommitted changes to vlmdoctor/" if dirty.stdout.strip() else "")
    except OSError:
        return "?"


def table_text(results: list[Result], first: list[dict] | None, jsonl: Path, took: float, skipped: int) -> str:
    """The markdown table of docs/reliability.md: by class, then by command."""
    now = {r.case.id: r for r in results}
    first_by = {x["id"]: x for x in first} if first else {}
    lines = [
        f"Run of {datetime.date.today().isoformat()} on {_machine()}, at commit {_commit()}: "
        f"{len(results)} cases in {took / 60:.0f} min"
        + (f" ({skipped} skipped: no tmpfs mount here)" if skipped else "")
        + f"; every case in `{jsonl.relative_to(ROOT) if jsonl.is_relative_to(ROOT) else jsonl}`.",
        "",
        "| class | cases aimed at it | defects on the first run | fixed | left |",
        "|---|---:|---:|---:|---:|",
    ]
    for cls in CLASSES:
        aimed = sum(1 for r in results if aims(r.case) == cls)
        found = [i for i, x in first_by.items() if x["verdict"] == cls] if first else []
        fixed = [i for i in found if i in now and now[i].verdict == OK]
        left = [i for i, r in now.items() if r.verdict == cls]
        lines.append(
            f"| {cls} | {aimed} | {len(found) if first else '-'} | {len(fixed) if first else '-'} | {len(left)} |"
        )
    ok = sum(1 for r in results if r.verdict == OK and not r.setup_error)
    total_found = sum(1 for x in first_by.values() if x["verdict"] != OK)
    lines.append(f"| **all** | {len(results)} | {total_found if first else '-'} | | {len(results) - ok} |")
    lines += ["", "| command | cases | OK now |", "|---|---:|---:|"]
    by_cmd: dict[str, list[Result]] = collections.defaultdict(list)
    for r in results:
        by_cmd[r.case.command].append(r)
    for cmd, rs in sorted(by_cmd.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"| {cmd} | {len(rs)} | {sum(1 for r in rs if r.verdict == OK and not r.setup_error)} |")
    by_input = collections.Counter(r.case.input for r in results)
    lines += ["", "Inputs: " + ", ".join(f"{k} {v}" for k, v in by_input.most_common()) + "."]
    left = [r for r in results if r.verdict != OK or r.setup_error]
    if left:
        lines += ["", "Cases with a defect left:", ""]
        for r in left:
            why = r.setup_error or "; ".join(w for _, w in r.defects)
            lines.append(f"- `{r.case.id}` ({r.verdict}): {why}")
    return "\n".join(lines)


def write_table(results: list[Result], first: list[dict] | None, jsonl: Path, took: float, skipped: int) -> None:
    doc = ROOT / "docs" / "reliability.md"
    text = doc.read_text() if doc.exists() else f"# Reliability\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + BEGIN + "\n" + table_text(results, first, jsonl, took, skipped) + "\n" + END + tail)
    print(f"table written: {doc}")


if __name__ == "__main__":
    main()
