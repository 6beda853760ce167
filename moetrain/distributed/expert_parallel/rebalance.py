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
                                 every rank plans alike); then every replica starts fetching its
                                 home's weights (the step changed them), which travel while the
                                 next step loads its batch and runs up to the first MoE layer's
                                 experts (``wait_refresh``, called by the dispatcher)
    after a checkpoint load      ``load_state_dict``: the saved placements and load since the last
                                 plan (``state_dict``, in the checkpoint's trainer state), then
                                 ``refresh_replicas``

Each of these moves every layer's rows in one collective (``_exchange_layers``): one all-to-all
for the weights, one all-reduce over edp and one all-to-all for the gradients per step, however
many MoE layers there are.

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
and starting the weight refresh: ``after_step_s``), whether it re-planned (``rebalanced``) and then
the new placement (``replicas``, per layer, rank and spare slot). The records are gathered over ep
on re-planning steps and by ``finish`` at the end of training, not every step: one all-gather per
plan. A run resumed in the same folder keeps the records up to its checkpoint's step.

With frozen experts (LoRA elsewhere) no gradient goes home and the weights travel only after a
re-plan; ``around`` makes the replicas follow a temporary swap of the homes' weights (the weight
average for evaluation).

Shape legend: E logical experts, L home experts per rank, R spare slots per rank, P ranks in the
ep group, X elements of one expert's flattened parameters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
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
from moetrain.utils.files import jsonl_records_until
from moetrain.utils.tensors import local_tensor

