"""The environment a number was measured in: a number without it cannot be compared."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from typing import Any

import torch


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
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
        env.update(gpu=None, driver=None, cuda=None)
    return env
