"""A treatment's limits, declared once: doctor/treat.py runs under `TreatOptions`, and `vlmdoctor treat`'s options
default to its fields. A light module (the paired engine, doctor/decide.py, is loaded when a treatment asks for
it), so that the command line reads the defaults without loading the treatment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vlmdoctor.supervise import RUN_TIMEOUT_S

if TYPE_CHECKING:
    from vlmdoctor.doctor.decide import PairedOptions

#: share of --time-budget kept for the final ablation once a round has adopted changes: a later round of new
#: compositions starts only when its pairs fit beside it, and a comparison spends it only while its candidate has
#: shown a gain on every pair (docs/treat.md, "The budget plan")
ABLATION_SHARE = 0.25


@dataclass
class TreatOptions:
    max_trials: int = 24
    time_budget_s: float | None = 540.0  # 9 minutes: with the runs' own limit, one treatment ends within 10
    min_gain: float = 0.02
    trial_timeout_s: float = float(RUN_TIMEOUT_S)  # a run's own limit, as every run of vlmdoctor has
    rules_dirs: list[str] = field(default_factory=list)
    confidence: float = 0.95
    min_pairs: int = 3
    max_pairs: int = 6
    ablation_share: float = ABLATION_SHARE

    def paired(self) -> PairedOptions:
        from vlmdoctor.doctor.decide import PairedOptions  # deferred: the paired engine; keeps --help fast

        return PairedOptions(self.min_gain, self.confidence, self.min_pairs, self.max_pairs)
