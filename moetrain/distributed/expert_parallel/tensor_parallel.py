"""Expert tensor parallelism (``parallel.etp``): every routed expert's hidden dim split over a group
of ``etp`` consecutive ranks, Megatron-Core's ETP on the folded MoE layout.

An expert ``y = act(x w1 [* x w3]) w2`` splits exactly along its hidden dim F: rank j of the etp
group holds ``w1[:, :, Fj]``, ``w3[:, :, Fj]`` and ``w2[:, Fj, :]`` and computes the partial output
``act(x w1j [* x w3j]) w2j``; the sum over j is the whole output. So the group computes on the
same tokens, all of its ranks' (parallel folding gives each rank of a stage its own tokens):

    route locally                 each rank its T tokens (routing counts and aux losses local, as
                                  without etp: no token is counted twice)
    all-gather over etp           tokens, chosen experts and gate weights: [etp * T, ...]
    dispatch / experts / combine  the inner dispatcher (local at ep = 1, all-to-all over the ep
                                  group of this etp index), each rank with its F/etp slice
    reduce-scatter over etp       the partial outputs summed, each rank keeping its own T tokens

Autograd runs the mirror image: the reduce-scatter's backward all-gathers the output gradient
(every slice needs all of it), the all-gather's backward reduce-scatters the input and gate
gradients (each rank's tokens feed every slice). Expert weights are DTensors on the (ep, etp)
mesh, ``[Shard(0), Shard(F dim)]``: each rank's gradient is its slice's whole gradient (it saw
every token of the group), reduced over the edp copies only, and checkpoints reshard across etp.

Per rank: expert weights and their states / etp; expert FLOPs unchanged (etp times the tokens, 1/etp
of the hidden dim); all-to-all bytes etp times those of etp = 1 for the same local tokens, plus
the all-gather and reduce-scatter of ``[T, D]`` over the etp group (keep it inside a node).

Dropless only: with a capacity factor each rank of the group would decide drops over the gathered
batch, counted etp times over the stage (refused by name in the config). The ``token_idx_M`` and
``num_token_rank_sends`` returned refer to the gathered rows. The gather and reduce-scatter bytes
are counted apart (``CommStats.etp_bytes``) and timed apart (``log.comm_timing``: "etp_gather",
"etp_scatter" and their backward; the inner dispatcher's exchanges keep their own kinds).

Shape legend: T local tokens, G = etp * T gathered tokens, D model dim, K experts per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moetrain.distributed.comm.stats import CommStats, CountedExchanges, row_bytes
from moetrain.distributed.comm.timer import CommTimer, timed_exchange, waited
from moetrain.distributed.parallel_dims import ParallelDims
from moetrain.models.moe.dispatcher import (
    Dispatcher,
    DispatchResult,
    ExpertsFn,
    RoutedOutput,
    count_per_expert,
)
from moetrain.models.moe.experts import GroupedExperts

HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}
"""The hidden (F) dim of each stacked expert weight: w1/w3 ``[E, D, F]``, w2 ``[E, F, D]``."""


class ExpertTensorParallelDispatcher(CountedExchanges):
    """A ``Dispatcher`` whose experts hold 1/etp of the hidden dim: gathers the etp group's routed
    tokens around ``inner`` (the dispatcher of this etp index's ep group). See the module docstring."""

    def __init__(self, inner: Dispatcher[Any], *, num_experts: int, group: dist.ProcessGroup, size: int,
                 equal_counts: bool = False) -> None:
        self.inner, self.num_experts, self.group, self.size = inner, num_experts, group, size
        self.equal_counts = equal_counts
        """Every rank of the group routes the same token count (a language model's B * S / tp):
        no count exchange and host sync per layer. False: counts exchanged (a classifier's real
        tokens differ per rank)."""
        self.stats = CommStats()
        """The bytes of the etp gathers and reduce-scatters (``etp_bytes``)."""
        self.timer = CommTimer()
        """Off unless ``log.comm_timing`` (``expert_parallel.enable_comm_timing``)."""

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return timed_exchange(lambda x: funcol.all_gather_single_autograd(x, gather_dim=0, group=self.group),
                              t.contiguous(), self.timer, kind="etp_gather")

    def _gather_routing(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor,
                        capacity_factor: float | Fraction | None) -> _GatheredRouting:
        """The group's tokens, chosen experts and gate weights, rank by rank, and the ``GatheredRows``
        that take the combined output back. The ranks may hold different token counts (a
        classifier's real tokens): each pads to the largest, and the padding rows are dropped after
        the gather."""
        if capacity_factor is not None:
            raise ValueError(f"moe.capacity_factor ({capacity_factor}) must be null with parallel.etp ({self.size}) "
                             "> 1: expert tensor parallelism is dropless")
        T = x_TD.shape[0]
        if self.equal_counts:
            counts = [T] * self.size
        else:
            with self.timer.span("etp_gather"):
                counts_G = funcol.all_gather_single(torch.tensor([T], device=x_TD.device), gather_dim=0,
                                                    group=self.group)
                counts = counts_G.tolist()  # host sync: the counts size the gathered rows
        rows = GatheredRows(T, max(counts), None)
        chunk = rows.padded * (row_bytes(x_TD) + row_bytes(idx_TK) + row_bytes(weights_TK))
        counts_bytes = 0 if self.equal_counts else 8
        self.stats.count_group_collective(chunk_bytes=chunk + counts_bytes, group_size=self.size)
        if min(counts) != rows.padded:
            pad = rows.padded - T
            x_TD, idx_TK, weights_TK = (F.pad(t, (0, 0, 0, pad)) for t in (x_TD, idx_TK, weights_TK))
            rows.kept = torch.cat([torch.arange(r * rows.padded, r * rows.padded + n, device=x_TD.device)
                                   for r, n in enumerate(counts)])
        x_GD, weights_GK = self._gather(x_TD), self._gather(weights_TK)
        with self.timer.span("etp_gather"):
            idx_GK = waited(funcol.all_gather_single(idx_TK.contiguous(), gather_dim=0, group=self.group))
        if rows.kept is not None:
            x_GD, idx_GK, weights_GK = (t.index_select(0, rows.kept) for t in (x_GD, idx_GK, weights_GK))
        return _GatheredRouting(x_GD, idx_GK, weights_GK, rows)

    def _scatter(self, out_GD: torch.Tensor, rows: GatheredRows) -> torch.Tensor:
        """The partial outputs summed over the group; this rank's own tokens."""
        if rows.kept is not None:
            out_GD = out_GD.new_zeros(self.size * rows.padded, out_GD.shape[1]).index_copy(0, rows.kept, out_GD)
        self.stats.count_group_collective(chunk_bytes=rows.padded * row_bytes(out_GD), group_size=self.size)
        out_TD = timed_exchange(lambda x: funcol.wait_tensor(funcol.reduce_scatter_single_autograd(
            x, "sum", scatter_dim=0, group=self.group)), out_GD.contiguous(), self.timer, kind="etp_scatter")
        return out_TD[:rows.num_local]

    def _own_counts(self, idx_TK: torch.Tensor) -> torch.Tensor:
        # This rank's own copies: the stage's counts are then summed once per token.
        return count_per_expert(idx_TK.reshape(-1), self.num_experts)

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 capacity_factor: float | Fraction | None = None,
                 drop_policy: str = "position") -> DispatchResult[EtpState]:
        """The inner dispatch of the etp group's gathered tokens (``x_MD`` holds copies of all of them)."""
        g = self._gather_routing(x_TD, idx_TK, weights_TK, capacity_factor)
        d = self.inner.dispatch(g.x_GD, g.idx_GK, g.weights_GK, drop_policy=drop_policy)
        return DispatchResult(x_MD=d.x_MD, num_tokens_per_expert=d.num_tokens_per_expert,
                              num_routed_per_expert=self._own_counts(idx_TK), num_dropped=d.num_dropped,
                              token_idx_M=d.token_idx_M, state=EtpState(d.state, g.rows),
                              num_token_rank_sends=d.num_token_rank_sends)

    def combine(self, y_MD: torch.Tensor, state: EtpState) -> torch.Tensor:
        """The inner combine, then the partial outputs summed over the group, this rank's tokens kept."""
        return self._scatter(self.inner.combine(y_MD, state.inner), state.rows)

    def run_experts(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertsFn, *,
                    capacity_factor: float | Fraction | None = None, drop_policy: str = "position",
                    in_flight: Callable[[], torch.Tensor] | None = None) -> RoutedOutput:
        g = self._gather_routing(x_TD, idx_TK, weights_TK, capacity_factor)
        routed = self.inner.run_experts(g.x_GD, g.idx_GK, g.weights_GK, experts, drop_policy=drop_policy,
                                        in_flight=in_flight)
        return dataclasses.replace(routed, out_TD=self._scatter(routed.out_TD, g.rows),
                                   num_routed_per_expert=self._own_counts(idx_TK),
                                   num_dropped=torch.zeros((), dtype=torch.int64, device=x_TD.device))


