"""The documents vlmdoctor writes, each declared once: the run report, the trace analysis, the diagnosis, the treat
result, the gate verdict and the comparison.

A reader loads a document through its declaration (`read_document`, or `as_document` for a parsed one): the value is
checked once, field by field, and a bad one is refused with one line naming the field (`DocumentError`, exit 2), so
readers use fields, not `.get(...) or {}` chains. Keys a declaration does not name are ignored and every field a
writer may leave out is optional, so a baseline written by an older or newer vlmdoctor still loads. A number has one
name and one meaning wherever a document holds it (`RealTokensPerS`, `StepMs`, ...). The field table of
docs/files.md is generated from these declarations (`markdown_fields`; `python -m vlmdoctor.documents` rewrites it).

Open-ended mappings stay mappings: `facts` (a fact name -> its value, docs/analysis.md), `config` (a knob name -> its
value; the knobs read by name are `RecordedConfig`), `mode`, `split`, `accounts`.
"""

from __future__ import annotations

import math
import os
import re
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from vlmdoctor import SCHEMA_VERSION, docgen
from vlmdoctor.errors import UsageError

#: the largest report, analysis or treat result a reader takes (a report holds facts and per-step lists)
MAX_DOCUMENT_BYTES = 512 * 2**20

# --- the numbers: a kind each, then one name and one meaning wherever a document holds them ---------

Ms = Annotated[float, Meta(ge=0, extra={"unit": "ms"})]
Seconds = Annotated[float, Meta(ge=0, extra={"unit": "s"})]
GiB = Annotated[float, Meta(ge=0, extra={"unit": "GiB"})]
Fraction = Annotated[float, Meta(ge=0, le=1)]
Count = Annotated[int, Meta(ge=0)]
Number = int | float
#: tokens or FLOPs: counted (an integer) or averaged
Amount = Annotated[int, Meta(ge=0)] | Annotated[float, Meta(ge=0)]

RealTokensPerS = Annotated[
    float,
    Meta(
        ge=0,
        description="non-padding LLM input tokens (prompt, template, image, answer) per second of wall time, by the "
        "one estimator: the steps' tokens over their time",
        extra={"unit": "tokens/s"},
    ),
]
LossTokensPerS = Annotated[
    float, Meta(ge=0, description="tokens whose label is not -100, per second", extra={"unit": "tokens/s"})
]
PadFraction = Annotated[Fraction, Meta(description="1 - real / (batch x padded length)")]
ModelTflopsPerS = Annotated[
    float, Meta(ge=0, description="model FLOPs per second (docs/metrics.md)", extra={"unit": "TFLOP/s"})
]
Mfu = Annotated[
    float,
    Meta(ge=0, description="model FLOPs per second over the device's peak dense bf16 rate", extra={"unit": "0..1"}),
]
StepMs = Annotated[Ms, Meta(description="median optimizer step (a job: the slowest rank's)")]
StepMsP10 = Annotated[Ms, Meta(description="10th percentile optimizer step")]
StepMsP90 = Annotated[Ms, Meta(description="90th percentile optimizer step")]
PeakMemGb = Annotated[GiB, Meta(description="peak allocated device memory (null on CPU)")]
PeakMemReservedGb = Annotated[GiB, Meta(description="peak memory the allocator reserved (null on CPU)")]
FinalLoss = Annotated[float, Meta(description="the loss of the last timed step")]
WarmupS = Annotated[Seconds, Meta(description="wall time of the warm-up")]
CompileS = Annotated[Seconds, Meta(description="warm-up time beyond steady steps: compilation, autotuning")]
Layer = Annotated[int, Meta(ge=1, le=5, description="1 precision, 2 batching, 3 data layout, 4 fusion, 5 system")]
Severity = Annotated[str, Meta(description="high, medium or low, from the expected gain")]
Version = Annotated[int, Meta(ge=1, description="the layout's version (vlmdoctor.SCHEMA_VERSION); a newer is refused")]


