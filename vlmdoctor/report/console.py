"""The console report: rich tables of metrics, facts, findings, ladders and sweeps."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vlmdoctor.run.config import RunConfig, knob_table
from vlmdoctor.errors import UsageError


def _fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{unit}"
    return f"{v}{unit}"


def _changed_knobs(config: dict[str, Any]) -> list[str]:
    defaults = RunConfig().to_dict()
    layer = {row["name"]: row["layer"] for row in knob_table()}
    # the measurement window (steps, warmup, repeats) is shown in the table; model and stage in the title
    shown = {"model", "stage", "device", "steps", "warmup", "repeats"}
    return [f"{k}={v}" for k, v in config.items() if v != defaults.get(k) and k in layer and k not in shown]


def render(report: dict[str, Any], console: Console) -> None:
    cfg, env, model = report["config"], report.get("env", {}), report.get("model", {})
    where = env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"
    title = f"vlmdoctor profile: {cfg['model']} stage {cfg['stage']} on {where}"
    changed = _changed_knobs(cfg)
    console.print(f"[bold]{title}[/bold]")
    console.print(f"model: {model.get('vision')} + {model.get('projector')} + {model.get('llm')}; "
                  f"{model.get('image_tokens')} image tokens")
    console.print("knobs changed from the default: " + (", ".join(changed) if changed else "none (the default config)"))
    data = report.get("data") or {}
    if data.get("skipped"):
        console.print(f"[yellow]data: {data['skipped']} of {data.get('records')} records skipped[/yellow] "
                      f"(--bad-records skip; the first: {escape(str((data.get('problems') or ['?'])[0]))})",
                      highlight=False)
    for w in report.get("warnings") or []:
        console.print(f"[yellow]warning:[/yellow] {escape(str(w))}", highlight=False)
    if report["status"] not in ("ok", "nan_loss"):
        err = report.get("error", {})
        console.print(f"[bold red]{report['status']}[/bold red]: {err.get('message')}")
        if err.get("requested_gb") is not None:
            console.print(f"asked for {err['requested_gb']:.2f} GiB more; peak before failure "
                          f"{_fmt(err.get('peak_mem_gb_before_failure'), ' GiB', 2)} of "
                          f"{_fmt(err.get('device_mem_total_gb'), ' GiB', 1)}")
        return
    m, stats = report["metrics"], report.get("stats", {})
    t = Table(show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column(f"spread over {m['repeats']} repeat(s) x {m['steps_per_repeat']} steps", justify="right")

    def spread(key: str, unit: str = "", digits: int = 1) -> str:
        s = stats.get(key)
        if not s or s["n"] < 2:
            return ""
        return f"{_fmt(s['min'], unit, digits)} .. {_fmt(s['max'], unit, digits)}"

    t.add_row("real tokens/s", _fmt(m["real_tokens_per_s"], "", 0), spread("real_tokens_per_s", "", 0))
    t.add_row("loss tokens/s", _fmt(m["loss_tokens_per_s"], "", 0), spread("loss_tokens_per_s", "", 0))
    t.add_row("pad fraction", _fmt(m["pad_fraction"] * 100, " %"), "")
    step = stats.get("step_ms", {})
    t.add_row("ms/step (median)", _fmt(m["step_ms"], " ms"),
              f"p10 {_fmt(m['step_ms_p10'])} / p90 {_fmt(m['step_ms_p90'])} (n={step.get('n')})")
    t.add_row("MFU", _fmt(m["mfu"] * 100 if m["mfu"] is not None else None, " %"), spread("mfu", "", 3))
    t.add_row("model TFLOP/s", _fmt(m["model_tflops_per_s"], "", 2), "")
    if m.get("peak_mem_gb") is not None:
        t.add_row("peak memory allocated / reserved",
                  f"{_fmt(m['peak_mem_gb'], ' GiB', 2)} / {_fmt(m['peak_mem_reserved_gb'], ' GiB', 2)}",
                  f"of {_fmt(m['device_mem_total_gb'], ' GiB')}")
    else:
        t.add_row("host peak RSS", _fmt(m["host_peak_rss_gb"], " GiB", 2), "")
    loss = m["final_loss"]
    t.add_row("final loss", _fmt(loss, "", 4) if m["loss_finite"] else f"[red]{loss} (not finite)[/red]", "")
    console.print(t)
    versions = ", ".join(f"{k} {env.get(k)}" for k in ("torch", "transformers", "liger_kernel") if env.get(k))
    console.print(f"[dim]{versions}; driver {env.get('driver') or 'n/a'}[/dim]")
    tr = report.get("trace")
    if tr:
        traced = sorted(tr["traced_step_ms"])[len(tr["traced_step_ms"]) // 2]
        where = tr["path"] or "analyzed, not kept (--trace-dir DIR keeps it)"
        console.print(f"trace: {where} ({tr['steps']} steps; traced step {traced:.1f} ms vs untraced median "
                      f"{m['step_ms']:.1f} ms)")
    if report["status"] == "nan_loss":
        console.print("[bold red]the loss was NaN or inf in a timed step[/bold red]")


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    t = Table(show_header=True, header_style="bold")
    for col in ("kind", "name", "params", "layers", "hidden", "heads", "head dim", "notes"):
        t.add_column(col, justify="right" if col in ("params", "layers", "hidden", "heads", "head dim") else "left")
    for r in rows:
        t.add_row(r["kind"], r["name"], f"{r['params'] / 1e6:,.1f}M", str(r.get("layers", "")), str(r.get("hidden", "")),
                  str(r.get("heads", "")), str(r.get("head_dim", "")), r.get("notes", ""))
    console.print(t)



def _ms(v: Any) -> str:
    return f"{v:,.1f}" if isinstance(v, (int, float)) else "n/a"


def render_facts(result: dict[str, Any], console: Console) -> None:
    """Summary of `vlmdoctor analyze`: what the GPU did per step and why it waited."""
    for entry in result["files"]:
        f = entry["facts"]
        known = ", ".join(f"{k.split('.')[1]} {f[k]}" for k in ("run.model", "run.stage") if k in f) or "model and stage unknown"
        console.print(f"[bold]{entry['file']}[/bold]: {f['trace.steps']} step(s), {known}"
                      + ("" if f["trace.written_by_vlmdoctor"] else " (not written by vlmdoctor)"))
        for w in f.get("trace.warnings", []):
            console.print(f"[yellow]partial:[/yellow] {w}")
        line = f"step {_ms(f['step.ms'])} ms"
        if "gpu.busy_frac" in f:
            line += f"; GPU busy {f['gpu.busy_frac'] * 100:.0f}% ({_ms(f['gpu.busy_ms'])} ms), idle {_ms(f['gpu.idle_ms'])} ms"
        console.print(line)
        if "gpu.busy_frac" not in f:
            continue
        causes = [(k.split(".")[1], f[k]) for k in f if k.startswith("idle.") and k.endswith(".ms")]
        console.print("GPU idle while the host was in: " + ", ".join(f"{c} {_ms(v)} ms" for c, v in causes if v >= 0.05))
        t = Table(title="host work while the GPU waited (per step)", show_header=True, header_style="bold")
        t.add_column("innermost host op / runtime call")
        t.add_column("ms", justify="right")
        t.add_column("share of idle", justify="right")
        for row in f["idle.top_host_ops"][:6]:
            t.add_row(row["op"][:70], _ms(row["ms"]), f"{row['share'] * 100:.0f}%")
        console.print(t)
        t = Table(title="kernel classes (per step)", show_header=True, header_style="bold")
        for col in ("class", "ms", "count", "share of GPU time"):
            t.add_column(col, justify="left" if col == "class" else "right")
        classes = sorted({k.split(".")[1] for k in f if k.startswith("kernels.")}, key=lambda c: -f[f"kernels.{c}.ms"])
        for c in classes[:12]:
            t.add_row(c, _ms(f[f"kernels.{c}.ms"]), f"{f[f'kernels.{c}.count']:,.0f}", f"{f[f'kernels.{c}.share'] * 100:.1f}%")
        console.print(t)
        console.print(f"GEMMs: {_ms(f['gemm.ms'])} ms; FP32 (no tensor cores) {f['gemm.fp32_share'] * 100:.1f}% of GEMM time"
                      + (f" in {', '.join(f['part.fp32_gemm_parts'])}: {f['gemm.fp32_top_kernels'][0][:60]}"
                         if f["gemm.fp32_share"] > 0 else ""))
        parts = sorted({k.split(".")[1] for k in f if k.startswith("part.") and k.endswith(".ms")}, key=lambda p: -f[f"part.{p}.ms"])
        console.print("GPU time by part: " + ", ".join(f"{p} {_ms(f[f'part.{p}.ms'])} ms" for p in parts))
        phases = [k.split(".")[1] for k in f if k.startswith("phase.") and k.endswith(".ms")]
        console.print("by phase: " + ", ".join(f"{p} {_ms(f[f'phase.{p}.ms'])} ms" for p in phases)
                      + f"; recompute: {f['recompute.kind']} ({f['recompute.share'] * 100:.1f}% of GPU time)")
        console.print(f"launches: {f['launch.kernels']:,.0f} kernels/step, {f['launch.tiny_kernel_frac'] * 100:.0f}% under "
                      f"10 µs, launch API {_ms(f['launch.api_ms'])} ms/step, launch-to-start median "
                      f"{_ms(f.get('launch.delay_us_median'))} µs")
        extra = []
        if "shapes.distinct_token_batches" in f:
            extra.append(f"token batch shapes: {', '.join(f['shapes.token_batches'])}")
        if "loss.logits_gb" in f:
            extra.append(f"logits {f['loss.logits_gb']:.2f} GiB ({f['loss.logits_dtype']})")
        elif f.get("ops.fused_linear_cross_entropy"):
            extra.append("logits not materialized (fused linear cross entropy)")
        liger = [f"{k.split('.')[1]} {f[k]:.0f}" for k in f if k.startswith("liger.") and f[k]]
        if liger:
            extra.append("Liger launches/step: " + ", ".join(liger))
        backends = [k.split(".")[2] for k in f if k.startswith("attention.backend.")]
        if backends:
            extra.append("SDPA backend: " + ", ".join(backends))
        if extra:
            console.print("; ".join(extra))


def render_findings(diagnosis: dict[str, Any], console: Console) -> None:
    """Prescriptions in layer order: what was seen, what to change, what it should save."""
    findings = diagnosis["findings"]
    if not findings:
        console.print("[bold green]no prescriptions[/bold green]: no rule fired on the measured facts")
    else:
        t = Table(title="prescriptions, in layer order", show_header=True, header_style="bold", show_lines=True)
        t.add_column("#", justify="right")
        t.add_column("layer")
        t.add_column("seen (measured)")
        t.add_column("change")
        t.add_column("expected gain", justify="right")
        for i, f in enumerate(findings, 1):
            gain = f["expected_gain"]
            g = "n/a"
            if gain["saves_ms_per_step"] is not None:
                g = f"-{gain['saves_ms_per_step']:.1f} ms/step"
                if gain["share_of_step"]:
                    g += f"\n({gain['share_of_step'] * 100:.0f}% of the step)"
            elif gain.get("throughput_x"):
                g = f"x{gain['throughput_x']:.2f} throughput"
            patch = ", ".join(f"{k}={v}" for k, v in f["config_patch"].items())
            # titles, evidence and fixes come from rule files, which may be a user's: never read as markup
            t.add_row(str(i), f"{f['layer']} {f['layer_name']}",
                      f"[bold]{escape(str(f['title']))}[/bold]\n" + "\n".join(escape(str(e)) for e in f["evidence"]),
                      f"{escape(str(f['fix']))}\n[cyan]{escape(patch)}[/cyan]", g)
        console.print(t)
    for s in diagnosis["superseded"]:
        console.print(f"[dim]superseded: {escape(s['id'])} (covered by {escape(s['superseded_by'])})[/dim]")
    for n in diagnosis["not_evaluated"]:
        console.print(f"[dim]not evaluated: {escape(n['id'])} (needs {escape(', '.join(n.get('missing') or []))})[/dim]")
    for p in diagnosis.get("problems", []):
        console.print(f"[yellow]rule problem:[/yellow] {escape(str(p))}")


def render_ladder(result: dict[str, Any], console: Console) -> None:
    """The treat ladder: kept steps with their numbers, then the trials that were not kept."""
    cfg = result["start_config"]
    console.print(f"[bold]vlmdoctor treat: {cfg['model']} stage {cfg['stage']}[/bold] "
                  f"({len(result['trials'])} trial(s); stopped: {result.get('stopped_because')})")
    if not result["ladder"]:
        start = result.get("start") or {}
        console.print(f"[bold red]the start config did not run[/bold red]: {start.get('status')} {start.get('error') or ''}")
        return
    t = Table(title="ladder (kept changes, in order)", header_style="bold")
    for col, just in (("#", "right"), ("change", "left"), ("rule", "left"), ("real tokens/s", "right"),
                      ("x start", "right"), ("ms/step", "right"), ("MFU", "right"), ("peak GiB", "right")):
        t.add_column(col, justify=just)
    for r in result["ladder"]:
        reps = r.get("tokens_per_s_repeats") or []
        spread = f" ({min(reps):,.0f}-{max(reps):,.0f})" if len(reps) > 1 else ""
        t.add_row(str(r["step"]), r["change"], r["rule"] or "", f"{r['real_tokens_per_s']:,.0f}{spread}",
                  f"{r['speedup']:.2f}", _fmt(r.get("step_ms")), _fmt(r["mfu"] * 100 if r.get("mfu") else None, " %"),
                  _fmt(r.get("peak_mem_gb"), "", 1))
    console.print(t)
    rejected = [x for x in result["trials"] if x.get("outcome") != "kept"]
    if rejected:
        t = Table(title="trials not kept", header_style="bold")
        for col in ("trial", "rule", "change", "outcome", "real tokens/s", "gain vs margin"):
            t.add_column(col)
        for x in rejected:
            gain = f"{x['gain'] * 100:+.1f}% vs +/-{x['margin'] * 100:.1f}%" if "gain" in x else (x.get("error") or "")[:60]
            t.add_row(str(x["trial"]), x["rule"], ", ".join(f"{k}={v}" for k, v in x["config_patch"].items()),
                      x["outcome"], _fmt(x.get("real_tokens_per_s"), "", 0), gain)
        console.print(t)
    for s in result.get("skipped") or []:
        console.print(f"skipped {s['rule']}: {s['why']}")


def render_sweep(rows: list[dict[str, Any]], console: Console) -> None:
    t = Table(title="sweep", header_style="bold")
    for col, just in (("stage", "right"), ("configuration", "left"), ("real tokens/s", "right"), ("pad %", "right"),
                      ("ms/step (p10-p90)", "right"), ("MFU", "right"), ("peak GiB", "right"), ("status", "left")):
        t.add_column(col, justify=just)
    for r in rows:
        ok = r["status"] == "ok"
        t.add_row(str(r["stage"]), r["name"], _fmt(r["real_tokens_per_s"], "", 0) if ok else "",
                  _fmt(r["pad_fraction"] * 100 if ok else None),
                  f"{_fmt(r['step_ms'])} ({_fmt(r['step_ms_p10'])}-{_fmt(r['step_ms_p90'])})" if ok else "",
                  _fmt(r["mfu"] * 100 if r.get("mfu") else None, " %"), _fmt(r.get("peak_mem_gb"), "", 1),
                  r["status"] if ok else f"{r['status']}: {(r.get('error') or '')[:50]}")
    console.print(t)
