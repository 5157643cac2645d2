"""Rewrite docs/files.md's field table from the declarations: python -m vlmdoctor.documents"""

from __future__ import annotations

from pathlib import Path

from vlmdoctor.documents.fields import with_generated

if __name__ == "__main__":
    path = Path(__file__).resolve().parents[2] / "docs" / "files.md"
    path.write_text(with_generated(path.read_text()))
    print(f"wrote the fields table of {path}")
