"""The treat ladder as a PNG step chart, drawn with Pillow (no plotting library needed)."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from PIL import Image, ImageDraw, ImageFont

from vlmdoctor.files import atomic_writer

W, H = 1000, 560
LEFT, RIGHT, TOP, BOTTOM = 90, 30, 60, 170
KEPT, REJECTED, FAILED, INK, GRID = (
    (46, 125, 50),
    (158, 158, 158),
    (198, 40, 40),
    (33, 33, 33),
    (224, 224, 224),
)


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one default size
        return ImageFont.load_default()


def ladder_png(result: dict[str, Any], path: Path | IO[bytes]) -> None:
    """One bar per kept step (real tokens/s, speedup over the start on top); trials that were not
    kept are dots at the height they measured (grey: no gain or harmful; red x: OOM or crash),
    drawn at the rung they were tried from."""
    ladder, trials = result["ladder"], result["trials"]
    values = [r["real_tokens_per_s"] or 0 for r in ladder]
    values += [t["real_tokens_per_s"] or 0 for t in trials if t.get("real_tokens_per_s")]
    top = max(values + [1.0]) * 1.15
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    f, small, big = _font(14), _font(12), _font(18)
    cfg = result["start_config"]
    d.text(
        (LEFT, 18),
        f"vlmdoctor treat: {cfg['model']} stage {cfg['stage']}, real tokens/s per kept step",
        fill=INK,
        font=big,
    )
    plot_h = H - TOP - BOTTOM
    y = lambda v: TOP + plot_h * (1 - v / top)  # noqa: E731
    for i in range(6):
        v = top * i / 5
        d.line([(LEFT, y(v)), (W - RIGHT, y(v))], fill=GRID)
        d.text((8, y(v) - 7), f"{v:,.0f}", fill=INK, font=small)
    n = len(ladder)
    slot = (W - LEFT - RIGHT) / max(n, 1)
    rung_of_trial = {}
    rung = 0
    for t in trials:  # a trial is tried from the rung kept before it
        rung_of_trial[t["trial"]] = rung
        if t.get("outcome") in ("kept", "adopted"):
            rung += 1
    for i, r in enumerate(ladder):
        x0, x1 = LEFT + i * slot + slot * 0.2, LEFT + (i + 1) * slot - slot * 0.2
        v = r["real_tokens_per_s"] or 0
        d.rectangle([x0, y(v), x1, y(0)], fill=KEPT)
        d.text((x0, y(v) - 18), f"x{r['speedup']:.2f}", fill=INK, font=f)
        label = r["change"] if len(r["change"]) <= 40 else r["change"][:37] + "..."
        _vertical_text(img, label, (int((x0 + x1) / 2) - 7, int(y(0)) + 6), small)
    for t in trials:
        if t.get("outcome") in ("kept", "adopted"):
            continue
        i = rung_of_trial[t["trial"]]
        cx = LEFT + (i + 1) * slot - slot * 0.12
        v = t.get("real_tokens_per_s")
        if v:
            d.ellipse([cx - 5, y(v) - 5, cx + 5, y(v) + 5], fill=REJECTED)
        else:
            yy = y(0) - 12
            d.line([(cx - 6, yy - 6), (cx + 6, yy + 6)], fill=FAILED, width=3)
            d.line([(cx - 6, yy + 6), (cx + 6, yy - 6)], fill=FAILED, width=3)
    d.text(
        (LEFT, H - 22),
        "green: kept; grey dot: tried, not kept (no gain or harmful); red x: OOM / crash / refused",
        fill=INK,
        font=small,
    )
    if isinstance(path, (str, Path)):
        with atomic_writer(path) as f:
            img.save(f, format="PNG")
    else:  # a file object (bytes in memory, written by the caller)
        img.save(path, format="PNG")


def _vertical_text(img: Image.Image, text: str, at: tuple[int, int], font) -> None:
    box = ImageDraw.Draw(img).textbbox((0, 0), text, font=font)
    layer = Image.new("RGBA", (box[2] + 4, box[3] + 4), (255, 255, 255, 0))
    ImageDraw.Draw(layer).text((2, 0), text, fill=INK, font=font)
    rotated = layer.rotate(90, expand=True)
    img.paste(rotated, (at[0], at[1]), rotated)