log = logging.getLogger("moetrain")


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
    no-op). ``run_dir``: where rank 0 writes ``rebalance.jsonl`` (None: nowhere); its first write
    keeps only the records up to the step the run started from (``load_state_dict``)."""

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
        self._keep_until: int | None = 0  # None once rebalance.jsonl has been started
        # Frozen experts (LoRA elsewhere): no replica gradients to send home, and the weights change
        # only where a re-plan moves a replica.
        self.frozen = not any(t.requires_grad for _, d in self.layers for t in d.bank.values())
        self.step_bytes = 0
        # References, not copies: a forward replaces load_E (load + counts) and never updates it in place.
        self._load_at_step_start = [d.load_E for _, d in self.layers]
        self._replan_due = False
        self._pending: list[_StepRecord] = []
        self._landing: Callable[[], None] | None = None
        for _, d in self.layers:
            d.bank_ready = self.wait_refresh
        self.refresh_replicas()

    # ----- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Every layer's placement (JSON, the same on every rank), its load since the last plan
        summed over dp x tp (``load``, one list per layer) and whether a re-plan waits for a step
        taken (``replan_due``): a resume between re-plans plans as the run that never stopped.
        Collective over dp x tp (one all-reduce of L x E numbers)."""
        if not self.layers:
            return {"placements": []}
        return {"placements": [d.placement.to_json() for _, d in self.layers],
                "load": self._global_load().to(torch.int64).tolist(), "replan_due": self._replan_due}

    def load_state_dict(self, state: dict | None, *, step: int) -> None:
        """A resumed run's placements (a checkpoint's ``state_dict``), where they fit these layers,
        ranks and slots, with the load since the last plan and a re-plan due; else the home layout
        and a fresh load history until the first re-plan (the next plan sees the load from here).
        The replicas then take the loaded homes' weights, and rebalance.jsonl keeps the records up
        to ``step``. Collective over ep."""
        self._keep_until = step
        saved = (state or {}).get("placements") or []
        if not self.layers:
            return
        placements = [Placement.from_json(p) for p in saved]
        if [(p.num_ranks, p.slots_per_rank, p.num_experts) for p in placements] == \
                [(d.ep_size, d.slots_per_rank, d.num_logical) for _, d in self.layers]:
            for p, (_, d) in zip(placements, self.layers, strict=True):
                d.set_placement(p)
            self._load_history(state or {})
        elif saved:
            log.info("the checkpoint's expert placement is for another layout: replicas start from the home "
                     "layout and follow the first re-plan, planned from the load since this resume")
        self.refresh_replicas()

    def _load_history(self, state: dict) -> None:
        """The saved load since the last plan (global: on the first rank of dp x tp, zeros on the
        others, so the next plan's all-reduce sums it in once) and a re-plan due. A checkpoint
        saved without them leaves a fresh history."""
        if "load" not in state:
            return
        first = self.dims.dp_tp == 1 or dist.get_rank(self.dims.group("dp_tp")) == 0
        for (_, d), load_E in zip(self.layers, state["load"], strict=True):
            saved_E = torch.tensor(load_E, dtype=torch.int64, device=_device(d))
            d.load_E = saved_E if first else torch.zeros_like(saved_E)
        self._load_at_step_start = [d.load_E for _, d in self.layers]
        self._replan_due = bool(state.get("replan_due", False))

    def _global_load(self) -> torch.Tensor:
        """``[layers, E]`` float64: every layer's load since the last plan summed over dp x tp
        (integers: exact in float64, in any order of summation). Collective over dp x tp."""
        load_YE = torch.stack([d.load_E.to(_device(d), torch.float64) for _, d in self.layers])  # nccl: on the device
        if self.dims.dp_tp > 1:
            dist.all_reduce(load_YE, group=self.dims.group("dp_tp"))
        return load_YE

    # ----- weights out, gradients home -------------------------------------------------------------

    def _routes(self, d: ReplicatedDispatcher) -> ReplicaRoutes:
        return replica_routes(d.placement, rank=d.ep_rank)

    @torch.no_grad()
    def refresh_replicas(self, *, async_op: bool = False) -> None:
        """Every replica takes its home expert's current weights (and adapters): one all-to-all over
        ep for every layer. With ``async_op`` it travels while the next step starts; the first
        forward through a replica bank (or any later call here) waits for it (``wait_refresh``)."""
        self.wait_refresh()
        if not self.layers:
            return
        blocks, all_routes = [], []
        for layer, d in self.layers:
            routes = self._routes(d)
            blocks.append(_rows([local_tensor(getattr(layer.experts, n)).detach() for n in d.bank],
                                routes.send_home_idx, device=_device(d)))
            all_routes.append(routes)
        d0 = self.layers[0][1]
        unpack, sent = _exchange_layers(blocks, [r.send_splits for r in all_routes],
                                        [r.recv_splits for r in all_routes], group=d0.ep_group, rank=d0.ep_rank,
                                        async_op=async_op)
        self.step_bytes += sent

        def land() -> None:
            for (_, d), routes, recv_RX in zip(self.layers, all_routes, unpack(), strict=True):
                names = list(d.bank)
                for bank_slot, row in zip(routes.recv_bank_idx, _unflatten(recv_RX, [d.bank[n] for n in names]),
                                          strict=True):
                    for n, value in zip(names, row, strict=True):
                        d.bank[n][bank_slot].copy_(value)

        self._landing = land
        if not async_op:
            self.wait_refresh()

    @contextlib.contextmanager
    def around(self, swap: AbstractContextManager) -> Iterator[None]:
        """``swap`` (the home experts' weights replaced for a block, as the weight average does for
        evaluation) with the replicas following the homes in and back out: a refresh on entry and
        on exit. Collective over ep."""
        with swap:
            self.refresh_replicas()
            yield
        self.refresh_replicas()

    @torch.no_grad()
    def wait_refresh(self) -> None:
        """Wait for a refresh in flight and write it into the replica banks (no-op if none)."""
        land, self._landing = self._landing, None
        if land is not None:
            land()

    @torch.no_grad()
    def sum_replica_grads(self) -> None:
        """Add every replica's gradient to its home's (after the data-parallel reduction of the
        homes, before clipping): one all-reduce over edp and one all-to-all over ep for every
        layer. Clears the bank's gradients."""
        if not self.layers or self.frozen:
            return
        self.wait_refresh()
        rule = grad_reduction(self.dims, "edp")
        blocks, all_routes, all_names = [], [], []
        for _, d in self.layers:
            routes = self._routes(d)
            names = [n for n, t in d.bank.items() if t.requires_grad]
            blocks.append(_rows([_grad_or_zeros(d.bank[n]) for n in names], routes.recv_bank_idx,
                                device=_device(d)).mul_(rule.scale))
            all_routes.append(routes)
            all_names.append(names)
        if rule.group is not None:
            flat = torch.cat([b.reshape(-1) for b in blocks])
            dist.all_reduce(flat, group=rule.group)
            blocks = [part.view_as(b) for part, b in zip(flat.split([b.numel() for b in blocks]), blocks, strict=True)]
        d0 = self.layers[0][1]
        unpack, sent = _exchange_layers(blocks, [r.recv_splits for r in all_routes],
                                        [r.send_splits for r in all_routes], group=d0.ep_group, rank=d0.ep_rank,
                                        async_op=False)
        self.step_bytes += sent
        for (layer, d), routes, names, home_LX in zip(self.layers, all_routes, all_names, unpack(), strict=True):
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

    # ----- planning --------------------------------------------------------------------------------

    def after_step(self, step: int, *, taken: bool = True) -> None:
        """Re-plan on every ``rebalance_every``-th step, then start refreshing the replicas (the
        step changed the homes), and log. Call after every optimizer step, taken or skipped.
        A skipped step (``taken`` False: a non-finite loss or gradient) leaves no routed load in
        the history, as it moves no router bias; a re-plan due on it waits for the next step taken."""
        if not self.layers:
            return
        start = time.perf_counter()
        due = step % self.every == 0 or self._replan_due
        replan, self._replan_due = due and taken, due and not taken
        if not taken:
            for (_, d), load_E in zip(self.layers, self._load_at_step_start, strict=True):
                d.load_E = load_E
        if replan:
            self._replan()
        if replan or not self.frozen:
            self.refresh_replicas(async_op=True)
        self._pending.append(_StepRecord(step, replan, [d.recv_copies for _, d in self.layers], self.step_bytes,
                                         time.perf_counter() - start))
        for _, d in self.layers:
            d.recv_copies = 0
        self._load_at_step_start = [d.load_E for _, d in self.layers]
        self.step_bytes = 0
        if replan:
            self.flush()

    def _replan(self) -> None:
        """A placement per layer from its global load since the last plan (one all-reduce)."""
        for (_, d), load_E in zip(self.layers, self._global_load().tolist(), strict=True):
            d.set_placement(plan_placement(load_E, num_ranks=d.ep_size, slots_per_rank=d.slots_per_rank))
            d.load_E = torch.zeros_like(d.load_E)

    def finish(self) -> None:
        """End of training: the refresh in flight lands and the last steps' records are written."""
        self.wait_refresh()
        self.flush()

    def flush(self) -> None:
        """Gather the steps since the last flush (each rank's received copies per layer and replica
        bytes; one all-gather over ep, on re-planning steps and at the end of training) and write
        them on rank 0. Collective over ep."""
        if not self._pending:
            return
        d0 = self.layers[0][1]
        mine = torch.tensor([[*r.copies, r.replica_bytes] for r in self._pending], dtype=torch.int64,
                            device=d0.load_E.device)
        every = [torch.zeros_like(mine) for _ in range(d0.ep_size)]
        dist.all_gather(every, mine, group=d0.ep_group)
        pending, self._pending = self._pending, []
        if self.log_path is None:
            return
        if self._keep_until is not None:  # the first write: what a resumed run keeps, or nothing
            self.log_path.write_text("".join(jsonl_records_until(self.log_path, self._keep_until)))
            self._keep_until = None
        with self.log_path.open("a") as f:
            for i, r in enumerate(pending):
                rec: dict = {"step": r.step, "rank_copies": [[int(t[i, y]) for t in every]
                                                             for y in range(len(self.layers))],
                             "replica_bytes": int(sum(int(t[i, -1]) for t in every)),
                             "after_step_s": round(r.seconds, 6), "rebalanced": r.replanned}
                if r.replanned and i == len(pending) - 1:
                    rec["replicas"] = [d.placement.replicas for _, d in self.layers]
                f.write(json.dumps(rec) + "\n")