@dataclasses.dataclass
class GatheredRows:
    """Where this rank's tokens sit among the gathered rows."""

    num_local: int
    padded: int
    """Rows each rank contributes to the gather (the group's largest token count)."""
    kept: torch.Tensor | None
    """With unequal counts, the gathered rows that are tokens (not padding); None when all are."""


@dataclasses.dataclass
class _GatheredRouting:
    """The etp group's routed tokens, rank by rank (``G = etp * T`` rows)."""

    x_GD: torch.Tensor
    idx_GK: torch.Tensor
    weights_GK: torch.Tensor
    rows: GatheredRows


@dataclasses.dataclass
class EtpState:
    """What ``ExpertTensorParallelDispatcher.combine`` needs."""

    inner: object
    """The inner dispatcher's state."""
    rows: GatheredRows


def shard_experts_2d(experts: GroupedExperts, dims: ParallelDims) -> None:
    """Replace each full ``[E, ...]`` expert weight by this rank's E/ep experts and F/etp slice of
    their hidden dim, a DTensor ``[Shard(0), Shard(F dim)]`` on ``dims.expert_mesh`` (ep, etp).
    The model was built full-size with the same seed on every rank, so slicing needs no
    communication and the global model is the same for any (ep, etp)."""
    for name, w in list(experts.named_parameters(recurse=False)):
        if isinstance(w, DTensor):
            continue
        if name not in HIDDEN_DIM:
            raise ValueError(f"parallel.etp ({dims.etp}) > 1 splits the expert weights w1, w2, w3 only; the experts "
                             f"also hold {name!r} (LoRA adapters are not split by etp)")
        f_dim = HIDDEN_DIM[name]
        if w.shape[f_dim] % dims.etp:
            raise ValueError(f"parallel.etp ({dims.etp}) must divide moe.expert_hidden_dim ({w.shape[f_dim]})")
        num_local, f_local = w.shape[0] // dims.ep, w.shape[f_dim] // dims.etp
        local = w.detach()[dims.ep_rank * num_local:(dims.ep_rank + 1) * num_local]
        # A copy: a view would keep the whole [E, ...] tensor alive on every rank.
        local = local.narrow(f_dim, dims.etp_rank * f_local, f_local).clone()
        shard = DTensor.from_local(local, dims.expert_mesh, [Shard(0), Shard(f_dim)], run_check=False,
                                   shape=w.shape, stride=w.stride())
        setattr(experts, name, nn.Parameter(shard, requires_grad=w.requires_grad))
