"""1-bit Adam (Tang et al. 2021; DeepSpeed's OnebitAdam): AdamW whose replicas exchange 1-bit
compressed momenta instead of fp32 gradients, once the variance has settled.

Sign compression of the *gradients* under plain Adam does not converge well: Adam's variance,
estimated from compressed gradients, sees every element of a chunk at the chunk's mean magnitude,
and the update degenerates into a sign-like one. 1-bit Adam runs in two stages:

    warmup (the first ``warmup_steps`` optimizer steps): exactly AdamW; the gradients are
        all-reduced in fp32 by ``MoEDataParallel`` before the step, as without compression.
    compression (every later step):
        1. the backward reduces nothing: each rank keeps its own gradient (``MoEDataParallel``'s
           local-gradient mode; expert shards get the local scale of its module docstring);
        2. each rank folds its local gradient into the momentum, m = b1 m + (1 - b1) g_local;
        3. the momenta are averaged over the replicas with the two-phase 1-bit all-reduce and its
           error feedback (``MoEDataParallel.onebit_average_``: dense over dp, experts over edp);
           every replica ends with the same m, bit for bit;
        4. v stays frozen; p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps).

Averaging momenta is averaging gradients: with m identical on every replica before the step, the
mean of b1 m + (1 - b1) g_r over the replicas is b1 m + (1 - b1) mean(g_r), the AdamW momentum of
the averaged gradient, up to the compression error that the residuals feed back.

Bias correction: AdamW's, so that the warmup equals torch's per-tensor AdamW bit for bit and the first compressed step
continues it: m_hat = m / (1 - b1^t) at the current step t, v_hat = v / (1 - b2^t_v) with t_v the
step v froze at. (DeepSpeed applies none, in either stage; its freeze_step is thousands of steps,
where both corrections are 1.) t_v is recorded in each param group (``onebit_frozen_at``) when v
freezes, so it is saved with the optimizer's state: a resume with another ``warmup_steps`` (or
another ``train.steps``, which sets its default) keeps dividing by the correction v froze under and
stays compressing, and a checkpoint of an uncompressed run resumed past the warmup freezes v at its
saved step.

Momentum mask: a coordinate whose gradient was exactly zero throughout the warmup has v = 0, and
1-bit compression cannot send an exact zero (every element becomes +- its chunk's scale): its
update would be scale / eps. DeepSpeed asks the user for an ``exp_avg_mask``; here the mask is
v > 0, derived from the frozen variance itself and the same on every replica. Such a coordinate
(an expert that got no token, an embedding row not seen in the warmup) then gets no update but
weight decay for the rest of the run, as with DeepSpeed's mask: the freeze logs a warning with their
count. Giving
them a variance later would need their exact averaged gradient (the compressed momentum carries
only its chunk's +- scale), an exchange the compression is there to avoid.

Parameters without replicas (expert shards at edp = 1: the all-to-all already summed every rank's
contribution into the one copy) have their exact gradient and nothing to average: they keep plain
AdamW steps, variance included, in both stages.

The state is AdamW's (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter; the same param groups),
so checkpoints save and reshard it as AdamW's and a run can switch dp.grad_compression on resume.
The error-feedback residuals are ``MoEDataParallel``'s and travel with its compression state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import overload

import torch

from moetrain.distributed.data_parallel.ddp import MoEDataParallel
from moetrain.utils.tensors import local_tensor

log = logging.getLogger("moetrain")

FROZEN_AT = "onebit_frozen_at"
"""Param-group key: the step count the variance froze at (saved with the optimizer's state)."""


class OneBitAdam(torch.optim.AdamW):
    """1-bit Adam over the replicas of ``data_parallel`` (see the module docstring): AdamW for
    ``warmup_steps`` optimizer steps, then a frozen variance and 1-bit compressed momenta.

    Switches ``data_parallel`` into local-gradient mode once the warmup is over, and back when a
    checkpoint of an earlier step is loaded: which stage the next backward belongs to follows from
    the step count of the state, the same on every rank.
    """

    carried_group_keys = frozenset({FROZEN_AT})
    """Param-group keys a checkpoint load keeps though a fresh optimizer lacks them."""

    def __init__(self, params, *, data_parallel: MoEDataParallel, warmup_steps: int, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
            raise ValueError(f"dp.onebit_warmup_steps ({warmup_steps!r}) must be an int >= 1: the variance "
                             "freezes after the warmup, and one frozen at zero would divide by eps")
        # foreach=False: the fused multi-tensor path does not accept a mix of DTensor expert
        # weights and plain tensors in one group (the param groups stay those of AdamW).
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.data_parallel = data_parallel
        self.warmup_steps = warmup_steps
        self.register_load_state_dict_post_hook(_follow_stage_after_load)
        self._follow_stage()

    def num_steps(self) -> int:
        """Optimizer steps taken: the step count of the state (0 before the first step). AdamW
        keeps it as a CPU scalar, so reading it is no device sync."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    return int(state["step"].item())
        return 0

    @property
    def compressing(self) -> bool:
        """Whether the next step is a compression-stage step: the variance froze (in this run or in
        the checkpoint it resumed), or the warmup is over."""
        return any(FROZEN_AT in g for g in self.param_groups) or self.num_steps() >= self.warmup_steps

    def _follow_stage(self) -> None:
        compressing = self.compressing
        if compressing:
            frozen_at = self.num_steps()
            for group in self.param_groups:
                group.setdefault(FROZEN_AT, frozen_at)
        if compressing and not self.data_parallel.local_gradients:
            log.info("1-bit Adam: variance frozen after %d steps; momenta are 1-bit compressed from here on",
                     self.param_groups[0][FROZEN_AT])
            self._warn_unset_variance()
        self.data_parallel.set_local_gradients(compressing)

    def _warn_unset_variance(self) -> None:
        """Warn about the coordinates the momentum mask holds still (module docstring): replicated
        ones whose frozen variance is 0. One host sync, once per run."""
        vs = [local_tensor(self.state[p]["exp_avg_sq"]) for g in self.param_groups for p in g["params"]
              if self.state.get(p) and self.data_parallel.has_replicas(p)]
        if not vs:
            return
        counts = torch.stack([(v == 0).sum() for v in vs]).tolist()
        unset, tensors = sum(counts), sum(1 for c in counts if c)
        if unset:
            total = sum(v.numel() for v in vs)
            log.warning("1-bit Adam: %d of %d replicated coordinates (in %d tensors) had no gradient during the "
                        "%d warmup steps (experts without tokens, embedding rows not seen): their momentum is "
                        "masked and they get no update but weight decay for the rest of the run; a longer "
                        "dp.onebit_warmup_steps trains them", unset, total, tensors, self.param_groups[0][FROZEN_AT])

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            # AdamW's format: an fp32 CPU step count, moments shaped (and placed) like the parameter.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.compressing
        # Multi-tensor operations over each group's local tensors: a handful of kernels per group
        # and stage, not a dozen per parameter (the same elementwise arithmetic, so the warmup
        # stays torch's per-tensor AdamW bit for bit).
        buckets: dict[tuple[int, float, bool], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        averaged_params, averaged_m = [], []
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state_of(p) for p in params]
            torch._foreach_add_([s["step"] for s in states], 1)
            grads = [local_tensor(p.grad) for p in params]
            ms = [local_tensor(s["exp_avg"]) for s in states]
            vs = [local_tensor(s["exp_avg_sq"]) for s in states]
            # On the local gradient in the compression stage (step 2), the averaged one in warmup.
            torch._foreach_lerp_(ms, grads, 1 - beta1)
            frozen = [compressing and self.data_parallel.has_replicas(p) for p in params]
            live = [i for i, f in enumerate(frozen) if not f]
            if live:
                live_v, live_g = [vs[i] for i in live], [grads[i] for i in live]
                torch._foreach_mul_(live_v, beta2)
                torch._foreach_addcmul_(live_v, live_g, live_g, value=1 - beta2)
            steps = torch.stack([s["step"] for s in states]).tolist()  # CPU step counts: no device sync
            for p, t, m, v, f in zip(params, steps, ms, vs, frozen, strict=True):
                if f:
                    averaged_params.append(p)
                    averaged_m.append(m)
                buckets.setdefault((index, t, f), []).append((local_tensor(p), m, v))
        if averaged_m:
            # Step 3: every rank ends with the same m (collective: dp, then edp).
            self.data_parallel.onebit_average_(averaged_params, averaged_m)
        for (index, t, frozen_v), members in buckets.items():
            ps, ms, vs = (list(x) for x in zip(*members, strict=True))
            if frozen_v:
                # The momentum mask (module docstring): sign(v) is 1 where v > 0 and 0 where v == 0.
                torch._foreach_mul_(ms, torch._foreach_sign(vs))
            group = self.param_groups[index]
            self._update(ps, ms, vs, group, t=t, t_v=group[FROZEN_AT] if frozen_v else t)
        self._follow_stage()
        return loss

    @staticmethod
    def _update(ps: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], group: dict, *, t: float,
                t_v: float) -> None:
        """AdamW's update, operation for operation as torch's single-tensor AdamW (so the warmup
        matches it bit for bit), with the variance's bias correction at its own step t_v."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if wd != 0:
            torch._foreach_mul_(ps, 1 - lr * wd)
        step_size = lr / (1 - beta1 ** t)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, (1 - beta2 ** t_v) ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-step_size)


def _follow_stage_after_load(optimizer: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post-hook: the loaded step count decides the stage of the next backward."""
    assert isinstance(optimizer, OneBitAdam)
    optimizer._follow_stage()
