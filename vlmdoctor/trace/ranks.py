"""Several ranks' traces of one data-parallel job, joined: the slowest rank, the skew, and who waited for whom.

In synchronous data parallelism every rank's step ends at the same gradient collective, so step
times barely differ; a slow rank shows instead as time the *other* ranks spend inside collectives
waiting for it. On one node all ranks share the host clock, so matching collectives (the k-th
collective of a kind in the same ProfilerStep) can be compared directly: each rank's wait is how
much later the last rank started the same collective, bounded by the collective's exposed time (a
wait the rank's own compute ran beside costs it nothing). A rank's busy time is its step time minus
that wait; the straggler is the rank with the most busy time, the skew its excess over the median
of the other ranks (any number of ranks: one fast outlier among many does not make a skew), and
the gain its excess over the mean (what perfect balance would save). The cause is read from what
differs on that rank: more real tokens, more data-loader time, or more host gaps.
Which fact comes from where: docs/analysis.md ("Several ranks").
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from vlmdoctor.trace.accounts import step_accounts
from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.comms import GRAD_SYNC, RankComms

PRODUCES = by_producer(__name__)
SAME_TIME_SLACK_US = 1e6  # ranks of one job whose steps are further apart than this did not run together
#: each collective's joined facts, spelled out so that a search for a fact finds where it is computed:
#: (ms, exposed_ms, bytes, busbw_gbps, count, exposed_own_ms), the ranks' mean of comm.<kind>.* but the last
KIND_FACTS = {
    "all_reduce": (
        "dist.comm.all_reduce.ms",
        "dist.comm.all_reduce.exposed_ms",
        "dist.comm.all_reduce.bytes",
        "dist.comm.all_reduce.busbw_gbps",
        "dist.comm.all_reduce.count",
        "dist.comm.all_reduce.exposed_own_ms",
    ),
    "reduce_scatter": (
        "dist.comm.reduce_scatter.ms",
        "dist.comm.reduce_scatter.exposed_ms",
        "dist.comm.reduce_scatter.bytes",
        "dist.comm.reduce_scatter.busbw_gbps",
        "dist.comm.reduce_scatter.count",
        "dist.comm.reduce_scatter.exposed_own_ms",
    ),
    "all_gather": (
        "dist.comm.all_gather.ms",
        "dist.comm.all_gather.exposed_ms",
        "dist.comm.all_gather.bytes",
        "dist.comm.all_gather.busbw_gbps",
        "dist.comm.all_gather.count",
        "dist.comm.all_gather.exposed_own_ms",
    ),
    "all_to_all": (
        "dist.comm.all_to_all.ms",
        "dist.comm.all_to_all.exposed_ms",
        "dist.comm.all_to_all.bytes",
        "dist.comm.all_to_all.busbw_gbps",
        "dist.comm.all_to_all.count",
        "dist.comm.all_to_all.exposed_own_ms",
    ),
    "broadcast": (
        "dist.comm.broadcast.ms",
        "dist.comm.broadcast.exposed_ms",
        "dist.comm.broadcast.bytes",
        "dist.comm.broadcast.busbw_gbps",
        "dist.comm.broadcast.count",
        "dist.comm.broadcast.exposed_own_ms",
    ),
    "send_recv": (
        "dist.comm.send_recv.ms",
        "dist.comm.send_recv.exposed_ms",
        "dist.comm.send_recv.bytes",
        "dist.comm.send_recv.busbw_gbps",
        "dist.comm.send_recv.count",
        "dist.comm.send_recv.exposed_own_ms",
    ),
    "barrier": (
        "dist.comm.barrier.ms",
        "dist.comm.barrier.exposed_ms",
        "dist.comm.barrier.bytes",
        "dist.comm.barrier.busbw_gbps",
        "dist.comm.barrier.count",
        "dist.comm.barrier.exposed_own_ms",
    ),
    "reduce": (
        "dist.comm.reduce.ms",
        "dist.comm.reduce.exposed_ms",
        "dist.comm.reduce.bytes",
        "dist.comm.reduce.busbw_gbps",
        "dist.comm.reduce.count",
        "dist.comm.reduce.exposed_own_ms",
    ),
    "gather": (
        "dist.comm.gather.ms",
        "dist.comm.gather.exposed_ms",
        "dist.comm.gather.bytes",
        "dist.comm.gather.busbw_gbps",
        "dist.comm.gather.count",
        "dist.comm.gather.exposed_own_ms",
    ),
    "scatter": (
        "dist.comm.scatter.ms",
        "dist.comm.scatter.exposed_ms",
        "dist.comm.scatter.bytes",
        "dist.comm.scatter.busbw_gbps",
        "dist.comm.scatter.count",
        "dist.comm.scatter.exposed_own_ms",
    ),
    "other": (
        "dist.comm.other.ms",
        "dist.comm.other.exposed_ms",
        "dist.comm.other.bytes",
        "dist.comm.other.busbw_gbps",
        "dist.comm.other.count",
        "dist.comm.other.exposed_own_ms",
    ),
}


def one_job(names: list[str], per: list[RankComms], configs: list[dict[str, Any] | None]) -> str | None:
    """Why the traces of a folder are not the ranks of one job, or None when nothing says they are not.

    Traces of two jobs (two runs of one script, or two scripts) joined as one would compare collectives
    that never waited for each other. They are told apart by what one job shares: its world size (every
    rank < it), the run config vlmdoctor recorded, and the time it ran: the ranks' steps overlap (Kineto's
    times are the wall clock less one fixed base, so hosts agree to well within SAME_TIME_SLACK_US).
    """
    worlds = sorted({rc.world for rc in per if rc.world is not None})
    if len(worlds) > 1:
        return f"the traces come from jobs of {worlds[0]} and {worlds[1]} ranks (distributedInfo.world_size)"
    for name, rc in zip(names, per):
        if worlds and rc.rank is not None and not 0 <= rc.rank < worlds[0]:
            return f"{name} is rank {rc.rank}, outside a job of {worlds[0]} ranks"
    seen: dict[str, str] = {}
    for name, cfg in zip(names, configs):
        if cfg:
            seen.setdefault(repr(sorted(cfg.items(), key=lambda kv: str(kv[0]))), name)
    if len(seen) > 1:
        a, b = list(seen.values())[:2]
        return f"{a} and {b} record different run configs"
    spans = [
        (float(rc.steps["ts"].min()), float(rc.steps["end"].max()), name)
        for name, rc in zip(names, per)
        if len(rc.steps) and np.isfinite(rc.steps["ts"].min()) and np.isfinite(rc.steps["end"].max())
    ]
    if len(spans) > 1:
        late = max(spans)  # the last to start
        early = min(spans, key=lambda x: x[1])  # the first to end
        if late[0] - early[1] > SAME_TIME_SLACK_US:
            return f"{early[2]} and {late[2]} were not recorded at the same time (their steps do not overlap)"
    return None


def _kind_facts(kind: str) -> tuple[str, ...]:
    """A collective's joined facts (a kind the table lacks: tests/test_catalog.py checks it has them all)."""
    whats = ("ms", "exposed_ms", "bytes", "busbw_gbps", "count", "exposed_own_ms")
    return KIND_FACTS.get(kind) or tuple(f"dist.comm.{kind}.{w}" for w in whats)


