"""YAML files (by path or a shipped config's name), --section.field=value overrides, presets, and the
save/load round trip."""

from pathlib import Path

import pytest
import yaml

from moetrain.config import (
    JobConfig,
    ModelConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    format_config,
    load_config,
    parse_overrides,
    resolve_config_path,
    save_config,
    shipped_config_names,
)
from moetrain.config.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SHIPPED = ROOT / "moetrain" / "configs"
CONFIGS = sorted(SHIPPED.glob("*.yaml"))


def test_no_file_no_overrides_is_the_default():
    assert load_config(None, []) == JobConfig()


OVERRIDES = [
    # (override, section, field, value after loading)
    ("--train.steps=100", "train", "steps", 100),
    ("train.steps=7", "train", "steps", 7),
    ("--optim.lr=3e-4", "optim", "lr", 3e-4),  # PyYAML reads 3e-4 as a string
    ("--optim.lr=1", "optim", "lr", 1.0),  # int -> float field
    ("--optim.min_lr=null", "optim", "min_lr", None),
    ("--optim.min_lr=None", "optim", "min_lr", None),
    ("--optim.betas=[0.8, 0.99]", "optim", "betas", (0.8, 0.99)),
    ("--moe.capacity_factor=1.25", "moe", "capacity_factor", 1.25),
    ("--moe.capacity_factor=null", "moe", "capacity_factor", None),
    ("--model.tie_embeddings=true", "model", "tie_embeddings", True),
    ("--model.vocab_size=8192", "model", "vocab_size", 8192),
    ("--zero.reduce_bucket_size=5e8", "zero", "reduce_bucket_size", 500_000_000),
    ("--log.run_dir=runs/2024", "log", "run_dir", "runs/2024"),  # string field keeps the text
    ("--checkpoint.resume=never", "checkpoint", "resume", "never"),
    ("--checkpoint.dir=null", "checkpoint", "dir", None),
    ("--log.run_dir=runs/my run", "log", "run_dir", "runs/my run"),
    ("--parallel.ep=2", "parallel", "ep", 2),
]


@pytest.mark.parametrize("override, section, field, value", OVERRIDES, ids=[o[0] for o in OVERRIDES])
def test_override_is_parsed_to_the_field_type(override, section, field, value):
    got = getattr(getattr(load_config(None, [override]), section), field)
    assert got == value and type(got) is type(value)


def test_override_as_two_tokens():
    cfg = load_config(None, ["--train.steps", "12", "--train.seed=3"])
    assert (cfg.train.steps, cfg.train.seed) == (12, 3)


BAD_OVERRIDES = [
    ("--moe.top_k=abc", r"moe\.top_k \('abc'\) must be an int"),
    ("--train.steps=1.5", r"train\.steps \(1\.5\) must be an int"),
    ("--train.steps=null", r"train\.steps \(None\) must not be null"),
    ("--optim.lr=fast", r"optim\.lr \('fast'\) must be a number"),
    ("--model.tie_embeddings=maybe", r"model\.tie_embeddings \('maybe'\) must be true or false"),
    ("--optim.betas=0.9", r"optim\.betas \(0\.9\) must be a list"),
    ("--optim.betas=[0.9, x]", r"optim\.betas\[1\] \('x'\) must be a number"),
    ("--model.dim=0", r"model\.dim \(0\)"),
    ("--modle.dim=64", r"unknown config section 'modle'; valid sections: model, moe, parallel"),
    ("--model.dimm=64", r"unknown field model\.dimm; valid fields of model: preset, vocab_size, dim"),
    ("--model=64", r"must look like --section\.field=value"),
    ("--model.dim", r"must look like --section\.field=value"),
    ("--model.preset=gpt-5", r"model\.preset \('gpt-5'\) must be one of 'tiny'"),
    ("--zero.overlap_comm=true", r"unknown field zero\.overlap_comm; valid fields of zero: offload_optimizer"),
    ("--data.corpus=", r"data\.corpus \(''\) must be a registered corpus name or \"path\""),
]


@pytest.mark.parametrize("override, message", BAD_OVERRIDES, ids=[o[0] for o in BAD_OVERRIDES])
def test_bad_override_names_it(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_parse_overrides_only_names():
    assert parse_overrides(["--train.steps=5", "--log.run_dir=007"]) == [("train", "steps", 5),
                                                                          ("log", "run_dir", "007")]


def test_preset_then_explicit_fields_then_overrides():
    cfg = load_config(FIXTURES / "job_small.yaml", [])
    tiny = PRESETS["tiny"]
    assert cfg.model.preset == "tiny" and cfg.model.num_layers == 2  # the file overrides the preset
    assert cfg.model.dim == tiny.model.dim and cfg.model.tie_embeddings is True  # the rest from the preset
    assert cfg.moe.top_k == 1 and cfg.moe.num_experts == tiny.moe.num_experts
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.8, 0.9)

    cfg = load_config(FIXTURES / "job_small.yaml", ["--model.num_layers=3", "--moe.top_k=2"])
    assert cfg.model.num_layers == 3 and cfg.moe.top_k == 2


def test_preset_override_on_the_command_line():
    cfg = load_config(FIXTURES / "job_small.yaml", ["--model.preset=tiny-dense"])
    assert cfg.model.preset == "tiny-dense" and cfg.model.moe_every == 0 and cfg.model.dense_hidden_dim == 512
    assert cfg.model.num_layers == 2  # still the file's explicit value

    cfg = load_config(None, ["--model.preset=mixtral-8x7b", "--data.vocab_size=32000", "--parallel.ep=8"])
    assert (cfg.model.dim, cfg.model.num_kv_heads, cfg.moe.expert_hidden_dim, cfg.moe.activation) == \
        (4096, 8, 14336, "swiglu")


