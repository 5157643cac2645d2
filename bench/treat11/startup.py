"""Where a profile run's wall time goes before and around its timed steps.

    python3 bench/treat11/startup.py CONFIG.yaml OUT.json

A treat ladder spends about 37 s a run on one H100 while its 40 timed and warm-up steps take
6-10 s; this times the imports, each progress phase of `run_profile`, and the whole run, without
the profiler window (trace=None), so the overhead a shorter run could save is measured, not guessed.
"""

from __future__ import annotations

import json
import sys
import time

T0 = time.perf_counter()
marks: list[tuple[str, float]] = []


def mark(name: str) -> None:
    marks.append((name, round(time.perf_counter() - T0, 3)))


import torch  # noqa: E402

mark("import torch")
import transformers  # noqa: E402,F401

mark("import transformers")
from vlmdoctor.run import runner  # noqa: E402
from vlmdoctor.run.config import RunConfig  # noqa: E402

mark("import vlmdoctor")
seen: set[str] = set()


def progress(label: str, done: int, total: int) -> None:
    if label not in seen:
        seen.add(label)
        mark(f"start: {label}")


cfg = RunConfig.load(sys.argv[1])
report = runner.run_profile(cfg, progress)
mark("report")
if torch.cuda.is_available():
    torch.cuda.synchronize()
out = {
    "marks": marks,
    "status": report["status"],
    "warmup": report.get("warmup"),
    "tokens_per_s": (report.get("metrics") or {}).get("real_tokens_per_s"),
    "step_ms": (report.get("metrics") or {}).get("step_ms"),
}
json.dump(out, open(sys.argv[2], "w"), indent=1)
for name, t in marks:
    print(f"{t:8.2f} s  {name}")
