"""A trace's analysis in the terminal: the step's accounts, the host work the GPU waited for, the kernel classes,
parts, phases and launches, which optimizations took effect, the collectives, and the ranks of a job side by side
(`vlmdoctor analyze`)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table

from vlmdoctor.documents import Analysis, AnalyzedFile, CrossRank, Effect, StepAccounts, as_document
from vlmdoctor.report.text import esc, fmt_ms, plain


def straggler_cause(f: dict[str, Any]) -> str:
    """The straggler's cause in words, with the numbers that make it the cause."""
    cause = str(f["dist.straggler.cause"])
    grown = f.get("dist.straggler.accounts") or []
    if cause == "tokens":
        text = f"tokens ({f['dist.straggler.tokens_excess_frac'] * 100:+.0f}% over the others' mean)"
    elif cause == "gemm_work":
        text = (
            f"gemm work (its GEMMs ran {f['dist.straggler.gemm_excess_frac'] * 100:+.0f}% longer than the others': "
            "more or longer samples; record_shapes=True counts its tokens)"
        )
    elif cause.startswith(("busy.", "idle.")):
        text = next((f"{g['account']} grew {g['excess_ms']:,.1f} ms/step ({g['meaning']})" for g in grown), cause)
    else:
        text = cause.replace("_", " ")
    if cause not in ("balanced",) and grown and not cause.startswith(("busy.", "idle.")):
        text += "; accounts above the others': " + ", ".join(f"{g['account']} +{g['excess_ms']:,.1f} ms" for g in grown)
    return text


def render_accounts(acc: StepAccounts, console: Console, top: int = 12) -> None:
    """The traced step's accounts, largest first, then the unattributed rest: every millisecond of the step."""
    t = Table(
        title=f"accounts of the traced step ({acc.step_ms:,.1f} ms; per step)",
        show_header=True,
        header_style="bold",
    )
    for col, justify in (("account", "left"), ("ms", "right"), ("step", "right"), ("what", "left")):
        t.add_column(col, justify=justify, no_wrap=col != "what")  # a name is never cut; the words wrap
    for r in acc.rows[:top]:
        t.add_row(esc(r.account), fmt_ms(r.ms), f"{r.share * 100:.0f}%", esc(r.meaning or ""))
    rest = acc.rows[top:]
    if rest:
        ms = sum(r.ms for r in rest)
        t.add_row(f"{len(rest)} more", fmt_ms(ms), f"{ms / acc.step_ms * 100:.0f}%", "")
    t.add_row(
        "unattributed",
        fmt_ms(acc.unattributed_ms),
        f"{acc.unattributed_share * 100:.0f}%",
        "GPU idle under no host event" if acc.unattributed_ms > 0 else "",
    )
    console.print(t)


def render_facts(result: Analysis | dict[str, Any], console: Console) -> None:
    """What the GPU did per step and why it waited, every table (`vlmdoctor analyze --verbose`)."""
    a = as_document(result, Analysis, "analysis") if isinstance(result, dict) else result
    for entry in a.files:
        f = entry.facts
        file_head(entry, console)
        if not f["trace.written_by_vlmdoctor"]:  # a user's trace: say where each number's frame came from
            console.print(
                f"steps from {esc(f.get('trace.windows_from', 'n/a'))}; stage: "
                f"{esc(f.get('run.stage_source') or f.get('run.stage_estimate_why') or 'unknown')}; "
                f"model parts from: {esc(f.get('part.source', 'none'))}"
            )
            if "shapes.micro_batches_per_step.source" in f:
                console.print(
                    f"micro-batches per step: {f['shapes.micro_batches_per_step']:g} "
                    f"({esc(f['shapes.micro_batches_per_step.source'])})"
                )
        console.print(step_line(entry), highlight=False)
        if "comm.ms" in f:
            console.print(comm_line(f, "comm.", entry.rank))
        if "gpu.busy_frac" in f:
            _render_gpu_facts(entry, console)
        if entry.effects:
            render_effects(entry.effects, console)


