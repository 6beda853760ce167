"""Optimizer and learning-rate schedule. Gradient clipping over the global (all-rank) norm is
``moetrain.distributed.data_parallel.grads.clip_global_grad_norm_``."""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.config.optim import OptimConfig
from moetrain.distributed.data_parallel.ddp import onebit_data_parallel
from moetrain.distributed.data_parallel.onebit_adam import OneBitAdam
from moetrain.distributed.local_adamw import LocalAdamW
from moetrain.distributed.muon import Muon, muon_param_ids


def param_groups(model: nn.Module, *, weight_decay: float, muon: bool = False) -> list[dict]:
    """AdamW groups: matrices (and stacked expert matrices) decay; norms, biases and other
    vectors do not (decaying a norm gain pulls it towards zero, not towards "simple").
    ``muon``: the hidden and expert matrices (``muon_param_ids``) form a group of their own,
    ``"muon": True``, which decays too; the other groups carry ``"muon": False``."""
    to_muon = muon_param_ids(model) if muon else set()
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    matrices: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in to_muon:
            matrices.append(p)
        else:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": matrices, "weight_decay": weight_decay, "name": "muon", "muon": True},
              {"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    if muon:
        for g in groups[1:]:
            g["muon"] = False
    return [g for g in groups if g["params"]]


def optimizer_settings(o: OptimConfig) -> dict:
    """``build_optimizer``'s keyword arguments from the optim section."""
    return dict(name=o.name, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps)


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, name: str = "adamw", momentum: float = 0.95, nesterov: bool = True,
                    ns_steps: int = 5, data_parallel: nn.Module | None = None,
                    onebit_warmup_steps: int = 1) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters (fused, on each rank's local shards: ``LocalAdamW``);
    1-bit Adam (AdamW for ``onebit_warmup_steps`` steps, then compressed momenta:
    ``moetrain.distributed.data_parallel.onebit_adam``) when ``data_parallel``, the wrapped model,
    runs dp.grad_compression "onebit". ``name="muon"``: ``Muon`` (momentum, nesterov, ns_steps) for
    the hidden and expert matrices, AdamW for the rest (``moetrain.distributed.muon``)."""
    wrapper = onebit_data_parallel(data_parallel) if data_parallel is not None else None
    if name == "muon":
        if wrapper is not None:
            raise ValueError("dp.grad_compression ('onebit') cannot be used with optim.name ('muon'): "
                             "1-bit Adam replaces the optimizer")
        return Muon(param_groups(model, weight_decay=weight_decay, muon=True), lr=lr, weight_decay=weight_decay,
                    momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, betas=betas, eps=eps)
    if name != "adamw":
        raise ValueError(f"optim.name ({name!r}) must be 'adamw' or 'muon'")
    groups = param_groups(model, weight_decay=weight_decay)
    if wrapper is not None:
        return OneBitAdam(groups, data_parallel=wrapper, warmup_steps=onebit_warmup_steps, lr=lr, betas=betas,
                          eps=eps, weight_decay=weight_decay)
    return LocalAdamW(groups, lr=lr, betas=betas, eps=eps)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
          schedule: str) -> float:
    """Linear warmup from lr/warmup to lr, then cosine decay to min_lr at total_steps
    ("constant": stays at lr after warmup). ``step`` counts from 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, **kwargs) -> torch.optim.lr_scheduler.LambdaLR:
    base = kwargs["lr"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, **kwargs) / base)


def apply_optim_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                       o: OptimConfig) -> list[str]:
    """After a checkpoint load: put ``o``'s hyper-parameters back into every param group, which
    ``load_state_dict`` (and ZeRO-1's ``load_consolidated``) replaced with the saved ones, and the
    scheduler's base learning rates with them. A resume may change every ``optim`` field but the
    name (docs/checkpoints.md); the optimizer *state* (moments, step counts) stays the checkpoint's.
    The current lr is the schedule's at the resumed step, through the scheduler's own multiplier,
    so an unchanged config gives the saved values bit for bit. Returns one line per field whose
    saved value differs, e.g. ``"optim.lr: 0.001 in the checkpoint, 0.0001 now (...)"``."""
    changes: dict[str, str] = {}

    def note(field: str, saved, now) -> None:
        if saved != now and field not in changes:
            changes[field] = (f"optim.{field}: {saved} in the checkpoint, {now} now "
                              "(the resumed run uses the config's value)")

    wanted = {"betas": tuple(o.betas), "eps": o.eps, "momentum": o.muon_momentum, "nesterov": o.muon_nesterov,
              "ns_steps": o.muon_ns_steps}
    names = {"momentum": "muon_momentum", "nesterov": "muon_nesterov", "ns_steps": "muon_ns_steps"}
    # 1-bit Adam past its warmup divides a variance that froze under the saved b2 by that b2's bias
    # correction: another b2 would only mis-correct it, so b2 stays the checkpoint's.
    frozen_b2 = bool(getattr(optimizer, "compressing", False))
    for i, group in enumerate(optimizer.param_groups):
        if frozen_b2 and "betas" in group and group["betas"][1] != o.betas[1]:
            changes.setdefault("betas[1]", f"optim.betas[1]: {group['betas'][1]} in the checkpoint, {o.betas[1]} "
                                           "asked, kept: 1-bit Adam's variance froze with it")
            wanted["betas"] = (o.betas[0], group["betas"][1])
        note("lr", scheduler.base_lrs[i], o.lr)
        scheduler.base_lrs[i] = group["initial_lr"] = o.lr
        group["lr"] = o.lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
        # The no-decay group (norms, biases) never decays, whatever optim.weight_decay says.
        decay = 0.0 if group.get("name") == "no_decay" else o.weight_decay
        if group.get("name") != "no_decay":
            note("weight_decay", group["weight_decay"], decay)
        group["weight_decay"] = decay
        for key, value in wanted.items():
            if key not in group:
                continue
            if key not in names or group.get("muon"):  # Muon's fields act in its Muon groups only
                note(names.get(key, key), tuple(group[key]) if key == "betas" else group[key], value)
            group[key] = value
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    return list(changes.values())