class Doc(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base of every declared part: fields by keyword, keys it does not declare ignored."""


class DocumentError(UsageError):
    """A document that is not what its declaration says: one line naming the document and the field, exit 2."""


# --- the run report (report.json of profile, run, Doctor, DoctorCallback) ---------------------


class ErrorInfo(Doc, kw_only=True):
    """How a run that did not finish cleanly ended."""

    type: Annotated[str, Meta(description="OutOfMemory, NonFiniteLoss, Timeout, NoSteps, ScriptFailed, ...")] = ""
    message: Annotated[str, Meta(description="one line saying what happened")] = ""
    where: Annotated[str | None, Meta(description="out of memory: on the GPU or the host")] = None


class Tool(Doc, kw_only=True):
    """The program that wrote the document."""

    name: Annotated[str, Meta(description="vlmdoctor")] = "vlmdoctor"
    version: Annotated[str | None, Meta(description="its version")] = None


class RecordedConfig(Doc, kw_only=True):
    """The knobs of a report's `config` that readers read by name (every knob: `vlmdoctor profile --help`)."""

    source: Annotated[
        str | None, Meta(description="api, trainer or script: the way in that measured the user's training")
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


class ExpectedGain(Doc, kw_only=True):
    """What a finding's fix is expected to win, measured on the traced step."""

    throughput_x: Annotated[float | None, Meta(description="expected tokens/s ratio (x1.25: a quarter more)")] = None
    saves_ms_per_step: Annotated[float | None, Meta(description="ms of the traced step the fix removes")] = None
    share_of_step: Annotated[float | None, Meta(description="that time over the traced step")] = None
    step_ms: Annotated[float | None, Meta(description="the traced step the ms and share are of")] = None
    window: Annotated[str | None, Meta(description="traced: the step the gain is measured on")] = None
    how: Annotated[str | None, Meta(description="where the expected gain comes from")] = None


class Finding(Doc, kw_only=True):
    """A rule that matched the measured facts, and its prescription (docs/rules.md)."""

    id: Annotated[str, Meta(description="the rule's id")]
    title: Annotated[str | None, Meta(description="what the rule detects, in one line")] = None
    layer: Layer | None = None
    layer_name: Annotated[str | None, Meta(description="the layer's name")] = None
    severity: Severity | None = None
    severity_from: Annotated[str | None, Meta(description="what set the severity")] = None
    rule_severity: Annotated[str | None, Meta(description="the rule's own cap on the severity")] = None
    evidence: Annotated[list[str] | None, Meta(description="the measured facts, as text")] = None
    fix: Annotated[str | None, Meta(description="the prescription, as text")] = None
    config_patch: Annotated[dict[str, Any] | None, Meta(description="the knobs the fix sets")] = None
    expected_gain: ExpectedGain | None = None
    sources: Annotated[list[str] | None, Meta(description="where the rule's knowledge comes from")] = None
    rank: Annotated[int, Meta(ge=1, description="1: the biggest expected win")] | None = None
    apply_order: Annotated[int, Meta(ge=1, description="the order the fixes apply in (layer order)")] | None = None
    advice: Annotated[dict[str, Any] | None, Meta(description="the fix in the user's terms")] = None
    muted_by: Annotated[str | None, Meta(description="a muted finding: what muted it (--ignore, ...)")] = None
    superseded_by: Annotated[str | None, Meta(description="a superseded finding: the finding that wins")] = None


class NotEvaluated(Doc, kw_only=True):
    """A rule that could not be evaluated: the facts it needs are missing."""

    id: Annotated[str, Meta(description="the rule's id")]
    missing: Annotated[list[str] | None, Meta(description="the facts it needs that the trace lacks")] = None
    hint: Annotated[str | None, Meta(description="how to record them")] = None


class NotApplicable(Doc, kw_only=True):
    """A rule that does not apply to this run, and why."""

    id: Annotated[str, Meta(description="the rule's id")]
    why: Annotated[str | None, Meta(description="why it does not apply")] = None


class Diagnosis(Doc, kw_only=True):
    """The rules run on the facts: what fired, and what did not and why (doctor/rules.py `diagnose`)."""

    findings: Annotated[list[Finding], Meta(description="biggest expected gain first")] = []
    superseded: Annotated[list[Finding], Meta(description="fired, but another finding's fix covers it")] = []
    muted: Annotated[list[Finding], Meta(description="fired, but muted (--ignore, [tool.vlmdoctor])")] = []
    not_evaluated: list[NotEvaluated] = []
    not_applicable: list[NotApplicable] = []
    problems: Annotated[list[str], Meta(description="rule files that failed to load or to evaluate")] = []


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
    error: ErrorInfo | None = None
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


# --- the trace analysis (`analyze --json`) ------------------------------------------------------


class AnalyzedFile(Doc, kw_only=True):
    """One trace file's facts, and their diagnosis."""

    file: Annotated[str, Meta(description="the trace file")]
    facts: Annotated[dict[str, Any], Meta(description="fact name -> value (docs/analysis.md)")]
    meta: Annotated[dict[str, Any] | None, Meta(description="the trace's metadata the facts read")] = None
    rank: Annotated[int, Meta(ge=0, description="the rank that wrote the trace")] | None = None
    diagnosis: Diagnosis | None = None
    findings: Annotated[list[Finding] | None, Meta(description="the diagnosis' findings")] = None
    muted: Annotated[list[Finding] | None, Meta(description="the diagnosis' muted findings")] = None


class Analysis(Doc, kw_only=True):
    """`vlmdoctor analyze --json`: the facts of a trace, or of a folder of rank traces, and the diagnosis."""

    schema_version: Version
    kind: Annotated[str | None, Meta(description="analysis")] = None
    path: Annotated[str | None, Meta(description="the trace or folder analyzed")] = None
    files: Annotated[list[AnalyzedFile], Meta(description="each trace file's facts")] = []
    cross_rank: CrossRank | None = None


# --- the treat result (treat.json) ------------------------------------------------------------


class TreatDecision(Doc, kw_only=True):
    """The rule a change had to pass to be kept."""

    min_gain: Annotated[float | None, Meta(description="the smallest gain kept (0.02: 2%)")] = None
    confidence: Annotated[float, Meta(gt=0, lt=1, description="the paired interval's level")] | None = None
    min_pairs: Annotated[Count, Meta(description="paired runs before a decision")] | None = None
    max_pairs: Annotated[Count, Meta(description="paired runs at most")] | None = None
    rule: Annotated[str | None, Meta(description="the decision rule, in words")] = None


class RunSummary(Doc, kw_only=True):
    """One run's numbers as treat keeps them (doctor/treat.py `summary`)."""

    status: Annotated[str | None, Meta(description="how the run ended")] = None
    real_tokens_per_s: RealTokensPerS | None = None
    tokens_per_s_repeats: Annotated[list[float | None] | None, Meta(description="each timed window's")] = None
    step_ms: StepMs | None = None
    mfu: Mfu | None = None
    pad_fraction: PadFraction | None = None
    peak_mem_gb: PeakMemGb | None = None
    compile_s: CompileS | None = None
    warmup_s: WarmupS | None = None
    findings: Annotated[list[str] | None, Meta(description="ids of the run's findings")] = None
    warnings: Annotated[list[str] | None, Meta(description="the run's warnings")] = None
    error: Annotated[str | None, Meta(description="how the run failed")] = None
    profile: Annotated[dict[str, Any] | None, Meta(description="a few facts of the run's trace")] = None


class Rung(RunSummary, kw_only=True):
    """A step of the ladder: the start config, then each kept round, with its speedup over the start."""

    step: Annotated[Count, Meta(description="0: the start config")] | None = None
    change: Annotated[str | None, Meta(description="what this round changed")] = None
    rule: Annotated[str | None, Meta(description="the finding(s) whose fix it applied")] = None
    config_patch: Annotated[dict[str, Any] | None, Meta(description="the knobs it set")] = None
    speedup: Annotated[float, Meta(ge=0, description="tokens/s over the start config's")] | None = None
    speedup_how: Annotated[str | None, Meta(description="how the speedup was found")] = None
    paired_ratio: Annotated[float, Meta(ge=0, description="paired ratio over the previous rung")] | None = None
    composed_of: Annotated[list[str] | None, Meta(description="the findings the round applied together")] = None
    elapsed_s: Annotated[Seconds, Meta(description="since the treatment started")] | None = None


class Trial(RunSummary, kw_only=True):
    """One candidate change or composition, measured against the current config in paired runs."""

    trial: Annotated[int, Meta(ge=1, description="its number")]
    rule: Annotated[str | None, Meta(description="the finding(s) whose fix it tried")] = None
    config_patch: Annotated[dict[str, Any] | None, Meta(description="the knobs it set")] = None
    kind: Annotated[str | None, Meta(description="single or composition")] = None
    name: Annotated[str | None, Meta(description="what it tried")] = None
    title: Annotated[str | None, Meta(description="the finding's title")] = None
    layer: Layer | None = None
    expected_gain: ExpectedGain | None = None
    outcome: Annotated[str | None, Meta(description="kept, harmful, no gain, failed, ...")] = None
    ratio: Annotated[float, Meta(ge=0, description="paired candidate/current tokens/s ratio")] | None = None
    gain: Annotated[float | None, Meta(description="the ratio - 1")] = None
    ci_low: Annotated[float | None, Meta(description="the ratio's interval, low end")] = None
    ci_high: Annotated[float | None, Meta(description="the ratio's interval, high end")] = None
    pairs: Annotated[Count, Meta(description="paired runs")] | None = None
    ratios: Annotated[list[float] | None, Meta(description="each pair's ratio")] = None
    runs: Annotated[Count, Meta(description="runs of the candidate")] | None = None
    tokens_per_s_runs: Annotated[list[float] | None, Meta(description="each run's tokens/s")] = None
    why: Annotated[str | None, Meta(description="the decision, in words")] = None


class TreatResult(Doc, kw_only=True):
    """treat.json of `vlmdoctor treat`: prescriptions applied one round at a time, each re-measured (docs/treat.md)."""

    schema_version: Version
    kind: Annotated[str | None, Meta(description="treat")] = None
    tool: Tool | None = None
    created_at: Annotated[str | None, Meta(description="local time the treatment started")] = None
    env: Env | None = None
    start_config: Annotated[dict[str, Any] | None, Meta(description="the config treated (every knob)")] = None
    final_config: Annotated[dict[str, Any] | None, Meta(description="the config with every kept change")] = None
    decision: TreatDecision | None = None
    start: Annotated[RunSummary | None, Meta(description="the start config's run")] = None
    ladder: Annotated[list[Rung], Meta(description="the start, then each kept round")] = []
    trials: Annotated[list[Trial], Meta(description="every change tried, kept or not")] = []
    rounds: Annotated[list[dict[str, Any]], Meta(description="each round's compositions and what was adopted")] = []
    skipped: Annotated[list[Any], Meta(description="prescriptions not tried, and why")] = []
    final_ablation: Annotated[dict[str, Any] | None, Meta(description="changes dropped by leave-one-out")] = None
    rediagnosed: Annotated[list[dict[str, Any]] | None, Meta(description="findings after each round")] = None
    stopped_because: Annotated[str | None, Meta(description="why the treatment ended")] = None
    interrupted: Annotated[bool, Meta(description="Ctrl-C or a signal ended it")] = False
    exit_code: Annotated[int | None, Meta(description="the exit code an interruption gives")] = None
    wall_s: Annotated[Seconds, Meta(description="the treatment's wall time")] | None = None
    outputs: Annotated[dict[str, str] | None, Meta(description="the files written, by kind")] = None


# --- the gate verdict (`gate --json`) -----------------------------------------------------------


class GateCheck(Doc, kw_only=True):
    """One check of the gate (throughput, memory, findings, slowest rank) and its numbers."""

    name: Annotated[str, Meta(description="throughput, memory, findings or slowest rank")]
    passed: Annotated[bool, Meta(description="the check passed")]
    verdict: Annotated[str, Meta(description="pass, fail, skip (slowest rank: ok, uneven)")]
    detail: Annotated[str, Meta(description="one line: the numbers and why")]
    base_median: Annotated[RealTokensPerS, Meta(description="throughput: the baseline's")] | None = None
    cur_median: Annotated[RealTokensPerS, Meta(description="throughput: the current run's")] | None = None
    ratio: Annotated[float, Meta(ge=0, description="throughput: current over baseline")] | None = None
    ci_low: Annotated[float | None, Meta(description="the ratio's interval, low end (paired)")] = None
    ci_high: Annotated[float | None, Meta(description="the ratio's interval, high end (paired)")] = None
    pairs: Annotated[Count, Meta(description="paired runs (--remeasure-baseline)")] | None = None
    p: Annotated[float, Meta(ge=0, le=1, description="Mann-Whitney p-value (reports as they are)")] | None = None
    significant: Annotated[bool | None, Meta(description="the change is beyond the noise")] = None
    method: Annotated[str | None, Meta(description="the statistical test used")] = None
    samples: Annotated[str | None, Meta(description="what a sample is: a step, a window, a run")] = None
    max_regression: Annotated[float | None, Meta(description="the slowdown allowed (0.05: 5%)")] = None
    base_gb: Annotated[PeakMemGb, Meta(description="memory: the baseline's peak")] | None = None
    cur_gb: Annotated[PeakMemGb, Meta(description="memory: the current run's peak")] | None = None
    growth: Annotated[float | None, Meta(description="memory: current over baseline, - 1")] = None
    added: Annotated[list[str] | None, Meta(description="findings: new in current")] = None
    gone: Annotated[list[str] | None, Meta(description="findings: gone in current")] = None
    failing: Annotated[list[str] | None, Meta(description="findings: new at or above --fail-on")] = None
    muted: Annotated[list[dict[str, Any]] | None, Meta(description="findings: muted, never failing")] = None


class GateVerdict(Doc, kw_only=True):
    """`vlmdoctor gate --json`: the verdict and each check (docs/ci.md)."""

    passed: Annotated[bool, Meta(description="every check passed (exit 0; else 1)")]
    checks: list[GateCheck]
    summary: Annotated[str, Meta(description="PASSED or FAILED, and why, in one line")]
    notes: Annotated[list[str], Meta(description="what differs between the runs, besides the code")] = []
    model: Annotated[str | None, Meta(description="the baseline's model")] = None
    stage: Annotated[int | None, Meta(description="the baseline's stage")] = None
    remeasured: Annotated[bool | None, Meta(description="the baseline was measured again, in pairs")] = None


# --- the comparison (`compare --json`) ----------------------------------------------------------


class CompareSide(Doc, kw_only=True):
    """What one side of a comparison measured."""

    model: Annotated[str | None, Meta(description="its model")] = None
    stage: Annotated[int | None, Meta(description="its stage")] = None
    device: Annotated[str | None, Meta(description="the GPU, or CPU")] = None
    torch: Annotated[str | None, Meta(description="torch's version")] = None
    created_at: Annotated[str | None, Meta(description="when its report was written")] = None


class MetricRow(Doc, kw_only=True):
    """One metric of both sides."""

    key: Annotated[str, Meta(description="the metric's name in report.json `metrics`")]
    label: Annotated[str, Meta(description="its name as shown")]
    a: Annotated[float | None, Meta(description="A's value")] = None
    b: Annotated[float | None, Meta(description="B's value")] = None
    delta: Annotated[float | None, Meta(description="b - a")] = None
    rel: Annotated[float | None, Meta(description="(b - a) / |a|")] = None
    higher_is_better: Annotated[bool, Meta(description="the direction of better")]
    verdict: Annotated[str, Meta(description="better, worse, same (within 1%) or n/a")]


class FindingBrief(Doc, kw_only=True):
    """A finding, named."""

    id: Annotated[str, Meta(description="the rule's id")]
    title: Annotated[str | None, Meta(description="what it detects")] = None
    severity: Severity | None = None
    layer: Layer | None = None


class FindingsDiff(Doc, kw_only=True):
    """Findings new in B, gone in B, in both."""

    added: Annotated[list[FindingBrief], Meta(description="new in B")] = []
    gone: Annotated[list[FindingBrief], Meta(description="gone in B")] = []
    kept: Annotated[list[str], Meta(description="ids in both")] = []


class KnobRow(Doc, kw_only=True):
    """A knob that differs."""

    knob: Annotated[str, Meta(description="its name")]
    layer: Annotated[int, Meta(ge=0, le=5, description="its layer (0: a run setting)")]
    a: Annotated[Any, Meta(description="A's value")] = None
    b: Annotated[Any, Meta(description="B's value")] = None


class SlowestRank(Doc, kw_only=True):
    """The slowest rank of a job."""

    rank: Annotated[int | None, Meta(description="the rank")] = None
    step_ms: Annotated[Ms, Meta(description="its median step")] | None = None
    imbalance: Annotated[float | None, Meta(description="its median step over the fastest's, - 1")] = None


class RanksCompared(Doc, kw_only=True):
    """How many ranks each side ran."""

    a: Annotated[int, Meta(ge=1, description="A's ranks")]
    b: Annotated[int, Meta(ge=1, description="B's ranks")]
    slowest_a: SlowestRank | None = None
    slowest_b: SlowestRank | None = None


class Comparison(Doc, kw_only=True):
    """`vlmdoctor compare --json`: two reports side by side, A the reference."""

    labels: Annotated[list[str], Meta(description="the two reports' names")]
    a: CompareSide
    b: CompareSide
    notes: Annotated[list[str], Meta(description="what differs besides the numbers")] = []
    metrics: list[MetricRow] = []
    kernels: Annotated[
        list[dict[str, Any]] | None, Meta(description="GPU ms per step by kernel class, biggest change first")
    ] = None
    gpu: Annotated[dict[str, Any] | None, Meta(description="step, GPU busy and idle, and idle by host cause")] = None
    findings: FindingsDiff | None = None
    config: Annotated[list[KnobRow], Meta(description="the knobs that differ, in layer order")] = []
    ranks: RanksCompared | None = None


# --- reading ----------------------------------------------------------------------------------

D = TypeVar("D", bound=Doc)

#: the documents with a `kind` and a `schema_version`: kind, what to call it, what writes it
_KINDS: dict[type[Doc], tuple[str, str, str]] = {
    RunReport: ("profile", "profile report", "the report JSON written by `vlmdoctor profile --json`"),
    Analysis: ("analysis", "analysis result", "the JSON written by `vlmdoctor analyze --json`"),
    TreatResult: ("treat", "treat result", "the treat.json written by `vlmdoctor treat`"),
}


def as_document(value: Any, cls: type[D], name: str) -> D:
    """`value` (parsed JSON) as the document `cls` declares, or one DocumentError naming `name` and the field.

    A document of another kind, or of a newer schema, is said to be so before its fields are read."""
    if cls in _KINDS:
        kind, what, writer = _KINDS[cls]
        if not isinstance(value, dict):
            raise DocumentError(f"{name}: not a vlmdoctor {what} (the JSON is a {type(value).__name__}, not an object)")
        other = value.get("kind")
        if other is None and cls is RunReport:  # an older vlmdoctor wrote reports without a kind
            other = kind
        if other is None:
            raise DocumentError(f"{name}: not a vlmdoctor {what} (no kind); pass {writer}")
        if other != kind:
            raise DocumentError(f"{name}: a vlmdoctor {other} result, not a {what}; pass {writer}")
        version = value.get("schema_version")
        if version is None:
            raise DocumentError(f"{name}: not a vlmdoctor {what} (no schema_version)")
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            raise DocumentError(
                f"{name}: schema_version {version} was written by a newer vlmdoctor "
                f"(this one reads up to {SCHEMA_VERSION}); upgrade vlmdoctor"
            )
    try:
        doc = msgspec.convert(value, cls)
        if isinstance(doc, RunReport) and doc.config is not None:
            _convert_at(doc.config, RecordedConfig, "config")
    except msgspec.ValidationError as e:
        raise DocumentError(f"{name}: {_problem(str(e), value)}") from None
    return doc


def _convert_at(value: Any, cls: type[D], at: str) -> D:
    """msgspec.convert, its error's field path starting at `at`."""
    try:
        return msgspec.convert(value, cls)
    except msgspec.ValidationError as e:
        text, _, where = str(e).partition(" - at `$")
        raise msgspec.ValidationError(f"{text} - at `$.{at}{where}") from None


def _problem(text: str, value: Any) -> str:
    """msgspec's message as one line of vlmdoctor's: the field first, then what it must be and what it is."""
    what, _, where = text.partition(" - at `$")
    path = where.rstrip("`").lstrip(".")
    got = _at(value, path)
    missing = re.fullmatch(r"Object missing required field `(\w+)`", what)
    if missing:
        field = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return f"{field}: missing (a required field)"
    bound = re.fullmatch(r"Expected `(\w+)` (>=|>|<=|<) (-?[\d.e+]+)", what)
    if bound:
        kind, op, limit = bound.groups()
        if isinstance(got, float) and not math.isfinite(got):
            must = "must be a finite number"
        elif (op, float(limit)) == (">=", 0.0):
            must = "must not be negative"
        else:
            must = f"must be {'a whole number' if kind == 'int' else 'a number'} {op} {limit.removesuffix('.0')}"
        return f"{path}: {must}, got {got!r}"
    expected = re.fullmatch(r"Expected `([^`]+)`, got `(\w+)`", what)
    if expected:
        return f"{path or 'the document'}: expected {_words(expected.group(1))}, got {_words(expected.group(2))}"
    return f"{path}: {what}" if path else what


#: msgspec's type names, as the error line says them
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "str": "text", "bool": "true/false", "null": "null"}
_TYPE_WORDS |= {"array": "a list", "object": "an object"}


def _words(types: str) -> str:
    return " or ".join(_TYPE_WORDS.get(t.strip(), t.strip()) for t in types.split("|"))


def _at(value: Any, path: str) -> Any:
    """The value at a msgspec field path (`metrics.step_ms`, `repeats[0].step_ms[2]`), or None."""
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        try:
            value = value[int(index)] if index else value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _json(source: str | os.PathLike | bytes, name: str | None, what: str) -> tuple[Any, str]:
    """Parsed JSON of a file (every bound of vlmdoctor/inputs.py: a regular file, its size, UTF-8, nesting) or of
    bytes, and the name its errors use."""
    from vlmdoctor import inputs  # reads files for every input kind; imported here, documents.py stays a leaf

    if isinstance(source, bytes):
        where = name or what
        return inputs.parse_json(source, where), where
    return inputs.read_json(source, what, max_bytes=MAX_DOCUMENT_BYTES), name or str(source)


def read_document(source: str | os.PathLike | bytes, cls: type[D], what: str, name: str | None = None) -> D:
    """A document (a path, or its bytes) checked against its declaration `cls`; `what` names it in errors."""
    value, where = _json(source, name, what)
    return as_document(value, cls, where)


def read_report(source: str | os.PathLike | bytes, name: str | None = None) -> RunReport:
    """A report.json (a path, or its bytes), checked against its declaration."""
    return read_document(source, RunReport, "report", name)


def read_analysis(source: str | os.PathLike | bytes, name: str | None = None) -> Analysis:
    """An `analyze --json` result, checked against its declaration."""
    return read_document(source, Analysis, "analysis", name)


def as_report(report: RunReport | dict[str, Any], name: str = "report") -> RunReport:
    """A report read by field: a RunReport as it is, a report's dict through its declaration."""
    return report if isinstance(report, RunReport) else as_document(report, RunReport, name)


# --- the field table of docs/files.md ---------------------------------------------------------

#: the declarations docs/files.md lists first, in this order; the parts they hold follow
DOCUMENTS: tuple[type[Doc], ...] = (
    RunReport,
    RecordedConfig,
    Diagnosis,
    Analysis,
    TreatResult,
    GateVerdict,
    Comparison,
)


def _type_text(t: msgspec.inspect.Type) -> tuple[str, str, list[type[Doc]]]:
    """(the type in words, its description, the declared parts it holds)."""
    ins = msgspec.inspect
    if isinstance(t, ins.Metadata):
        text, desc, parts = _type_text(t.type)
        unit = (t.extra or {}).get("unit")
        return text + (f" ({unit})" if unit else ""), (t.extra_json_schema or {}).get("description") or desc, parts
    if isinstance(t, ins.UnionType):
        kinds = [_type_text(x) for x in t.types if not isinstance(x, ins.NoneType)]
        texts = list(dict.fromkeys(k[0] for k in kinds))
        texts = [x for x in texts if not (x.startswith("integer") and "number" + x.removeprefix("integer") in texts)]
        text = " or ".join(texts) + (" or null" if len(kinds) < len(t.types) else "")
        return text, next((k[1] for k in kinds if k[1]), ""), [p for k in kinds for p in k[2]]
    if isinstance(t, (ins.IntType, ins.FloatType)):
        bounds = [f"{op} {v:g}" for op, v in ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt)) if v is not None]
        if t.ge is not None and t.le is not None:
            bounds = [f"{t.ge:g}..{t.le:g}"]
        return ("integer" if isinstance(t, ins.IntType) else "number") + "".join(f" {b}" for b in bounds), "", []
    if isinstance(t, ins.ListType):
        text, desc, parts = _type_text(t.item_type)
        return f"list of {_one(text)}", desc, parts
    if isinstance(t, ins.DictType):
        text, _, parts = _type_text(t.value_type)
        return ("object" if text == "any" else f"object of {_one(text)}"), "", parts
    if isinstance(t, ins.StructType):
        return f"`{t.cls.__name__}`", (t.cls.__doc__ or "").split("\n")[0], [t.cls]
    words = {ins.StrType: "text", ins.BoolType: "true/false", ins.AnyType: "any"}
    return words.get(type(t), type(t).__name__), "", []


