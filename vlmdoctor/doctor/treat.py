"""Apply the prescriptions one at a time, re-measure each in a fresh process, keep what helped.

A doctor whose advice is never checked is a blog post. `treat` profiles the start config, takes
the first prescription in layer order, applies its config patch, profiles again in a new
process, and keeps the change only when real tokens/s rose by more than the noise:

    keep     when  median(trial) / median(current) - 1  >  margin
    harmful  when  median(trial) / median(current) - 1  < -margin
    no gain  otherwise,   margin = max(min_gain, spread(current), spread(trial))

where median and spread are taken over the repeats (timed windows) of each run, spread being
(max - min) / median. A trial that runs out of memory, crashes or diverges is recorded with that
outcome and reverted. The next prescription comes from the diagnosis of the run now kept, so a
fix that changes the picture (a bigger batch, compile) changes what is prescribed next; a
prescription that did not help may be tried again once another change was kept.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vlmdoctor import SCHEMA_VERSION, __version__
from vlmdoctor.run.config import RunConfig
from vlmdoctor.errors import EXIT_USAGE, UsageError

Runner = Callable[[RunConfig], dict[str, Any]]
PROFILE_FACTS = ("gpu.busy_frac", "gpu.busy_tflops", "launch.kernels", "idle.other_host.ms", "idle.data_loader.ms",
                 "idle.op.cudnn_attention.ms", "gemm.ms", "gpu.busy_ms", "step.ms")
Notify = Callable[[str], None]


@dataclass
class TreatOptions:
    max_trials: int = 8
    time_budget_s: float | None = None
    min_gain: float = 0.03  # below 3% a change is not worth a config line, whatever the noise
    trial_timeout_s: float = 900.0
    rules_dirs: list[str] = field(default_factory=list)


def tokens(report: dict[str, Any]) -> list[float]:
    """Real tokens/s of each timed window of a run."""
    return [r["real_tokens_per_s"] for r in report.get("repeats") or []]


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def decide(current: dict[str, Any], trial: dict[str, Any], min_gain: float) -> dict[str, Any]:
    """Kept, no gain or harmful, with the numbers the decision used."""
    a, b = tokens(current), tokens(trial)
    gain = statistics.median(b) / statistics.median(a) - 1
    margin = max(min_gain, spread(a), spread(b))
    outcome = "kept" if gain > margin else "harmful" if gain < -margin else "no_gain"
    return {"outcome": outcome, "gain": gain, "margin": margin, "current_median": statistics.median(a),
            "trial_median": statistics.median(b), "current_spread": spread(a), "trial_spread": spread(b)}


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """What the ladder shows of one run."""
    m = report.get("metrics") or {}
    facts = report.get("facts") or {}
    return {"status": report.get("status"), "real_tokens_per_s": m.get("real_tokens_per_s"),
            # what limits this rung, from its traced window: how busy the GPU was, and how fast while busy
            "profile": {k: facts.get(k) for k in PROFILE_FACTS if k in facts},
            "tokens_per_s_repeats": tokens(report), "step_ms": m.get("step_ms"), "mfu": m.get("mfu"),
            "peak_mem_gb": m.get("peak_mem_gb"), "pad_fraction": m.get("pad_fraction"),
            "findings": [f["id"] for f in report.get("findings") or []],
            "error": (report.get("error") or {}).get("message")}


def _next(current_cfg: RunConfig, report: dict[str, Any], tried: set[str],
          skipped: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], RunConfig] | None:
    """The first untried prescription whose patch changes something and makes a valid config:
    (finding, the knobs it changes, the new config)."""
    state = json.dumps(current_cfg.to_dict(), sort_keys=True, default=str)
    for f in report.get("findings") or []:
        # a prescription is tried once per config: after a kept change (the picture changed: a bigger
        # batch can make bf16 weights pay off where the host-bound step hid it) it may be tried again
        key = f["id"] + json.dumps(f["config_patch"], sort_keys=True, default=str) + state
        if key in tried:
            continue
        tried.add(key)
        changes = {k: v for k, v in f["config_patch"].items() if getattr(current_cfg, k, None) != v}
        if not changes:
            skipped.append({"rule": f["id"], "config_patch": f["config_patch"], "why": "the config already has it"})
            continue
        try:
            return f, changes, current_cfg.replace(source=f"prescription {f['id']}", **changes)
        except UsageError as e:
            skipped.append({"rule": f["id"], "config_patch": f["config_patch"], "why": e.message})
    return None


def treat(cfg: RunConfig, run: Runner, opts: TreatOptions, notify: Notify = lambda _: None) -> dict[str, Any]:
    """The ladder: each kept step with its numbers, and every trial with its outcome.

    Ctrl-C ends the treatment; the ladder measured so far is returned, marked interrupted.
    """
    t0 = time.time()
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "kind": "treat", "tool": {"name": "vlmdoctor", "version": __version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "start_config": cfg.to_dict(),
        "decision": {"min_gain": opts.min_gain, "rule": "keep when the median real tokens/s over the trial's repeats "
                     "beats the current run's by more than max(min_gain, the relative spread (max-min)/median of "
                     "either run's repeats); harmful when it loses by more than that; each trial in a fresh process"},
        "ladder": [], "trials": [], "skipped": [], "interrupted": False,
    }
    current_cfg = cfg
    try:
        notify("measuring the start config")
        current = run(cfg)
        out["env"] = current.get("env")
        out["start"] = summary(current)
        if current.get("status") != "ok" or not tokens(current):
            why = (current.get("error") or {}).get("message") or "it measured no throughput"
            out["stopped_because"] = f"the start config did not run ({current.get('status') or 'no report'}): {why}"
            out["final_config"] = cfg.to_dict()
            return out
        base = statistics.median(tokens(current))
        out["ladder"].append({"step": 0, "change": "start", "rule": None, "config_patch": {},
                              **summary(current), "speedup": 1.0})
        tried: set[str] = set()
        out["stopped_because"] = "no prescription left"
        while True:
            if len(out["trials"]) >= opts.max_trials:
                out["stopped_because"] = f"--max-trials {opts.max_trials} reached"
                break
            if opts.time_budget_s is not None and time.time() - t0 > opts.time_budget_s:
                out["stopped_because"] = f"--time-budget {opts.time_budget_s:.0f} s spent"
                break
            pick = _next(current_cfg, current, tried, out["skipped"])
            if pick is None:
                break
            finding, patch, trial_cfg = pick
            label = ", ".join(f"{k}={v}" for k, v in patch.items())
            notify(f"trial {len(out['trials']) + 1}: {finding['id']} ({label})")
            report = run(trial_cfg)
            entry = {"trial": len(out["trials"]) + 1, "rule": finding["id"], "layer": finding["layer"],
                     "title": finding["title"], "config_patch": patch,
                     "expected_gain": finding.get("expected_gain"), **summary(report)}
            if report.get("status") == "ok" and tokens(report):
                entry.update(decide(current, report, opts.min_gain))
            elif report.get("status") == "error" and (report.get("error") or {}).get("exit_code") == EXIT_USAGE:
                entry["outcome"] = "not_applicable"  # the run refused the config (a GPU-only knob on CPU, say)
            else:
                entry["outcome"] = report.get("status") or "error"  # oom, nan_loss, error: reverted
            out["trials"].append(entry)
            if entry["outcome"] == "kept":
                current_cfg, current = trial_cfg, report
                out["ladder"].append({"step": len(out["ladder"]), "change": label, "rule": finding["id"],
                                      "config_patch": patch, **summary(report),
                                      "speedup": statistics.median(tokens(report)) / base})
    except KeyboardInterrupt:
        out["interrupted"] = True
        out["stopped_because"] = "interrupted (Ctrl-C)"
    out["final_config"] = current_cfg.to_dict()
    out["wall_s"] = time.time() - t0
    return out
