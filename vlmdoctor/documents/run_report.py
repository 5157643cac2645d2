"""The run report (report.json of `vlmdoctor profile`, `vlmdoctor run`, `Doctor`, `DoctorCallback`): one
measured run, its numbers by the one writer (run/metrics.py), its trace and its diagnosis; a job of several ranks
with each rank's numbers; and what a comparison needs of a report's numbers (`check_measured`)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from vlmdoctor.documents.base import (
    OWN_SOURCES,
    AllocRetries,
    Amount,
    CompileS,
    Count,
    Doc,
    DocumentError,
    ErrorInfo,
    FinalLoss,
    GiB,
    LossTokensPerS,
    Mfu,
    ModelTflopsPerS,
    Ms,
    Number,
    PadFraction,
    PeakMemGb,
    PeakMemReservedGb,
    RealTokensPerS,
    Seconds,
    StepMs,
    StepMsP10,
    StepMsP90,
    Tool,
    Version,
    WarmupS,
)
from vlmdoctor.documents.diagnosis import Diagnosis, Finding


class RecordedConfig(Doc, kw_only=True):
    """The knobs of a report's `config` that readers read by name (every knob: `vlmdoctor profile --help`)."""

    source: Annotated[
        str | None,
        Meta(
            description=f"{', '.join(OWN_SOURCES[:-1])} or {OWN_SOURCES[-1]}: the way in that measured the user's "
            "training"
        ),
    ] = None
    model: Annotated[str | None, Meta(description="zoo preset, or the user's model class")] = None
    stage: Annotated[int, Meta(ge=1, description="1: alignment (projector only), 2: instruction tuning")] | None = None
    vision: Annotated[str | None, Meta(description="vision tower (null: the preset's)")] = None
    llm: Annotated[str | None, Meta(description="language model (null: the preset's)")] = None
    projector: Annotated[str | None, Meta(description="projector (null: the preset's)")] = None
    pixel_shuffle: Annotated[int, Meta(ge=1, description="pixel-shuffle factor (null: the preset's)")] | None = None
    train: Annotated[str | None, Meta(description="full, lora or qlora")] = None
    device: Annotated[str | None, Meta(description="cuda, cpu or auto")] = None
    parallel: Annotated[str | None, Meta(description="none, ddp or fsdp2")] = None
    warmup: Annotated[Count, Meta(description="warm-up steps before the timed windows")] | None = None
    steps: Annotated[Count, Meta(description="timed steps a window")] | None = None


class Env(Doc, kw_only=True):
    """The machine and the software the run measured on."""

    device_type: Annotated[str | None, Meta(description="cuda or cpu")] = None
    gpu: Annotated[str | None, Meta(description="the GPU's model name (null on CPU)")] = None
    gpu_count: Annotated[Count, Meta(description="GPUs the process sees")] | None = None
    gpu_mem_total_gb: Annotated[GiB, Meta(description="the GPU's memory")] | None = None
    sm_count: Annotated[Count, Meta(description="the GPU's streaming multiprocessors")] | None = None
    compute_capability: Annotated[str | Number | None, Meta(description="the GPU's, e.g. 9.0")] = None
    driver: Annotated[str | None, Meta(description="NVIDIA driver version")] = None
    cuda: Annotated[str | None, Meta(description="CUDA version torch was built with")] = None
    cudnn: Annotated[int | None, Meta(description="cuDNN version number")] = None
    cpu_model: Annotated[str | None, Meta(description="the CPU's model name")] = None
    cpu_count: Annotated[Count, Meta(description="CPU cores the run had")] | None = None
    cpu_capability: Annotated[str | None, Meta(description="torch's CPU instruction set (AVX512, AMX, ...)")] = None
    cpu_matmul_gflops: Annotated[
        dict[str, Number | None] | None, Meta(description="measured CPU matmul GFLOP/s, by dtype")
    ] = None
    torch: Annotated[str | None, Meta(description="version")] = None
    transformers: Annotated[str | None, Meta(description="version")] = None
    liger_kernel: Annotated[str | None, Meta(description="version (null: not installed)")] = None
    triton: Annotated[str | None, Meta(description="version (null: not installed)")] = None
    python: Annotated[str | None, Meta(description="version")] = None
    platform: Annotated[str | None, Meta(description="the operating system")] = None
    vlmdoctor: Annotated[str | None, Meta(description="version")] = None


