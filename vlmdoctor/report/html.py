"""Self-contained HTML reports: one file, inline CSS, charts as inline SVG, no script, nothing fetched.

`profile_html` renders a `vlmdoctor profile --json` report, `analyze_html` the JSON that `vlmdoctor
analyze --json` writes, `treat_html` a treat result (`treat.json`). Each page holds the numbers, the
charts (step time split into GPU busy and idle by cause; GPU time by kernel class; for treat, the
ladder), the prescriptions in layer order and the environment. Every piece of text from a report is
escaped; a Content-Security-Policy forbids any fetch and any script, so the file shows the same
offline, in a mail attachment or in a CI artifact.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vlmdoctor.errors import UsageError
from vlmdoctor.run import throughput

esc = html.escape

# -- colours ------------------------------------------------------------------------------------------
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

CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: #212121; background: #fafafa; margin: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 16px 24px 48px; background: #fff; }
h1 { font-size: 22px; margin: 8px 0 4px; }
h2 { font-size: 18px; margin: 28px 0 8px; padding-bottom: 4px; border-bottom: 1px solid #e0e0e0; }
h3 { font-size: 15px; margin: 18px 0 6px; }
p.sub { color: #616161; margin: 0 0 12px; }
.note { color: #616161; font-size: 13px; }
.warn { color: #b71c1c; font-weight: 600; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }
th, td { border: 1px solid #e0e0e0; padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #f5f5f5; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.wide { width: 100%; }
table.findings td:nth-child(3) { width: 34%; } table.findings td:nth-child(4) { width: 24%; }
table.findings td:nth-child(6) { width: 22%; }
ul.ev { margin: 4px 0 0; padding-left: 18px; }
code.kv { white-space: nowrap; }
code { font: 12px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background: #f5f5f5;
       padding: 1px 4px; border-radius: 3px; word-break: break-word; }
.how { color: #616161; font-size: 12px; margin-top: 4px; }
.badge { display: inline-block; padding: 0 6px; border-radius: 9px; font-size: 12px; color: #fff; }
.kept { background: #2e7d32; } .no_gain { background: #757575; } .harmful { background: #e65100; }
.failed { background: #c62828; }
svg { display: block; max-width: 100%; height: auto; margin: 4px 0 8px; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; }
details { margin: 8px 0; } summary { cursor: pointer; color: #424242; }
.grid2 { display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); gap: 0 24px; }
footer { margin-top: 32px; color: #9e9e9e; font-size: 12px; }
p.top, div.top { border-left: 4px solid #2e7d32; background: #f1f8e9; padding: 8px 12px; margin: 8px 0 12px; }
div.top p { margin: 4px 0; }
pre.fix { margin: 4px 0; padding: 6px 8px; background: #f5f5f5; border-radius: 3px; overflow-x: auto; }
pre.fix code { background: none; padding: 0; white-space: pre; word-break: normal; }
"""
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


# -- small formatting helpers ---------------------------------------------------------------------------
def _num(v: Any, digits: int = 1, unit: str = "") -> str:
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return "n/a" if v is None else str(v)
    return f"{v:,.{digits}f}{unit}"


def _pct(v: Any, digits: int = 1) -> str:
    return "n/a" if not isinstance(v, (int, float)) else f"{v * 100:.{digits}f}%"


def _patch(patch: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (patch or {}).items())


def _patch_html(patch: dict[str, Any] | None) -> str:
    """A config patch as one `knob=value` per line, never broken inside one."""
    if not patch:
        return "none"
    return "<br>".join(f'<code class="kv">{esc(f"{k}={v}")}</code>' for k, v in patch.items())


def _table(headers: Iterable[str], rows: Iterable[Iterable[str]], numeric: Iterable[int] = (), cls: str = "") -> str:
    """Headers are escaped here; cells must already be HTML (escape text with esc)."""
    num = set(numeric)
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="num">{c}</td>' if i in num else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _kv(pairs: Iterable[tuple[str, Any]]) -> str:
    """A two-column table of label and value (both escaped here); pairs without a value are left out."""
    rows = "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>" for k, v in pairs if v not in (None, ""))
    return f"<table><tbody>{rows}</tbody></table>"


def _page(title: str, subtitle: str, body: list[str]) -> str:
    from vlmdoctor import __version__

    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body><main>\n"
        f'<h1>{esc(title)}</h1><p class="sub">{esc(subtitle)}</p>\n'
        + "\n".join(b for b in body if b)
        + f"\n<footer>written by vlmdoctor {esc(__version__)}; a self-contained file: no script, nothing "
        "fetched.</footer>\n</main></body></html>\n"
    )


