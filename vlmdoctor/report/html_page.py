"""The one HTML page builder (`page`) and its pieces: the page's CSS and Content-Security-Policy (no script,
nothing fetched), escaping, tables of cells and of labels and values, numbers as the pages show them."""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

from vlmdoctor import __version__

esc = html.escape


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


def fmt_num(v: Any, digits: int = 1, unit: str = "") -> str:
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return "n/a" if v is None else str(v)
    return f"{v:,.{digits}f}{unit}"


def text(v: Any) -> str:
    """A document's optional field as text: nothing where it is null."""
    return "" if v is None else str(v)


def fmt_pct(v: Any, digits: int = 1) -> str:
    return "n/a" if not isinstance(v, (int, float)) else f"{v * 100:.{digits}f}%"


def patch_text(patch: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (patch or {}).items())


def patch_html(patch: dict[str, Any] | None) -> str:
    """A config patch as one `knob=value` per line, never broken inside one."""
    if not patch:
        return "none"
    return "<br>".join(f'<code class="kv">{esc(f"{k}={v}")}</code>' for k, v in patch.items())


def html_table(
    headers: Iterable[str], rows: Iterable[Iterable[str]], numeric: Iterable[int] = (), cls: str = ""
) -> str:
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


def kv_table(pairs: Iterable[tuple[str, Any]]) -> str:
    """A two-column table of label and value (both escaped here); pairs without a value are left out."""
    rows = "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>" for k, v in pairs if v not in (None, ""))
    return f"<table><tbody>{rows}</tbody></table>"


def page(title: str, subtitle: str, body: list[str]) -> str:
    """The one page builder: every page is a title, a subtitle and its body's sections."""
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
