"""The sections the HTML pages share: the prescriptions (biggest expected win first, in the order to apply them),
the diagnosis' notes, the trace's facts with their charts, the environment; and the `own` layout's sections for the
user's own training (their run, their model, their fixes as lines they write, their ranks, a CPU trace's facts).

They read the declared documents (vlmdoctor/documents/) by field; the trace's `facts` (a fact name -> its value)
and the free-form maps of a document (a config, a split, a finding's advice) stay mappings."""

from __future__ import annotations

from typing import Any

import msgspec

from vlmdoctor.doctor.gain import gain_ratio
from vlmdoctor.documents import (
    CrossRank,
    Diagnosis,
    Distributed,
    Env,
    ExpectedGain,
    Finding,
    GlobalNumbers,
    Metrics,
    ModelInfo,
    Params,
    RunReport,
    Throughput,
)
from vlmdoctor.report.html_page import esc, fmt_num, fmt_pct, html_table, kv_table, patch_html, text
from vlmdoctor.report.svg import kernel_classes_svg, step_split_svg
from vlmdoctor.run import throughput


def gain_cell(g: ExpectedGain | None) -> str:
    if g is None:
        return "n/a"
    parts = []
    if g.throughput_x:
        parts.append(f"<b>x{esc(fmt_num(g.throughput_x, 2))}</b> throughput")
    if g.saves_ms_per_step:
        s = f"saves {esc(fmt_num(g.saves_ms_per_step))} ms/step"
        if g.share_of_step:
            of = f"the {fmt_num(g.step_ms)} ms traced step" if g.step_ms else "the traced step"
            s += f" ({esc(fmt_pct(g.share_of_step, 0))} of {esc(of)})"
        parts.append(s)
    out = "<br>".join(parts) or "not estimated"
    if g.how:
        out += f'<div class="how">{esc(g.how)}</div>'
    return out


def by_gain(findings: list[Any]) -> list[Any]:
    """Biggest expected win first (`rank`); a report older than ranks is ordered by its gains the same way.

    Findings as declared (`Finding`), or a report's findings as dicts (report/summary.py hands those): each comes
    back as it was given."""

    def key(i_f: tuple[int, Any]) -> tuple:
        i, f = i_f
        if isinstance(f, Finding):
            rank, gain = f.rank, msgspec.structs.asdict(f.expected_gain) if f.expected_gain is not None else None
        else:
            rank, gain = f.get("rank"), f.get("expected_gain")
        if isinstance(rank, int):
            return (0, rank, i)
        ratio = gain_ratio(gain)
        return (1, ratio is None, -(ratio or 0.0), i)

    return [f for _, f in sorted(enumerate(findings), key=key)]


def apply_cell(f: Finding) -> str:
    where = f"layer {esc(text(f.layer))} {esc(text(f.layer_name))}"
    return (f"<b>{esc(str(f.apply_order))}</b> ({where})" if f.apply_order is not None else where) if f.layer else ""


def top_finding(findings: list[Finding] | None) -> str:
    """The first screen's line: the biggest expected win, its gain and its fix."""
    if not findings:
        return ""
    f = by_gain(findings)[0]
    gain = gain_cell(f.expected_gain).split('<div class="how">')[0].replace("<br>", "; ")
    patch = f.config_patch or {}
    return (
        '<p class="top">Biggest expected win: '
        f"<b>{esc(text(f.title))}</b> <code>{esc(f.id)}</code>, {gain}"
        f" ({esc(text(f.severity))}).<br>Fix: {esc(text(f.fix))}"
        + (" " + patch_html(patch) if patch else "")
        + (f' <span class="note">({len(findings) - 1} more below)</span>' if len(findings) > 1 else "")
        + "</p>"
    )


#: how to read a findings table (the console's and both pages' order)
ORDER_NOTE = (
    '<p class="note">Biggest expected win first; apply the fixes in the order of the "apply" column '
    "(the layer: precision, batching, data layout, kernel fusion, system tuning).</p>"
)


def finding_seen(f: Finding, severity: bool = True) -> str:
    """A finding's title, id (and severity) over its evidence: the 'what was seen' cell of both pages."""
    return (
        f"<b>{esc(text(f.title))}</b> <code>{esc(f.id)}</code>"
        + (f' <span class="note">({esc(f.severity)})</span>' if severity and f.severity else "")
        + '<ul class="ev">'
        + "".join(f"<li>{esc(str(e))}</li>" for e in f.evidence or [])
        + "</ul>"
    )