# -- charts ---------------------------------------------------------------------------------------------
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
        f'<text x="{X0}" y="18" font-size="14" fill="{INK}">one traced step: {esc(_num(step))} ms '
        f"(host wall time, mean of the traced window); GPU busy {esc(_pct(busy / step, 0))}</text>",
    ]
    x = float(X0)
    for label, ms, color in segs:
        w = BAR_W * ms / total
        if w <= 0:
            continue
        out.append(
            f'<rect x="{x:.2f}" y="{BAR_Y}" width="{w:.2f}" height="{BAR_H}" fill="{color}">'
            f"<title>{esc(label)}: {esc(_num(ms))} ms ({esc(_pct(ms / step))} of the step)</title></rect>"
        )
        if w > 70:
            out.append(
                f'<text x="{x + 5:.1f}" y="{BAR_Y + 27}" font-size="13" fill="#fff">{esc(_num(ms, 0))} ms</text>'
            )
        x += w
    # legend: two columns
    y0 = BAR_Y + BAR_H + 24
    for i, (label, ms, color) in enumerate(segs):
        col, row = i % 2, i // 2
        lx, ly = X0 + col * 540, y0 + row * 22
        out.append(f'<rect x="{lx}" y="{ly - 11}" width="12" height="12" fill="{color}"/>')
        out.append(
            f'<text x="{lx + 18}" y="{ly}" font-size="13" fill="{INK}">{esc(label)}: {esc(_num(ms))} ms '
            f"({esc(_pct(ms / step))})</text>"
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
        f"(total {esc(_num(facts.get('gpu.busy_ms') or sum(r[1] for r in rows)))} ms busy)</text>",
    ]
    for i, (cls, ms, count, share) in enumerate(rows):
        y = 30 + i * ROW_H
        w = max(1.0, BAR_MAX * ms / peak)
        out.append(f'<text x="{LABEL_W}" y="{y + 15}" font-size="13" text-anchor="end" fill="{INK}">{esc(cls)}</text>')
        out.append(
            f'<rect x="{BAR_X}" y="{y + 3}" width="{w:.1f}" height="{ROW_H - 7}" fill="{_kernel_color(cls)}">'
            f"<title>{esc(cls)}: {esc(_num(ms, 2))} ms, {esc(_num(count, 0))} kernels</title></rect>"
        )
        detail = f"{_num(ms)} ms · {_pct(share)} · {_num(count, 0)} kernels"
        out.append(f'<text x="{BAR_X + w + 8:.1f}" y="{y + 15}" font-size="12" fill="{INK}">{esc(detail)}</text>')
    out.append("</svg>")
    return "".join(out)


def _failed(outcome: str | None) -> bool:
    return outcome not in ("kept", "no_gain", "harmful")


