"""Per-expert learning rates (and the rest of the balancing hooks) under ZeRO stages 1-3, with and
without expert parallelism, on real gloo processes, against one plain process with the global
batch (zero_parity.py's harness with ``install_balancing`` on both sides): the loss and gradient
norm of every step and every parameter after the last.

ZeRO-1 steps element slices of the flattened parameters (host copies with offload); FSDP2
(stages 2/3) steps DTensor row shards, over edp on top of ep for the experts. The learning-rate
scale of each expert must reach exactly its own elements in every case.
"""

import pytest
import torch
import torch.distributed as dist

from moetrain.models.moe import MoELayer
from moetrain.train.balancing import install_balancing
from moetrain.train.precision import DynamicLossScaler
from tests.distributed.workers.zero_parity import (
    GLOBAL_BATCH,
    Run,
    _optimizer,
    _step,
    assert_matches,
    build,
    make_batches,
    setup_run,
)
from tests.helpers.dist_launcher import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Scales recomputed every step from that step's load; the biased sigmoid router keeps the load
# uneven, so some experts run at up to 3x the learning rate.
BALANCED_MOE = {"expert_lr_scale_max": 3.0, "balance_interval": 1, "router": "sigmoid",
                "router_bias_update_rate": 0.01, "collapse_threshold": 0.9}


def _scales(model) -> torch.Tensor:
    return torch.stack([m.expert_lr_scale.clone() for m in model.modules() if isinstance(m, MoELayer)])


def reference(run: Run) -> dict:
    model = build(run)
    opt = _optimizer(model)
    install_balancing(opt, model)
    params = list(model.parameters())
    scaler = DynamicLossScaler(enabled=False)
    batches = make_batches(run, run.steps)
    losses, norms, scales = [], [], []
    for s in range(run.steps):
        loss, norm = _step(model, opt, params, [batches[s]], run, scaler)
        losses.append(loss)
        norms.append(norm)
        scales.append(_scales(model))
    return {"loss": losses, "grad_norm": norms, "scales": scales,
            "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def worker(rank: int, world_size: int, runs: list[Run]) -> dict:
    out = {}
    B = GLOBAL_BATCH // world_size
    for run in runs:
        dims, model, train_model, opt = setup_run(run, world_size)
        install_balancing(opt, model, dims)
        params = list(model.parameters())
        scaler = DynamicLossScaler(enabled=False)
        batches = make_batches(run, run.steps)
        losses, norms, scales = [], [], []
        for s in range(run.steps):
            loss, norm = _step(train_model, opt, params, [batches[s][rank * B:(rank + 1) * B]], run, scaler)
            t = torch.tensor([loss])
            dist.all_reduce(t)
            losses.append(t.item() / world_size)
            norms.append(norm)
            scales.append(_scales(model))
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.named_parameters()}
        out[run.name] = {"loss": losses, "grad_norm": norms, "scales": scales, "params": full if rank == 0 else None}
    return out


def _check(runs, results):
    for run in runs:
        ref = reference(run)
        assert max(float(s.max()) for s in ref["scales"]) > 1.5, "the case must scale some expert's rate"
        for r, res in enumerate(results):
            for s, (got, want) in enumerate(zip(res[run.name]["scales"], ref["scales"], strict=True)):
                assert torch.equal(got, want), f"[{run.name}] rank {r} step {s} learning-rate scales"
        assert_matches(run, results, ref, rtol=2e-5)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.filterwarnings("ignore:zero.offload_optimizer:UserWarning")
def test_expert_lr_scales_under_zero_world2():
    runs = [Run("zero1", zero_stage=1, steps=6, moe=BALANCED_MOE),
            Run("zero1_offload", zero_stage=1, steps=6, offload_optimizer=True, moe=BALANCED_MOE),
            Run("zero3", zero_stage=3, steps=6, moe=BALANCED_MOE),
            Run("zero2_ep2", zero_stage=2, ep=2, steps=6, moe=BALANCED_MOE)]
    _check(runs, run_ranks(worker, 2, runs, timeout_s=200))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_expert_lr_scales_under_zero_with_expert_parallelism_world4():
    # ep=2 x edp=2: ZeRO-1 shards the expert slices over edp; FSDP2 shards ep shards again over edp.
    runs = [Run("zero1_ep2", zero_stage=1, ep=2, steps=6, moe=BALANCED_MOE),
            Run("zero3_ep2", zero_stage=3, ep=2, steps=6, moe=BALANCED_MOE)]
    _check(runs, run_ranks(worker, 4, runs, timeout_s=200))
