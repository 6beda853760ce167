"""Config loading at its edges: YAML written twice, empty or scalar sections, booleans YAML reads from
words, non-finite numbers, --deepspeed against explicit overrides, a preset given over a saved config,
fields of a switched-off feature, and the ``--section.field value`` form on the command line."""

import re
from pathlib import Path

import pytest
import yaml

from moetrain.cli import main
from moetrain.config import JobConfig, load_config, save_config
from moetrain.config.convert import BOOL_WORD_CHOICES, config_to_dict

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "moetrain" / "configs").glob("*.yaml"))


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


# --- YAML ---------------------------------------------------------------------------------------------


def test_a_section_written_twice_is_refused_naming_key_file_and_line(tmp_path):
    path = _write(tmp_path, "train:\n  steps: 5\n  global_batch_size: 4\n  micro_batch_size: 4\n"
                            "optim:\n  lr: 1.0e-3\ntrain:\n  seed: 3\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*key 'train' is written twice.*line 7"):
        load_config(path, [])


def test_a_field_written_twice_in_a_section_is_refused(tmp_path):
    path = _write(tmp_path, "train:\n  steps: 5\n  seed: 1\n  steps: 9\n")
    with pytest.raises(ValueError, match=r"key 'steps' is written twice.*line 4"):
        load_config(path, [])


def test_an_empty_section_takes_an_override(tmp_path):
    path = _write(tmp_path, "model:\n  preset: tiny\nmoe:\n  # top_k: 2\ntrain:\n  steps: 5\n")
    cfg = load_config(path, ["--moe.top_k=1"])
    assert cfg.moe.top_k == 1 and cfg.train.steps == 5


def test_a_scalar_section_with_an_override_names_the_section(tmp_path):
    path = _write(tmp_path, "moe: 5\n")
    with pytest.raises(ValueError, match=r"config section 'moe' \(5\) must be a mapping of fields"):
        load_config(path, ["--moe.top_k=1"])


def test_routing_trace_off_unquoted_is_the_word(tmp_path):
    assert load_config(_write(tmp_path, "log:\n  routing_trace: off\n"), []).log.routing_trace == "off"
    with pytest.raises(ValueError, match=r"log\.routing_trace \(True\) must be a string \(one of 'counts', 'full', "
                                         r"'off'\).*write the value quoted"):
        load_config(_write(tmp_path, "log:\n  routing_trace: on\n"), [])


def test_a_yaml_boolean_for_another_string_field_asks_for_quotes(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint\.resume \(False\) must be a string: YAML reads unquoted "
                                         r"yes/no/on/off/true/false as a boolean; write the value quoted"):
        load_config(_write(tmp_path, "checkpoint:\n  resume: no\n"), [])


def test_every_string_choice_that_yaml_reads_as_a_boolean_is_mapped():
    """Every require_choice whose choices hold a YAML 1.1 boolean word is in BOOL_WORD_CHOICES."""
    words = {"on", "off", "yes", "no", "true", "false", "y", "n"}
    sources = "\n".join(p.read_text() for p in (ROOT / "moetrain" / "config").glob("*.py"))
    for field, choices in re.findall(r'require_choice\("([\w.]+)", [^,]+, \(([^)]*)\)', sources):
        if words & set(re.findall(r'"(\w+)"', choices)):
            assert field in BOOL_WORD_CHOICES, field
    assert "log.routing_trace" in BOOL_WORD_CHOICES


@pytest.mark.parametrize("value", ["null", "~", "NULL"])
def test_resume_null_is_not_a_checkpoint_path(value):
    with pytest.raises(ValueError, match=r'checkpoint\.resume .* must be "auto", "never" or a checkpoint path'):
        load_config(None, [f"--checkpoint.resume={value}"])


# --- numbers ------------------------------------------------------------------------------------------

FINITE_FIELDS = ["optim.lr", "optim.eps", "optim.weight_decay", "optim.min_lr", "optim.grad_clip", "model.init_std",
                 "model.norm_eps", "model.rope_theta", "model.clip_qkv", "moe.aux_loss_coef", "moe.z_loss_coef",
                 "moe.router_init_std"]


@pytest.mark.parametrize("value", [".inf", ".nan"])
@pytest.mark.parametrize("field", FINITE_FIELDS)
def test_non_finite_values_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"{re.escape(field)} \((inf|nan)\) must be .*finite number"):
        load_config(None, [f"--{field}={value}"])


# --- DeepSpeed and presets ----------------------------------------------------------------------------

DS = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 2.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "zero_optimization": {"stage": 1}}


