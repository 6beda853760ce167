"""The step-time model's all-to-all calls per MoE layer (``plan.step_time.all_to_alls_per_moe_layer``)
against the all-to-all ops a real ep = 2 layer issues (two gloo ranks), counted below autograd by a
TorchDispatchMode: its forward (what a recompute repeats) and forward + backward, for dropless and
capacity routing, expert choice, deduplicated rows and chunked exchanges."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.config.moe import MoEConfig
from moetrain.plan.step_time import all_to_alls_per_moe_layer
from tests.helpers.dist_launcher import run_ranks

SETTINGS = {
    "dropless": {}, "dedup": {"dispatch_dedup": True},
    "chunks2": {"dispatch_chunks": 2}, "chunks4": {"dispatch_chunks": 4},
    "chunks3_dedup": {"dispatch_chunks": 3, "dispatch_dedup": True},
    "capacity": {"capacity_factor": 1.25}, "capacity_dedup": {"capacity_factor": 1.25, "dispatch_dedup": True},
    "capacity_chunks2": {"capacity_factor": 1.25, "dispatch_chunks": 2},
    "expert_choice_chunks2_dedup": {"router": "expert_choice", "capacity_factor": 1.0, "dispatch_chunks": 2,
                                    "dispatch_dedup": True},
}


class _CountAllToAlls(TorchDispatchMode):
    """Every all-to-all op that reaches the kernels (the dispatcher's, and autograd's in backward)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += "all_to_all" in str(func) or "alltoall" in str(func)
        return func(*args, **(kwargs or {}))


def _count(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    from moetrain.distributed import ParallelDims, apply_expert_parallel
    from moetrain.models.moe import MoELayer

    dims = ParallelDims(world_size=world_size, ep=world_size, num_experts=4)
    dims.build_mesh("cpu")
    x_TD = torch.randn(32, 16, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, setting in SETTINGS.items():
        torch.manual_seed(0)
        layer = apply_expert_parallel(torch.nn.Sequential(MoELayer(16, _config(setting))), dims)[0]
        with _CountAllToAlls() as counter:
            y_TD, _ = layer(x_TD.clone().requires_grad_())
            forward = counter.calls
            y_TD.square().sum().backward()
        out[name] = (counter.calls, forward)
    return out


def _config(setting: dict) -> MoEConfig:
    return MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8, **setting)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_modelled_all_to_alls_are_the_issued_ones():
    ranks = run_ranks(_count, 2, timeout_s=90)
    assert ranks[0] == ranks[1]
    for name, setting in SETTINGS.items():
        assert ranks[0][name] == all_to_alls_per_moe_layer(_config(setting)), name
    # By hand, dropless in one piece: the counts, the dispatch and the combine forward, their two
    # gradients backward; four chunks send both payloads four times each way, the counts once.
    assert ranks[0]["dropless"] == (5, 3) and ranks[0]["chunks4"] == (17, 9)
