"""Each knob is declared once (the run config's field) and everything else comes from it: its flag on
the commands, its `--help` line and panel, the TrainingArguments fields both ways, its advice, and
what happens to a knob that only qualifies another when the command line turns that one off."""

from __future__ import annotations

import ast
import json
import types
from dataclasses import fields
from pathlib import Path

import pytest
import typer.main
import yaml

import vlmdoctor.cli as cli
from vlmdoctor.commands.knobs import knob_flags
from vlmdoctor.commands.treat import TREAT_KNOBS
from vlmdoctor.doctor.advice import ADVICE, LIGER_KNOBS, advise
from vlmdoctor.errors import UsageError
from vlmdoctor.run.config import FLAGS, RunConfig, _base_type, flag, idle_qualifiers, override, panel
from vlmdoctor.run.trainer_args import TABLE, fields_for, getter, training_args_config

KNOBS = [f.name for f in fields(RunConfig)]
COMMANDS = typer.main.get_command(cli.app).commands


def _params(command: str) -> dict:
    return {p.name: p for p in COMMANDS[command].params}


def test_every_knob_is_a_profile_flag_generated_from_its_declaration():
    params = _params("profile")
    for f in fields(RunConfig):
        p = params[f.name]
        assert p.opts == [flag(f.name)], f.name
        assert p.secondary_opts == (["--no-" + flag(f.name)[2:]] if _base_type(f.type) is bool else []), f.name
        assert p.default is None, f.name  # a flag not given leaves the config's (or the file's) value
        assert p.rich_help_panel == panel(f.name)
        assert p.help.startswith(f.metadata["help"]), f.name
    assert FLAGS == {
        "liger_fused_linear_cross_entropy": "--liger-fused-ce",
        "checkpoint_use_reentrant": "--checkpoint-reentrant",
    }
    assert knob_flags()["checkpoint_use_reentrant"] == ("--checkpoint-reentrant", "--no-checkpoint-reentrant")


