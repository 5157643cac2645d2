"""The HTML page of the user's own training (Doctor, DoctorCallback, `vlmdoctor run`): their run, their terms.

A page about the user's run, not about vlmdoctor's zoo: their model's class and parts, the split of
the traced step (vision / projector / LLM / loss / optimizer / other), the biggest expected win and
every fix as the lines they write (`TrainingArguments` fields or loop code, doctor/advice.py), the
ranks of a job of several processes, and what the trace holds: on a GPU the step's busy and idle
time and the kernel classes, on a CPU the CPU facts (time per part, casts, matmuls by dtype).
The same self-contained page rules as every vlmdoctor page (report/html.py): no script, nothing
fetched, every text escaped.
"""

from __future__ import annotations

from typing import Any

from vlmdoctor.report.console import measurement_notes
from vlmdoctor.report.html import (
    ORDER_NOTE,
    _apply_cell,
    _cross_rank_section,
    _env_section,
    _facts_sections,
    _gain,
    _kv,
    _num,
    _page,
    _pct,
    _report_env,
    _table,
    by_gain,
    diagnosis_notes,
    esc,
    finding_seen,
)
from vlmdoctor.run import throughput

SOURCES = {"api": "your loop (vlmdoctor.Doctor)", "trainer": "your Trainer run", "script": "your script"}
PART_COLORS = {
    "vision": "#6a1b9a",
    "projector": "#00838f",
    "llm": "#1565c0",
    "loss": "#ef6c00",
    "optimizer": "#5d4037",
    "other": "#9e9e9e",
}


def is_own(report: dict[str, Any]) -> bool:
    """A report of the user's own training, not of a vlmdoctor run of its zoo."""
    return (report.get("config") or {}).get("source") in SOURCES


def _where(report: dict[str, Any]) -> str:
    env = report.get("env") or {}
    return env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"


def _fix_lines(f: dict[str, Any]) -> str:
    """A finding's fix as the user writes it, in a code block; the knob patch when no advice was given."""
    advice = f.get("advice") or {}
    lines = advice.get("lines") or []
    if not lines:
        patch = f.get("config_patch") or {}
        return esc(", ".join(f"{k}={v}" for k, v in patch.items())) or "n/a"
    where = "your Trainer script" if advice.get("audience") == "trainer" else "your loop"
    return f'<div class="how">in {esc(where)}:</div><pre class="fix"><code>{esc(chr(10).join(lines))}</code></pre>'


def top_fix(findings: list[dict[str, Any]] | None) -> str:
    """The first screen: the biggest expected win, its gain, and the lines to write."""
    if not findings:
        return ""
    f = by_gain(findings)[0]
    gain = _gain(f.get("expected_gain")).split('<div class="how">')[0].replace("<br>", "; ")
    more = f' <span class="note">({len(findings) - 1} more below)</span>' if len(findings) > 1 else ""
    return (
        f'<div class="top"><p>Biggest expected win: <b>{esc(str(f.get("title", "")))}</b> '
        f"<code>{esc(str(f.get('id', '')))}</code>, {gain} ({esc(str(f.get('severity', '')))}).{more}</p>"
        f"<p>Fix: {esc(str(f.get('fix', '')))}</p>{_fix_lines(f)}</div>"
    )


