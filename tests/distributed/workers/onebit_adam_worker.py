"""Rank functions for the 1-bit Adam tests (``test_onebit_adam.py``).

``stages_worker`` trains ``zero_parity``'s tiny model (two blocks, the first MoE with 4 experts) at
stage 0 twice from the same weights: with dp.grad_compression "none" and torch's AdamW (the
reference), and with "onebit" and ``OneBitAdam``, recording weights and moments after every step.
``momentum_worker`` runs one compressed step of ``OneBitAdam`` on known values.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn

from moetrain.distributed import ParallelDims
from moetrain.distributed.data_parallel.ddp import MoEDataParallel, apply_data_parallel, grad_comm_metrics
from moetrain.distributed.data_parallel.grads import clip_global_grad_norm_
from moetrain.distributed.data_parallel.onebit_adam import OneBitAdam
from moetrain.distributed.expert_parallel.apply import apply_expert_parallel
from moetrain.train.optim import build_optimizer, param_groups
from moetrain.utils.tensors import local_tensor
from tests.distributed.workers.zero_parity import GLOBAL_BATCH, Run, build, make_batches, model_configs

HYPER = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}


def _release(*objs) -> None:
    """Drop DDP wrappers before the process group goes: gloo aborts at exit otherwise."""
    del objs
    gc.collect()
    dist.barrier()


def _local_copy(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t).detach().clone()


def _train(mode: str, rank: int, world_size: int, *, ep: int, warmup: int, steps: int) -> dict:
    run = Run("onebit", zero_stage=0, ep=ep)
    dims = ParallelDims(world_size=world_size, ep=ep, num_experts=model_configs(run)[1].num_experts)
    dims.build_mesh("cpu")
    model = build(run)
    apply_expert_parallel(model, dims)
    ddp = apply_data_parallel(model, dims, grad_compression=mode)
    if mode == "onebit":
        opt = build_optimizer(model, **HYPER, data_parallel=ddp, onebit_warmup_steps=warmup)
    else:  # torch's per-tensor AdamW, which OneBitAdam's warmup repeats operation for operation
        opt = torch.optim.AdamW(param_groups(model, weight_decay=HYPER["weight_decay"]), lr=HYPER["lr"],
                                betas=HYPER["betas"], eps=HYPER["eps"], foreach=False)
    batches = make_batches(run, steps)
    B = GLOBAL_BATCH // world_size
    names = {p: n for n, p in model.named_parameters()}
    records = []
    for s in range(steps):
        tokens = batches[s][rank * B:(rank + 1) * B]
        ddp(tokens[:, :-1], tokens[:, 1:]).total_loss.backward()
        # As the trainer: clipping by the norm of the gradients at hand (local ones after the freeze).
        clip_global_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        records.append({
            "params": {n: _local_copy(p) for n, p in model.named_parameters()},
            "m": {names[p]: _local_copy(st["exp_avg"]) for p, st in opt.state.items()},
            "v": {names[p]: _local_copy(st["exp_avg_sq"]) for p, st in opt.state.items()},
            "stats": grad_comm_metrics(ddp),
            "local_mode": ddp.local_gradients if isinstance(ddp, MoEDataParallel) else None})
    out = {"records": records, "optimizer": type(opt).__name__, "dp": dims.dp, "edp": dims.edp,
           "ep_rank": dims.ep_rank,
           "replicated": {n: ddp.has_replicas(p) for n, p in model.named_parameters()},
           "numel": {n: local_tensor(p).numel() for n, p in model.named_parameters()}}
    _release(ddp, model, opt)
    return out


def stages_worker(rank: int, world_size: int, *, ep: int, warmup: int, steps: int) -> dict:
    return {mode: _train(mode, rank, world_size, ep=ep, warmup=warmup, steps=steps) for mode in ("none", "onebit")}


class _Flat(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))

    def forward(self, x):
        return (self.w * x).sum()


def momentum_worker(rank: int, world_size: int, case: dict) -> dict:
    """One compressed step of ``OneBitAdam`` on known values: weights ``case["p"]``, momentum
    ``m``, frozen variance ``v`` at step ``step`` (past ``warmup``), this rank's gradient
    ``grads[rank]``. Returns the momentum, weights and residuals after it, and the step's bytes."""
    dims = ParallelDims(world_size=world_size)
    dims.build_mesh("cpu")
    module = _Flat(case["p"].numel())
    ddp = MoEDataParallel(module, dims, grad_compression="onebit")
    opt = OneBitAdam(module.parameters(), data_parallel=ddp, warmup_steps=case["warmup"], lr=case["lr"],
                     betas=case["betas"], eps=case["eps"], weight_decay=case["weight_decay"])
    with torch.no_grad():
        module.w.copy_(case["p"])
    opt.load_state_dict({"state": {0: {"step": torch.tensor(float(case["step"])), "exp_avg": case["m"].clone(),
                                       "exp_avg_sq": case["v"].clone()}},
                         # A checkpoint of a run whose variance froze after its warmup records so.
                         "param_groups": [g | {"onebit_frozen_at": case["warmup"]}
                                          for g in opt.state_dict()["param_groups"]]})
    local_mode = ddp.local_gradients  # the load put the wrapper in the compression stage
    module.w.grad = case["grads"][rank].clone()
    opt.step()
    state = opt.state[module.w]
    out = {"m": state["exp_avg"].clone(), "v": state["exp_avg_sq"].clone(), "p": module.w.detach().clone(),
           "step": state["step"].item(), "local_mode": local_mode,
           "residuals": {k: v.clone() for k, v in ddp.compression_state_dict().items()},
           "stats": ddp.grad_comm_stats()}
    _release(ddp, module, opt)
    return out