#: the ranks' mean of a per-rank fact: (comm fact, joined fact)
MEAN_FACTS = (
    ("comm.fsdp.prefetched_frac", "dist.fsdp.prefetched_frac"),
    ("comm.fsdp.forward_prefetched_frac", "dist.fsdp.forward_prefetched_frac"),
    ("comm.fsdp.backward_prefetched_frac", "dist.fsdp.backward_prefetched_frac"),
    ("comm.micro_batches_per_step", "dist.micro_batches_per_step"),
    ("comm.synced_micro_batches_per_step", "dist.synced_micro_batches_per_step"),
    ("comm.grad_sync.extra_ms", "dist.grad_sync.extra_ms"),
    ("comm.grad_sync.extra_bytes", "dist.grad_sync.extra_bytes"),
)

CAUSE_MIN_SHARE = 0.3  # a cause explains the skew when it accounts for at least this share of it
BALANCED_SKEW = 0.05  # under 5% of the step the ranks count as balanced: no cause is named
#: GEMM time above the others' by this share means the rank was given more work (more or longer samples): GEMM
#: FLOPs grow with tokens, so its GEMM time measures its work where the trace records no token batches
GEMM_WORK_EXCESS = 0.1
#: accounts that are waiting for other ranks, not a rank's own work: never the straggler's cause
WAITING = ("busy.communication", "idle.host.ranks")


