"""The field table of docs/files.md, generated from the declarations: one table per document and per part it
holds (`python -m vlmdoctor.documents` rewrites it)."""

from __future__ import annotations

import msgspec

from vlmdoctor import docgen
from vlmdoctor.documents.analysis import Analysis
from vlmdoctor.documents.base import Doc
from vlmdoctor.documents.comparison import Comparison
from vlmdoctor.documents.diagnosis import Diagnosis
from vlmdoctor.documents.gate import GateVerdict
from vlmdoctor.documents.run_report import RecordedConfig, RunReport
from vlmdoctor.documents.treat import TreatResult

#: the declarations docs/files.md lists first, in this order; the parts they hold follow
DOCUMENTS: tuple[type[Doc], ...] = (
    RunReport,
    RecordedConfig,
    Diagnosis,
    Analysis,
    TreatResult,
    GateVerdict,
    Comparison,
)


def _type_text(t: msgspec.inspect.Type) -> tuple[str, str, list[type[Doc]]]:
    """(the type in words, its description, the declared parts it holds)."""
    ins = msgspec.inspect
    if isinstance(t, ins.Metadata):
        text, desc, parts = _type_text(t.type)
        unit = (t.extra or {}).get("unit")
        return text + (f" ({unit})" if unit else ""), (t.extra_json_schema or {}).get("description") or desc, parts
    if isinstance(t, ins.UnionType):
        kinds = [_type_text(x) for x in t.types if not isinstance(x, ins.NoneType)]
        texts = list(dict.fromkeys(k[0] for k in kinds))
        texts = [x for x in texts if not (x.startswith("integer") and "number" + x.removeprefix("integer") in texts)]
        text = " or ".join(texts) + (" or null" if len(kinds) < len(t.types) else "")
        return text, next((k[1] for k in kinds if k[1]), ""), [p for k in kinds for p in k[2]]
    if isinstance(t, (ins.IntType, ins.FloatType)):
        bounds = [f"{op} {v:g}" for op, v in ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt)) if v is not None]
        if t.ge is not None and t.le is not None:
            bounds = [f"{t.ge:g}..{t.le:g}"]
        return ("integer" if isinstance(t, ins.IntType) else "number") + "".join(f" {b}" for b in bounds), "", []
    if isinstance(t, ins.ListType):
        text, desc, parts = _type_text(t.item_type)
        return f"list of {_one(text)}", desc, parts
    if isinstance(t, ins.DictType):
        text, _, parts = _type_text(t.value_type)
        return ("object" if text == "any" else f"object of {_one(text)}"), "", parts
    if isinstance(t, ins.StructType):
        return f"`{t.cls.__name__}`", (t.cls.__doc__ or "").split("\n")[0], [t.cls]
    words = {ins.StrType: "text", ins.BoolType: "true/false", ins.AnyType: "any"}
    return words.get(type(t), type(t).__name__), "", []


def _one(text: str) -> str:
    return f"({text})" if " or " in text else text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_fields() -> str:
    """The field table of every declared document and part, for docs/files.md: one table each, the documents
    first, then the parts in the order they are met."""
    todo, seen, out = list(DOCUMENTS), set(), []
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        out += [f"### `{cls.__name__}`", "", " ".join((cls.__doc__ or "").split()), ""]
        out += ["| field | type | meaning |", "|---|---|---|"]
        for f in msgspec.inspect.type_info(cls).fields:
            text, desc, parts = _type_text(f.type)
            out.append(f"| `{f.encode_name}` | {_cell(text)}{', required' if f.required else ''} | {_cell(desc)} |")
            todo += parts
        out.append("")
    return "\n".join(out)


_BEGIN = "<!-- fields table: generated from vlmdoctor/documents/ (python -m vlmdoctor.documents) -->\n"
_END = "<!-- end of the generated fields table -->\n"


def with_generated(text: str) -> str:
    """docs/files.md's text with its field table rewritten from the declarations."""
    return docgen.with_generated(text, _BEGIN, _END, markdown_fields(), "fields table")
