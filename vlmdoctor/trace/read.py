"""Reading torch.profiler Chrome traces: a file (.json, .json.gz) or a folder of per-rank traces.

Events are streamed one at a time through the C JSON decoder, never loaded whole, so memory stays bounded on traces of many GB.
The small top-level metadata (device properties, the `vlmdoctor` block a profile embeds) is read
from the part of the file before `traceEvents`, where Kineto writes it.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from vlmdoctor.errors import UsageError

TRACE_SUFFIXES = (".json", ".json.gz")
HEAD_LIMIT = 8 * 2**20  # metadata before traceEvents is small; never read more than this looking for it


class TraceError(UsageError):
    """Not a readable torch.profiler trace: the message says what is wrong and what was expected."""


def trace_files(path: str | Path) -> list[Path]:
    """The trace files a path names: the file itself, or every trace file in a folder (one per rank)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file or folder")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(TRACE_SUFFIXES))
        if not files:
            raise TraceError(
                f"{p}: the folder holds no trace files (expected *.json or *.json.gz written by "
                "torch.profiler, one per rank)"
            )
        return files
    if not p.name.endswith(TRACE_SUFFIXES):
        raise TraceError(f"{p}: expected a torch.profiler Chrome trace (.json or .json.gz)")
    return [p]


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def read_metadata(path: Path, strict: bool = False) -> dict[str, Any]:
    """Top-level keys other than traceEvents (Kineto writes them first).

    strict: keys that do not parse are an error (an export must not drop them) instead of none.
    """
    head = b""
    try:
        with _open(path) as f:
            while len(head) < HEAD_LIMIT:
                chunk = f.read(1 << 16)
                if not chunk:
                    break
                head += chunk
                i = head.find(b'"traceEvents"')
                if i >= 0:
                    try:
                        meta = json.loads(head[:i].decode("utf-8", "replace") + '"traceEvents": []}')
                    except json.JSONDecodeError as e:
                        if strict:
                            raise TraceError(
                                f"{path}: the keys before traceEvents are not valid JSON ({e.msg}); "
                                "expected a torch.profiler trace"
                            ) from None
                        return {}
                    meta.pop("traceEvents", None)
                    return meta
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e}); expected a torch.profiler trace") from None
    if b'"traceEvents"' not in head:
        text = head[:200].decode("utf-8", "replace").strip()
        if not text.startswith("{"):
            raise TraceError(
                f"{path}: not a JSON object (starts with {text[:40]!r}); expected a torch.profiler "
                "Chrome trace with a traceEvents list"
            )
    return {}


def iter_events(path: Path, block: int = 1 << 24, tail: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every element of traceEvents, streamed through the C JSON decoder one event at a time.

    A rolling buffer of `block` characters keeps memory bounded whatever the trace size;
    truncation and bad JSON become TraceErrors. With `tail`, the top-level keys written after
    traceEvents (Kineto's traceName) are read into it once the events are spent.
    """
    dec = json.JSONDecoder()
    count = 0
    try:
        with _open(path) as raw:
            f = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
            buf = ""
            while True:  # find the start of the events list
                more = f.read(block)
                if not more:
                    raise TraceError(f"{path}: no 'traceEvents' list (expected a torch.profiler Chrome trace)")
                buf += more
                k = buf.find('"traceEvents"')
                if k >= 0:
                    k = buf.find("[", k)
                    if k >= 0:
                        break
                buf = buf[-64:]
            i, eof = k + 1, False
            while True:
                n = len(buf)
                while i < n and buf[i] in " \t\r\n,":
                    i += 1
                if not eof and n - i < (1 << 20):  # keep at least 1 MB ahead of the decoder
                    more = f.read(block)
                    eof = not more
                    buf, i = buf[i:] + more, 0
                    continue
                if i >= n:
                    raise json.JSONDecodeError("the events list is not closed", buf, i)
                if buf[i] == "]":
                    break
                ev, i = dec.raw_decode(buf, i)
                count += 1
                yield ev
            if tail is not None and count:
                tail.update(_trailing_keys(path, buf[i + 1 :] + f.read()))
    except json.JSONDecodeError as e:
        where = f"after {count} events" if count else "before any event"
        raise TraceError(
            f"{path}: the JSON is malformed or truncated {where} ({e.msg}); expected a complete "
            "torch.profiler Chrome trace"
        ) from None
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e}); a truncated .gz file?") from None
    if count == 0:
        raise TraceError(f"{path}: no trace events (expected a top-level 'traceEvents' list, as torch.profiler writes)")


def _trailing_keys(path: Path, rest: str) -> dict[str, Any]:
    """The keys after the traceEvents list: `, "k": v, ... }`."""
    text = rest.strip()
    if not text.endswith("}"):
        raise TraceError(
            f"{path}: the JSON object is not closed after traceEvents (a truncated file?); expected a "
            "complete torch.profiler Chrome trace"
        )
    body = text[:-1].strip().lstrip(",").strip()
    try:
        return json.loads("{" + body + "}") if body else {}
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: the keys after traceEvents are not valid JSON ({e.msg})") from None
