"""AdamW over each rank's local shards: one fused kernel call per parameter group, whatever mix of
DTensor and plain parameters the group holds.

torch's AdamW cannot take its multi-tensor or fused path over a group that mixes DTensor expert
weights with plain tensors (the multi-tensor ops refuse mixed lists), and its per-tensor path
sends every operation on a DTensor through DTensor's sharding propagation: about a dozen
dispatches and kernel launches per parameter and step, host time that grows with the layer count
(DeepSeek-V3's 58 MoE layers hold 174 expert tensors). Every AdamW operation is elementwise, and
when the optimizer runs each gradient is placed like its parameter (gradient finalization has
summed the Partial ones), so the update of a rank's local shard is that shard of the global
update. Stepping the local tensors therefore computes what DTensor would, with no dispatch, and
the fused kernel makes it one pass over each tensor with no full-size temporaries (the
multi-tensor path would allocate a square-root buffer as large as the group).

The state is torch's fused AdamW state: ``exp_avg`` and ``exp_avg_sq`` placed like the parameter
(DTensors for DTensor parameters, so DCP saves and reshards them) and a 0-dim fp32 ``step`` on the
parameter's device. Checkpoints, ``state_dict`` and resharding are those of ``torch.optim.AdamW``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from moetrain.utils.tensors import local_tensor


def _check_placed_alike(p: torch.Tensor) -> None:
    g = p.grad
    if isinstance(p, DTensor) and (not isinstance(g, DTensor) or tuple(g.placements) != tuple(p.placements)):
        placements = tuple(g.placements) if isinstance(g, DTensor) else "a plain tensor"
        raise ValueError(f"a gradient placed as {placements} for a parameter placed as {tuple(p.placements)}: "
                         "the local AdamW step needs each gradient placed like its parameter "
                         "(finalize the gradients first)")


def _state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif state["step"].device != p.device:
        # A state saved by a per-tensor AdamW keeps its step count on the CPU; the fused kernel
        # reads it on the parameter's device.
        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return state


@torch.no_grad()
def adamw_local_step(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """One AdamW step of ``group`` (its lr, betas, eps, weight_decay) on the local tensors of its
    parameters that have gradients; creates their state on the first step."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        _check_placed_alike(p)
        state = _state(optimizer, p)
        params.append(local_tensor(p))
        grads.append(local_tensor(p.grad))
        exp_avgs.append(local_tensor(state["exp_avg"]))
        exp_avg_sqs.append(local_tensor(state["exp_avg_sq"]))
        steps.append(state["step"])
    beta1, beta2 = group["betas"]
    adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, decoupled_weight_decay=True,
         amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
         eps=group["eps"], maximize=False)


class LocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)``: the same groups, hyper-parameters, state and state_dict,
    stepped by :func:`adamw_local_step`, so groups may mix DTensor and plain parameters."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            adamw_local_step(self, group)
        return loss