class Params(Doc, kw_only=True):
    """Parameter counts."""

    total: Annotated[Count, Meta(description="every parameter")] | None = None
    trainable: Annotated[Count, Meta(description="parameters with gradients")] | None = None
    vision: Annotated[Count, Meta(description="the vision tower's")] | None = None
    llm: Annotated[Count, Meta(description="the language model's")] | None = None
    projector: Annotated[Count, Meta(description="the projector's")] | None = None
    by_part: Annotated[dict[str, Any] | None, Meta(description="counts by model part (the user's model)")] = None


class ModelInfo(Doc, kw_only=True):
    """What was trained."""

    preset: Annotated[str | None, Meta(description="zoo preset (vlmdoctor's own runs)")] = None
    class_name: Annotated[str | None, Meta(description="the user's model class")] = msgspec.field(
        default=None, name="class"
    )
    vision: Annotated[str | None, Meta(description="vision tower")] = None
    llm: Annotated[str | None, Meta(description="language model")] = None
    projector: Annotated[str | None, Meta(description="projector")] = None
    native: Annotated[bool | None, Meta(description="a transformers VLM class, not the composite model")] = None
    image_tokens: Annotated[Count, Meta(description="LLM tokens per image")] | None = None
    llm_head_dim: Annotated[Count, Meta(description="the LLM's attention head size")] | None = None
    vision_head_dim: Annotated[Count, Meta(description="the vision tower's attention head size")] | None = None
    params: Params | None = None
    parts: Annotated[dict[str, Any] | None, Meta(description="module path of each model part found")] = None
    paths: Annotated[dict[str, Any] | None, Meta(description="module paths the advice names")] = None
    param_dtypes: Annotated[dict[str, Any] | None, Meta(description="parameter count by dtype")] = None


class DataInfo(Doc, kw_only=True):
    """Where the batches came from."""

    source: Annotated[str | None, Meta(description="synthetic, a --data file, or the way in")] = None
    samples: Annotated[Count, Meta(description="samples in the data")] | None = None
    length_model: Annotated[str | None, Meta(description="the length distribution of synthetic samples")] = None
    tokens_from: Annotated[str | None, Meta(description="batch or forward hook: where tokens were counted")] = None
    steps_seen: Annotated[Count, Meta(description="optimizer steps the way in saw")] | None = None
    records: Annotated[Count, Meta(description="records in a --data file")] | None = None
    skipped: Annotated[Count, Meta(description="records skipped (--bad-records skip)")] | None = None
    problems: Annotated[list[str] | None, Meta(description="the first skipped records' problems")] = None


class RunError(ErrorInfo, kw_only=True):
    """How a run that did not finish cleanly ended; an out-of-memory, with what it asked for."""

    requested_gb: Annotated[GiB, Meta(description="out of memory: the allocation that failed")] | None = None
    peak_mem_gb_before_failure: Annotated[GiB, Meta(description="out of memory: the peak allocated before")] | None = (
        None
    )
    device_mem_total_gb: Annotated[GiB, Meta(description="out of memory: the device's memory")] | None = None


class FlopsInfo(Doc, kw_only=True):
    """How the model FLOPs and the peak rate behind MFU were found."""

    formula: Annotated[
        dict[str, str] | str | None, Meta(description="the FLOP formulas used, by part (docs/metrics.md)")
    ] = None
    peak_flops: Annotated[float, Meta(ge=0, description="the device's peak dense bf16 FLOP/s")] | None = None
    peak_source: Annotated[str | None, Meta(description="where the peak comes from")] = None
    how: Annotated[str | None, Meta(description="how the user's model FLOPs were counted")] = None


