"""A treatment's limits, declared once: doctor/treat.py runs under `TreatOptions`, and `vlmdoctor treat`'s options
default to its fields. A light module (the paired engine, doctor/decide.py, whose decision defaults it takes, needs
only the standard library), so that the command line reads the defaults without loading the treatment."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmdoctor.doctor.decide import CONFIDENCE, MIN_GAIN, MIN_PAIRS, PairedOptions
from vlmdoctor.supervise import RUN_TIMEOUT_S

#: share of --time-budget kept for the final ablation once a round has adopted changes: a later round of new
#: compositions starts only when its pairs fit beside it, and a comparison spends it only while its candidate has
#: shown a gain on every pair (docs/treat.md, "The budget plan")
ABLATION_SHARE = 0.25


@dataclass
class TreatOptions:
    max_trials: int = 24
    time_budget_s: float | None = 540.0  # 9 minutes: with the runs' own limit, one treatment ends within 10
    min_gain: float = MIN_GAIN
    trial_timeout_s: float = float(RUN_TIMEOUT_S)  # a run's own limit, as every run of vlmdoctor has
    rules_dirs: list[str] = field(default_factory=list)
    confidence: float = CONFIDENCE
    min_pairs: int = MIN_PAIRS
    max_pairs: int = 6
    ablation_share: float = ABLATION_SHARE
    #: GPUs a round's pairs (lanes) and the final ablation's arms run on at once, every pair on one GPU (0: every
    #: visible one; 1: as before)
    trial_gpus: int = 1

    def paired(self) -> PairedOptions:
        return PairedOptions(self.min_gain, self.confidence, self.min_pairs, self.max_pairs)