def findings_section(
    findings: list[Finding] | None,
    diagnosis: Diagnosis | None = None,
    heading: str = "Prescriptions",
) -> str:
    """The prescriptions, biggest expected win first: what was seen (the evidence), the change, the config
    patch, the expected gain with how it was estimated, and the order in which to apply them (the layer)."""
    out = [f"<h2>{esc(heading)}</h2>"]
    if findings is None:
        out.append(
            '<p class="note">Not diagnosed: this report has no trace facts (profile without --no-diagnose, '
            "or vlmdoctor analyze on its trace, adds them).</p>"
        )
        return "".join(out)
    if not findings:
        out.append("<p>No rule fired: nothing to prescribe.</p>")
    else:
        out.append(ORDER_NOTE)
        rows = []
        for n, f in enumerate(by_gain(findings), 1):
            seen = finding_seen(f)
            change = esc(text(f.fix))
            patch = patch_html(f.config_patch)
            rows.append((str(n), apply_cell(f), seen, change, patch, gain_cell(f.expected_gain)))
        out.append(
            html_table(
                ("#", "apply", "what was seen", "change", "config patch", "expected gain"),
                rows,
                cls="wide findings",
            )
        )
    out.append(diagnosis_notes(diagnosis))
    return "".join(out)


def diagnosis_notes(diagnosis: Diagnosis | None) -> str:
    """What the rules did besides prescribing: muted findings, superseded ones, rules not evaluated."""
    if diagnosis is None:
        return ""
    out: list[str] = []
    if diagnosis.muted:
        out.append(
            '<p class="note">muted: '
            + ", ".join(
                f"<code>{esc(m.id)}</code> ({gain_cell(m.expected_gain).split('<div')[0]}; "
                f"{esc(str(m.severity))}; by {esc(str(m.muted_by))})"
                for m in diagnosis.muted
            )
            + "</p>"
        )
    notes = [
        f"superseded: <code>{esc(s.id)}</code> (covered by <code>{esc(str(s.superseded_by))}</code>)"
        for s in diagnosis.superseded
    ]
    notes += [
        f"not evaluated: <code>{esc(s.id)}</code> (needs {esc(', '.join(s.missing or []))}"
        + (f"; record with {esc(s.hint)}" if s.hint else "")
        + ")"
        for s in diagnosis.not_evaluated
    ]
    notes += [f"rule problem: {esc(str(p))}" for p in diagnosis.problems]
    if notes:
        out.append(
            '<details><summary>rules that did not prescribe</summary><ul class="note">'
            + "".join(f"<li>{n}</li>" for n in notes)
            + "</ul></details>"
        )
    return "".join(out)


def env_section(pairs: list[tuple[str, Any]], note: str = "") -> str:
    body = kv_table(pairs)
    return "<h2>Environment</h2>" + body + (f'<p class="note">{esc(note)}</p>' if note else "")


def report_env(env: Env | None) -> list[tuple[str, Any]]:
    env = env or Env()
    gpu = env.gpu
    if gpu and env.gpu_count and env.gpu_count > 1:
        gpu = f"{gpu} x{env.gpu_count}"
    return [
        ("GPU", gpu or f"none (CPU, {env.cpu_count} cores)"),
        ("GPU memory", fmt_num(env.gpu_mem_total_gb, 1, " GiB") if env.gpu_mem_total_gb else None),
        ("compute capability", env.compute_capability),
        ("driver", env.driver),
        ("CUDA", env.cuda),
        ("cuDNN", env.cudnn),
        ("torch", env.torch),
        ("transformers", env.transformers),
        ("liger-kernel", env.liger_kernel),
        ("triton", env.triton),
        ("python", env.python),
        ("platform", env.platform),
        ("CPU cores", env.cpu_count),
    ]


