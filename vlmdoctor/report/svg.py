"""The pages' charts as inline SVG: the step split into GPU busy and idle by cause, GPU time by kernel class, the
treat ladder, and the split of a user's traced step by model part."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vlmdoctor.documents import TreatResult, Trial
from vlmdoctor.report.html_page import esc, fmt_num, fmt_pct, patch_text

BUSY = "#2e7d32"


IDLE_COLORS = {
    "data_loader": "#f9a825",
    "sync": "#c62828",
    "memcpy": "#8e24aa",
    "optimizer_host": "#1565c0",
    "other_host": "#9e9e9e",
}


EXTRA_COLORS = ["#00838f", "#6d4c41", "#ef6c00", "#5c6bc0", "#ad1457", "#558b2f"]


IDLE_LABELS = {
    "data_loader": "data loader",
    "sync": "host sync",
    "memcpy": "memcpy calls",
    "optimizer_host": "optimizer (host)",
    "other_host": "other host work (launches, Python, planning)",
}


KEPT, REJECTED, FAILED, INK, GRID = "#2e7d32", "#9e9e9e", "#c62828", "#212121", "#e0e0e0"


def _idle_causes(facts: dict[str, Any]) -> list[tuple[str, float]]:
    """idle.<cause>.ms in the order analysis writes them (idle.op.<x>.ms is a detail, not a cause)."""
    return [
        (k.split(".")[1], float(v))
        for k, v in facts.items()
        if k.startswith("idle.") and k.endswith(".ms") and k.count(".") == 2 and isinstance(v, (int, float))
    ]


def step_split_svg(facts: dict[str, Any]) -> str:
    """The step as one stacked horizontal bar: GPU busy, then GPU idle split by what the host was doing."""
    step = facts.get("step.ms")
    busy = facts.get("gpu.busy_ms")
    if not isinstance(step, (int, float)) or not isinstance(busy, (int, float)) or step <= 0:
        return '<p class="note">No GPU busy/idle split: the trace has no GPU kernels or no ProfilerStep markers.</p>'
    segs = [("GPU busy", float(busy), BUSY)]
    extra = iter(EXTRA_COLORS)
    for cause, ms in _idle_causes(facts):
        segs.append((f"idle: {IDLE_LABELS.get(cause, cause)}", ms, IDLE_COLORS.get(cause) or next(extra, "#bdbdbd")))
    total = max(float(step), sum(ms for _, ms, _ in segs))
    W, X0, BAR_W, BAR_Y, BAR_H = 1100, 10, 1080, 30, 44
    out = [
        f'<svg viewBox="0 0 {W} {{H}}" role="img" aria-label="step time split">',
        f'<text x="{X0}" y="18" font-size="14" fill="{INK}">one traced step: {esc(fmt_num(step))} ms '
        f"(host wall time, mean of the traced window); GPU busy {esc(fmt_pct(busy / step, 0))}</text>",
    ]
    x = float(X0)
    for label, ms, color in segs:
        w = BAR_W * ms / total
        if w <= 0:
            continue
        out.append(
            f'<rect x="{x:.2f}" y="{BAR_Y}" width="{w:.2f}" height="{BAR_H}" fill="{color}">'
            f"<title>{esc(label)}: {esc(fmt_num(ms))} ms ({esc(fmt_pct(ms / step))} of the step)</title></rect>"
        )
        if w > 70:
            out.append(
                f'<text x="{x + 5:.1f}" y="{BAR_Y + 27}" font-size="13" fill="#fff">{esc(fmt_num(ms, 0))} ms</text>'
            )
        x += w
    # legend: two columns
    y0 = BAR_Y + BAR_H + 24
    for i, (label, ms, color) in enumerate(segs):
        col, row = i % 2, i // 2
        lx, ly = X0 + col * 540, y0 + row * 22
        out.append(f'<rect x="{lx}" y="{ly - 11}" width="12" height="12" fill="{color}"/>')
        out.append(
            f'<text x="{lx + 18}" y="{ly}" font-size="13" fill="{INK}">{esc(label)}: {esc(fmt_num(ms))} ms '
            f"({esc(fmt_pct(ms / step))})</text>"
        )
    height = y0 + ((len(segs) + 1) // 2) * 22
    out.append("</svg>")
    return "".join(out).replace("{H}", str(height))


_PREFIX_COLORS = [
    ("gemm_fp32", "#c62828"),
    ("gemm_tf32", "#ef6c00"),
    ("gemm", "#1565c0"),
    ("attention", "#6a1b9a"),
    ("liger", "#00838f"),
    ("triton", "#00897b"),
]  # first matching prefix wins


_CLASS_COLORS = {"optimizer": "#5d4037", "cast": "#f9a825", "softmax": "#8e24aa", "nccl": "#ad1457"}


def _kernel_color(cls: str) -> str:
    return next((c for p, c in _PREFIX_COLORS if cls.startswith(p)), _CLASS_COLORS.get(cls, "#78909c"))


def kernel_classes_svg(facts: dict[str, Any], top: int = 14) -> str:
    """GPU time per step by kernel class, one bar each, largest first; the rest summed in one bar."""
    classes = sorted(
        {k.split(".")[1] for k in facts if k.startswith("kernels.") and k.endswith(".ms")},
        key=lambda c: -float(facts[f"kernels.{c}.ms"] or 0),
    )
    rows = [
        (
            c,
            float(facts[f"kernels.{c}.ms"] or 0),
            facts.get(f"kernels.{c}.count"),
            facts.get(f"kernels.{c}.share"),
        )
        for c in classes
    ]
    rows = [r for r in rows if r[1] > 0]
    if not rows:
        return '<p class="note">No GPU kernels in the trace.</p>'
    if len(rows) > top:
        rest = rows[top - 1 :]
        rows = rows[: top - 1] + [
            (
                f"{len(rest)} other classes",
                sum(r[1] for r in rest),
                sum(r[2] or 0 for r in rest),
                sum(r[3] or 0 for r in rest),
            )
        ]
    W, LABEL_W, BAR_X, BAR_MAX, ROW_H = 1100, 190, 200, 600, 24
    peak = max(r[1] for r in rows)
    out = [
        f'<svg viewBox="0 0 {W} {len(rows) * ROW_H + 34}" role="img" aria-label="GPU time by kernel class">',
        f'<text x="0" y="16" font-size="14" fill="{INK}">GPU time per step by kernel class '
        f"(total {esc(fmt_num(facts.get('gpu.busy_ms') or sum(r[1] for r in rows)))} ms busy)</text>",
    ]
    for i, (cls, ms, count, share) in enumerate(rows):
        y = 30 + i * ROW_H
        w = max(1.0, BAR_MAX * ms / peak)
        out.append(f'<text x="{LABEL_W}" y="{y + 15}" font-size="13" text-anchor="end" fill="{INK}">{esc(cls)}</text>')
        out.append(
            f'<rect x="{BAR_X}" y="{y + 3}" width="{w:.1f}" height="{ROW_H - 7}" fill="{_kernel_color(cls)}">'
            f"<title>{esc(cls)}: {esc(fmt_num(ms, 2))} ms, {esc(fmt_num(count, 0))} kernels</title></rect>"
        )
        detail = f"{fmt_num(ms)} ms · {fmt_pct(share)} · {fmt_num(count, 0)} kernels"
        out.append(f'<text x="{BAR_X + w + 8:.1f}" y="{y + 15}" font-size="12" fill="{INK}">{esc(detail)}</text>')
    out.append("</svg>")
    return "".join(out)


def _failed(outcome: str | None) -> bool:
    return outcome not in ("kept", "no_gain", "harmful")


def ladder_svg(result: TreatResult) -> str:
    """One bar per kept step (real tokens/s; speedup over the start on top, the change below); trials not
    kept drawn at the rung they were tried from: grey dot at what they measured, red cross when they failed."""
    ladder, trials = result.ladder, result.trials
    if not ladder:
        return '<p class="warn">The start config did not run: no ladder.</p>'
    values = [float(r.real_tokens_per_s or 0) for r in ladder]
    values += [float(t.real_tokens_per_s) for t in trials if t.real_tokens_per_s]
    values += [float(v) for r in ladder for v in r.tokens_per_s_repeats or []]  # the whiskers
    peak = max(values + [1.0]) * 1.08
    tick = _nice(peak / 5)
    ticks = max(1, math.ceil(peak / tick))
    top = tick * ticks
    W, LEFT, RIGHT, TOP, PLOT_H = 1100, 80, 20, 40, 300
    n = len(ladder)
    slot = (W - LEFT - RIGHT) / n
    width = max(8, int(slot / 7.5))
    rows = max(len(_wrap(str(r.change or ""), width, 3)) for r in ladder)
    H = TOP + PLOT_H + 18 + 15 * rows + 44

    def y(v: float) -> float:
        return TOP + PLOT_H * (1 - v / top)

    out = [
        f'<svg viewBox="0 0 {W} {H}" role="img" aria-label="treat ladder">',
        f'<text x="{LEFT}" y="18" font-size="14" fill="{INK}">real tokens/s per kept step (median over the repeats); '
        "speedup over the start on top</text>",
    ]
    for i in range(ticks + 1):
        v = tick * i
        out.append(f'<line x1="{LEFT}" y1="{y(v):.1f}" x2="{W - RIGHT}" y2="{y(v):.1f}" stroke="{GRID}"/>')
        out.append(
            f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" font-size="12" text-anchor="end" fill="{INK}">'
            f"{esc(fmt_num(v, 0))}</text>"
        )
    for i, r in enumerate(ladder):
        v = float(r.real_tokens_per_s or 0)
        x0, w = LEFT + i * slot + slot * 0.18, slot * 0.5
        cx = x0 + w / 2
        reps = r.tokens_per_s_repeats or []
        tip = f"step {r.step}: {r.change} ({fmt_num(v, 0)} tokens/s, x{fmt_num(r.speedup, 2)})"
        out.append(
            f'<rect x="{x0:.1f}" y="{y(v):.1f}" width="{w:.1f}" height="{y(0) - y(v):.1f}" fill="{KEPT}">'
            f"<title>{esc(tip)}</title></rect>"
        )
        if len(reps) > 1:  # the spread of the repeats, as a whisker
            lo, hi = min(reps), max(reps)
            out.append(
                f'<line x1="{cx:.1f}" y1="{y(lo):.1f}" x2="{cx:.1f}" y2="{y(hi):.1f}" stroke="{INK}" '
                'stroke-width="1.5"/>'
            )
        out.append(
            f'<text x="{cx:.1f}" y="{min(y(v), y(max(reps)) if reps else y(v)) - 6:.1f}" font-size="13" '
            f'font-weight="600" text-anchor="middle" fill="{INK}">x{esc(fmt_num(r.speedup, 2))}</text>'
        )
        label = str(r.change or "")
        parts = _wrap(label, width, 3)
        for j, part in enumerate(parts):
            out.append(
                f'<text x="{cx:.1f}" y="{y(0) + 18 + j * 15:.1f}" font-size="12" text-anchor="middle" '
                f'fill="{INK}">{esc(part)}</text>'
            )
        out.append(
            f'<text x="{cx:.1f}" y="{y(0) + 18 + len(parts) * 15:.1f}" font-size="11" text-anchor="middle" '
            f'fill="#616161">{esc(fmt_num(v, 0))} tokens/s</text>'
        )
    out += _trial_marks(trials, LEFT, slot, y)
    out.append(_ladder_legend(LEFT, H - 14))
    out.append("</svg>")
    return "".join(out)


def _trial_marks(trials: list[Trial], left: float, slot: float, y: Callable[[float], float]) -> list[str]:
    """The trials not kept, at the rung they were tried from: a grey dot at what they measured, a red cross when
    they failed."""
    out: list[str] = []
    rung, seen_at = 0, {}
    for t in trials:  # a trial is tried from the rung kept before it
        if t.outcome in ("kept", "adopted"):
            rung += 1
            continue
        k = seen_at.get(rung, 0)
        seen_at[rung] = k + 1
        cx = left + rung * slot + slot * (0.78 + 0.07 * (k % 3))
        v = t.real_tokens_per_s
        tip = f"trial {t.trial}: {t.rule} ({patch_text(t.config_patch)}): {t.outcome}" + (
            f", {fmt_num(v, 0)} tokens/s" if v else (f": {t.error}" if t.error else "")
        )
        if v and not _failed(t.outcome):
            out.append(
                f'<circle cx="{cx:.1f}" cy="{y(v):.1f}" r="6" fill="{REJECTED}" stroke="#fff"><title>{esc(tip)}'
                "</title></circle>"
            )
            out.append(
                f'<text x="{cx:.1f}" y="{y(v) - 9:.1f}" font-size="10" text-anchor="middle" fill="#616161">'
                f"t{esc(str(t.trial))}</text>"
            )
        else:
            yy = y(0) - 12
            out.append(
                f'<g stroke="{FAILED}" stroke-width="3"><title>{esc(tip)}</title>'
                f'<line x1="{cx - 6:.1f}" y1="{yy - 6:.1f}" x2="{cx + 6:.1f}" y2="{yy + 6:.1f}"/>'
                f'<line x1="{cx - 6:.1f}" y1="{yy + 6:.1f}" x2="{cx + 6:.1f}" y2="{yy - 6:.1f}"/></g>'
            )
            out.append(
                f'<text x="{cx:.1f}" y="{yy - 10:.1f}" font-size="10" text-anchor="middle" fill="{FAILED}">'
                f"t{esc(str(t.trial))}</text>"
            )
    return out


def _ladder_legend(left: int, ly: int) -> str:
    """The ladder's legend: kept, tried and not kept, failed."""
    return (
        f'<rect x="{left}" y="{ly - 10}" width="12" height="12" fill="{KEPT}"/>'
        f'<text x="{left + 18}" y="{ly}" font-size="12" fill="{INK}">kept (whisker: spread of the repeats)</text>'
        f'<circle cx="{left + 306}" cy="{ly - 4}" r="6" fill="{REJECTED}"/>'
        f'<text x="{left + 318}" y="{ly}" font-size="12" fill="{INK}">tried, not kept (no gain or harmful)</text>'
        f'<g stroke="{FAILED}" stroke-width="3"><line x1="{left + 580}" y1="{ly - 10}" x2="{left + 592}" '
        f'y2="{ly + 2}"/><line x1="{left + 580}" y1="{ly + 2}" x2="{left + 592}" y2="{ly - 10}"/></g>'
        f'<text x="{left + 600}" y="{ly}" font-size="12" fill="{INK}">failed: OOM, crash, timeout or refused'
        "</text>"
    )


