"""Record the trace fixtures of fixtures/traces/ on a GPU, through `vlmdoctor profile` itself.

    python bench/record_fixtures.py --out OUTDIR [--only name1,name2] [--trace-steps 2]

Each fixture runs in its own process with `--trace-dir` (record_shapes on), writes
NAME.pt.trace.json.gz and NAME.report.json, and a manifest.json with the exact command, the
versions, the device and the date. Everything is packed into OUTDIR/fixtures.tar.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def flags(knobs: dict) -> list[str]:
    out = []
    for k, v in knobs.items():
        name = {
            "liger_fused_linear_cross_entropy": "liger-fused-ce",
            "checkpoint_use_reentrant": "checkpoint-reentrant",
        }.get(k, k.replace("_", "-"))
        if isinstance(v, bool):
            out.append(f"--{name}" if v else f"--no-{name}")
        else:
            out += [f"--{name}", str(v)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only")
    ap.add_argument("--trace-steps", type=int, default=2)
    args = ap.parse_args()
    spec = yaml.safe_load((ROOT / "bench/grids/fixtures.yaml").read_text())
    out = Path(args.out) / "traces"
    out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for fx in spec["fixtures"]:
        if args.only and fx["name"] not in args.only.split(","):
            continue
        knobs = {**spec["defaults"], **fx["set"]}
        cmd = [
            "vlmdoctor",
            "profile",
            "--stage",
            str(fx["stage"]),
            *flags(knobs),
            "--trace-dir",
            f"tmp_{fx['name']}",
            "--trace-steps",
            str(args.trace_steps),
            "--trace-shapes",
            "--json",
            f"{fx['name']}.report.json",
            "--quiet",
        ]
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "vlmdoctor", *cmd[1:]], cwd=out, capture_output=True, text=True)
        wall = time.time() - t0
        traces = glob.glob(str(out / f"tmp_{fx['name']}" / "*.json.gz"))
        entry = {
            "name": fx["name"],
            "stage": fx["stage"],
            "why": fx["why"],
            "command": " ".join(cmd),
            "exit_code": proc.returncode,
            "wall_s": round(wall, 1),
        }
        if traces:
            dest = out / f"{fx['name']}.pt.trace.json.gz"
            shutil.move(traces[0], dest)
            entry["trace_bytes"] = dest.stat().st_size
        shutil.rmtree(out / f"tmp_{fx['name']}", ignore_errors=True)
        rep_path = out / f"{fx['name']}.report.json"
        if rep_path.exists():
            rep = json.loads(rep_path.read_text())
            entry.update(
                status=rep["status"],
                env=rep.get("env"),
                created_at=rep.get("created_at"),
                real_tokens_per_s=(rep.get("metrics") or {}).get("real_tokens_per_s"),
            )
        else:
            entry["stderr_tail"] = proc.stderr[-1500:]
        manifest.append(entry)
        print(
            f"{fx['name']}: exit {proc.returncode}, {entry.get('trace_bytes', 0) / 2**20:.2f} MiB, {wall:.0f}s "
            f"{entry.get('status', '')} {entry.get('stderr_tail', '')[-300:]}",
            flush=True,
        )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    with tarfile.open(Path(args.out) / "fixtures.tar", "w") as tar:
        tar.add(out, arcname="traces")
    print(
        f"packed {Path(args.out) / 'fixtures.tar'}: {os.path.getsize(Path(args.out) / 'fixtures.tar') / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