def test_help_says_each_knobs_default_and_choices(cli_runner):
    text = " ".join(cli_runner.invoke(cli.app, ["profile", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "samples per micro-batch [default: 4]" in text
    assert (
        "dtype the weights are stored in [fp32, bf16] [default: fp32]" in text
        and "recompute LLM activations in backward [default: on]" in text
    )
    for title in ("experiment", "1 precision", "2 batching", "3 data layout", "4 kernel fusion", "5 system tuning"):
        assert f"─ {title} ─" in text, title
    treat = " ".join(cli_runner.invoke(cli.app, ["treat", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "timed steps per repeat [default: 10]" in treat and "timed windows" in treat  # treat's shorter window


def _option_flags(tree: ast.AST) -> set[str]:
    """The flags the hand-written typer options of a module name (its aliases and its functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Option":
            found |= {
                a.value.split("/")[0] for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            }
    return found


def _generated(param) -> bool:
    """A command's option made from the knob's declaration (commands/knobs.py): a knob's name, no default of
    its own, the knob's help."""
    field = RunConfig.__dataclass_fields__.get(param.name)
    return field is not None and param.default is None and param.help.startswith(field.metadata["help"])


def test_no_command_retypes_a_knob():
    """The commands that build a run config take its knobs from the declaration, never from an option
    written by hand. Not knobs, though spelled like some: `analyze`'s --stage and --model (hints about
    a trace), `run`'s --stage, --steps and --warmup (the window of the user's own script), `sweep`'s
    --stage (which stages of a grid to run, repeatable)."""
    theirs = {"analyze": {"--stage", "--model"}, "run": {"--stage", "--steps", "--warmup"}, "sweep": {"--stage"}}
    spelled = {flag(k) for k in KNOBS}
    for command, click_command in COMMANDS.items():
        typed = {o for p in click_command.params for o in p.opts if o in spelled and not _generated(p)}
        assert typed == theirs.get(command, set()), command
    written = set()  # and in the source: no hand-written option anywhere in the commands spells another knob
    for path in Path(cli.__file__).parent.joinpath("commands").glob("*.py"):
        written |= _option_flags(ast.parse(path.read_text())) & spelled
    assert written == set().union(*theirs.values())
    for command, names in (("profile", KNOBS), ("treat", TREAT_KNOBS), ("sweep", ("nproc_per_node", "parallel"))):
        params = _params(command)
        for name in names:
            assert params[name].opts == [flag(name)] and params[name].help.startswith(
                RunConfig.__dataclass_fields__[name].metadata["help"]
            )


def _values(name: str) -> list:
    f = RunConfig.__dataclass_fields__[name]
    kind = _base_type(f.type)
    if f.metadata["choices"]:
        return list(f.metadata["choices"])
    return [True, False] if kind is bool else [f.default, 8]


@pytest.mark.parametrize("knob", sorted(TABLE))
def test_training_arguments_round_trip(knob):
    """What advice tells a Trainer user to set is read back as the same knob value."""
    assert knob in KNOBS
    for value in _values(knob):
        written = TABLE[knob].write(value)
        assert TABLE[knob].read(getter(types.SimpleNamespace(**written))) == value, (knob, value, written)


def test_a_whole_patch_round_trips_through_training_arguments():
    patch = {
        "autocast": "bf16",
        "batch_size": 16,
        "sampler": "length_bucketed",
        "compile": "max-autotune",
        "liger_rms_norm": True,
        "liger_rope": False,
        "num_workers": 4,
        "pin_memory": True,
        "fused_optimizer": True,
        "checkpoint_use_reentrant": False,
    }
    read = training_args_config(types.SimpleNamespace(**fields_for(patch)))
    assert {k: read[k] for k in patch} == patch
    assert read["trainer_args"]["liger_kernel_config"] == {"rms_norm": True, "rope": False}


def test_written_fields_exist_in_training_arguments():
    transformers = pytest.importorskip("transformers")
    names = {f.name for f in fields(transformers.TrainingArguments)}
    for knob, entry in TABLE.items():
        for value in _values(knob):
            assert set(entry.write(value)) <= names, (knob, value)


def test_advice_table_names_only_knobs_and_covers_the_rest():
    assert set(ADVICE) <= set(KNOBS) and set(TABLE) <= set(KNOBS)
    said = set(ADVICE) | set(TABLE) | set(LIGER_KNOBS)
    # layer 0 knobs that define vlmdoctor's own experiment (model, data, seed) have no line in user code
    unsaid = {k for k in KNOBS if k not in said}
    assert all(RunConfig.__dataclass_fields__[k].metadata["layer"] == 0 for k in unsaid), unsaid
    assert advise({"allow_tf32": True, "compile": "max-autotune"}, "trainer") == [
        "tf32=True",
        "torch_compile=True",
        'torch_compile_mode="max-autotune"',
    ]


# --- a command-line override wins; what only qualified a knob turned off is dropped, and said -------


def _final(tmp_path: Path) -> Path:
    path = tmp_path / "final.yaml"
    cfg = RunConfig(model="tiny", device="cpu", steps=1, warmup=0, autocast="off", batch_size=2)
    cfg = cfg.replace(compile="default", compile_regions=True, compile_shape_padding=False)
    cfg.dump(path)
    return path


def test_qualifiers_are_declared_with_the_knob():
    declared = {f.name: f.metadata["qualifies"] for f in fields(RunConfig) if f.metadata["qualifies"]}
    assert declared["compile_regions"] == {"compile": ("off",)}
    assert set(declared["compile_shape_padding"]) == {"compile", "compile_vision"}
    assert declared["pack_length"] == {"packing": (False,)}
    for name, qualified in declared.items():
        for knob, off in qualified.items():
            assert knob in KNOBS and off, name
    on = {"compile_regions": True, "compile_shape_padding": False, "pack_length": 4096}
    assert set(idle_qualifiers(on)) == set(on)
    assert idle_qualifiers({**on, "compile": "default", "packing": True}) == []


def test_override_drops_what_only_qualified_a_knob_turned_off(tmp_path):
    path = _final(tmp_path)
    with pytest.raises(UsageError, match="changes nothing without torch.compile"):  # not from a file: refused
        RunConfig.from_dict({**yaml.safe_load(path.read_text()), "compile": "off"}, source="command line")
    notes: list[str] = []
    cfg = RunConfig.load(path, {"compile": "off"}, notes)
    assert (cfg.compile, cfg.compile_regions, cfg.compile_shape_padding) == ("off", False, True)
    assert cfg.batch_size == 2  # the file's other knobs stay
    assert notes == [
        f"--compile off: dropped compile_shape_padding, compile_regions from {path} (they only qualify --compile)"
    ]
    notes.clear()  # a knob the command line does not turn off drops nothing
    assert RunConfig.load(path, {"batch_size": 3}, notes).compile_regions and notes == []


def test_a_qualifier_given_on_the_command_line_is_still_refused(tmp_path):
    path = _final(tmp_path)
    with pytest.raises(UsageError, match="--compile-regions says how --compile compiles"):
        RunConfig.load(path, {"compile": "off", "compile_regions": True})
    with pytest.raises(UsageError, match="--compile-regions says how --compile compiles"):
        RunConfig().replace(source="command line", compile_regions=True)


def test_override_says_each_turned_off_knob_once():
    data = {
        "packing": True,
        "pack_length": 4096,
        "parallel": "fsdp2",
        "fsdp_prefetch": 2,
        "reshard_after_forward": False,
    }
    merged, line = override(data, {"packing": False, "parallel": "ddp"}, "c.yaml")
    assert merged == {"packing": False, "parallel": "ddp"}
    assert line == (
        "--no-packing, --parallel ddp: dropped pack_length, reshard_after_forward, fsdp_prefetch from c.yaml "
        "(they only qualify --packing, --parallel)"
    )
    assert override(data, {"parallel": "fsdp2"}, "c.yaml") == ({**data, "parallel": "fsdp2"}, None)


def test_profile_config_with_compile_off_runs_on_cpu(cli_runner, tmp_path):
    """`--config final.yaml --compile off` on a config with compile regions: runs, one line says what was dropped."""
    path, out = _final(tmp_path), tmp_path / "r.json"
    r = cli_runner.invoke(
        cli.app, ["profile", "--config", str(path), "--compile", "off", "--no-diagnose", "--json", str(out), "--quiet"]
    )
    assert r.exit_code == 0, r.output
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "dropped compile_shape_padding, compile_regions" in notes[0], r.stderr
    config = json.loads(out.read_text())["config"]
    assert (config["compile"], config["compile_regions"], config["compile_shape_padding"]) == ("off", False, True)


def test_treat_set_compile_off_drops_the_regions_of_its_start_config(cli_runner, tmp_path, monkeypatch):
    """`treat --config final.yaml --set compile=off`: the start config treat checks has no regions left."""
    import vlmdoctor.run.runner as runner_mod
    from vlmdoctor.errors import VlmdoctorError

    seen = []

    def check(cfg):  # the first thing treat does with the config it built: stop there
        seen.append(cfg)
        raise VlmdoctorError("stopped before any run")

    monkeypatch.setattr(runner_mod, "check", check)
    path = _final(tmp_path)
    r = cli_runner.invoke(cli.app, ["treat", "--config", str(path), "--set", "compile=off", "--steps", "2"])
    assert r.exit_code == 2 and "stopped before any run" in r.stderr, r.output
    assert [line for line in r.stderr.splitlines() if line.startswith("note:")] == [
        f"note: --compile off: dropped compile_shape_padding, compile_regions from {path} (they only qualify --compile)"
    ]
    assert (seen[0].compile, seen[0].compile_regions, seen[0].steps, seen[0].batch_size) == ("off", False, 2, 2)