def _nice(x: float) -> float:
    """The round number (1, 2, 2.5 or 5 times a power of ten) at or above x: an axis step."""
    p = 10 ** math.floor(math.log10(x)) if x > 0 else 1.0
    return next(m * p for m in (1, 2, 2.5, 5, 10) if m * p >= x)


def _wrap(text: str, width: int, lines: int) -> list[str]:
    words, out, cur = text.replace(",", ", ").split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            out.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    if cur:
        out.append(cur)
    if len(out) > lines:
        out = out[:lines]
        out[-1] = out[-1][: max(1, width - 3)] + "..."
    return [o if len(o) <= width + 4 else o[: width + 1] + "..." for o in out]


PART_COLORS = {
    "vision": "#6a1b9a",
    "projector": "#00838f",
    "llm": "#1565c0",
    "loss": "#ef6c00",
    "optimizer": "#5d4037",
    "other": "#9e9e9e",
}


def split_svg(split: dict[str, Any]) -> str:
    """The traced step as one stacked bar: vision, projector, LLM, loss, optimizer, other."""
    rows = [r for r in split["rows"] if r["ms"] > 0]
    W, X0, BAR_W, BAR_Y, BAR_H = 1100, 10, 1080, 30, 40
    out = [
        f'<svg viewBox="0 0 {W} {{H}}" role="img" aria-label="split of the step">',
        f'<text x="{X0}" y="18" font-size="14" fill="#212121">one traced step: {esc(fmt_num(split["step_ms"]))} ms '
        f"({esc(split['basis'])})</text>",
    ]
    x = float(X0)
    for r in rows:
        w = BAR_W * r["share"]
        color = PART_COLORS.get(r["part"], "#bdbdbd")
        out.append(
            f'<rect x="{x:.2f}" y="{BAR_Y}" width="{w:.2f}" height="{BAR_H}" fill="{color}">'
            f"<title>{esc(r['part'])}: {esc(fmt_num(r['ms']))} ms ({esc(fmt_pct(r['share']))})</title></rect>"
        )
        if w > 80:
            out.append(
                f'<text x="{x + 5:.1f}" y="{BAR_Y + 25}" font-size="13" fill="#fff">{esc(r["part"])} '
                f"{esc(fmt_pct(r['share'], 0))}</text>"
            )
        x += w
    y0 = BAR_Y + BAR_H + 24
    for i, r in enumerate(split["rows"]):
        lx, ly = X0 + (i % 3) * 360, y0 + (i // 3) * 22
        out.append(
            f'<rect x="{lx}" y="{ly - 11}" width="12" height="12" fill="{PART_COLORS.get(r["part"], "#bdbdbd")}"/>'
        )
        out.append(
            f'<text x="{lx + 18}" y="{ly}" font-size="13" fill="#212121">{esc(r["part"])}: {esc(fmt_num(r["ms"]))} ms '
            f"({esc(fmt_pct(r['share']))})</text>"
        )
    out.append("</svg>")
    return "".join(out).replace("{H}", str(y0 + ((len(split["rows"]) + 2) // 3) * 22))
