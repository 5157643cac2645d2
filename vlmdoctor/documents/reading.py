"""Reading a document through its declaration: checked once, field by field, a bad one refused with one line that
names the field (`DocumentError`, exit 2); a document of another kind, or of a newer schema, said to be so first."""

from __future__ import annotations

import math
import os
import re
from typing import Any, TypeVar

import msgspec

from vlmdoctor import SCHEMA_VERSION
from vlmdoctor.documents.analysis import Analysis
from vlmdoctor.documents.base import MAX_DOCUMENT_BYTES, Doc, DocumentError
from vlmdoctor.documents.run_report import RecordedConfig, RunReport
from vlmdoctor.documents.treat import TreatResult

D = TypeVar("D", bound=Doc)

#: the documents with a `kind` and a `schema_version`: kind, what to call it, what writes it
_KINDS: dict[type[Doc], tuple[str, str, str]] = {
    RunReport: ("profile", "profile report", "the report JSON written by `vlmdoctor profile --json`"),
    Analysis: ("analysis", "analysis result", "the JSON written by `vlmdoctor analyze --json`"),
    TreatResult: ("treat", "treat result", "the treat.json written by `vlmdoctor treat`"),
}


def as_document(value: Any, cls: type[D], name: str) -> D:
    """`value` (parsed JSON) as the document `cls` declares, or one DocumentError naming `name` and the field.

    A document of another kind, or of a newer schema, is said to be so before its fields are read."""
    if cls in _KINDS:
        kind, what, writer = _KINDS[cls]
        if not isinstance(value, dict):
            raise DocumentError(f"{name}: not a vlmdoctor {what} (the JSON is a {type(value).__name__}, not an object)")
        other = value.get("kind")
        if other is None and cls is RunReport:  # an older vlmdoctor wrote reports without a kind
            other = kind
        if other is None:
            raise DocumentError(f"{name}: not a vlmdoctor {what} (no kind); pass {writer}")
        if other != kind:
            raise DocumentError(f"{name}: a vlmdoctor {other} result, not a {what}; pass {writer}")
        version = value.get("schema_version")
        if version is None:
            raise DocumentError(f"{name}: not a vlmdoctor {what} (no schema_version)")
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            raise DocumentError(
                f"{name}: schema_version {version} was written by a newer vlmdoctor "
                f"(this one reads up to {SCHEMA_VERSION}); upgrade vlmdoctor"
            )
    try:
        doc = msgspec.convert(value, cls)
        if isinstance(doc, RunReport) and doc.config is not None:
            _convert_at(doc.config, RecordedConfig, "config")
    except msgspec.ValidationError as e:
        raise DocumentError(f"{name}: {_problem(str(e), value)}") from None
    return doc


def _convert_at(value: Any, cls: type[D], at: str) -> D:
    """msgspec.convert, its error's field path starting at `at`."""
    try:
        return msgspec.convert(value, cls)
    except msgspec.ValidationError as e:
        text, _, where = str(e).partition(" - at `$")
        raise msgspec.ValidationError(f"{text} - at `$.{at}{where}") from None


def _problem(text: str, value: Any) -> str:
    """msgspec's message as one line of vlmdoctor's: the field first, then what it must be and what it is."""
    what, _, where = text.partition(" - at `$")
    path = where.rstrip("`").lstrip(".")
    got = _at(value, path)
    missing = re.fullmatch(r"Object missing required field `(\w+)`", what)
    if missing:
        field = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return f"{field}: missing (a required field)"
    bound = re.fullmatch(r"Expected `(\w+)` (>=|>|<=|<) (-?[\d.e+]+)", what)
    if bound:
        kind, op, limit = bound.groups()
        if isinstance(got, float) and not math.isfinite(got):
            must = "must be a finite number"
        elif (op, float(limit)) == (">=", 0.0):
            must = "must not be negative"
        else:
            must = f"must be {'a whole number' if kind == 'int' else 'a number'} {op} {limit.removesuffix('.0')}"
        return f"{path}: {must}, got {got!r}"
    expected = re.fullmatch(r"Expected `([^`]+)`, got `(\w+)`", what)
    if expected:
        return f"{path or 'the document'}: expected {_words(expected.group(1))}, got {_words(expected.group(2))}"
    return f"{path}: {what}" if path else what


#: msgspec's type names, as the error line says them
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "str": "text", "bool": "true/false", "null": "null"}
_TYPE_WORDS |= {"array": "a list", "object": "an object"}


def _words(types: str) -> str:
    return " or ".join(_TYPE_WORDS.get(t.strip(), t.strip()) for t in types.split("|"))


def _at(value: Any, path: str) -> Any:
    """The value at a msgspec field path (`metrics.step_ms`, `repeats[0].step_ms[2]`), or None."""
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        try:
            value = value[int(index)] if index else value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _json(source: str | os.PathLike | bytes, name: str | None, what: str) -> tuple[Any, str]:
    """Parsed JSON of a file (every bound of vlmdoctor/inputs.py: a regular file, its size, UTF-8, nesting) or of
    bytes, and the name its errors use."""
    from vlmdoctor import inputs  # reads files for every input kind; imported here, the declarations stay a leaf

    if isinstance(source, bytes):
        where = name or what
        return inputs.parse_json(source, where), where
    return inputs.read_json(source, what, max_bytes=MAX_DOCUMENT_BYTES), name or str(source)


def read_document(source: str | os.PathLike | bytes, cls: type[D], what: str, name: str | None = None) -> D:
    """A document (a path, or its bytes) checked against its declaration `cls`; `what` names it in errors."""
    value, where = _json(source, name, what)
    return as_document(value, cls, where)


def read_report(source: str | os.PathLike | bytes, name: str | None = None) -> RunReport:
    """A report.json (a path, or its bytes), checked against its declaration."""
    return read_document(source, RunReport, "report", name)


def read_analysis(source: str | os.PathLike | bytes, name: str | None = None) -> Analysis:
    """An `analyze --json` result, checked against its declaration."""
    return read_document(source, Analysis, "analysis", name)


def as_json(doc: Doc) -> dict[str, Any]:
    """A declared document as its JSON holds it, for code that reads the JSON (the throughput estimator): a top-level
    field it does not have left out, and a value JSON cannot hold (torch's version string) as its text, as the writer
    (files.json_text) leaves them."""
    return {k: v for k, v in msgspec.to_builtins(doc, enc_hook=str).items() if v is not None}


def as_report(report: RunReport | dict[str, Any], name: str = "report") -> RunReport:
    """A report read by field: a RunReport as it is, a report's dict through its declaration."""
    return report if isinstance(report, RunReport) else as_document(report, RunReport, name)