def facts_sections(facts: dict[str, Any]) -> list[str]:
    """Charts and tables of one trace's facts (a fact the trace could not give is left out)."""
    out = ["<h2>Step time: GPU busy and idle by cause</h2>", step_split_svg(facts)]
    for w in facts.get("trace.warnings") or []:
        out.append(f'<p class="warn">partial analysis: {esc(str(w))}</p>')
    ops = facts.get("idle.top_host_ops") or []
    if ops:
        out.append("<h3>Host work while the GPU waited (per step)</h3>")
        out.append(
            html_table(
                ("innermost host op / runtime call", "ms", "share of idle"),
                [
                    (
                        f"<code>{esc(str(r['op'])[:90])}</code>",
                        esc(fmt_num(r["ms"])),
                        esc(fmt_pct(r["share"], 0)),
                    )
                    for r in ops[:8]
                ],
                numeric=(1, 2),
            )
        )
    out.append("<h2>GPU time by kernel class</h2>")
    out.append(kernel_classes_svg(facts))
    parts = sorted(
        {k.split(".")[1] for k in facts if k.startswith("part.") and k.endswith(".ms") and k.count(".") == 2},
        key=lambda p: -float(facts[f"part.{p}.ms"] or 0),
    )
    phases = [k.split(".")[1] for k in facts if k.startswith("phase.") and k.endswith(".ms")]
    rows = []
    if parts:
        rows.append(("GPU time by model part", ", ".join(f"{p} {fmt_num(facts[f'part.{p}.ms'])} ms" for p in parts)))
    if phases:
        rows.append(("by phase", ", ".join(f"{p} {fmt_num(facts[f'phase.{p}.ms'])} ms" for p in phases)))
    if "recompute.kind" in facts:
        rows.append(
            (
                "checkpoint recompute",
                f"{facts['recompute.kind']} ({fmt_pct(facts.get('recompute.share'))} of GPU time)",
            )
        )
    if "launch.kernels" in facts:
        rows.append(
            (
                "launches",
                f"{fmt_num(facts['launch.kernels'], 0)} kernels/step, "
                f"{fmt_pct(facts.get('launch.tiny_kernel_frac'), 0)} under 10 µs, launch API "
                f"{fmt_num(facts.get('launch.api_ms'))} ms/step, launch-to-start median "
                f"{fmt_num(facts.get('launch.delay_us_median'))} µs",
            )
        )
    if "gemm.fp32_share" in facts:
        rows.append(
            (
                "GEMMs",
                f"{fmt_num(facts.get('gemm.ms'))} ms; FP32 without tensor cores "
                f"{fmt_pct(facts['gemm.fp32_share'])} of GEMM time",
            )
        )
    if facts.get("attention.backends") or any(k.startswith("attention.backend.") for k in facts):
        names = facts.get("attention.backends") or [
            k.split(".")[2] for k in facts if k.startswith("attention.backend.")
        ]
        rows.append(("SDPA backend", ", ".join(map(str, names))))
    if "shapes.distinct_token_batches" in facts:
        rows.append(
            (
                "token batch shapes",
                f"{facts['shapes.distinct_token_batches']} distinct: "
                + ", ".join(map(str, (facts.get("shapes.token_batches") or [])[:8])),
            )
        )
    if facts.get("loss.logits_gb") is not None:
        rows.append(("logits", f"{fmt_num(facts['loss.logits_gb'], 2)} GB ({facts.get('loss.logits_dtype')})"))
    if facts.get("host.sync_calls"):
        rows.append(("host syncs", f"{fmt_num(facts['host.sync_calls'], 0)} per step"))
    if rows:
        out.append("<h3>Where the GPU time went</h3>" + kv_table(rows))
    return out


def facts_metrics(facts: dict[str, Any]) -> list[tuple[str, Any]]:
    busy = facts.get("measured.gpu.busy_frac", facts.get("gpu.busy_frac"))  # the untraced run's, where measured
    reserved = facts.get("measured.memory.peak_reserved_gb", facts.get("memory.peak_reserved_gb"))
    return [
        ("steps traced", facts.get("trace.steps")),
        ("step (median)", fmt_num(facts["step.ms"], 1, " ms") if "step.ms" in facts else None),
        ("GPU busy", f"{fmt_pct(busy, 0)} ({fmt_num(facts.get('gpu.busy_ms'))} ms)" if busy is not None else None),
        ("GPU idle", fmt_num(facts["gpu.idle_ms"], 1, " ms") if "gpu.idle_ms" in facts else None),
        ("model", facts.get("run.model")),
        ("stage", facts.get("run.stage")),
        (
            "MFU (upper bound from the trace)",
            fmt_pct(facts["mfu.upper_bound"], 2) if "mfu.upper_bound" in facts else None,
        ),
        ("MFU (measured)", fmt_pct(facts["mfu"], 2) if isinstance(facts.get("mfu"), (int, float)) else None),
        (
            "peak memory reserved",
            fmt_num(reserved, 2, " GiB") if reserved is not None else None,
        ),
    ]


