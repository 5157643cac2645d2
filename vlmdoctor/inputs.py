"""Checks every input kind shares: files the user names, and numbers on the command line.

Each failure is a UsageError (exit 2) of one line that names the flag or the file, so a bad
input never reaches the code that would have crashed on it.
"""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from typing import Any

from vlmdoctor.errors import UsageError

NAME_MAX = 255


def check_number(
    flag: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    integer: bool = False,
) -> None:
    """A finite number within bounds; the message names the flag and the allowed range."""
    if value is None:
        return
    bounds = []
    if above is not None:
        bounds.append(f"> {_num(above)}")
    if minimum is not None:
        bounds.append(f">= {_num(minimum)}")
    if below is not None:
        bounds.append(f"< {_num(below)}")
    if maximum is not None:
        bounds.append(f"<= {_num(maximum)}")
    what = ("an integer" if integer else "a finite number") + (" " + " and ".join(bounds) if bounds else "")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer and not isinstance(value, int):
        ok = False
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if ok:
        ok = (
            (above is None or value > above)
            and (minimum is None or value >= minimum)
            and (below is None or value < below)
            and (maximum is None or value <= maximum)
        )
    if not ok:
        raise UsageError(f"{flag} must be {what}, got {value!r}")


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def path_problem(path: Path) -> str | None:
    """Why a path cannot name a file at all (a name over 255 bytes), or None."""
    for part in Path(path).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            return f"a name in the path is longer than {NAME_MAX} bytes"
    return None


def read_bytes(path: str | os.PathLike, what: str = "file", max_bytes: int | None = None) -> bytes:
    """The bytes of a file the user named; every way this fails is one line naming it. A fifo or a
    device is refused (reading /dev/zero or a fifo would never end), and so is a file over max_bytes."""
    import stat

    p = Path(path)
    problem = path_problem(p)
    if problem:
        raise UsageError(f"{what} {_short(p)}: {problem}")
    if p.is_dir():
        raise UsageError(f"{what} {p}: is a folder, not a file")
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{what} {p}: not a regular file (a device or fifo cannot be read as one)")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UsageError(
                f"{what} {p}: {st.st_size / 2**20:.0f} MiB, more than the {max_bytes / 2**20:.0f} MiB a {what} can be"
            )
        return p.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{what} {p}: cannot read: no such file") from None
    except MemoryError:
        raise UsageError(f"{what} {p}: too big to read into memory") from None
    except OSError as e:
        why = "too long a path" if e.errno == errno.ENAMETOOLONG else (e.strerror or str(e))
        raise UsageError(f"{what} {_short(p)}: cannot read ({why})") from None


def decode(data: bytes, path: str | os.PathLike, what: str = "file") -> str:
    """UTF-8 text; an undecodable byte is reported with its line and column."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UsageError(
            f"{what} {_short(Path(path))}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, column {col})"
        ) from None


def read_text(path: str | os.PathLike, what: str = "file", max_bytes: int | None = None) -> str:
    return decode(read_bytes(path, what, max_bytes), path, what)


def check_rules_dirs(dirs: list[str]) -> None:
    """`--rules DIR`: an extra rule folder that is missing is a typo the user must hear about (exit 2)."""
    for d in dirs:
        p = Path(d)
        problem = path_problem(p)
        if problem:
            raise UsageError(f"--rules {_short(p)}: {problem}")
        if not p.exists():
            raise UsageError(f"--rules {d}: no such folder")
        if not p.is_dir():
            raise UsageError(f"--rules {d}: not a folder (give the folder that holds the rule files)")
        try:
            next(iter(os.scandir(p)), None)
        except OSError as e:
            raise UsageError(f"--rules {d}: cannot read the folder ({e.strerror})") from None


def _short(p: Path) -> str:
    text = str(p)
    return text if len(text) <= 120 else text[:60] + "..." + text[-40:]