class Metrics(Doc, kw_only=True):
    """The timed windows' numbers, by the one estimator over every timed step after warm-up (docs/metrics.md)."""

    real_tokens_per_s: Annotated[RealTokensPerS, Meta(description="the headline (a job: the job's)")] | None = None
    loss_tokens_per_s: LossTokensPerS | None = None
    pad_fraction: PadFraction | None = None
    model_tflops_per_s: ModelTflopsPerS | None = None
    mfu: Mfu | None = None
    mfu_reason: Annotated[str | None, Meta(description="why there is no MFU")] = None
    flops_per_step: Annotated[float, Meta(ge=0, description="model FLOPs of one optimizer step")] | None = None
    step_ms: StepMs | None = None
    step_ms_p10: StepMsP10 | None = None
    step_ms_p90: StepMsP90 | None = None
    peak_mem_gb: PeakMemGb | None = None
    peak_mem_reserved_gb: PeakMemReservedGb | None = None
    alloc_retries: AllocRetries | None = None
    device_mem_total_gb: Annotated[GiB, Meta(description="the device's memory")] | None = None
    host_peak_rss_gb: Annotated[GiB, Meta(description="the process's peak resident memory")] | None = None
    final_loss: FinalLoss | None = None
    loss_finite: Annotated[bool | None, Meta(description="every timed loss was finite")] = None
    repeats: Annotated[Count, Meta(description="timed windows")] | None = None
    steps_per_repeat: Annotated[Count, Meta(description="timed steps a window")] | None = None
    warmup_s: WarmupS | None = None
    compile_s: CompileS | None = None


class Throughput(Doc, kw_only=True):
    """The estimator over the timed steps, its spread, and whether to trust it (run/throughput.py)."""

    estimator: Annotated[str | None, Meta(description="how the headline is computed")] = None
    n: Annotated[Count, Meta(description="timed steps")] | None = None
    real_tokens_per_s: RealTokensPerS | None = None
    real_tokens_per_s_p10: Annotated[RealTokensPerS, Meta(description="10th percentile of the steps' rates")] | None = (
        None
    )
    real_tokens_per_s_p90: Annotated[RealTokensPerS, Meta(description="90th percentile of the steps' rates")] | None = (
        None
    )
    loss_tokens_per_s: LossTokensPerS | None = None
    tokens_per_step: Annotated[float, Meta(ge=0, description="real tokens per optimizer step")] | None = None
    model_tflops_per_s: ModelTflopsPerS | None = None
    mfu: Mfu | None = None
    step_ms: StepMs | None = None
    step_ms_p10: StepMsP10 | None = None
    step_ms_p90: StepMsP90 | None = None
    stable: Annotated[bool | None, Meta(description="the window is steady enough to stand behind one number")] = None
    unstable_reason: Annotated[str | None, Meta(description="why it is not")] = None
    advice: Annotated[str | None, Meta(description="what to do about an unstable window")] = None
    spread: Annotated[float, Meta(ge=0, description="p10-p90 of the step times per token over the median")] | None = (
        None
    )
    outliers: Annotated[list[dict[str, Any]] | None, Meta(description="steps over 3x the median")] = None
    settled: Annotated[bool | None, Meta(description="false: the window was still warming up")] = None
    settle_note: Annotated[str | None, Meta(description="what the trend of the window says")] = None
    first_third_x_last: (
        Annotated[float, Meta(ge=0, description="time per token of the first third of steps over the last")] | None
    ) = None


class Spread(Doc, kw_only=True):
    """A number's spread over the timed windows (step_ms: over the steps)."""

    median: Annotated[float | None, Meta(description="the median")] = None
    min: Annotated[float | None, Meta(description="the smallest")] = None
    max: Annotated[float | None, Meta(description="the largest")] = None
    n: Annotated[Count, Meta(description="values")] | None = None
    p10: Annotated[float | None, Meta(description="10th percentile")] = None
    p90: Annotated[float | None, Meta(description="90th percentile")] = None
    n_repeats: Annotated[Count, Meta(description="windows")] | None = None


