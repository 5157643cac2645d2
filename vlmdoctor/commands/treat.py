"""`vlmdoctor treat`: apply the prescriptions together, verify on paired runs, confirm each change by ablation.

The ladder is doctor/treat.py's, its limits' defaults doctor/treat_options.py's (named here, not typed again), its
files report/treat_outputs.py's; here: the options, the start config, the checks before any run, the console."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from vlmdoctor import supervise
from vlmdoctor.commands import options
from vlmdoctor.commands.app import err, exit_if_failed, out, user_errors
from vlmdoctor.commands.knobs import knob_options, parse_sets
from vlmdoctor.commands.options import Ignore, RulesDirs, Select, hush_profiler, rule_choice
from vlmdoctor.doctor.select import mute_report
from vlmdoctor.doctor.treat_options import TreatOptions
from vlmdoctor.errors import UsageError
from vlmdoctor.files import check_distinct, check_inputs_kept, check_output_dir, check_writable, save, save_json
from vlmdoctor.inputs import check_number, check_rules_dirs
from vlmdoctor.report.console import esc, render_ladder
from vlmdoctor.run.config import RunConfig, override

#: the knobs `treat` takes as flags (others: --set), and its shorter window without --config
TREAT_KNOBS = ("model", "stage", "device", "steps", "warmup", "repeats", "nproc_per_node", "parallel")
TREAT_DEFAULTS = {"steps": 10, "repeats": 3}
#: the limits of a treatment where the command line does not set them
LIMITS = TreatOptions()
#: what treat writes into its --out folder
OUT_FILES = ("treat.json", "final_config.yaml", "ladder.png", "treat.html")

Config = Annotated[str | None, typer.Option("--config", help="start from this run config (YAML/JSON or a report)")]
Sets = Annotated[list[str] | None, typer.Option("--set", help="knob=value on top of the start config (repeatable)")]
MaxTrials = Annotated[
    int,
    typer.Option(
        "--max-trials",
        help="trials at most (a trial: one composition or one ablation, measured in several paired runs)",
    ),
]
TimeBudget = Annotated[
    float | None,
    typer.Option(
        "--time-budget",
        help="seconds; no run starts after this and a run's limit is cut to what is left",
    ),
]
MinGain = Annotated[
    float,
    typer.Option(
        "--min-gain",
        help=f"smallest throughput gain worth keeping ({LIMITS.min_gain} = {LIMITS.min_gain:.0%}): "
        "kept when the paired interval's lower bound is above it",
    ),
]
TrialTimeout = options.timeout("--trial-timeout")
MaxPairs = Annotated[
    int,
    typer.Option("--max-pairs", help=f"paired runs per comparison at most ({LIMITS.min_pairs} at least)"),
]
TrialGpus = Annotated[
    int,
    typer.Option(
        "--trial-gpus",
        help="GPUs the trials run on at once, every pair on one GPU: each round's pairs, a lane per GPU, and the "
        "final ablation's arms, a comparison per GPU (0 = every visible one; 1 on a CPU or with --nproc-per-node "
        "above 1)",
    ),
]
OutDir = Annotated[
    str | None,
    typer.Option(
        "--out",
        help="folder for treat.json, final_config.yaml, ladder.png [default: treat-MODEL-stageN]",
    ),
]
Html = options.html_out("also write the HTML report here (it is always written as treat.html in --out)")
Force = options.force("write into an --out folder that already holds results")
JsonAlso = options.json_also("also write the result JSON here ('-' = stdout)")
Quiet = options.quiet("no progress and no tables")


@knob_options(TREAT_KNOBS, TREAT_DEFAULTS, panels=False)
def treat(
    config: Config = None,
    sets: Sets = None,
    max_trials: MaxTrials = LIMITS.max_trials,
    time_budget: TimeBudget = LIMITS.time_budget_s,
    min_gain: MinGain = LIMITS.min_gain,
    trial_timeout: TrialTimeout = LIMITS.trial_timeout_s,
    max_pairs: MaxPairs = LIMITS.max_pairs,
    trial_gpus: TrialGpus = LIMITS.trial_gpus,
    rules_dirs: RulesDirs = None,
    select: Select = None,
    ignore: Ignore = None,
    out_dir: OutDir = None,
    html_path: Html = None,
    force: Force = False,
    json_path: JsonAlso = None,
    quiet: Quiet = False,
    **knobs: Any,
) -> None:
    """Apply the prescriptions together, verify on paired runs, confirm each change by ablation.

    Prints the ladder: each adopted round with its paired speedup, each change with its measured contribution.

    Then the trials not kept; writes the final run config, which `vlmdoctor profile --config` runs again.
    """
    from vlmdoctor.doctor.rules import load_rules  # deferred: pandas
    from vlmdoctor.report.treat_outputs import write_outputs  # deferred: PIL, msgspec; found before any run
    from vlmdoctor.run.runner import check  # deferred: torch

    with user_errors():
        check_number("--max-trials", max_trials, minimum=0, maximum=1000, integer=True)
        check_number("--time-budget", time_budget, above=0)
        check_number("--min-gain", min_gain, minimum=0, maximum=10)
        check_number("--trial-timeout", trial_timeout, above=0)
        check_number("--trial-gpus", trial_gpus, minimum=0, maximum=64, integer=True)
        cfg = _start_config(config, sets, knobs)
        check(cfg)
        folder = Path(out_dir or f"treat-{cfg.model}-stage{cfg.stage}")
        _check_folder(folder, json_path, html_path, force)
        check_rules_dirs(rules_dirs or [])
        selection, rules_dirs, _ = rule_choice(select, ignore, rules_dirs)
        if folder.is_dir() and any(folder.iterdir()) and not force:
            raise UsageError(f"{folder} already holds files; pass --force to write into it, or --out another folder")
        if folder.is_dir():  # the files treat will write there: never a link, fifo or folder
            for name in OUT_FILES:
                check_writable(folder / name, True, "--out")
        _, problems = load_rules(*(rules_dirs or []))
        for p in problems:
            err.print(f"rule problem: {esc(p)}", highlight=False)
        check_number("--max-pairs", max_pairs, minimum=LIMITS.min_pairs, maximum=1000, integer=True)
        check_writable(json_path if json_path != "-" else None, force, "--json")
        check_inputs_kept(
            {"the --config": config, "a --rules folder": rules_dirs},
            {"--out": [folder / n for n in OUT_FILES], "--html": html_path, "--json": json_path},
        )
        opts = TreatOptions(
            max_trials=max_trials,
            time_budget_s=time_budget or None,
            min_gain=min_gain,
            trial_timeout_s=trial_timeout,
            rules_dirs=list(rules_dirs or []),
            max_pairs=max_pairs,
            trial_gpus=trial_gpus,
        )
        result = _run(cfg, opts, folder, selection, quiet or json_path == "-")
        _outputs(write_outputs(result, folder), result, html_path, json_path, quiet)


def _start_config(config: str | None, sets: list[str] | None, knobs: dict[str, Any]) -> RunConfig:
    """The start config: --config (else the shorter window), then --set, then the flags; the later one wins."""
    cfg = RunConfig.load(config) if config else RunConfig(**TREAT_DEFAULTS)
    flags = {k: v for k, v in knobs.items() if v is not None}
    for source, changes in (("--set", parse_sets(sets or [])), ("command line", flags)):
        merged, dropped = override(cfg.to_dict(), changes, config or "the start config")  # the later one wins
        if dropped:
            err.print(f"note: {esc(dropped)}", highlight=False)
        cfg = RunConfig.from_dict(merged, source=source)
    return cfg


def _check_folder(folder: Path, json_path: str | None, html_path: str | None, force: bool) -> None:
    """The --out folder and the files beside it, before any run: no two outputs the same file, room on the disk."""
    check_distinct(json=json_path, html=html_path, out=folder / "treat.html")  # what --out always holds
    check_distinct(json=json_path, out=folder / "treat.json")
    check_output_dir(folder, "--out")
    inside = [p for p in (json_path, html_path) if p and p != "-" and Path(p).parent.resolve() == folder.resolve()]
    if inside and not folder.exists():
        folder.mkdir(parents=True)  # --out creates its folder, as `run` does: a file inside it is no missing folder
    check_writable(html_path, force, "--html")
    supervise.check_room(folder, "--out")  # compile caches and results: found full now, not after the trials
    supervise.check_file_folders(json=json_path, html=html_path)
    supervise.check_temp()


def _run(cfg: RunConfig, opts: TreatOptions, folder: Path, selection: Any, silent: bool) -> dict[str, Any]:
    """The treatment: each run in a fresh process (muted rules' fixes not tried), its progress on stderr."""
    from vlmdoctor.doctor import treat as treatment  # deferred: the command's own module; keeps --help fast
    from vlmdoctor.run.compile import cache_env  # deferred: torch
    from vlmdoctor.run.runner import run_isolated  # deferred: torch

    compile_env = cache_env(folder / "compile-cache")  # trials of one treatment reuse each other's compiled kernels

    def run_one(
        c: RunConfig, diagnose: bool, timeout: float | None, device: int | None = None, **arms: Any
    ) -> dict[str, Any]:
        env = compile_env | pinned(device)  # the child's environment only: this process's stays as it is
        # `arms`: in_process and in_process_s, the leave-one-out arms the run measures in its own process
        report = run_isolated(c, timeout=timeout, diagnose=diagnose, rules_dirs=opts.rules_dirs, env=env, **arms)
        return mute_report(report, selection)  # a muted rule's fix is not tried

    if silent:
        hush_profiler()
        return treatment.treat(cfg, run_one, opts)  # looked up when it runs (a test stands in for the ladder)
    from vlmdoctor.report.progress import TreatProgress  # deferred: only a treatment that shows progress needs it

    with err.status("treat") as status:
        t0 = time.time()
        follow = TreatProgress()  # a round's paired runs numbered as its pairs, not as rounds again

        def notify(msg: str) -> None:
            line = follow(msg)
            status.update(f"{esc(line.strip())}  [dim]({time.time() - t0:.0f} s so far)[/dim]")
            err.print(f"[dim]{esc(line)}[/dim]", highlight=False)

        return treatment.treat(cfg, run_one, opts, notify)


def pinned(device: int | None) -> dict[str, str]:
    """The environment that pins a child run to the `device`-th GPU this process sees (through its own
    CUDA_VISIBLE_DEVICES, where set): the ablation's comparisons on several GPUs, one each."""
    if device is None:
        return {}
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {"CUDA_VISIBLE_DEVICES": seen[device] if device < len(seen) else str(device)}


def _outputs(
    written: tuple[dict[str, Any], list[str | None]],
    result: dict[str, Any],
    html_path: str | None,
    json_path: str | None,
    quiet: bool,
) -> None:
    """After the --out folder's files (`written`: their paths and failures): --html, --json and the ladder on the
    console; exit 1 when nothing was adopted, 130 when interrupted."""
    paths, failures = written
    if html_path:
        from vlmdoctor.report.html import treat_html  # deferred: the HTML builder; keeps --help fast

        failures.append(save(html_path, treat_html(result), "HTML report"))
    failures.append(save_json(result, json_path, "result JSON"))
    if not quiet and json_path != "-":
        render_ladder(result, out)
        out.print(f"written: {esc(', '.join(str(p) for p in paths.values()))}", highlight=False)
        out.print(f"run the final config again: vlmdoctor profile --config {esc(paths['config'])}", highlight=False)
    exit_if_failed(failures)
    if result["interrupted"]:
        raise typer.Exit(result.get("exit_code") or 130)
    if not result["ladder"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(treat)
