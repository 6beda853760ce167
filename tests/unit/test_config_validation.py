"""Every bad value a user can write raises ValueError naming the field and the value."""

import dataclasses

import pytest

from moetrain.config import (
    SECTIONS,
    CheckpointConfig,
    JobConfig,
    LogConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    ZeroConfig,
    build_section,
    resolve_device,
)

BAD_SECTION_VALUES = [
    # (config class, kwargs, field named in the error, value shown in the error)
    (ModelConfig, {"dim": 0}, "model.dim", "0"),
    (ModelConfig, {"dim": 130, "num_heads": 4}, "model.dim", "130"),
    (ModelConfig, {"dim": 12, "num_heads": 4}, "model.dim", "12"),  # head dim 3 is odd: no rotary pairs
    (ModelConfig, {"num_layers": -1}, "model.num_layers", "-1"),
    (ModelConfig, {"num_heads": True}, "model.num_heads", "True"),
    (ModelConfig, {"num_kv_heads": 3}, "model.num_kv_heads", "3"),
    (ModelConfig, {"num_kv_heads": 0}, "model.num_kv_heads", "0"),
    (ModelConfig, {"vocab_size": 1}, "model.vocab_size", "1"),
    (ModelConfig, {"max_seq_len": 0}, "model.max_seq_len", "0"),
    (ModelConfig, {"moe_every": -1}, "model.moe_every", "-1"),
    (ModelConfig, {"moe_layer_offset": 4, "num_layers": 4}, "model.moe_layer_offset", "4"),
    (ModelConfig, {"dense_hidden_dim": 0}, "model.dense_hidden_dim", "0"),
    (ModelConfig, {"activation": "relu"}, "model.activation", "'relu'"),
    (ModelConfig, {"norm_eps": 0.0}, "model.norm_eps", "0.0"),
    (ModelConfig, {"rope_theta": -1.0}, "model.rope_theta", "-1.0"),
    (ModelConfig, {"tie_embeddings": "yes"}, "model.tie_embeddings", "'yes'"),
    (ModelConfig, {"init_std": 0}, "model.init_std", "0"),
    (ModelConfig, {"head": "seq2seq"}, "model.head", "'seq2seq'"),
    (ModelConfig, {"head": "classifier"}, "model.num_classes", "None"),
    (ModelConfig, {"head": "classifier", "num_classes": 1}, "model.num_classes", "1"),
    (ModelConfig, {"preset": ""}, "model.preset", "''"),  # the name itself: see test_config_loader
    (OptimConfig, {"name": "sgd"}, "optim.name", "'sgd'"),
    (OptimConfig, {"lr": 0.0}, "optim.lr", "0.0"),
    (OptimConfig, {"lr": 1e-3, "min_lr": 1e-2}, "optim.min_lr", "0.01"),
    (OptimConfig, {"min_lr": -1.0}, "optim.min_lr", "-1.0"),
    (OptimConfig, {"weight_decay": -0.1}, "optim.weight_decay", "-0.1"),
    (OptimConfig, {"betas": (0.9, 1.0)}, "optim.betas", "(0.9, 1.0)"),
    (OptimConfig, {"betas": (0.9,)}, "optim.betas", "(0.9,)"),
    (OptimConfig, {"eps": 0.0}, "optim.eps", "0.0"),
    (OptimConfig, {"warmup_steps": -5}, "optim.warmup_steps", "-5"),
    (OptimConfig, {"schedule": "linear"}, "optim.schedule", "'linear'"),
    (OptimConfig, {"grad_clip": -1.0}, "optim.grad_clip", "-1.0"),
    (TrainConfig, {"steps": 0}, "train.steps", "0"),
    (TrainConfig, {"global_batch_size": 10, "micro_batch_size": 4}, "train.global_batch_size", "10"),
    (TrainConfig, {"micro_batch_size": 0}, "train.micro_batch_size", "0"),
    (TrainConfig, {"grad_accum": 0}, "train.grad_accum", "0"),
    (TrainConfig, {"global_batch_size": 16, "micro_batch_size": 8, "grad_accum": 4},
     "train.global_batch_size", "16"),
    (TrainConfig, {"seed": -1}, "train.seed", "-1"),
    (TrainConfig, {"dtype": "fp8"}, "train.dtype", "'fp8'"),
    (TrainConfig, {"eval_every": -1}, "train.eval_every", "-1"),
    (TrainConfig, {"eval_steps": 0}, "train.eval_steps", "0"),
    (TrainConfig, {"device": "tpu"}, "train.device", "'tpu'"),
    (TrainConfig, {"deterministic": 1}, "train.deterministic", "1"),
    (TrainConfig, {"activation_checkpointing": "some"}, "train.activation_checkpointing", "'some'"),
    (TrainConfig, {"activation_checkpointing_every": 0}, "train.activation_checkpointing_every", "0"),
    (TrainConfig, {"compile": "no"}, "train.compile", "'no'"),
    (CheckpointConfig, {"dir": ""}, "checkpoint.dir", "''"),
    (CheckpointConfig, {"every": -1}, "checkpoint.every", "-1"),
    (CheckpointConfig, {"keep_last": -2}, "checkpoint.keep_last", "-2"),
    (CheckpointConfig, {"resume": "none"}, "checkpoint.resume", "'none'"),
    (CheckpointConfig, {"save_final": None}, "checkpoint.save_final", "None"),
    (CheckpointConfig, {"async_save": "yes"}, "checkpoint.async_save", "'yes'"),
    (LogConfig, {"run_dir": ""}, "log.run_dir", "''"),
    (LogConfig, {"every": 0}, "log.every", "0"),
    (LogConfig, {"tensorboard": "true"}, "log.tensorboard", "'true'"),
    (LogConfig, {"level": "trace"}, "log.level", "'trace'"),
    (ZeroConfig, {"offload_optimizer": "nvme"}, "zero.offload_optimizer", "'nvme'"),
    (ZeroConfig, {"offload_param": "gpu"}, "zero.offload_param", "'gpu'"),
    (ZeroConfig, {"pin_memory": 0}, "zero.pin_memory", "0"),
    (ZeroConfig, {"reduce_bucket_size": 0}, "zero.reduce_bucket_size", "0"),
    (ZeroConfig, {"allgather_bucket_size": 1.5}, "zero.allgather_bucket_size", "1.5"),
]


