"""Checks every input kind shares: files the user names, numbers on the command line, and the one
reader of each text format (YAML, JSON) that every input of that kind goes through.

Each failure is a UsageError (exit 2) of one line that names the flag or the file, so a bad
input never reaches the code that would have crashed on it. The bounds are in docs/files.md.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from vlmdoctor.errors import UsageError

NAME_MAX = 255
#: the largest YAML file (config, rule, sweep grid): they are a few hundred bytes; YAML is parsed in Python
MAX_YAML_BYTES = 2**20
#: the deepest nesting of YAML or JSON values a config, rule, grid or report may have (they use 4 or 5)
MAX_DEPTH = 64


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


def open_regular(path: str | os.PathLike, what: str = "file") -> BinaryIO:
    """A file the user named, open for reading, refused unless it is a regular file.

    The file is opened without blocking and checked on the open descriptor, so a fifo (or a device)
    named `*.json` is refused at once instead of blocking the read, and nothing can swap the path
    between the check and the read. Every way this fails is one line naming the path.
    """
    p = Path(path)
    problem = path_problem(p)
    if problem:
        raise UsageError(f"{what} {_short(p)}: {problem}")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise UsageError(f"{what} {_short(p)}: cannot read: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{what} {_short(p)}: is a folder, not a file") from None
    except OSError as e:
        why = "too long a path" if e.errno == errno.ENAMETOOLONG else (e.strerror or str(e))
        raise UsageError(f"{what} {_short(p)}: cannot read ({why})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"{what} {_short(p)}: is a folder, not a file")
        if not stat.S_ISREG(mode):
            raise UsageError(f"{what} {_short(p)}: not a regular file (a device or fifo cannot be read as one)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, what: str = "file", max_bytes: int | None = None) -> bytes:
    """The bytes of a file the user named; every way this fails is one line naming it. A fifo or a
    device is refused (reading /dev/zero or a fifo would never end), and so is a file over max_bytes."""
    p = Path(path)
    try:
        with open_regular(p, what) as f:
            size = os.fstat(f.fileno()).st_size
            if max_bytes is not None and size > max_bytes:
                raise UsageError(f"{what} {p}: {_size(size)}, more than the {_size(max_bytes)} a {what} can be")
            data = f.read(max_bytes + 1 if max_bytes is not None else -1)
            if max_bytes is not None and len(data) > max_bytes:  # it grew while being read
                raise UsageError(f"{what} {p}: more than the {_size(max_bytes)} a {what} can be")
            return data
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


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} bytes"


# --- YAML: one loader for every YAML input (configs, rules, sweep grids, --set values) ------------------


def _yaml_loader():
    """A SafeLoader that refuses what turns a small file into a big or ambiguous value.

    Aliases and anchors (a 500-byte file of nested aliases expands to gigabytes once walked),
    a key written twice in one mapping (YAML would silently keep the last), and nesting deeper
    than MAX_DEPTH are each refused with the line they are on.
    """

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                raise _YamlRefusal(
                    event.start_mark,
                    f"an alias (*{event.anchor}) repeats a value written elsewhere; aliases and anchors are "
                    "not allowed (a small file could expand to gigabytes): write the value out",
                )
            if getattr(event, "anchor", None) is not None:
                raise _YamlRefusal(
                    event.start_mark,
                    f"an anchor (&{event.anchor}); aliases and anchors are not allowed (a small file could "
                    "expand to gigabytes): write the value out",
                )
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _YamlRefusal(event.start_mark, f"values nested more than {MAX_DEPTH} deep")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, Any] = {}
                for key_node, _ in node.value:
                    if not isinstance(key_node, yaml.ScalarNode):
                        continue  # a complex key: the constructor says what is wrong with it
                    key = self.construct_object(key_node)
                    try:
                        first = seen.setdefault(key, key_node.start_mark)
                    except TypeError:
                        continue
                    if first is not key_node.start_mark:
                        raise _YamlRefusal(
                            key_node.start_mark,
                            f"the key {str(key)[:60]!r} is written twice in one mapping (first at line "
                            f"{first.line + 1}, column {first.column + 1}); YAML would keep only the last: keep one",
                        )
            return super().construct_mapping(node, deep=deep)

    return Loader


class _YamlRefusal(Exception):
    def __init__(self, mark: Any, why: str) -> None:
        super().__init__(why)
        self.at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        self.why = why


_LOADER = None


#: parsed YAML texts kept, each its value's own copy handed out: the rule folder is read at every diagnosis (51
#: files, 0.16-0.28 s of pure-Python parsing on a 2-core CPU), and `treat` diagnoses each trial
_PARSED: dict[str, Any] = {}
#: the most texts kept, and the longest kept (a config or rule file is a few KB)
PARSED_MAX_TEXTS = 512
PARSED_MAX_CHARS = 65_536


def parse_yaml(text: str, where: str) -> Any:
    """The value of a YAML text through the one bounded loader; every way this fails is one line that
    starts with `where` (the file, or the flag) and says the line."""
    if text in _PARSED:
        return copy.deepcopy(_PARSED[text])
    value = _parse_yaml(text, where)
    if len(text) <= PARSED_MAX_CHARS and len(_PARSED) < PARSED_MAX_TEXTS:
        _PARSED[text] = copy.deepcopy(value)
    return value


def _parse_yaml(text: str, where: str) -> Any:
    global _LOADER
    if _LOADER is None:
        _LOADER = _yaml_loader()
    loader = _LOADER(text)
    try:
        return visible_surrogates(loader.get_single_data(), text)
    except _YamlRefusal as e:
        raise UsageError(f"{where}: {e.at}{e.why}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UsageError(f"{where}: does not parse: not valid YAML ({problem}{at})") from None
    except ValueError as e:  # a number too long to convert (over 4,300 digits), a bad date
        raise UsageError(f"{where}: a value does not convert ({str(e).splitlines()[0][:120]})") from None
    except RecursionError:
        raise UsageError(f"{where}: values nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike, what: str = "file", max_bytes: int = MAX_YAML_BYTES) -> Any:
    """A YAML file the user named (a regular file of at most max_bytes, UTF-8), through parse_yaml."""
    return parse_yaml(read_text(path, what, max_bytes), f"{what} {_short(Path(path))}")


# --- JSON: reports and configs ---------------------------------------------------------------------


#: a UTF-16 surrogate written as an escape (JSON, YAML): a lone one decodes to a string UTF-8 cannot hold
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _visible(s: str) -> str:
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def visible_surrogates(value: Any, text: str | bytes | None = None) -> Any:
    """`value` with every lone UTF-16 surrogate of its strings and keys shown as its escape (`\\ud800`).

    JSON and YAML may write one (`"\\ud800"`); the string it decodes to cannot be encoded as UTF-8, so a name
    holding one would fail the first print, write or hash of it, after the work. Given the `text` the value
    was decoded from, values are walked only when the text holds a surrogate escape (rarely)."""
    if text is not None:
        probe = text if isinstance(text, str) else text.decode("ascii", "replace")
        if not _SURROGATE_ESCAPE.search(probe):
            return value
    if isinstance(value, str):
        return _visible(value)
    todo = [value]
    while todo:  # not recursive: values may nest deeper than Python's recursion limit
        v = todo.pop()
        if isinstance(v, dict):
            for k in list(v):
                x = v[k]
                if isinstance(x, str):
                    v[k] = _visible(x)
                elif isinstance(x, (dict, list)):
                    todo.append(x)
                if isinstance(k, str) and _visible(k) != k:
                    v[_visible(k)] = v.pop(k)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, str):
                    v[i] = _visible(x)
                elif isinstance(x, (dict, list)):
                    todo.append(x)
    return value


def parse_json(text: str | bytes, where: str) -> Any:
    """The value of a JSON text; every way this fails (bad JSON, NaN is fine, an integer of more than
    4,300 digits, nesting deeper than MAX_DEPTH) is one line that starts with `where`. A lone surrogate
    escape in a string is kept visible (`visible_surrogates`)."""
    try:
        value = visible_surrogates(json.loads(text), text)
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{where}: does not parse: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}; truncated?)"
        ) from None
    except RecursionError:
        raise UsageError(f"{where}: not valid here (JSON nested more than {MAX_DEPTH} deep)") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise UsageError(f"{where}: a value does not convert ({str(e).splitlines()[0][:120]})") from None
    if _depth(value) > MAX_DEPTH:
        raise UsageError(f"{where}: not valid here (JSON nested more than {MAX_DEPTH} deep)")
    return value


def read_json(path: str | os.PathLike, what: str = "file", max_bytes: int | None = None) -> Any:
    """A JSON file the user named (a regular file of at most max_bytes, UTF-8), through parse_json."""
    return parse_json(read_text(path, what, max_bytes), f"{what} {_short(Path(path))}")


def _depth(value: Any) -> int:
    """How deep lists and objects nest (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if d > deepest:
            deepest = d
            if d > MAX_DEPTH:
                break
        todo.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest
