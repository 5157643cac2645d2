"""Reading torch.profiler Chrome traces: a file (.json, .json.gz) or a folder of per-rank traces.

Events are read in chunks of a few MB, each decoded whole by msgspec, never the file at once, so
memory stays bounded on traces of many GB. A large file may be read in parts (Span, split_points), one
process each, a .gz as well as a plain file.
The small top-level metadata (device properties, the `vlmdoctor` block a profile embeds) is read
from the part of the file before `traceEvents`, where Kineto writes it.

Every input is bounded (docs/files.md, "Reading"): only regular files are opened (a fifo named
`*.json` is refused at once), a gzip file may not inflate to more than GZIP_MAX_RATIO times its
size (real traces: under 20), one event may span any number of reads up to MAX_EVENT_BYTES, and
the metadata a reader keeps is bounded by HEAD_LIMIT.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

import msgspec

from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import visible_surrogates

TRACE_SUFFIXES = (".json", ".json.gz")
HEAD_LIMIT = 8 * 2**20  # metadata before traceEvents is small; never read more than this looking for it
BLOCK = 1 << 21  # bytes read at a time; a chunk of events is about this size (decoded: about 10x)
SLOW_AFTER = 8  # blocks without a place to cut: the rest is read event by event
CUT_TRIES = 4  # cuts tried, the last first, before a chunk is read event by event
STREAM_AHEAD = 1 << 20  # read event by event: at least this much text stays buffered ahead of the decoder
MAX_EVENT_BYTES = 64 * 2**20  # one event's JSON text; torch.profiler's largest are a few KB
#: a .gz trace may inflate to this many times its size on disk (recorded traces: 14x to 19x); more is a
#: gzip bomb, refused before it fills the memory
GZIP_MAX_RATIO = 100
GZIP_MIN_LIMIT = 64 * 2**20  # ... or to this many bytes, for small files
_BETWEEN = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")  # where one event ends and the next starts, or inside one
_ANY = msgspec.json.Decoder()


#: one JSON token other than a string (TopKey finds strings by their closing quote): a structural mark,
#: or a literal (number, true, false, null)
_TOKEN = re.compile(rb'[ \t\r\n]*(?:([{}\[\],:])|([^ \t\r\n{}\[\],:"]+))')
_SPACE = re.compile(rb"[ \t\r\n]*")
NEED_MORE = None  # TopKey.scan: the text so far does not say yet
NOT_FOUND = (-1, -1)


class TopKey:
    """Where the top-level object's `key` starts and where its value starts, as every JSON reader sees them.

    The first bytes `"traceEvents"` anywhere (inside a string, a nested object) are not the key; a key
    spelled with escapes is. `scan` is given the text read so far, each time longer, and goes on from where
    it stopped: NEED_MORE until the text tells, then (key start, value start), or NOT_FOUND when the
    top-level object ended without the key or the text is not an object."""

    def __init__(self, key: str = "traceEvents") -> None:
        self.key, self.pos, self.depth, self.want_key, self.last, self.start = key, 0, 0, False, None, -1
        self.searched = 0  # where the search for the end of a string cut by the last read goes on

    def _string_end(self, text: bytes, start: int) -> int:
        """The end of the string that starts at `start` (just past its closing quote), or -1 when the text read
        so far does not hold it; a long string is searched once, however many reads it spans."""
        at = max(start + 1, self.searched)
        while True:
            q = text.find(b'"', at)
            if q < 0:
                self.searched = len(text)
                return -1
            k = q
            while k > start + 1 and text[k - 1] == 0x5C:  # backslashes before the quote: an odd count escapes it
                k -= 1
            if (q - k) % 2 == 0:
                self.searched = 0
                return q + 1
            at = q + 1

    def scan(self, text: bytes) -> tuple[int, int] | None:
        while True:
            self.pos = here = _SPACE.match(text, self.pos).end()
            if text[here : here + 1] == b'"':  # a string: found by its closing quote, not by the regex
                end = self._string_end(text, here)
                if end < 0:
                    return NEED_MORE
                if self.depth == 0:
                    return NOT_FOUND
                self.pos = end
                if self.want_key:
                    try:
                        self.last = json.loads(text[here:end])
                    except ValueError:
                        self.last = None
                    self.start, self.want_key = here, False
                continue
            m = _TOKEN.match(text, self.pos)
            if m is None or (m.end() == len(text) and m.group(2) is not None):
                return NEED_MORE  # a token cut at the end of the text read so far (the caller bounds the text)
            mark = m.group(1)
            if self.depth == 0 and mark != b"{":
                return NOT_FOUND
            self.pos = m.end()
            if mark in (b"{", b"["):
                self.depth += 1
                self.want_key = self.depth == 1
            elif mark in (b"}", b"]"):
                self.depth -= 1
                if self.depth == 0:
                    return NOT_FOUND
            elif mark == b",":
                self.want_key = self.depth == 1
            elif mark == b":" and self.depth == 1 and self.last == self.key:
                return (self.start, self.pos)


class TraceError(UsageError):
    """Not a readable torch.profiler trace: the message says what is wrong and what was expected."""


class SplitError(Exception):
    """A part of a trace (split_points) is not whole events: read the file whole instead."""


class Span(NamedTuple):
    """A part of traceEvents for one of several processes: bytes `start` to `end` of the JSON text (for a .gz,
    of the inflated text); start -1: from the list's first event, end None: to the list's end.

    exact: both ends sit on events (split_points found them in a plain file). Else (a .gz file, whose text
    would have to be inflated to find them) each is moved on to the first place at or after it where one
    event ends and the next starts: the part that ends there and the part that starts there search the same
    bytes from the same offset, so they meet without a gap or an overlap."""

    start: int
    end: int | None
    exact: bool = True


def trace_files(path: str | Path) -> list[Path]:
    """The trace files a path names: the file itself, or every trace file in a folder (one per rank).

    Only regular files are traces: a fifo, a device or a socket named like one is refused (named
    itself) or left out (in a folder), never opened, so it cannot block the read."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file or folder")
    if p.is_dir():  # a link inside the folder is not followed: a rank folder holds the ranks' own files
        named = [f for f in p.iterdir() if f.name.endswith(TRACE_SUFFIXES)]
        files = sorted(f for f in named if not f.is_symlink() and f.is_file())
        if not files:
            links = sum(f.is_symlink() for f in named)
            raise TraceError(
                f"{p}: the folder holds no trace files (expected *.json or *.json.gz written by "
                "torch.profiler, one per rank)" + (f"; {links} link(s) in it, which are not followed" if links else "")
            )
        return files
    if not p.name.endswith(TRACE_SUFFIXES):
        raise TraceError(f"{p}: expected a torch.profiler Chrome trace (.json or .json.gz)")
    if not p.is_file():
        raise TraceError(f"{p}: not a regular file (a fifo or a device cannot be read as a trace)")
    return [p]


def json_size(path: Path) -> int:
    """About the bytes of JSON text in a trace file, to decide whether it is worth several processes: its size,
    or for .gz what gzip's trailer records (ISIZE: exact under 4 GiB for the one member torch.profiler
    writes, else less). A wrong value costs balance between the parts, never what they read."""
    size = path.stat().st_size
    if not path.name.endswith(".gz") or size < 18:  # 18: gzip's smallest member (header and trailer)
        return size
    from vlmdoctor.inputs import open_regular

    with open_regular(path, "trace") as f:
        f.seek(-4, os.SEEK_END)
        return max(size, int.from_bytes(f.read(4), "little"))


def _open(path: Path) -> IO[bytes]:
    """The trace's bytes (inflated for .gz), from a regular file only, a gzip file bounded by GZIP_MAX_RATIO."""
    from vlmdoctor.inputs import open_regular

    f = open_regular(path, "trace")
    if not path.name.endswith(".gz"):
        return f
    size = os.fstat(f.fileno()).st_size
    return _Inflated(gzip.GzipFile(fileobj=f, mode="rb"), f, path, max(GZIP_MIN_LIMIT, GZIP_MAX_RATIO * size))


class _Inflated:
    """A gzip stream that refuses to inflate past `limit` bytes (a small file of a huge repetitive trace)."""

    def __init__(self, gz: gzip.GzipFile, raw: IO[bytes], path: Path, limit: int) -> None:
        self.gz, self.raw, self.path, self.limit, self.done = gz, raw, path, limit, 0

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.limit + 1 - self.done
        data = self.gz.read(min(n, self.limit + 1 - self.done))
        self.done += len(data)
        if self.done > self.limit:
            raise TraceError(
                f"{self.path}: inflates to more than {self.limit / 2**20:,.0f} MiB, over {GZIP_MAX_RATIO}x its "
                "size on disk (recorded traces inflate under 20x): not read (a gzip bomb?)"
            )
        return data

    def __enter__(self) -> _Inflated:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.gz.close()
        self.raw.close()


