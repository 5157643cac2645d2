"""cProfile of `build_patient` on the GPU: what the 16 s between 'building model' and the warm-up hold.

python3 bench/treat11/buildprof.py CONFIG.yaml OUT.txt
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from vlmdoctor.run import runner
from vlmdoctor.run.config import RunConfig

cfg = RunConfig.load(sys.argv[1])
t0 = time.perf_counter()
prof = cProfile.Profile()
prof.enable()
patient = runner.build_patient(cfg, torch.device("cuda"))
torch.cuda.synchronize()
t1 = time.perf_counter()
next(patient.batches)  # the first batch: the loader workers start here
t2 = time.perf_counter()
prof.disable()
with open(sys.argv[2], "w") as out:
    out.write(f"build_patient {t1 - t0:.2f} s, first batch {t2 - t1:.2f} s\n")
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
print(open(sys.argv[2]).read()[:200])