@pytest.mark.parametrize("cls, kwargs, field, shown", BAD_SECTION_VALUES,
                         ids=[f"{c[2]}={c[3]}" for c in BAD_SECTION_VALUES])
def test_bad_section_value_names_field_and_value(cls, kwargs, field, shown):
    with pytest.raises(ValueError) as err:
        cls(**kwargs)
    assert str(err.value).startswith(f"{field} ({shown})"), str(err.value)


def _job(**sections):
    return JobConfig(**sections)


BAD_JOBS = [
    # Cross-section rules of JobConfig.
    ({"model": ModelConfig(moe_every=0), "parallel": ParallelConfig(ep=2)}, "parallel.ep", "2"),
    ({"model": ModelConfig(max_seq_len=128)}, "data.seq_len", "256"),  # DataConfig default seq_len 256
    ({"model": ModelConfig(vocab_size=1000)}, "model.vocab_size", "1000"),  # < data.vocab_size 4096
    ({"parallel": ParallelConfig(dp=3)}, "train.global_batch_size", "16"),  # 16 % (8 * 3) != 0
    ({"parallel": ParallelConfig(dp=2), "train": TrainConfig(grad_accum=2)}, "train.grad_accum", "2"),
    ({"zero": ZeroConfig(offload_param="cpu"), "parallel": ParallelConfig(zero_stage=2)},
     "zero.offload_param", "'cpu'"),
    ({"zero": ZeroConfig(offload_optimizer="cpu")}, "zero.offload_optimizer", "'cpu'"),
    ({"model": ModelConfig(moe_every=0), "train": TrainConfig(activation_checkpointing="moe")},
     "train.activation_checkpointing", "'moe'"),
]


@pytest.mark.parametrize("sections, field, shown", BAD_JOBS, ids=[f"{c[1]}={c[2]}" for c in BAD_JOBS])
def test_bad_job_names_field_and_value(sections, field, shown):
    with pytest.raises(ValueError) as err:
        _job(**sections)
    assert str(err.value).startswith(f"{field} ({shown})"), str(err.value)


def test_ep_against_the_experts_is_checked_by_parallel_dims_alone():
    """"parallel.ep must divide moe.num_experts" has one home, ParallelDims, which knows the world
    size too: a JobConfig records the degrees, the layout check names both values."""
    from moetrain.distributed.parallel_dims import ParallelDims

    cfg = JobConfig(moe=MoEConfig(num_experts=6), parallel=ParallelConfig(ep=4))
    assert (cfg.parallel.ep, cfg.moe.num_experts) == (4, 6)
    with pytest.raises(ValueError, match=r"parallel\.ep \(4\) must divide moe\.num_experts \(6\)"):
        ParallelDims.from_config(cfg.parallel, world_size=8, num_experts=cfg.moe.num_experts)
    assert ParallelDims.from_config(ParallelConfig(ep=2), world_size=8, num_experts=6).edp == 4