def test_explicit_overrides_win_over_the_deepspeed_json():
    plain = load_config("tiny", [], deepspeed=DS, world_size=2)
    assert (plain.optim.lr, plain.optim.grad_clip, plain.parallel.zero_stage, plain.train.micro_batch_size) == \
        (3e-4, 2.0, 1, 8)
    cfg = load_config("tiny", ["--optim.lr=1e-4", "--optim.grad_clip=0.5", "--parallel.zero_stage=0",
                               "--train.micro_batch_size=4"], deepspeed=DS, world_size=2)
    assert (cfg.optim.lr, cfg.optim.grad_clip, cfg.parallel.zero_stage, cfg.train.micro_batch_size) == \
        (1e-4, 0.5, 0, 4)
    # The JSON's batch of 16 (8 per rank, no accumulation) holds; the accumulation follows the new micro-batch.
    assert cfg.train.global_batch_size == 16 and cfg.grad_accum_steps(2) == 2


def test_an_overridden_lr_keeps_the_deepspeed_cosine_floor_ratio():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1, "warmup_type": "linear"}}}
    assert load_config("tiny", [], deepspeed=ds, world_size=2).optim.min_lr == pytest.approx(1e-5)
    for lr in (1e-3, 1e-6):  # the floor follows the lr; it was left at 1e-5 (above the lr at 1e-6: refused)
        assert load_config("tiny", [f"--optim.lr={lr}"], deepspeed=ds, world_size=2).optim.min_lr == \
            pytest.approx(0.1 * lr)
    assert load_config("tiny", ["--optim.schedule=constant"], deepspeed=ds, world_size=2).optim.min_lr is None
    # A floor the YAML wrote is absolute: a JSON without WarmupCosineLR leaves it where it is.
    plain = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg = load_config("tiny", ["--optim.min_lr=1e-5", "--optim.lr=2e-3"], deepspeed=plain, world_size=2)
    assert cfg.optim.min_lr == 1e-5
    cfg = load_config("mixtral-8x7b", ["--optim.lr=2e-3"], deepspeed=plain, world_size=64)
    assert cfg.optim.min_lr == load_config("mixtral-8x7b", []).optim.min_lr


def test_yaml_merge_keys_still_load_and_an_unhashable_key_is_invalid_yaml(tmp_path):
    path = _write(tmp_path, "data:\n  corpus: path\n  sources:\n    - &web {path: a.txt, weight: 3.0}\n"
                            "    - <<: *web\n      path: b.txt\n      weight: 1.0\n")
    assert [(s.path, s.weight) for s in load_config(path, []).data.sources] == [("a.txt", 3.0), ("b.txt", 1.0)]
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_config(_write(tmp_path, "? [a, b]\n: 1\n"), [])


def test_a_constant_deepspeed_schedule_drops_the_files_cosine_floor():
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}}
    cfg = load_config("mixtral-8x7b", [], deepspeed=ds, world_size=64)  # the file sets optim.min_lr
    assert cfg.optim.schedule == "constant" and cfg.optim.min_lr is None


def test_a_preset_over_a_saved_config_is_refused(tmp_path):
    save_config(load_config("tiny", []), tmp_path / "config.yaml")
    with pytest.raises(ValueError, match=r"--model\.preset \('mixtral-8x7b'\) would change only the label"):
        load_config(tmp_path / "config.yaml", ["--model.preset=mixtral-8x7b"])
    # The preset it already names changes nothing, and is fine.
    assert load_config(tmp_path / "config.yaml", ["--model.preset=tiny"]) == load_config("tiny", [])


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_round_trip_through_a_saved_config(tmp_path, path):
    cfg = load_config(path, [])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml", []) == cfg


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_comments_state_the_process_count(path):
    lines = path.read_text().splitlines()
    nproc = int(m.group(1)) if (m := re.search(r"--nproc (\d+)", lines[0])) else 1
    head = " ".join(line.lstrip("# ") for line in lines if line.startswith("#"))
    for count in re.findall(r"\bon (\d+) process(?:es)?\b", head):
        assert int(count) == nproc, f"{path.name}: 'on {count} process' but the command runs {nproc}"


# --- rules --------------------------------------------------------------------------------------------