def _wait_per_step(per: list[RankComms]) -> dict[int, dict[str, float]] | None:
    """rank -> step name -> ms spent waiting for later ranks inside matched collectives."""
    hosts = {r.host for r in per if r.host}
    if len(hosts) > 1:
        return None  # ranks on different hosts: their clocks are not comparable
    steps = set.intersection(*(set(r.steps["name"].astype(str)) for r in per))
    if not steps:
        return None  # no ProfilerStep every rank recorded: nothing to match
    out: dict[int, dict[str, float]] = {r.rank: {} for r in per}
    for r in per:
        r.work["step_name"] = [str(r.steps["name"].iloc[k]) if k >= 0 else "" for k in r.work["step"]]
        r.work["wait"] = 0.0
    for step in steps:
        seqs = []
        for r in per:
            w = r.work[r.work["step_name"] == step].sort_values("issue")
            seqs.append({k: g for k, g in w.groupby("kind")})
        kinds = set.intersection(*(set(s) for s in seqs))
        waits = np.zeros(len(per))
        for kind in kinds:
            m = min(len(s[kind]) for s in seqs)
            if any(len(s[kind]) != m for s in seqs):
                continue  # not the same collectives on every rank: no safe match
            starts = np.stack([s[kind]["ts"].to_numpy() for s in seqs])  # ranks x collectives
            exposed = np.stack([s[kind]["exposed"].to_numpy() for s in seqs])
            each = np.minimum(starts.max(axis=0) - starts, exposed)  # lost only where no own compute ran beside
            for r, s, wk in zip(per, seqs, each):
                r.work.loc[s[kind].index, "wait"] = wk
            waits += each.sum(axis=1)
        for r, wt in zip(per, waits):
            out[r.rank][step] = float(wt) / 1e3
    return out


