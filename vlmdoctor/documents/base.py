"""What every declared document shares: the kinds of number (each with one name and one meaning wherever a
document holds it), the base of every declared part, the error a bad document raises, and the parts every document
may hold (how a run ended, the tool that wrote it)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

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
AllocRetries = Annotated[
    Count,
    Meta(description="the CUDA caching allocator's retries in the timed steps: a failed cudaMalloc, the cache freed"),
]
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


class ErrorInfo(Doc, kw_only=True):
    """How a run that did not finish cleanly ended."""

    type: Annotated[str, Meta(description="OutOfMemory, NonFiniteLoss, Timeout, NoSteps, ScriptFailed, ...")] = ""
    message: Annotated[str, Meta(description="one line saying what happened")] = ""
    where: Annotated[str | None, Meta(description="out of memory: on the GPU or the host")] = None


class Tool(Doc, kw_only=True):
    """The program that wrote the document."""

    name: Annotated[str, Meta(description="vlmdoctor")] = "vlmdoctor"
    version: Annotated[str | None, Meta(description="its version")] = None


#: `config.source` of a report of the user's own training: the way in that measured it (Doctor, DoctorCallback,
#: `vlmdoctor run`); a zoo run's report has none
OWN_SOURCES = ("api", "trainer", "script")
