"""Every file vlmdoctor writes goes through here: refused up front, written atomically, never lost.

The promises (docs/files.md):
- only regular files are written: a symlink, device, fifo or folder at the target is refused,
  never replaced (as root, `--json /dev/null --force` must not replace /dev/null);
- an existing file is replaced only with --force, and only once the new content is complete
  (temp file in the same folder, fsync, rename); the temp file is removed on any failure;
- every output path is checked before the work starts (`check_writable`);
- when the final write still fails (a full disk), the content is saved to a fallback file in
  the current folder or the temp folder, and the message names it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from vlmdoctor.errors import EXIT_FAILED_RUN, UsageError, VlmdoctorError

NAME_MAX = 255  # bytes in one path component on Linux/macOS file systems


class WriteError(VlmdoctorError):
    """An output file could not be written after the work was done (exit 1; the content is kept elsewhere)."""

    def __init__(self, message: str, fallback: Path | None = None) -> None:
        super().__init__(message, EXIT_FAILED_RUN)
        self.fallback = fallback


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def check_distinct(**outputs: str | os.PathLike | None) -> None:
    """Two outputs of one command on the same file would leave only the last one: refuse it up front.

    Keywords are the flags without dashes (`json=..., html=...`); '-' (standard output) and None are skipped.
    """
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None or str(path) in ("", "-"):
            continue
        key = os.path.realpath(os.path.abspath(os.fspath(path)))
        name = "--" + flag.replace("_", "-")
        if key in seen:
            raise UsageError(f"{seen[key]} and {name} name the same file ({path}); give each output its own path")
        seen[key] = name


def _check_names(p: Path, label: str) -> None:
    for part in p.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise UsageError(f"{label}: a name in the path is longer than {NAME_MAX} bytes")


def check_writable(path: str | os.PathLike | None, force: bool, flag: str = "") -> None:
    """Refuse up front, before minutes of GPU time are spent, any output path the write would fail on
    or that would replace something it must not: a non-regular file, an existing file without --force,
    a missing or read-only folder, a name too long."""
    if path is None or str(path) in ("", "-"):
        return
    label = f"{flag} {path}" if flag else str(path)
    p = Path(path)
    _check_names(p, label)
    try:
        st = os.lstat(p)
    except (
        FileNotFoundError,
        NotADirectoryError,
    ):  # a missing name, or a file where a folder should be: below
        st = None
    except OSError as e:
        raise UsageError(f"{label}: cannot use this path ({e.strerror})") from None
    if st is not None:
        kind = _kind(st.st_mode)
        if kind:
            raise UsageError(f"{label} is {kind}; vlmdoctor writes regular files only and never replaces {kind}")
        if not force:
            raise UsageError(f"{label} exists; pass --force to overwrite it")
    parent = p.parent
    if not parent.exists():
        raise UsageError(f"{label}: the folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise UsageError(f"{label}: {parent} is not a folder")
    try:  # os.access says yes to root on a read-only mount's folders only sometimes; a probe file does not lie
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{p.name[:100]}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{label}: cannot write in {parent} ({e.strerror})") from None


def check_output_dir(path: str | os.PathLike | None, flag: str = "") -> None:
    """A folder vlmdoctor will write into: refuse a file or a link at its place, or a parent it cannot write in."""
    if not path:
        return
    label = f"{flag} {path}" if flag else str(path)
    p = Path(path)
    _check_names(p, label)
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        raise UsageError(f"{label} exists and is not a folder")
    probe_dir = p
    while not probe_dir.exists():  # the nearest existing ancestor is where the folder gets created
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise UsageError(f"{label}: {probe_dir} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=probe_dir, prefix=".vlmdoctor.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{label}: cannot write in {probe_dir} ({e.strerror})") from None


def finite(v: Any) -> Any:
    """NaN and +-Infinity (not JSON) as null, anywhere in a value."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def json_text(data: Any, indent: int | None = 2) -> str:
    """Strict JSON: a NaN loss is written as null, never as the bare NaN other readers reject."""
    return json.dumps(finite(data), indent=indent, default=str, allow_nan=False) + "\n"


def _refuse_special(target: Path) -> None:
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    kind = _kind(st.st_mode)
    if kind:
        raise UsageError(f"{target} is {kind}; vlmdoctor writes regular files only and never replaces {kind}")


def _write_all(fd: int, data: bytes) -> None:
    """os.write until done (a seam the tests use to fake a full disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file object whose content replaces `path` only when the block ends without error.

    Temp file in the same folder (so the rename is atomic), fsync before the rename; on any
    failure (a full disk, Ctrl-C) the temp file is removed and `path` is as it was.
    """
    target = Path(path)
    _refuse_special(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:100]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; an output is an ordinary file
        _refuse_special(target)  # something appeared at the target meanwhile: still never replace it
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write atomically; an OSError becomes a one-line WriteError naming the file (nothing is left behind)."""
    target = Path(path)
    try:
        fd, tmp = _mkstemp(target)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.chmod(tmp, 0o644)
            _refuse_special(target)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise WriteError(f"cannot write {target}: {e.strerror or e}") from None


def _mkstemp(target: Path) -> tuple[int, str]:
    _refuse_special(target)
    return tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:100]}.", suffix=".tmp")


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` as UTF-8, atomically."""
    write_bytes(path, text.encode("utf-8"))


def write_json(report: Any, path: str) -> None:
    """Strict JSON to a file (atomically) or to stdout for '-'."""
    text = json_text(report)
    if path == "-":
        print(text, end="")
        return
    write_text(path, text)


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append to a regular file (JSON lines, a CI step summary); a link or device there is refused."""
    target = Path(path)
    _refuse_special(target)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            _write_all(fd, text.encode("utf-8"))
        finally:
            os.close(fd)
    except OSError as e:
        raise WriteError(f"cannot append to {target}: {e.strerror or e}") from None


def fallback_path(name: str) -> Path:
    """Where content goes when its own path failed: the current folder, else the temp folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(name).name or "output"
    for folder in (Path.cwd(), Path(tempfile.gettempdir())):
        candidate = folder / f"vlmdoctor-rescued-{stamp}-{base}"
        k = 1
        while candidate.exists() or candidate.is_symlink():
            candidate = folder / f"vlmdoctor-rescued-{stamp}-{k}-{base}"
            k += 1
        try:
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            return candidate
        except OSError:
            continue
    raise OSError(errno.ENOSPC, "no folder to save a fallback copy in")


def save(path: str | os.PathLike, data: str | bytes, what: str = "output") -> str | None:
    """Write `data` to `path`; when that fails, keep it in a fallback file. Returns None on success,
    else one line saying what failed and where the content is now (the caller exits 1 with it)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        write_bytes(path, raw)
        return None
    except VlmdoctorError as e:
        reason = e.message
    try:
        rescue = fallback_path(str(path))
        write_bytes(rescue, raw)
    except (OSError, VlmdoctorError):
        return f"{reason}; the {what} could not be saved anywhere else either"
    return f"{reason}; the {what} was saved to {rescue} instead"


def save_json(data: Any, path: str | None, what: str) -> str | None:
    """A command's --json PATH|-: strict JSON to stdout for '-', else `save` (kept elsewhere if the path fails)."""
    if path == "-":
        write_json(data, "-")
        return None
    return save(path, json_text(data), what) if path else None
