"""A resume continues the same model: the fields that define the function the weights compute must
keep the values the checkpoint was saved with.

Matching tensor shapes are not enough: ``moe.top_k``, ``moe.router``, the activation or the
group-limited routing change what the same weights compute without changing a shape, and a run
resumed with another of them would train on under the new rule while its config.yaml claimed it
had always been so. Every ``model`` and ``moe`` field is such a field unless listed below as a
training setting; the other sections (``train``, ``optim``, ``parallel``, ``data``, ...) may change
(the data loader and the checkpoint loader refuse what they cannot continue, such as another
global batch or tokenizer). A field the saved config lacks (a checkpoint older than it) is not
compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moetrain.train.checkpoint.files import CheckpointError

MAY_CHANGE: dict[str, frozenset[str]] = {
    "model": frozenset({
        "preset",  # a label: the preset's values are the fields themselves
        "dropout", "init_std", "mtp_loss_weight",  # regulariser, initialisation, a loss weight
    }),
    "moe": frozenset({
        # losses and their balancing
        "aux_loss_coef", "z_loss_coef", "aux_loss_type", "router_bias_update_rate", "router_init_std",
        # token dropping (capacity) and its adaptation
        "capacity_factor", "drop_policy", "dynamic_capacity", "dynamic_capacity_base", "dynamic_capacity_scale",
        "dynamic_capacity_shift", "balance_interval", "expert_lr_scale_max",
        # how the same computation runs
        "expert_impl", "dispatch_dedup", "dispatch_dtype", "dispatch_chunks", "rebalance_every",
        # training-time noise, benchmark switches and monitoring
        "router_jitter", "router_noise_std", "force_balance", "force_skew", "routing_replay",
        "collapse_threshold", "collapse_warmup_steps", "collapse_consecutive_checks", "collapse_aux_increase",
        "collapse_aux_max", "unused_expert_steps",
    }),
}
"""The ``model`` and ``moe`` fields a resume may change: training settings, not the model's function."""

RULE = ("a resume continues the same model, so every model field and the moe fields of its experts and "
        "routing (num_experts, top_k, expert_hidden_dim, activation, router, renormalize, "
        "routed_scaling_factor, shared experts, expert_bias, expert groups) keep their saved values; to "
        "train another model, give it its own run folder (--log.run_dir=...), or export this checkpoint "
        "(`moetrain export`) and start a new run from its weights with --checkpoint.init_from. A resume "
        "may change the training settings: the losses and their coefficients, the capacity factor and "
        "drop policy, the dispatch settings and expert_impl, the balancing and collapse settings, "
        "model.dropout, and the train, optim and parallel fields but the global batch, train.seed and "
        "optim.name (docs/checkpoints.md)")


def _plain(value: Any) -> Any:
    """As the checkpoint's JSON holds it (tuples as lists)."""
    return json.loads(json.dumps(value))


def model_changes(saved: dict, new: dict, *, moe: bool = True) -> list[str]:
    """``section.field (saved X, now Y)`` for each model-defining field whose value differs between
    the config dicts ``saved`` and ``new`` (``config_to_dict``'s form); ``moe``: whether the model
    has MoE layers (a dense model ignores the moe section)."""
    changes = []
    for section, may_change in MAY_CHANGE.items():
        if section == "moe" and not moe:
            continue
        old, now = saved.get(section) or {}, _plain(new.get(section) or {})
        for name in sorted(set(old) & set(now) - may_change):
            if old[name] != now[name]:
                changes.append(f"{section}.{name} (saved {old[name]!r}, now {now[name]!r})")
    return changes


def check_same_model(path: Path, saved: Any, new: dict, *, moe: bool = True) -> None:
    """Raise ``CheckpointError`` (a ValueError) naming every model-defining field in which the job's
    config ``new`` differs from the config ``saved`` with checkpoint ``path``."""
    if not isinstance(saved, dict):
        return  # a checkpoint without its config: only its tensors can be checked
    changes = model_changes(saved, new, moe=moe)
    if changes:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match this job's model: "
                              + "; ".join(changes) + f". {RULE[0].upper()}{RULE[1:]}")
