"""Routing flips in low precision and the optimizer-moment bound of the experts they touch
(docs/verify.md, "Moments").

In bf16 (or a low-precision dispatch) the router's input carries rounding that differs by layout,
which flips the rare near-tied top-k choices. A flipped copy moves one token's whole gradient from
one expert to another, so the moments of the experts whose routed counts differ between the layout
and world 1 differ by far more than rounding. Those experts are found from the per-step counts both
runs log (``expert_share``); only their slices (row e of each stacked ``[E, ...]`` expert tensor and
of the router's ``[E, D]`` gate) get the looser bound, every other slice and tensor keeps the
rounding rule, so a bug that scales whole expert tensors (a missing 1/ep) still fails.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from moetrain.verify.checks import counts_from_shares

FLIPPED_SLICE_REL = 3.0
"""Bound of a flipped expert's moment slice, in multiples of world 1's largest entry of that slice
(never tighter than the rounding rule). A flipped copy adds or removes one token's gradient t, of
up to the slice's own size S when the expert holds a few tokens a step (2-3 in the shrunk jobs):
exp_avg moves by up to S, exp_avg_sq by (S + S)^2 - S^2 = 3 S^2. The token's other experts move too
(their combine weights are renormalised without it), which the measured exp_avg reached (1.08 S in
the DeepSeek-V3 job), so 3 S holds both moments. A slice more than 4x world 1's still fails."""

FLIP_WHY = (f"routed counts differed from world 1's (a low-precision routing flip moves a token's gradient to "
            f"another expert), so each is held to {FLIPPED_SLICE_REL:g}x its own largest entry")

_EXPERT_KEY = re.compile(r"^optim\.state\.(.+?)\.(?:experts|router)\.")
"""An optimizer-state tensor of an MoE layer's routed experts or router; group 1 is the layer's
module path (``layers.3.feed_forward``, ``mtp.0.block.feed_forward``). Shared experts are
``...shared_experts...`` and do not match."""


@dataclass(frozen=True)
class Flips:
    """(MoE layer, expert) pairs whose routed counts differed at some step, the layer numbered in
    the logged per-layer order."""

    num_layers: int
    pairs: frozenset[tuple[int, int]] = field(default_factory=frozenset)


def flipped_experts(got: Mapping[int, dict], want: Mapping[int, dict], *, routed_L: list[int], up_to: int) -> Flips:
    """The experts whose counts differ between the records ``got`` and ``want`` (by step) at any
    step 1..``up_to`` (the moments of a checkpoint after ``up_to`` hold every one of them).
    ``routed_L``: each logged layer's routed copies in a step (checks.routed_counts)."""
    pairs: set[tuple[int, int]] = set()
    num_layers = 0
    for step in range(1, up_to + 1):
        g, w = got.get(step) or {}, want.get(step) or {}
        if "expert_share" not in g or "expert_share" not in w:
            continue
        if not len(g["expert_share"]) == len(w["expert_share"]) == len(routed_L):
            continue  # the counts row fails this step already
        a_LE, b_LE = counts_from_shares(g["expert_share"], routed_L), counts_from_shares(w["expert_share"], routed_L)
        if a_LE.shape != b_LE.shape:
            continue  # as above (a different number of experts)
        num_layers = a_LE.shape[0]
        pairs |= {(int(layer), int(e)) for layer, e in (a_LE != b_LE).nonzero().tolist()}
    return Flips(num_layers, frozenset(pairs))


def moe_layers(keys: list[str]) -> list[str]:
    """The MoE layers named by the optimizer state ``keys``, in the logged per-layer order
    (train/pipeline_step.py merge_layer_metrics: ``layers.<i>`` by i, then ``mtp.<k>`` by k)."""

    def order(name: str) -> tuple[str, int, str]:
        head, _, rest = name.partition(".")
        index = rest.split(".")[0]
        return head, int(index) if index.isdigit() else -1, name

    return sorted({m.group(1) for k in keys if (m := _EXPERT_KEY.match(k))}, key=order)


def loosened_rows(keys: list[str], want: Mapping[str, torch.Tensor], flips: Flips | None, *, num_experts: int,
                  rel: float) -> list[torch.Tensor | None] | None:
    """Per key of ``keys`` (optimizer moments): None, or an absolute bound per expert row ``[E]``:
    ``rel`` x the tensor's largest entry (world 1's ``want``), and for the flipped experts at least
    ``FLIPPED_SLICE_REL`` x their own slice's largest entry. None when nothing is loosened, or when
    the logged layers cannot be matched to the checkpoint's (then every tensor keeps the plain rule)."""
    if flips is None or not flips.pairs:
        return None
    layers = moe_layers(keys)
    if len(layers) != flips.num_layers:
        return None
    by_layer: dict[str, set[int]] = {}
    for layer, e in flips.pairs:
        by_layer.setdefault(layers[layer], set()).add(e)
    out: list[torch.Tensor | None] = []
    for key in keys:
        m = _EXPERT_KEY.match(key)
        w = want[key].detach().double().abs()
        experts = by_layer.get(m.group(1)) if m else None
        if not experts or w.dim() == 0 or w.shape[0] != num_experts or w.numel() == 0:
            out.append(None)
            continue
        bound_E = torch.full((num_experts,), rel * float(w.max()), dtype=torch.float64)
        slice_E = w.flatten(1).amax(dim=1) if w.dim() > 1 else w
        idx = torch.tensor(sorted(experts))
        bound_E[idx] = torch.maximum(bound_E[idx], FLIPPED_SLICE_REL * slice_E[idx])
        out.append(bound_E)
    return out if any(b is not None for b in out) else None
