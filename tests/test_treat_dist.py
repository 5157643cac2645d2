"""`treat` of a distributed job: the distributed knobs (no_sync accumulation, DDP's bucket size, FSDP2's
reshard and prefetch, DDP for a model one GPU holds) are candidates like any other, composed from the
diagnosis of the job's joined ranks. The diagnoses are of real 2-rank NCCL recordings (fixtures/dist_gpu,
two H200s, 2026-11-27): what `treat` composes from each, on the config that ran it."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.doctor.treat_compose import compose
from vlmdoctor.run.config import RunConfig
from vlmdoctor.trace.facts import analyze

GPU = Path(__file__).resolve().parents[1] / "fixtures" / "dist_gpu"
RULES, _ = load_rules()


@cache
def job(case: str) -> dict:
    """The diagnosis of a recorded job's joined ranks (the facts `treat` reads of a distributed trial)."""
    return diagnose(analyze(GPU / case)["cross_rank"]["facts"], RULES)


def patches(cfg: RunConfig, case: str) -> list[dict]:
    skipped: list = []
    comps = compose(cfg, job(case), skipped)
    assert comps, f"nothing composed from {case}: {[f['id'] for f in job(case)['findings']]}"
    return [c["config_patch"] for c in comps[0]["changes"]]


def merged(ps: list[dict]) -> dict:
    out: dict = {}
    for p in ps:
        out.update(p)
    return out


def test_accumulation_without_no_sync_composes_no_sync():
    cfg = RunConfig(model="0.5b", stage=2, nproc_per_node=2, parallel="ddp", grad_accum=4)
    assert merged(patches(cfg, "ddp_accum_sync")).get("accum_no_sync") is True


def test_no_sync_is_not_composed_where_the_job_has_it():
    assert "system-accum-sync" not in {f["id"] for f in job("ddp_accum_nosync")["findings"]}
    cfg = RunConfig(model="0.5b", stage=2, nproc_per_node=2, parallel="ddp", grad_accum=4, accum_no_sync=True)
    comps = compose(cfg, job("ddp_accum_nosync"), [])
    assert all("accum_no_sync" not in ch["config_patch"] for comp in comps for ch in comp["changes"])
    # the accumulating job's finding on a config that already has no_sync: said, not composed
    skipped: list = []
    comps = compose(cfg, job("ddp_accum_sync"), skipped)
    assert all("accum_no_sync" not in ch["config_patch"] for comp in comps for ch in comp["changes"])
    assert {"rule": "system-accum-sync", "why": "the config already has it"} in [
        {"rule": s["rule"], "why": s["why"]} for s in skipped
    ]


def test_fsdp2_on_a_model_one_gpu_holds_composes_ddp():
    cfg = RunConfig(model="0.5b", stage=2, nproc_per_node=2, parallel="fsdp2")
    assert merged(patches(cfg, "fsdp2_reshard")).get("parallel") == "ddp"


def test_a_rank_given_more_tokens_composes_balanced_batches():
    cfg = RunConfig(model="0.5b", stage=2, nproc_per_node=2, parallel="ddp")
    assert merged(patches(cfg, "ddp_long_rank1")) == {"balance_tokens": True}


def test_a_healthy_job_and_a_small_bucket_over_nvlink_compose_nothing_distributed():
    """ddp_bucket1's 41 all-reduces a step leave 1.4% of the step exposed: the bucket rule stays silent."""
    cfg = RunConfig(model="0.5b", stage=2, nproc_per_node=2, parallel="ddp")
    for case in ("ddp_healthy", "ddp_bucket1"):
        comps = compose(cfg, job(case), [])
        knobs = {k for comp in comps for ch in comp["changes"] for k in ch["config_patch"]}
        assert not knobs & {"ddp_bucket_cap_mb", "accum_no_sync", "parallel", "balance_tokens", "fsdp_prefetch"}