def measurement_notes_html(report: RunReport, notes: list[str]) -> list[str]:
    """An unstable or unsettled window said plainly (`notes`: console.measurement_notes of the report), and the
    split of the traced step with its shares."""
    out = [f'<p class="warn">{esc(line)}</p>' for line in notes]
    sp = report.split
    if sp:
        timed = report.metrics.step_ms if report.metrics is not None else None
        out.append(
            f'<h2>Time split of the traced step</h2><p class="note">one traced step of {esc(fmt_num(sp["step_ms"]))} ms'
            f" ({esc(sp['basis'])}); shares of that step, from the traced window"
            + (f", not of the timed median step ({esc(fmt_num(timed))} ms)" if timed else "")
            + "</p>"
        )
        out.append(
            html_table(
                ("part", "ms per traced step", "share"),
                [(esc(r["part"]), esc(fmt_num(r["ms"])), esc(fmt_pct(r["share"], 0))) for r in sp["rows"]],
                numeric=(1, 2),
            )
        )
        if sp["note"]:
            out.append(f'<p class="note">{esc(sp["note"])}</p>')
    return out


def fix_lines(f: Finding) -> str:
    """A finding's fix as the user writes it, in a code block; the knob patch when no advice was given."""
    lines = f.advice["lines"] if f.advice else []
    if not lines:
        patch = f.config_patch or {}
        return esc(", ".join(f"{k}={v}" for k, v in patch.items())) or "n/a"
    where = "your Trainer script" if f.advice["audience"] == "trainer" else "your loop"
    return f'<div class="how">in {esc(where)}:</div><pre class="fix"><code>{esc(chr(10).join(lines))}</code></pre>'


def top_fix(findings: list[Finding] | None) -> str:
    """The first screen: the biggest expected win, its gain, and the lines to write."""
    if not findings:
        return ""
    f = by_gain(findings)[0]
    gain = gain_cell(f.expected_gain).split('<div class="how">')[0].replace("<br>", "; ")
    more = f' <span class="note">({len(findings) - 1} more below)</span>' if len(findings) > 1 else ""
    return (
        f'<div class="top"><p>Biggest expected win: <b>{esc(text(f.title))}</b> '
        f"<code>{esc(f.id)}</code>, {gain} ({esc(text(f.severity))}).{more}</p>"
        f"<p>Fix: {esc(text(f.fix))}</p>{fix_lines(f)}</div>"
    )


def own_metrics(report: RunReport, headline: float | None) -> str:
    """The `own` layout's numbers of the timed window; `headline`: its real tokens/s by the one estimator."""
    m, tp = report.metrics or Metrics(), report.throughput
    fps = m.flops_per_step
    rows = [
        ("real tokens/s", fmt_num(headline, 0), tokens_spread(tp)),
        ("loss tokens/s", fmt_num(m.loss_tokens_per_s, 0), ""),
        ("pad fraction", fmt_pct(m.pad_fraction), ""),
        (
            "ms/step (median)",
            fmt_num(m.step_ms),
            f"p10 {fmt_num(m.step_ms_p10)} / p90 {fmt_num(m.step_ms_p90)}",
        ),
        ("FLOPs/step", f"{fps / 1e9:,.2f} GFLOP" if fps else "n/a", "counted on a real step" if fps else ""),
        ("MFU", fmt_pct(m.mfu, 2), "" if m.mfu is not None else text(m.mfu_reason)),
    ]
    if m.peak_mem_gb is not None:
        rows.append(
            (
                "peak memory allocated",
                fmt_num(m.peak_mem_gb, 2, " GiB"),
                f"of {fmt_num(m.device_mem_total_gb)} GiB",
            )
        )
    elif m.host_peak_rss_gb is not None:
        rows.append(("host peak RSS", fmt_num(m.host_peak_rss_gb, 2, " GiB"), ""))
    rows.append(("last loss", fmt_num(m.final_loss, 4) + ("" if m.loss_finite is not False else " (not finite)"), ""))
    return "<h2>Your run</h2>" + html_table(
        ("metric", "value", f"over {m.steps_per_repeat} timed steps"),
        [tuple(esc(str(c)) for c in r) for r in rows],
        numeric=(1,),
    )


def tokens_spread(tp: Throughput | None) -> str:
    """The tokens/s row's spread, p10-p90 over the timed steps (run/throughput.py `spread_text`, which takes the
    throughput's fields as a mapping); '' without one."""
    return throughput.spread_text(msgspec.structs.asdict(tp)) if tp is not None else ""