def _one(text: str) -> str:
    return f"({text})" if " or " in text else text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_fields() -> str:
    """The field table of every declared document and part, for docs/files.md: one table each, the documents
    first, then the parts in the order they are met."""
    todo, seen, out = list(DOCUMENTS), set(), []
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        out += [f"### `{cls.__name__}`", "", " ".join((cls.__doc__ or "").split()), ""]
        out += ["| field | type | meaning |", "|---|---|---|"]
        for f in msgspec.inspect.type_info(cls).fields:
            text, desc, parts = _type_text(f.type)
            out.append(f"| `{f.encode_name}` | {_cell(text)}{', required' if f.required else ''} | {_cell(desc)} |")
            todo += parts
        out.append("")
    return "\n".join(out)


_BEGIN = "<!-- fields table: generated from vlmdoctor/documents.py (python -m vlmdoctor.documents) -->\n"
_END = "<!-- end of the generated fields table -->\n"


def with_generated(text: str) -> str:
    """docs/files.md's text with its field table rewritten from the declarations."""
    return docgen.with_generated(text, _BEGIN, _END, markdown_fields(), "fields table")


if __name__ == "__main__":  # rewrite docs/files.md's field table: python -m vlmdoctor.documents
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "files.md"
    path.write_text(with_generated(path.read_text()))
    print(f"wrote the fields table of {path}")