def ladder_svg(result: dict[str, Any]) -> str:
    """One bar per kept step (real tokens/s; speedup over the start on top, the change below); trials not
    kept drawn at the rung they were tried from: grey dot at what they measured, red cross when they failed."""
    ladder, trials = result.get("ladder") or [], result.get("trials") or []
    if not ladder:
        return '<p class="warn">The start config did not run: no ladder.</p>'
    values = [float(r.get("real_tokens_per_s") or 0) for r in ladder]
    values += [float(t["real_tokens_per_s"]) for t in trials if t.get("real_tokens_per_s")]
    values += [float(v) for r in ladder for v in r.get("tokens_per_s_repeats") or []]  # the whiskers
    peak = max(values + [1.0]) * 1.08
    tick = _nice(peak / 5)
    ticks = max(1, math.ceil(peak / tick))
    top = tick * ticks
    W, LEFT, RIGHT, TOP, PLOT_H = 1100, 80, 20, 40, 300
    n = len(ladder)
    slot = (W - LEFT - RIGHT) / n
    width = max(8, int(slot / 7.5))
    rows = max(len(_wrap(str(r.get("change") or ""), width, 3)) for r in ladder)
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
            f"{esc(_num(v, 0))}</text>"
        )
    for i, r in enumerate(ladder):
        v = float(r.get("real_tokens_per_s") or 0)
        x0, w = LEFT + i * slot + slot * 0.18, slot * 0.5
        cx = x0 + w / 2
        reps = r.get("tokens_per_s_repeats") or []
        tip = f"step {r.get('step')}: {r.get('change')} ({_num(v, 0)} tokens/s, x{_num(r.get('speedup'), 2)})"
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
            f'font-weight="600" text-anchor="middle" fill="{INK}">x{esc(_num(r.get("speedup"), 2))}</text>'
        )
        label = str(r.get("change") or "")
        parts = _wrap(label, width, 3)
        for j, part in enumerate(parts):
            out.append(
                f'<text x="{cx:.1f}" y="{y(0) + 18 + j * 15:.1f}" font-size="12" text-anchor="middle" '
                f'fill="{INK}">{esc(part)}</text>'
            )
        out.append(
            f'<text x="{cx:.1f}" y="{y(0) + 18 + len(parts) * 15:.1f}" font-size="11" text-anchor="middle" '
            f'fill="#616161">{esc(_num(v, 0))} tokens/s</text>'
        )
    rung, seen_at = 0, {}
    for t in trials:  # a trial is tried from the rung kept before it
        if t.get("outcome") in ("kept", "adopted"):
            rung += 1
            continue
        k = seen_at.get(rung, 0)
        seen_at[rung] = k + 1
        cx = LEFT + rung * slot + slot * (0.78 + 0.07 * (k % 3))
        v = t.get("real_tokens_per_s")
        tip = f"trial {t.get('trial')}: {t.get('rule')} ({_patch(t.get('config_patch'))}): {t.get('outcome')}" + (
            f", {_num(v, 0)} tokens/s" if v else (f": {t.get('error')}" if t.get("error") else "")
        )
        if v and not _failed(t.get("outcome")):
            out.append(
                f'<circle cx="{cx:.1f}" cy="{y(v):.1f}" r="6" fill="{REJECTED}" stroke="#fff"><title>{esc(tip)}'
                "</title></circle>"
            )
            out.append(
                f'<text x="{cx:.1f}" y="{y(v) - 9:.1f}" font-size="10" text-anchor="middle" fill="#616161">'
                f"t{esc(str(t.get('trial')))}</text>"
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
                f"t{esc(str(t.get('trial')))}</text>"
            )
    ly = H - 14
    out.append(
        f'<rect x="{LEFT}" y="{ly - 10}" width="12" height="12" fill="{KEPT}"/>'
        f'<text x="{LEFT + 18}" y="{ly}" font-size="12" fill="{INK}">kept (whisker: spread of the repeats)</text>'
        f'<circle cx="{LEFT + 306}" cy="{ly - 4}" r="6" fill="{REJECTED}"/>'
        f'<text x="{LEFT + 318}" y="{ly}" font-size="12" fill="{INK}">tried, not kept (no gain or harmful)</text>'
        f'<g stroke="{FAILED}" stroke-width="3"><line x1="{LEFT + 580}" y1="{ly - 10}" x2="{LEFT + 592}" '
        f'y2="{ly + 2}"/><line x1="{LEFT + 580}" y1="{ly + 2}" x2="{LEFT + 592}" y2="{ly - 10}"/></g>'
        f'<text x="{LEFT + 600}" y="{ly}" font-size="12" fill="{INK}">failed: OOM, crash, timeout or refused'
        "</text>"
    )
    out.append("</svg>")
    return "".join(out)


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


# -- sections -------------------------------------------------------------------------------------------
def _gain(g: dict[str, Any] | None) -> str:
    if not g:
        return "n/a"
    parts = []
    if g.get("throughput_x"):
        parts.append(f"<b>x{esc(_num(g['throughput_x'], 2))}</b> throughput")
    if g.get("saves_ms_per_step"):
        s = f"saves {esc(_num(g['saves_ms_per_step']))} ms/step"
        if g.get("share_of_step"):
            of = f"the {_num(g['step_ms'])} ms traced step" if g.get("step_ms") else "the traced step"
            s += f" ({esc(_pct(g['share_of_step'], 0))} of {esc(of)})"
        parts.append(s)
    text = "<br>".join(parts) or "not estimated"
    if g.get("how"):
        text += f'<div class="how">{esc(str(g["how"]))}</div>'
    return text


