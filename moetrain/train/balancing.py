"""Load balancing that acts between steps, in optimizer hooks, and expert-health monitoring.

    optimizer = build_optimizer(model, ...)
    balancer = install_balancing(optimizer, model, dims)     # once, after building the optimizer
    ...                                                      # train as usual: forward/backward, step
    metrics.update(balancer.metrics())                       # at log steps, on every rank

``install_balancing`` registers an optimizer *pre-step* hook that runs once per optimizer step,
after every micro-batch's backward and before the update, and a *post-step* hook. The pre-step
hook reads each MoE layer's routed-token counts of the step (summed over micro-batches by the
layer, and over all data- and expert-parallel ranks by its ``balance_group`` all-reduce, so they
are identical on every rank and independent of gradient accumulation) and

1. moves the auxiliary-loss-free selection bias (``moe.router_bias_update_rate``), and keeps the
   counts as the next step's f_e of the global-batch balance loss (``moe.aux_loss_type``),
2. every ``moe.balance_interval`` steps, from the load of that interval: recomputes the dynamic
   capacity factor, the per-expert learning-rate scales, and checks for routing collapse (an
   alarm once one expert's share has stayed above ``moe.collapse_threshold`` for
   ``moe.collapse_consecutive_checks`` checks in a row, never in the first
   ``moe.collapse_warmup_steps`` steps),
3. keeps the expert-health window (load, drops, entropy, idle experts) for ``metrics()``.

The post-step hook applies the per-expert learning-rate scales (see :func:`scale_expert_updates`).

Nothing here is module-global: all state is in the returned ``Balancer`` and in the layers'
buffers. Every decision uses only all-reduced counts, so every rank decides the same.

Shape legend: L MoE layers, E experts.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moetrain.distributed.data_parallel.ddp import unwrap
from moetrain.distributed.data_parallel.zero1 import ZeroShardedOptimizer
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.models.moe.layer import MoELayer
from moetrain.train.health import expert_health_summary, token_fraction

log = logging.getLogger("moetrain")


def seed_capacity_factor(relative_load_E: torch.Tensor, *, base: float = 1.0, scale: float = 0.5,
                         shift: float = 1.0) -> float:
    """The dynamic capacity factor of a practitioner's blog post on PyTorch MoE
    training, ``base + scale * sigmoid(std(load) - shift)``.

    ``relative_load_E`` is each expert's load over the mean load (1.0 everywhere = balanced), so
    ``std`` (torch.std, unbiased, as the blog post writes it) is the coefficient of variation: a
    balanced layer gets 1.0 + 0.5 * sigmoid(-1) = 1.134, a very skewed one approaches 1.5.
    """
    std = relative_load_E.double().std().item() if relative_load_E.numel() > 1 else 0.0
    return base + scale / (1.0 + math.exp(-(std - shift)))


def expert_lr_scales(relative_load_E: torch.Tensor, *, max_scale: float) -> torch.Tensor:
    """Learning-rate scale per expert: ``min(max_scale, max(1, 1 / load))`` with load relative to
    the mean. Under-used experts (load < 1) learn faster, up to ``max_scale``; an expert that got
    nothing gets ``max_scale``; the others keep the base rate."""
    inv_E = torch.where(relative_load_E > 0, 1.0 / relative_load_E.clamp(min=1e-12),
                        torch.full_like(relative_load_E, math.inf))
    return inv_E.clamp(min=1.0, max=max_scale)


class Balancer:
    """State and hooks of :func:`install_balancing`. ``metrics()`` returns the expert-health
    window (a collective over the data-parallel group: call it on every rank)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, dims: ParallelDims | None = None, *,
                 capacity_fn: Callable[[torch.Tensor], float] | None = None) -> None:
        self.named_layers = [(name, m) for name, m in unwrap(model).named_modules() if isinstance(m, MoELayer)]
        self.layers = [m for _, m in self.named_layers]
        # The tp ranks of a dp index see different tokens at the MoE layers (sequence slices).
        self.dp_group = dims.group("dp_tp") if dims is not None and dims.dp_tp > 1 else None
        self.capacity_fn = capacity_fn
        num_layers = len(self.layers)
        num_experts = self.layers[0].config.num_experts if self.layers else 0
        device = self.layers[0].step_routed_E.device if self.layers else torch.device("cpu")
        # Window since the last metrics() (global counts; local stats reduced when read).
        self.window_routed_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.window_local_L4 = torch.zeros(num_layers, 4, dtype=torch.float64, device=device)
        self.window_steps = 0
        self.window_alarms_L = [0] * num_layers
        # Load since the last interval update, and consecutive idle steps per expert.
        self.interval_routed_LE = torch.zeros_like(self.window_routed_LE)
        self.idle_steps_LE = torch.zeros_like(self.window_routed_LE)
        self.steps = 0
        self.total_alarms = 0
        # Consecutive collapse checks above the threshold, per layer (the persistence rule).
        self.collapse_streak_L = [0] * num_layers
        # Per-expert learning rates: what the optimizer really steps (see _lr_targets), and the
        # copies taken before the step.
        self._stepped_owner = optimizer
        self._stepped = _stepped_optimizer(optimizer)
        self._targets: list[_LrTarget] | None = None
        self._snapshots: list[tuple[_LrTarget, torch.Tensor, torch.Tensor]] = []
        self._lr_scale_cache: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._collapse_on = []
        off = []
        for name, layer in self.named_layers:
            layer.track_routing_stats = layer.balancing_installed = True
            c = layer.config
            on = not c.is_expert_choice and c.collapse_threshold < 1.0
            if on and c.collapse_threshold <= c.top_k / c.num_experts:
                on = False
                off.append((name, c))
            self._collapse_on.append(on)
        if off:
            c = off[0][1]
            warnings.warn(f"moe.collapse_threshold ({c.collapse_threshold}) is not above top_k / num_experts "
                          f"({c.top_k} / {c.num_experts} = {c.top_k / c.num_experts:g}), the fraction of tokens "
                          f"every expert gets under perfectly balanced routing: the routing-collapse alarm is off "
                          f"for MoE layers {[name for name, _ in off]}", stacklevel=3)
        # On the optimizer that steps the tensors (ZeRO-1's inner one): its post-step hook runs
        # before ZeRO-1 copies offloaded slices back and all-gathers them.
        self.handles = [self._stepped.register_step_pre_hook(self._pre_step),
                        self._stepped.register_step_post_hook(self._post_step)]

    def remove(self) -> None:
        """Unregister the hooks and stop the layers' statistics."""
        for h in self.handles:
            h.remove()
        for layer in self.layers:
            layer.track_routing_stats = layer.balancing_installed = False

    def discard_step(self) -> None:
        """Forget the routing counts of the current step: call it when a step is skipped without
        ``optimizer.step()`` (non-finite loss or gradient), or its counts would be added to the
        next step's bias update."""
        for layer in self.layers:
            layer.step_routed_E.zero_()
            layer.step_local_stats.zero_()

    # ----- the hooks ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _pre_step(self, optimizer, args, kwargs) -> None:
        for i, layer in enumerate(self.layers):
            routed_E = layer.step_routed_E
            rate = layer.config.router_bias_update_rate
            if rate > 0:
                layer.router.update_bias(routed_E, rate)
            if layer.config.aux_loss_type == "global_batch":
                layer.prev_step_routed_E.copy_(routed_E)
            self.window_routed_LE[i] += routed_E
            self.window_local_L4[i] += layer.step_local_stats
            self.interval_routed_LE[i] += routed_E
            self.idle_steps_LE[i] = torch.where(routed_E == 0, self.idle_steps_LE[i] + 1, 0)
            routed_E.zero_()
            layer.step_local_stats.zero_()
        self.window_steps += 1
        self.steps += 1
        if self.layers and self.steps % self.layers[0].config.balance_interval == 0:
            self._interval_update()
        self._snapshot_expert_weights()

    @torch.no_grad()
    def _post_step(self, optimizer, args, kwargs) -> None:
        for target, before, scale in self._snapshots:
            scale_expert_updates(target.tensor, before, scale)
        self._snapshots = []

    # ----- every balance_interval steps ------------------------------------------------------------

    def _interval_update(self) -> None:
        counts_LE = self.interval_routed_LE.double().cpu()  # host sync, once per interval
        self.interval_routed_LE.zero_()
        first = self.steps - self.layers[0].config.balance_interval + 1
        for i, (name, layer) in enumerate(self.named_layers):
            c = layer.config
            counts_E = counts_LE[i]
            if c.is_expert_choice or counts_E.sum() == 0:
                continue
            relative_E = counts_E / counts_E.mean()
            if c.dynamic_capacity:
                if self.capacity_fn is not None:
                    factor = float(self.capacity_fn(relative_E))
                else:
                    factor = seed_capacity_factor(relative_E, base=c.dynamic_capacity_base,
                                                  scale=c.dynamic_capacity_scale, shift=c.dynamic_capacity_shift)
                layer.capacity_factor_now.fill_(factor)
            if c.expert_lr_scale_max > 1:
                layer.expert_lr_scale.copy_(expert_lr_scales(relative_E, max_scale=c.expert_lr_scale_max))
            if self._collapse_on[i]:
                self._check_collapse(i, name, layer, counts_E, first)

    def _check_collapse(self, i: int, name: str, layer: MoELayer, counts_E: torch.Tensor, first: int) -> None:
        """Alarm when the layer's most chosen expert took more than ``collapse_threshold`` of the
        tokens at ``collapse_consecutive_checks`` checks in a row (the expert may change between
        them), except during the first ``collapse_warmup_steps`` steps: a freshly initialised
        router is often that skewed for a few steps, before the balancing has acted. The streak
        counts during the warm-up too, so a collapse that persists since initialisation is
        reported at the first check after it."""
        c = layer.config
        tokens = counts_E.sum() / c.top_k  # every token routes exactly K copies (before drops)
        frac_E = token_fraction(counts_E.unsqueeze(0), tokens.view(1))[0]
        top = int(frac_E.argmax())
        if frac_E[top] <= c.collapse_threshold:
            self.collapse_streak_L[i] = 0
            return
        self.collapse_streak_L[i] += 1
        streak = self.collapse_streak_L[i]
        if self.steps <= c.collapse_warmup_steps or streak < c.collapse_consecutive_checks:
            return
        self.window_alarms_L[i] += 1
        self.total_alarms += 1
        action = ""
        if c.collapse_aux_increase > 0:
            old = layer.aux_loss_coef
            new = max(old, min(c.collapse_aux_max, old + c.collapse_aux_increase))
            layer.aux_loss_coef_now.fill_(new)
            action = f"; aux_loss_coef of this layer {old:g} -> {new:g}"
        if streak > 1:
            action = f"; above it at {streak} checks in a row{action}"
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("ROUTING COLLAPSE in MoE layer %d (%s): expert %d was chosen by %.1f%% of the tokens in "
                        "steps %d-%d (alarm above %.0f%%; balanced would be %.1f%%)%s", i, name, top,
                        100 * float(frac_E[top]), first, self.steps, 100 * c.collapse_threshold,
                        100 * c.top_k / c.num_experts, action)

    # ----- per-expert learning rates ---------------------------------------------------------------

    def _host_lr_scale(self, i: int, layer: MoELayer) -> torch.Tensor:
        buf = layer.expert_lr_scale
        cached = self._lr_scale_cache.get(i)
        if cached is None or cached[0] is not buf or cached[1] != buf._version:
            cached = (buf, buf._version, buf.detach().cpu())  # host sync only after a change
            self._lr_scale_cache[i] = cached
        return cached[2]

    def _lr_targets(self) -> list[_LrTarget]:
        """The tensors the optimizer steps that hold expert weights of a layer with per-expert
        learning rates, with the global expert of each row (or element)."""
        layer_of = {}
        for i, layer in enumerate(self.layers):
            if layer.config.expert_lr_scale_max > 1:
                for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
                    if w is not None and w.requires_grad:
                        layer_of[id(w)] = i
        targets = []
        if isinstance(self._stepped_owner, ZeroShardedOptimizer):
            shards = self._stepped_owner.shards
            # ZeRO-1: the inner optimizer steps element ranges [lo, hi) of each flattened local
            # parameter (or host copies of them); element j of the local tensor is expert
            # first + j // (elements per expert).
            for shard in shards:
                if id(shard.param) not in layer_of:
                    continue
                local, first, rows = _local_expert_rows(shard.param)
                per_expert = local.numel() // rows
                expert_N = first + torch.arange(shard.lo, shard.hi, device=shard.master.device) // per_expert
                targets.append(_LrTarget(layer_of[id(shard.param)], shard.master, expert_N, (-1,)))
            return targets
        for i, layer in enumerate(self.layers):
            for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
                if w is not None and id(w) in layer_of:
                    local, first, rows = _local_expert_rows(w)
                    expert_R = torch.arange(first, first + rows, device=local.device)
                    targets.append(_LrTarget(i, local, expert_R, (-1,) + (1,) * (local.dim() - 1)))
        return targets

    def _snapshot_expert_weights(self) -> None:
        self._snapshots = []
        if not any(layer.config.expert_lr_scale_max > 1 for layer in self.layers):
            return
        if self._targets is None:
            self._targets = self._lr_targets()
        for target in self._targets:
            scale_E = self._host_lr_scale(target.layer, self.layers[target.layer])
            if bool((scale_E == 1).all()):
                continue
            scale = scale_E.to(target.expert.device)[target.expert].view(target.shape)
            self._snapshots.append((target, target.tensor.detach().clone(), scale))

    # ----- checkpoint state ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The counters as plain Python values, for the trainer's checkpoint state. A collective
        over the data-parallel group: the window's local statistics are summed over it here (that
        sum is what ``metrics()`` reports). Everything else is the same on every rank (routed
        counts are global)."""
        local_L4 = self.window_local_L4.clone()
        if self.dp_group is not None:
            dist.all_reduce(local_L4, group=self.dp_group)
        state = {"num_layers": len(self.layers), "num_experts": int(self.interval_routed_LE.shape[1]),
                 "steps": self.steps, "interval_routed": self.interval_routed_LE.tolist(),
                 "idle_steps": self.idle_steps_LE.tolist(), "total_alarms": self.total_alarms,
                 "window_steps": self.window_steps, "window_routed": self.window_routed_LE.tolist(),
                 "window_local": local_L4.tolist(), "window_alarms": list(self.window_alarms_L),
                 "collapse_streak": list(self.collapse_streak_L)}
        if any(layer.config.aux_loss_type == "global_batch" for layer in self.layers):
            state["prev_step_routed"] = [_prev_step_routed(layer) for layer in self.layers]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s counters: the next interval update comes at the step it
        would have come without the stop, from the same load. The window's local statistics go to
        the first rank of the data-parallel group (``metrics()`` sums them over the group)."""
        shape = (len(self.layers), int(self.interval_routed_LE.shape[1]))
        saved = (state.get("num_layers"), state.get("num_experts"))
        if saved != shape:
            raise ValueError(f"balancer state (num_layers, num_experts) {saved} does not match this model's "
                             f"MoE layers {shape}")
        dev = self.interval_routed_LE.device
        self.steps = int(state["steps"])
        self.interval_routed_LE.copy_(torch.tensor(state["interval_routed"], dtype=torch.int64, device=dev))
        self.idle_steps_LE.copy_(torch.tensor(state["idle_steps"], dtype=torch.int64, device=dev))
        self.total_alarms = int(state["total_alarms"])
        self.window_steps = int(state["window_steps"])
        self.window_routed_LE.copy_(torch.tensor(state["window_routed"], dtype=torch.int64, device=dev))
        self.window_alarms_L = [int(a) for a in state["window_alarms"]]
        # Checkpoints written before the persistence rule existed carry no streak: it restarts.
        self.collapse_streak_L = [int(n) for n in state.get("collapse_streak", [0] * len(self.layers))]
        # The global-batch balance loss's counts (layers with another aux_loss_type hold none;
        # checkpoints without them restart from uniform f_e for one step).
        for layer, routed in zip(self.layers, state.get("prev_step_routed", [None] * len(self.layers)), strict=True):
            if routed is not None and layer.config.aux_loss_type == "global_batch":
                layer.prev_step_routed_E.copy_(torch.tensor(routed, dtype=torch.int64))
        first_of_group = self.dp_group is None or dist.get_rank(self.dp_group) == 0
        local_L4 = torch.tensor(state["window_local"], dtype=torch.float64, device=dev)
        self.window_local_L4.copy_(local_L4 if first_of_group else torch.zeros_like(local_L4))

    # ----- metrics ---------------------------------------------------------------------------------

    def metrics(self) -> dict:
        """Expert health since the last call (then reset). A collective when data-parallel."""
        if not self.layers or self.window_steps == 0:
            return {}
        local_L4 = self.window_local_L4.clone()
        if self.dp_group is not None:
            dist.all_reduce(local_L4, group=self.dp_group)
        local_L4 = local_L4.cpu()  # host sync: once per log step
        c = self.layers[0].config
        m = expert_health_summary(self.window_routed_LE.cpu(), dropped_L=local_L4[:, 0], routed_L=local_L4[:, 1],
                                  entropy_sum_L=local_L4[:, 2], tokens_L=local_L4[:, 3],
                                  idle_steps_LE=self.idle_steps_LE.cpu(), unused_after=c.unused_expert_steps)
        m["routing_collapse_alarms"] = list(self.window_alarms_L)
        if c.dynamic_capacity:
            m["capacity_factor"] = [round(layer.dynamic_capacity_factor, 5) for layer in self.layers]
        if c.router_bias_update_rate > 0:
            m["expert_bias"] = [[round(v, 5) for v in _expert_bias(layer).tolist()] for layer in self.layers]
        if c.expert_lr_scale_max > 1:
            m["expert_lr_scale"] = [[round(v, 4) for v in layer.expert_lr_scale.tolist()] for layer in self.layers]
        if c.collapse_aux_increase > 0:
            m["aux_loss_coef"] = [layer.aux_loss_coef for layer in self.layers]
        self.window_routed_LE.zero_()
        self.window_local_L4.zero_()
        self.window_steps = 0
        self.window_alarms_L = [0] * len(self.layers)
        return m


