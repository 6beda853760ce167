"""LoRA fine-tuning by module surgery: freeze every base weight, add low-rank adapters to the
projections ``finetune.lora_targets`` names, and fold them back into the base weights for export.
A classifier's task head (its output layer, attention-pooling query and n-gram table) stays
trainable, as PEFT's ``modules_to_save`` for sequence classification: it is new to the base model.

    apply_lora(model, cfg.finetune, seed=cfg.train.seed)   # single-device model, before parallelize
    merged = merge_lora(state_dict, cfg.finetune)          # full tensors -> plain model's tensors

A projection ``y = x W`` becomes ``y = x W + (alpha / r) * (x A) B``: A drawn uniform in
``+-1/sqrt(in)`` (nn.Linear's default, as PEFT draws it), B zero, so a fresh adapter changes
nothing and training starts from the base model exactly.

Where the adapters live, and in which layout (each the layout of its base weight):

* attention (q/k/v/o, or MLA's projections), shared experts, dense FFNs: the ``nn.Linear`` is
  replaced by a ``LoRALinear`` holding the same ``weight`` (and ``bias``) plus ``lora_a [R, I]``
  and ``lora_b [O, R]`` (PEFT's layout: ``W + scale * B A`` is ``[O, I]`` like ``W``). State-dict
  names of the base weights do not change (``...wq.weight``); the adapters add ``...wq.lora_a``.
* routed experts: ``GroupedExperts.add_lora`` adds ``lora_a_w1 [E, D, R]``, ``lora_b_w1 [E, R, F]``
  (and w3, w2 in theirs), run with the same grouped matmul as the experts, sharded over ``ep``
  with them.

Every adapter is drawn whole from its own generator, seeded from ``(seed, parameter name)``: the
same adapters for any parallel layout. Frozen parameters get no gradient and are left out of the
optimizer (``moetrain.train.optim.param_groups`` skips them): no AdamW state, no gradient memory.

Shape legend: I a projection's input dim, O its output dim, R adapter rank, E experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config.finetune import FinetuneConfig
from moetrain.models.attention import Attention
from moetrain.models.feedforward import FeedForward
from moetrain.models.mla import MultiHeadLatentAttention
from moetrain.models.moe.experts import GroupedExperts
from moetrain.models.moe.layer import MoELayer
from moetrain.utils.seeds import seeded_generator

LINEAR_A, LINEAR_B = "lora_a", "lora_b"
"""Attribute names of a ``LoRALinear``'s adapters."""