def by_gain(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Biggest expected win first (`rank`); a report older than ranks is ordered by its gains the same way."""
    from vlmdoctor.doctor.rules import gain_ratio

    def key(i_f: tuple[int, dict[str, Any]]) -> tuple:
        i, f = i_f
        if isinstance(f.get("rank"), int):
            return (0, f["rank"], i)
        ratio = gain_ratio(f.get("expected_gain"))
        return (1, ratio is None, -(ratio or 0.0), i)

    return [f for _, f in sorted(enumerate(findings), key=key)]


def _apply_cell(f: dict[str, Any]) -> str:
    order = f.get("apply_order")
    where = f"layer {esc(str(f.get('layer', '')))} {esc(str(f.get('layer_name', '')))}"
    return (f"<b>{esc(str(order))}</b> ({where})" if order is not None else where) if f.get("layer") else ""


def top_finding(findings: list[dict[str, Any]] | None) -> str:
    """The first screen's line: the biggest expected win, its gain and its fix."""
    if not findings:
        return ""
    f = by_gain(findings)[0]
    gain = _gain(f.get("expected_gain")).split('<div class="how">')[0].replace("<br>", "; ")
    patch = f.get("config_patch") or {}
    return (
        '<p class="top">Biggest expected win: '
        f"<b>{esc(str(f.get('title', '')))}</b> <code>{esc(str(f.get('id', '')))}</code>, {gain}"
        f" ({esc(str(f.get('severity', '')))}).<br>Fix: {esc(str(f.get('fix', '')))}"
        + (" " + _patch_html(patch) if patch else "")
        + (f' <span class="note">({len(findings) - 1} more below)</span>' if len(findings) > 1 else "")
        + "</p>"
    )


#: how to read a findings table (the console's and both pages' order)
ORDER_NOTE = (
    '<p class="note">Biggest expected win first; apply the fixes in the order of the "apply" column '
    "(the layer: precision, batching, data layout, kernel fusion, system tuning).</p>"
)


def finding_seen(f: dict[str, Any], severity: bool = True) -> str:
    """A finding's title, id (and severity) over its evidence: the 'what was seen' cell of both pages."""
    return (
        f"<b>{esc(str(f.get('title', '')))}</b> <code>{esc(str(f.get('id', '')))}</code>"
        + (f' <span class="note">({esc(str(f["severity"]))})</span>' if severity and f.get("severity") else "")
        + '<ul class="ev">'
        + "".join(f"<li>{esc(str(e))}</li>" for e in f.get("evidence") or [])
        + "</ul>"
    )


def findings_section(
    findings: list[dict[str, Any]] | None,
    diagnosis: dict[str, Any] | None = None,
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
            change = esc(str(f.get("fix", "")))
            patch = _patch_html(f.get("config_patch"))
            rows.append((str(n), _apply_cell(f), seen, change, patch, _gain(f.get("expected_gain"))))
        out.append(
            _table(
                ("#", "apply", "what was seen", "change", "config patch", "expected gain"),
                rows,
                cls="wide findings",
            )
        )
    out.append(diagnosis_notes(diagnosis))
    return "".join(out)


def diagnosis_notes(diagnosis: dict[str, Any] | None) -> str:
    """What the rules did besides prescribing: muted findings, superseded ones, rules not evaluated."""
    out: list[str] = []
    if diagnosis and diagnosis.get("muted"):
        out.append(
            '<p class="note">muted: '
            + ", ".join(
                f"<code>{esc(str(m.get('id')))}</code> ({_gain(m.get('expected_gain')).split('<div')[0]}; "
                f"{esc(str(m.get('severity')))}; by {esc(str(m.get('muted_by')))})"
                for m in diagnosis["muted"]
            )
            + "</p>"
        )
    if diagnosis:
        notes = [
            f"superseded: <code>{esc(s['id'])}</code> (covered by <code>{esc(str(s.get('superseded_by')))}</code>)"
            for s in diagnosis.get("superseded") or []
        ]
        notes += [
            f"not evaluated: <code>{esc(s['id'])}</code> (needs {esc(', '.join(s.get('missing') or []))}"
            + (f"; record with {esc(s['hint'])}" if s.get("hint") else "")
            + ")"
            for s in diagnosis.get("not_evaluated") or []
        ]
        notes += [f"rule problem: {esc(str(p))}" for p in diagnosis.get("problems") or []]
        if notes:
            out.append(
                '<details><summary>rules that did not prescribe</summary><ul class="note">'
                + "".join(f"<li>{n}</li>" for n in notes)
                + "</ul></details>"
            )
    return "".join(out)


def _env_section(pairs: list[tuple[str, Any]], note: str = "") -> str:
    body = _kv(pairs)
    return "<h2>Environment</h2>" + body + (f'<p class="note">{esc(note)}</p>' if note else "")


def _report_env(env: dict[str, Any]) -> list[tuple[str, Any]]:
    gpu = env.get("gpu")
    if gpu and env.get("gpu_count", 1) and env.get("gpu_count", 1) > 1:
        gpu = f"{gpu} x{env['gpu_count']}"
    return [
        ("GPU", gpu or f"none (CPU, {env.get('cpu_count')} cores)"),
        ("GPU memory", _num(env.get("gpu_mem_total_gb"), 1, " GiB") if env.get("gpu_mem_total_gb") else None),
        ("compute capability", env.get("compute_capability")),
        ("driver", env.get("driver")),
        ("CUDA", env.get("cuda")),
        ("cuDNN", env.get("cudnn")),
        ("torch", env.get("torch")),
        ("transformers", env.get("transformers")),
        ("liger-kernel", env.get("liger_kernel")),
        ("triton", env.get("triton")),
        ("python", env.get("python")),
        ("platform", env.get("platform")),
        ("CPU cores", env.get("cpu_count")),
    ]


def _facts_sections(facts: dict[str, Any]) -> list[str]:
    """Charts and tables of one trace's facts."""
    out = ["<h2>Step time: GPU busy and idle by cause</h2>", step_split_svg(facts)]
    for w in facts.get("trace.warnings") or []:
        out.append(f'<p class="warn">partial analysis: {esc(str(w))}</p>')
    ops = facts.get("idle.top_host_ops") or []
    if ops:
        out.append("<h3>Host work while the GPU waited (per step)</h3>")
        out.append(
            _table(
                ("innermost host op / runtime call", "ms", "share of idle"),
                [
                    (
                        f"<code>{esc(str(r.get('op', ''))[:90])}</code>",
                        esc(_num(r.get("ms"))),
                        esc(_pct(r.get("share"), 0)),
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
        rows.append(("GPU time by model part", ", ".join(f"{p} {_num(facts[f'part.{p}.ms'])} ms" for p in parts)))
    if phases:
        rows.append(("by phase", ", ".join(f"{p} {_num(facts[f'phase.{p}.ms'])} ms" for p in phases)))
    if "recompute.kind" in facts:
        rows.append(
            (
                "checkpoint recompute",
                f"{facts['recompute.kind']} ({_pct(facts.get('recompute.share'))} of GPU time)",
            )
        )
    if "launch.kernels" in facts:
        rows.append(
            (
                "launches",
                f"{_num(facts['launch.kernels'], 0)} kernels/step, "
                f"{_pct(facts.get('launch.tiny_kernel_frac'), 0)} under 10 µs, launch API "
                f"{_num(facts.get('launch.api_ms'))} ms/step, launch-to-start median "
                f"{_num(facts.get('launch.delay_us_median'))} µs",
            )
        )
    if "gemm.fp32_share" in facts:
        rows.append(
            (
                "GEMMs",
                f"{_num(facts.get('gemm.ms'))} ms; FP32 without tensor cores "
                f"{_pct(facts['gemm.fp32_share'])} of GEMM time",
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
        rows.append(("logits", f"{_num(facts['loss.logits_gb'], 2)} GB ({facts.get('loss.logits_dtype')})"))
    if facts.get("host.sync_calls"):
        rows.append(("host syncs", f"{_num(facts['host.sync_calls'], 0)} per step"))
    if rows:
        out.append("<h3>Where the GPU time went</h3>" + _kv(rows))
    return out


def _facts_metrics(facts: dict[str, Any]) -> list[tuple[str, Any]]:
    busy = facts.get("measured.gpu.busy_frac", facts.get("gpu.busy_frac"))  # the untraced run's, where measured
    reserved = facts.get("measured.memory.peak_reserved_gb", facts.get("memory.peak_reserved_gb"))
    return [
        ("steps traced", facts.get("trace.steps")),
        ("step (median)", _num(facts.get("step.ms"), 1, " ms") if "step.ms" in facts else None),
        ("GPU busy", f"{_pct(busy, 0)} ({_num(facts.get('gpu.busy_ms'))} ms)" if busy is not None else None),
        ("GPU idle", _num(facts.get("gpu.idle_ms"), 1, " ms") if "gpu.idle_ms" in facts else None),
        ("model", facts.get("run.model")),
        ("stage", facts.get("run.stage")),
        (
            "MFU (upper bound from the trace)",
            _pct(facts["mfu.upper_bound"], 2) if "mfu.upper_bound" in facts else None,
        ),
        ("MFU (measured)", _pct(facts["mfu"], 2) if isinstance(facts.get("mfu"), (int, float)) else None),
        (
            "peak memory reserved",
            _num(reserved, 2, " GiB") if reserved is not None else None,
        ),
    ]


def _measurement_notes(report: dict[str, Any]) -> list[str]:
    """An unstable or unsettled window said plainly, and the split of the traced step with its shares."""
    from vlmdoctor.report.console import measurement_notes

    out = [f'<p class="warn">{esc(line)}</p>' for line in measurement_notes(report)]
    sp = report.get("split")
    if sp:
        timed = (report.get("metrics") or {}).get("step_ms")
        out.append(
            f'<h2>Time split of the traced step</h2><p class="note">one traced step of {esc(_num(sp["step_ms"]))} ms'
            f" ({esc(sp['basis'])}); shares of that step, from the traced window"
            + (f", not of the timed median step ({esc(_num(timed))} ms)" if timed else "")
            + "</p>"
        )
        out.append(
            _table(
                ("part", "ms per traced step", "share"),
                [(esc(r["part"]), esc(_num(r["ms"])), esc(_pct(r["share"], 0))) for r in sp["rows"]],
                numeric=(1, 2),
            )
        )
        if sp.get("note"):
            out.append(f'<p class="note">{esc(sp["note"])}</p>')
    return out


# -- pages ----------------------------------------------------------------------------------------------
def profile_html(report: dict[str, Any]) -> str:
    """A `vlmdoctor profile --json` report as one HTML page (a report of the user's own training: own_html)."""
    from vlmdoctor.report.own_html import is_own, own_html

    if is_own(report):
        return own_html(report)
    cfg, env, model = report.get("config") or {}, report.get("env") or {}, report.get("model") or {}
    where = env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"
    title = f"vlmdoctor profile: {cfg.get('model')} stage {cfg.get('stage')} on {where}"
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
        from vlmdoctor.report.console import _changed_knobs

        changed = _changed_knobs(cfg) if cfg else []
    except Exception:  # an unknown knob in an older report: list none rather than fail the page
        changed = []
    body.append(
        "<p>knobs changed from the default: "
        + (esc(", ".join(changed)) if changed else "none (the default config)")
        + "</p>"
    )
    m, stats = report.get("metrics") or {}, report.get("stats") or {}
    if m:

        def spread(key: str, digits: int = 0) -> str:
            s = stats.get(key)
            return f"{_num(s['min'], digits)} .. {_num(s['max'], digits)}" if s and s.get("n", 0) >= 2 else ""

        tp = report.get("throughput") or {}
        fps = m.get("flops_per_step")
        rows = [
            (
                "real tokens/s",
                _num(throughput.headline(report), 0),
                throughput.spread_text(tp) or spread("real_tokens_per_s"),
            ),
            ("loss tokens/s", _num(m.get("loss_tokens_per_s"), 0), spread("loss_tokens_per_s")),
            ("pad fraction", _pct(m.get("pad_fraction")), ""),
            (
                "ms/step (median)",
                _num(m.get("step_ms")),
                f"p10 {_num(m.get('step_ms_p10'))} / p90 {_num(m.get('step_ms_p90'))}",
            ),
            ("MFU", _pct(m.get("mfu"), 2), "" if m.get("mfu") is not None else str(m.get("mfu_reason") or "")),
            ("model TFLOP/s", _num(m.get("model_tflops_per_s"), 2), ""),
        ]
        if fps:
            rows.append(("FLOPs/step", f"{fps / 1e9:,.2f} GFLOP", "counted on a real step"))
        if m.get("peak_mem_gb") is not None:
            rows.append(
                (
                    "peak memory allocated / reserved",
                    f"{_num(m.get('peak_mem_gb'), 2)} / {_num(m.get('peak_mem_reserved_gb'), 2)} GiB",
                    f"of {_num(m.get('device_mem_total_gb'))} GiB",
                )
            )
        elif m.get("host_peak_rss_gb") is not None:
            rows.append(("host peak RSS", _num(m.get("host_peak_rss_gb"), 2, " GiB"), ""))
        rows.append(
            (
                "final loss",
                _num(m.get("final_loss"), 4) + ("" if m.get("loss_finite", True) else " (not finite)"),
                "",
            )
        )
        body.append("<h2>Metrics</h2>")
        body.append(
            _table(
                (
                    "metric",
                    "value",
                    f"spread over {m.get('repeats')} repeat(s) x {m.get('steps_per_repeat')} steps",
                ),
                [tuple(esc(str(c)) for c in r) for r in rows],
                numeric=(1, 2),
            )
        )
    body.extend(_measurement_notes(report))
    tr = report.get("trace")
    if tr:
        traced = sorted(tr.get("traced_step_ms") or [0])[len(tr.get("traced_step_ms") or [0]) // 2]
        body.append(
            f'<p class="note">trace: {esc(str(tr.get("path") or "analyzed, not kept"))} ({esc(str(tr.get("steps")))}'
            f" steps; traced step {esc(_num(traced))} ms vs untraced median {esc(_num(m.get('step_ms')))} ms)</p>"
        )
    facts = report.get("facts")
    if facts and "trace.error" not in facts:
        body.extend(_facts_sections(facts))
    else:
        body.append('<p class="note">No trace facts in this report, so no step split and no kernel classes.</p>')
    body.append(findings_section(findings, diagnosis))
    body.append(_env_section(_report_env(env)))
    if cfg:
        body.append("<details><summary>full run config</summary>" + _kv(sorted(cfg.items())) + "</details>")
    return _page(title, subtitle, body)


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
        body.append("<h2>Summary</h2>" + _kv(_facts_metrics(facts)))
        body.extend(_facts_sections(facts))
        body.append(findings_section(findings if findings is not None else [], diagnosis))
        props = (meta.get("deviceProperties") or [{}])[0] if isinstance(meta.get("deviceProperties"), list) else {}
        env = entry.get("env") or result.get("env") or {}
        card = facts.get("memory.device_total_gb") or facts.get("measured.memory.device_total_gb")
        pairs = [
            ("GPU", facts.get("device.name") or props.get("name") or env.get("gpu")),
            (
                "GPU memory",
                _num(card, 1, " GiB") if card else None,
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
        body.append(_env_section(pairs, note))
    if result.get("cross_rank"):
        body.append(_cross_rank_section(result["cross_rank"]))
    return _page(title, subtitle, body)


def _cross_rank_section(cross: dict[str, Any]) -> str:
    """The ranks of a folder side by side: wait for late ranks, busy time, tokens, communication; and its findings."""
    if "skipped" in cross:
        return f"<h2>Cross-rank</h2><p>{esc(str(cross['skipped']))}</p>"
    f = cross.get("facts") or {}
    parts = [
        f"<h2>Cross-rank: {esc(str(f.get('dist.ranks')))} ranks of {esc(str(f.get('dist.world_size')))}, "
        f"{esc(str(f.get('dist.parallel')))} over {esc(str(f.get('dist.backend')))}</h2>"
    ]
    parts += [f'<p class="warn">{esc(n)}</p>' for n in cross.get("notes") or []]
    keys = (
        "step_ms",
        "wait_ms",
        "busy_ms",
        "tokens",
        "loader_ms",
        "gap_ms",
        "comm_ms",
        "exposed_ms",
        "hidden_ms",
    )
    parts.append(
        _table(
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
                [esc(str(r.get("rank")))] + [_num(r.get(k), 0 if k == "tokens" else 1) for k in keys]
                for r in cross.get("ranks") or []
            ],
            numeric=range(10),
        )
    )
    hta = cross.get("hta") or {}
    overlap = "; ".join(
        f"rank {r}: {_num(v, 1, '%')} vs {_num((hta.get('ours_overlap_pct') or {}).get(r), 1, '%')}"
        for r, v in sorted((hta.get("overlap_pct") or {}).items())
    ) or hta.get("skipped")
    parts.append(
        _kv(
            [
                ("slowest rank", f.get("dist.straggler.rank")),
                ("cause", f.get("dist.straggler.cause")),
                (
                    "busy-time skew",
                    _pct(f.get("dist.step_skew_frac")) if "dist.step_skew_frac" in f else None,
                ),
                (
                    "wait for late ranks, ms/step",
                    _num(f.get("dist.late_wait_ms")) if "dist.late_wait_ms" in f else None,
                ),
                (
                    "exposed communication less the wait, ms/step",
                    _num(f.get("dist.comm.exposed_own_ms")) if "dist.comm.exposed_own_ms" in f else None,
                ),
                ("overlap, traceinsight vs vlmdoctor", overlap),
            ]
        )
    )
    if cross.get("diagnosis") is not None:
        parts.append(findings_section(cross.get("findings") or [], cross["diagnosis"]))
    return "\n".join(parts)


def treat_html(result: dict[str, Any]) -> str:
    """A treat result (treat.json) as one HTML page: the ladder chart, the kept steps, the trials not kept
    (with the decision's numbers) and the final config."""
    cfg = result.get("start_config") or {}
    trials = result.get("trials") or []
    title = f"vlmdoctor treat: {cfg.get('model')} stage {cfg.get('stage')}"
    subtitle = f"{len(trials)} trial(s); stopped: {result.get('stopped_because')}; {result.get('created_at', '')}" + (
        f"; {_num(result.get('wall_s'), 0)} s" if result.get("wall_s") else ""
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
        rows = []
        for r in ladder:
            reps = r.get("tokens_per_s_repeats") or []
            spread = f" ({_num(min(reps), 0)}-{_num(max(reps), 0)})" if len(reps) > 1 else ""
            rows.append(
                (
                    esc(str(r.get("step"))),
                    esc(str(r.get("change"))),
                    f"<code>{esc(str(r['rule']))}</code>" if r.get("rule") else "",
                    esc(_num(r.get("real_tokens_per_s"), 0) + spread),
                    esc("x" + _num(r.get("speedup"), 2)),
                    esc(_num(r.get("step_ms"))),
                    esc(_pct(r.get("mfu"), 2) if r.get("mfu") else "n/a"),
                    esc(_num(r.get("peak_mem_gb"))),
                )
            )
        body.append(
            _table(
                ("#", "change", "rule", "real tokens/s (repeats)", "x start", "ms/step", "MFU", "peak GiB"),
                rows,
                numeric=(0, 3, 4, 5, 6, 7),
            )
        )
    if trials:
        rows = []
        for t in trials:
            outcome = str(t.get("outcome"))
            cls = "kept" if outcome == "adopted" else outcome if outcome in ("kept", "no_gain", "harmful") else "failed"
            if "ratio" in t:
                measured = esc(_paired(t))
            elif "gain" in t:  # a treat.json of the first treat: gain against the spread-based margin
                measured = f"{t['gain'] * 100:+.1f}% vs ±{(t.get('margin') or 0) * 100:.1f}%"
            elif t.get("ratios"):  # the time cut the comparison short: the pairs it did measure
                measured = esc(", ".join(f"x{r:.2f}" for r in t["ratios"]) + f": {t.get('why') or ''}")
            else:  # a failed arm: why it failed; an ablation's says what that means for the change it left out
                measured = esc(": ".join(str(x) for x in (t.get("why"), t.get("error")) if x))
            rows.append(
                (
                    esc(str(t.get("trial"))),
                    f"{esc(str(t.get('layer', '')))}",
                    f"<b>{esc(str(t.get('title') or ''))}</b><br><code>{esc(str(t.get('rule')))}</code>",
                    _patch_html(t.get("config_patch")),
                    _gain(t.get("expected_gain")),
                    esc(_num(t.get("real_tokens_per_s"), 0)),
                    measured,
                    f'<span class="badge {cls}">{esc(outcome)}</span>',
                )
            )
        body.append("<h2>Trials, in the order tried</h2>")
        body.append(
            _table(
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
        )
    dec = result.get("decision") or {}
    if dec.get("rule"):
        body.append(
            f'<p class="note">decision: {esc(str(dec["rule"]))} (min gain {esc(_pct(dec.get("min_gain"), 0))})</p>'
        )
    skipped = result.get("skipped") or []
    if skipped:
        body.append(
            "<h3>Skipped prescriptions</h3><ul>"
            + "".join(
                f"<li><code>{esc(str(s.get('rule')))}</code> (<code>{esc(_patch(s.get('config_patch')))}</code>): "
                f"{esc(str(s.get('why')))}</li>"
                for s in skipped
            )
            + "</ul>"
        )
    final = result.get("final_config") or {}
    changed = {k: v for k, v in final.items() if cfg.get(k) != v and k != "source"}
    body.append(
        "<h2>Final config</h2><p>changed from the start: "
        + (f"<code>{esc(_patch(changed))}</code>" if changed else "nothing")
        + "</p>"
    )
    if (result.get("outputs") or {}).get("config"):
        body.append(f"<p>run it again: <code>vlmdoctor profile --config {esc(result['outputs']['config'])}</code></p>")
    body.append(_env_section(_report_env(result.get("env") or {})))
    if cfg:
        body.append("<details><summary>start config</summary>" + _kv(sorted(cfg.items())) + "</details>")
    return _page(title, subtitle, body)


def _paired(t: dict[str, Any]) -> str:
    """x1.23 [1.10-1.38] (3): the paired ratio, its interval and the pairs it rests on."""
    lo, hi = t.get("ci_low"), t.get("ci_high")
    ci = f" [{lo:.2f}-{hi:.2f}]" if lo is not None and hi is not None and hi != float("inf") else ""
    return f"x{t['ratio']:.2f}{ci} ({t.get('pairs')})"


def write_html(text: str, path: Path, force: bool = False) -> None:
    """Write a page through the one writer (atomic, regular files only); an existing file only with `force`."""
    from vlmdoctor.files import write_text

    target = Path(path)
    if target.exists() and not force:
        raise UsageError(f"{target} exists; pass --force to overwrite it")
    if target.is_dir():
        raise UsageError(f"{target} is a folder; give a file name ending in .html")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text(target, text)
