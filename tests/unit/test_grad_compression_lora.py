"""dp.grad_compression with LoRA on the routed experts only at ep > 1: every trainable parameter is
an expert shard, so there is no replicated gradient for the DDP wrapper to compress. JobConfig
refuses it naming the field, and apply_data_parallel refuses it for models built outside JobConfig
(before, DDP raised its own RuntimeError at the first step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from moetrain.config import JobConfig
from moetrain.config.dp import DataParallelConfig
from moetrain.config.finetune import FinetuneConfig
from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.distributed import ParallelDims
from moetrain.distributed.data_parallel.ddp import apply_data_parallel


def _job(mode: str, *, ep: int, targets: tuple[str, ...] = ("experts",)) -> JobConfig:
    return JobConfig(model=ModelConfig(moe_every=1), parallel=ParallelConfig(ep=ep),
                     finetune=FinetuneConfig(lora_rank=4, lora_targets=targets),
                     dp=DataParallelConfig(grad_compression=mode))


@pytest.mark.parametrize("mode", ["bf16", "onebit"])
def test_config_refuses_compression_with_expert_only_lora_at_ep_2(mode):
    with pytest.raises(ValueError, match=rf"dp.grad_compression \('{mode}'\) must be \"none\" with LoRA on the "
                                         r"routed experts only .*no replicated gradient is left to compress"):
        _job(mode, ep=2)


@pytest.mark.parametrize("mode", ["bf16", "onebit"])
def test_config_accepts_the_layouts_that_keep_a_replicated_gradient(mode):
    _job(mode, ep=1)  # the expert adapters are plain replicated parameters
    _job(mode, ep=2, targets=("experts", "attention"))  # the attention adapters are replicated
    _job("none", ep=2)


@pytest.mark.parametrize("mode", ["bf16", "onebit"])
def test_apply_data_parallel_refuses_compression_when_only_expert_shards_train(ep_mesh, mode):
    model = nn.Module()
    model.frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    model.adapter = nn.Parameter(distribute_tensor(torch.zeros(2, 3), ep_mesh, [Shard(0)]))
    dims = ParallelDims(world_size=2)
    with pytest.raises(ValueError, match=rf"dp.grad_compression \('{mode}'\) must be \"none\" when only expert "
                                         r"shards train"):
        apply_data_parallel(model, dims, grad_compression=mode)
    assert apply_data_parallel(model, dims) is model  # "none": finalize_grads reduces the shards
