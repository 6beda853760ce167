"""Import of DeepSpeed JSON configs: batch arithmetic as DeepSpeed checks it, precision, ZeRO,
MoE expert parallelism, and one warning naming every unsupported key."""

import json
import warnings
from pathlib import Path

import pytest

from moetrain.config import JobConfig, apply_deepspeed_config, load_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _apply(ds, world_size=8, cfg=None):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these configs must import without any warning
        return apply_deepspeed_config(cfg or JobConfig(), ds, world_size=world_size)


def test_zero3_moe_skeleton_from_the_design_notes():
    """tests/fixtures/ds_zero3_moe.json is the "ZeRO-3 + MoE" DeepSpeed skeleton of the design notes
    (section 3.1): batch 64 with 4 accumulation steps, fp16, ZeRO-3 with CPU offload, ep_size 8."""
    with pytest.warns(UserWarning) as record:
        cfg = load_config(None, [], deepspeed=FIXTURES / "ds_zero3_moe.json", world_size=16)
    assert len(record) == 1
    message = str(record[0].message)
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in message
    assert "moe.use_tutel" in message
    # No equivalent in FSDP2/DDP: named in the one warning, under its DeepSpeed name.
    assert "zero_optimization.contiguous_gradients" in message
    # Supported, or what moetrain does anyway (overlap_comm: true): no warning.
    assert "moe.enabled" not in message and "pin_memory" not in message and "overlap_comm" not in message
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.grad_accum) == (64, 1, 4)
    assert cfg.grad_accum_steps(16) == 4
    assert cfg.train.dtype == "fp16"
    assert (cfg.parallel.zero_stage, cfg.parallel.ep) == (3, 8)
    z = cfg.zero
    assert (z.offload_optimizer, z.offload_param, z.pin_memory) == ("cpu", "cpu", True)


BATCHES = [
    # (train_batch_size, micro, accum, world) -> (global, micro, accum)
    ((64, 2, 4, 8), (64, 2, 4)),
    ((64, 2, None, 8), (64, 2, 4)),
    ((64, None, 4, 8), (64, 2, 4)),
    ((None, 2, 4, 8), (64, 2, 4)),
    ((64, None, None, 8), (64, 8, 1)),  # one alone: no accumulation, as DeepSpeed
    ((None, 2, None, 8), (16, 2, 1)),
    ((12, 3, 4, 1), (12, 3, 4)),
]


@pytest.mark.parametrize("given, expected", BATCHES, ids=[str(b[0]) for b in BATCHES])
def test_any_two_batch_sizes_determine_the_third(given, expected):
    batch, micro, accum, world = given
    ds = {k: v for k, v in (("train_batch_size", batch), ("train_micro_batch_size_per_gpu", micro),
                            ("gradient_accumulation_steps", accum)) if v is not None}
    cfg = _apply(ds, world_size=world)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.grad_accum) == expected
    assert cfg.grad_accum_steps(world) == expected[2]


@pytest.mark.parametrize("ds, world", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 8),
    ({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 4}, 8),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 3}, 8),
    ({"train_batch_size": 12}, 8),
])
def test_inconsistent_batch_sizes_name_the_three_values(ds, world):
    with pytest.raises(ValueError) as err:
        _apply(ds, world_size=world)
    text = str(err.value)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert f"{key} ({ds.get(key)})" in text
    assert f"data-parallel size ({world})" in text


@pytest.mark.parametrize("ds, message", [
    ({"gradient_accumulation_steps": 4}, r"gradient_accumulation_steps \(4\) needs train_batch_size"),
    ({"train_batch_size": 0}, r"train_batch_size \(0\) must be an int > 0"),
    ({"train_micro_batch_size_per_gpu": 1.5}, r"train_micro_batch_size_per_gpu \(1\.5\)"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"fp16\.enabled and bf16\.enabled"),
    ({"fp16": True}, r"fp16 \(True\) must be an object"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     r"zero_optimization\.offload_optimizer\.device \('nvme'\)"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     r"zero\.offload_param \('cpu'\)"),
    ({"zero_optimization": {"stage": 5}}, r"parallel\.zero_stage \(5\)"),
    ({"moe": {"ep_size": 0}}, r"moe\.ep_size \(0\) must be an int > 0"),
    ({"moe": {"ep_size": True}}, r"moe\.ep_size \(True\) must be an int > 0"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, r"optimizer\.type \('Lamb'\)"),
    ({"gradient_clipping": -1.0}, r"optim\.grad_clip \(-1\.0\)"),
])
def test_bad_deepspeed_values(ds, message):
    with pytest.raises(ValueError, match=message):
        _apply(ds)


