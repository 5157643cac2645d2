"""Measure `vlmdoctor gate --remeasure-baseline` on this machine, as it is loaded right now.

Issue 11's target: 0 false alarms over >= 10 same-config gates on the 2-core CI host, and every
>= 10% slowdown caught. This script checks both with real runs of the tiny preset on CPU:

- two detached checkouts of one commit under --work: `base` as it is, `slow` with a deliberate
  slowdown in `train_step`: after the step it does 64x64 matmuls for VLMDOCTOR_BENCH_SLOWDOWN x
  the step's own CPU time (0.125 -> -11.1% tokens/s, 0.25 -> -20%, whatever the load: more work,
  not a wait);
- the truth: plain `vlmdoctor profile` runs of base and of each slowdown, in rotating order, so
  the real drop is measured independently of the gate;
- the gates, interleaved (same, slow 1, slow 2, same, ...) so a load change touches all kinds:
  same config = both sides the `base` checkout; slowdown = current side the `slow` checkout,
  baseline side `--baseline-env PYTHONPATH=<base>`.

Every gate's exit code, verdict JSON (ratio, interval, pairs, ratios, per-run values), wall time
and load average go to OUT/gates.jsonl; the truth runs (one thread, as the gate runs them) to
OUT/truth.jsonl; OUT/summary.md is rewritten after every gate. Run from the repository root, in
the background; two streams (same config; slowdowns) get twice the gates in the same hour:

    nohup python bench/gate_cpu/measure.py --out R/same --work /tmp/gb-a --kinds 0 > a.log 2>&1 &
    nohup python bench/gate_cpu/measure.py --out R/slow --work /tmp/gb-b --kinds 0.125,0.25 \
        --truth-rounds 0 > b.log 2>&1 &

Options after `--` go to every gate (e.g. `-- --cpu-threads 0` for the gate as it was before).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROFILE = ["--model", "tiny", "--device", "cpu", "--autocast", "off", "--no-diagnose", "--quiet"]
SLOW_PATCH_AT = "    p.optimizer.zero_grad(set_to_none=True)\n    return loss_sum, total\n"
SLOW_PATCH = """    p.optimizer.zero_grad(set_to_none=True)
    _frac = float(os.environ.get("VLMDOCTOR_BENCH_SLOWDOWN", "0"))  # bench/gate_cpu: a deliberate slowdown
    if _frac > 0:
        _end = time.process_time() + _frac * (time.process_time() - _t0)
        _a = torch.full((64, 64), 0.01)
        while time.process_time() < _end:
            _a = torch.mm(_a, _a).clamp_(-1, 1)
    return loss_sum, total
