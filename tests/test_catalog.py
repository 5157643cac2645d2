"""The fact catalogue against the code: each family writes only what it declares, every declared fact is
produced by some committed trace, every fact a rule reads is declared and spelled out at its producer, and the
docs' tables are the catalogue's."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.doctor.rules import load_rules
from vlmdoctor.trace import attention_cause, casts, catalog, cpu_facts, cudnn_plan, modes
from vlmdoctor.trace import facts as driver
from vlmdoctor.trace.families import attention, kernels, memcpy, parts
from vlmdoctor.trace.measured import merge_measured

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
FAMILIES = driver.FAMILIES
#: committed traces that together make every declared fact: a zoo run and its report (GPU, memory, shapes, DPO),
#: a CPU QLoRA run, FSDP2 and DDP ranks on gloo, a user's H100 trace with the module hierarchy, FusedCE
TRACES = [
    (FIX / "mode_traces" / "h100_dpo_fixed_s2.pt.trace.json.gz", FIX / "mode_traces" / "h100_dpo_fixed_s2.report.json"),
    (FIX / "traces" / "treated_s1.pt.trace.json.gz", FIX / "traces" / "treated_s1.report.json"),
    (FIX / "mode_traces" / "qlora_tiny_cpu.pt.trace.json.gz", None),
    (FIX / "dist_cpu" / "fsdp2", None),
    (FIX / "dist_cpu" / "ddp_loader", None),
    (FIX / "user_h100" / "llava_s2_modules.pt.trace.json.gz", None),
    (FIX / "traces" / "liger_fce_s2.pt.trace.json.gz", None),  # Liger's FusedCE with shapes
    (FIX / "dist_gpu" / "ddp_long_rank1", None),  # two H200 ranks over NCCL, one given longer texts
    (FIX / "corpus_h200" / "qwen3vlmoe_tiny_batch.pt.trace.json.gz", None),  # MoE expert GEMMs with shapes
]


def _record(produced: dict[str, set[str]], module: str, fn):
    """fn, writing down every fact it adds or rewrites (in the facts it is given, or the dict it returns)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        facts = next((a for a in args if isinstance(a, dict)), None)
        before = dict(facts) if facts is not None else {}
        got = fn(*args, **kwargs)
        if facts is not None:
            produced[module] |= {k for k in facts if k not in before or facts[k] is not before[k]}
        out = getattr(got, "facts", got)  # rank_comms returns its facts in an object, cross_rank under "facts"
        if isinstance(out, dict):
            produced[module] |= set(out.get("facts", out) if module == "vlmdoctor.trace.ranks" else out)
        return got

    return wrapped


@pytest.fixture(scope="module")
def produced() -> dict[str, set[str]]:
    """What each producer wrote on the committed traces, the driver's own facts included."""
    out: dict[str, set[str]] = defaultdict(set)
    mp = pytest.MonkeyPatch()
    for fam in FAMILIES:
        mp.setattr(fam, "produce", _record(out, fam.__name__, fam.produce))
    mp.setattr(cpu_facts, "cpu_facts", _record(out, cpu_facts.__name__, cpu_facts.cpu_facts))
    mp.setattr(modes, "mode_facts", _record(out, modes.__name__, modes.mode_facts))
    mp.setattr(casts, "cast_facts", _record(out, casts.__name__, casts.cast_facts))
    mp.setattr(cudnn_plan, "cudnn_plan_facts", _record(out, cudnn_plan.__name__, cudnn_plan.cudnn_plan_facts))
    mp.setattr(
        attention_cause,
        "attention_cause_facts",
        _record(out, attention_cause.__name__, attention_cause.attention_cause_facts),
    )
    mp.setattr(driver, "rank_comms", _record(out, "vlmdoctor.trace.comms", driver.rank_comms))
    mp.setattr(driver, "cross_rank", _record(out, "vlmdoctor.trace.ranks", driver.cross_rank))
    try:
        for path, report in TRACES:
            doc = driver.analyze(path)
            for entry in doc["files"]:
                by_family = set().union(*(v for k, v in out.items() if k != "vlmdoctor.trace.ranks"))
                out[driver.__name__] |= set(entry["facts"]) - by_family
                if report is not None:
                    merged = merge_measured(entry["facts"], json.loads(report.read_text()))
                    out["vlmdoctor.trace.measured"] |= {
                        k for k in merged if k not in entry["facts"] or merged[k] is not entry["facts"][k]
                    }
    finally:
        mp.undo()
    return out


def test_every_family_writes_only_what_it_declares(produced):
    bad = []
    for module, names in produced.items():
        for name in sorted(names):
            f = catalog.lookup(name)
            joined = module == "vlmdoctor.trace.ranks" and f is not None and f.joined
            if f is None or (f.producer != module and not joined):
                bad.append(f"{module} writes {name} (declared: {f.producer if f else 'nowhere'})")
    assert not bad, "\n".join(bad)


def test_every_declared_fact_is_made_by_a_committed_trace(produced):
    made = set().union(*produced.values())
    missing = [f.name for f in catalog.FACTS if not f.unfixtured and not any(f.pattern.fullmatch(n) for n in made)]
    assert not missing, f"declared, but no committed trace makes them (or say why in unfixtured): {missing}"
    assert all(f.unfixtured for f in catalog.FACTS if f.name == "measured.device.compute_capability")


def test_each_family_declares_its_facts_as_PRODUCES():
    for mod in (*FAMILIES, cpu_facts, modes, casts, attention_cause, cudnn_plan, driver):
        assert getattr(mod, "PRODUCES", None) == catalog.by_producer(mod.__name__) != [], mod.__name__


