"""One measured run of `vlmdoctor profile`: one process, or a job of several ranks launched through torchrun
together with the one-GPU reference of its scaling efficiency (read from a report, or measured first).

The launcher's own pieces (the rendezvous, the torchrun command, the reference's config and its checks) are in
run/distributed.py, the runs themselves in run/runner.py; this module puts them in order (docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmdoctor.errors import UsageError
from vlmdoctor.run import distributed, runner, throughput
from vlmdoctor.run.capture import TraceOptions
from vlmdoctor.run.config import RunConfig

#: how a run says how far it is: (phase, done, total)
Progress = Callable[[str, int, int], None]


@dataclass
class Launch:
    """How a job of several ranks is started, and where the reference of its scaling efficiency comes from."""

    rdzv: distributed.Rendezvous = field(default_factory=distributed.Rendezvous)
    #: a report of the same config on one GPU (its path; `reference` is what was read from it)
    one_gpu_report: str | None = None
    #: run the same config on one GPU first, in this command
    measure_one_gpu: bool = False
    reference: dict[str, Any] | None = None

    def given(self) -> bool:
        """Any option of a job of several ranks given (torchrun's beyond --standalone, or a reference)."""
        return bool(self.one_gpu_report or self.measure_one_gpu or self.rdzv.args() != ["--standalone"])


def check(cfg: RunConfig, launch: Launch) -> None:
    """The launch options belong to a run with --parallel ddp or fsdp2, and agree with each other; before any run."""
    if not distributed.is_distributed(cfg):
        if launch.given():
            raise UsageError(
                "--one-gpu-report, --measure-one-gpu and the torchrun options (--nnodes, --rdzv-*, "
                "--master-*) belong to a run with --parallel ddp or fsdp2"
            )
        return
    launch.rdzv.check()
    if launch.one_gpu_report and launch.measure_one_gpu:
        raise UsageError("give --one-gpu-report or --measure-one-gpu, not both")


def take_reference(cfg: RunConfig, launch: Launch, report: dict[str, Any]) -> None:
    """The report read from --one-gpu-report as the job's reference, once it is the same config on one GPU."""
    distributed.check_reference(cfg.to_dict(), report, launch.one_gpu_report or "the one-GPU report")
    launch.reference = report


def measure(
    cfg: RunConfig, trace: TraceOptions | None, launch: Launch, progress: Progress | None = None
) -> dict[str, Any]:
    """The run's report: one process, or the job of several ranks with its scaling efficiency against the reference.

    The runner's functions are looked up when called (`runner.run_profile`), so a test can stand in for them."""
    if not distributed.is_distributed(cfg):
        return runner.run_profile(cfg, progress, trace) if progress else runner.run_profile(cfg, trace=trace)
    reference, source = launch.reference, launch.one_gpu_report
    if launch.measure_one_gpu:
        reference, source = one_gpu_reference(cfg, progress), "measured first in this command (--measure-one-gpu)"
    result = runner.run_distributed(cfg, trace, launch.rdzv, progress or (lambda *_: None))
    if "distributed" in result and reference is not None:
        add_scaling(result, reference, source)
    return result


def one_gpu_reference(cfg: RunConfig, progress: Progress | None = None) -> dict[str, Any]:
    """The same config on one GPU in a fresh process, under the CPU threads torchrun gives each rank, undiagnosed."""
    if progress:
        progress("one-GPU reference run", 0, 1)
    report = runner.run_isolated(distributed.one_gpu_config(cfg), diagnose=False, env=distributed.rank_threads_env(cfg))
    if progress:
        progress("one-GPU reference run", 1, 1)
    return report


def add_scaling(result: dict[str, Any], reference: dict[str, Any], source: str | None) -> None:
    """The job's scaling efficiency against the one-GPU reference, in place; a reference that did not finish is a
    warning instead."""
    ref_tps = (reference.get("metrics") or {}).get("real_tokens_per_s")
    if reference.get("status") != "ok" or not ref_tps:
        result.setdefault("warnings", []).append(
            f"the one-GPU reference run ended with status {reference.get('status')}: no scaling efficiency"
        )
        return
    result["distributed"]["scaling"] = throughput.scaling(
        result["metrics"]["real_tokens_per_s"],
        result["distributed"]["world_size"],
        ref_tps,
        source,
        {
            "job's": (result.get("throughput") or {}).get("unstable_reason"),
            "one-GPU reference's": (reference.get("throughput") or {}).get("unstable_reason"),
        },
    )
