"""Token dispatch: moves routed token copies to their experts and brings the results back.

Every dispatcher has the same calls (the ``Dispatcher`` protocol), so the MoE layer never knows
where its experts live: ``dispatch(x_TD, idx_TK, weights_TK, capacity_factor=...)`` returns the
token copies grouped by local expert with the ``state`` their combine needs (a record of the
dispatcher's own, the type parameter of ``Dispatcher``), and ``combine(y_MD, state)`` returns the
weighted sum of each token's K expert outputs. ``run_experts`` does both around the layer's experts and takes an
``in_flight`` callable, work that does not need the routed rows (the shared experts): a
dispatcher that communicates runs it while the rows travel, and may pipeline the experts against
its exchanges; the local one simply calls it. Each dispatcher turns the capacity factor into a
capacity over the batch it decides drops for, and reports what it sent. ``LocalDispatcher`` (all experts on this
process) is here; the all-to-all one for expert parallelism is in
``moetrain.distributed.expert_parallel.dispatcher``.

Shape legend: T tokens, D model dim, E experts, K experts per token, N = T*K routed copies,
M copies kept after capacity drops (M = N when dropless).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Generic, Protocol, TypeVar

import torch

from moetrain.models.moe.token_bags import TokenBags, bags_from_copies, gather_rows, weighted_scatter


def expert_capacity(num_tokens: int, *, num_experts: int, top_k: int, capacity_factor: float | Fraction) -> int:
    """Token copies one expert takes per forward: ``ceil(factor * T * K / E)``.

    Computed on the decimal value of the factor: in floats 1.1 * 50 * 2 / 2 is 55.00000000000001
    and would round up to 56.
    """
    return math.ceil(Fraction(str(capacity_factor)) * num_tokens * top_k / num_experts)


def count_per_expert(idx_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed copies per expert, without the host sync that ``bincount`` needs for its size."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_N.device)
    return counts_E.scatter_add_(0, idx_N, torch.ones_like(idx_N))


def sort_by_expert(idx_TK: torch.Tensor, weights_TK: torch.Tensor, *, drop_policy: str) -> torch.Tensor:
    """Order of the flattened (token-major) copies that makes each expert's copies contiguous.

    The sort is stable, so inside one expert's block the copies keep token order ("position":
    earlier tokens win capacity). With "score" the copies are pre-sorted by descending weight,
    so the stable expert sort leaves the highest-weight copies first in each block.
    """
    idx_N = idx_TK.reshape(-1)
    if drop_policy == "score":
        by_score_N = torch.sort(weights_TK.reshape(-1), descending=True, stable=True).indices
        return by_score_N[torch.sort(idx_N[by_score_N], stable=True).indices]
    return torch.sort(idx_N, stable=True).indices


def capacity_keep_mask(sorted_expert_N: torch.Tensor, num_routed_E: torch.Tensor,
                       capacity: int) -> torch.Tensor:
    """True for the sorted copies whose rank inside their expert's block is below capacity."""
    block_start_E = torch.cumsum(num_routed_E, dim=0) - num_routed_E
    rank_in_expert_N = torch.arange(sorted_expert_N.numel(), device=sorted_expert_N.device) \
        - block_start_E[sorted_expert_N]
    return rank_in_expert_N < capacity


StateT = TypeVar("StateT")
"""The record a dispatcher's ``combine`` needs from its ``dispatch``."""


@dataclass
class DispatchResult(Generic[StateT]):
    """What ``Dispatcher.dispatch`` returns."""

    x_MD: torch.Tensor
    """Token copies grouped by local expert (expert 0 first)."""
    num_tokens_per_expert: torch.Tensor
    """Copies each local expert receives (int64, on the device): the group sizes for the experts."""
    num_routed_per_expert: torch.Tensor
    """Copies routed to each of the E global experts by this process's tokens, before drops."""
    num_dropped: torch.Tensor
    """Copies dropped by capacity (0-dim int64 tensor; no host sync)."""
    token_idx_M: torch.Tensor
    """Local token of each copy this process kept (and sent), in send order."""
    state: StateT
    """What ``combine`` needs (the dispatcher's own record)."""
    num_token_rank_sends: torch.Tensor | None = None
    """Under expert parallelism: (token, other ep rank) pairs among this rank's routed copies,
    before capacity drops (0-dim int64). A dispatcher that sent each token once per destination
    rank (not once per copy) would move this many rows each way; None when all experts are local."""


ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``experts(x_MD, num_tokens_per_expert) -> y_MD``: the routed experts (``GroupedExperts``)."""


@dataclass
class RoutedOutput:
    """What ``Dispatcher.run_experts`` returns."""

    out_TD: torch.Tensor
    """``out[t]``: the weighted sum of token t's kept expert outputs (zero if all dropped)."""
    overlapped: torch.Tensor | None
    """What ``in_flight()`` returned (None without it)."""
    num_routed_per_expert: torch.Tensor
    """As ``DispatchResult.num_routed_per_expert``."""
    num_dropped: torch.Tensor
    """As ``DispatchResult.num_dropped``."""
    token_idx_M: torch.Tensor
    """Local token of each copy this process kept (in the dispatcher's send order)."""
    num_token_rank_sends: torch.Tensor | None = None
    """As ``DispatchResult.num_token_rank_sends``."""