SWITCHED_OFF = [
    (["--model.num_classes=5"], "model.num_classes", 'model.head "classifier"'),
    (["--moe.shared_hidden_dim=64"], "moe.shared_hidden_dim", "moe.num_shared_experts > 0"),
    (["--optim.schedule=constant", "--optim.min_lr=1e-5"], "optim.min_lr", 'optim.schedule "cosine"'),
    (["--dp.onebit_warmup_steps=5"], "dp.onebit_warmup_steps", 'dp.grad_compression "onebit"'),
    (["--train.activation_checkpointing_every=3"], "train.activation_checkpointing_every",
     'train.activation_checkpointing "every_n"'),
    (["--moe.dynamic_capacity_base=3.0"], "moe.dynamic_capacity_base", "moe.dynamic_capacity true"),
    (["--moe.dynamic_capacity_scale=0.7"], "moe.dynamic_capacity_scale", "moe.dynamic_capacity true"),
    (["--moe.dynamic_capacity_shift=0.0"], "moe.dynamic_capacity_shift", "moe.dynamic_capacity true"),
    (["--model.moe_every=0", "--model.moe_layer_offset=2", "--parallel.ep=1"], "model.moe_layer_offset",
     "model.moe_every > 0"),
    (["--moe.drop_policy=score", "--moe.capacity_factor=null"], "moe.drop_policy", "moe.capacity_factor set"),
]


@pytest.mark.parametrize(("overrides", "field", "needs"), SWITCHED_OFF, ids=[f for _, f, _ in SWITCHED_OFF])
def test_a_field_of_a_switched_off_feature_is_refused(overrides, field, needs):
    with pytest.raises(ValueError, match=rf"{re.escape(field)} \(.*\) acts only with {re.escape(needs)}"):
        load_config("tiny", overrides)


def test_the_same_fields_act_with_their_feature_on():
    load_config("tiny", ["--model.head=classifier", "--model.num_classes=5", "--model.causal=false"])
    load_config("tiny", ["--moe.num_shared_experts=1", "--moe.shared_hidden_dim=64"])
    load_config("tiny", ["--optim.min_lr=1e-5"])
    load_config("tiny", ["--train.activation_checkpointing=every_n", "--train.activation_checkpointing_every=3"])
    load_config("tiny", ["--moe.dynamic_capacity=true", "--moe.capacity_factor=1.0", "--moe.dynamic_capacity_base=3"])
    load_config("tiny", ["--model.moe_layer_offset=2"])
    load_config("tiny", ["--moe.drop_policy=score", "--moe.capacity_factor=1.0"])


def test_nccl_needs_a_device_that_may_be_cuda():
    with pytest.raises(ValueError, match=r"parallel\.backend \('nccl'\) needs train\.device \"cuda\" or \"auto\""):
        load_config(None, ["--parallel.backend=nccl", "--train.device=cpu"])
    assert load_config(None, ["--parallel.backend=nccl", "--train.device=auto"]).parallel.backend == "nccl"


# --- command line -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "line"), [
    (["--train.steps", "9"], "train.steps"),
    (["--train.dtype", "bf16"], "train.dtype"),
    (["--log.run_dir", "runs/x"], "log.run_dir"),
    (["--parallel.dp", "-1", "--train.steps", "9"], "train.steps"),
    (["train.steps", "9"], "train.steps"),
])
def test_an_override_and_its_value_as_two_arguments(capsys, args, line):
    assert main(["config", "show", *args]) == 0
    shown = {ln[2:].split(" = ")[0].strip(): ln.split(" = ")[1] for ln in capsys.readouterr().out.splitlines()}
    expected = load_config(None, [f"--{args[-2].lstrip('-')}={args[-1]}"])
    section, name = line.split(".")
    assert shown[line] == repr(getattr(getattr(expected, section), name))
    assert shown[line] != repr(getattr(getattr(JobConfig(), section), name))


def test_a_stray_word_after_an_override_pair_is_still_refused(capsys):
    with pytest.raises(SystemExit):
        main(["config", "show", "--train.steps", "9", "extra"])
    assert "unrecognised arguments: extra" in capsys.readouterr().err


def test_a_saved_config_with_a_field_an_older_version_ignored_still_loads(tmp_path):
    # A run saved before these refusals holds every field at its value, the ignored ones too: it must
    # still resume, evaluate and export. A hand-written file, or an override, is refused as before.
    saved = config_to_dict(load_config("tiny", []))
    saved["optim"].update(schedule="constant", min_lr=1e-5)
    saved["dp"]["onebit_warmup_steps"] = 5
    body = yaml.safe_dump(saved, sort_keys=False)
    path = tmp_path / "config.yaml"
    path.write_text("# Resolved moetrain config: moetrain train --config x\n" + body)
    with pytest.warns(UserWarning, match="it did nothing when this config was saved"):
        cfg = load_config(path, [])
    assert cfg.optim.min_lr is None and cfg.dp.onebit_warmup_steps is None and cfg.optim.schedule == "constant"
    with pytest.raises(ValueError, match=r"optim.min_lr \(2e-05\) acts only with"):
        load_config(path, ["--optim.min_lr=2e-5"])
    path.write_text(body)  # no header: a file the user wrote
    with pytest.raises(ValueError, match="acts only with"):
        load_config(path, [])