def read_metadata(path: Path, strict: bool = False) -> dict[str, Any]:
    """Top-level keys other than traceEvents (Kineto writes them first).

    strict: keys that do not parse are an error (an export must not drop them) instead of none.
    """
    head = b""
    scanner = TopKey()
    found = NEED_MORE
    try:
        with _open(path) as f:
            while len(head) < HEAD_LIMIT:
                chunk = f.read(1 << 16)
                if not chunk:
                    break
                head += chunk
                found = scanner.scan(head)
                if found == NOT_FOUND:
                    break
                if found is not None:
                    i = found[0]
                    try:
                        text = head[:i].decode("utf-8", "replace") + '"traceEvents": []}'
                        meta = visible_surrogates(json.loads(text), text)
                    except RecursionError:
                        raise TraceError(f"{path}: the keys before traceEvents nest too deeply") from None
                    except json.JSONDecodeError as e:
                        if strict:
                            raise TraceError(
                                f"{path}: the keys before traceEvents are not valid JSON ({e.msg}); "
                                "expected a torch.profiler trace"
                            ) from None
                        return {}
                    except ValueError as e:  # an integer of more than 4,300 digits
                        raise TraceError(f"{path}: a value before traceEvents does not convert ({_first(e)})") from None
                    if not isinstance(meta, dict):
                        return {}
                    meta.pop("traceEvents", None)
                    return meta
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e}); expected a torch.profiler trace") from None
    if found in (NEED_MORE, NOT_FOUND):
        text = head[:200].decode("utf-8", "replace").strip()
        if not text.startswith("{"):
            raise TraceError(
                f"{path}: not a JSON object (starts with {text[:40]!r}); expected a torch.profiler "
                "Chrome trace with a traceEvents list"
            )
    return {}


