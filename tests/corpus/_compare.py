"""What the differential test (tests/test_differential.py) and the probe's observer family
(bench/probe/observe_driver.py) both need to compare a watched run with a plain one."""

from __future__ import annotations

from pathlib import Path

#: plain python with torch's generator started from a given seed (an unseeded script replayed):
#: `python -c SHIM SEED SCRIPT ARGS`
SHIM = (
    "import runpy, sys, torch; torch.manual_seed(int(sys.argv[1])); sys.argv = sys.argv[2:]; "
    "sys.path[0] = sys.argv[0].rsplit('/', 1)[0]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def written(folder: Path, volatile: tuple[str, ...] = ()) -> dict[str, bytes | None]:
    """Every file a script wrote in its folder, by its path there; a volatile one (its content holds times)
    by its presence only."""
    return {
        str(p.relative_to(folder)): None if p.name in volatile else p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