class Repeat(Doc, kw_only=True):
    """One timed window: its per-step records (the gate's samples) and its numbers."""

    steps: Annotated[Count, Meta(description="timed steps")] | None = None
    wall_s: Annotated[Seconds, Meta(description="the window's wall time")] | None = None
    real_tokens_per_s: RealTokensPerS | None = None
    loss_tokens_per_s: LossTokensPerS | None = None
    pad_fraction: PadFraction | None = None
    model_tflops_per_s: ModelTflopsPerS | None = None
    mfu: Mfu | None = None
    peak_mem_gb: PeakMemGb | None = None
    peak_mem_reserved_gb: PeakMemReservedGb | None = None
    alloc_retries: AllocRetries | None = None
    final_loss: FinalLoss | None = None
    step_ms: Annotated[list[Ms] | None, Meta(description="wall time of each timed step")] = None
    step_cpu_ms: Annotated[list[Ms] | None, Meta(description="the process's CPU time of each timed step")] = None
    step_real_tokens: Annotated[list[Amount] | None, Meta(description="real tokens of each timed step")] = None
    step_loss_tokens: Annotated[list[Amount] | None, Meta(description="loss tokens of each timed step")] = None
    step_padded_tokens: Annotated[list[Amount] | None, Meta(description="padded tokens of each timed step")] = None
    step_flops: Annotated[list[Amount] | None, Meta(description="model FLOPs of each timed step")] = None
    forwards_per_step: Annotated[float, Meta(ge=0, description="model forwards that reached a backward")] | None = None
    rows_per_step: Annotated[float, Meta(ge=0, description="batch rows per optimizer step")] | None = None


class Warmup(Doc, kw_only=True):
    """The steps before the timed windows."""

    steps: Annotated[Count, Meta(description="warm-up steps run")] | None = None
    asked: Annotated[Count, Meta(description="warm-up steps asked for")] | None = None
    settle_steps: Annotated[int | None, Meta(description="steps added until the time per token settled")] = None
    settled: Annotated[bool | None, Meta(description="the time per token settled within the warm-up")] = None
    warmup_s: WarmupS | None = None
    compile_s: CompileS | None = None
    step_s: Annotated[list[Seconds] | None, Meta(description="each warm-up step's wall time")] = None
    graphs_compiled: Annotated[Count, Meta(description="torch.compile graphs built in the warm-up")] | None = None
    graphs_compiled_in_timed_windows: Annotated[Count, Meta(description="graphs built later: in the timing")] | None = (
        None
    )


class TraceInfo(Doc, kw_only=True):
    """The traced window (after the timed ones) and where its trace is."""

    path: Annotated[str | None, Meta(description="the trace file (null: not kept)")] = None
    dir: Annotated[str | None, Meta(description="the folder of the ranks' traces")] = None
    rank_paths: Annotated[list[str] | None, Meta(description="each rank's trace file")] = None
    kept: Annotated[bool | None, Meta(description="the trace was asked for (--trace-dir) and stays")] = None
    lost: Annotated[str | None, Meta(description="why the trace could not be written")] = None
    bytes: Annotated[Count, Meta(description="the trace file's size")] | None = None
    steps: Annotated[Count, Meta(description="traced steps")] | None = None
    traced_step_ms: Annotated[list[Ms] | None, Meta(description="each traced step's wall time (profiler on)")] = None
    untraced_step_ms_median: Annotated[Ms, Meta(description="the timed median, for comparison")] | None = None
    record_shapes: Annotated[bool | None, Meta(description="the profiler recorded shapes")] = None
    profile_memory: Annotated[bool | None, Meta(description="the profiler recorded memory")] = None
    with_stack: Annotated[bool | None, Meta(description="the profiler recorded stacks")] = None
    schedule: Annotated[dict[str, Any] | None, Meta(description="the profiler's wait, warmup and active steps")] = None


