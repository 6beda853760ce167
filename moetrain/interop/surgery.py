"""Model surgery on full tensors: growing a trained MoE's experts, and folding LoRA adapters into
the base weights for export.

    moetrain experts grow RUN --num-experts 2E --to DIR [--top-k 2K] [--noise 0.01] [--seed 0]

Growing E -> f*E experts (f an integer): each grown expert is a copy of an original expert e, and
so is its router row, its per-expert learning-rate scale and its selection bias (``expert_bias``;
divided by f under a softmax router, whose probabilities the copies split f ways: ``p/f + b/f``
ranks the experts as ``p + b`` did, where ``p/f + b`` would not; a sigmoid router's scores do not
shrink, so its bias is copied as it is). Copies sit next to each other, grown expert ``f*e + c``
(copy c = 0..f-1) being expert e, so that under expert parallelism every copy of an expert lands on
the ep rank that held the original (each rank holds a whole number of originals' copy-blocks
whenever ep divides E), and a group of group-limited routing holds the copies of whole original
groups. Except under group-limited routing scored ``top2_sum`` (DeepSeek-V3's default): a group
holding f copies of each expert would score two copies of its best one instead of its two best
experts, and another group could win. There the groups multiply too (moe.num_expert_groups and
moe.top_groups times f) and grown group ``f*g + c`` holds copy c of original group g's experts:
each grown group scores as its original (scaled by 1/f under softmax), the f copies of a group tie
and sit side by side, so a token keeps the copies of its original groups, on the ranks that held
them whenever ep divides the number of groups. ``noise`` adds ``noise * std(tensor) * N(0, 1)``
to every copy but the first (c >= 1) of the expert weights and router rows (std of the layer's
whole tensor, drawn per tensor from ``(seed, name)``): copy 0 stays the trained expert, the others
start close to it and drift apart as their routers see different tokens.

Identity (noise 0): with ``top_k`` scaled by f as well, every token picks the f copies of each of
its K experts (copies tie and rank next to each other); softmax spreads each expert's probability
evenly over its copies, and with renormalised gates the f copies' weights sum to the original
weight, so the output is the original model's up to rounding. Unrenormalised gates need care: at
top_k 1 the source's gate is its raw score (moe.renormalize is ignored there), so the grown model
gets moe.renormalize false, whose softmax copies' p/f sum to p; a sigmoid router's copies each keep
the score s, so unrenormalised (or at top_k 1) the grown moe.routed_scaling_factor is divided by f.
Keeping ``top_k`` instead changes the function: a token then picks the copies of fewer distinct
experts (K copies of about K/f experts), and the load-balancing loss counts f*E experts.

Every MoE layer grows, the multi-token modules' (``model.mtp_depth``: each module's block is an MoE block
in an MoE model) as the trunk's, so the identity holds for their losses too.

The output is a moetrain export (``write_export``): it starts a run at any layout through
``checkpoint.init_from``. The optimizer state does not carry over (no AdamW moments for the copies).
Its config.yaml is the source's with the changes above and a fresh run's log and checkpoint sections
(``_fresh_run``): ``moetrain train --config DIR/config.yaml`` trains the grown model in ``DIR-run``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path

import torch

from moetrain.config.convert import build_section
from moetrain.config.finetune import FinetuneConfig
from moetrain.config.moe import MoEConfig
from moetrain.interop.export import (
    check_output_folder,
    copy_classes,
    fresh_run_config,
    load_source,
    model_configs,
    source_folder,
    without_adapters,
    write_export,
)
from moetrain.models.lora import merge_lora
from moetrain.utils.seeds import seeded_generator

EXPERT_TENSORS = ("experts.",)
"""State-dict names under an MoE layer that are stacked ``[E, ...]`` per expert (weights, adapters)."""
PER_EXPERT = ("router.gate.weight", "router.expert_bias", "expert_lr_scale")
"""Other per-expert state of an MoE layer, ``[E, ...]`` in expert order."""
NOISY = ("experts.w1", "experts.w2", "experts.w3", "router.gate.weight")
"""Where ``noise`` goes: the expert weights and the router rows (not the adapters, biases, scales)."""


def _moe_prefixes(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """``layers.L.feed_forward.`` of every MoE layer (``mtp.k.block.feed_forward.`` of the multi-token
    modules'): the owners of ``experts.w1``."""
    suffix = "experts.w1"
    return sorted(n[: -len(suffix)] for n in state_dict if n.endswith(suffix))


def _generator(seed: int, name: str) -> torch.Generator:
    return seeded_generator(f"grow/{seed}/{name}")


def _copy_rows(num_experts: int, factor: int, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source row, copy number)`` of each grown expert. Copies side by side (row ``f*e + c`` is
    expert e), or with ``group_size`` n group-major: grown group ``f*g + c`` holds copy c of the n
    experts of original group g (row ``g*f*n + c*n + j`` is expert ``g*n + j``)."""
    row = torch.arange(num_experts * factor)
    if group_size is None:
        return row // factor, row % factor
    block = factor * group_size
    return (row // block) * group_size + row % group_size, (row % block) // group_size


def _grow_tensor(name: str, t_E: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], *, noise: float,
                 seed: int) -> torch.Tensor:
    """``[E, ...] -> [f*E, ...]``: grown row r is row ``src[r]``, plus noise on copies c >= 1."""
    src, copy_no = rows
    grown = t_E[src]
    if noise > 0:
        std = float(t_E.float().std()) if t_E.numel() > 1 else 0.0
        draw = torch.randn(grown.shape, generator=_generator(seed, name), dtype=torch.float32)
        draw[copy_no == 0] = 0.0  # copy 0 of each expert stays exact
        grown = (grown.float() + noise * std * draw).to(t_E.dtype)
    return grown


def _regroups(moe: MoEConfig) -> bool:
    """Whether the groups of group-limited routing must multiply with the experts: a group scored
    by the sum of its two best experts (``top2_sum``) would, holding f copies of each, score two
    copies of its best one, and rank otherwise than the original group did."""
    limited = 1 < moe.num_expert_groups and moe.top_groups < moe.num_expert_groups
    return limited and moe.group_score == "top2_sum" and moe.num_experts // moe.num_expert_groups >= 2


def grown_config(config: dict, *, num_experts: int, top_k: int | None = None) -> tuple[dict, list[str]]:
    """The grown model's config and a line for each moe setting changed, besides num_experts and
    top_k, so that it computes the source's function (see the module docstring)."""
    _, moe_cfg = model_configs(config)
    factor, old_k = num_experts // moe_cfg.num_experts, moe_cfg.top_k
    new_config = copy.deepcopy(config)
    moe = new_config.setdefault("moe", {})
    moe["num_experts"] = num_experts
    notes = []
    if _regroups(moe_cfg):
        groups, top = moe_cfg.num_expert_groups, moe_cfg.top_groups
        moe["num_expert_groups"], moe["top_groups"] = factor * groups, factor * top
        notes.append(f"moe.num_expert_groups {groups} -> {factor * groups}, moe.top_groups {top} -> {factor * top}: "
                     "group_score top2_sum would score a group of copies by two copies of its best expert; each "
                     f"grown group holds one copy of an original group (--moe.num_expert_groups={groups} "
                     f"--moe.top_groups={top} keeps {top} of {groups} groups per token but changes the function)")
    if top_k is not None:
        moe["top_k"] = top_k
    if top_k == factor * old_k and moe_cfg.router != "expert_choice":
        if moe_cfg.renormalize and old_k == 1:
            moe["renormalize"] = False
            notes.append("moe.renormalize true -> false: at top_k 1 the gate is the raw router score (renormalize "
                         f"is ignored), which the {factor} copies keep summed only unrenormalised")
        if moe_cfg.router == "sigmoid" and not (moe_cfg.renormalize and old_k > 1):
            scale = moe_cfg.routed_scaling_factor / factor
            moe["routed_scaling_factor"] = scale
            notes.append(f"moe.routed_scaling_factor {moe_cfg.routed_scaling_factor} -> {scale:g}: sigmoid copies "
                         f"keep the original's score each, so unrenormalised the {factor} copies' gates sum to "
                         f"{factor}x the original's")
    model_configs(new_config)  # the grown model/moe sections must be valid (top_k <= experts, groups, ...)
    return new_config, notes


def grow_experts(config: dict, state_dict: dict[str, torch.Tensor], *, num_experts: int, top_k: int | None = None,
                 noise: float = 0.0, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of the model with ``num_experts`` experts per MoE layer (an
    integer multiple of moe.num_experts), each a copy of an original (see the module docstring).
    ``top_k`` sets moe.top_k of the grown model (None keeps it). Full tensors in, full tensors out;
    the config's other sections are kept."""
    model_cfg, moe_cfg = model_configs(config)
    old = moe_cfg.num_experts
    if not model_cfg.is_moe:
        raise ValueError("experts grow: the source is a dense model (model.moe_every = 0): no experts to grow")
    if not (isinstance(num_experts, int) and num_experts > old and num_experts % old == 0):
        raise ValueError(f"--num-experts ({num_experts}) must be a multiple (> 1x) of the source's "
                         f"moe.num_experts ({old})")
    if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
        raise ValueError(f"--noise ({noise!r}) must be a finite number >= 0 (a fraction of each tensor's std)")
    factor = num_experts // old
    new_config, _ = grown_config(config, num_experts=num_experts, top_k=top_k)
    rows = _copy_rows(old, factor, old // moe_cfg.num_expert_groups if _regroups(moe_cfg) else None)

    prefixes = _moe_prefixes(state_dict)
    # Each multi-token module's block is an MoE block in an MoE model (models/transformer.py).
    expected = len(model_cfg.moe_layer_ids) + model_cfg.mtp_depth
    if len(prefixes) != expected:
        raise ValueError(f"experts grow: the source has {len(prefixes)} MoE layers with experts.w1, its config "
                         f"{expected} ({len(model_cfg.moe_layer_ids)} blocks, {model_cfg.mtp_depth} multi-token "
                         "modules)")
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        local = name[len(prefix):] if prefix is not None else ""
        if prefix is None or not (local.startswith(EXPERT_TENSORS) or local in PER_EXPERT):
            out[name] = t
            continue
        if t.shape[0] != old:
            raise ValueError(f"experts grow: {name} has {t.shape[0]} rows, moe.num_experts is {old}")
        if local == "router.expert_bias" and moe_cfg.router == "softmax":
            t = t / factor
        out[name] = _grow_tensor(name, t, rows, noise=noise if local in NOISY else 0.0, seed=seed)
    return new_config, out


@dataclasses.dataclass
class Grown:
    """What ``grow_source`` wrote: the export, the ``--moe.X=V`` overrides that make another config's
    model the grown one, and the notes of ``grown_config``."""
    export: Path
    overrides: list[str]
    notes: list[str]


def grow_source(source: str | os.PathLike, out_dir: str | os.PathLike, *, num_experts: int, top_k: int | None = None,
                noise: float = 0.0, seed: int = 0) -> Grown:
    """``moetrain experts grow``: read ``source`` (a run folder, checkpoint or export, saved at any
    layout), grow its experts and write the export ``out_dir``, whose config.yaml starts a fresh
    run from it (``_fresh_run``)."""
    check_output_folder(source, out_dir, "--to")
    config, state_dict, info = load_source(source)
    new_config, grown = grow_experts(config, state_dict, num_experts=num_experts, top_k=top_k, noise=noise, seed=seed)
    _, notes = grown_config(config, num_experts=num_experts, top_k=top_k)
    new_config = fresh_run_config(new_config, source, Path(out_dir))
    old_moe, new_moe = config.get("moe") or {}, new_config["moe"]
    overrides = [f"--moe.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in new_moe.items()
                 if old_moe.get(k) != v]
    info = {**info, "grown_from_num_experts": old_moe.get("num_experts"), "grow_noise": noise, "grow_seed": seed}
    out = write_export(out_dir, config=new_config, state_dict=grown, info=info)
    copy_classes(source_folder(source), out)
    return Grown(out, overrides, notes)


def merge_lora_export(config: dict, state_dict: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A fine-tuning run's ``(config, full tensors)`` as the plain model's: adapters folded into
    their base weights (``merge_lora`` with the config's finetune section) and the finetune section
    reset to its defaults (no adapters), so the result builds and loads as a plain model."""
    finetune = build_section(FinetuneConfig, "finetune", dict(config.get("finetune") or {}))
    return without_adapters(copy.deepcopy(config)), merge_lora(state_dict, finetune)
