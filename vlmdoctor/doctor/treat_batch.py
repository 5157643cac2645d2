"""The batch ceiling for `treat` (doctor/treat.py): peak memory against the batch, per config family, from every run
of the treatment (`MemoryModel`), and the larger batch it leaves room for (`batch_probe`, `with_probe`), so that a
treatment raises the batch to what fits, measured, rather than to one rule's guess."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmdoctor.doctor.decide import throughput
from vlmdoctor.doctor.treat_compose import MEASUREMENT_KNOBS, apply, config_key
from vlmdoctor.errors import UsageError
from vlmdoctor.run.config import RunConfig

#: the rule id a batch probe is recorded under (not a rule file: treat's own search, from measured memory)
PROBE_RULE = "treat-batch-probe"
#: share of the card the probe sizes the batch for, in allocated (live) memory. Higher than the batch rule's
#: HEADROOM (0.7, the rule's one guess): the probe is a first guess that an out-of-memory run bisects. On the H100
#: (2026-11-26) llava-siglip2-0.5b ran batch 112 at 76.2 of 79.2 GiB allocated (96%) and ran out at 144; sized for
#: 70%, treat's 0.5b stage-2 batch would stop a quarter short of what fits
PROBE_HEADROOM = 0.9
#: the probe runs only when the memory model leaves room for this much more batch: a smaller step is not worth
#: a round of paired runs
PROBE_MIN_STEP = 1.25
#: the most a probe multiplies the batch by, as the batch rule does: memory per sample is extrapolated
PROBE_MAX_FACTOR = 8
#: the most a memory line (two measured batches) is extrapolated: this many times its largest batch. On four H100s
#: (qwen2-vl-2b with gradient checkpointing kept, 2026-11-28) batches 8, 16 and 32 read 0.08 GiB a sample and
#: promised batch 256, whose runs (steps 8x as long) did not end in the 140 s the budget had left
PROBE_STEP_X = 4
#: a doubling of the batch that raised the measured throughput less than this is saturated: no larger batch is
#: sized (runs side by side on one host differ by a few percent; an underfed GPU gains 20% and more a doubling)
PROBE_MIN_RISE = 1.10
#: a batch past PROBE_HEADROOM of the card that runs this much slower than a smaller batch of its family is at the
#: memory wall (likely the allocator freeing and retrying; not measured): counted as out of memory. On two H200s
#: (qwen2-vl-2b, 2026-11-28) batch 80 peaked at 135.5 of 139.8 GiB (97%) and ran 4,075 ms a step (11,255 tokens/s),
#: where batch 73 at 89% ran 1,130 ms (34,898) on the same host; the treatment adopted it. Where it ran near the wall
#: and faster than any smaller batch, it is kept: the same batch on another two-H200 host the day before ran 34,068
WALL_SLOWER = 1 / PROBE_MIN_RISE


def family(cfg: RunConfig) -> str:
    """The config without its batch and its measurement knobs: runs of one family differ in memory by the batch."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("batch_size", *MEASUREMENT_KNOBS)}
    return json.dumps(d, sort_keys=True, default=str)


