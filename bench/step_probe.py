"""Time a few configurations in one process each and show where a step's time goes.

    python bench/step_probe.py --set model=0.5b --set stage=2 --profile
    python bench/step_probe.py --set attention=efficient --set pad_to_multiple_of=64

Prints per-step times (not only the median: variance is a symptom) and, with --profile, the
top ops by self CUDA time and by self CPU time over three steps under torch.profiler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlmdoctor.run.checks import resolve_device  # noqa: E402
from vlmdoctor.run.config import RunConfig  # noqa: E402
from vlmdoctor.run.patient import build_patient  # noqa: E402
from vlmdoctor.run.patient import sync as _sync  # noqa: E402
from vlmdoctor.run.runner import train_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    cfg = RunConfig.from_dict({k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)})
    dev = resolve_device(cfg)
    p = build_patient(cfg, dev)
    for _ in range(3):
        train_step(p)
    _sync(dev)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_step(p)
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    print(
        f"{' '.join(args.set)}: median {statistics.median(times):.1f} ms; steps: {' '.join(f'{t:.0f}' for t in times)}"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(3):
                train_step(p)
            _sync(dev)
        ka = prof.key_averages()
        if dev.type == "cuda":
            print(ka.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=70))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))


if __name__ == "__main__":
    main()