def _render_gpu_facts(entry: AnalyzedFile, console: Console) -> None:
    """A GPU trace's tables: the step's accounts, the host work the GPU waited for, the kernel classes; then
    GEMMs, parts, phases, launches and what else the trace shows, a line each."""
    f = entry.facts
    if entry.accounts is not None:
        render_accounts(entry.accounts, console)
    t = Table(title="host work while the GPU waited (per step)", show_header=True, header_style="bold")
    t.add_column("innermost host op / runtime call")
    t.add_column("ms", justify="right", no_wrap=True)
    t.add_column("share of idle", justify="right", no_wrap=True)
    for row in f["idle.top_host_ops"][:6]:
        t.add_row(esc(str(row["op"])), fmt_ms(row["ms"]), f"{row['share'] * 100:.0f}%")
    console.print(t)
    t = Table(title="kernel classes (per step)", show_header=True, header_style="bold")
    for col in ("class", "ms", "count", "share of GPU time"):
        t.add_column(col, justify="left" if col == "class" else "right")
    classes = sorted({k.split(".")[1] for k in f if k.startswith("kernels.")}, key=lambda c: -f[f"kernels.{c}.ms"])
    for c in classes[:12]:
        t.add_row(
            esc(c),
            fmt_ms(f[f"kernels.{c}.ms"]),
            f"{f[f'kernels.{c}.count']:,.0f}",
            f"{f[f'kernels.{c}.share'] * 100:.1f}%",
        )
    console.print(t)
    console.print(
        f"GEMMs: {fmt_ms(f['gemm.ms'])} ms; FP32 (no tensor cores) {f['gemm.fp32_share'] * 100:.1f}% of GEMM time"
        + (
            f" in {esc(', '.join(f['part.fp32_gemm_parts']))}: {esc(str(f['gemm.fp32_top_kernels'][0])[:60])}"
            if f["gemm.fp32_share"] > 0
            else ""
        )
    )
    parts = sorted(
        {k.split(".")[1] for k in f if k.startswith("part.") and k.endswith(".ms")},
        key=lambda p: -f[f"part.{p}.ms"],
    )
    console.print("GPU time by part: " + ", ".join(f"{esc(p)} {fmt_ms(f[f'part.{p}.ms'])} ms" for p in parts))
    phases = [k.split(".")[1] for k in f if k.startswith("phase.") and k.endswith(".ms")]
    console.print(
        "by phase: "
        + ", ".join(f"{esc(p)} {fmt_ms(f[f'phase.{p}.ms'])} ms" for p in phases)
        + f"; recompute: {esc(f['recompute.kind'])} ({f['recompute.share'] * 100:.1f}% of GPU time)"
    )
    console.print(
        f"launches: {f['launch.kernels']:,.0f} kernels/step, {f['launch.tiny_kernel_frac'] * 100:.0f}% under "
        f"10 µs, launch API {fmt_ms(f['launch.api_ms'])} ms/step, launch-to-start median "
        f"{fmt_ms(f.get('launch.delay_us_median'))} µs"
    )
    if "shapes.distinct_token_batches" in f:  # logits, Liger, SDPA backends: the effects table says them
        console.print(f"token batch shapes: {esc(', '.join(map(str, f['shapes.token_batches'])))}")


def render_effects(rows: list[Effect], console: Console) -> None:
    """Which optimizations took effect in the traced step, with the evidence and, when off or partial, why
    (trace/effects.py)."""
    t = Table(title="did it take effect?", show_header=True, header_style="bold")
    for col in ("optimization", "state", "seen", "why"):
        # a name is never cut; the words wrap, and a long name in them folds onto the next line
        t.add_column(col, no_wrap=col in ("optimization", "state"), overflow="fold")
    for r in rows:
        t.add_row(esc(r.name), esc(r.state), esc(r.seen), esc(r.why or ""))
    console.print(t)


def effects_line(rows: list[Effect], width: int = 80) -> str:
    """`in effect: compile partial (89%), Liger off, SDPA cudnn, ...` in markup, wrapped at its commas to `width`
    columns, each further line indented under the first item."""
    head = "in effect: "
    items = [plain(r.brief or f"{r.name} {r.state}") for r in rows]
    lines, line = [], head
    for k, item in enumerate(items):
        piece = item + ("," if k < len(items) - 1 else "")
        if line != head and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = " " * len(head) + piece
        else:
            line += ("" if line == head else " ") + piece
    lines.append(line)
    return "\n".join(esc(x) for x in lines)


