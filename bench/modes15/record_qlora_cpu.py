"""Record the QLoRA CPU trace fixture (fixtures/mode_traces/qlora_tiny_cpu.pt.trace.json.gz).

bitsandbytes 0.50 has CPU kernels for its 4-bit ops, so a real QLoRA step of the tiny preset runs on
the CPU: NF4 Linear4bit layers (bitsandbytes::dequantize_4bit, dequantize_blockwise for the double-
quantized statistics, gemm_4bit) under peft LoRA. vlmdoctor itself refuses --train qlora on CPU
(QLoRA is for GPUs); this script lifts that check for the recording only. bitsandbytes is not a
dependency of vlmdoctor or of its tests: install it anywhere on the path first, e.g.

    pip install --target /tmp/bnb --no-deps bitsandbytes==0.50.2
    PYTHONPATH=$PWD:/tmp/bnb python bench/modes15/record_qlora_cpu.py
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from vlmdoctor.run import modes, runner
from vlmdoctor.run.capture import TraceOptions
from vlmdoctor.run.config import RunConfig

OUT = Path(__file__).resolve().parents[2] / "fixtures" / "mode_traces" / "qlora_tiny_cpu.pt.trace.json.gz"


def main() -> None:
    import bitsandbytes

    modes.check_mode_device = lambda cfg, device: None  # the recording only: vlmdoctor refuses QLoRA on CPU
    torch.set_num_threads(2)
    cfg = RunConfig(
        model="tiny",
        device="cpu",
        train="qlora",
        lora_rank=4,
        steps=1,
        warmup=1,
        num_samples=2,
        batch_size=1,
        gradient_checkpointing=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        report = runner.run_profile(cfg, trace=TraceOptions(tmp, steps=1))
        assert report["status"] == "ok", report.get("error")
        OUT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(report["trace"]["path"], OUT)
    print(
        f"bitsandbytes {bitsandbytes.__version__}: {OUT} ({OUT.stat().st_size / 1024:.0f} KiB), "
        f"{report['metrics']['step_ms']:.0f} ms/step"
    )


if __name__ == "__main__":
    main()