def split_svg(split: dict[str, Any]) -> str:
    """The traced step as one stacked bar: vision, projector, LLM, loss, optimizer, other."""
    rows = [r for r in split["rows"] if r["ms"] > 0]
    W, X0, BAR_W, BAR_Y, BAR_H = 1100, 10, 1080, 30, 40
    out = [
        f'<svg viewBox="0 0 {W} {{H}}" role="img" aria-label="split of the step">',
        f'<text x="{X0}" y="18" font-size="14" fill="#212121">one traced step: {esc(_num(split["step_ms"]))} ms '
        f"({esc(split['basis'])})</text>",
    ]
    x = float(X0)
    for r in rows:
        w = BAR_W * r["share"]
        color = PART_COLORS.get(r["part"], "#bdbdbd")
        out.append(
            f'<rect x="{x:.2f}" y="{BAR_Y}" width="{w:.2f}" height="{BAR_H}" fill="{color}">'
            f"<title>{esc(r['part'])}: {esc(_num(r['ms']))} ms ({esc(_pct(r['share']))})</title></rect>"
        )
        if w > 80:
            out.append(
                f'<text x="{x + 5:.1f}" y="{BAR_Y + 25}" font-size="13" fill="#fff">{esc(r["part"])} '
                f"{esc(_pct(r['share'], 0))}</text>"
            )
        x += w
    y0 = BAR_Y + BAR_H + 24
    for i, r in enumerate(split["rows"]):
        lx, ly = X0 + (i % 3) * 360, y0 + (i // 3) * 22
        out.append(
            f'<rect x="{lx}" y="{ly - 11}" width="12" height="12" fill="{PART_COLORS.get(r["part"], "#bdbdbd")}"/>'
        )
        out.append(
            f'<text x="{lx + 18}" y="{ly}" font-size="13" fill="#212121">{esc(r["part"])}: {esc(_num(r["ms"]))} ms '
            f"({esc(_pct(r['share']))})</text>"
        )
    out.append("</svg>")
    return "".join(out).replace("{H}", str(y0 + ((len(split["rows"]) + 2) // 3) * 22))


def _metrics(report: dict[str, Any]) -> str:
    m, tp = report.get("metrics") or {}, report.get("throughput") or {}
    fps = m.get("flops_per_step")
    rows = [
        ("real tokens/s", _num(throughput.headline(report), 0), throughput.spread_text(tp)),
        ("loss tokens/s", _num(m.get("loss_tokens_per_s"), 0), ""),
        ("pad fraction", _pct(m.get("pad_fraction")), ""),
        (
            "ms/step (median)",
            _num(m.get("step_ms")),
            f"p10 {_num(m.get('step_ms_p10'))} / p90 {_num(m.get('step_ms_p90'))}",
        ),
        ("FLOPs/step", f"{fps / 1e9:,.2f} GFLOP" if fps else "n/a", "counted on a real step" if fps else ""),
        ("MFU", _pct(m.get("mfu"), 2), "" if m.get("mfu") is not None else str(m.get("mfu_reason") or "")),
    ]
    if m.get("peak_mem_gb") is not None:
        rows.append(
            ("peak memory allocated", _num(m["peak_mem_gb"], 2, " GiB"), f"of {_num(m.get('device_mem_total_gb'))} GiB")
        )
    elif m.get("host_peak_rss_gb") is not None:
        rows.append(("host peak RSS", _num(m["host_peak_rss_gb"], 2, " GiB"), ""))
    rows.append(
        ("last loss", _num(m.get("final_loss"), 4) + ("" if m.get("loss_finite", True) else " (not finite)"), "")
    )
    n = m.get("steps_per_repeat")
    return "<h2>Your run</h2>" + _table(
        ("metric", "value", f"over {n} timed steps"),
        [tuple(esc(str(c)) for c in r) for r in rows],
        numeric=(1,),
    )


def _model_section(model: dict[str, Any]) -> str:
    params = model.get("params") or {}
    by = params.get("by_part") or {}
    rows = [
        (
            esc(part),
            f"<code>{esc(str(cls))}</code>",
            esc(_num((by.get(part) or {}).get("total"), 0)),
            esc(_num((by.get(part) or {}).get("trainable"), 0)),
        )
        for part, cls in (model.get("parts") or {}).items()
    ]
    rows.append(
        (
            "whole model",
            f"<code>{esc(str(model.get('class')))}</code>",
            esc(_num(params.get("total"), 0)),
            esc(_num(params.get("trainable"), 0)),
        )
    )
    dtypes = ", ".join(f"{k} {_num(v, 0)}" for k, v in (model.get("param_dtypes") or {}).items())
    return (
        "<h2>Your model</h2>"
        + _table(("part", "class", "parameters", "trainable"), rows, numeric=(2, 3))
        + (f'<p class="note">weights by dtype (parameters): {esc(dtypes)}</p>' if dtypes else "")
    )


def _findings(findings: list[dict[str, Any]] | None, diagnosis: dict[str, Any] | None) -> str:
    out = ["<h2>What to change</h2>"]
    if findings is None:
        out.append('<p class="note">Not diagnosed: this run has no traced window (see the notes above).</p>')
        return "".join(out)
    if not findings:
        out.append("<p>No rule fired on the measured facts: nothing to prescribe.</p>")
    else:
        out.append(ORDER_NOTE)
        rows = []
        for n, f in enumerate(by_gain(findings), 1):
            seen = finding_seen(f, severity=False)
            rows.append(
                (
                    str(n),
                    _apply_cell(f),
                    seen,
                    esc(str(f.get("fix", ""))) + _fix_lines(f),
                    _gain(f.get("expected_gain")),
                )
            )
        out.append(
            _table(("#", "apply", "what was seen", "the fix, in your code", "expected gain"), rows, cls="wide own")
        )
    out.append(diagnosis_notes(diagnosis))
    return "".join(out)


def _fact_table(
    facts: dict[str, Any], heads: tuple[str, ...], names: list[str], cells: tuple[tuple[str, Any], ...]
) -> str:
    """One row per name: the name, then each fact `key.format(name)` through its formatter."""
    rows = [tuple(esc(x) for x in (n, *(fmt(facts.get(key.format(n))) for key, fmt in cells))) for n in names]
    return _table(heads, rows, numeric=tuple(range(1, len(heads))))


def _cpu_section(facts: dict[str, Any]) -> str:
    """What a CPU trace holds: op time per part (forward, backward), casts, matmuls by dtype, the rest."""
    parts = [p for p in ("vision", "projector", "llm") if f"cpu.part.{p}.ms" in facts]
    out = ["<h2>Where the CPU time went (per traced step)</h2>"]
    if parts:
        cells = tuple((f"cpu.part.{{}}.{k}", lambda v: _num(v, 2)) for k in ("forward_ms", "backward_ms", "ms"))
        heads = ("part", "forward ms", "backward ms", "total ms", "share of the step")
        out.append(_fact_table(facts, heads, parts, (*cells, ("cpu.part.{}.share", _pct))))
    dtypes = [d for d in ("fp32", "bf16", "fp16") if facts.get(f"cpu.matmul.{d}_ms")]
    if dtypes:
        out.append("<h3>Matmuls by dtype</h3>")
        heads = ("dtype", "ms", "GFLOP", "GFLOP/s", "this CPU's probe, GFLOP/s")
        cells = (
            ("cpu.matmul.{}_ms", lambda v: _num(v, 2)),
            ("cpu.matmul.{}_gflop", lambda v: _num(v, 3)),
            ("cpu.matmul.{}_gflops", lambda v: _num(v, 1)),
            ("cpu.probe.{}_gflops", lambda v: _num(v, 1)),
        )
        out.append(_fact_table(facts, heads, dtypes, cells))
    out.append(
        _kv(
            [
                (
                    "matmuls",
                    f"{_num(facts.get('cpu.matmul.ms'), 2)} ms ({_pct(facts.get('cpu.matmul.share'))} of the step)",
                ),
                (
                    "dtype casts (autocast)",
                    f"{_num(facts.get('cpu.cast.count'), 0)} per step, {_num(facts.get('cpu.cast.ms'), 2)} ms "
                    f"({_pct(facts.get('cpu.cast.share'))})",
                ),
                ("LM head", _num(facts["cpu.lm_head.ms"], 2, " ms") if "cpu.lm_head.ms" in facts else None),
                ("loss", _num(facts.get("cpu.loss.ms"), 2, " ms")),
                ("optimizer step", _num(facts.get("cpu.optimizer.ms"), 2, " ms")),
                (
                    "data loader",
                    f"{_num(facts.get('cpu.data_loader.ms'), 2)} ms ({_pct(facts.get('cpu.data_loader.share'))})",
                ),
                ("CPU", facts.get("cpu.capability")),
            ]
        )
    )
    out.append(
        '<p class="note">A CPU trace has no GPU kernels: the rules that read kernel facts are listed as not '
        "evaluated below, and the times are CPU op times.</p>"
    )
    return "\n".join(out)


def _ranks_section(d: dict[str, Any], cross: dict[str, Any] | None) -> str:
    g = d.get("global") or {}
    rows = [
        tuple(
            esc(str(x))
            for x in (
                f"{r.get('rank')}{' (slowest)' if r.get('rank') == g.get('slowest_rank') else ''}",
                _num(r.get("step_ms")),
                _num(r.get("real_tokens_per_s"), 0),
                _num(r.get("real_tokens"), 0),
                _pct(r.get("pad_fraction")),
                _num(r.get("peak_mem_gb"), 2),
                _num(r.get("final_loss"), 4),
                r.get("host"),
            )
        )
        for r in d.get("ranks") or []
    ]
    head = (
        f"<h2>Ranks: {esc(str(d.get('world_size')))} processes ({esc(str(d.get('parallel')))}, "
        f'{esc(str(d.get("backend")))})</h2><p class="note">The numbers above are the job\'s: per timed step, '
        "all ranks' tokens over the slowest rank's time.</p>"
    )
    missing = d.get("missing_ranks") or []
    warn = f'<p class="warn">rank(s) {esc(", ".join(map(str, missing)))} sent no measurement</p>' if missing else ""
    table = _table(
        ("rank", "ms/step", "real tokens/s", "real tokens", "pad", "peak GiB", "last loss", "host"),
        rows,
        numeric=range(1, 7),
    )
    return head + warn + table + (_cross_rank_section(cross) if cross else "")


def own_html(report: dict[str, Any]) -> str:
    """A report of the user's own training as one HTML page."""
    cfg, model = report.get("config") or {}, report.get("model") or {}
    stage = f"stage {cfg['stage']} ({cfg.get('stage_source')})" if cfg.get("stage") else "stage unknown"
    title = f"vlmdoctor: {model.get('class') or 'your model'}, {SOURCES.get(cfg.get('source'), 'your training')}"
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
        body.append(_metrics(report))
    sp = report.get("split")
    if sp:
        body.append("<h2>Where the step goes</h2>" + split_svg(sp))
    body += [f'<p class="warn">{esc(line)}</p>' for line in measurement_notes(report)]
    if sp and sp.get("note"):
        body.append(f'<p class="note">{esc(sp["note"])}</p>')
    if report.get("distributed", {}).get("ranks"):
        body.append(_ranks_section(report["distributed"], report.get("cross_rank")))
    body.append(_findings(findings, diagnosis))
    body.append(_model_section(model))
    facts = report.get("facts") or {}
    tr = report.get("trace") or {}
    if tr.get("path"):
        where = tr.get("dir") if len(tr.get("rank_paths") or []) > 1 else tr.get("path")
        body.append(
            f'<p class="note">trace: <code>{esc(str(where))}</code>; open it at https://ui.perfetto.dev '
            "(Open trace file): your browser reads it, nothing is uploaded.</p>"
        )
    if facts.get("trace.cpu_only"):
        body.append(_cpu_section(facts))
    elif facts and "trace.error" not in facts:
        body.extend(_facts_sections(facts))
    elif "trace.error" in facts:
        body.append(f'<p class="warn">the trace could not be analyzed: {esc(str(facts["trace.error"]))}</p>')
    body.append(_env_section(_report_env(report.get("env") or {})))
    known = {k: v for k, v in cfg.items() if k != "trainer_args"}
    body.append(
        "<details><summary>what vlmdoctor knows of your run</summary>" + _kv(sorted(known.items())) + "</details>"
    )
    if cfg.get("trainer_args"):
        body.append(
            "<details><summary>your TrainingArguments (the fields read)</summary>"
            + _kv(sorted(cfg["trainer_args"].items()))
            + "</details>"
        )
    return _page(title, subtitle, body)