def _straggler(
    rows: list[dict[str, Any]],
    busy: list[float],
    steps: list[float],
    facts: dict[str, Any],
    rank_facts: list[dict[str, Any]],
) -> None:
    """The slowest rank by busy time (step less its wait for late ranks) and which cause explains its excess:
    more tokens, more GEMM work (a measure of tokens where shapes are not recorded), a slower loader, more host
    gaps, or, failing those, the account of the step (trace/accounts.py) that grew most on that rank."""
    i = int(np.argmax(busy))
    slow = rows[i]
    others = [x for j, x in enumerate(rows) if j != i] or rows
    other_f = [f for j, f in enumerate(rank_facts) if j != i] or rank_facts
    mean_busy = float(np.mean(busy))
    facts["dist.straggler.rank"] = slow["rank"]
    facts["dist.step_skew_ms"] = busy[i] - float(np.median([b for j, b in enumerate(busy) if j != i] or busy))
    facts["dist.straggler.excess_ms"] = slow["busy_ms"] - mean_busy
    if steps:
        facts["dist.step_skew_frac"] = facts["dist.step_skew_ms"] / facts["dist.step.ms"]
    causes = {}
    o_busy = float(np.mean([x["busy_ms"] for x in others]))
    o_tokens = [x["tokens"] for x in others if x["tokens"]]
    if slow["tokens"] and o_tokens:
        facts["dist.straggler.tokens_excess_frac"] = slow["tokens"] / float(np.mean(o_tokens)) - 1
        causes["tokens"] = facts["dist.straggler.tokens_excess_frac"] * o_busy  # compute grows with tokens
    gemm = [f.get("gemm.ms") for f in (rank_facts[i], *other_f)]
    if all(isinstance(g, (int, float)) for g in gemm) and np.mean(gemm[1:]) > 0:
        facts["dist.straggler.gemm_excess_frac"] = gemm[0] / float(np.mean(gemm[1:])) - 1
        if "tokens" not in causes and facts["dist.straggler.gemm_excess_frac"] >= GEMM_WORK_EXCESS:
            compute = [f["gpu.busy_ms"] - f.get("busy.communication.ms", 0.0) for f in (rank_facts[i], *other_f)]
            causes["gemm_work"] = compute[0] - float(np.mean(compute[1:]))  # the GPU work it was given above theirs
    facts["dist.straggler.loader_excess_ms"] = slow["loader_ms"] - float(np.mean([x["loader_ms"] for x in others]))
    facts["dist.straggler.gap_excess_ms"] = slow["gap_ms"] - float(np.mean([x["gap_ms"] for x in others]))
    causes["data_loader"] = facts["dist.straggler.loader_excess_ms"]
    causes["host_gaps"] = facts["dist.straggler.gap_excess_ms"] - max(causes["data_loader"], 0)
    grown = _accounts_grown(rank_facts[i], other_f)
    if grown:
        facts["dist.straggler.accounts"] = grown
    best = max(causes, key=causes.get)
    if "gemm_work" in causes and "tokens" not in causes:  # more work given: its host work (plans, launches for
        best = "gemm_work"  # longer shapes) grows with it, so the work is the cause, not what grew beside it
    skew = facts["dist.step_skew_ms"]
    if facts.get("dist.step_skew_frac", 1.0) < BALANCED_SKEW:
        facts["dist.straggler.cause"] = "balanced"
    elif best == "gemm_work" or causes[best] >= CAUSE_MIN_SHARE * skew:
        facts["dist.straggler.cause"] = best
    elif grown and grown[0]["excess_ms"] >= CAUSE_MIN_SHARE * skew:
        facts["dist.straggler.cause"] = grown[0]["account"]
    else:
        facts["dist.straggler.cause"] = "unexplained"


