"""Distributed runs through torchrun: real 2-process gloo jobs of the tiny model on the CPU.

The jobs are launched the way a user launches them (`vlmdoctor profile --nproc-per-node 2
--parallel ddp|fsdp2`), so torchrun, the process group, the collectives, the per-rank traces and
the rank-0 report are all real; only the device is the CPU.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vlmdoctor.errors import UsageError
from vlmdoctor.run import distributed
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.data import BatchSampler

ROOT = Path(__file__).resolve().parent.parent
#: a few seconds of model time per job: two timed steps, one warm-up step, one traced step
SMALL = [
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--batch-size",
    "1",
    "--num-samples",
    "8",
    "--trace-steps",
    "1",
    "--seed",
    "3",
]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "vlmdoctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def trace_info(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f).get("distributedInfo")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One one-process run (in this process), then the same config on 2 DDP ranks, judged against it."""
    from typer.testing import CliRunner

    from vlmdoctor.cli import app

    d = tmp_path_factory.mktemp("dist")
    one = CliRunner().invoke(app, ["profile", *SMALL, "--json", str(d / "one.json"), "--quiet", "--no-diagnose"])
    assert one.exit_code == 0, one.output[-2000:]
    ddp = cli(
        "profile",
        *SMALL,
        "--nproc-per-node",
        "2",
        "--parallel",
        "ddp",
        "--trace-dir",
        str(d / "traces"),
        "--one-gpu-report",
        str(d / "one.json"),
        "--json",
        str(d / "ddp.json"),
        "--quiet",
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    return {
        "dir": d,
        "one": json.loads((d / "one.json").read_text()),
        "ddp": json.loads((d / "ddp.json").read_text()),
    }


def test_every_rank_writes_its_trace_into_one_folder(runs):
    r = runs["ddp"]
    paths = r["trace"]["rank_paths"]
    assert len(paths) == 2 and len({Path(p).parent for p in paths}) == 1
    assert Path(r["trace"]["dir"]).parent == runs["dir"] / "traces"  # a folder of its own per run
    for rank, p in enumerate(paths):
        assert f"rank{rank}" in Path(p).name and Path(p).exists()
        info = trace_info(p)  # torch.profiler writes it once the process group exists
        assert info["rank"] == rank and info["world_size"] == 2 and info["backend"] == "gloo"


def test_the_diagnosis_joins_the_ranks_traces(runs):
    """The report's diagnosis reads the job's folder of rank traces, not rank 0's alone."""
    cross = runs["ddp"]["cross_rank"]
    assert sorted(r["rank"] for r in cross["ranks"]) == [0, 1]
    assert any(k.startswith("dist.") for k in runs["ddp"]["facts"])


def test_report_holds_per_rank_and_global_numbers(runs):
    r = runs["ddp"]
    d, m = r["distributed"], r["metrics"]
    assert r["status"] == "ok" and d["world_size"] == 2 and d["backend"] == "gloo" and d["parallel"] == "ddp"
    ranks = d["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1]
    for x in ranks:
        assert x["step_ms"] > 0 and x["real_tokens"] > 0 and x["real_tokens_per_s"] > 0
    # global: all ranks' real tokens over the slowest rank's wall time; ms/step is the slowest rank's
    (rep,) = r["repeats"]
    assert d["global"]["real_tokens"] == sum(x["real_tokens"] for x in ranks) == sum(rep["step_real_tokens"])
    # the one estimator over the global per-step samples (run/throughput.py)
    rates = sorted(t / (ms / 1e3) for t, ms in zip(rep["step_real_tokens"], rep["step_ms"]))
    assert m["real_tokens_per_s"] == pytest.approx(sum(rates) / 2) == r["throughput"]["real_tokens_per_s"]
    assert m["real_tokens_per_s"] > max(x["real_tokens_per_s"] for x in ranks)
    assert m["step_ms"] == max(x["step_ms"] for x in ranks) == d["global"]["slowest_step_ms"]
    assert d["global"]["slowest_rank"] == max(ranks, key=lambda x: x["step_ms"])["rank"]
    assert len(rep["step_ms"]) == len(rep["step_real_tokens"]) == 2
    sc = d["scaling"]
    one = runs["one"]["metrics"]["real_tokens_per_s"]
    assert sc["efficiency"] == pytest.approx(m["real_tokens_per_s"] / (2 * one))
    assert r["launch"]["command"].split()[1:3] == ["-m", "torch.distributed.run"]
    assert r["launch"]["env"] == {}  # CPU: the NVLink switches are for GPU ranks only


def test_ranks_train_on_their_own_shards_and_end_with_the_same_weights(runs):
    d = runs["ddp"]["distributed"]
    a, b = d["ranks"]
    assert a["final_loss"] != b["final_loss"]  # different samples on each rank
    assert a["param_digest"] == b["param_digest"] and d["params_identical"] is True


def test_fsdp2_on_cpu_gloo_through_sweep(tmp_path):
    """FSDP2 runs on gloo in torch 2.13: sharded decoder layers, a replicated frozen tower, no-sync
    accumulation; launched by `sweep --nproc-per-node 2 --parallel fsdp2` (run_isolated -> torchrun)."""
    knobs = [
        "model=tiny",
        "device=cpu",
        "steps=2",
        "warmup=1",
        "batch_size=1",
        "num_samples=8",
        "seed=3",
        "grad_accum=2",
        "accum_no_sync=true",
        "balance_tokens=true",
        "fsdp_prefetch=1",
    ]
    sets = [x for k in knobs for x in ("--set", k)]
    p = cli(
        "sweep",
        *sets,
        "--nproc-per-node",
        "2",
        "--parallel",
        "fsdp2",
        "--jsonl",
        str(tmp_path / "r.jsonl"),
        "--json",
        str(tmp_path / "rows.json"),
    )
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    (r,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    d = r["distributed"]
    assert r["status"] == "ok" and d["parallel"] == "fsdp2" and d["world_size"] == 2
    assert r["config"]["nproc_per_node"] == 2 and r["config"]["grad_accum"] == 2
    w = d["wrap"]
    assert w["wrapper"] == "fully_shard" and w["sharded_layers"] == 2 and w["layer_class"] == "Qwen2DecoderLayer"
    assert w["replicated_params"] == r["model"]["params"]["vision"]  # the frozen tower is not sharded
    assert w["mixed_precision"] == {"param_dtype": "bf16", "reduce_dtype": "fp32"} and w["forward_prefetch"] == 1
    assert d["params_identical"] is True
    assert d["global"]["real_tokens"] == sum(x["real_tokens"] for x in d["ranks"])
    (row,) = json.loads((tmp_path / "rows.json").read_text())["runs"]
    assert row["real_tokens_per_s"] == r["metrics"]["real_tokens_per_s"]


# --- gate and compare on a one-GPU and a two-rank report --------------------------------------
def test_gate_refuses_one_rank_against_two(runs):
    from vlmdoctor.ci.gate import check_comparable

    with pytest.raises(UsageError, match="baseline ran on 1 rank.*current on 2"):
        check_comparable(runs["one"], runs["ddp"])
    d = runs["dir"]
    p = cli("gate", "--baseline", str(d / "one.json"), "--current", str(d / "ddp.json"))
    assert p.returncode == 2 and "current on 2" in p.stderr and "Traceback" not in p.stderr


def test_gate_judges_the_slowest_rank(runs):
    from vlmdoctor.ci.gate import gate

    base = runs["ddp"]
    same = gate(base, base, max_memory_growth=10.0)
    slow = [c for c in same["checks"] if c["name"] == "slowest rank"]
    assert slow and slow[0]["passed"]
    uneven = copy.deepcopy(base)
    uneven["distributed"]["global"]["step_imbalance"] = base["distributed"]["global"]["step_imbalance"] + 0.3
    check = [c for c in gate(base, uneven, max_memory_growth=10.0)["checks"] if c["name"] == "slowest rank"][0]
    assert not check["passed"] and check["verdict"] == "uneven"


def test_compare_names_the_rank_counts_and_the_scaling(runs):
    from vlmdoctor.report.compare import compare

    result = compare(runs["one"], runs["ddp"], labels=("one", "two"))
    note = [n for n in result["notes"] if n.startswith("different number of ranks")][0]
    eff = runs["ddp"]["metrics"]["real_tokens_per_s"] / (2 * runs["one"]["metrics"]["real_tokens_per_s"])
    assert f"{eff * 100:.0f}%" in note and "one 1 (none), two 2 (ddp)" in note
    assert result["ranks"]["a"] == 1 and result["ranks"]["b"] == 2
    assert any(n.startswith("two: slowest of 2 ranks") for n in result["notes"])


# --- launching: what reaches torchrun and its children ------------------------------------------
def test_gpu_children_get_nvlink_multicast_off_unless_set():
    env = distributed.child_env(True, {"PATH": "/bin", "NCCL_NVLS_ENABLE": "1"})
    assert env["NCCL_NVLS_ENABLE"] == "1"  # the user's own choice stays
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert not set(distributed.NVLINK_MULTICAST_OFF) & set(distributed.child_env(False, {"PATH": "/bin"}))


def test_torchrun_command_and_rendezvous():
    cfg = RunConfig(model="tiny", nproc_per_node=4, parallel="fsdp2")
    cmd = distributed.torchrun_command(cfg, ["--config", "c.json"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and cmd[-2:] == ["--config", "c.json"]
    assert "vlmdoctor.run.rank_worker" in cmd
    two = distributed.Rendezvous(nnodes="2", node_rank=1, rdzv_backend="c10d", rdzv_endpoint="h0:29400", rdzv_id="j")
    args = two.args()
    assert "--standalone" not in args and args[args.index("--rdzv-endpoint") + 1] == "h0:29400"
    assert args[args.index("--node-rank") + 1] == "1" and args[args.index("--nnodes") + 1] == "2"
    static = distributed.Rendezvous(nnodes="2", node_rank=0, master_addr="10.0.0.1", master_port=29500).args()
    assert static[static.index("--master-addr") + 1] == "10.0.0.1" and "--master-port" in static
    for bad in (
        distributed.Rendezvous(nnodes="2"),
        distributed.Rendezvous(nnodes="two"),
        distributed.Rendezvous(master_port=70000),
    ):
        with pytest.raises(UsageError):
            bad.check()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc-per-node", "2"], "--parallel ddp or fsdp2"),
        (["--nproc-per-node", "2", "--parallel", "ddp", "--nnodes", "2"], "--rdzv-endpoint"),
        (["--one-gpu-report", "x.json"], "belong to a run with --parallel"),
        (["--parallel", "ddp", "--one-gpu-report", "missing.json"], "missing.json"),
        (["--parallel", "pipeline"], "choose one of: none, ddp, fsdp2"),
    ],
)
def test_launch_usage_errors_are_one_line(args, needle, cli_runner):
    from vlmdoctor.cli import app

    r = cli_runner.invoke(app, ["profile", "--model", "tiny", "--device", "cpu", *args, "--quiet", "--no-diagnose"])
    assert r.exit_code == 2, r.output
    assert needle in " ".join(r.output.split()) and "Traceback" not in r.output


@pytest.mark.parametrize("command", [["treat", "--out", "T"], ["sweep", "--set", "steps=2"]])
def test_treat_and_sweep_take_the_process_count(command, cli_runner, tmp_path, monkeypatch):
    from vlmdoctor.cli import app

    monkeypatch.chdir(tmp_path)
    r = cli_runner.invoke(
        app,
        [*command, "--model", "tiny", "--device", "cpu", "--nproc-per-node", "2"]
        if command[0] == "treat"
        else [*command, "--set", "model=tiny", "--set", "device=cpu", "--nproc-per-node", "2"],
    )
    assert r.exit_code == 2 and "ddp or fsdp2" in " ".join(r.output.split()), r.output


def test_one_rank_wrappers_are_valid_configs():
    for parallel in ("ddp", "fsdp2"):  # measures the wrapper's own cost on one GPU
        assert RunConfig(parallel=parallel).replace(nproc_per_node=1).parallel == parallel
    with pytest.raises(UsageError, match="nproc_per_node=2"):
        RunConfig.from_dict({"nproc_per_node": 2})


def test_one_gpu_reference_must_be_the_same_config(runs):
    cfg = runs["ddp"]["config"]
    distributed.check_reference(cfg, runs["one"], "one.json")
    other = copy.deepcopy(runs["one"])
    other["config"]["batch_size"] = 8
    with pytest.raises(UsageError, match="batch_size"):
        distributed.check_reference(cfg, other, "one.json")
    with pytest.raises(UsageError, match="not a one-GPU report"):
        distributed.check_reference(cfg, runs["ddp"], "ddp.json")


# --- data: each rank its own shard ------------------------------------------------------------
@pytest.mark.parametrize("world, batch, seed", [(2, 1, 0), (2, 4, 1), (3, 5, 2), (8, 2, 3), (4, 16, 4)])
@pytest.mark.parametrize("bucketed", [False, True])
def test_ranks_shard_each_global_batch(world, batch, seed, bucketed):
    rng = random.Random(seed)
    lengths = [rng.randint(20, 900) for _ in range(world * batch * 7 + 3)]
    for balance in (False, True):
        shards = [
            list(
                distributed.RankBatches(
                    BatchSampler(lengths, batch * world, bucketed, seed), lengths, r, world, balance
                )
            )
            for r in range(world)
        ]
        glob = list(BatchSampler(lengths, batch * world, bucketed, seed))
        for step, g in enumerate(glob):
            mine = [s[step] for s in shards]
            assert all(len(x) == batch for x in mine)
            assert sorted(i for x in mine for i in x) == sorted(g)  # disjoint, and together the global batch
            if not balance:
                assert mine == [g[r::world] for r in range(world)]  # rank-strided, as DistributedSampler


def test_balanced_ranks_have_close_token_counts():
    spread_balanced = spread_strided = 0
    for seed in range(300):  # assorted rank counts and batch sizes; even seeds long-tailed lengths
        rng = random.Random(seed)
        world, batch = rng.choice([2, 3, 4, 8]), rng.choice([1, 2, 3, 4, 8])
        lengths = [
            int(rng.paretovariate(1.2) * 100) if seed % 2 == 0 else rng.randint(100, 1000) for _ in range(world * batch)
        ]
        g = list(range(len(lengths)))
        rng.shuffle(g)
        tokens = [sum(lengths[i] for i in s) for s in distributed.deal(g, lengths, world, True)]
        strided = [sum(lengths[i] for i in s) for s in distributed.deal(g, lengths, world, False)]
        # longest first to the emptiest rank with room: the spread stays within one sample's length
        assert max(tokens) - min(tokens) <= max(lengths)
        if seed % 2:  # (one huge sample dominates a long tail whatever the dealing)
            spread_balanced += max(tokens) - min(tokens)
            spread_strided += max(strided) - min(strided)
    assert spread_balanced < spread_strided / 3


def test_a_timed_out_distributed_trial_leaves_no_rank_behind(monkeypatch):
    """run_isolated (treat, sweep, gate) stops the CLI child, torchrun and every rank on a timeout."""
    import time
    import uuid

    from vlmdoctor.run.runner import run_isolated

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    mark = uuid.uuid4().hex
    cfg = RunConfig(
        model="tiny",
        device="cpu",
        steps=100_000,  # hours on any CPU: the 15 s limit must stop it
        warmup=0,
        batch_size=1,
        num_samples=8,
        nproc_per_node=2,
        parallel="ddp",
    )
    report = run_isolated(cfg, timeout=15, diagnose=False, env={"VLMDOCTOR_TEST_MARK": mark})
    assert report["status"] == "timeout"

    def marked() -> list[str]:
        found = []
        for env in Path("/proc").glob("[0-9]*/environ"):
            try:
                if mark.encode() in env.read_bytes():
                    found.append(env.parent.name)
            except OSError:
                pass
        return found

    deadline = time.time() + 10
    while marked() and time.time() < deadline:
        time.sleep(0.5)
    assert marked() == []