@dataclass(frozen=True)
class _StepRecord:
    """What ``after_step`` saw on this rank, kept until the next ``flush``."""

    step: int
    replanned: bool
    copies: list[int]
    replica_bytes: int
    seconds: float


def rebalance_settings(cfg: JobConfig) -> dict:
    """``Rebalancer``'s keyword arguments from a job config."""
    return {"slots_per_rank": cfg.parallel.expert_slots_per_rank, "every": cfg.moe.rebalance_every}


def _device(d: ReplicatedDispatcher) -> torch.device:
    """Where a layer's replica bank, and so its exchanges, live."""
    return next(iter(d.bank.values())).device


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _rows(tensors: list[torch.Tensor], idx: list[int], *, device: torch.device) -> torch.Tensor:
    """``[len(idx), X]``: the given experts' parameters flattened and concatenated, in fp32 or the
    tensors' common dtype (on ``device``, where the exchange runs, also when there are none)."""
    if not tensors:
        return torch.zeros(len(idx), 0, device=device)
    index = torch.tensor(idx, dtype=torch.long, device=device)
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



def _exchange_layers(blocks: list[torch.Tensor], send_splits: list[list[int]], recv_splits: list[list[int]], *,
                     group: dist.ProcessGroup | None, rank: int,
                     async_op: bool) -> tuple[Callable[[], list[torch.Tensor]], int]:
    """One all-to-all over ``group`` for the rows of every layer: ``blocks[y]`` is layer y's
    ``[M_y, X_y]`` rows grouped by destination rank (``send_splits[y]``), received grouped by
    source (``recv_splits[y]``). Returns (a function that waits and gives each layer's received
    ``[R_y, X_y]`` rows, as an all-to-all per layer would, and the bytes sent to other ranks).
    One call instead of one per layer: on gloo each costs milliseconds of latency, on NCCL a launch."""
    num_ranks, widths = len(send_splits[0]), [b.shape[1] for b in blocks]
    pieces = [b.split(s) for b, s in zip(blocks, send_splits, strict=True)]
    send = torch.cat([pieces[y][p].reshape(-1) for p in range(num_ranks) for y in range(len(blocks))])
    in_splits = [sum(s[p] * w for s, w in zip(send_splits, widths, strict=True)) for p in range(num_ranks)]
    out_splits = [sum(s[p] * w for s, w in zip(recv_splits, widths, strict=True)) for p in range(num_ranks)]
    recv = send.new_empty(sum(out_splits))
    work = dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=async_op)

    def unpack() -> list[torch.Tensor]:
        if work is not None:
            work.wait()
        rows: list[list[torch.Tensor]] = [[] for _ in blocks]
        for p, chunk in enumerate(recv.split(out_splits)):
            for y, part in enumerate(chunk.split([s[p] * w for s, w in zip(recv_splits, widths, strict=True)])):
                rows[y].append(part.view(recv_splits[y][p], widths[y]))
        return [torch.cat(r) for r in rows]

    return unpack, (sum(in_splits) - in_splits[rank]) * send.element_size()