def render_accounts_brief(acc: StepAccounts, console: Console, at_least: float = 0.05) -> None:
    """The step's largest accounts, one line each, and the rest in one line: where the traced step went."""
    t = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
    t.add_column("share", justify="right", no_wrap=True)
    t.add_column("ms", justify="right", no_wrap=True)
    t.add_column("account", no_wrap=True)
    t.add_column("what")
    big = [r for r in acc.rows if r.share >= at_least]
    for r in big:
        t.add_row(f"{r.share * 100:.0f}%", f"{fmt_ms(r.ms)} ms", esc(r.account), esc(r.meaning or ""))
    rest = acc.rows[len(big) :]
    if rest:
        ms = sum(r.ms for r in rest)
        t.add_row(f"{ms / acc.step_ms * 100:.0f}%", f"{fmt_ms(ms)} ms", f"{len(rest)} smaller accounts", "")
    if acc.unattributed_ms > 0:
        t.add_row(
            f"{acc.unattributed_share * 100:.0f}%", f"{fmt_ms(acc.unattributed_ms)} ms", "unattributed", "no host event"
        )
    console.print(f"where the {fmt_ms(acc.step_ms)} ms traced step went:", highlight=False)
    console.print(Padding(t, (0, 0, 0, 2)))


def file_head(entry: AnalyzedFile, console: Console, said: set[str] | None = None) -> None:
    """A trace's name, steps, model and stage, and its warnings: what every reading of it starts with.
    `said`: warnings printed for an earlier rank's trace, not printed again."""
    f = entry.facts
    known = (
        ", ".join(f"{k.split('.')[1]} {esc(f[k])}" for k in ("run.model", "run.stage") if k in f)
        or "model and stage unknown"
    )
    console.print(
        f"[bold]{esc(entry.file)}[/bold]: {esc(f['trace.steps'])} step(s), {known}"
        + ("" if f["trace.written_by_vlmdoctor"] else " (not written by vlmdoctor)")
    )
    notes = f.get("run.notes") or []
    for w in f.get("trace.warnings", []):
        if said is not None and w in said:
            continue
        console.print(f"[yellow]{'warning' if w in notes else 'partial'}:[/yellow] {esc(w)}", highlight=False)
        if said is not None:
            said.add(w)


def step_line(entry: AnalyzedFile) -> str:
    """The step's time and GPU busy share (a trace's headline)."""
    f = entry.facts
    line = f"step {fmt_ms(f['step.ms'])} ms"
    if "gpu.busy_frac" in f:
        busy = f"{f['gpu.busy_frac'] * 100:.0f}% ({fmt_ms(f['gpu.busy_ms'])} ms)"
        line += f"; GPU busy {busy}, idle {fmt_ms(f['gpu.idle_ms'])} ms"
    return line


def comm_line(f: dict[str, Any], prefix: str, rank: int | None = None) -> str:
    """Collective time per step, exposed vs hidden, and each collective's size and bus bandwidth."""
    who = f"rank {esc(rank)}: " if rank is not None else ""
    line = (
        f"{who}collectives {fmt_ms(f[prefix + 'ms'])} ms/step, exposed {fmt_ms(f[prefix + 'exposed_ms'])} ms, hidden "
        f"{fmt_ms(f[prefix + 'hidden_ms'])} ms"
    )
    kinds = f.get(prefix + "kinds") or []
    parts = []
    for k in kinds:
        bw = f.get(f"{prefix}{k}.busbw_gbps")
        size = f.get(f"{prefix}{k}.bytes")
        parts.append(
            f"{esc(k)} {fmt_ms(f.get(f'{prefix}{k}.ms'))} ms"
            + (f" {size / 2**20:,.1f} MiB" if size else "")
            + (f" busbw {bw:.2f} GB/s" if bw is not None else "")
        )
    return "\n".join([line] + [f"  {p}" for p in parts])