def model_section(model: ModelInfo) -> str:
    params = model.params or Params()
    by = params.by_part or {}
    rows = [
        (
            esc(part),
            f"<code>{esc(str(cls))}</code>",
            esc(fmt_num(by[part]["total"], 0) if part in by else "n/a"),
            esc(fmt_num(by[part]["trainable"], 0) if part in by else "n/a"),
        )
        for part, cls in (model.parts or {}).items()
    ]
    rows.append(
        (
            "whole model",
            f"<code>{esc(str(model.class_name))}</code>",
            esc(fmt_num(params.total, 0)),
            esc(fmt_num(params.trainable, 0)),
        )
    )
    dtypes = ", ".join(f"{k} {fmt_num(v, 0)}" for k, v in (model.param_dtypes or {}).items())
    return (
        "<h2>Your model</h2>"
        + html_table(("part", "class", "parameters", "trainable"), rows, numeric=(2, 3))
        + (f'<p class="note">weights by dtype (parameters): {esc(dtypes)}</p>' if dtypes else "")
    )


def own_findings(findings: list[Finding] | None, diagnosis: Diagnosis | None) -> str:
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
                    apply_cell(f),
                    seen,
                    esc(text(f.fix)) + fix_lines(f),
                    gain_cell(f.expected_gain),
                )
            )
        out.append(
            html_table(("#", "apply", "what was seen", "the fix, in your code", "expected gain"), rows, cls="wide own")
        )
    out.append(diagnosis_notes(diagnosis))
    return "".join(out)


def fact_table(
    facts: dict[str, Any], heads: tuple[str, ...], names: list[str], cells: tuple[tuple[str, Any], ...]
) -> str:
    """One row per name: the name, then each fact `key.format(name)` through its formatter (n/a where missing)."""
    rows = [tuple(esc(x) for x in (n, *(fmt(facts.get(key.format(n))) for key, fmt in cells))) for n in names]
    return html_table(heads, rows, numeric=tuple(range(1, len(heads))))