def lora_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from ``(seed, parameter name)``: one stream per adapter, independent
    of the global RNG, the device and the layout."""
    return seeded_generator(f"lora/{seed}/{name}")


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (the same ``weight`` and ``bias`` objects) plus ``lora_a [R, I]`` and
    ``lora_b [O, R]``: ``y = x W^T + b + scale * (x A^T) B^T``. Weights follow the input dtype (bf16
    compute over fp32 master weights), as ``ComputeDtypeLinear`` does."""

    def __init__(self, base: nn.Linear, *, rank: int, scale: float, generator: torch.Generator | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        w = base.weight
        bound = 1.0 / math.sqrt(self.in_features)
        a_RI = torch.empty(rank, self.in_features).uniform_(-bound, bound, generator=generator)
        self.lora_a = nn.Parameter(a_RI.to(device=w.device, dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        self.lora_rank, self.lora_scale = rank, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        bias = self.bias.to(dtype) if self.bias is not None else None
        y = F.linear(x, self.weight.to(dtype), bias)
        return y + self.lora_scale * F.linear(F.linear(x, self.lora_a.to(dtype)), self.lora_b.to(dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_rank}, lora_scale={self.lora_scale:g}"


def _targets(model: nn.Module, targets: tuple[str, ...]) -> dict[str, list[tuple[str, nn.Module]]]:
    """target -> [(qualified name, module)]: attention modules, GroupedExperts, the shared
    experts' FeedForward, the dense blocks' FeedForward."""
    shared = {id(m.shared_experts) for m in model.modules() if isinstance(m, MoELayer) and m.shared_experts is not None}
    found: dict[str, list[tuple[str, nn.Module]]] = {t: [] for t in targets}
    for name, module in model.named_modules():
        if isinstance(module, (Attention, MultiHeadLatentAttention)):
            kind = "attention"
        elif isinstance(module, GroupedExperts):
            kind = "experts"
        elif isinstance(module, FeedForward):
            kind = "shared_experts" if id(module) in shared else "dense_ffn"
        else:
            continue
        if kind in found:
            found[kind].append((name, module))
    return found


def apply_lora(model: nn.Module, finetune: FinetuneConfig, *, seed: int = 0) -> nn.Module:
    """Freeze every parameter of ``model`` and add adapters to the projections ``finetune``
    targets (see the module docstring); nothing when ``finetune.lora_rank`` is 0. In place, on the
    full single-device model before ``parallelize`` (the routed experts' adapters are then sharded
    with their experts). Returns ``model``.

    ``ValueError`` when a target matches nothing in this model (e.g. "shared_experts" without
    shared experts): the setting would otherwise be silently ignored."""
    if not finetune.enabled:
        return model
    found = _targets(model, finetune.lora_targets)
    missing = [t for t, modules in found.items() if not modules]
    if missing:
        raise ValueError(f"finetune.lora_targets ({finetune.lora_targets!r}) names {', '.join(map(repr, missing))}, "
                         "which this model does not have")
    for p in model.parameters():
        p.requires_grad_(False)
    config = getattr(model, "config", None)
    if config is not None and config.head == "classifier":
        # The task head trains whole, as PEFT's modules_to_save for sequence classification: a
        # classifier's head (and its pooling query and n-gram table) is new to the base model.
        for name in ("output", "pool_query", "ngram_embeddings"):
            part = getattr(model, name, None)
            for p in part.parameters() if isinstance(part, nn.Module) else [part] if part is not None else []:
                p.requires_grad_(True)
    rank, scale = finetune.lora_rank, finetune.scale
    for modules in found.values():
        for prefix, module in modules:
            where = f"{prefix}." if prefix else ""
            if isinstance(module, GroupedExperts):
                def generator_for(attr: str, where: str = where) -> torch.Generator:
                    return lora_generator(seed, where + attr)

                module.add_lora(rank=rank, scale=scale, generator_for=generator_for)
                continue
            for child_name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and not isinstance(child, LoRALinear):
                    generator = lora_generator(seed, f"{where}{child_name}.{LINEAR_A}")
                    setattr(module, child_name, LoRALinear(child, rank=rank, scale=scale, generator=generator))
    return model


def is_lora_name(name: str) -> bool:
    """Whether a state-dict name is an adapter's (``...wq.lora_a``, ``...experts.lora_b_w1``)."""
    leaf = name.rpartition(".")[2]
    return leaf in (LINEAR_A, LINEAR_B) or leaf.startswith(("lora_a_", "lora_b_"))


def num_lora_params(model: nn.Module) -> int:
    """Adapter parameters of ``model`` (global sizes, also when sharded)."""
    return sum(p.numel() for n, p in model.named_parameters() if is_lora_name(n))


def merge_one(name: str, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base + scale * product`` in the base weight's layout, summed in fp32 (fp64 for fp64),
    returned in the base weight's dtype."""
    acc = torch.float64 if base.dtype == torch.float64 else torch.float32
    if base.dim() == 3:  # routed experts: w [E, I, O] + a [E, I, R] @ b [E, R, O]
        delta = torch.bmm(a.to(acc), b.to(acc))
    else:  # nn.Linear: W [O, I] + b [O, R] @ a [R, I]
        delta = b.to(acc) @ a.to(acc)
    if delta.shape != base.shape:
        raise ValueError(f"LoRA adapters of {name}: product {tuple(delta.shape)} does not match the base weight "
                         f"{tuple(base.shape)}")
    return (base.to(acc) + scale * delta).to(base.dtype)


def lora_pairs(shapes: dict[str, tuple[int, ...]], finetune: FinetuneConfig) -> dict[str, tuple[str, str]]:
    """Base weight name -> (its lora_a name, its lora_b name), from a state dict's names and shapes.
    ``ValueError`` listing every adapter without its partner or base weight, or of another rank
    than ``finetune.lora_rank``."""
    adapters = [n for n in shapes if is_lora_name(n)]
    if not finetune.enabled:
        if adapters:
            raise ValueError(f"finetune.lora_rank (0) but the state dict holds {len(adapters)} LoRA adapters "
                             f"(e.g. {adapters[0]}): pass the fine-tuning run's finetune section")
        return {}
    pairs: dict[str, tuple[str, str]] = {}
    problems = []
    for n in adapters:
        prefix, _, leaf = n.rpartition(".")
        if leaf == LINEAR_A:
            pairs[f"{prefix}.weight"] = (n, f"{prefix}.{LINEAR_B}")
        elif leaf.startswith("lora_a_"):
            pairs[f"{prefix}.{leaf[len('lora_a_'):]}"] = (n, f"{prefix}.lora_b_{leaf[len('lora_a_'):]}")
    for base, (a, b) in pairs.items():
        for needed in (base, b):
            if needed not in shapes:
                problems.append(f"{needed} (needed by {a}) is missing")
        rank = shapes[a][0] if len(shapes[a]) == 2 else shapes[a][-1]
        if rank != finetune.lora_rank:
            problems.append(f"{a} has rank {rank}, finetune.lora_rank is {finetune.lora_rank}")
    partnered = {n for a, b in pairs.values() for n in (a, b)}
    problems += [f"{n} has no lora_a partner" for n in adapters if n not in partnered]
    if problems:
        raise ValueError("cannot merge the LoRA adapters: " + "; ".join(problems))
    return pairs


def merge_lora(state_dict: dict[str, torch.Tensor], finetune: FinetuneConfig) -> dict[str, torch.Tensor]:
    """The state dict of the plain model: each adapted base weight replaced by ``base + (alpha / r)
    * product of its adapters`` (in its own layout and dtype), adapters removed; every other entry
    passes through (the same tensor objects). Full tensors (an export's, or ``load_source``'s).
    ``ValueError`` as ``lora_pairs``."""
    pairs = lora_pairs({n: tuple(t.shape) for n, t in state_dict.items()}, finetune)
    out = {n: t for n, t in state_dict.items() if not is_lora_name(n)}
    for base, (a, b) in pairs.items():
        out[base] = merge_one(base, state_dict[base], state_dict[a], state_dict[b], finetune.scale)
    return out