def render_cross_rank(cross: CrossRank | dict[str, Any], console: Console, brief: bool = False) -> None:
    """The ranks of one data-parallel job side by side: who was slow, who waited, how much communication showed.
    `brief`: the table and the slowest rank only."""
    c = as_document(cross, CrossRank, "cross_rank") if isinstance(cross, dict) else cross
    if c.skipped is not None or c.facts is None:
        console.print(f"[yellow]cross-rank:[/yellow] {esc(c.skipped or 'no facts')}", highlight=False)
        return
    f = c.facts
    console.print(
        f"[bold]cross-rank[/bold]: {esc(f['dist.ranks'])} ranks of {esc(f['dist.world_size'])}, "
        f"{esc(f['dist.parallel'])} over {esc(f['dist.backend'])}"
    )
    for note in c.notes or []:
        console.print(f"[yellow]note:[/yellow] {esc(note)}", highlight=False)
    t = Table(
        show_header=True,
        header_style="bold",
        title="per rank (ms per step)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
    )
    for col in ("rank", "step", "waited", "busy", "tokens", "loader", "gaps", "comm", "exposed"):
        t.add_column(col, justify="right")
    for r in c.ranks or []:
        t.add_row(
            esc(r["rank"]),
            *(fmt_ms(r.get(k)) for k in ("step_ms", "wait_ms", "busy_ms")),
            f"{r['tokens']:,.0f}" if r.get("tokens") else "n/a",
            *(fmt_ms(r.get(k)) for k in ("loader_ms", "gap_ms", "comm_ms", "exposed_ms")),
        )
    console.print(t)
    if "dist.straggler.rank" in f:
        console.print(
            f"slowest rank {esc(f['dist.straggler.rank'])}: busy {fmt_ms(f['dist.step_skew_ms'])} ms/step more than "
            f"the fastest ({f.get('dist.step_skew_frac', 0) * 100:.0f}%)"
        )
        console.print(f"  cause: {esc(straggler_cause(f))}", highlight=False)
    if brief:
        return
    if "dist.late_wait_ms" in f:
        console.print(
            f"waiting for late ranks in collectives: {fmt_ms(f['dist.late_wait_ms'])} ms/step mean, "
            f"{fmt_ms(f['dist.late_wait_ms_max'])} max"
        )
    if "dist.comm.ms" in f:
        console.print(comm_line(f, "dist.comm.", None).replace("collectives", "rank mean: collectives", 1))
        console.print(
            f"exposed, less the wait for late ranks: {fmt_ms(f['dist.comm.exposed_own_ms'])} ms/step"
            + (f" ({f['dist.comm.exposed_share'] * 100:.1f}%)" if "dist.comm.exposed_share" in f else "")
        )
    if "dist.fsdp.prefetched_frac" in f:
        console.print(
            f"FSDP2 all-gathers issued ahead of their module: forward "
            f"{f.get('dist.fsdp.forward_prefetched_frac', 0) * 100:.0f}%, backward "
            f"{f.get('dist.fsdp.backward_prefetched_frac', 0) * 100:.0f}%"
        )
    if f.get("dist.micro_batches_per_step", 1) > 1:
        console.print(
            f"gradient sync in {f['dist.synced_micro_batches_per_step']:g} of {f['dist.micro_batches_per_step']:g} "
            f"micro-batches per step"
        )
        console.print(f"  {fmt_ms(f['dist.grad_sync.extra_ms'])} ms/step of it before the last micro-batch")
    hta = c.hta or {}
    if "overlap_pct" in hta:
        ours = hta.get("ours_overlap_pct") or {}
        console.print("comm overlapped with compute, traceinsight vs vlmdoctor:")
        for r, v in sorted(hta["overlap_pct"].items()):
            console.print(f"  rank {esc(r)}: {v:.1f}% vs {ours.get(r) or 0:.1f}%")
    elif "skipped" in hta:
        console.print(f"[dim]traceinsight cross-check skipped: {esc(hta['skipped'])}[/dim]", highlight=False)
