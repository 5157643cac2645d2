"""`vlmdoctor export`: a trace (or a report's kept trace) for Perfetto or Holistic Trace Analysis (trace/export.py);
here: the options, the checks and the list of files written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vlmdoctor.commands import options
from vlmdoctor.commands.app import exit_if_failed, out, user_errors
from vlmdoctor.errors import UsageError
from vlmdoctor.files import check_inputs_kept, check_output_dir, check_writable, save_json
from vlmdoctor.report.console import esc

Source = Annotated[
    str, typer.Argument(help="a profile report JSON (its kept trace) or a trace file / folder of rank traces")
]
Chrome = Annotated[
    str | None, typer.Option("--chrome", help="write gzipped Chrome JSON (opens in Perfetto) here, *.json.gz")
]
HtaDir = Annotated[
    str | None,
    typer.Option(
        "--hta-dir",
        help="write a folder of per-rank traces as Holistic Trace Analysis (traceinsight) reads them",
    ),
]
JsonOut = options.json_out("list of files written")
Force = options.force("overwrite existing output")


def export(
    source: Source, chrome: Chrome = None, hta_dir: HtaDir = None, json_path: JsonOut = None, force: Force = False
) -> None:
    """Export a trace for Perfetto (ui.perfetto.dev) or for Holistic Trace Analysis."""
    # deferred: the trace's reader and writers; keeps --help fast
    from vlmdoctor.trace.export import export_chrome, export_hta_folder, trace_of_report
    from vlmdoctor.trace.read import trace_files

    with user_errors():
        check_writable(chrome, force, "--chrome")  # an empty path or a folder's name: refused before anything
        if not chrome and not hta_dir:
            raise UsageError("say where: --chrome OUT.json.gz and/or --hta-dir DIR")
        check_output_dir(hta_dir, "--hta-dir")
        src = trace_of_report(Path(source))
        check_writable(json_path, force)
        check_inputs_kept(
            {"the source": source, "its trace": src}, {"--chrome": chrome, "--hta-dir": hta_dir, "--json": json_path}
        )
        files = trace_files(src)
        written: dict[str, str] = {}
        if chrome:
            if len(files) != 1:
                raise UsageError(f"{src} holds {len(files)} traces; --chrome exports one (use --hta-dir for ranks)")
            written["chrome"] = str(export_chrome(files[0], Path(chrome), force))
        if hta_dir:
            written["hta_dir"] = str(export_hta_folder(files, Path(hta_dir), force))
        if json_path:
            listing = {"source": str(src), "traces": [str(f) for f in files], "written": written}
            exit_if_failed([save_json(listing, json_path, "list of files written")])
        if json_path != "-":
            for path in written.values():
                out.print(f"written: {esc(path)}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(export)