def _accounts_grown(slow: dict[str, Any], others: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The straggler's accounts above the other ranks' mean, largest first (waiting for ranks left out)."""
    mine = step_accounts(slow)
    theirs = [step_accounts(f) for f in others]
    if mine is None or any(a is None for a in theirs):
        return []
    other_ms = [{r["account"]: r["ms"] for r in a["rows"]} for a in theirs]
    grown = []
    for r in mine["rows"]:
        if r["account"] in WAITING:
            continue
        excess = r["ms"] - float(np.mean([o.get(r["account"], 0.0) for o in other_ms]))
        if excess > 0:
            grown.append({"account": r["account"], "excess_ms": excess, "meaning": r["meaning"]})
    return sorted(grown, key=lambda g: -g["excess_ms"])[:3]


def _coverage_notes(per: list[RankComms], facts: dict[str, Any], waits: dict | None) -> list[str]:
    """What the ranks' traces leave unmeasured, said once in the report."""
    notes: list[str] = []
    if facts["dist.ranks"] < facts["dist.world_size"]:
        notes.append(f"{len(per)} of {facts['dist.world_size']} ranks' traces: the facts cover those ranks only")
    if not any(len(r.work) for r in per):
        notes.append(
            "no collectives in the traces: the wait for late ranks is not measured (separate runs, "
            "or a trace window without communication?)"
        )
    elif waits is None and len({r.host for r in per if r.host}) > 1:
        notes.append(
            "the ranks ran on different hosts: their clocks are not comparable, so the wait for late ranks "
            "is not measured"
        )
    elif waits is None:
        notes.append(
            "the ranks recorded no common ProfilerStep: collectives cannot be matched, so the wait for late "
            "ranks is not measured"
        )
    return notes


def cross_rank(per: list[RankComms], rank_facts: list[dict[str, Any]]) -> dict[str, Any]:
    """Cross-rank facts and a per-rank table, from the ranks' own comm facts and step tables."""
    per_rank = sorted(zip(per, rank_facts), key=lambda x: x[0].rank)
    per = [p for p, _ in per_rank]
    rank_facts = [f for _, f in per_rank]
    facts: dict[str, Any] = {"dist.ranks": len(per)}
    for key in (
        "trace.recorded.memory",
        "trace.recorded.shapes",
        "trace.cpu_only",
    ):  # for the not-evaluated hints
        if any(key in f for f in rank_facts):
            facts[key] = all(f.get(key) for f in rank_facts)
    worlds = [r.world for r in per if r.world]
    facts["dist.world_size"] = max(worlds) if worlds else len(per)
    facts["dist.backend"] = Counter(r.backend for r in per).most_common(1)[0][0]
    facts["dist.parallel"] = Counter(f.get("comm.parallel", "none") for f in rank_facts).most_common(1)[0][0]
    waits = _wait_per_step(per) if any(len(r.work) for r in per) else None
    notes = _coverage_notes(per, facts, waits)
    rows = []
    for r, f in zip(per, rank_facts):
        ps = r.per_step
        step_ms = float(ps["ms"].mean()) if len(ps) else None
        wait = float(np.mean(list(waits[r.rank].values()))) if waits and waits[r.rank] else (0.0 if waits else None)
        tokens = ps["tokens"].dropna()
        rows.append(
            {
                "rank": r.rank,
                "step_ms": step_ms,
                "wait_ms": wait,
                "busy_ms": step_ms - wait if step_ms is not None and wait is not None else step_ms,
                "tokens": float(tokens.mean()) if len(tokens) else None,
                "loader_ms": float(ps["loader_ms"].mean()) if len(ps) else None,
                "gap_ms": float(ps["gap_ms"].mean()) if len(ps) else None,
                "comm_ms": f.get("comm.ms"),
                "exposed_ms": f.get("comm.exposed_ms"),
                "hidden_ms": f.get("comm.hidden_ms"),
            }
        )
    steps = [x["step_ms"] for x in rows if x["step_ms"] is not None]
    if steps:
        facts["dist.step.ms"] = float(np.mean(steps))
        facts["dist.step_ms_spread"] = max(steps) - min(steps)
    busy = [x["busy_ms"] for x in rows]
    if all(b is not None for b in busy) and busy:
        _straggler(rows, busy, steps, facts, rank_facts)
    if waits is not None:
        w = [x["wait_ms"] for x in rows]
        facts["dist.late_wait_ms"] = float(np.mean(w))
        facts["dist.late_wait_ms_max"] = float(max(w))
    comm_ranks = [(x, f) for x, f in zip(rows, rank_facts) if "comm.ms" in f]
    if comm_ranks:

        def mean(key: str) -> float | None:
            vals = [f[key] for _, f in comm_ranks if f.get(key) is not None]
            return float(np.mean(vals)) if vals else None

        facts["dist.comm.ms"] = mean("comm.ms")
        facts["dist.comm.exposed_ms"] = mean("comm.exposed_ms")
        facts["dist.comm.hidden_ms"] = mean("comm.hidden_ms")
        # exposed time that is communication itself, not waiting for a late rank
        own = [max(x["exposed_ms"] - (x["wait_ms"] or 0.0), 0.0) for x, _ in comm_ranks]
        facts["dist.comm.exposed_own_ms"] = float(np.mean(own))
        if facts.get("dist.step.ms"):
            facts["dist.comm.exposed_share"] = facts["dist.comm.exposed_own_ms"] / facts["dist.step.ms"]
        kinds = sorted({k for _, f in comm_ranks for k in f.get("comm.kinds", [])})
        facts["dist.comm.kinds"] = kinds
        if waits is not None:  # each kind's exposed time less its own collectives' wait for late ranks
            for kind in kinds:
                own = []
                for r in per:
                    w = r.work[(r.work["kind"] == kind) & (r.work["step"] >= 0)]
                    own.append(float((w["exposed"] - w["wait"]).clip(lower=0).sum()) / 1e3 / max(len(r.steps), 1))
                facts[_kind_facts(kind)[5]] = float(np.mean(own))
        for kind in kinds:
            for what, name in zip(("ms", "exposed_ms", "bytes", "busbw_gbps", "count"), _kind_facts(kind)):
                v = mean(f"comm.{kind}.{what}")
                if v is not None:
                    facts[name] = v
        for key, name in MEAN_FACTS:
            v = mean(key)
            if v is not None:
                facts[name] = v
        synced = facts.get("dist.synced_micro_batches_per_step")
        sync_bytes = sum(facts.get(_kind_facts(k)[2], 0.0) for k in GRAD_SYNC)
        if synced and sync_bytes:
            # one synchronization moves every trained gradient once: its size is the trained parameters' bytes
            facts["dist.grad_gb"] = sync_bytes / synced / 2**30
    for key in (
        "memory.device_total_gb",
        "memory.peak_reserved_gb",
        "memory.peak_reserved_frac",
        "memory.peak_allocated_gb",
        "memory.peak_allocated_frac",
    ):
        vals = [f[key] for f in rank_facts if f.get(key) is not None]
        if vals:
            facts[key] = max(vals)
    batches = [r.per_step["batch"].max() for r in per if len(r.per_step) and r.per_step["batch"].notna().any()]
    if batches:  # the micro-batch size each rank ran (the token batch's first dimension)
        facts["dist.batch_size"] = int(min(batches))
    return {"facts": facts, "ranks": rows, "notes": notes}


def hta_overlap(folder: str | Path) -> dict[str, Any]:
    """traceinsight's (HTA's) communication/computation overlap per rank, when it is installed.

    HTA counts, per rank, the share of NCCL kernel time that overlaps compute kernels. It reads
    GPU kernels only, so on CPU (gloo) traces it has nothing to say. By default it drops the
    kernels of the last ProfilerStep; it is asked to keep them, so both read the same steps.
    """
    try:  # optional extra: traceinsight (the package first: its submodules may already be loaded)
        import hta  # noqa: F401
        from hta.analyzers.communication_analysis import CommunicationAnalysis
        from hta.common.trace import Trace
    except Exception:  # not installed, or broken: the cross-check is skipped, never the analysis
        return {"skipped": "traceinsight (hta) is not installed: pip install 'vlmdoctor[hta]'"}
    sink = io.StringIO()
    level = logging.root.manager.disable
    try:
        logging.disable(logging.WARNING)
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            # its ranks parsed in this process: HTA's default forks a multiprocessing pool from a process whose
            # progress thread runs, and a pool worker left waiting on the pool's queue lock hung `analyze` of a
            # 2-rank folder in the pool's terminate (fixtures/dist_gpu/ddp_long_rank1, 2026-11-27)
            trace = Trace(trace_dir=str(folder))
            trace.load_traces(include_last_profiler_step=True, use_multiprocessing=False)
            df = CommunicationAnalysis.get_comm_comp_overlap(trace, visualize=False)
    except Exception as e:  # HTA's own limits (no GPU kernels, unknown layout) must not fail the analysis
        return {"skipped": f"traceinsight could not read the folder ({type(e).__name__}: {str(e)[:120]})"}
    finally:
        logging.disable(level)
    if df is None or not len(df):
        return {"skipped": "traceinsight found no communication kernels (it reads GPU NCCL kernels only)"}
    col = next((c for c in df.columns if "overlap" in c), None)
    if col is None:
        return {"skipped": f"traceinsight returned no overlap column ({', '.join(map(str, df.columns))})"}
    return {"overlap_pct": {int(r): float(v) for r, v in zip(df["rank"], df[col])}}
