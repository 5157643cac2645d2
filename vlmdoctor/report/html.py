"""Self-contained HTML reports: one file, inline CSS, charts as inline SVG, no script, nothing fetched.

`profile_html` renders a run report in one of two layouts (`LAYOUTS`): `zoo`, a `vlmdoctor profile --json`
report of vlmdoctor's own run; `own`, a report of the user's own training (Doctor, DoctorCallback, `vlmdoctor
run`), about their run in their terms: their model's parts, the split of the traced step, every fix as the
lines they write, their ranks, and on a CPU the CPU facts. `analyze_html` renders the JSON that `vlmdoctor
analyze --json` writes, `treat_html` a treat result (`treat.json`). One page builder (`page`) and one set of
sections serve every page. Each page holds the numbers, the charts (step time split into GPU busy and idle
by cause; GPU time by kernel class; for treat, the ladder), the prescriptions in layer order and the
environment. Every piece of text from a report is escaped; a Content-Security-Policy forbids any fetch and
any script, so the file shows the same offline, in a mail attachment or in a CI artifact.

Each page reads its document through the declaration (vlmdoctor/documents/): a parsed JSON is checked once, here
at the entry (`as_report`, `as_document`), and every section reads fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmdoctor.documents import (
    OWN_SOURCES,
    Analysis,
    Env,
    Finding,
    Metrics,
    ModelInfo,
    RecordedConfig,
    Rung,
    RunReport,
    RunSummary,
    TraceInfo,
    TreatResult,
    Trial,
    as_document,
    as_report,
)
from vlmdoctor.errors import UsageError
from vlmdoctor.files import write_text
from vlmdoctor.report.console import changed_knobs, headline_tokens_per_s, measurement_notes
from vlmdoctor.report.html_page import esc, fmt_num, fmt_pct, html_table, kv_table, page, patch_html, patch_text, text
from vlmdoctor.report.html_sections import (
    cpu_section,
    cross_rank_section,
    env_section,
    facts_metrics,
    facts_sections,
    findings_section,
    gain_cell,
    measurement_notes_html,
    model_section,
    own_findings,
    own_metrics,
    ranks_section,
    report_env,
    tokens_spread,
    top_finding,
    top_fix,
)
from vlmdoctor.report.svg import ladder_svg, split_svg

#: the layouts of a run report's page: vlmdoctor's own run of its zoo, and the user's own training
LAYOUTS = ("zoo", "own")


def profile_html(report: RunReport | dict[str, Any], layout: str | None = None) -> str:
    """A run report (parsed JSON, or as declared) as one HTML page, in the layout of its kind (`LAYOUTS`; None:
    `own` for a report of the user's own training, else `zoo`)."""
    doc = as_report(report)
    layout = layout or ("own" if is_own(doc) else "zoo")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    tps, notes = headline_tokens_per_s(doc), measurement_notes(doc)
    title, subtitle, body = _own_layout(doc, tps, notes) if layout == "own" else _zoo_layout(doc, tps, notes)
    return page(title, subtitle, body)


def _findings(doc: Any) -> list[Finding] | None:
    """A report's, a trace's or the joined ranks' findings: the top-level list, else the diagnosis' (None: not
    diagnosed)."""
    if doc.findings is not None:
        return doc.findings
    return doc.diagnosis.findings if doc.diagnosis is not None else None


def _status_lines(report: RunReport) -> list[str]:
    """A run that did not finish cleanly, said first."""
    out = []
    if report.status not in ("ok", "nan_loss"):
        why = report.error.message if report.error is not None else ""
        out.append(f'<p class="warn">{esc(report.status)}: {esc(why)}</p>')
    if report.status == "nan_loss":
        out.append('<p class="warn">The loss was NaN or inf in a timed step.</p>')
    return out


def _zoo_layout(report: RunReport, tps: float | None, notes: list[str]) -> tuple[str, str, list[str]]:
    """A `vlmdoctor profile --json` report of a zoo run: title, subtitle and sections."""
    cfg, knobs, model = report.config or {}, report.knobs, report.model or ModelInfo()
    title = f"vlmdoctor profile: {knobs.model} stage {knobs.stage} on {_where(report)}"
    subtitle = (
        f"{model.vision} + {model.projector} + {model.llm}; "
        f"{model.image_tokens} image tokens; {text(report.created_at)}"
    )
    body: list[str] = []
    findings = _findings(report)
    body.append(top_finding(findings))
    body += _status_lines(report)
    try:
        changed = changed_knobs(cfg) if cfg else []
    except Exception:  # an unknown knob in an older report: list none rather than fail the page
        changed = []
    body.append(
        "<p>knobs changed from the default: "
        + (esc(", ".join(changed)) if changed else "none (the default config)")
        + "</p>"
    )
    body.extend(_zoo_metrics(report, tps))
    body.extend(measurement_notes_html(report, notes))
    tr = report.trace
    if tr is not None:
        steps = tr.traced_step_ms or [0]
        traced = sorted(steps)[len(steps) // 2]
        timed = report.metrics.step_ms if report.metrics is not None else None
        body.append(
            f'<p class="note">trace: {esc(tr.path or "analyzed, not kept")} ({esc(str(tr.steps))}'
            f" steps; traced step {esc(fmt_num(traced))} ms vs untraced median {esc(fmt_num(timed))} ms)</p>"
        )
    facts = report.facts
    if facts and "trace.error" not in facts:
        body.extend(facts_sections(facts))
    else:
        body.append('<p class="note">No trace facts in this report, so no step split and no kernel classes.</p>')
    body.append(findings_section(findings, report.diagnosis))
    body.append(env_section(report_env(report.env)))
    if cfg:
        body.append("<details><summary>full run config</summary>" + kv_table(sorted(cfg.items())) + "</details>")
    return title, subtitle, body


def _zoo_metrics(report: RunReport, tps: float | None) -> list[str]:
    """The metrics table of a zoo run, with each number's spread over the repeats (`tps`: the headline)."""
    m, stats = report.metrics, report.stats or {}
    if m is None or m == Metrics():
        return []
    body: list[str] = []

    def spread(key: str, digits: int = 0) -> str:
        s = stats.get(key)  # a metric's spread, where the report has one
        return f"{fmt_num(s.min, digits)} .. {fmt_num(s.max, digits)}" if s is not None and (s.n or 0) >= 2 else ""

    fps = m.flops_per_step
    rows = [
        (
            "real tokens/s",
            fmt_num(tps, 0),
            tokens_spread(report.throughput) or spread("real_tokens_per_s"),
        ),
        ("loss tokens/s", fmt_num(m.loss_tokens_per_s, 0), spread("loss_tokens_per_s")),
        ("pad fraction", fmt_pct(m.pad_fraction), ""),
        (
            "ms/step (median)",
            fmt_num(m.step_ms),
            f"p10 {fmt_num(m.step_ms_p10)} / p90 {fmt_num(m.step_ms_p90)}",
        ),
        ("MFU", fmt_pct(m.mfu, 2), "" if m.mfu is not None else text(m.mfu_reason)),
        ("model TFLOP/s", fmt_num(m.model_tflops_per_s, 2), ""),
    ]
    if fps:
        rows.append(("FLOPs/step", f"{fps / 1e9:,.2f} GFLOP", "counted on a real step"))
    if m.peak_mem_gb is not None:
        rows.append(
            (
                "peak memory allocated / reserved",
                f"{fmt_num(m.peak_mem_gb, 2)} / {fmt_num(m.peak_mem_reserved_gb, 2)} GiB",
                f"of {fmt_num(m.device_mem_total_gb)} GiB",
            )
        )
        if m.alloc_retries:
            rows.append(("allocator retries", str(m.alloc_retries), "timed steps: card full"))
    elif m.host_peak_rss_gb is not None:
        rows.append(("host peak RSS", fmt_num(m.host_peak_rss_gb, 2, " GiB"), ""))
    rows.append(
        (
            "final loss",
            fmt_num(m.final_loss, 4) + ("" if m.loss_finite is not False else " (not finite)"),
            "",
        )
    )
    body.append("<h2>Metrics</h2>")
    body.append(
        html_table(
            (
                "metric",
                "value",
                f"spread over {m.repeats} repeat(s) x {m.steps_per_repeat} steps",
            ),
            [tuple(esc(str(c)) for c in r) for r in rows],
            numeric=(1, 2),
        )
    )
    return body


#: the `own` layout's words for each way in (documents.OWN_SOURCES)
SOURCE_WORDS = {"api": "your loop (vlmdoctor.Doctor)", "trainer": "your Trainer run", "script": "your script"}


def is_own(report: RunReport | dict[str, Any]) -> bool:
    """A report of the user's own training, not of a vlmdoctor run of its zoo."""
    return as_report(report).knobs.source in OWN_SOURCES


def _where(report: RunReport) -> str:
    """The device a run measured: its GPU, or the CPU and its cores."""
    env = report.env or Env()
    return env.gpu or f"CPU ({env.cpu_count} cores)"


def _own_layout(report: RunReport, tps: float | None, notes: list[str]) -> tuple[str, str, list[str]]:
    """A report of the user's own training (their model, their fixes as the lines they write): title, subtitle
    and sections."""
    cfg, knobs, model = report.config or {}, report.knobs, report.model or ModelInfo()
    # stage_source and trainer_args: knobs only the ways in record, read where they are
    stage = f"stage {knobs.stage} ({cfg.get('stage_source')})" if knobs.stage else "stage unknown"
    title = f"vlmdoctor: {model.class_name or 'your model'}, {SOURCE_WORDS.get(knobs.source, 'your training')}"
    parts = ", ".join(f"{k} {v}" for k, v in (model.parts or {}).items())
    subtitle = f"{stage} on {_where(report)}" + (f"; {parts}" if parts else "") + f"; {text(report.created_at)}"
    findings = _findings(report)
    body = [top_fix(findings)]
    body += _status_lines(report)
    body += [f'<p class="note">note: {esc(str(n))}</p>' for n in report.notes or []]
    if report.metrics is not None and report.metrics != Metrics():
        body.append(own_metrics(report, tps))
    sp = report.split
    if sp:
        body.append("<h2>Where the step goes</h2>" + split_svg(sp))
    body += [f'<p class="warn">{esc(line)}</p>' for line in notes]
    if sp and sp["note"]:
        body.append(f'<p class="note">{esc(sp["note"])}</p>')
    if report.distributed is not None and report.distributed.ranks:
        body.append(ranks_section(report.distributed, report.cross_rank))
    body.append(own_findings(findings, report.diagnosis))
    body.append(model_section(model))
    facts = report.facts or {}
    tr = report.trace or TraceInfo()
    if tr.path:
        where = tr.dir if len(tr.rank_paths or []) > 1 else tr.path
        body.append(
            f'<p class="note">trace: <code>{esc(str(where))}</code>; open it at https://ui.perfetto.dev '
            "(Open trace file): your browser reads it, nothing is uploaded.</p>"
        )
    if facts.get("trace.cpu_only"):
        body.append(cpu_section(facts))
    elif facts and "trace.error" not in facts:
        body.extend(facts_sections(facts))
    elif "trace.error" in facts:
        body.append(f'<p class="warn">the trace could not be analyzed: {esc(str(facts["trace.error"]))}</p>')
    body.append(env_section(report_env(report.env)))
    known = {k: v for k, v in cfg.items() if k != "trainer_args"}
    body.append(
        "<details><summary>what vlmdoctor knows of your run</summary>" + kv_table(sorted(known.items())) + "</details>"
    )
    if cfg.get("trainer_args"):
        body.append(
            "<details><summary>your TrainingArguments (the fields read)</summary>"
            + kv_table(sorted(cfg["trainer_args"].items()))
            + "</details>"
        )
    return title, subtitle, body


def analyze_html(result: Analysis | dict[str, Any]) -> str:
    """The JSON of `vlmdoctor analyze --json` ({path, files: [{file, facts, meta, diagnosis, findings}]}), or the
    analysis as declared, as one HTML page, one section per trace file (one per rank)."""
    doc = as_document(result, Analysis, "analysis") if isinstance(result, dict) else result
    files = doc.files
    title = f"vlmdoctor analyze: {text(doc.path)}"
    subtitle = f"{len(files)} trace file(s)"
    body: list[str] = []
    for entry in files:
        facts = entry.facts
        if len(files) > 1:
            body.append(
                f'<h2 style="font-size:20px">{esc(entry.file)}'
                + (f" (rank {esc(str(entry.rank))})" if entry.rank is not None else "")
                + "</h2>"
            )
        else:
            body.append(
                f"<p>trace: <code>{esc(entry.file)}</code>"
                + ("" if facts.get("trace.written_by_vlmdoctor") else " (not written by vlmdoctor)")
                + "</p>"
            )
        findings = _findings(entry)
        body.append(top_finding(findings))
        body.append("<h2>Summary</h2>" + kv_table(facts_metrics(facts)))
        body.extend(facts_sections(facts))
        body.append(findings_section(findings if findings is not None else [], entry.diagnosis))
        body.append(env_section(_trace_env(facts, entry.meta or {}), TRACE_ENV_NOTE))
    if doc.cross_rank is not None:
        body.append(cross_rank_section(doc.cross_rank))
    return page(title, subtitle, body)


#: what an analysis' environment lacks: a trace records the device, not the software
TRACE_ENV_NOTE = (
    "A trace records the device, not the software: driver, torch and transformers versions come with a profile report."
)


def _trace_env(facts: dict[str, Any], meta: dict[str, Any]) -> list[tuple[str, Any]]:
    """The device a trace names: its facts, else the profiler's own record of the device (Kineto's
    `deviceProperties`, free-form: any key may be missing)."""
    devices = meta.get("deviceProperties")
    props = devices[0] if isinstance(devices, list) and devices else {}
    card = facts.get("memory.device_total_gb") or facts.get("measured.memory.device_total_gb")
    return [
        ("GPU", facts.get("device.name") or props.get("name")),
        ("GPU memory", fmt_num(card, 1, " GiB") if card else None),
        (
            "compute capability",
            f"{props['computeMajor']}.{props.get('computeMinor', 0)}"
            if props.get("computeMajor") is not None
            else None,
        ),
        ("SMs", props.get("numSms")),
    ]


def treat_html(result: TreatResult | dict[str, Any]) -> str:
    """A treat result (treat.json, or as declared) as one HTML page: the ladder chart, the kept steps, the trials
    not kept (with the decision's numbers) and the final config."""
    doc = as_document(result, TreatResult, "treat result") if isinstance(result, dict) else result
    cfg = doc.start_config or {}  # every knob of the config treated
    knobs = as_document(cfg, RecordedConfig, "treat result: start_config")
    trials = doc.trials
    title = f"vlmdoctor treat: {knobs.model} stage {knobs.stage}"
    subtitle = f"{len(trials)} trial(s); stopped: {doc.stopped_because}; {text(doc.created_at)}" + (
        f"; {fmt_num(doc.wall_s, 0)} s" if doc.wall_s else ""
    )
    body: list[str] = []
    if doc.interrupted:
        body.append('<p class="warn">Interrupted: the ladder measured so far.</p>')
    body.append("<h2>Ladder</h2>")
    body.append(ladder_svg(doc))
    if not doc.ladder:
        start = doc.start or RunSummary()
        body.append(f"<p>start: {esc(str(start.status))} {esc(start.error or '')}</p>")
    else:
        body.append(_ladder_table(doc.ladder))
    own = [(r.step, c) for r in doc.ladder for c in r.changes or []]
    if own:
        body.append("<h2>Each change's own contribution</h2>")
        body.append(_changes_table(own))
        att = doc.trace_attribution
        if att is not None and att.explained_share is not None:
            body.append(
                f'<p class="note">the targets\' drops add up to {esc(fmt_pct(att.explained_share, 0))} of the time per '
                f"real token saved ({esc(fmt_num(att.start_us_per_token, 1))} → "
                f"{esc(fmt_num(att.final_us_per_token, 1))} µs per token)</p>"
            )
    if trials:
        body.append("<h2>Trials, in the order tried</h2>")
        body.append(_trials_table(trials))
    dec = doc.decision
    if dec is not None and dec.rule:
        body.append(f'<p class="note">decision: {esc(dec.rule)} (min gain {esc(fmt_pct(dec.min_gain, 0))})</p>')
    if doc.skipped:  # each {rule, config_patch, why} (doctor/treat.py `compose`)
        body.append(
            "<h3>Skipped prescriptions</h3><ul>"
            + "".join(
                f"<li><code>{esc(str(s['rule']))}</code> (<code>{esc(patch_text(s['config_patch']))}</code>): "
                f"{esc(str(s['why']))}</li>"
                for s in doc.skipped
            )
            + "</ul>"
        )
    final = doc.final_config or {}
    changed = {k: v for k, v in final.items() if cfg.get(k) != v and k != "source"}
    body.append(
        "<h2>Final config</h2><p>changed from the start: "
        + (f"<code>{esc(patch_text(changed))}</code>" if changed else "nothing")
        + "</p>"
    )
    outputs = doc.outputs or {}
    if outputs.get("config"):
        body.append(f"<p>run it again: <code>vlmdoctor profile --config {esc(outputs['config'])}</code></p>")
    body.append(env_section(report_env(doc.env)))
    if cfg:
        body.append("<details><summary>start config</summary>" + kv_table(sorted(cfg.items())) + "</details>")
    return page(title, subtitle, body)


def _ladder_table(ladder: list[Rung]) -> str:
    """The kept rungs: each change, its rule, its tokens/s (the repeats' range), its speedup and numbers."""
    rows = []
    for r in ladder:
        reps = r.tokens_per_s_repeats or []
        spread = f" ({fmt_num(min(reps), 0)}-{fmt_num(max(reps), 0)})" if len(reps) > 1 else ""
        rows.append(
            (
                esc(str(r.step)),
                esc(str(r.change) + (" (adopted on pairs of windows in one process)" if r.in_process else "")),
                f"<code>{esc(r.rule)}</code>" if r.rule else "",
                esc(fmt_num(r.real_tokens_per_s, 0) + spread),
                esc("x" + fmt_num(r.speedup, 2)),
                esc(fmt_num(r.step_ms)),
                esc(fmt_pct(r.mfu, 2) if r.mfu else "n/a"),
                esc(fmt_num(r.peak_mem_gb)),
            )
        )
    return html_table(
        ("#", "change", "rule", "real tokens/s (repeats)", "x start", "ms/step", "MFU", "peak GiB"),
        rows,
        numeric=(0, 3, 4, 5, 6, 7),
    )


def _changes_table(own: list[tuple[int | None, dict[str, Any]]]) -> str:
    """Each adopted change: its leave-one-out verdict in the final config, and its rule's target read in the start
    trace and the adopted config's (doctor/treat_attribution.py)."""
    rows = []
    for step, c in own:
        k, tr = c.get("contribution") or {}, c.get("trace") or {}
        x = "" if k.get("ratio") is None else _ratio_ci(k["ratio"], k.get("ci_low"), k.get("ci_high"))
        if k.get("pairs"):
            x += f" ({k['pairs']} pair(s){' in one process' if k.get('in_process') else ''})"
        elif k.get("in_process") and k.get("why"):
            x = f"{k['why']}"
        shared = ", ".join(tr.get("shared_with") or [])
        target = (
            f"{fmt_pct(tr['start_share'], 1)} → {fmt_pct(tr['final_share'], 1)}"
            if tr.get("start_share") is not None
            else str(tr.get("why") or "")
        )
        rows.append(
            (
                esc(str(step)),
                f"<code>{esc(str(c.get('rule')))}</code>",
                esc(str(k.get("outcome") or "")),
                esc(x or str(k.get("why") or k.get("how") or "")),
                esc(target),
                esc(fmt_pct(tr.get("share_of_saving"), 0) if tr.get("share_of_saving") is not None else ""),
                esc(shared),
            )
        )
    return html_table(
        (
            "#",
            "rule",
            "leave-one-out",
            "x own [95% CI]",
            "its target, % of the step: start → final",
            "of the time per token saved",
            "target shared with",
        ),
        rows,
        numeric=(0, 5),
    )


def _measured(t: Trial) -> str:
    """What a trial measured, as its decision read it."""
    if t.ratio is not None:
        return esc(_paired(t) + (" in one process" if t.in_process else ""))
    if t.gain is not None:  # a treat.json of the first treat: gain against the spread-based margin
        return f"{t.gain * 100:+.1f}% vs ±{(t.margin or 0) * 100:.1f}%"
    if t.ratios:  # the time cut the comparison short: the pairs it did measure
        return esc(", ".join(f"x{r:.2f}" for r in t.ratios) + f": {t.why or ''}")
    # a failed arm: why it failed; an ablation's says what that means for the change it left out
    return esc(": ".join(str(x) for x in (t.why, t.error) if x))


def _trials_table(trials: list[Trial]) -> str:
    """Every trial in the order tried: its prescription and patch, the expected gain, what it measured, its outcome."""
    rows = []
    for t in trials:
        outcome = str(t.outcome)
        cls = "kept" if outcome == "adopted" else outcome if outcome in ("kept", "no_gain", "harmful") else "failed"
        rows.append(
            (
                esc(str(t.trial)),
                esc(text(t.layer)),
                f"<b>{esc(t.title or '')}</b><br><code>{esc(str(t.rule))}</code>",
                patch_html(t.config_patch),
                gain_cell(t.expected_gain),
                esc(fmt_num(t.real_tokens_per_s, 0)),
                _measured(t),
                f'<span class="badge {cls}">{esc(outcome)}</span>',
            )
        )
    return html_table(
        (
            "trial",
            "layer",
            "prescription",
            "config patch",
            "expected gain",
            "real tokens/s",
            "measured: paired ratio [95% CI] (pairs)",
            "outcome",
        ),
        rows,
        numeric=(0, 5, 6),
        cls="wide",
    )


def _paired(t: Trial) -> str:
    """x1.23 [1.10-1.38] (3): the paired ratio, its interval and the pairs it rests on."""
    return f"{_ratio_ci(t.ratio, t.ci_low, t.ci_high)} ({t.pairs})"


def _ratio_ci(ratio: float, lo: float | None, hi: float | None) -> str:
    """x1.23 [1.10-1.38]: a paired ratio and its interval (none where it is open)."""
    ci = f" [{lo:.2f}-{hi:.2f}]" if lo is not None and hi is not None and hi != float("inf") else ""
    return f"x{ratio:.2f}{ci}"


def write_html(text: str, path: Path, force: bool = False) -> None:
    """Write a page through the one writer (atomic, regular files only); an existing file only with `force`."""
    target = Path(path)
    if target.exists() and not force:
        raise UsageError(f"{target} exists; pass --force to overwrite it")
    if target.is_dir():
        raise UsageError(f"{target} is a folder; give a file name ending in .html")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text(target, text)