def iter_events(path: Path, block: int | None = None, tail: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every element of traceEvents, as the `json` module decodes it, in order.

    Chunks of events are decoded whole by msgspec (C, about twice json's speed), each checked
    against json where msgspec refuses it; memory stays bounded by the chunk whatever the trace
    size. Truncation and bad JSON become TraceErrors. With `tail`, the top-level keys written
    after traceEvents (Kineto's traceName) are read into it once the events are spent.
    """
    for _, events, _ in iter_batches(path, None, block, tail):
        yield from events


def iter_batches(
    path: Path,
    decode: Callable[[bytes], list[Any]] | None = None,
    block: int | None = None,
    tail: dict[str, Any] | None = None,
    span: Span | tuple[int, int | None] | None = None,
) -> Iterator[tuple[bool, list[Any], bytes]]:
    """traceEvents in chunks of whole events: (fast, events, the chunk's JSON text).

    fast: `events` is `decode(text)` (typed structs a caller declares); else they are what `json`
    decodes (dicts), for the chunks `decode` refuses: a value of an unexpected type, NaN, a lone
    surrogate. The text is cut only between two events, where a `}` is followed by `,` and `{`;
    a cut that falls inside an event makes the chunk invalid JSON, so it is never taken: an earlier
    cut is tried, and past that the rest of the file is read event by event as JSON text, which
    also names where a malformed trace breaks.

    span: only the events of one part of the file (a Span; a plain (start, end) tuple is exact), for
    one of several processes reading parts of one file (split_points). Anything but whole events
    there raises SplitError.
    """
    fast = decode or _decode_any
    block = block or BLOCK
    count = 0
    exact = span is None or len(span) < 3 or span[2]
    try:
        with _open(path) as f:
            src = f  # what the events are read from: the file, or for a part that ends softly, up to its end
            if span is None or span[0] < 0:  # from the first event (before a soft end: small reads, not past it)
                buf, pos = _events_start(path, f, block if exact else min(block, 1 << 16))
            elif exact:
                f.seek(span[0])
                buf, pos = b"", 0
            else:
                buf, pos = _soft_start(path, f, span[0], block), 0
            left = None  # bytes of an exact part still to read
            if span is not None and span[1] is not None:
                if exact:
                    left = span[1] - span[0]
                else:
                    src = _Until(path, f, span[1] - (f.done if isinstance(f, _Inflated) else f.tell()), block)
            eof = False
            while not eof:
                more = src.read(block if left is None else min(block, left))
                if left is not None:
                    left -= len(more)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                cuts = _cuts(buf)
                if not cuts:
                    if len(buf) > SLOW_AFTER * block:  # no cut in many blocks: not a layout this reader knows
                        break
                    continue
                for cut, nxt in cuts:  # the last cut first; an earlier one when a cut falls inside an event
                    got = _decode_chunk(buf[pos:cut], fast)
                    if got is not None:
                        count += len(got[1])
                        yield got
                        pos = nxt
                        break
                else:
                    break  # no cut decodes: the rest is read event by event (it says where the JSON breaks)
            rest = buf[pos:]
            del buf
            if span is not None and span[1] is not None:  # a part of the file: it must end with whole events
                got = _decode_chunk(rest, fast) if eof else None
                if got is None:
                    raise SplitError(f"{path}: bytes {span} are not whole events")
                yield got
                return
            for ev in _stream(path, rest, f, block, count, tail):
                count += 1
                yield False, [ev], b""
    except json.JSONDecodeError as e:
        if span is not None:
            raise SplitError(f"{path}: bytes {span}: {e.msg}") from None
        where = f"after {count} events" if count else "before any event"
        raise TraceError(
            f"{path}: the JSON is malformed or truncated {where} ({e.msg}); expected a complete "
            "torch.profiler Chrome trace"
        ) from None
    except RecursionError:
        if span is not None:
            raise SplitError(f"{path}: bytes {span}: nested too deeply") from None
        raise TraceError(
            f"{path}: event {count + 1} nests its values too deeply to be a torch.profiler event"
        ) from None
    except ValueError as e:  # an integer of more than 4,300 digits
        if span is not None:
            raise SplitError(f"{path}: bytes {span}: {_first(e)}") from None
        raise TraceError(f"{path}: event {count + 1}: a value does not convert ({_first(e)})") from None
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e}); a truncated .gz file?") from None
    if count == 0:
        raise TraceError(f"{path}: no trace events (expected a top-level 'traceEvents' list, as torch.profiler writes)")


def split_points(path: Path, parts: int) -> list[Span]:
    """Byte spans of about equal size, each of whole events, that together hold every event of a
    trace (for iter_batches' span); one span where the file cannot be cut.

    A cut is placed where one event seems to end and the next begin; a wrong one (inside a string)
    shows when a span does not decode as whole events (SplitError), and the file is read whole.
    A .gz file gets soft spans (Span.exact False) at equal offsets of its inflated text, found by the
    parts themselves: each part inflates the file up to its own end, none inflates it to place the cuts.
    """
    if parts < 2:
        return [Span(-1, None)]
    if path.name.endswith(".gz"):
        cuts = [json_size(path) * k // parts for k in range(1, parts)]
        return [Span(a, b, exact=False) for a, b in zip([-1, *cuts], [*cuts, None])]
    from vlmdoctor.inputs import open_regular

    size = path.stat().st_size
    with open_regular(path, "trace") as f:
        try:
            buf, start = _events_start(path, f, 1 << 16)
        except TraceError:
            return [Span(-1, None)]
        start += f.tell() - len(buf)
        spans, a = [], start
        for k in range(1, parts):
            f.seek(max(a, start + (size - start) * k // parts))
            window = f.read(1 << 20)
            m = _BETWEEN.search(window)
            if m is None:
                continue
            here = f.tell() - len(window)
            spans.append(Span(a, here + m.start() + 1))
            a = here + m.end() - 1
    if len(spans) == 0:
        return [Span(-1, None)]
    return [*spans, Span(a, None)]


def _decode_any(text: bytes) -> list[Any]:
    return _ANY.decode(text)


def _events_start(path: Path, f: IO[bytes], block: int) -> tuple[bytes, int]:
    """The text read so far and where the first event starts (just past `"traceEvents": [`)."""
    buf = b""
    scanner = TopKey()
    while True:
        more = f.read(block)
        buf += more
        found = scanner.scan(buf) if more else NOT_FOUND
        if found == NOT_FOUND or (found is None and len(buf) > HEAD_LIMIT):
            raise TraceError(f"{path}: no top-level 'traceEvents' list (expected a torch.profiler Chrome trace)")
        if found is None:
            continue
        j = found[1] + len(buf[found[1] :]) - len(buf[found[1] :].lstrip(b" \t\r\n"))
        if j >= len(buf):
            more = f.read(block)
            if not more:
                raise TraceError(f"{path}: 'traceEvents' has no value")
            buf += more
            continue
        if buf[j : j + 1] != b"[":
            raise TraceError(f"{path}: 'traceEvents' is not followed by a list")
        return buf, j + 1


def _soft_start(path: Path, f: IO[bytes], at: int, block: int) -> bytes:
    """The text from the first event that starts after another ends at or after byte `at` (a soft Span's start;
    _Until finds the same place from the other side). A .gz is inflated up to `at`, the bytes thrown away."""
    if isinstance(f, _Inflated):
        left = at
        while left > 0:
            skipped = len(f.read(min(block, left)))
            if not skipped:
                raise SplitError(f"{path}: shorter than a part's start ({at} bytes)")
            left -= skipped
    else:
        f.seek(at)
    buf = b""
    while True:
        m = _BETWEEN.search(buf)
        if m is not None:
            return buf[m.end() - 1 :]
        more = f.read(1 << 16)  # small reads: the text kept must not pass the part's end (_Until)
        if not more or len(buf) > MAX_EVENT_BYTES:
            raise SplitError(f"{path}: no event starts after byte {at}")
        buf += more


class _Until:
    """A file read up to the first place, `left` bytes on or later, where one event ends and the next starts
    (a soft Span's end; the next part starts there, _soft_start), and no further."""

    def __init__(self, path: Path, f: IO[bytes], left: int, block: int) -> None:
        if left < 0:  # what was read before the events already passed the end: too small a part
            raise SplitError(f"{path}: a part ends before its first event")
        self.path, self.f, self.left, self.block, self.done = path, f, left, block, False

    def read(self, n: int) -> bytes:
        if self.left > 0:
            data = self.f.read(min(n, self.left))
            if not data:
                raise SplitError(f"{self.path}: shorter than a part's end")
            self.left -= len(data)
            return data
        buf = b""  # the text from the part's nominal end on, searched from its first byte as _soft_start does
        while not self.done:
            m = _BETWEEN.search(buf)
            if m is not None:
                self.done = True
                return buf[: m.start() + 1]
            more = self.f.read(self.block)
            if not more or len(buf) > MAX_EVENT_BYTES:
                raise SplitError(f"{self.path}: no event ends after a part's end")
            buf += more
        return b""


def _cuts(buf: bytes) -> list[tuple[int, int]]:
    """Places to cut between two events, the last first: (end of one event, start of the next)."""
    width = 1 << 16
    while True:
        lo = max(0, len(buf) - width)
        found = [(m.start() + 1, m.end() - 1) for m in _BETWEEN.finditer(buf, lo)]
        if found or lo == 0:
            return found[::-1][:CUT_TRIES]
        width *= 16


def _decode_chunk(text: bytes, fast: Callable[[bytes], list[Any]]) -> tuple[bool, list[Any], bytes] | None:
    """The events of one chunk: by `fast`, else by json; None when the text is not a list of whole values."""
    whole = b"[" + text + b"]"
    try:
        return True, fast(whole), text
    except (msgspec.DecodeError, UnicodeDecodeError):
        pass
    try:
        decoded = whole.decode("utf-8", "replace")
        return False, visible_surrogates(json.loads(decoded), decoded), text
    except (ValueError, RecursionError):  # a cut inside an event, or a value that does not convert
        return None


def _stream(path: Path, first: bytes, f: IO[bytes], block: int, count: int, tail: dict[str, Any] | None):
    """The rest of traceEvents from `first` and the file, one event at a time through json's decoder.

    Reads the list's end and the keys after it; a rolling buffer keeps memory bounded whatever the size.
    An event longer than what is buffered (any size up to MAX_EVENT_BYTES) is read whole: where the
    decoder stops inside it before the file's end, the buffer grows (doubling) and the event is decoded again.
    """
    dec = json.JSONDecoder()
    text = codecs.getincrementaldecoder("utf-8")("replace")
    buf, i, eof = text.decode(first), 0, False
    ahead = STREAM_AHEAD
    while True:
        n = len(buf)
        while i < n and buf[i] in " \t\r\n,":
            i += 1
        if not eof and n - i < ahead:
            more = f.read(max(block, ahead - (n - i)))
            eof = not more
            buf, i = buf[i:] + text.decode(more, final=eof), 0
            continue
        if i >= n:
            raise json.JSONDecodeError("the events list is not closed", buf, i)
        if buf[i] == "]":
            break
        try:
            start = i
            ev, i = dec.raw_decode(buf, i)
            if buf.find("\\u", start, i) >= 0:  # an escape: maybe a lone surrogate, which UTF-8 cannot hold
                ev = visible_surrogates(ev)
        except json.JSONDecodeError:
            if eof:
                raise
            if n - i > MAX_EVENT_BYTES:
                raise TraceError(
                    f"{path}: event {count + 1} is not whole within {MAX_EVENT_BYTES // 2**20} MiB (malformed "
                    "JSON, or an event larger than any torch.profiler writes)"
                ) from None
            # the event may be longer than the buffer: read more (doubling) and decode it again
            ahead = min(2 * (n - i), MAX_EVENT_BYTES + 1)
            continue
        ahead = STREAM_AHEAD
        count += 1
        yield ev
    if count:  # what follows the list is read too: the keys Kineto writes there, and nothing after the object
        rest = f.read(HEAD_LIMIT + 1)
        if len(rest) > HEAD_LIMIT:
            raise TraceError(
                f"{path}: more than {HEAD_LIMIT // 2**20} MiB after the traceEvents list (two traces in one file?)"
            )
        keys = _trailing_keys(path, buf[i + 1 :] + text.decode(rest, final=True))
        if tail is not None:
            tail.update(keys)


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
        keys = visible_surrogates(json.loads("{" + body + "}"), body) if body else {}
    except json.JSONDecodeError as e:
        raise TraceError(
            f"{path}: the keys after traceEvents are not valid JSON ({e.msg}; more than one JSON document in the file?)"
        ) from None
    except RecursionError:
        raise TraceError(f"{path}: the keys after traceEvents nest too deeply") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise TraceError(f"{path}: a value after traceEvents does not convert ({_first(e)})") from None
    return keys


def _first(e: BaseException) -> str:
    """An exception's first line, short: Python's message for a long integer runs on for a paragraph."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text.split(";")[0][:120]