class GlobalNumbers(Doc, kw_only=True):
    """A job's numbers over its ranks."""

    real_tokens_per_s: Annotated[RealTokensPerS, Meta(description="the job's (the headline)")] | None = None
    real_tokens: Annotated[Amount | None, Meta(description="real tokens of every rank's timed steps")] = None
    slowest_rank: Annotated[int, Meta(ge=0, description="the rank every other waits for")] | None = None
    slowest_step_ms: Annotated[Ms, Meta(description="its median step")] | None = None
    fastest_step_ms: Annotated[Ms, Meta(description="the fastest rank's median step")] | None = None
    median_rank_step_ms: Annotated[Ms, Meta(description="the median over the ranks' median steps")] | None = None
    step_imbalance: Annotated[float, Meta(ge=0, description="slowest median step over the fastest, - 1")] | None = None
    peak_mem_gb: Annotated[PeakMemGb, Meta(description="the largest rank's peak allocated memory")] | None = None


class RankRow(Doc, kw_only=True):
    """One rank's own numbers."""

    rank: Annotated[int, Meta(ge=0, description="the rank")]
    status: Annotated[str | None, Meta(description="how the rank's run ended")] = None
    host: Annotated[str | None, Meta(description="the machine it ran on")] = None
    steps: Annotated[Count, Meta(description="timed steps")] | None = None
    step_ms: Annotated[StepMs, Meta(description="the rank's median step")] | None = None
    real_tokens: Annotated[Amount | None, Meta(description="the rank's real tokens")] = None
    real_tokens_per_s: Annotated[RealTokensPerS, Meta(description="the rank's own, not the job's")] | None = None
    pad_fraction: PadFraction | None = None
    peak_mem_gb: PeakMemGb | None = None
    final_loss: FinalLoss | None = None
    loss_finite: Annotated[bool | None, Meta(description="every timed loss of the rank was finite")] = None
    trace: Annotated[str | None, Meta(description="the rank's trace file")] = None


class Distributed(Doc, kw_only=True):
    """A job of several ranks (torchrun, accelerate): its size, its numbers and each rank's."""

    world_size: Annotated[int, Meta(ge=1, description="ranks in the job")]
    parallel: Annotated[str | None, Meta(description="ddp or fsdp2")] = None
    backend: Annotated[str | None, Meta(description="nccl or gloo")] = None
    nproc_per_node: Annotated[int, Meta(ge=1, description="ranks a machine")] | None = None
    nnodes: Annotated[int, Meta(ge=1, description="machines")] | None = None
    ranks_joined: Annotated[Count, Meta(description="ranks whose numbers came in")] | None = None
    missing_ranks: Annotated[list[int] | None, Meta(description="ranks whose numbers did not")] = None
    params_identical: Annotated[bool | None, Meta(description="every rank ended with the same weights")] = None
    global_: Annotated[GlobalNumbers | None, Meta(description="the job's numbers")] = msgspec.field(
        default=None, name="global"
    )
    scaling: Annotated[dict[str, Any] | None, Meta(description="efficiency against one GPU, with its doubts")] = None
    ranks: Annotated[list[RankRow] | None, Meta(description="each rank's own numbers")] = None


class CrossRank(Doc, kw_only=True):
    """The ranks' traces joined (trace/ranks.py), or why they could not be."""

    skipped: Annotated[str | None, Meta(description="why the traces were not joined")] = None
    facts: Annotated[dict[str, Any] | None, Meta(description="dist.* facts of the ranks together")] = None
    ranks: Annotated[list[dict[str, Any]] | None, Meta(description="each rank's step accounts")] = None
    notes: Annotated[list[str] | None, Meta(description="what the join could not do")] = None
    hta: Annotated[dict[str, Any] | None, Meta(description="Holistic Trace Analysis' numbers, where it ran")] = None
    diagnosis: Diagnosis | None = None
    findings: Annotated[list[Finding] | None, Meta(description="the diagnosis' findings")] = None
    muted: Annotated[list[Finding] | None, Meta(description="the diagnosis' muted findings")] = None


class InProcessArm(Doc, kw_only=True):
    """One leave-one-out arm measured in the run's own process (run/switch.py)."""

    patch: Annotated[dict[str, Any], Meta(description="the knobs the arm sets otherwise than the run")]
    status: Annotated[str, Meta(description="ok, oom (out of memory without the change) or error")] = "ok"
    tokens_per_s: Annotated[
        list[RealTokensPerS], Meta(description="each of its windows' real tokens/s, round by round")
    ] = []
    ratios: Annotated[
        list[Annotated[float, Meta(gt=0)]],
        Meta(description="each round's pair: the run's window's real tokens/s over the arm's window's after it"),
    ] = []
    error: Annotated[str | None, Meta(description="how it failed, where it did")] = None


class InProcess(Doc, kw_only=True):
    """The leave-one-out arms a treatment asked this run to measure in its own process, after its windows."""

    window_steps: Annotated[int, Meta(ge=1, description="timed steps of each window")] | None = None
    rounds: Annotated[Count, Meta(description="rounds run: the run's window, then each arm's")] = 0
    stopped: Annotated[str | None, Meta(description="rounds (all run) or time (the seconds given ran out)")] = None
    seconds: Annotated[Seconds | None, Meta(description="wall seconds the arms took")] = None
    final_tokens_per_s: Annotated[
        list[RealTokensPerS], Meta(description="each round's window of the run's own config, real tokens/s")
    ] = []
    arms: Annotated[dict[str, InProcessArm], Meta(description="each arm, by name")] = {}
    error: Annotated[str | None, Meta(description="why the arms stopped, where they failed as a whole")] = None


class Script(Doc, kw_only=True):
    """The user's command that `vlmdoctor run` measured, and how it ended."""

    argv: Annotated[list[str] | None, Meta(description="the script's arguments")] = None
    command: Annotated[list[str] | None, Meta(description="the command as given, run again by gate")] = None
    cwd: Annotated[str | None, Meta(description="the folder it ran in")] = None
    python: Annotated[str | None, Meta(description="the interpreter the command runs")] = None
    env: Annotated[dict[str, str] | None, Meta(description="the variables that change how training runs")] = None
    warmup: Annotated[int, Meta(ge=0, description="the recorded window's warm-up steps")] | None = None
    steps: Annotated[int, Meta(ge=1, description="the recorded window's timed steps")] | None = None
    exit_code: Annotated[int | None, Meta(description="the script's exit code")] = None
    error: Annotated[str | None, Meta(description="how the script failed")] = None
    out_of_memory: Annotated[bool | None, Meta(description="it ran out of memory")] = None
    steps_of_other_optimizers: Annotated[Count, Meta(description="steps of optimizers not measured")] | None = None


