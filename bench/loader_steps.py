"""Each single-process loader call (`enumerate(DataLoader)#...__next__`) of a torch.profiler trace, in order: its
wall time, how many CPU ops ran in it, and the time of the pixel tensors' elementwise ops with stack and cat, and of
the copies. Why: on llava-siglip2-0.5b the loader's wait read at the start moves per sample to x9-30 where the
in-process pairs measured x1.3-1.4 (docs/treat.md, the calibration's far-off rows); two committed H100 traces show
the first traced step's loader call 4.6-5.6x the second's.

    python bench/loader_steps.py TRACE.pt.trace.json[.gz] ...
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from vlmdoctor.trace.read import iter_events

PIXEL_OPS = ("aten::mul_", "aten::sub_", "aten::div_", "aten::add_", "aten::stack", "aten::cat")


def main(paths: list[str]) -> None:
    for path in paths:
        events = [e for e in iter_events(Path(path)) if e.get("ph") == "X"]
        calls = sorted((e for e in events if "DataLoader" in e.get("name", "")), key=lambda e: e["ts"])
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        print(path)
        for c in calls:
            start, end = c["ts"], c["ts"] + c["dur"]
            inside = [e for e in ops if e.get("tid") == c.get("tid") and start <= e["ts"] and e["ts"] + e["dur"] <= end]
            by = collections.defaultdict(float)
            for e in inside:
                by[e["name"]] += e["dur"]
            pixel = sum(by[n] for n in PIXEL_OPS) / 1000
            copies = by["aten::copy_"] / 1000
            print(f"  {c['dur'] / 1000:8.1f} ms  {len(inside):5d} ops  pixel {pixel:7.1f} ms  copies {copies:6.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
