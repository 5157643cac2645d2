"""RunConfig: defaults, layers, file round trips and validation errors."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import yaml

from vlmdoctor.errors import EXIT_USAGE, UsageError
from vlmdoctor.run.config import LAYER_NAMES, RunConfig, knob_table

LIGER_KNOBS = ["liger_rope", "liger_rms_norm", "liger_swiglu", "liger_fused_linear_cross_entropy"]


def test_defaults_are_a_typical_first_training_script():
    c = RunConfig()
    assert c.weight_dtype == "fp32"
    assert c.autocast == "bf16"
    assert c.batch_size == 4
    assert c.sampler == "random"
    assert c.packing is False
    assert c.attention == "sdpa"
    for name in LIGER_KNOBS:
        assert getattr(c, name) is False, name
    assert c.uses_liger is False
    assert c.compile == "off"
    assert c.gradient_checkpointing is True
    assert c.num_workers == 0
    assert c.model == "0.5b"
    assert c.stage == 2


def test_default_config_validates():
    RunConfig().validate()  # must not raise


def test_every_knob_has_a_layer_0_to_5():
    table = knob_table()
    names = [row["name"] for row in table]
    assert names == [f.name for f in fields(RunConfig)]
    assert len(names) == len(set(names))
    for row in table:
        assert row["layer"] in range(6), row
        assert row["layer_name"] == LAYER_NAMES[row["layer"]]
        assert row["help"], row
    # every layer of the recipe is populated
    assert {row["layer"] for row in table} == set(range(6))


@pytest.mark.parametrize(
    "name, layer",
    [
        ("model", 0),
        ("stage", 0),
        ("weight_dtype", 1),
        ("autocast", 1),
        ("batch_size", 2),
        ("sampler", 3),
        ("packing", 3),
        ("attention", 4),
        ("liger_rope", 4),
        ("compile", 4),
        ("gradient_checkpointing", 5),
        ("num_workers", 5),
    ],
)
def test_knobs_sit_in_their_recipe_layer(name, layer):
    rows = {row["name"]: row for row in knob_table()}
    assert rows[name]["layer"] == layer


def test_knob_table_defaults_match_dataclass():
    c = RunConfig().to_dict()
    for row in knob_table():
        assert row["default"] == c[row["name"]]
        if row["choices"] is not None:
            assert row["default"] is None or row["default"] in row["choices"]


NON_DEFAULT = dict(
    model="tiny",
    stage=1,
    device="cpu",
    lr=3e-4,
    weight_dtype="bf16",
    autocast="off",
    batch_size=16,
    sampler="length_bucketed",
    packing=True,
    pack_length=4096,
    pad_to_multiple_of=64,
    attention="math",
    liger_rms_norm=True,
    compile="max-autotune",
    gradient_checkpointing=False,
    num_workers=2,
    pixel_shuffle=3,
    projector="mlp2x_gelu",
    vision="clip-vit-l-14-336",
)


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_dump_load_round_trip(tmp_path, suffix):
    cfg = RunConfig(**NON_DEFAULT)
    path = tmp_path / f"run{suffix}"
    cfg.dump(path)
    loaded = RunConfig.load(path)
    assert loaded == cfg
    assert loaded.to_dict() == cfg.to_dict()
    # and the file is really in the format its suffix says
    text = path.read_text()
    parsed = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    assert parsed == cfg.to_dict()


def test_default_round_trip_keeps_float_lr(tmp_path):
    path = tmp_path / "c.yaml"
    RunConfig().dump(path)
    loaded = RunConfig.load(path)
    assert isinstance(loaded.lr, float) and loaded.lr == RunConfig().lr


def test_partial_yaml_fills_defaults(tmp_path):
    path = tmp_path / "partial.yaml"
    path.write_text("model: tiny\nbatch_size: 8\npacking: true\n")
    cfg = RunConfig.load(path)
    assert (cfg.model, cfg.batch_size, cfg.packing) == ("tiny", 8, True)
    assert cfg.sampler == RunConfig().sampler


def test_report_json_is_accepted_as_config(tmp_path):
    cfg = RunConfig(model="tiny", stage=1, batch_size=2, packing=True)
    report = {
        "schema_version": 1,
        "status": "ok",
        "config": cfg.to_dict(),
        "metrics": {"real_tokens_per_s": 1.0},
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert RunConfig.load(path) == cfg


def test_unknown_knob_lists_valid_knobs():
    with pytest.raises(UsageError) as ei:
        RunConfig.from_dict({"batchsize": 8})
    msg = str(ei.value)
    assert "batchsize" in msg
    for name in ("batch_size", "packing", "weight_dtype", "gradient_checkpointing"):
        assert name in msg
    assert ei.value.exit_code == EXIT_USAGE


def test_unknown_knob_in_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("modle: tiny\n")
    with pytest.raises(UsageError, match="modle") as ei:
        RunConfig.load(path)
    assert "bad.yaml" in str(ei.value)


@pytest.mark.parametrize(
    "knob, value, valid",
    [
        ("weight_dtype", "fp16", ["fp32", "bf16"]),
        ("sampler", "sorted", ["random", "length_bucketed"]),
        ("attention", "flash2", ["sdpa", "flash", "efficient", "cudnn", "math", "eager", "flex"]),
        ("stage", 3, ["1", "2"]),
    ],
)
def test_bad_choice_names_valid_choices(knob, value, valid):
    with pytest.raises(UsageError) as ei:
        RunConfig.from_dict({knob: value})
    msg = str(ei.value)
    assert knob in msg
    for v in valid:
        assert v in msg


@pytest.mark.parametrize(
    "knob, value",
    [
        ("batch_size", "4"),
        ("batch_size", 4.0),
        ("batch_size", True),
        ("gradient_checkpointing", "yes"),
        ("gradient_checkpointing", 1),
        ("packing", "false"),
        ("lr", "fast"),
    ],
)
def test_wrong_type_is_usage_error(knob, value):
    with pytest.raises(UsageError, match=knob):
        RunConfig.from_dict({knob: value})


@pytest.mark.parametrize("knob, value", [("batch_size", 0), ("steps", 0), ("pack_length", 8), ("warmup", -1)])
def test_below_minimum_is_usage_error(knob, value):
    with pytest.raises(UsageError, match=knob):
        RunConfig.from_dict({knob: value})


def test_non_mapping_config_is_usage_error(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(UsageError, match="mapping"):
        RunConfig.load(path)


def test_unparseable_and_missing_files_are_usage_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="does not parse"):
        RunConfig.load(bad)
    with pytest.raises(UsageError, match="cannot read"):
        RunConfig.load(tmp_path / "missing.yaml")


def test_replace_changes_and_validates():
    base = RunConfig()
    new = base.replace(batch_size=16, packing=True)
    assert (new.batch_size, new.packing) == (16, True)
    assert (base.batch_size, base.packing) == (4, False)  # a copy, the original is untouched
    with pytest.raises(UsageError, match="weight_dtype"):
        base.replace(weight_dtype="fp16")
    with pytest.raises(UsageError, match="batch_size"):
        base.replace(batch_size="16")
    with pytest.raises(UsageError, match="valid knobs"):
        base.replace(not_a_knob=1)


def test_uses_liger_follows_each_flag():
    for name in LIGER_KNOBS:
        assert RunConfig(**{name: True}).uses_liger, name


@pytest.mark.parametrize("knob", ["batch_size", "model", "stage"])
def test_none_for_non_optional_knob_is_usage_error(knob):
    with pytest.raises(UsageError, match=knob):
        RunConfig.from_dict({knob: None})


def test_yaml_scientific_notation_lr(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny\nlr: 2e-5\n")
    assert RunConfig.load(path).lr == pytest.approx(2e-5)