@pytest.mark.parametrize("field", ["overlap_comm", "contiguous_gradients", "prefetch_bucket_size",
                                   "param_persistence_threshold", "max_live_parameters", "max_reuse_distance"])
def test_zero_fields_that_would_not_act_do_not_exist(tmp_path, field):
    path = tmp_path / "job.yaml"
    path.write_text(f"zero:\n  {field}: 1\n")
    with pytest.raises(ValueError, match=rf"config: unknown field zero\.{field}; valid fields of zero: "
                                         "offload_optimizer, offload_param, pin_memory, reduce_bucket_size, "
                                         "allgather_bucket_size$"):
        load_config(path, [])


def test_bad_file_section_and_field(tmp_path):
    path = tmp_path / "empty_sections.yaml"
    path.write_text("model:\nmoe:\ntrain:\n  steps: 3\n")
    assert load_config(path, []) == JobConfig(train=TrainConfig(steps=3))
    for text, message in [("modle:\n  dim: 3\n", "unknown config section 'modle'"),
                          ("model:\n  dimm: 3\n", r"unknown field model\.dimm"),
                          ("model: 3\n", r"model \(3\) must be a mapping"),
                          ("- 1\n", "must hold a mapping of sections"),
                          ("model:\n  dim: [1\n", "is not valid YAML"),
                          ("moe:\n  top_k: abc\n", r"moe\.top_k \('abc'\) must be an int")]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_config(path, [])


def _non_default_job():
    return load_config(FIXTURES / "job_small.yaml",
                       ["--model.vocab_size=8192", "--data.vocab_size=8000", "--optim.min_lr=1e-5",
                        "--moe.capacity_factor=1.5", "--zero.offload_optimizer=cpu",
                        "--parallel.zero_stage=1", "--checkpoint.dir=/tmp/ckpt", "--train.dtype=bf16"])


@pytest.mark.parametrize("make", [JobConfig, _non_default_job], ids=["default", "non-default"])
def test_yaml_round_trip(tmp_path, make):
    cfg = make()
    save_config(cfg, tmp_path / "run" / "config.yaml")
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert text.startswith("# Resolved moetrain config: moetrain train --config")
    assert load_config(tmp_path / "run" / "config.yaml", []) == cfg
    assert config_from_dict(yaml.safe_load(text)) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_config_to_dict_is_plain_yaml():
    d = config_to_dict(JobConfig())
    assert list(d) == ["model", "moe", "parallel", "zero", "dp", "optim", "train", "finetune", "data", "classify",
                       "checkpoint", "log"]
    assert d["optim"]["betas"] == [0.9, 0.95]
    yaml.safe_dump(d)  # no Python-only types


def test_format_config_marks_changed_fields():
    text = format_config(load_config(None, ["--train.steps=5"]))
    lines = {line[2:].split(" = ")[0].strip(): line for line in text.splitlines()}
    assert lines["train.steps"].startswith("*") and lines["train.steps"].endswith("= 5")
    assert lines["train.seed"].startswith(" ")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load_and_start_with_their_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and f"train --config {path.stem}" in first
    cfg = load_config(path, [])
    # A config named after a preset uses it; the others spell their model out.
    assert cfg.model.preset == (path.stem if path.stem in PRESETS else None)
    # By name, with or without .yaml: the same file, the same config.
    assert load_config(path.stem, []) == load_config(path.name, []) == cfg


def test_shipped_config_names_are_the_package_data():
    assert shipped_config_names() == sorted(p.stem for p in CONFIGS) and "tiny" in shipped_config_names()
    assert resolve_config_path("tiny") == SHIPPED / "tiny.yaml"


def test_a_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("train:\n  steps: 7\n")
    assert resolve_config_path("tiny") == Path("tiny") and load_config("tiny", []).train.steps == 7


def test_configs_folder_path_is_the_shipped_config_where_no_such_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the issues' `--config configs/r8.yaml`, from a wheel or any directory
    assert resolve_config_path("configs/r8.yaml") == resolve_config_path("configs/r8") == SHIPPED / "r8.yaml"
    assert load_config("configs/thucnews.yaml", []) == load_config("thucnews", [])
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "r8.yaml").write_text("train:\n  steps: 7\n")
    assert resolve_config_path("configs/r8.yaml") == Path("configs/r8.yaml")  # a real file still wins


@pytest.mark.parametrize("config", ["nope", "configs/nope.yaml", "other/tiny.yaml", "configs/sub/tiny.yaml",
                                    "tiny.yml"])
def test_neither_file_nor_shipped_name_lists_the_shipped_configs(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name here
    with pytest.raises(ValueError) as err:
        load_config(config, [])
    assert str(err.value) == (f"--config ({config!r}) is neither a file nor a shipped config; shipped configs: "
                              + ", ".join(sorted(p.stem for p in CONFIGS)))


def test_tiny_config_is_the_cpu_demo():
    cfg = load_config(SHIPPED / "tiny.yaml", [])
    assert "--nproc 2" in (SHIPPED / "tiny.yaml").read_text().splitlines()[0]
    assert (cfg.parallel.ep, cfg.data.corpus, cfg.train.dtype) == (2, "shakespeare", "fp32")
    assert cfg.grad_accum_steps(2) >= 1
    dense = load_config(SHIPPED / "tiny-dense.yaml", [])
    # Same data and schedule: only the model differs.
    for section in ("data", "train", "optim"):
        assert getattr(dense, section) == getattr(cfg, section)
    assert isinstance(dense.model, ModelConfig) and dense.model.moe_every == 0