"""


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def checkouts(work: Path, ref: str) -> tuple[Path, Path]:
    """Two detached worktrees of `ref`: base as it is, slow with the patched train_step."""
    work.mkdir(parents=True, exist_ok=True)
    trees = []
    for name in ("base", "slow"):
        path = work / name
        if path.exists():
            sh(["git", "worktree", "remove", "--force", str(path)])
        r = sh(["git", "worktree", "add", "--detach", str(path), ref])
        if r.returncode:
            sys.exit(f"git worktree add failed: {r.stderr}")
        trees.append(path)
    runner = trees[1] / "vlmdoctor/run/runner.py"
    src = runner.read_text()
    head = "    cfg = p.cfg\n    dtype = "
    if SLOW_PATCH_AT not in src or head not in src:
        sys.exit("train_step changed: update SLOW_PATCH in bench/gate_cpu/measure.py")
    src = src.replace(head, "    cfg = p.cfg\n    _t0 = time.process_time()\n    dtype = ", 1)
    runner.write_text(src.replace(SLOW_PATCH_AT, SLOW_PATCH, 1))
    return trees[0], trees[1]


def env_for(tree: Path, slowdown: float, threads: int = 0) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "VLMDOCTOR_BENCH_SLOWDOWN": str(slowdown)}
    if threads:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return env


def profile(tree: Path, slowdown: float, args: argparse.Namespace, out: Path) -> dict:
    """One plain profile run; its report."""
    cmd = [
        sys.executable,
        "-m",
        "vlmdoctor",
        "profile",
        *PROFILE,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--json",
        str(out),
        "--force",
    ]
    r = sh(cmd, env=env_for(tree, slowdown, args.truth_threads), cwd=tree)
    if r.returncode:
        sys.exit(f"profile failed: {r.stderr[-2000:]}")
    return json.loads(out.read_text())


def run_tps(report: dict, key: str = "step_ms") -> float:
    """What the gate takes from one run: the median over its timed steps of real tokens/s."""
    return statistics.median(t / (ms / 1000) for r in report["repeats"] for t, ms in zip(r["step_real_tokens"], r[key]))


def summarize(out: Path, truth: list[dict], gates: list[dict], fracs: list[float]) -> str:
    lines = [f"# gate on this machine: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    if truth:
        lines += [
            "## truth: plain profile runs (a run's median step, real tokens/s)",
            "",
            "| code | runs | wall-time tokens/s | drop vs base | CPU-time tokens/s | drop vs base |",
            "|---|---|---|---|---|---|",
        ]
        base = statistics.median(t["tps"] for t in truth if t["slowdown"] == 0)
        cbase = statistics.median(t["cpu_tps"] for t in truth if t["slowdown"] == 0)
        for f in [0.0, *fracs]:
            v = [t["tps"] for t in truth if t["slowdown"] == f]
            c = [t["cpu_tps"] for t in truth if t["slowdown"] == f]
            if v:
                lines.append(
                    f"| slowdown {f:g} | {len(v)} | {statistics.median(v):,.0f} | "
                    f"{(statistics.median(v) / base - 1) * 100:+.1f}% | {statistics.median(c):,.0f} | "
                    f"{(statistics.median(c) / cbase - 1) * 100:+.1f}% |"
                )
        lines.append("")
    lines += [
        "## gates",
        "",
        "| kind | gates | failed (exit 1) | exit 2 | median pairs | past max-pairs | "
        "median ratio | ratios of the verdicts | minutes each |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in [0.0, *fracs]:
        g = [x for x in gates if x["slowdown"] == f]
        if not g:
            continue
        ok = [x for x in g if x["rc"] in (0, 1)]
        pairs = [x["pairs"] for x in ok]
        ratios = [x["ratio"] for x in ok]
        kind = "same config" if f == 0 else f"slowdown {f:g}"
        lines.append(
            f"| {kind} | {len(g)} | {sum(x['rc'] == 1 for x in g)} | {sum(x['rc'] == 2 for x in g)} | "
            f"{statistics.median(pairs) if pairs else '-'} | {sum(bool(x.get('extended')) for x in ok)} | "
            f"{statistics.median(ratios) if ratios else float('nan'):.3f} | "
            + " ".join(f"{r:.3f}" for r in ratios)
            + f" | {statistics.median(x['wall_s'] for x in g) / 60:.1f} |"
        )
    logs = [math.log(r) for x in gates if x["slowdown"] == 0 and x["rc"] in (0, 1) for r in x["ratios"]]
    if len(logs) > 2:
        lines += [
            "",
            f"same-config pair log-ratios: n={len(logs)}, sd={statistics.stdev(logs):.4f}, "
            f"median |log r| = {statistics.median(abs(v) for v in logs):.4f}, max |log r| = "
            f"{max(abs(v) for v in logs):.4f}",
        ]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def resummarize(out: Path) -> str:
    """summary.md again from a folder's truth.jsonl and gates.jsonl (after a stream was stopped)."""
    rows = (
        [json.loads(x) for x in (out / "gates.jsonl").read_text().splitlines()]
        if (out / "gates.jsonl").exists()
        else []
    )
    truth = (
        [json.loads(x) for x in (out / "truth.jsonl").read_text().splitlines()]
        if (out / "truth.jsonl").exists()
        else []
    )
    fracs = sorted({x["slowdown"] for x in rows + truth} - {0.0})
    return summarize(out, truth, rows, fracs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the results")
    ap.add_argument("--work", default="/tmp/vlmdoctor-gate-bench", help="folder for the two checkouts")
    ap.add_argument("--ref", default="HEAD", help="the commit to measure (its gate and its training step)")
    ap.add_argument("--gates", type=int, default=10, help="gates of each kind")
    ap.add_argument("--fracs", default="0.125,0.25", help="slowdowns: extra busy time per step, x the step time")
    ap.add_argument("--kinds", default=None, help="which kinds to gate (default: 0 and every slowdown), e.g. 0.125")
    ap.add_argument("--truth-rounds", type=int, default=3, help="plain profile runs of each code")
    ap.add_argument("--truth-threads", type=int, default=1, help="OMP threads of the truth runs (0: default)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("gate_args", nargs="*", help="more gate options, after --")
    ap.add_argument(
        "--summary-only",
        action="store_true",
        help="rewrite OUT/summary.md from its jsonl files, measure nothing",
    )
    args = ap.parse_args()
    out = Path(args.out).resolve()
    if args.summary_only:
        print(resummarize(out), flush=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    fracs = [float(f) for f in args.fracs.split(",")]
    base_tree, slow_tree = checkouts(Path(args.work), args.ref)
    commit = sh(["git", "-C", str(base_tree), "rev-parse", "HEAD"]).stdout.strip()
    (out / "setup.json").write_text(
        json.dumps(
            {
                "commit": commit,
                "args": vars(args),
                "nproc": os.cpu_count(),
                "profile": PROFILE,
                "cpu": _cpu_model(),
            },
            indent=1,
        )
    )
    print(f"measuring {commit} in {base_tree} and {slow_tree}", flush=True)

    # the baseline report the gates read (its config: tiny, CPU, fp32, steps x repeats)
    base_json = out / "base.json"
    profile(base_tree, 0.0, args, base_json)

    truth: list[dict] = []
    kinds = [0.0, *fracs]
    for i in range(args.truth_rounds):
        k = i % len(kinds)
        for f in kinds[k:] + kinds[:k]:
            rep = profile(slow_tree if f else base_tree, f, args, Path(args.work) / "truth.json")
            row = {
                "round": i,
                "slowdown": f,
                "tps": run_tps(rep),
                "cpu_tps": run_tps(rep, "step_cpu_ms"),
                "repeats": [r["real_tokens_per_s"] for r in rep["repeats"]],
                "step_ms": [round(v, 1) for r in rep["repeats"] for v in r["step_ms"]],
                "load": os.getloadavg()[0],
                "t": time.time(),
            }
            truth.append(row)
            with open(out / "truth.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"truth {f:g}: {row['tps']:,.0f} wall, {row['cpu_tps']:,.0f} CPU", flush=True)
    print(summarize(out, truth, [], fracs), flush=True)

    gates: list[dict] = []
    # the same config and the smaller slowdown alternate first (the target's two halves); the
    # larger slowdowns follow, so a measurement cut short still has both halves of the target
    gated = [float(k) for k in args.kinds.split(",")] if args.kinds else kinds
    plan = [(i, f) for i in range(args.gates) for f in gated[:2]] + [
        (i, f) for i in range(args.gates) for f in gated[2:]
    ]
    for i, f in plan:
        if True:
            verdict = out / f"gate-{i:02d}-{f:g}.json"
            cmd = [
                sys.executable,
                "-m",
                "vlmdoctor",
                "gate",
                "--baseline",
                str(base_json),
                "--remeasure-baseline",
                "--json",
                str(verdict),
                "--force",
                *args.gate_args,
            ]
            if f:
                cmd += ["--baseline-env", f"PYTHONPATH={base_tree}"]
            load0, t0 = os.getloadavg()[0], time.time()
            # cwd: `python -m vlmdoctor` imports from the working folder before PYTHONPATH
            r = sh(cmd, env=env_for(slow_tree if f else base_tree, f), cwd=slow_tree if f else base_tree)
            row = {
                "gate": i,
                "slowdown": f,
                "rc": r.returncode,
                "wall_s": time.time() - t0,
                "load_start": load0,
                "load_end": os.getloadavg()[0],
                "t": t0,
            }
            if verdict.exists():
                res = json.loads(verdict.read_text())
                tp = next(c for c in res["checks"] if c["name"] == "throughput")
                row |= {
                    k: tp.get(k)
                    for k in (
                        "ratio",
                        "ci_low",
                        "ci_high",
                        "pairs",
                        "ratios",
                        "base_values",
                        "cur_values",
                        "detail",
                        "median_ratio",
                        "slower_ci_high",
                        "extended",
                    )
                }
                row["summary"] = res["summary"]
            else:
                row["stderr"] = r.stderr[-1000:]
            gates.append(row)
            with open(out / "gates.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(
                f"gate {i} slowdown {f:g}: exit {r.returncode}, {row.get('pairs')} pairs, "
                f"ratio {row.get('ratio')}, {row['wall_s']:.0f} s",
                flush=True,
            )
            summarize(out, truth, gates, fracs)
    print(summarize(out, truth, gates, fracs), flush=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
