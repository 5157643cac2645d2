"""A one-rank DDP trace recorded through NCCL on the H100 (fixtures/dist_h100/README.md)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from vlmdoctor.cli import app

TRACE = Path(__file__).parent.parent / "fixtures" / "dist_h100" / "ddp_1gpu_rank0.pt.trace.json.gz"


def test_the_nccl_ops_are_there_and_no_kernel_moved_data():
    d = json.loads(gzip.open(TRACE).read())
    assert d["distributedInfo"]["backend"] == "nccl" and d["distributedInfo"]["world_size"] == 1
    comms = [e for e in d["traceEvents"] if e.get("name") == "record_param_comms"]
    assert comms and all("In msg nelems" in e["args"] for e in comms)
    assert not [e for e in d["traceEvents"] if str(e.get("name", "")).startswith(("ncclDevKernel", "ncclKernel"))]


def test_a_one_rank_folder_is_analyzed_without_inventing_communication(tmp_path):
    """One rank moves no data: no communication facts, no distributed finding, the GPU rules still run."""
    shutil.copy(TRACE, tmp_path / TRACE.name)
    r = CliRunner().invoke(app, ["analyze", str(tmp_path), "--json", "-"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    facts = out["files"][0]["facts"]
    assert not [k for k in facts if k.startswith(("comm.", "dist."))]
    assert facts["gpu.busy_frac"] > 0 and facts["launch.kernels"] > 1000
    assert not out.get("cross_rank")