class RunReport(Doc, kw_only=True):
    """report.json: one measured run of vlmdoctor's own training or the user's (docs/metrics.md)."""

    schema_version: Version
    kind: Annotated[str | None, Meta(description="profile (older own runs: absent)")] = None
    status: Annotated[str, Meta(description="ok, or how the run ended: oom, nan_loss, error, timeout")] = "ok"
    error: RunError | None = None
    tool: Tool | None = None
    created_at: Annotated[str | None, Meta(description="local time the report was written")] = None
    config: Annotated[
        dict[str, Any] | None,
        Meta(
            description="the run's knobs: every knob of vlmdoctor's own run, or those read from the user's model "
            "and loop; the ones read by name: RecordedConfig"
        ),
    ] = None
    model: ModelInfo | None = None
    env: Env | None = None
    data: DataInfo | None = None
    mode: Annotated[dict[str, Any] | None, Meta(description="training mode: objective, full/LoRA/QLoRA, ...")] = None
    flops: FlopsInfo | None = None
    metrics: Metrics | None = None
    throughput: Throughput | None = None
    stats: Annotated[dict[str, Spread] | None, Meta(description="each metric's spread, by name")] = None
    repeats: Annotated[list[Repeat] | None, Meta(description="the timed windows (a job: the job's steps)")] = None
    warmup: Warmup | None = None
    trace: TraceInfo | None = None
    facts: Annotated[dict[str, Any] | None, Meta(description="the traced step's facts (docs/analysis.md)")] = None
    split: Annotated[dict[str, Any] | None, Meta(description="the traced step split by model part")] = None
    accounts: Annotated[
        dict[str, Any] | None, Meta(description="every ms of the traced step in a named account (trace/accounts.py)")
    ] = None
    diagnosis: Diagnosis | None = None
    findings: Annotated[list[Finding] | None, Meta(description="the diagnosis' findings (what gate reads)")] = None
    muted: Annotated[list[Finding] | None, Meta(description="findings muted (what gate lists)")] = None
    distributed: Distributed | None = None
    cross_rank: CrossRank | None = None
    script: Script | None = None
    in_process: InProcess | None = None
    notes: Annotated[list[str] | None, Meta(description="what the reader of the numbers should know")] = None
    warnings: Annotated[list[str] | None, Meta(description="what went wrong without stopping the run")] = None
    audience: Annotated[str | None, Meta(description="whose terms the advice uses: loop or trainer")] = None
    interrupted: Annotated[str | None, Meta(description="the signal that stopped the run")] = None
    diagnosed_while_running: Annotated[bool | None, Meta(description="`run` diagnosed as the script trained on")] = None
    diagnosis_error: Annotated[str | None, Meta(description="why the diagnosis failed (the numbers stand)")] = None

    @property
    def knobs(self) -> RecordedConfig:
        """The knobs of `config` readers read by name, typed (checked when the report was read)."""
        return msgspec.convert(self.config or {}, RecordedConfig)


def check_measured(report: RunReport, name: str) -> None:
    """Refuse (DocumentError) a report whose numbers a comparison cannot use: a run that did not finish cleanly,
    no config or metrics, no positive tokens/s, a number that is not finite, step times or tokens that are all
    zero. What one field's declaration cannot say: these read several fields, or what a verdict needs."""
    if report.status != "ok":
        why = report.error.message if report.error else ""
        raise DocumentError(
            f"{name}: the run did not finish cleanly (status {report.status}"
            + (f": {why}" if why else "")
            + "); its numbers cannot be compared"
        )
    if report.config is None or report.metrics is None:
        missing = [k for k in ("config", "metrics") if getattr(report, k) is None]
        raise DocumentError(f"{name}: not a vlmdoctor profile report (no {' or '.join(missing)})")
    m = report.metrics
    tps = m.real_tokens_per_s
    if tps is None or not math.isfinite(tps) or tps <= 0:
        raise DocumentError(f"{name}: metrics.real_tokens_per_s must be a positive number, got {tps!r}")
    for key in msgspec.structs.fields(Metrics):
        v = getattr(m, key.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise DocumentError(f"{name}: metrics.{key.name} must be a number or null, got {v!r}")
    for i, r in enumerate(report.repeats or []):
        if r.real_tokens_per_s is not None and not (math.isfinite(r.real_tokens_per_s) and r.real_tokens_per_s > 0):
            raise DocumentError(f"{name}: repeats[{i}].real_tokens_per_s must be a positive number")
        for key in ("step_ms", "step_cpu_ms", "step_real_tokens"):
            v = getattr(r, key)
            if v and not all(math.isfinite(x) for x in v):
                raise DocumentError(f"{name}: repeats[{i}].{key} must be a list of non-negative numbers")
            if v and key != "step_cpu_ms" and not any(x > 0 for x in v):  # nothing to divide by, or nothing done
                raise DocumentError(f"{name}: repeats[{i}].{key} are all zero: not a measurement")