def cpu_section(facts: dict[str, Any]) -> str:
    """What a CPU trace holds: op time per part (forward, backward), casts, matmuls by dtype, the rest (the facts
    trace/cpu_facts.py writes for every CPU trace are read by name; a part's, a dtype's and the LM head's may be
    missing)."""
    parts = [p for p in ("vision", "projector", "llm") if f"cpu.part.{p}.ms" in facts]
    out = ["<h2>Where the CPU time went (per traced step)</h2>"]
    if parts:
        cells = tuple((f"cpu.part.{{}}.{k}", lambda v: fmt_num(v, 2)) for k in ("forward_ms", "backward_ms", "ms"))
        heads = ("part", "forward ms", "backward ms", "total ms", "share of the step")
        out.append(fact_table(facts, heads, parts, (*cells, ("cpu.part.{}.share", fmt_pct))))
    dtypes = [d for d in ("fp32", "bf16", "fp16") if facts.get(f"cpu.matmul.{d}_ms")]
    if dtypes:
        out.append("<h3>Matmuls by dtype</h3>")
        heads = ("dtype", "ms", "GFLOP", "GFLOP/s", "this CPU's probe, GFLOP/s")
        cells = (
            ("cpu.matmul.{}_ms", lambda v: fmt_num(v, 2)),
            ("cpu.matmul.{}_gflop", lambda v: fmt_num(v, 3)),
            ("cpu.matmul.{}_gflops", lambda v: fmt_num(v, 1)),
            ("cpu.probe.{}_gflops", lambda v: fmt_num(v, 1)),
        )
        out.append(fact_table(facts, heads, dtypes, cells))
    out.append(
        kv_table(
            [
                (
                    "matmuls",
                    f"{fmt_num(facts['cpu.matmul.ms'], 2)} ms ({fmt_pct(facts['cpu.matmul.share'])} of the step)",
                ),
                (
                    "dtype casts (autocast)",
                    f"{fmt_num(facts['cpu.cast.count'], 0)} per step, {fmt_num(facts['cpu.cast.ms'], 2)} ms "
                    f"({fmt_pct(facts['cpu.cast.share'])})",
                ),
                ("LM head", fmt_num(facts["cpu.lm_head.ms"], 2, " ms") if "cpu.lm_head.ms" in facts else None),
                ("loss", fmt_num(facts["cpu.loss.ms"], 2, " ms")),
                ("optimizer step", fmt_num(facts["cpu.optimizer.ms"], 2, " ms")),
                (
                    "data loader",
                    f"{fmt_num(facts['cpu.data_loader.ms'], 2)} ms ({fmt_pct(facts['cpu.data_loader.share'])})",
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


def ranks_section(d: Distributed, cross: CrossRank | None) -> str:
    g = d.global_ or GlobalNumbers()
    rows = [
        tuple(
            esc(str(x))
            for x in (
                f"{r.rank}{' (slowest)' if r.rank == g.slowest_rank else ''}",
                fmt_num(r.step_ms),
                fmt_num(r.real_tokens_per_s, 0),
                fmt_num(r.real_tokens, 0),
                fmt_pct(r.pad_fraction),
                fmt_num(r.peak_mem_gb, 2),
                fmt_num(r.final_loss, 4),
                r.host,
            )
        )
        for r in d.ranks or []
    ]
    head = (
        f"<h2>Ranks: {esc(str(d.world_size))} processes ({esc(str(d.parallel))}, "
        f'{esc(str(d.backend))})</h2><p class="note">The numbers above are the job\'s: per timed step, '
        "all ranks' tokens over the slowest rank's time.</p>"
    )
    missing = d.missing_ranks or []
    warn = f'<p class="warn">rank(s) {esc(", ".join(map(str, missing)))} sent no measurement</p>' if missing else ""
    table = html_table(
        ("rank", "ms/step", "real tokens/s", "real tokens", "pad", "peak GiB", "last loss", "host"),
        rows,
        numeric=range(1, 7),
    )
    return head + warn + table + (cross_rank_section(cross) if cross is not None else "")


#: a cross-rank row's numbers (trace/ranks.py writes each for every rank), as the table shows them
RANK_ROW_KEYS = ("step_ms", "wait_ms", "busy_ms", "tokens", "loader_ms", "gap_ms", "comm_ms", "exposed_ms", "hidden_ms")


def cross_rank_section(cross: CrossRank) -> str:
    """The ranks of a folder side by side: wait for late ranks, busy time, tokens, communication; and its findings."""
    if cross.skipped is not None:
        return f"<h2>Cross-rank</h2><p>{esc(cross.skipped)}</p>"
    f = cross.facts or {}
    parts = [
        f"<h2>Cross-rank: {esc(str(f['dist.ranks']))} ranks of {esc(str(f['dist.world_size']))}, "
        f"{esc(str(f['dist.parallel']))} over {esc(str(f['dist.backend']))}</h2>"
    ]
    parts += [f'<p class="warn">{esc(n)}</p>' for n in cross.notes or []]
    parts.append(
        html_table(
            (
                "rank",
                "step ms",
                "waited ms",
                "busy ms",
                "tokens",
                "loader ms",
                "gaps ms",
                "comm ms",
                "exposed ms",
                "hidden ms",
            ),
            [
                [esc(str(r["rank"]))] + [fmt_num(r[k], 0 if k == "tokens" else 1) for k in RANK_ROW_KEYS]
                for r in cross.ranks or []
            ],
            numeric=range(10),
        )
    )
    hta = cross.hta or {}  # traceinsight's numbers where it ran, else why not (free-form)
    ours = hta.get("ours_overlap_pct") or {}
    overlap = "; ".join(
        f"rank {r}: {fmt_num(v, 1, '%')} vs {fmt_num(ours.get(r), 1, '%')}"
        for r, v in sorted((hta.get("overlap_pct") or {}).items())
    ) or hta.get("skipped")
    parts.append(
        kv_table(
            [
                ("slowest rank", f.get("dist.straggler.rank")),
                ("cause", f.get("dist.straggler.cause")),
                (
                    "busy-time skew",
                    fmt_pct(f["dist.step_skew_frac"]) if "dist.step_skew_frac" in f else None,
                ),
                (
                    "wait for late ranks, ms/step",
                    fmt_num(f["dist.late_wait_ms"]) if "dist.late_wait_ms" in f else None,
                ),
                (
                    "exposed communication less the wait, ms/step",
                    fmt_num(f["dist.comm.exposed_own_ms"]) if "dist.comm.exposed_own_ms" in f else None,
                ),
                ("overlap, traceinsight vs vlmdoctor", overlap),
            ]
        )
    )
    if cross.diagnosis is not None:
        parts.append(findings_section(cross.findings or [], cross.diagnosis))
    return "\n".join(parts)