class Dispatcher(Protocol[StateT]):
    """What the MoE layer calls; ``LocalDispatcher`` and the expert-parallel ``AllToAllDispatcher``."""

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 capacity_factor: float | Fraction | None = None,
                 drop_policy: str = "position") -> DispatchResult[StateT]:
        """Group the routed copies by local expert. ``capacity_factor`` None is dropless; otherwise
        each expert keeps ``expert_capacity(batch, ...)`` copies of the batch the dispatcher
        decides drops for, chosen by ``drop_policy`` ("position" or "score")."""
        ...

    def combine(self, y_MD: torch.Tensor, state: StateT) -> torch.Tensor:
        """``out[t]`` = the weighted sum of token t's kept expert outputs (zero if all dropped)."""
        ...

    def run_experts(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertsFn, *,
                    capacity_factor: float | Fraction | None = None, drop_policy: str = "position",
                    in_flight: Callable[[], torch.Tensor] | None = None) -> RoutedOutput:
        """``combine(experts(dispatch(...)))``, with ``in_flight()`` called once, after the routed
        rows have left and before they are read (its result comes back as ``overlapped``)."""
        ...


@dataclass
class LocalState:
    """What ``LocalDispatcher.combine`` needs: each kept copy's token and gate weight."""

    token_idx_M: torch.Tensor
    weights_M: torch.Tensor
    num_tokens: int
    bags: TokenBags


class LocalDispatcher:
    """All E experts live on this process: a sort-based permutation, no communication."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 capacity_factor: float | Fraction | None = None,
                 drop_policy: str = "position") -> DispatchResult[LocalState]:
        """Capacity (with a factor): ``expert_capacity(T, ...)`` over this process's T tokens."""
        num_tokens, top_k = idx_TK.shape
        capacity = None if capacity_factor is None else expert_capacity(
            num_tokens, num_experts=self.num_experts, top_k=top_k, capacity_factor=capacity_factor)
        idx_N = idx_TK.reshape(-1)
        num_routed_E = count_per_expert(idx_N, self.num_experts)
        order_N = sort_by_expert(idx_TK, weights_TK, drop_policy=drop_policy)
        if capacity is None:
            order_M = order_N
            num_kept_E = num_routed_E
        else:
            keep_N = capacity_keep_mask(idx_N[order_N], num_routed_E, capacity)
            # Boolean indexing is a host sync (the kept count sizes the tensor); only capacity
            # mode pays it, and it saves the expert FLOPs of every dropped copy.
            order_M = order_N[keep_N]
            num_kept_E = num_routed_E.clamp(max=capacity)
        token_idx_M = torch.div(order_M, top_k, rounding_mode="floor")
        bags = bags_from_copies(order_M, num_tokens, top_k)
        x_MD = gather_rows(x_TD, token_idx_M, bags)
        weights_M = weights_TK.reshape(-1).index_select(0, order_M)
        num_dropped = (num_routed_E - num_kept_E).sum()
        return DispatchResult(x_MD=x_MD, num_tokens_per_expert=num_kept_E,
                              num_routed_per_expert=num_routed_E, num_dropped=num_dropped,
                              token_idx_M=token_idx_M,
                              state=LocalState(token_idx_M, weights_M, num_tokens, bags))

    def combine(self, y_MD: torch.Tensor, state: LocalState) -> torch.Tensor:
        return weighted_scatter(y_MD, state.weights_M, state.token_idx_M, state.num_tokens, state.bags)

    def run_experts(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertsFn, *,
                    capacity_factor: float | Fraction | None = None, drop_policy: str = "position",
                    in_flight: Callable[[], torch.Tensor] | None = None) -> RoutedOutput:
        """Nothing travels: ``in_flight()`` runs between the gather and the experts, the order the
        expert-parallel dispatcher runs them in (so both build the same autograd graph)."""
        d = self.dispatch(x_TD, idx_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy)
        overlapped = in_flight() if in_flight is not None else None
        out_TD = self.combine(experts(d.x_MD, d.num_tokens_per_expert), d.state)
        return RoutedOutput(out_TD=out_TD, overlapped=overlapped, num_routed_per_expert=d.num_routed_per_expert,
                            num_dropped=d.num_dropped, token_idx_M=d.token_idx_M)
