"""Kernel launches: how many, how many too small to pay for their launch, and the launch path's delay."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading

PRODUCES = by_producer(__name__)
LAUNCH_CALLS = re.compile(
    r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx|cudaLaunchCooperativeKernel)"
)
TINY_KERNEL_US = 10.0  # under this a kernel is mostly launch overhead on current GPUs


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
