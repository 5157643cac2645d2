"""Time, CPU time and peak memory of `vlmdoctor analyze` on one large trace, against a bare `json.load`
of the same file and against traceinsight (HTA), measured in one run; the table goes to docs/benchmarks.md.

    python bench/make_big_trace.py fixtures/traces/default_s2.pt.trace.json.gz /tmp/big/trace.json --min-gb 1.0
    python bench/analysis_speed.py /tmp/big/trace.json --runs 3 --hta-runs 1 --doc docs/benchmarks.md
    gzip -9 -k /tmp/big/trace.json   # torch.profiler writes .json.gz at gzip's level 9
    python bench/analysis_speed.py /tmp/big/trace.json.gz --runs 3 --hta-runs 0 --doc docs/benchmarks.md --section gz

A .json.gz trace is compared with `json.load(gzip.open(...))`, which pays the same inflation (zlib) as the
analyzer; the row `inflate only` is that zlib time alone, so the two can be told apart. With
`--baseline-tree DIR` (a copy of an older `vlmdoctor/` package and `rules/`), that analyzer runs in the same
rounds and its JSON output is compared with the new one's, byte for byte.

Every measurement is its own process (a fresh interpreter), run one after the other; the rounds
interleave json.load and the analyzer so that a change in the machine's load touches both. Peak
memory is the largest sum of the resident sets of the process and all its children, sampled from
/proc every 50 ms (the analyzer's worker processes count). CPU time is user + system of the
process tree. Each figure is the median of the rounds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- analysis-speed{}:{} -->"  # the doc's markers: start and end, one pair per --section
PAGE = os.sysconf("SC_PAGE_SIZE")

JSON_LOAD = (  # a .gz file through gzip.open: the same inflation the analyzer pays
    "import gzip, json, sys\nopen_ = gzip.open if sys.argv[1].endswith('.gz') else open\n"
    "with open_(sys.argv[1], 'rb') as f:\n    json.load(f)\n"
)
INFLATE = (  # the zlib time of a .gz trace alone: every byte inflated, nothing decoded
    "import gzip, sys, shutil, os\nwith gzip.open(sys.argv[1], 'rb') as f, open(os.devnull, 'wb') as out:\n"
    "    shutil.copyfileobj(f, out, 1 << 21)\n"
)
ONE_PROCESS = (  # the same command, its analysis held to one process
    "import sys\nimport vlmdoctor.trace.facts as f\nf.cpus = lambda: 1\nfrom vlmdoctor.cli import main\n"
    "sys.argv = ['vlmdoctor', 'analyze', sys.argv[1], '--json', sys.argv[2], '--force']\nmain()\n"
)
HTA = """
import sys, time, warnings
warnings.filterwarnings("ignore")
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True)
tb = a.get_temporal_breakdown(visualize=False)
a.get_idle_time_breakdown(visualize=False)
a.get_cuda_kernel_launch_stats(visualize=False)
print("HTA idle_pct", float(tb["idle_time_pctg"].iloc[0]))
"""


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it (walked through /proc/<pid>/task/*/children)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def measure(cmd: list[str], cwd: Path = ROOT) -> dict:
    """Wall time, CPU time (user + system) and peak resident memory of the process tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    out, err = proc.communicate()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}... exited with {proc.returncode}: {err[-2000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_gb": peak / 1e9, "stdout": out[-400:]}


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--runs", type=int, default=3, help="rounds of json.load and the analyzer")
    ap.add_argument("--hta-runs", type=int, default=1, help="traceinsight runs (0: skip; minutes each on 1 GB)")
    ap.add_argument("--doc", help="write the table into this Markdown file, between the analysis-speed markers")
    ap.add_argument("--section", default="", help="which markers of --doc: <!-- analysis-speed:NAME:start -->")
    ap.add_argument("--title", default="", help="the table's heading (default: says the file's size)")
    ap.add_argument("--no-one-process", action="store_true", help="skip the `analyze, one process` rows")
    ap.add_argument(
        "--baseline-tree",
        help="a copy of an older vlmdoctor (a folder holding its vlmdoctor/ package and rules/): its `analyze` "
        "runs in the same rounds (row `analyze (baseline)`), so old and new meet the same load",
    )
    ap.add_argument("--out", help="write every measurement here as JSON")
    args = ap.parse_args()
    trace = Path(args.trace).resolve()
    gib = json_gib(trace)
    load_before = os.getloadavg()
    gz = trace.name.endswith(".gz")
    rows: dict[str, list[dict]] = {"json.load": [], "analyze": []}
    if args.baseline_tree:
        rows["analyze (baseline)"] = []
    if not args.no_one_process:
        rows["analyze, one process"] = []
    if gz:
        rows["inflate only"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            rows["json.load"].append(measure([sys.executable, "-c", JSON_LOAD, str(trace)]))
            a, b = f"{tmp}/a{r}.json", f"{tmp}/b{r}.json"
            rows["analyze"].append(
                measure([sys.executable, "-m", "vlmdoctor", "analyze", str(trace), "--json", a, "--force"])
            )
            if args.baseline_tree:  # `-m` imports the package from the working folder: the old tree's
                cmd = [
                    sys.executable,
                    "-m",
                    "vlmdoctor",
                    "analyze",
                    str(trace),
                    "--json",
                    f"{tmp}/c{r}.json",
                    "--force",
                ]
                rows["analyze (baseline)"].append(measure(cmd, Path(args.baseline_tree)))
            if not args.no_one_process:
                rows["analyze, one process"].append(measure([sys.executable, "-c", ONE_PROCESS, str(trace), b]))
            if gz:
                rows["inflate only"].append(measure([sys.executable, "-c", INFLATE, str(trace)]))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['wall_s']:.1f} s" for k, v in rows.items()), flush=True)
        facts = json.loads(Path(f"{tmp}/a0.json").read_text())["files"][0]["facts"]
        same = args.no_one_process or facts == json.loads(Path(f"{tmp}/b0.json").read_text())["files"][0]["facts"]
        # the old analyzer's whole document (facts, accounts, findings) against the new one's, every round
        old_same = None
        if args.baseline_tree:
            old_same = all(
                Path(f"{tmp}/a{r}.json").read_bytes() == Path(f"{tmp}/c{r}.json").read_bytes() for r in range(args.runs)
            )
    report = _report(rows, trace, gib, facts, same, load_before)
    report["baseline_outputs_identical"] = old_same
    _save(args, report)  # the rounds now; again with traceinsight's runs when they end
    if args.hta_runs:
        rows["traceinsight"] = [measure([sys.executable, "-c", HTA, str(trace.parent)]) for _ in range(args.hta_runs)]
        _save(args, {**_report(rows, trace, gib, facts, same, load_before), "baseline_outputs_identical": old_same})


def _cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _report(rows: dict, trace: Path, gib: float, facts: dict, same: bool, load_before: tuple) -> dict:
    med = {
        k: {m: statistics.median(x[m] for x in v) for m in ("wall_s", "cpu_s", "peak_rss_gb")} for k, v in rows.items()
    }
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "trace": str(trace),
        "trace_gib": gib,
        "steps": facts.get("trace.steps"),
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "trace_on_disk_gib": trace.stat().st_size / 2**30,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "analyze_outputs_identical": same,
        "versions": {
            "python": platform.python_version(),
            **{k: _version(k) for k in ("vlmdoctor", "msgspec", "pandas", "numpy", "traceinsight")},
        },
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "runs": {k: len(v) for k, v in rows.items()},
        "median": med,
        "all": rows,
    }


def _save(args: argparse.Namespace, result: dict) -> None:
    print(json.dumps({k: v for k, v in result.items() if k != "all"}, indent=2), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.doc:
        _write_doc(Path(args.doc), result, " ".join(sys.argv[1:]), args.section, args.title)


def _write_doc(doc: Path, r: dict, argv: str, section: str = "", title: str = "") -> None:
    """The table between this section's markers of `doc` (appended with its markers where they are missing)."""
    gib, med, base = r["trace_gib"], r["median"], r["median"]["json.load"]
    gz = r["trace"].endswith(".gz")
    start, end = (MARK.format(f":{section}" if section else "", k) for k in ("start", "end"))
    lines = [
        start,
        f"### {title or f'Analyzing a {gib:.2f} GiB trace'} ({r['cores']}-core CPU machine, {r['date'][:10]})",
        "",
        "| | runs | wall time (median) | s per GiB of JSON | x json.load's wall time | CPU time (user+sys) | "
        "x json.load's CPU time | peak RSS (all processes) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, m in med.items():
        lines.append(
            f"| {k} | {r['runs'][k]} | {m['wall_s']:.1f} s | {m['wall_s'] / gib:.1f} | "
            f"{m['wall_s'] / base['wall_s']:.2f} | {m['cpu_s']:.1f} s | {m['cpu_s'] / base['cpu_s']:.2f} | "
            f"{m['peak_rss_gb']:.2f} GB |"
        )
    v = r["versions"]
    what = (
        f"{r['trace_on_disk_gib']:.3f} GiB gzip (level 9, as torch.profiler writes it) of {gib:.2f} GiB of JSON; "
        "json.load reads it through gzip.open, so both pay the inflation; `inflate only` is that zlib time alone"
        if gz
        else f"{gib:.2f} GiB of plain JSON"
    )
    lines += [
        "",
        f"Machine: {r['cores']} cores ({r['cpu']}), shared: load average {r['load_average_before'][0]:.1f} "
        f"(1 min) when the runs started and {r['load_average_after'][0]:.1f} when they ended, so wall times "
        "carry the other work's share of the cores; CPU time is the process tree's own. Trace: "
        f"{what}, {r['steps']} steps, built by `bench/make_big_trace.py` from the recorded default-config H100 trace. "
        "`analyze` is the command (a file is read in parts only by idle cores; a rank folder's files go a process "
        "each, up to one per core); `analyze, one process` (where given) is the same "
        "command with its analysis held to one process"
        + (
            f"; their facts were {'identical' if r['analyze_outputs_identical'] else 'NOT identical'}"
            if "analyze, one process" in med
            else ""
        )
        + (
            ""
            if r.get("baseline_outputs_identical") is None
            else "; `analyze (baseline)` is the analyzer before this change, run in the same rounds: its JSON "
            f"output was {'byte for byte the same' if r['baseline_outputs_identical'] else 'NOT the same'}"
        )
        + f". Versions: Python {v['python']}, vlmdoctor {v['vlmdoctor']} (commit {r['commit']} plus the working "
        f"tree), msgspec {v['msgspec']}, pandas {v['pandas']}, numpy {v['numpy']}, traceinsight {v['traceinsight']}. "
        "Each row is the median of its runs; rounds interleave json.load and the analyzer. Command:",
        "",
        "```bash",
        f"python bench/analysis_speed.py {argv}",
        "```",
        end,
    ]
    text = doc.read_text()
    block = "\n".join(lines)
    if start in text:
        i, j = text.index(start), text.index(end) + len(end)
        text = text[:i] + block + text[j:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def json_gib(trace: Path) -> float:
    """GiB of JSON text in the trace: its size, or for .gz the size gzip's trailer records (ISIZE: exact
    under 4 GiB for one gzip member, as torch.profiler writes)."""
    if not trace.name.endswith(".gz"):
        return trace.stat().st_size / 2**30
    with open(trace, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return int.from_bytes(f.read(4), "little") / 2**30


if __name__ == "__main__":
    main()