def install_balancing(optimizer: torch.optim.Optimizer, model: nn.Module, dims: ParallelDims | None = None, *,
                      capacity_fn: Callable[[torch.Tensor], float] | None = None) -> Balancer:
    """Attach the between-step balancing and the expert-health monitor to ``optimizer`` for every
    ``MoELayer`` of ``model`` (plain, or wrapped by ``parallelize``). Call it once, after
    ``parallelize`` and after building the optimizer, on every rank. ``dims`` (``ParallelDims``)
    is needed under data parallelism, for ``metrics()``. ``capacity_fn(relative_load_E) -> factor``
    replaces the configured dynamic-capacity formula."""
    return Balancer(optimizer, model, dims, capacity_fn=capacity_fn)


def scale_expert_updates(stepped: torch.Tensor, before: torch.Tensor, scale: torch.Tensor) -> None:
    """``w = before + scale_e * (w - before)`` for the entries of each expert e (``scale`` holds
    scale_e per entry, broadcastable to ``stepped``): the optimizer's update of expert e
    multiplied by ``scale_e``.

    For AdamW (and SGD) this is exactly a learning rate of ``scale_e * lr`` for expert e: the
    step is ``-lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)``, linear in lr, and the moments do not
    depend on lr. Scaling the gradient instead would do nothing for Adam, which divides it by its
    own running magnitude.
    """
    # Adds (scale - 1) * update: entries with scale 1 get exactly +0, so they stay bit-identical.
    stepped.add_((stepped - before).mul_(scale.to(stepped.dtype) - 1))


