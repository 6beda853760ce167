"""Config of parameter-efficient fine-tuning: low-rank adapters (LoRA) on chosen projections.

With ``lora_rank`` > 0 every base weight of the model is frozen and each targeted projection
``W`` gains an adapter: its output becomes ``x W + (alpha / r) * x A B`` with ``A`` of rank r
(drawn) and ``B`` zero (so training starts from the base model exactly). Only the adapters
train, so only they take gradients and AdamW states. ``moetrain.models.lora`` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config._checks import require_int
from moetrain.config.base import require, require_active

LORA_TARGETS = ("attention", "experts", "shared_experts", "dense_ffn")
"""What ``finetune.lora_targets`` may name: the attention projections (q, k, v, o, or MLA's),
the routed experts' stacked w1/w3/w2, the shared experts' w1/w3/w2, the dense FFN blocks'."""


@dataclass
class FinetuneConfig:
    lora_rank: int = 0
    """Rank r of the adapters; 0 = no adapters (every parameter trains). Each adapter adds
    r * (in + out) parameters per projection (per expert for the routed experts)."""

    lora_alpha: float = 16.0
    """The adapters' output is scaled by lora_alpha / lora_rank, so a change of rank does not
    change the size of the update at the same learning rate (the LoRA paper's alpha)."""

    lora_targets: tuple[str, ...] = ("experts",)
    """Which projections get adapters: any of "attention", "experts" (routed experts),
    "shared_experts", "dense_ffn" (the FFN of the dense blocks). Everything else is frozen."""

    def __post_init__(self) -> None:
        require_int("finetune.lora_rank", self.lora_rank, min_value=0)
        alpha = self.lora_alpha
        require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < float("inf"),
                "finetune.lora_alpha", alpha, "must be a finite number > 0")
        targets = self.lora_targets
        require(isinstance(targets, (tuple, list)) and all(isinstance(t, str) for t in targets),
                "finetune.lora_targets", targets, f"must be a list of {', '.join(map(repr, LORA_TARGETS))}")
        self.lora_targets = tuple(targets)
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        require(not unknown, "finetune.lora_targets", self.lora_targets,
                f"names {', '.join(map(repr, unknown))}: each must be one of {', '.join(map(repr, LORA_TARGETS))}")
        require(len(set(self.lora_targets)) == len(self.lora_targets), "finetune.lora_targets",
                self.lora_targets, "must not name a target twice")
        if self.lora_rank == 0:
            # Fields of a switched-off feature are rejected rather than ignored.
            require_active(self.lora_alpha == FinetuneConfig.lora_alpha, "finetune.lora_alpha", self.lora_alpha,
                           "acts only with finetune.lora_rank > 0 (lora_rank is 0)")
            require_active(self.lora_targets == FinetuneConfig.lora_targets, "finetune.lora_targets",
                           self.lora_targets, "acts only with finetune.lora_rank > 0 (lora_rank is 0)")
        else:
            require(len(self.lora_targets) > 0, "finetune.lora_targets", self.lora_targets,
                    "must name at least one target when finetune.lora_rank > 0")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scale(self) -> float:
        """alpha / r, the factor of the adapters' output."""
        return self.lora_alpha / self.lora_rank
