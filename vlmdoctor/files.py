"""Every file vlmdoctor writes goes through here: refused up front, written atomically, never lost.

The promises (docs/files.md):
- only regular files are written: a symlink, device, fifo or folder at the target is refused,
  never replaced (as root, `--json /dev/null --force` must not replace /dev/null);
- an existing file is replaced only with --force, and only once the new content is complete
  (temp file in the same folder, fsync, rename); the temp file is removed on any failure; a file that
  another program made at a checked output's path meanwhile is kept (the content is rescued instead);
- every output path is checked before the work starts (`check_writable`);
- when the final write still fails (a full disk), the content is saved to a fallback file in
  the current folder or the temp folder, and the message names it;
- an output that names one of the command's inputs is refused, even with --force (`check_inputs_kept`);
- files another library writes by name (torch's chrome trace) go through a temp name too (`export_via`),
  and a log that grows while a script runs is appended to only as a regular file (`open_log`).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import math
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from vlmdoctor.errors import EXIT_FAILED_RUN, UsageError, VlmdoctorError

NAME_MAX = 255  # bytes in one path component on Linux/macOS file systems
#: outputs that did not exist when `check_writable` checked them without --force: where they are -> the
#: identity of the file this process wrote there (None before its first write). Another program that makes the
#: file meanwhile (a second vlmdoctor writing the same output), or writes into it, keeps it: the write refuses,
#: `save` rescues.
_NEW: dict[str, tuple[int, int, int, int] | None] = {}


def _as_written(st: os.stat_result) -> tuple[int, int, int, int]:
    """A file as this process left it: device and inode, and its size and modification time, so that a program
    that rewrites the same inode in place (open(path, "w")) is seen too."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


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


def _paths(value: str | os.PathLike | Iterable[str | os.PathLike] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [] if str(value) in ("", "-") else [os.fspath(value)]
    return [p for v in value for p in _paths(v)]


def _identity(path: str) -> tuple[str, tuple[int, int] | None]:
    """The resolved path and the (device, inode) of the file it reaches (None where nothing is there)."""
    try:
        st = os.stat(path)
        ino = (st.st_dev, st.st_ino)
    except (OSError, ValueError):
        ino = None
    return _key(path), ino


def check_inputs_kept(
    inputs: Mapping[str, str | os.PathLike | Iterable[str | os.PathLike] | None],
    outputs: Mapping[str, str | os.PathLike | Iterable[str | os.PathLike] | None],
) -> None:
    """Refuse, even with --force, an output that would replace one of the command's inputs (`analyze T --json T`,
    `--save-config` onto the `--config`): the file the command read would be gone.

    Keys are what the line calls each path (`"--json"`, `"the trace"`); values a path, a list of paths or None.
    The same file is found by its resolved path and by its inode, so `./x` and `x`, a link and a hard link to
    an input count too. An input folder counts with the files in it (`export DIR --hta-dir DIR`).
    """
    seen: list[tuple[str, str, str, tuple[int, int] | None, bool]] = []
    held: dict[tuple[int, int], tuple[str, str]] = {}  # the files in an input folder (a hard link elsewhere)
    for label, value in inputs.items():
        for path in _paths(value):
            real, ino = _identity(path)
            is_dir = os.path.isdir(real)
            seen.append((label, path, real, ino, is_dir))
            if is_dir:
                with contextlib.suppress(OSError):
                    with os.scandir(real) as entries:
                        for entry, _ in zip(entries, range(10_000)):
                            if entry.is_file():
                                st = entry.stat()
                                held[(st.st_dev, st.st_ino)] = (label, path)
    for flag, value in outputs.items():
        for path in _paths(value):
            real, ino = _identity(path)
            for label, given, in_real, in_ino, is_dir in seen:
                same = real == in_real or (ino is not None and ino == in_ino)
                inside = (  # an existing file in an input folder: the command may read it (a rank trace, a rule)
                    is_dir and os.path.isfile(real) and real.startswith(in_real.rstrip(os.sep) + os.sep)
                )
                if same or inside or (ino is not None and held.get(ino, (None,))[0] == label):
                    what = "is" if same else "is a file of"
                    raise UsageError(
                        f"{flag} {path} {what} {label} ({given}); vlmdoctor never writes over what it reads, "
                        "even with --force: give the output another name"
                    )


def _check_names(p: Path, label: str) -> None:
    for part in p.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise UsageError(f"{label}: a name in the path is longer than {NAME_MAX} bytes")


#: the outputs that `-` sends to standard output; for any other, `-` is refused (never a file named '-')
STDOUT_FLAGS = ("--json",)


def check_writable(path: str | os.PathLike | None, force: bool, flag: str = "") -> None:
    """Refuse up front, before minutes of GPU time are spent, any output path the write would fail on
    or that would replace something it must not: a non-regular file, an existing file without --force,
    a missing or read-only folder, a name too long."""
    if path is None:
        return
    text, name = str(path), flag or "--json"
    if text == "-":
        if name not in STDOUT_FLAGS:
            raise UsageError(f"{name} -: this output cannot go to standard output; give a file name")
        return
    if not text.strip():
        raise UsageError(
            f"{name}: an empty path; give a file name" + (" (or - for standard output)" if name in STDOUT_FLAGS else "")
        )
    label = f"{flag} {path}" if flag else text
    if text.endswith(("/", os.sep)) or text in (".", ".."):
        raise UsageError(f"{label}: names a folder; give a file name (in that folder)")
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
            raise _not_regular(label, kind)
        if not force:
            raise UsageError(f"{label} exists; pass --force to overwrite it")
    if force:  # whatever is there when the work is done may be replaced
        _NEW.pop(_key(p), None)
    elif st is None:
        _NEW[_key(p)] = None
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


def _not_regular(label: str | os.PathLike, kind: str) -> UsageError:
    return UsageError(f"{label} is {kind}; vlmdoctor writes regular files only and never replaces {kind}")


def _refuse_special(target: Path) -> None:
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    kind = _kind(st.st_mode)
    if kind:
        raise _not_regular(target, kind)


def _key(path: str | os.PathLike) -> str:
    """The resolved path: one file reached by `./x`, `x` or a link is one key."""
    try:
        return os.path.realpath(os.path.abspath(os.fspath(path)))
    except (OSError, ValueError):  # a NUL in the name: nothing there to compare, and the write will refuse it
        return os.path.abspath(os.fspath(path))


def claim(*paths: str | os.PathLike) -> None:
    """`paths` are this process's outputs from now on: written where absent, replaced only where this process
    wrote them (or `adopt` took them); a file another program puts there meanwhile is kept."""
    for path in paths:
        _NEW[_key(path)] = None


def adopt(*paths: str | os.PathLike) -> None:
    """The files at `paths` were written by a child of this command (`run`'s script wrote OUT/report.json): this
    process may replace them, as it may replace what it wrote itself."""
    for path in paths:
        key = _key(path)
        if key in _NEW:
            with contextlib.suppress(OSError):
                _NEW[key] = _as_written(os.stat(key))


def _place(tmp: str, target: Path) -> None:
    """Move the complete temp file onto `target`: a regular file only; and an output that was new when checked
    without --force only if it is still absent, or still the file this process wrote (never another's)."""
    _refuse_special(target)
    key = _key(target)
    if key not in _NEW:
        os.replace(tmp, target)
        return
    ours = _NEW[key]
    try:
        there = _as_written(os.stat(target))
    except FileNotFoundError:
        there = None
    taken = OSError(errno.EEXIST, "another program wrote it while vlmdoctor worked; it is not replaced")
    if there is not None and there != ours:
        raise taken
    if there is None:
        try:
            os.link(tmp, target)  # fails if the name is taken meanwhile: never a replace
            os.unlink(tmp)
        except FileExistsError:
            raise taken from None
        except OSError:  # a file system without hard links
            os.replace(tmp, target)
    else:
        os.replace(tmp, target)
    _NEW[key] = _as_written(os.stat(target))


def output_mode() -> int:
    """The mode a new file gets from open(): 0o666 less the process's umask (read without changing it)."""
    return 0o666 & ~_umask()


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022  # where the kernel does not say: the common default (reading it any other way changes it)


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
        os.chmod(tmp, output_mode())  # mkstemp makes it private; an output is an ordinary file, as umask says
        _place(tmp, target)  # something appeared at the target meanwhile: still never replace it
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
            os.chmod(tmp, output_mode())
            _place(tmp, target)
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


def reader_gone(stream: Any) -> None:
    """The reader of `stream` went away (`vlmdoctor ... | head`): what is still printed goes nowhere, quietly,
    and the command finishes its work (its files are written); its exit flush cannot fail either."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def write_json(report: Any, path: str) -> None:
    """Strict JSON to a file (atomically) or to stdout for '-'."""
    text = json_text(report)
    if path == "-":
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader went away (`| head`): nothing left to give it
            reader_gone(sys.stdout)
        return
    write_text(path, text)


def _open_regular_append(target: Path, truncate: bool = False) -> int:
    """An fd appending to `target`, a regular file or a new one; a link (O_NOFOLLOW), fifo, device or folder is
    refused without blocking (O_NONBLOCK: opening a fifo for writing would wait for a reader)."""
    _refuse_special(target)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(target, flags, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            _refuse_special(target)  # the one line naming what is there
        raise
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind:
            raise _not_regular(target, kind)
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append to a regular file (JSON lines, a CI step summary); a link or device there is refused."""
    target = Path(path)
    try:
        fd = _open_regular_append(target)
        try:
            _write_all(fd, text.encode("utf-8"))
        finally:
            os.close(fd)
    except OSError as e:
        raise WriteError(f"cannot append to {target}: {e.strerror or e}") from None


def open_log(path: str | os.PathLike) -> IO[bytes]:
    """A log that grows while a script runs (`vlmdoctor run`'s OUT/script.log), streamed to its final name so
    that what a crash printed is there: a regular file only (never through a link, into a fifo or device),
    emptied first; whether an old one may be replaced is `check_writable`'s to say, before the run."""
    target = Path(path)
    try:
        fd = _open_regular_append(target, truncate=True)
    except OSError as e:
        raise UsageError(f"cannot write {target}: {e.strerror or e}") from None
    return os.fdopen(fd, "ab")


def export_via(path: str | os.PathLike, export: Callable[[str], None]) -> None:
    """A file another library writes by name (torch.profiler's `export_chrome_trace`), made atomic: it writes a
    temp name in the same folder, which is gzipped (for a `.gz` target) or renamed into place once complete.

    A failure or an interruption (a full disk, SIGTERM handled as an exception) leaves no file at `path`
    and no temp file; an OSError or the library's own error becomes a one-line WriteError.
    """
    target = Path(path)
    tmp: str | None = None
    own: str | None = None  # the library's own temp name beside ours (Kineto writes NAME.tmp, then renames it)
    try:
        fd, tmp = _mkstemp(target)  # a name ending .tmp: torch writes it as plain JSON (it gzips only *.gz)
        os.close(fd)
        own = tmp + ".tmp"
        export(tmp)
        if target.name.endswith(".gz"):
            with (
                open(tmp, "rb") as src,
                atomic_writer(target) as raw,
                gzip.GzipFile(filename=target.name[: -len(".gz")], mode="wb", fileobj=raw, compresslevel=6) as gz,
            ):
                shutil.copyfileobj(src, gz, 1 << 20)
        else:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, output_mode())
            _place(tmp, target)
            tmp = None
    except VlmdoctorError:
        raise
    except Exception as e:  # OSError from the disk, RuntimeError from the library's own writer
        raise WriteError(f"cannot write {target}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        for leftover in (tmp, own):
            if leftover is not None:
                with contextlib.suppress(OSError):
                    os.unlink(leftover)


def _rescue_folders() -> list[Path]:
    """Where content goes when its own path failed: the current folder, then the temp folder."""
    return [Path.cwd(), Path(tempfile.gettempdir())]


def _reserve(folder: Path, base: str) -> Path:
    """A fresh `vlmdoctor-rescued-STAMP-NAME` in `folder`, created empty (O_EXCL) so no other rescue takes it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        candidate = folder / (
            f"vlmdoctor-rescued-{stamp}-{base}" if k == 0 else f"vlmdoctor-rescued-{stamp}-{k}-{base}"
        )
        try:
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return candidate
    raise OSError(errno.EEXIST, f"no free rescue name in {folder}")


def rescue(name: str, data: bytes) -> Path:
    """Save `data` whole to a fallback file: the current folder first, then the temp folder. A folder where the
    write fails (a full disk holds the current folder too) leaves nothing there and the next is tried."""
    base = Path(name).name or "output"
    last: Exception | None = None
    for folder in _rescue_folders():
        try:
            spot = _reserve(folder, base)
        except OSError as e:
            last = e
            continue
        try:
            write_bytes(spot, data)
            return spot
        except VlmdoctorError as e:
            last = e
            with contextlib.suppress(OSError):
                os.unlink(spot)
    raise OSError(errno.ENOSPC, f"no folder to save a fallback copy in ({getattr(last, 'message', last)})")


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
        spot = rescue(str(path), raw)
    except OSError:
        return f"{reason}; the {what} could not be saved anywhere else either"
    return f"{reason}; the {what} was saved to {spot} instead"


def save_json(data: Any, path: str | None, what: str) -> str | None:
    """A command's --json PATH|-: strict JSON to stdout for '-', else `save` (kept elsewhere if the path fails)."""
    if path == "-":
        write_json(data, "-")
        return None
    return save(path, json_text(data), what) if path else None
