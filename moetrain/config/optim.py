"""Config of the optimizer (AdamW or Muon) and the learning-rate schedule."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from moetrain.config._checks import require_int
from moetrain.config.base import (
    require,
    require_active,
    require_choice,
    require_non_negative,
    require_positive,
)

OPTIMIZERS = ("adamw", "muon")


def check_muon(name: str, *, tp: int, etp: int, grad_compression: str, zero_stage: int, offload_optimizer: str,
               offload_param: str) -> None:
    """optim.name "muon" against the layout (``ValueError`` naming the fields): Muon orthogonalises
    whole matrices, gathered over ZeRO's shards but not over tensor-parallel splits; and 1-bit
    Adam is an optimizer of its own."""
    if name != "muon":
        return
    require(tp == 1, "parallel.tp", tp, "must be 1 with optim.name 'muon': a tp-split matrix is not gathered "
            "for the Newton-Schulz iteration")
    require(etp == 1, "parallel.etp", etp, "must be 1 with optim.name 'muon': an etp-split expert matrix is not "
            "gathered for the Newton-Schulz iteration")
    require(grad_compression != "onebit", "dp.grad_compression", grad_compression,
            "cannot be 'onebit' with optim.name 'muon': 1-bit Adam replaces the optimizer")
    if zero_stage >= 2:
        for field, value in (("zero.offload_optimizer", offload_optimizer), ("zero.offload_param", offload_param)):
            require(value == "none", field, value, f"must be 'none' with optim.name 'muon' at parallel.zero_stage "
                    f"{zero_stage}: FSDP2 keeps the shards on the host, where the whole-matrix gather over the "
                    "device's group cannot run")


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer. "adamw": AdamW (decoupled weight decay) for every parameter. "muon": Muon
    (Newton-Schulz orthogonalised momentum, Moonlight's update scaling, so lr and weight_decay
    carry over from AdamW) for the hidden matrices and every expert's matrices, AdamW (betas, eps)
    for embeddings, the output head, routers, norms and biases; ``moetrain.distributed.muon``.
    Not with parallel.tp or parallel.etp > 1, dp.grad_compression "onebit", or offloading at
    ZeRO stages 2/3."""

    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""

    min_lr: float | None = None
    """Learning rate at the end of the cosine decay; None = lr / 10. Must be <= lr."""

    weight_decay: float = 0.1
    """AdamW weight decay, applied to parameters with two or more dimensions (matrices, stacked
    experts); norm scales get none."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2), each in [0, 1)."""

    eps: float = 1e-8
    """AdamW epsilon."""

    muon_momentum: float = 0.95
    """optim.name "muon": the momentum coefficient mu of ``m = mu * m + g``, in [0, 1)."""

    muon_nesterov: bool = True
    """optim.name "muon": orthogonalise ``g + mu * m`` (Nesterov) instead of ``m``."""

    muon_ns_steps: int = 5
    """optim.name "muon": Newton-Schulz iterations per step (5 in the published recipe), >= 1."""

    warmup_steps: int = 100
    """Steps of linear warmup up to lr (a run shorter than this never reaches lr)."""

    schedule: str = "cosine"
    """After warmup: "cosine" decays to min_lr at train.steps; "constant" stays at lr."""

    grad_clip: float = 1.0
    """Clip the global gradient norm (over all parameters, experts included) to this value; 0 = off."""

    ema_decay: float = 0.0
    """Keep an exponential moving average of the trainable weights, updated after every step taken
    (``avg += (1 - d_t) * (w - avg)`` with ``d_t = min(ema_decay, (1 + t) / (10 + t))`` at the t-th
    update, so the first averages do not lean on the initial weights). Evaluations, ``moetrain eval``,
    the end-of-run sample and ``moetrain export`` then use the averaged weights; training goes on from
    the raw ones. Each rank averages its own shards; the average is in the checkpoint and reshards with
    it. In [0, 1); 0 = off. 0.999 averages over about the last 1,000 steps."""

    def __post_init__(self) -> None:
        require_choice("optim.name", self.name, OPTIMIZERS)
        require_positive("optim.lr", self.lr)
        if self.min_lr is not None:
            require_non_negative("optim.min_lr", self.min_lr)
            require(self.min_lr <= self.lr, "optim.min_lr", self.min_lr, f"must be <= optim.lr ({self.lr})")
        require_non_negative("optim.weight_decay", self.weight_decay)
        ok = isinstance(self.betas, tuple) and len(self.betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in self.betas)
        require(ok, "optim.betas", self.betas, "must be two numbers in [0, 1)")
        require_positive("optim.eps", self.eps)
        require_int("optim.warmup_steps", self.warmup_steps)
        require_choice("optim.schedule", self.schedule, ("cosine", "constant"))
        require_active(self.min_lr is None or self.schedule == "cosine", "optim.min_lr", self.min_lr,
                       f'acts only with optim.schedule "cosine" (it is {self.schedule!r}): leave it null')
        require_non_negative("optim.grad_clip", self.grad_clip)
        m = self.muon_momentum
        require(isinstance(m, (int, float)) and not isinstance(m, bool) and 0 <= m < 1, "optim.muon_momentum", m,
                "must be in [0, 1)")
        require(isinstance(self.muon_nesterov, bool), "optim.muon_nesterov", self.muon_nesterov,
                "must be true or false")
        require_int("optim.muon_ns_steps", self.muon_ns_steps, min_value=1)
        muon_fields = {"muon_momentum": 0.95, "muon_nesterov": True, "muon_ns_steps": 5}
        for name, default in muon_fields.items():
            if self.name != "muon" and getattr(self, name) != default:
                warnings.warn(f"optim.{name} ({getattr(self, name)!r}) is ignored: optim.name is {self.name!r}, "
                              "not 'muon'", stacklevel=2)
        d = self.ema_decay
        require(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d < 1, "optim.ema_decay", d,
                "must be in [0, 1)")

    @property
    def resolved_min_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr
