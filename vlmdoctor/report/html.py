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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmdoctor.documents import OWN_SOURCES
from vlmdoctor.errors import UsageError
from vlmdoctor.files import write_text
from vlmdoctor.report.console import changed_knobs, measurement_notes
from vlmdoctor.report.html_page import esc, fmt_num, fmt_pct, html_table, kv_table, page, patch_html, patch_text
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
    top_finding,
    top_fix,
)
from vlmdoctor.report.svg import ladder_svg, split_svg
from vlmdoctor.run import throughput

#: the layouts of a run report's page: vlmdoctor's own run of its zoo, and the user's own training
LAYOUTS = ("zoo", "own")


def profile_html(report: dict[str, Any], layout: str | None = None) -> str:
    """A run report as one HTML page, in the layout of its kind (`LAYOUTS`; None: `own` for a report of the
    user's own training, else `zoo`)."""
    layout = layout or ("own" if is_own(report) else "zoo")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    title, subtitle, body = _own_layout(report) if layout == "own" else _zoo_layout(report)
    return page(title, subtitle, body)


def _zoo_layout(report: dict[str, Any]) -> tuple[str, str, list[str]]:
    """A `vlmdoctor profile --json` report of a zoo run: title, subtitle and sections."""
    cfg, env, model = report.get("config") or {}, report.get("env") or {}, report.get("model") or {}
    title = f"vlmdoctor profile: {cfg.get('model')} stage {cfg.get('stage')} on {_where(report)}"
    subtitle = (
        f"{model.get('vision')} + {model.get('projector')} + {model.get('llm')}; "
        f"{model.get('image_tokens')} image tokens; {report.get('created_at', '')}"
    )
    body: list[str] = []
    diagnosis = report.get("diagnosis")
    findings = report.get("findings", (diagnosis or {}).get("findings"))
    body.append(top_finding(findings))
    status = report.get("status")
    if status not in ("ok", "nan_loss"):
        err = report.get("error") or {}
        body.append(f'<p class="warn">{esc(str(status))}: {esc(str(err.get("message", "")))}</p>')
    if status == "nan_loss":
        body.append('<p class="warn">The loss was NaN or inf in a timed step.</p>')
    try:
        changed = changed_knobs(cfg) if cfg else []
    except Exception:  # an unknown knob in an older report: list none rather than fail the page
        changed = []
    body.append(
        "<p>knobs changed from the default: "
        + (esc(", ".join(changed)) if changed else "none (the default config)")
        + "</p>"
    )
    m = report.get("metrics") or {}
    body.extend(_zoo_metrics(report))
    body.extend(measurement_notes_html(report))
    tr = report.get("trace")
    if tr:
        traced = sorted(tr.get("traced_step_ms") or [0])[len(tr.get("traced_step_ms") or [0]) // 2]
        body.append(
            f'<p class="note">trace: {esc(str(tr.get("path") or "analyzed, not kept"))} ({esc(str(tr.get("steps")))}'
            f" steps; traced step {esc(fmt_num(traced))} ms vs untraced median {esc(fmt_num(m.get('step_ms')))} ms)</p>"
        )
    facts = report.get("facts")
    if facts and "trace.error" not in facts:
        body.extend(facts_sections(facts))
    else:
        body.append('<p class="note">No trace facts in this report, so no step split and no kernel classes.</p>')
    body.append(findings_section(findings, diagnosis))
    body.append(env_section(report_env(env)))
    if cfg:
        body.append("<details><summary>full run config</summary>" + kv_table(sorted(cfg.items())) + "</details>")
    return title, subtitle, body


def _zoo_metrics(report: dict[str, Any]) -> list[str]:
    """The metrics table of a zoo run, with each number's spread over the repeats."""
    m, stats = report.get("metrics") or {}, report.get("stats") or {}
    if not m:
        return []
    body: list[str] = []

    def spread(key: str, digits: int = 0) -> str:
        s = stats.get(key)
        return f"{fmt_num(s['min'], digits)} .. {fmt_num(s['max'], digits)}" if s and s.get("n", 0) >= 2 else ""

    tp = report.get("throughput") or {}
    fps = m.get("flops_per_step")
    rows = [
        (
            "real tokens/s",
            fmt_num(throughput.headline(report), 0),
            throughput.spread_text(tp) or spread("real_tokens_per_s"),
        ),
        ("loss tokens/s", fmt_num(m.get("loss_tokens_per_s"), 0), spread("loss_tokens_per_s")),
        ("pad fraction", fmt_pct(m.get("pad_fraction")), ""),
        (
            "ms/step (median)",
            fmt_num(m.get("step_ms")),
            f"p10 {fmt_num(m.get('step_ms_p10'))} / p90 {fmt_num(m.get('step_ms_p90'))}",
        ),
        ("MFU", fmt_pct(m.get("mfu"), 2), "" if m.get("mfu") is not None else str(m.get("mfu_reason") or "")),
        ("model TFLOP/s", fmt_num(m.get("model_tflops_per_s"), 2), ""),
    ]
    if fps:
        rows.append(("FLOPs/step", f"{fps / 1e9:,.2f} GFLOP", "counted on a real step"))
    if m.get("peak_mem_gb") is not None:
        rows.append(
            (
                "peak memory allocated / reserved",
                f"{fmt_num(m.get('peak_mem_gb'), 2)} / {fmt_num(m.get('peak_mem_reserved_gb'), 2)} GiB",
                f"of {fmt_num(m.get('device_mem_total_gb'))} GiB",
            )
        )
    elif m.get("host_peak_rss_gb") is not None:
        rows.append(("host peak RSS", fmt_num(m.get("host_peak_rss_gb"), 2, " GiB"), ""))
    rows.append(
        (
            "final loss",
            fmt_num(m.get("final_loss"), 4) + ("" if m.get("loss_finite", True) else " (not finite)"),
            "",
        )
    )
    body.append("<h2>Metrics</h2>")
    body.append(
        html_table(
            (
                "metric",
                "value",
                f"spread over {m.get('repeats')} repeat(s) x {m.get('steps_per_repeat')} steps",
            ),
            [tuple(esc(str(c)) for c in r) for r in rows],
            numeric=(1, 2),
        )
    )
    return body


#: the `own` layout's words for each way in (documents.OWN_SOURCES)
SOURCE_WORDS = {"api": "your loop (vlmdoctor.Doctor)", "trainer": "your Trainer run", "script": "your script"}


def is_own(report: dict[str, Any]) -> bool:
    """A report of the user's own training, not of a vlmdoctor run of its zoo."""
    return (report.get("config") or {}).get("source") in OWN_SOURCES


def _where(report: dict[str, Any]) -> str:
    """The device a run measured: its GPU, or the CPU and its cores."""
    env = report.get("env") or {}
    return env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"


def _own_layout(report: dict[str, Any]) -> tuple[str, str, list[str]]:
    """A report of the user's own training (their model, their fixes as the lines they write): title, subtitle
    and sections."""
    cfg, model = report.get("config") or {}, report.get("model") or {}
    stage = f"stage {cfg['stage']} ({cfg.get('stage_source')})" if cfg.get("stage") else "stage unknown"
    title = f"vlmdoctor: {model.get('class') or 'your model'}, {SOURCE_WORDS.get(cfg.get('source'), 'your training')}"
    parts = ", ".join(f"{k} {v}" for k, v in (model.get("parts") or {}).items())
    subtitle = f"{stage} on {_where(report)}" + (f"; {parts}" if parts else "") + f"; {report.get('created_at', '')}"
    diagnosis = report.get("diagnosis")
    findings = report.get("findings", (diagnosis or {}).get("findings"))
    body = [top_fix(findings)]
    status = report.get("status")
    if status not in ("ok", "nan_loss"):
        body.append(
            f'<p class="warn">{esc(str(status))}: {esc(str((report.get("error") or {}).get("message", "")))}</p>'
        )
    if status == "nan_loss":
        body.append('<p class="warn">The loss was NaN or inf in a timed step.</p>')
    body += [f'<p class="note">note: {esc(str(n))}</p>' for n in report.get("notes") or []]
    if report.get("metrics"):
        body.append(own_metrics(report))
    sp = report.get("split")
    if sp:
        body.append("<h2>Where the step goes</h2>" + split_svg(sp))
    body += [f'<p class="warn">{esc(line)}</p>' for line in measurement_notes(report)]
    if sp and sp.get("note"):
        body.append(f'<p class="note">{esc(sp["note"])}</p>')
    if report.get("distributed", {}).get("ranks"):
        body.append(ranks_section(report["distributed"], report.get("cross_rank")))
    body.append(own_findings(findings, diagnosis))
    body.append(model_section(model))
    facts = report.get("facts") or {}
    tr = report.get("trace") or {}
    if tr.get("path"):
        where = tr.get("dir") if len(tr.get("rank_paths") or []) > 1 else tr.get("path")
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
    body.append(env_section(report_env(report.get("env") or {})))
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


def analyze_html(result: dict[str, Any]) -> str:
    """The JSON of `vlmdoctor analyze --json` ({path, files: [{file, facts, meta, diagnosis, findings}]}) as
    one HTML page, one section per trace file (one per rank)."""
    files = result.get("files") or []
    title = f"vlmdoctor analyze: {result.get('path', '')}"
    subtitle = f"{len(files)} trace file(s)"
    body: list[str] = []
    for entry in files:
        facts = entry.get("facts") or {}
        meta = entry.get("meta") or {}
        if len(files) > 1:
            rank = (meta.get("distributedInfo") or {}).get("rank")
            body.append(
                f'<h2 style="font-size:20px">{esc(str(entry.get("file", "")))}'
                + (f" (rank {esc(str(rank))})" if rank is not None else "")
                + "</h2>"
            )
        else:
            body.append(
                f"<p>trace: <code>{esc(str(entry.get('file', '')))}</code>"
                + ("" if facts.get("trace.written_by_vlmdoctor") else " (not written by vlmdoctor)")
                + "</p>"
            )
        diagnosis = entry.get("diagnosis")
        findings = entry.get("findings", (diagnosis or {}).get("findings"))
        body.append(top_finding(findings))
        body.append("<h2>Summary</h2>" + kv_table(facts_metrics(facts)))
        body.extend(facts_sections(facts))
        body.append(findings_section(findings if findings is not None else [], diagnosis))
        props = (meta.get("deviceProperties") or [{}])[0] if isinstance(meta.get("deviceProperties"), list) else {}
        env = entry.get("env") or result.get("env") or {}
        card = facts.get("memory.device_total_gb") or facts.get("measured.memory.device_total_gb")
        pairs = [
            ("GPU", facts.get("device.name") or props.get("name") or env.get("gpu")),
            (
                "GPU memory",
                fmt_num(card, 1, " GiB") if card else None,
            ),
            (
                "compute capability",
                f"{props['computeMajor']}.{props.get('computeMinor', 0)}"
                if props.get("computeMajor") is not None
                else env.get("compute_capability"),
            ),
            ("SMs", props.get("numSms")),
            ("driver", env.get("driver")),
            ("torch", env.get("torch")),
            ("transformers", env.get("transformers")),
        ]
        note = (
            ""
            if env.get("torch")
            else (
                "A trace records the device, not the software: driver, torch and "
                "transformers versions come with a profile report."
            )
        )
        body.append(env_section(pairs, note))
    if result.get("cross_rank"):
        body.append(cross_rank_section(result["cross_rank"]))
    return page(title, subtitle, body)


def treat_html(result: dict[str, Any]) -> str:
    """A treat result (treat.json) as one HTML page: the ladder chart, the kept steps, the trials not kept
    (with the decision's numbers) and the final config."""
    cfg = result.get("start_config") or {}
    trials = result.get("trials") or []
    title = f"vlmdoctor treat: {cfg.get('model')} stage {cfg.get('stage')}"
    subtitle = f"{len(trials)} trial(s); stopped: {result.get('stopped_because')}; {result.get('created_at', '')}" + (
        f"; {fmt_num(result.get('wall_s'), 0)} s" if result.get("wall_s") else ""
    )
    body: list[str] = []
    if result.get("interrupted"):
        body.append('<p class="warn">Interrupted: the ladder measured so far.</p>')
    ladder = result.get("ladder") or []
    body.append("<h2>Ladder</h2>")
    body.append(ladder_svg(result))
    if not ladder:
        start = result.get("start") or {}
        body.append(f"<p>start: {esc(str(start.get('status')))} {esc(str(start.get('error') or ''))}</p>")
    else:
        body.append(_ladder_table(ladder))
    if trials:
        body.append("<h2>Trials, in the order tried</h2>")
        body.append(_trials_table(trials))
    dec = result.get("decision") or {}
    if dec.get("rule"):
        body.append(
            f'<p class="note">decision: {esc(str(dec["rule"]))} (min gain {esc(fmt_pct(dec.get("min_gain"), 0))})</p>'
        )
    skipped = result.get("skipped") or []
    if skipped:
        body.append(
            "<h3>Skipped prescriptions</h3><ul>"
            + "".join(
                f"<li><code>{esc(str(s.get('rule')))}</code> (<code>{esc(patch_text(s.get('config_patch')))}</code>): "
                f"{esc(str(s.get('why')))}</li>"
                for s in skipped
            )
            + "</ul>"
        )
    final = result.get("final_config") or {}
    changed = {k: v for k, v in final.items() if cfg.get(k) != v and k != "source"}
    body.append(
        "<h2>Final config</h2><p>changed from the start: "
        + (f"<code>{esc(patch_text(changed))}</code>" if changed else "nothing")
        + "</p>"
    )
    if (result.get("outputs") or {}).get("config"):
        body.append(f"<p>run it again: <code>vlmdoctor profile --config {esc(result['outputs']['config'])}</code></p>")
    body.append(env_section(report_env(result.get("env") or {})))
    if cfg:
        body.append("<details><summary>start config</summary>" + kv_table(sorted(cfg.items())) + "</details>")
    return page(title, subtitle, body)


def _ladder_table(ladder: list[dict[str, Any]]) -> str:
    """The kept rungs: each change, its rule, its tokens/s (the repeats' range), its speedup and numbers."""
    rows = []
    for r in ladder:
        reps = r.get("tokens_per_s_repeats") or []
        spread = f" ({fmt_num(min(reps), 0)}-{fmt_num(max(reps), 0)})" if len(reps) > 1 else ""
        rows.append(
            (
                esc(str(r.get("step"))),
                esc(str(r.get("change"))),
                f"<code>{esc(str(r['rule']))}</code>" if r.get("rule") else "",
                esc(fmt_num(r.get("real_tokens_per_s"), 0) + spread),
                esc("x" + fmt_num(r.get("speedup"), 2)),
                esc(fmt_num(r.get("step_ms"))),
                esc(fmt_pct(r.get("mfu"), 2) if r.get("mfu") else "n/a"),
                esc(fmt_num(r.get("peak_mem_gb"))),
            )
        )
    return html_table(
        ("#", "change", "rule", "real tokens/s (repeats)", "x start", "ms/step", "MFU", "peak GiB"),
        rows,
        numeric=(0, 3, 4, 5, 6, 7),
    )


def _measured(t: dict[str, Any]) -> str:
    """What a trial measured, as its decision read it."""
    if "ratio" in t:
        return esc(_paired(t))
    if "gain" in t:  # a treat.json of the first treat: gain against the spread-based margin
        return f"{t['gain'] * 100:+.1f}% vs ±{(t.get('margin') or 0) * 100:.1f}%"
    if t.get("ratios"):  # the time cut the comparison short: the pairs it did measure
        return esc(", ".join(f"x{r:.2f}" for r in t["ratios"]) + f": {t.get('why') or ''}")
    # a failed arm: why it failed; an ablation's says what that means for the change it left out
    return esc(": ".join(str(x) for x in (t.get("why"), t.get("error")) if x))


def _trials_table(trials: list[dict[str, Any]]) -> str:
    """Every trial in the order tried: its prescription and patch, the expected gain, what it measured, its outcome."""
    rows = []
    for t in trials:
        outcome = str(t.get("outcome"))
        cls = "kept" if outcome == "adopted" else outcome if outcome in ("kept", "no_gain", "harmful") else "failed"
        rows.append(
            (
                esc(str(t.get("trial"))),
                f"{esc(str(t.get('layer', '')))}",
                f"<b>{esc(str(t.get('title') or ''))}</b><br><code>{esc(str(t.get('rule')))}</code>",
                patch_html(t.get("config_patch")),
                gain_cell(t.get("expected_gain")),
                esc(fmt_num(t.get("real_tokens_per_s"), 0)),
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


def _paired(t: dict[str, Any]) -> str:
    """x1.23 [1.10-1.38] (3): the paired ratio, its interval and the pairs it rests on."""
    lo, hi = t.get("ci_low"), t.get("ci_high")
    ci = f" [{lo:.2f}-{hi:.2f}]" if lo is not None and hi is not None and hi != float("inf") else ""
    return f"x{t['ratio']:.2f}{ci} ({t.get('pairs')})"


def write_html(text: str, path: Path, force: bool = False) -> None:
    """Write a page through the one writer (atomic, regular files only); an existing file only with `force`."""
    target = Path(path)
    if target.exists() and not force:
        raise UsageError(f"{target} exists; pass --force to overwrite it")
    if target.is_dir():
        raise UsageError(f"{target} is a folder; give a file name ending in .html")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text(target, text)
