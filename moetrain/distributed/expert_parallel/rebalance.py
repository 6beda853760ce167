"""Expert rebalancing during training (``parallel.expert_slots_per_rank``, ``moe.rebalance_every``):
replicas of hot experts in spare slots, planned from the experts' load, kept identical to their
home experts.

``Rebalancer`` swaps every MoE layer's all-to-all dispatcher for a ``ReplicatedDispatcher``
(``replicated.py``) and keeps the replicas right, at three points of a step:

    after the last backward      ``sum_replica_grads``: each replica's gradient, under the same
                                 data-parallel rule as its home's (scaled 1/dp, summed over edp),
                                 goes home over the ep group and is added to the home gradient,
                                 before clipping and the optimizer see it
    after the optimizer step     ``after_step``: every ``rebalance_every`` steps a new placement
                                 from the load since the last one (all-reduced over dp x tp, so
                                 every rank plans alike); then every replica fetches its home's
                                 weights (the step changed them)
    after a checkpoint load      ``refresh_replicas``

Why replicas follow their homes instead of stepping themselves: a home's gradient is then the
whole expert's gradient, the optimizer state (AdamW moments and step, LoRA adapters' state,
ZeRO-1 shards), the per-expert LR scale and the balancer stay where they are, checkpoints hold
the experts in logical order as without rebalancing, and a rebalance moves no optimizer state:
only which experts the spare slots fetch. The price is the replica traffic of every step: each
replica's weights out and its gradient back (``replica_bytes``), what an all-reduce between the
copies would move.

Rank 0 writes ``rebalance.jsonl`` in the run folder: per step the copies each rank of its ep group
received per layer after capacity drops (``rank_copies``), the replica bytes every rank moved
(weights out and gradients home, to other ranks), the seconds of ``after_step`` on rank 0 (plan
and weight refresh: ``after_step_s``), whether it re-planned (``rebalanced``) and then the new
placement (``replicas``, per layer, rank and spare slot).

Shape legend: E logical experts, L home experts per rank, R spare slots per rank, P ranks in the
ep group, X elements of one expert's flattened parameters.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config.job import JobConfig
from moetrain.distributed.data_parallel.finalize import grad_reduction
from moetrain.distributed.expert_parallel.dispatcher import AllToAllDispatcher
from moetrain.distributed.expert_parallel.placement import Placement, plan_placement
from moetrain.distributed.expert_parallel.replicated import ReplicatedDispatcher
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.models.moe.layer import MoELayer
from moetrain.utils.tensors import local_tensor


@dataclass(frozen=True)
class ReplicaRoutes:
    """This rank's part of the replica exchange of one placement (homes -> replicas; the
    gradients travel the reverse way)."""

    send_home_idx: list[int]
    """Local home expert of each row sent, grouped by destination rank."""
    send_splits: list[int]
    recv_bank_idx: list[int]
    """Bank slot of each row received, grouped by source (home) rank."""
    recv_splits: list[int]


def replica_routes(placement: Placement, *, rank: int) -> ReplicaRoutes:
    """Who sends which home expert to which replica slot (no communication; the same on every rank)."""
    P, L = placement.num_ranks, placement.num_local_experts
    send_idx, send_splits = [], []
    for dest in range(P):
        rows = [e % L for e in placement.replicas[dest] if e // L == rank]
        send_idx += rows
        send_splits.append(len(rows))
    recv_idx, recv_splits = [], []
    for src in range(P):
        slots = [r for r, e in enumerate(placement.replicas[rank]) if e // L == src]
        recv_idx += slots
        recv_splits.append(len(slots))
    return ReplicaRoutes(send_idx, send_splits, recv_idx, recv_splits)


class Rebalancer:
    """Replicas for every MoE layer of ``model`` (none when ``every`` is 0: then each call is a
    no-op). ``run_dir``: where rank 0 writes ``rebalance.jsonl`` (None: nowhere)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, *, slots_per_rank: int, every: int,
                 run_dir: Path | None = None) -> None:
        self.dims, self.every = dims, every
        self.layers: list[tuple[MoELayer, ReplicatedDispatcher]] = []
        if every > 0:
            for layer in model.modules():
                if isinstance(layer, MoELayer):
                    assert isinstance(layer.dispatcher, AllToAllDispatcher), "the config refuses other dispatchers"
                    new = ReplicatedDispatcher.replacing(layer.dispatcher, slots_per_rank=slots_per_rank)
                    new.attach(layer.experts)
                    layer.dispatcher = new
                    self.layers.append((layer, new))
        is_main = bool(self.layers) and dist.get_rank() == 0
        self.log_path = run_dir / "rebalance.jsonl" if run_dir is not None and is_main else None
        self.step_bytes = 0
        self.refresh_replicas()

    # ----- weights out, gradients home -------------------------------------------------------------

    def _routes(self, d: ReplicatedDispatcher) -> ReplicaRoutes:
        return replica_routes(d.placement, rank=d.ep_rank)

    @torch.no_grad()
    def refresh_replicas(self) -> None:
        """Every replica takes its home expert's current weights (and adapters). Collective over ep."""
        for layer, d in self.layers:
            routes = self._routes(d)
            names = list(d.bank)
            home = [local_tensor(getattr(layer.experts, n)).detach() for n in names]
            send_LX = _rows(home, routes.send_home_idx)
            recv_RX = self._exchange(d, send_LX, output_splits=routes.recv_splits, input_splits=routes.send_splits)
            for bank_slot, row in zip(routes.recv_bank_idx, _unflatten(recv_RX, [d.bank[n] for n in names]),
                                      strict=True):
                for n, value in zip(names, row, strict=True):
                    d.bank[n][bank_slot].copy_(value)

    @torch.no_grad()
    def sum_replica_grads(self) -> None:
        """Add every replica's gradient to its home's (after the data-parallel reduction of the
        homes, before clipping). Collective over edp and ep. Clears the bank's gradients."""
        if not self.layers:
            return
        rule = grad_reduction(self.dims, "edp")
        for layer, d in self.layers:
            routes = self._routes(d)
            names = [n for n, t in d.bank.items() if t.requires_grad]
            grads = [_grad_or_zeros(d.bank[n]) for n in names]
            rows_RX = _rows(grads, routes.recv_bank_idx).mul_(rule.scale)
            if rule.group is not None:
                dist.all_reduce(rows_RX, group=rule.group)
            home_LX = self._exchange(d, rows_RX, output_splits=routes.send_splits, input_splits=routes.recv_splits)
            targets = []
            for n in names:
                p = getattr(layer.experts, n)
                if p.grad is None:  # no token reached this rank's experts: the replicas' may still count
                    p.grad = torch.zeros_like(p)
                targets.append(local_tensor(p.grad))
            idx = torch.tensor(routes.send_home_idx, dtype=torch.long, device=home_LX.device)
            offset = 0
            for t in targets:
                width = math.prod(t.shape[1:])
                t.view(t.shape[0], -1).index_add_(0, idx, home_LX[:, offset:offset + width].to(t.dtype))
                offset += width
            for n in names:
                d.bank[n].grad = None

    def _exchange(self, d: ReplicatedDispatcher, x_MX: torch.Tensor, *, output_splits: list[int],
                  input_splits: list[int]) -> torch.Tensor:
        """All-to-all of whole-expert rows over ep, counted in ``step_bytes`` (rows to other ranks)."""
        recv = x_MX.new_empty(sum(output_splits), x_MX.shape[1])
        dist.all_to_all_single(recv, x_MX.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=d.ep_group)
        self.step_bytes += (sum(input_splits) - input_splits[d.ep_rank]) * x_MX.shape[1] * x_MX.element_size()
        return recv

    # ----- planning --------------------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        """Re-plan on every ``rebalance_every``-th step, then refresh the replicas (the step
        changed the homes), and log. Call after every optimizer step, taken or skipped."""
        if not self.layers:
            return
        start = time.perf_counter()
        replan = step % self.every == 0
        if replan:
            self._replan()
        self.refresh_replicas()
        self._log(step, replan, time.perf_counter() - start)

    def _replan(self) -> None:
        """A placement per layer from its global load since the last plan (one all-reduce)."""
        load_YE = torch.stack([d.load_E.to(torch.float64) for _, d in self.layers])  # on the device: nccl
        if self.dims.dp_tp > 1:
            dist.all_reduce(load_YE, group=self.dims.group("dp_tp"))
        for (_, d), load_E in zip(self.layers, load_YE.tolist(), strict=True):
            d.set_placement(plan_placement(load_E, num_ranks=d.ep_size, slots_per_rank=d.slots_per_rank))
            d.load_E = torch.zeros_like(d.load_E)

    def _log(self, step: int, replan: bool, seconds: float) -> None:
        """Gather this step's received copies per rank and layer (ep group) and the replica bytes
        of every rank, and write them on rank 0."""
        d0 = self.layers[0][1]
        mine = torch.tensor([d.recv_copies for _, d in self.layers] + [self.step_bytes], dtype=torch.int64,
                            device=d0.load_E.device)
        every = [torch.zeros_like(mine) for _ in range(d0.ep_size)]
        dist.all_gather(every, mine, group=d0.ep_group)
        for _, d in self.layers:
            d.recv_copies = 0
        self.step_bytes = 0
        if self.log_path is None:
            return
        rec: dict = {"step": step, "rank_copies": [[int(t[y]) for t in every] for y in range(len(self.layers))],
                     "replica_bytes": int(sum(int(t[-1]) for t in every)), "after_step_s": round(seconds, 6),
                     "rebalanced": replan}
        if replan:
            rec["replicas"] = [d.placement.replicas for _, d in self.layers]
        with self.log_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def rebalance_settings(cfg: JobConfig) -> dict:
    """``Rebalancer``'s keyword arguments from a job config."""
    return {"slots_per_rank": cfg.parallel.expert_slots_per_rank, "every": cfg.moe.rebalance_every}


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _rows(tensors: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
    """``[len(idx), X]``: the given experts' parameters flattened and concatenated, in fp32 or the
    tensors' common dtype."""
    if not tensors:
        return torch.zeros(len(idx), 0)
    index = torch.tensor(idx, dtype=torch.long, device=tensors[0].device)
    return torch.cat([t.index_select(0, index).reshape(len(idx), math.prod(t.shape[1:])) for t in tensors], dim=1)


def _unflatten(rows_MX: torch.Tensor, like: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each row of ``_rows`` back into one tensor per parameter, shaped as ``like[i][0]``."""
    out = []
    for row in rows_MX:
        parts, offset = [], 0
        for t in like:
            width = math.prod(t.shape[1:])
            parts.append(row[offset:offset + width].view(t.shape[1:]))
            offset += width
        out.append(parts)
    return out

