"""One rank of a distributed run: what torchrun starts in every process.

`python -m torch.distributed.run ... -m vlmdoctor.run.rank_worker --config C --out DIR [--trace JSON]`
runs `run_profile` (which joins the process group torchrun prepared). Every rank ends with the
job's numbers (they are all-gathered); local rank 0 of each node writes the job's report to
DIR/report.json, for the `vlmdoctor profile` process that launched that node's ranks. A rank whose run
fails writes DIR/report_rank<R>.json and exits with the run's exit code, so that torchrun stops the other
ranks (they would wait for it forever).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vlmdoctor import SCHEMA_VERSION
from vlmdoctor.errors import EXIT_USAGE, VlmdoctorError
from vlmdoctor.run import distributed
from vlmdoctor.run.capture import TraceOptions
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.runner import exit_code, run_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlmdoctor.run.rank_worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace", default=None, help="TraceOptions as JSON")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)

    def write(name: str, report: dict) -> None:
        tmp = out / f".{name}.tmp"
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(out / name)

    try:
        cfg = RunConfig.load(args.config)
        trace = TraceOptions(**json.loads(args.trace)) if args.trace else None
        report = run_profile(cfg, trace=trace)
    except VlmdoctorError as e:
        write(
            f"report_rank{rank}.json",
            {
                "schema_version": SCHEMA_VERSION,
                "status": "usage_error",
                "rank": rank,
                "error": {"type": "UsageError", "message": str(e), "rank": rank},
            },
        )
        return getattr(e, "exit_code", EXIT_USAGE)
    code = exit_code(report)
    if "distributed" in report:  # every rank reached the gather and holds the job's numbers
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one report per node, for its launching process
            write("report.json", report)
        distributed.teardown()
        return code
    report.setdefault("error", {})["rank"] = rank  # this rank failed before the gather
    report["rank"] = rank
    write(f"report_rank{rank}.json", report)
    return code or 1


if __name__ == "__main__":
    sys.exit(main())