def _local_expert_rows(w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """This rank's storage of a stacked ``[E, ...]`` expert weight, the global id of its first
    expert, and how many experts it holds. Works for any DTensor layout (expert parallelism's
    Shard(0) over ep, FSDP2/ZeRO-3's Shard(0) over more axes, a shard of another dim)."""
    if isinstance(w, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
        return w.to_local(), offset[0], local_shape[0]
    return w, 0, w.shape[0]


@dataclass
class _LrTarget:
    layer: int
    """Index of the MoE layer (its expert_lr_scale buffer)."""
    tensor: torch.Tensor
    """What the optimizer steps: a local expert weight, or ZeRO-1's 1-D slice of one."""
    expert: torch.Tensor
    """Global expert id of each row (or, for a slice, each element) of ``tensor``."""
    shape: tuple[int, ...]
    """View that broadcasts a per-row/element scale over ``tensor``."""


def _stepped_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose step updates the tensors: ZeRO-1's inner optimizer (which steps this
    rank's slices, host copies when offloading), else ``optimizer`` itself."""
    return optimizer.inner if isinstance(optimizer, ZeroShardedOptimizer) else optimizer


def _prev_step_routed(layer: MoELayer) -> list[int] | None:
    """The counts behind the layer's global-batch f_e, None for another aux_loss_type."""
    return layer.prev_step_routed_E.tolist() if layer.config.aux_loss_type == "global_batch" else None


def _expert_bias(layer: MoELayer) -> torch.Tensor:
    bias_E = layer.router.expert_bias
    assert bias_E is not None, "moe.router_bias_update_rate > 0 gives every router an expert_bias"
    return bias_E
