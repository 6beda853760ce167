"""The data-parallel settings' cross-field rules live in the config and every other place calls
them (the same words wherever a layout is refused), and zero.pin_memory reaches ZeRO-1's offload."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import (
    DataConfig,
    DataParallelConfig,
    JobConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
    ZeroConfig,
)
from moetrain.config.zero import check_offload
from moetrain.distributed import ParallelDims
from moetrain.distributed.data_parallel import zero1
from moetrain.distributed.data_parallel.ddp import apply_data_parallel
from moetrain.distributed.data_parallel.zero1 import ZeroShardedOptimizer
from moetrain.plan import make_plan

# (zero_stage, offload_optimizer, offload_param) -> the refusal
OFFLOAD_REFUSALS = [
    (2, True, True, "zero.offload_param ('cpu') needs parallel.zero_stage = 3 (is 2)"),
    (0, True, True, "zero.offload_param ('cpu') needs parallel.zero_stage = 3 (is 0)"),
    (0, True, False, "zero.offload_optimizer ('cpu') needs parallel.zero_stage >= 1 (is 0)"),
]


def _job(**sections) -> JobConfig:
    return JobConfig(model=ModelConfig(vocab_size=512, dim=64, num_layers=2, num_heads=2, max_seq_len=64),
                     moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=64),
                     train=TrainConfig(global_batch_size=16, micro_batch_size=2),
                     data=DataConfig(seq_len=64, vocab_size=512), **sections)


@pytest.mark.parametrize("stage, optimizer, param, message", OFFLOAD_REFUSALS)
def test_offload_refusal_is_the_configs_everywhere(stage, optimizer, param, message):
    with pytest.raises(ValueError) as rule:
        check_offload(stage, offload_optimizer=optimizer, offload_param=param)
    assert str(rule.value) == message
    zero = ZeroConfig(offload_optimizer="cpu" if optimizer else "none", offload_param="cpu" if param else "none")
    with pytest.raises(ValueError) as job:
        _job(zero=zero, parallel=ParallelConfig(zero_stage=stage))
    with pytest.raises(ValueError) as wrapper:
        apply_data_parallel(None, ParallelDims(world_size=2), zero_stage=stage, offload_optimizer=optimizer,
                            offload_params=param)
    offload = "params" if param else "optimizer"
    plan = make_plan(_job(), nproc=2, stages=(stage,), eps=[1], offloads=(offload,), acs=("none",))
    assert str(job.value) == str(wrapper.value) == plan.rows[0].reason == message
    check_offload(3, offload_optimizer=True, offload_param=True)
    check_offload(1, offload_optimizer=True, offload_param=False)


def test_pipeline_offload_refusal_is_the_same_rule_everywhere():
    """Pipeline stages offload only through FSDP2: ZeRO-1's host slices are not built under pp."""
    message = ("zero.offload_optimizer ('cpu') needs parallel.zero_stage >= 2 with parallel.pp (2) > 1 (is 1): "
               "pipeline stages offload through FSDP2")
    with pytest.raises(ValueError) as rule:
        check_offload(1, offload_optimizer=True, offload_param=False, pp=2)
    untied = ModelConfig(vocab_size=512, dim=64, num_layers=2, num_heads=2, max_seq_len=64, tie_embeddings=False)
    with pytest.raises(ValueError) as config:
        JobConfig(model=untied, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=64),
                  train=TrainConfig(global_batch_size=16, micro_batch_size=2),
                  data=DataConfig(seq_len=64, vocab_size=512), zero=ZeroConfig(offload_optimizer="cpu"),
                  parallel=ParallelConfig(pp=2, zero_stage=1))
    with pytest.raises(ValueError) as wrapper:
        apply_data_parallel(None, ParallelDims(world_size=2, pp=2), zero_stage=1, offload_optimizer=True)
    assert str(rule.value) == str(config.value) == str(wrapper.value) == message
    check_offload(2, offload_optimizer=True, offload_param=False, pp=2)
    check_offload(1, offload_optimizer=True, offload_param=False, pp=1)


@pytest.mark.parametrize("mode, stage, tp, rule", [
    ("bf16", 2, 1, r"needs parallel\.zero_stage <= 1 \(is 2\): at stages 2/3 FSDP2 reduce-scatters"),
    ("onebit", 1, 1, r"needs parallel\.zero_stage = 0 \(is 1\): 1-bit Adam keeps the whole momentum"),
    ("bf16", 0, 2, r"needs parallel\.tp = 1 \(is 2\): tensor-parallel gradients are reduced uncompressed"),
])
def test_grad_compression_refusal_is_the_configs_everywhere(mode, stage, tp, rule):
    message = rf"^dp\.grad_compression \('{mode}'\) {rule}"
    with pytest.raises(ValueError, match=message):
        _job(dp=DataParallelConfig(grad_compression=mode), parallel=ParallelConfig(zero_stage=stage, tp=tp))
    with pytest.raises(ValueError, match=message):
        apply_data_parallel(None, ParallelDims(world_size=2 * tp, tp=tp), zero_stage=stage, grad_compression=mode)


def test_wrapper_takes_the_parallel_sections_rules():
    with pytest.raises(ValueError, match=r"^parallel\.hsdp_replicate \(2\) needs parallel\.zero_stage >= 2 \(is 1\)"):
        apply_data_parallel(None, ParallelDims(world_size=2), zero_stage=1, hsdp_replicate=2)
    with pytest.raises(ValueError, match=r"^parallel\.zero_stage \(4\) must be one of 0, 1, 2, 3"):
        apply_data_parallel(None, ParallelDims(world_size=2), zero_stage=4)


@pytest.fixture
def one_rank(tmp_path):
    assert not dist.is_initialized(), "an earlier test left a process group initialised"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        dims = ParallelDims(world_size=1)
        dims.build_mesh("cpu")
        yield dims
    finally:
        dist.destroy_process_group()


def _offloaded_step(dims: ParallelDims, *, pin_memory: bool) -> ZeroShardedOptimizer:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with pytest.warns(UserWarning, match="parameters already on the CPU"):
        opt = ZeroShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), dims, offload=True,
                                   pin_memory=pin_memory)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt


def test_zero1_offload_pins_its_host_copies_where_cuda_exists(one_rank, monkeypatch):
    # Without CUDA torch has no page-locked memory to give: the run goes on with plain host memory.
    if not torch.cuda.is_available():
        opt = _offloaded_step(one_rank, pin_memory=True)
        assert not opt.pin_memory and not any(s.master.is_pinned() for s in opt.shards)
    # Where CUDA exists every host copy (master slices at build, gradient slices each step) asks
    # torch for page-locked memory; the spy records the request and hands out plain memory.
    requests: list[bool] = []
    empty = torch.empty

    def spy(*args, pin_memory: bool = False, **kwargs):
        requests.append(pin_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(zero1.torch, "empty", spy)
    opt = _offloaded_step(one_rank, pin_memory=True)
    assert opt.pin_memory and requests.count(True) == 2 * len(opt.shards) == 4, requests
    requests.clear()
    assert not _offloaded_step(one_rank, pin_memory=False).pin_memory and True not in requests