@pytest.mark.parametrize("cls, kwargs", [
    (ModelConfig, {"preset": "tiny", "dim": 64, "num_heads": 2, "num_kv_heads": 1, "head": "classifier",
                   "num_classes": 3}),
    (OptimConfig, {"lr": 1e-3, "min_lr": 0.0, "betas": (0.8, 0.9)}),
    (OptimConfig, {"lr": 1e-3, "betas": (0.8, 0.9), "schedule": "constant"}),
    (TrainConfig, {"global_batch_size": 32, "micro_batch_size": 4, "grad_accum": 8, "dtype": "bf16"}),
    (CheckpointConfig, {"dir": "/tmp/ckpt", "every": 10, "keep_last": 0, "resume": "never"}),
    (LogConfig, {"run_dir": "runs/x", "tensorboard": True, "level": "debug"}),
    (ZeroConfig, {"offload_optimizer": "cpu", "pin_memory": False, "reduce_bucket_size": 10**6,
                  "allgather_bucket_size": 10**7}),
    (ParallelConfig, {"dp": 4, "ep": 2, "zero_stage": 3, "hsdp_replicate": 2, "backend": "gloo"}),
])
def test_valid_section_values_are_kept(cls, kwargs):
    cfg = cls(**kwargs)
    assert {name: getattr(cfg, name) for name in kwargs} == kwargs
    # ... and survive the trip through plain values (what YAML holds).
    section = next(name for name, c in SECTIONS.items() if c is cls)
    plain = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    plain = {k: list(v) if isinstance(v, tuple) else v for k, v in plain.items()}
    assert build_section(cls, section, plain) == cfg


def test_defaults_are_valid_and_cpu_safe():
    cfg = JobConfig()
    assert cfg.train.device == "auto"
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f.name != "device" or getattr(getattr(cfg, section.name), f.name) != "cuda"


def test_auto_device_never_picks_missing_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto").type == "cpu"
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match=r"train.device \('cuda'\)"):
        resolve_device("cuda")


@pytest.mark.parametrize("global_bs, micro, dp, accum",
                         [(16, 8, 1, 2), (16, 8, 2, 1), (64, 2, 8, 4), (8, 1, 1, 8)])
def test_grad_accum_is_derived(global_bs, micro, dp, accum):
    assert TrainConfig(global_batch_size=global_bs, micro_batch_size=micro).grad_accum_steps(dp) == accum
    explicit = TrainConfig(global_batch_size=global_bs, micro_batch_size=micro, grad_accum=accum)
    assert explicit.grad_accum_steps(dp) == accum


def test_grad_accum_checks_the_data_parallel_size():
    with pytest.raises(ValueError, match=r"train.global_batch_size \(16\).*8 \* 4 = 32"):
        TrainConfig(global_batch_size=16, micro_batch_size=8).grad_accum_steps(4)
    cfg = JobConfig(train=TrainConfig(global_batch_size=32, micro_batch_size=4))
    assert cfg.data_parallel_size(4) == 4 and cfg.grad_accum_steps(4) == 2


def test_model_helpers():
    m = ModelConfig(num_layers=6, moe_every=2, moe_layer_offset=1, dim=64, num_heads=4, num_kv_heads=2)
    assert m.moe_layer_ids == [1, 3, 5]
    assert m.resolved_head_dim == 16 and m.resolved_num_kv_heads == 2 and m.resolved_dense_hidden_dim == 256
    assert not ModelConfig(moe_every=0).is_moe
    assert ModelConfig().with_vocab_size(300).vocab_size == 300
    assert ModelConfig(vocab_size=512).with_vocab_size(300).vocab_size == 512
    with pytest.raises(ValueError, match=r"model.vocab_size \(256\)"):
        ModelConfig(vocab_size=256).with_vocab_size(300)
    assert OptimConfig(lr=1e-3).resolved_min_lr == pytest.approx(1e-4)


def test_grad_compression_values():
    from moetrain.config import DataParallelConfig

    for mode in ("none", "bf16", "onebit"):
        assert DataParallelConfig(grad_compression=mode).grad_compression == mode
        assert build_section(DataParallelConfig, "dp", {"grad_compression": mode}) == DataParallelConfig(mode)
    with pytest.raises(ValueError, match=r"dp.grad_compression \('fp8'\) must be one of 'none', 'bf16', 'onebit'"):
        DataParallelConfig(grad_compression="fp8")


@pytest.mark.parametrize("stage", [2, 3])
def test_grad_compression_needs_zero_stage_at_most_1(stage):
    from moetrain.config import DataParallelConfig

    with pytest.raises(ValueError, match=rf"dp.grad_compression \('onebit'\) needs parallel.zero_stage <= 1 "
                                         rf"\(is {stage}\): at stages 2/3 FSDP2 reduce-scatters"):
        JobConfig(parallel=ParallelConfig(zero_stage=stage), dp=DataParallelConfig(grad_compression="onebit"))
    for ok_stage in (0, 1):
        JobConfig(parallel=ParallelConfig(zero_stage=ok_stage), dp=DataParallelConfig(grad_compression="bf16"))
    JobConfig(parallel=ParallelConfig(zero_stage=stage), dp=DataParallelConfig(grad_compression="none"))
