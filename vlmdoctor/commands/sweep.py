"""`vlmdoctor sweep`: run a list of configurations, one fresh process each, and tabulate them. The grid and the runs
are ci/sweep.py's; here: the options, the plan from a grid file or --set products, the checks, the table."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from vlmdoctor import supervise
from vlmdoctor.commands import options
from vlmdoctor.commands.app import err, exit_if_failed, out, user_errors
from vlmdoctor.commands.knobs import knob_options, parse_sets
from vlmdoctor.commands.options import Timeout
from vlmdoctor.errors import UsageError, VlmdoctorError
from vlmdoctor.files import check_distinct, check_inputs_kept, check_writable, save, save_json
from vlmdoctor.inputs import check_number
from vlmdoctor.report.console import esc, render_sweep
from vlmdoctor.supervise import RUN_TIMEOUT_S, describe_interruption, interrupted_exit_code

Grid = Annotated[str | None, typer.Argument(help="a grid YAML: defaults, runs (name, set, optional stages), stages")]
Sets = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="knob=v1,v2,... : every combination is run "
        "(repeatable); with a grid file, knob=value applies to every row",
    ),
]
Stages = Annotated[list[int] | None, typer.Option("--stage", help="only these stages (repeatable)")]
Csv = Annotated[str | None, typer.Option("--csv", help="write the results table as CSV")]
Jsonl = Annotated[str | None, typer.Option("--jsonl", help="append each run's full report as a JSON line")]
Diagnose = Annotated[bool, typer.Option("--diagnose/--no-diagnose", help="trace and diagnose each run")]
JsonOut = options.json_out("results table")
Force = options.force("overwrite an existing --csv or --json file")


@knob_options(("nproc_per_node", "parallel"), panels=False, note="(every run; a --set value wins)")
def sweep(
    grid: Grid = None,
    sets: Sets = None,
    stages: Stages = None,
    csv_path: Csv = None,
    jsonl_path: Jsonl = None,
    diagnose_runs: Diagnose = False,
    timeout: Timeout = RUN_TIMEOUT_S,
    json_path: JsonOut = None,
    force: Force = False,
    **knobs: Any,
) -> None:
    """Run a list of configurations, one fresh process each, and tabulate them side by side."""
    from vlmdoctor.ci.sweep import csv_text, load_grid, product_grid, run_sweep  # deferred: the command's own module

    with user_errors():
        check_number("--timeout", timeout, above=0)
        check_distinct(csv=csv_path, json=json_path, jsonl=jsonl_path)
        check_writable(csv_path, force, "--csv")
        check_writable(json_path, force, "--json")
        check_writable(jsonl_path, True, "--jsonl")  # appended to: an existing regular file is fine
        check_inputs_kept({"the grid": grid}, {"--csv": csv_path, "--json": json_path, "--jsonl": jsonl_path})
        supervise.check_file_folders(csv=csv_path, json=json_path, jsonl=jsonl_path)
        supervise.check_temp()  # each run's report goes there first
        launch = {k: v for k, v in knobs.items() if v is not None}
        if grid:  # every run launched the same way (--set knob=value wins)
            plan = load_grid(grid, {**launch, **parse_sets(sets or [])}, stages)
        elif sets:
            values = parse_sets(sets, many=True)
            for k, v in launch.items():
                values.setdefault(k, [v])
            plan = product_grid(values, stages)
        else:
            raise UsageError("give a grid YAML file or at least one --set knob=v1,v2")
        from vlmdoctor.run.runner import check  # deferred: torch, once the grid is read

        for name, c in plan:  # a run this machine refuses (a GPU preset without a GPU, say) is refused up front
            try:
                check(c)
            except VlmdoctorError as e:
                raise UsageError(f"{name}: {e.message}") from None
        with err.status("sweep") as status:

            def notify(i: int, n: int, name: str) -> None:
                status.update(f"run {i}/{n}: {esc(name)}")

            problems: list[str] = []
            rows: list[dict[str, Any]] = []
            interrupted: KeyboardInterrupt | None = None
            try:
                run_sweep(plan, timeout, diagnose_runs, jsonl_path, notify, problems, rows)
            except KeyboardInterrupt as e:  # the run in flight was stopped; the finished rows are kept below
                interrupted = e
        _outputs(rows, len(plan), problems, interrupted, csv_path, json_path, csv_text)


def _outputs(
    rows: list[dict[str, Any]],
    planned: int,
    problems: list[str],
    interrupted: KeyboardInterrupt | None,
    csv_path: str | None,
    json_path: str | None,
    csv_text: Any,
) -> None:
    """The results table (console, CSV, JSON), the runs' problems, and the exit code."""
    failures = [save_json({"runs": rows}, json_path, "sweep JSON")]
    if json_path != "-":
        render_sweep(rows, out)
    if csv_path:
        failures.append(save(csv_path, csv_text(rows), "results table"))
        if json_path != "-" and not failures[-1]:
            out.print(f"written: {esc(csv_path)}", highlight=False)
    if interrupted is not None:
        err.print(
            f"{describe_interruption(interrupted)}: {len(rows)} of {planned} run(s) finished, kept above",
            highlight=False,
            markup=False,
        )
    exit_if_failed([*failures, *problems])
    if interrupted is not None:
        raise typer.Exit(interrupted_exit_code(interrupted))


def register(app: typer.Typer) -> None:
    app.command()(sweep)
