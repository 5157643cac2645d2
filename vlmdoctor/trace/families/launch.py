"""Kernel launches: how many, how many too small to pay for their launch, the launch path's delay, and how long
the GPU sat idle waiting for a launch (the time launches, not the GPU, set the pace)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import SYNC_CALLS, Reading

PRODUCES = by_producer(__name__)
LAUNCH_CALLS = re.compile(
    r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx|cudaLaunchCooperativeKernel)"
)
TINY_KERNEL_US = 10.0  # under this a kernel is mostly launch overhead on current GPUs
#: a kernel that starts this soon after its launch call began found no queue ahead of it: the GPU was waiting for it
#: (a launch call takes 3-10 us and the kernel starts a few us after it returns on the H100 and H200 traces)
STARVED_US = 30.0
#: an idle gap longer than this before a kernel is host work other than the launch path's (a cuDNN plan, a loader,
#: the loop's own Python): the per-kernel cost of eager dispatch and launch is tens of microseconds
MAX_LAUNCH_GAP_US = 1000.0
#: a sync drains the queue; for this long after it returns the host refills it one launch at a time, and the gaps
#: are the sync's cost, not the launches' (qwen3vl_tuned: 107 syncs a step, 12% of its step idle within 1 ms of one)
REFILL_US = 1000.0


def produce(r: Reading, facts: dict[str, Any]) -> None:
    g, n = r.t.gpu, r.n
    kern = g[g["cat"] == "kernel"]
    facts["launch.kernels"] = len(kern) / n
    facts["launch.tiny_kernel_frac"] = float((kern["dur"] < TINY_KERNEL_US).mean()) if len(kern) else 0.0
    rt = r.t.runtime
    launches = rt[rt["name"].str.match(LAUNCH_CALLS)]
    facts["launch.api_ms"] = float(launches["dur"].sum()) / 1e3 / n
    rtc = rt.loc[rt["corr"] >= 0, ["corr", "ts"]].drop_duplicates("corr")
    joined = kern[kern["corr"] >= 0].merge(rtc.rename(columns={"ts": "rt_ts"}), on="corr", how="inner")
    delay = (joined["ts"] - joined["rt_ts"]).to_numpy()
    if len(delay):
        facts["launch.delay_us_median"] = float(np.median(delay))
        facts["launch.delay_us_p90"] = float(np.percentile(delay, 90))
        starts = joined["ts"].to_numpy()[delay < STARVED_US]
        syncs = rt[rt["name"].str.match(SYNC_CALLS)]
        facts["launch.starved_ms"] = _starved_ms(r, starts, np.sort(syncs["end"].to_numpy())) / 1e3 / n


def _starved_ms(r: Reading, starts: np.ndarray, sync_ends: np.ndarray) -> float:
    """GPU idle (us, all steps) that ended when a kernel started right after its launch: the launches set the pace.

    Gaps longer than MAX_LAUNCH_GAP_US are other host work, and gaps ending within REFILL_US of a sync's return are
    the sync's (the queue it drained, refilled launch by launch): a GPU-paced step with syncs in its forward shows
    kernels that start on launch there too, and compiling would not remove them.
    """
    lo, hi = r.idle
    if not len(lo) or not len(starts):
        return 0.0
    waited = np.isin(hi, starts) & (hi - lo <= MAX_LAUNCH_GAP_US)
    if len(sync_ends):  # a trace with no synchronizing call has no refill to leave out
        k = np.searchsorted(sync_ends, hi, side="right") - 1  # the last sync to return before the gap closed
        refill = (k >= 0) & (hi - sync_ends[np.maximum(k, 0)] < REFILL_US)
    else:
        refill = np.zeros(len(hi), dtype=bool)
    return float((hi - lo)[waited & ~refill].sum())