@pytest.mark.parametrize("ds, dtype", [
    ({"fp16": {"enabled": True, "loss_scale": 0}}, "fp16"),
    ({"bf16": {"enabled": True}}, "bf16"),
    ({"bfloat16": {"enabled": True}}, "bf16"),
    ({"bf16": {"enabled": False}}, "fp32"),
    ({"bf16": {"enabled": "auto"}}, "bf16"),  # "auto" = not set: the config's dtype stays
])
def test_precision(ds, dtype):
    cfg = _apply(ds, cfg=load_config(None, ["--train.dtype=bf16"]))
    assert cfg.train.dtype == dtype


def test_zero_optimizer_scheduler_and_moe_fields():
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": 0.5,
        "steps_per_print": 25,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.99], "eps": 1e-6,
                                                  "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "total_num_steps": 200,
                                                           "cos_min_ratio": 0.1, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                              "allgather_partitions": True, "reduce_scatter": True, "overlap_comm": True,
                              "reduce_bucket_size": 2e8, "allgather_bucket_size": 3e8},
        "moe": {"ep_size": 4, "num_experts": 8, "k": 1, "capacity_factor": 1.25},
    }
    cfg = _apply(ds, world_size=8)
    assert cfg.optim.grad_clip == 0.5 and cfg.log.every == 25
    o = cfg.optim
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (2e-4, (0.9, 0.99), 1e-6, 0.05)
    assert (cfg.optim.schedule, cfg.optim.warmup_steps, cfg.train.steps) == ("cosine", 10, 200)
    assert cfg.optim.min_lr == pytest.approx(2e-5)
    assert cfg.parallel.zero_stage == 1
    z = cfg.zero
    assert (z.offload_optimizer, z.offload_param, z.pin_memory) == ("cpu", "none", False)
    assert (z.reduce_bucket_size, z.allgather_bucket_size) == (200_000_000, 300_000_000)
    assert (cfg.parallel.ep, cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor) == (4, 8, 1, 1.25)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupCosineLR"])
@pytest.mark.parametrize("warmup_type", [None, "log"])
def test_a_log_warmup_is_said_out_loud(kind, warmup_type):
    """DeepSpeed warms up along a log curve unless told "linear"; the warmup here is linear."""
    params = {"warmup_num_steps": 10, "warmup_max_lr": 1e-3}
    if warmup_type is not None:
        params["warmup_type"] = warmup_type
    with pytest.warns(UserWarning) as record:
        cfg = apply_deepspeed_config(JobConfig(), {"scheduler": {"type": kind, "params": params}}, world_size=8)
    assert len(record) == 1
    message = str(record[0].message)
    told = "is 'log'" if warmup_type else "is not set, and DeepSpeed's default is 'log'"
    assert f"scheduler.params.warmup_type {told}" in message and "moetrain warms up linearly" in message
    assert (cfg.optim.warmup_steps, cfg.optim.lr) == (10, 1e-3)
    # "linear" is what runs here, and without a warmup its shape does not matter: no warning.
    for quiet in ({**params, "warmup_type": "linear"}, {"warmup_num_steps": 0}):
        _apply({"scheduler": {"type": kind, "params": quiet}})


@pytest.mark.parametrize("moe, capacity", [({"drop_tokens": False, "capacity_factor": 2.0}, None),
                                           ({"drop_tokens": True}, 1.0)])
def test_drop_tokens(moe, capacity):
    assert _apply({"moe": moe}).moe.capacity_factor == capacity


