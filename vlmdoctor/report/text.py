"""Text for the terminal, whatever the inputs hold: the console every vlmdoctor command prints through, and numbers
as the tables show them.

Text is text. Names, paths and messages come from traces, reports, rule files and the command line, so
whatever they hold is shown, never acted on: every console vlmdoctor prints through is a `SafeConsole`
(control characters become visible escapes, no hyperlinks, markup that does not parse is shown as it is),
and data placed inside a markup string goes through `esc` (its `[` shown, not read as a style).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any

from rich.console import Console
from rich.errors import MarkupError
from rich.segment import Segment
from rich.text import Text

from vlmdoctor import files

#: what a terminal acts on instead of showing: C0 controls but the newline (ESC starts clear-screen, window
#: title and OSC 8 hyperlink sequences), DEL, C1 controls (CSI and OSC as one byte), and the Unicode bidi
#: controls that reorder what is shown
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def plain(value: Any) -> str:
    """Any value as text a terminal only shows: each control character as its visible escape (\\x1b, \\u202e)."""
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))


#: a `[` with the backslashes before it, and whether Rich would read a tag there (rich.markup.RE_TAGS)
_BRACKET = re.compile(r"(\\*)\[")


_TAG_AT = re.compile(r"\[[a-z#/@][^[]*?]")


def _bracket(m: re.Match[str]) -> str:
    slashes = m.group(1)
    if _TAG_AT.match(m.string, m.end() - 1):  # a tag: each backslash doubled, and one to escape it (as escape())
        return slashes * 2 + "\\["
    return slashes + ("\\" if slashes else "") + "["  # Rich turns a plain backslash-bracket into a bracket


def esc(value: Any) -> str:
    """A value from a trace, report, rule or path, for a markup string: `plain`, and every `[` and backslash
    shown as written (rich.markup.escape leaves a backslash before a `[` that opens no tag to be eaten)."""
    text = _BRACKET.sub(_bracket, plain(value))
    tail = len(text) - len(text.rstrip("\\"))
    return text + "\\" * tail  # backslashes at the end must not escape the tag that follows


def _shown(segments: Iterable[Segment]) -> Iterator[Segment]:
    for seg in segments:
        if seg.control:  # rich's own cursor moves (progress bars), never text from an input
            yield seg
            continue
        style = seg.style.update_link(None) if seg.style is not None and seg.style.link else seg.style
        yield Segment(plain(seg.text) if CONTROL.search(seg.text) else seg.text, style)


class _Guarded:
    """A console's stream that printing can never fail on after the work: text its encoding cannot hold (an
    ASCII-only stdout) is shown replaced, and a reader that went away ends the printing, not the command."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except UnicodeEncodeError:
            encoding = getattr(self._stream, "encoding", None) or "ascii"
            return self._stream.write(text.encode(encoding, "replace").decode(encoding))
        except BrokenPipeError:
            files.reader_gone(self._stream)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            files.reader_gone(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class SafeConsole(Console):
    """The console every vlmdoctor command, `Doctor` and `vlmdoctor run` print through: the boundary where text
    from inputs meets the terminal. Control characters in any text become visible escapes, hyperlinks are
    dropped (vlmdoctor prints none), emoji codes stay text, and markup that does not parse is printed as it
    is, so that printing never fails after the work is done (nor does a stream that cannot encode a character,
    or a reader that went away: `_Guarded`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("emoji", False)
        super().__init__(*args, **kwargs)

    @property
    def file(self) -> Any:
        stream = Console.file.fget(self)  # type: ignore[attr-defined]  # sys.stdout as it is now, unless given
        guard = self.__dict__.get("_guard")
        if guard is None or guard._stream is not stream:  # one wrapper per stream, not one per write
            guard = self.__dict__["_guard"] = _Guarded(stream)
        return guard

    @file.setter
    def file(self, new_file: Any) -> None:
        Console.file.fset(self, new_file)  # type: ignore[attr-defined]

    def render_str(self, text: str, **kwargs: Any) -> Text:
        try:
            return super().render_str(text, **kwargs)
        except MarkupError:
            return super().render_str(text, **{**kwargs, "markup": False})

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(_shown(buffer))


def fmt_small(v: float | None, unit: str = "", digits: int = 2) -> str:
    """A rate that may be far below one (a tiny model's TFLOP/s): its significant digits, never "0.00"."""
    if isinstance(v, float) and v != 0 and abs(v) < 1:
        return f"{v:.{digits}g}{unit}"
    return fmt(v, unit, digits)


def fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{unit}"
    return f"{esc(v)}{unit}"


def fmt_ms(v: Any) -> str:
    return f"{v:,.1f}" if isinstance(v, (int, float)) else "n/a"


def fill(text: str, width: int, first: str = "", rest: str | None = None) -> str:
    """`text` broken at spaces to `width`, a name longer than a line left whole on its own line."""
    return textwrap.fill(
        plain(text),
        max(width, 20),
        initial_indent=first,
        subsequent_indent=first if rest is None else rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def print_text(console: Console, text: str, style: str | None = None) -> None:
    """Text already broken to the width: printed as it is (no markup, no further folding or cropping)."""
    console.print(text, style=style, markup=False, highlight=False, overflow="ignore", crop=False, soft_wrap=True)
