"""The multi-process launchers `vlmdoctor run` follows: torchrun (`python -m torch.distributed.run`) and
`accelerate launch`.

A launcher starts the training script once per rank. Both have an option to run a Python module
instead of a script (`-m` / `--module`), and vlmdoctor uses it: the command comes back with the
script replaced by `-m vlmdoctor.own.rank_entry SCRIPT ARGS`, so every rank starts in vlmdoctor's
bootstrap (rank_entry.py: child.child_main), which hooks the optimizer and then runs SCRIPT as
`__main__`, as `vlmdoctor run -- python SCRIPT ARGS` does for one process. The launcher's own options are left
as they are; where the script starts is read with the launcher's own argument parser, so that an
option's value is never taken for the script.

    python -m vlmdoctor.own.rank_entry SCRIPT ARGS     # what each rank runs (never typed by hand)
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmdoctor.errors import UsageError

#: the module each rank runs in front of the script
ENTRY = "vlmdoctor.own.rank_entry"
#: launchers that start several processes but that vlmdoctor does not follow (yet): refused with a hint
NOT_FOLLOWED = {"deepspeed", "mpirun", "srun", "mpiexec"}


def _torchrun_parser() -> Any:
    from torch.distributed.run import get_args_parser  # deferred: torch

    return get_args_parser()


def _accelerate_parser() -> Any:
    try:
        from accelerate.commands.launch import launch_command_parser  # deferred: accelerate, an optional extra
    except ImportError as e:
        raise UsageError("accelerate launch: accelerate is not installed here (pip install accelerate)") from e
    return launch_command_parser()


def launcher_of(command: Sequence[str]) -> tuple[str, int] | None:
    """('torchrun' | 'accelerate', index where the launcher's own arguments start), or None: no launcher."""
    cmd = list(command)
    if not cmd:
        return None
    name = Path(cmd[0]).name
    if name in NOT_FOLLOWED:
        raise UsageError(
            f"{name} starts several processes in a way vlmdoctor run does not follow yet; "
            "it follows torchrun and accelerate launch (or one process: vlmdoctor run -- python train.py ARGS)"
        )
    if name == "torchrun":
        return "torchrun", 1
    if name == "accelerate" and len(cmd) > 1 and cmd[1] == "launch":
        return "accelerate", 2
    if name.startswith("python") and not name.endswith(".py"):  # python [-u] -m torch.distributed.run ...
        i = 1
        while i < len(cmd) and cmd[i] in ("-u", "-B", "-O", "-OO"):
            i += 1
        if cmd[i : i + 2] == ["-m", "torch.distributed.run"]:
            return "torchrun", i + 2
        if cmd[i : i + 2] == ["-m", "accelerate.commands.launch"]:
            return "accelerate", i + 2
    return None


def rank_command(command: Sequence[str], cwd: str | None = None) -> list[str] | None:
    """The launcher command with vlmdoctor's bootstrap in front of the script on every rank; None: no launcher."""
    found = launcher_of(command)
    if found is None:
        return None
    kind, start = found
    cmd = list(command)
    rest = cmd[start:]
    parser = _torchrun_parser() if kind == "torchrun" else _accelerate_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(rest)
    except SystemExit as e:  # argparse's own words, on one line
        why = next((ln for ln in reversed(said.getvalue().splitlines()) if "error:" in ln), "cannot read its options")
        raise UsageError(f"{kind}: {why.split('error:', 1)[-1].strip()}") from e
    if getattr(args, "no_python", False):
        raise UsageError(f"{kind}: --no-python runs a program, not a Python script; vlmdoctor cannot enter it")
    script_args = list(args.training_script_args or [])
    split = len(rest) - len(script_args) - 1
    if split < 0 or rest[split] != args.training_script:
        raise UsageError(f"{kind}: could not find the training script in {' '.join(rest)}")
    options = rest[:split]
    module = bool(getattr(args, "module", False))
    if module:
        options = [o for o in options if o not in ("-m", "--module")]
    elif not (Path(cwd or ".") / args.training_script).is_file():
        raise UsageError(f"{args.training_script}: no such script file")
    target = ["-m", args.training_script] if module else [args.training_script]
    return cmd[:start] + options + ["-m", ENTRY] + target + script_args
