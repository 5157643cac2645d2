"""The docs' generated tables: a table between two marker lines of a doc, rewritten from the code that declares it
(the fact catalogue, the declared documents), so the doc and the code cannot drift apart."""

from __future__ import annotations


def with_generated(text: str, begin: str, end: str, body: str, what: str) -> str:
    """`text` with what stands between its `begin` and `end` marker lines replaced by `body`."""
    if begin not in text or end not in text:
        raise ValueError(f"no generated {what} (markers {begin.strip()} ... {end.strip()})")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + body + end + tail
