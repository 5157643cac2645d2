"""A page in a real headless browser (Debian's chromium): its screenshot is drawn, not blank, with no
script error and nothing the page's Content-Security-Policy had to block; kept under $VLMDOCTOR_ARTIFACTS."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
SKIP = "no headless browser: apt-get install chromium"


def check_in_browser(page: str, tmp_path: Path, kind: str) -> Path:
    """Screenshot `page` (1280x2000) and check it; returns the screenshot's path."""
    from PIL import Image

    from vlmdoctor.report.html import write_html

    html_path = tmp_path / f"{kind}.html"
    write_html(page, html_path, force=False)
    shot = tmp_path / f"{kind}.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--enable-logging=stderr",
        "--v=0",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
        html_path.as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert shot.is_file() and shot.stat().st_size > 10_000
    with Image.open(shot) as img:
        assert img.size == (1280, 2000)
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 1, "a blank screenshot"
        if colors:  # a page of charts and tables: many colours, and not almost all one
            assert len(colors) > 50
            assert max(c for c, _ in colors) < 0.97 * img.size[0] * img.size[1]
    console = [
        line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line or "Refused to" in line
    ]
    assert not console, console  # no script error, and nothing the page's CSP had to block
    artifacts = os.environ.get("VLMDOCTOR_ARTIFACTS")
    if artifacts:
        keep = Path(artifacts)
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, keep / f"html-{kind}.png")
        shutil.copy(html_path, keep / f"html-{kind}.html")
    return shot