def test_one_producer_per_name():
    names = [f.name for f in catalog.FACTS]
    assert len(names) == len(set(names))
    literal = [f for f in catalog.FACTS if not f.is_template]
    for f in literal:  # no literal fact is also an instance of another producer's template
        others = [
            t for t in catalog.FACTS if t.is_template and t.pattern.fullmatch(f.name) and t.producer != f.producer
        ]
        assert not others, (f.name, [t.name for t in others])


def _rule_reads() -> dict[str, set[str]]:
    rules, problems = load_rules()
    assert not problems
    reads: dict[str, set[str]] = defaultdict(set)
    for r in rules:
        for n in r.facts_used():
            reads[n].add(r.id)
    return reads


def test_every_fact_a_rule_reads_is_in_the_catalogue():
    unknown = {n: ids for n, ids in _rule_reads().items() if not n.startswith("patch.") and not catalog.known(n)}
    assert not unknown, unknown


def test_a_search_for_a_fact_a_rule_reads_finds_its_producer():
    """`git grep idle.data_loader.ms` finds where it is computed: no fact a rule reads is built from a template.
    The run config's knobs (config.<knob>) are copied as they were recorded; their one declaration is
    run/config.py."""
    bad = []
    for name in sorted(_rule_reads()):
        if name.startswith(("patch.", "config.")):
            continue
        f = catalog.lookup(name)
        source = (ROOT / catalog.module_path(f.producer)).read_text()
        if not re.search(rf'"{re.escape(name)}"', source):
            bad.append(f"{name} (producer {catalog.module_path(f.producer)})")
    assert not bad, "spelled out nowhere at their producer:\n" + "\n".join(bad)


@pytest.mark.parametrize("which", sorted(catalog.GENERATED))
def test_the_docs_tables_are_the_catalogues(which):
    name, _ = catalog.GENERATED[which]
    text = (ROOT / "docs" / name).read_text()
    assert catalog.with_generated(text, which) == text, f"regenerate: python -m vlmdoctor.trace.catalog ({name})"


def test_every_module_path_the_docs_name_exists():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [
        f"{d.name}: {m}"
        for d in docs
        for m in sorted(set(re.findall(r"vlmdoctor/[\w/]+\.py", d.read_text())))
        if not (ROOT / m).is_file()
    ]
    assert not bad, bad


def test_facts_command_says_what_where_and_what_records_it():
    r = CliRunner().invoke(app, ["facts", "idle.data_loader.ms", "--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["computed_in"] == "vlmdoctor/trace/families/idle.py" and (ROOT / doc["computed_in"]).is_file()
    assert doc["recorded_by"] == [catalog.NEEDS["gpu"]] and "system-data-loader" in doc["read_by"]
    assert CliRunner().invoke(app, ["facts", "kernels.cast.share"]).exit_code == 0
    r = CliRunner().invoke(app, ["facts", "idle.dataloader.ms"])
    assert r.exit_code == 2
    assert "did you mean idle.data_loader.ms" in r.output and len(r.output.strip().splitlines()) == 1


def test_missing_hints_follow_what_each_fact_needs():
    cpu = {"trace.gpu_kernels": False, "trace.recorded.shapes": False, "trace.recorded.memory": False}
    assert catalog.missing_hint("memory.peak_reserved_frac", cpu) == catalog.NEEDS["gpu"]
    gpu = {"trace.gpu_kernels": True, "trace.recorded.memory": False, "part.source": "none"}
    assert catalog.missing_hint("memory.peak_reserved_frac", gpu) == "profile_memory=True"
    assert catalog.missing_hint("attention.vision.head_dims", {**gpu, "trace.recorded.shapes": False}) == (
        "record_shapes=True"
    )
    assert catalog.missing_hint("part.vision.forward_ms", gpu) == catalog.NEEDS["stack"]
    assert catalog.missing_hint("part.loss.ms", gpu) is None  # the loss is found without the module hierarchy
    assert catalog.missing_hint("measured.gpu.busy_frac", cpu) is None


def test_the_spelled_out_names_cover_every_value_and_are_declared():
    """The producers' tables of names (kernel classes, parts, copy directions, collectives) hold every value
    the code can meet, each name declared for that producer: the template fallback is never used."""
    from vlmdoctor.trace import comms, ranks
    from vlmdoctor.trace.kernels import KERNEL_CLASSES

    assert set(kernels.CLASS_FACTS) == {c for c, _, _ in KERNEL_CLASSES} | {"memcpy", "memset", "triton_other", "other"}
    assert set(parts.PART_FACTS) == {*catalog.MODEL_PARTS, "loss", "optimizer", "other", "unattributed"}
    assert set(ranks.KIND_FACTS) == {v for _, v in comms.KINDS} | {"other"}
    tables = [
        (kernels, [n for names in kernels.CLASS_FACTS.values() for n in names]),
        (kernels, list(kernels.LIGER_FACTS.values())),
        (parts, [n for names in (*parts.PART_FACTS.values(), *parts.PART_PHASE_FACTS.values()) for n in names]),
        (memcpy, [n for names in memcpy.DIRECTION_FACTS.values() for n in names]),
        (attention, [n for names in attention.PART_FACTS.values() for n in names]),
        (ranks, [n for names in ranks.KIND_FACTS.values() for n in names]),
        (cpu_facts, [*cpu_facts.PROBE_FACTS.values(), *(n for v in cpu_facts.MATMUL_FACTS.values() for n in v)]),
        (casts, [n for names in casts.KIND_FACTS.values() for n in names]),
        (attention_cause, [n for names in attention_cause.KIND_FACTS.values() for n in names]),
    ]
    bad = [
        (mod.__name__, n)
        for mod, names in tables
        for n in names
        if getattr(catalog.lookup(n), "producer", None) != mod.__name__
    ]
    assert not bad, bad
