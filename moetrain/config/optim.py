"""Config of the optimizer (AdamW) and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_int
from moetrain.config.base import require, require_choice, require_non_negative, require_positive


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer. Only "adamw" (decoupled weight decay) for now."""

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
        require_choice("optim.name", self.name, ("adamw",))
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
        require_non_negative("optim.grad_clip", self.grad_clip)
        d = self.ema_decay
        require(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d < 1, "optim.ema_decay", d,
                "must be in [0, 1)")

    @property
    def resolved_min_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr
