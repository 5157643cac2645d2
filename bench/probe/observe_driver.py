"""One case of the observer family: a corpus script (tests/corpus/) run plain and under one way in, with the
same window, environment and interpreter options on both sides; prints USER-OK when the losses (bit for bit),
every file the script wrote and its exit code are the same, else USER-CHANGED and what differs.

    python observe_driver.py '{"script": "loop_dropout_seeded.py", "way": "run", "window": [1, 2, 1]}'

Keys: script; way (run, doctor, callback, run-stop); window [warmup, steps, trace_steps]; flags (interpreter
options); ranks (torchrun processes). The environment the case gives applies to both sides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CORPUS = Path(os.environ["PROBE_ROOT"]) / "tests" / "corpus"
PY = sys.executable
sys.path.insert(0, str(CORPUS))
from _compare import SHIM, written  # noqa: E402


def files(folder: Path) -> dict[str, bytes | None]:
    """What the script wrote; its own profiler's trace holds times, so only its presence counts."""
    return written(folder, ("mine.json",))


def command(spec: dict, seed: str | None = None) -> list[str]:
    script = str(CORPUS / spec["script"])
    if spec.get("ranks"):
        return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['ranks']}", script]
    if seed is not None:
        return [PY, *spec.get("flags", []), "-c", SHIM, seed, script]
    return [PY, *spec.get("flags", []), script]


def run(spec: dict, way: str, seed: str | None = None) -> tuple[int, dict, str]:
    cwd = Path(f"{way}-cwd{'-' + seed if seed else ''}")
    cwd.mkdir()
    out = Path("out").resolve()
    env = dict(os.environ)
    w, s, t = spec.get("window", [1, 2, 1])
    cmd = command(spec, seed)
    if way in ("doctor", "callback"):
        env |= {"CORPUS_WAY": way, "CORPUS_OUT": str(out), "CORPUS_WINDOW": f"{w},{s},{t}"}
    elif way in ("run", "run-stop"):
        stop = ["--stop-after-window"] if way == "run-stop" else []
        window = ["--warmup", str(w), "--steps", str(s), "--trace-steps", str(t)]
        cmd = [PY, "-m", "vlmdoctor", "run", "--out", str(out), *window, "--quiet", *stop, "--", *cmd]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    return p.returncode, files(cwd), (p.stdout + p.stderr)[-1500:]


def main() -> None:
    spec = json.loads(sys.argv[1])
    way = spec["way"]
    code, wrote, said = run(spec, way)
    seed = None
    if "losses.json" in wrote and b'"seed"' in (wrote["losses.json"] or b""):
        seed = json.loads(wrote["losses.json"])["seed"]  # unseeded: the plain run replays the watched run's seed
    p_code, p_wrote, p_said = run(spec, "plain", seed)
    changed = []
    if way == "run-stop":  # stopped after the window: exit 0 with the report, the loop never reached its end
        if code != 0:
            changed.append(f"exit {code} after the stop (plain {p_code})")
        if not Path("out/report.json").is_file():
            changed.append("no report")
    else:
        if code != p_code:
            changed.append(f"exit code {code}, plain {p_code}")
        if sorted(wrote) != sorted(p_wrote):
            changed.append(f"files {sorted(wrote)} against plain {sorted(p_wrote)}")
        changed += [f"{name} differs" for name in p_wrote if name in wrote and wrote[name] != p_wrote[name]]
    if changed:
        print("USER-CHANGED " + "; ".join(changed)[:400], flush=True)
        print(said, file=sys.stderr)
        print(p_said, file=sys.stderr)
    else:
        print("USER-OK", flush=True)


if __name__ == "__main__":
    main()
