"""The environment a number was measured in: a number without it cannot be compared."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import time
from importlib import metadata
from typing import Any

import torch


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    """The CPU's model name: on a CPU run it is the hardware, as the GPU's name is on a GPU run."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _driver() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def collect(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device_type": device.type,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "liger_kernel": _version("liger-kernel") or _version("liger_kernel"),
        "triton": _version("triton"),
        "vlmdoctor": _version("vlmdoctor"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            gpu_mem_total_gb=round(props.total_memory / 2**30, 2),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            driver=_driver(),
        )
    else:
        env.update(
            gpu=None,
            driver=None,
            cuda=None,
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            cpu_matmul_gflops=dict(_probed(torch.get_num_threads())),
        )
    return env


PROBE_SHAPE = (1024, 256, 256)  # M, K, N: the order of the tiny preset's projections (1,568 x 64 x 256)
#: the probe's rounds (each the best of PROBE_REPEATS calls) go on until two in a row agree within this share
PROBE_AGREE = 0.10
PROBE_REPEATS = 3
PROBE_MAX_ROUNDS = 12
#: a call at least this long ends its round: the timer's noise is nothing beside it (on a 2-core CPU without
#: native bf16 the probe's bf16 call took about 100 ms, and seven of them were 0.6 s of every CPU run)
PROBE_LONG_S = 0.02


def _rate(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """GFLOP/s of the best of `repeats` calls of a @ b (of the first, where it is long: `PROBE_LONG_S`)."""

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        if best >= PROBE_LONG_S:
            break
    m, k = a.shape
    return 2.0 * m * k * b.shape[1] / max(best, 1e-9) / 1e9


@functools.cache
def _probed(threads: int) -> dict[str, float]:
    """One probe a process and thread count: the CPU does not change between its runs (the tests' and a script's
    with two `Doctor` windows), and a second probe of it could read otherwise."""
    return matmul_probe()


def matmul_probe(repeats: int = PROBE_REPEATS, max_rounds: int = PROBE_MAX_ROUNDS) -> dict[str, float]:
    """GFLOP/s of one fp32 and one bf16 CPU matmul of the same shape, once warm.

    Whether this CPU multiplies bf16 natively (AMX, AVX512-BF16) or converts to fp32 and back shows
    only in a measurement; the CPU precision rule compares the two rates. The first bf16 calls are cold
    (oneDNN builds its kernels), so a rate is kept only once two rounds in a row agree: a rule must not
    flip on an unchanged run. The operands come from a generator of the probe's own: the user's random
    streams (torch's global generator above all) are never drawn from.
    """
    gen = torch.Generator().manual_seed(0)
    m, k, n = PROBE_SHAPE
    out: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(m, k, generator=gen).to(dtype)
        b = torch.randn(k, n, generator=gen).to(dtype)
        a @ b  # first call: allocation and kernel selection
        last = _rate(a, b, repeats)
        for _ in range(max_rounds - 1):
            now = _rate(a, b, repeats)
            settled = abs(now - last) <= PROBE_AGREE * max(now, last)
            last = max(now, last)
            if settled:
                break
        out[name] = last
    return out
