"""Mixed precision: autocast contexts and a dynamic loss scaler for fp16.

bf16 needs no scaling (same exponent range as fp32). fp16 does: the loss is multiplied by a
scale before backward, gradients are unscaled before clipping, and a step whose gradients hold
an inf/NaN on *any* rank is skipped on every rank (the ranks must agree, or replicas diverge).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from moetrain.utils.tensors import local_tensor


def autocast_context(device: torch.device, dtype: str):
    """Autocast for ``train.dtype`` at every ZeRO stage. Ops autocast does not cover (the MoE
    all-to-all, ``torch._grouped_mm``) get its dtype from the MoE layer
    (``moetrain.models.moe.experts.to_autocast_dtype``), so they run in it at stages 0/1 too."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


class DynamicLossScaler:
    """The usual dynamic scaler (halve on overflow, double after ``growth_interval`` good steps),
    written for DTensor and plain gradients alike and agreeing across ranks."""

    def __init__(self, *, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 group=None) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.group = group
        self._good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_and_check(self, params: list[torch.Tensor]) -> bool:
        """Unscale gradients in place; True when they are all finite on every rank."""
        if not self.enabled:
            return True
        inv = 1.0 / self.scale
        found_inf = torch.zeros(())
        for p in params:
            if p.grad is None:
                continue
            g = local_tensor(p.grad)
            g.mul_(inv)
            found_inf = found_inf.to(g.device)
            found_inf = torch.maximum(found_inf, (~torch.isfinite(g)).any().float())
        if dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        return not bool(found_inf.item())  # host sync: the skip decision must be made on the host

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