def test_one_warning_names_every_unsupported_key():
    ds = {"train_batch_size": 16, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
          "fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000},
          "zero_optimization": {"stage": 1, "round_robin_gradients": True,
                                "offload_optimizer": {"device": "cpu", "buffer_count": 4}},
          "scheduler": {"type": "OneCycle", "params": {}},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
          "moe": {"ep_size": 2, "use_residual": True, "enabled": False}}
    with pytest.warns(UserWarning) as record:
        cfg = apply_deepspeed_config(JobConfig(), ds, world_size=4)
    assert len(record) == 1
    message = str(record[0].message)
    for key in ("wall_clock_breakdown", "zero_allow_untested_optimizer", "fp16.initial_scale_power",
                "fp16.loss_scale_window", "zero_optimization.round_robin_gradients",
                "zero_optimization.offload_optimizer.buffer_count", "scheduler (type 'OneCycle')",
                "optimizer.params.torch_adam", "moe.use_residual", "moe.enabled"):
        assert key in message, key
    assert cfg.parallel.ep == 2 and cfg.optim.lr == 1e-3 and cfg.train.dtype == "fp16"


def test_zero_knobs_without_an_equivalent_are_named_in_the_one_warning():
    """DeepSpeed ZeRO settings FSDP2/DDP have no knob for do not become config fields that only warn:
    they are ignored keys, listed under their DeepSpeed names, and the zero section keeps its defaults."""
    unhonoured = {"overlap_comm": False, "contiguous_gradients": True, "stage3_prefetch_bucket_size": 1e7,
                  "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 1e8,
                  "stage3_max_reuse_distance": 1e8}
    with pytest.warns(UserWarning) as record:
        cfg = apply_deepspeed_config(JobConfig(), {"zero_optimization": {"stage": 3, **unhonoured}}, world_size=8)
    assert len(record) == 1
    message = str(record[0].message)
    for key in unhonoured:
        assert f"zero_optimization.{key}" in message, key
    assert cfg.parallel.zero_stage == 3 and cfg.zero == JobConfig().zero


@pytest.mark.parametrize("stage", [2, 3])
def test_bucket_sizes_of_a_layout_without_those_buckets_are_ignored_keys(stage):
    """At stages 2/3 FSDP2 has neither DDP's gradient buckets nor ZeRO-1's all-gather buckets: the
    import loads (the zero section would refuse the values), naming both in the one warning."""
    zero = {"reduce_bucket_size": 2e8, "allgather_bucket_size": 3e8, "stage": stage}  # stage last: any key order
    with pytest.warns(UserWarning) as record:
        cfg = apply_deepspeed_config(JobConfig(), {"zero_optimization": zero}, world_size=8)
    assert len(record) == 1
    message = str(record[0].message)
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        assert f"zero_optimization.{key} (no such bucket at zero stage {stage}" in message, key
    assert cfg.parallel.zero_stage == stage and cfg.zero == JobConfig().zero


def test_reduce_bucket_size_at_stage_0_is_taken_and_the_allgather_one_ignored():
    with pytest.warns(UserWarning, match=r"zero_optimization\.allgather_bucket_size \(no such bucket") as record:
        cfg = apply_deepspeed_config(JobConfig(), {"zero_optimization": {"stage": 0, "reduce_bucket_size": 2e8,
                                                                         "allgather_bucket_size": 3e8}}, world_size=8)
    assert len(record) == 1 and "reduce_bucket_size" not in str(record[0].message)
    z = cfg.zero
    assert (z.reduce_bucket_size, z.allgather_bucket_size) == (200_000_000, JobConfig().zero.allgather_bucket_size)


def test_ep_size_is_taken_as_given_and_checked_with_the_layout():
    """moe.ep_size becomes parallel.ep; whether it divides the world and the experts is decided where
    the layout is built (ParallelDims), with the world size the job really has."""
    from moetrain.distributed.parallel_dims import ParallelDims

    cfg = _apply({"moe": {"ep_size": 8, "num_experts": 4}}, world_size=8)
    assert (cfg.parallel.ep, cfg.moe.num_experts) == (8, 4)
    with pytest.raises(ValueError, match=r"parallel\.ep \(8\) must divide moe\.num_experts \(4\)"):
        ParallelDims.from_config(cfg.parallel, world_size=8, num_experts=cfg.moe.num_experts)


def test_deepspeed_file_needs_the_world_size(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16}))
    with pytest.raises(ValueError, match="world_size"):
        load_config(None, [], deepspeed=path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(None, [], deepspeed=path, world_size=1)
    for missing in (tmp_path / "absent.json", tmp_path):  # no such file; a folder
        with pytest.raises(ValueError, match=r"--deepspeed \(.*\) must be a readable JSON file"):
            load_config(None, [], deepspeed=missing, world_size=1)
