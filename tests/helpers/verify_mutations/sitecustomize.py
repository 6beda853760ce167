"""Test-only bug injection for ``moetrain verify``'s mutation suite (tests/integration/
test_verify_mutations.py). Python imports ``sitecustomize`` at start-up from PYTHONPATH: a process
started with this folder on it and ``MOETRAIN_TEST_MUTATION`` in its environment (any value, even
empty) gets every classic layout bug below wrapped around the moetrain function it corrupts, as
that module is imported. Each wrapper acts only while ``MOETRAIN_TEST_MUTATION`` names its bug at
the time of the call, so one armed process (verify's launcher, whose ranks are forked with each
run's environment) serves every case. Nothing in moetrain reads the variable or knows this file:
the hook cannot be reached from a config.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import os
import sys

VARIABLE = "MOETRAIN_TEST_MUTATION"


def _when(name: str, original):
    """``mutated`` in place of ``original`` while the environment names bug ``name``."""

    def wrap(mutated):
        @functools.wraps(original)
        def chosen(*args, **kwargs):
            return (mutated if os.environ.get(VARIABLE) == name else original)(*args, **kwargs)

        return chosen

    return wrap


def _expert_grad_scale(finalize) -> None:
    """Missing 1/ep: an expert shard's gradient averaged over its edp copies instead of (sum) / dp."""
    original = finalize.grad_reduction

    @_when("expert_grad_scale", original)
    def grad_reduction(dims, axis):
        rule = original(dims, axis)
        return dataclasses.replace(rule, divisor=rule.size) if axis == "edp" else rule

    finalize.grad_reduction = grad_reduction


def _aux_loss_group(layer) -> None:
    """The Switch balance loss normalised by this rank's tokens, not the balance group's."""
    import torch.distributed as dist

    original = layer.load_balancing_loss

    @_when("aux_loss_group", original)
    def load_balancing_loss(probs_TE, counts_E, *, top_k, num_tokens=None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        local = None if num_tokens is None else num_tokens // world
        return original(probs_TE, counts_E, top_k=top_k, num_tokens=local)

    layer.load_balancing_loss = load_balancing_loss


def _grad_norm_replicated(grads) -> None:
    """Replicated (plain) gradients' squares summed over every rank: counted once per copy."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    original = grads.global_grad_norm

    @_when("grad_norm_replicated", original)
    def global_grad_norm(params):
        norm = original(params)
        world = dist.get_world_size() if dist.is_initialized() else 1
        plain = sum((p.grad.float().pow(2).sum() for p in params
                     if p.grad is not None and not isinstance(p.grad, DTensor)), torch.zeros(()))
        return (norm.pow(2) + (world - 1) * plain.to(norm.device)).sqrt()

    grads.global_grad_norm = global_grad_norm


def _bias_local_counts(layer) -> None:
    """The router's selection bias updated from this rank's routing counts, not the global ones."""
    import torch

    from moetrain.models.moe import router as router_module

    token_choice_aux = layer.MoELayer._token_choice_aux

    @_when("bias_local_counts", token_choice_aux)
    def _token_choice_aux(self, x, routing, *args, **kwargs):
        aux = token_choice_aux(self, x, routing, *args, **kwargs)
        # Counted where the layer records its step statistics: training forwards, a checkpointed
        # forward run again in backward once.
        if self.track_routing_stats and self.training and torch._C._current_graph_task_id() == -1:
            local_E = torch.bincount(routing.idx_TK.reshape(-1), minlength=self.config.num_experts)
            self.router._local_routed_E = getattr(self.router, "_local_routed_E", 0) + local_E
        return aux

    update = router_module.TopKRouter.update_bias

    @_when("bias_local_counts", update)
    def update_bias(self, num_routed_E, rate):
        local_E = self.__dict__.pop("_local_routed_E", num_routed_E)
        update(self, local_E, rate)

    layer.MoELayer._token_choice_aux = _token_choice_aux
    router_module.TopKRouter.update_bias = update_bias


def _optimizer_old_layout(state) -> None:
    """After a reshard, each expert stack's optimizer moments left as the saving layout's first
    rank held them: its expert rows repeated over the whole stack."""
    original = state._read_state

    @_when("optimizer_old_layout", original)
    def _read_state(*args, **kwargs):
        loaded, groups = original(*args, **kwargs)
        for name, entry in loaded["optim"]["state"].items():
            if ".experts." not in name or not isinstance(entry, dict):
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                t = entry.get(key)
                if t is not None and t.dim() == 3 and t.shape[0] >= 2:
                    half = t.shape[0] // 2
                    t[half:2 * half].copy_(t[:half])
        return loaded, groups

    state._read_state = _read_state


def _export_skips_expert(convert) -> None:
    """The HF exporter's per-expert loop stops one expert short."""
    from moetrain.interop.hf.family import Experts

    original = convert._export_jobs

    @_when("export_skips_expert", original)
    def _export_jobs(entries, src, dtype_of):
        jobs = original(entries, src, dtype_of)
        last = {f"{e.hf}.{e.num_experts - 1}." for e in entries if isinstance(e, Experts)}
        return [j for j in jobs if not any(j[0].name.startswith(p) for p in last)]

    convert._export_jobs = _export_jobs


MUTATIONS = {
    "expert_grad_scale": ("moetrain.distributed.data_parallel.finalize", _expert_grad_scale),
    "aux_loss_group": ("moetrain.models.moe.layer", _aux_loss_group),
    "grad_norm_replicated": ("moetrain.distributed.data_parallel.grads", _grad_norm_replicated),
    "bias_local_counts": ("moetrain.models.moe.layer", _bias_local_counts),
    "optimizer_old_layout": ("moetrain.train.checkpoint.state", _optimizer_old_layout),
    "export_skips_expert": ("moetrain.interop.hf.convert", _export_skips_expert),
}
"""Mutation name -> (the module it patches, the patch), applied right after that module runs."""


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs each listed module's patches right after the module's own code."""

    def __init__(self, patches: dict[str, list]) -> None:
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        patches = self.patches[name]

        def exec_module(module):
            run(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if VARIABLE in os.environ:
    _name = os.environ[VARIABLE]
    if _name and _name not in MUTATIONS:
        raise SystemExit(f"{VARIABLE} ({_name!r}) must be one of {', '.join(MUTATIONS)}")
    _patches: dict[str, list] = {}
    for _module, _patch in MUTATIONS.values():
        _patches.setdefault(_module, []).append(_patch)
    sys.meta_path.insert(0, _PatchAfterImport(_patches))