@dataclass
class MemoryModel:
    """Peak allocated memory against the batch, per config family, from every run of the treatment.

    The batch a family can hold is (usable - fixed) / per_sample: from two measured batches, the line
    through them; from one, per_sample = peak / batch (fixed taken as 0, which overestimates the memory a
    sample needs and so underestimates the batch). An out-of-memory run bounds it from above, and bounds the memory a
    sample takes from below: at least the card less the largest batch that ran's peak, over the batches between.
    After a family's first out-of-memory run the next guess is that bound's batch; after another, the middle between
    the largest batch that ran and the smallest that did not. Why: on four H200s (qwen2-vl-2b, 2026-11-28) batches 11
    and 22 read 1.41 GiB a sample, batch 81 ran out of memory, the middle (51) peaked at 59% of the card, and the
    bound reads 1.66 GiB a sample: batch 72 (one GPU measured 73 at 89%)."""

    points: dict[str, dict[int, float]] = field(default_factory=dict)
    # the batches of the family that ran out of memory (one batch on N GPUs at once is one): bound first, then middle
    oom_batches: dict[str, set[int]] = field(default_factory=dict)
    flat: dict[str, int] = field(default_factory=dict)  # a larger batch measured and not kept: saturated
    rates: dict[str, dict[int, float]] = field(default_factory=dict)  # tokens/s by batch, from the same runs
    retries: dict[str, dict[int, int]] = field(default_factory=dict)  # the allocator's retries in the timed steps
    total_gb: float | None = None

    @property
    def oom(self) -> dict[str, int]:
        """Each family's smallest batch that ran out of memory or ran at the memory wall (`too_large`)."""
        return {fam: min(bs) for fam in {*self.oom_batches, *self.points} if (bs := self.too_large(fam))}

    def at_wall(self, cfg: RunConfig) -> bool:
        """The config's batch ran at the memory wall (`_wall`)."""
        return cfg.batch_size in self._wall(family(cfg))

    def too_large(self, fam: str) -> set[int]:
        """The family's batches that ran out of memory, and those that ran at the memory wall (`_wall`)."""
        return self.oom_batches.get(fam, set()) | self._wall(fam)

    def _wall(self, fam: str) -> set[int]:
        """The family's batches past PROBE_HEADROOM of the card that ran slower than a smaller batch (WALL_SLOWER)."""
        pts, rates = self.points.get(fam, {}), self.rates.get(fam, {})
        if not self.total_gb:
            return set()
        usable = PROBE_HEADROOM * self.total_gb
        return {
            b
            for b, t in rates.items()
            if pts.get(b, 0.0) >= usable and any(bb < b and tt * WALL_SLOWER > t for bb, tt in rates.items())
        }

    def observe(self, cfg: RunConfig, report: dict[str, Any]) -> None:
        fam, b = family(cfg), cfg.batch_size
        m = report.get("metrics") or {}
        if report.get("status") == "oom":
            self.oom_batches.setdefault(fam, set()).add(b)
            return
        if report.get("status") != "ok" or not m.get("peak_mem_gb") or not m.get("device_mem_total_gb"):
            return
        self.total_gb = float(m["device_mem_total_gb"])
        pts = self.points.setdefault(fam, {})
        pts[b] = max(pts.get(b, 0.0), float(m["peak_mem_gb"]))
        if m.get("alloc_retries") is not None:
            got = self.retries.setdefault(fam, {})
            got[b] = max(got.get(b, 0), int(m["alloc_retries"]))
        rate = throughput(report)
        if rate:
            self.rates.setdefault(fam, {})[b] = max(self.rates.get(fam, {}).get(b, 0.0), rate)

    def saturated(self, cfg: RunConfig) -> tuple[int, str] | None:
        """The batch no larger one is sized past, with the words; None while throughput still rises. Throughput
        stopped rising at the smallest measured batch that ran less than PROBE_MIN_RISE a doubling faster than the
        batch before it (at least 1.5x smaller); where a larger measured batch ran faster still, the cap is that
        one: the cap bounds the batches not yet measured, and never drops a measured batch that ran faster. Why: on
        four H200s (llava-siglip2-0.5b, 2026-11-28) batches 32, 64 and 128 ran at once, 32 to 64 rose less than
        10%, and the cap at 64 left the measured 128 out: adopted at 142,207 tokens/s where one GPU's batch 152
        ran 151,253-155,080."""
        r = sorted(self.rates.get(family(cfg), {}).items())
        for (b1, t1), (b2, t2) in zip(r, r[1:]):
            if b2 >= 1.5 * b1 and t2 / t1 < PROBE_MIN_RISE ** math.log2(b2 / b1):
                how = f"throughput {t2 / t1:.2f}x from batch {b1} to {b2}: saturated"
                fastest, tf = max(r, key=lambda bt: bt[1])
                if fastest > b2:
                    return fastest, f"{how}; batch {fastest} measured faster still ({tf / t2:.2f}x batch {b2})"
                return b2, how
        return None

    def ceiling(self, cfg: RunConfig) -> tuple[int, str] | None:
        """The largest batch the family should hold, and how that was worked out; None without memory facts."""
        fam = family(cfg)
        pts = sorted(self.points.get(fam, {}).items())
        if not pts or not self.total_gb:
            return None
        usable = PROBE_HEADROOM * self.total_gb
        (b1, p1), (b2, p2) = (pts[-2], pts[-1]) if len(pts) >= 2 else (pts[-1], pts[-1])
        per = (p2 - p1) / (b2 - b1) if b2 > b1 else 0.0
        if per > 0:
            fixed = max(0.0, p2 - per * b2)
            how = f"{per:.2f} GiB a sample + {fixed:.1f} GiB fixed (batches {b1} and {b2})"
        else:
            per, fixed = p2 / b2, 0.0
            how = f"{p2:.1f} GiB at batch {b2}: at most {per:.2f} GiB a sample"
        target = int((usable - fixed) // per)
        how += f"; {PROBE_HEADROOM:.0%} of {self.total_gb:.0f} GiB holds batch {target}"
        target = min(target, PROBE_MAX_FACTOR * cfg.batch_size)
        if len(pts) >= 2 and target > PROBE_STEP_X * b2:
            target = PROBE_STEP_X * b2
            how += f"; at most {PROBE_STEP_X}x the largest batch measured: {target}"
        sat = self.saturated(cfg)
        if sat is not None and target > sat[0]:
            target = sat[0]
            how += f"; {sat[1]}"
        over = self.too_large(fam)
        oom = min(over, default=None)
        if oom is not None and target >= oom:
            fits, p_fit = max([(b, p) for b, p in pts if b < oom], default=(cfg.batch_size, None))
            if len(over) == 1 and p_fit is not None and p_fit < usable:
                least = (self.total_gb - p_fit) / (oom - fits)  # the card filled between `fits` and `oom`, at least
                target = fits + int((usable - p_fit) // least)
                how += (
                    f"; {self.over_words(fam, oom)}: at least {least:.2f} GiB a sample above batch {fits} holds "
                    f"batch {target}"
                )
            else:
                target = (fits + oom) // 2
                how += f"; {self.over_words(fam, oom)}: bisected to {target}"
        elif oom is not None:
            how += f"; {self.over_words(fam, oom)}"
        return target, how

    def over_words(self, fam: str, b: int) -> str:
        """Why the family's batch b is too large: out of memory, or at the memory wall."""
        if b in self.oom_batches.get(fam, set()):
            return f"out of memory at batch {b}"
        retried = self.retries.get(fam, {}).get(b)
        also = f", {retried} allocator retries in its timed steps" if retried is not None else ""
        return (
            f"batch {b} at the memory wall (slower than a smaller batch, past {PROBE_HEADROOM:.0%} of the card{also})"
        )


def batch_probe(cfg: RunConfig, mem: MemoryModel) -> dict[str, Any] | None:
    """A change to the batch the measured memory allows, when that is well above the current one and the family
    did not already show that a larger batch does not pay."""
    fam = family(cfg)
    if fam in mem.flat and mem.flat[fam] > cfg.batch_size:
        return None
    ceiling = mem.ceiling(cfg)
    if ceiling is None:
        return None
    target, how = ceiling
    if target < math.ceil(PROBE_MIN_STEP * cfg.batch_size):
        return None
    return {
        "rule": PROBE_RULE,
        "layer": 2,
        "title": "probe the batch ceiling: memory left room",
        "config_patch": {"batch_size": target},
        "expected_gain": None,
        "why": how,
    }


def _raises_batch(comp: dict[str, Any], cfg: RunConfig) -> bool:
    return any((ch["config_patch"].get("batch_size") or 0) > cfg.batch_size for ch in comp["changes"])


def with_probe(
    found: list[dict[str, Any]],
    cfg: RunConfig,
    mem: MemoryModel,
    validate: Callable[[RunConfig], Any],
    tried: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[dict[str, Any]]:
    """The compositions with the batch probe: in the first one (a larger batch is tried with the other changes
    of its round), or alone when there is no other or that joint config was measured already. Unchanged
    when a composition already raises the batch (the batch rule sized it) or memory leaves no room."""
    if any(_raises_batch(c, cfg) for c in found):
        return found
    probe = batch_probe(cfg, mem)
    if probe is None:
        return found
    options = []
    if found:
        joint = sorted([*found[0]["changes"], probe], key=lambda ch: ch["layer"])
        options.append(({"name": found[0]["name"], "changes": joint}, found[1:]))
    options.append(({"name": "batch probe", "changes": [probe]}, []))
    for comp, others in options:
        try:
            comp["config"] = apply(cfg, comp["changes"])
            validate(comp["config"])
        except UsageError:
            continue
        if config_key(comp["config"]) not in tried:
            return [comp, *others]
    return found
