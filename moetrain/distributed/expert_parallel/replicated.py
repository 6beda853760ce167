"""The all-to-all dispatcher over expert *slots* (``parallel.expert_slots_per_rank``): each ep rank
holds its L home experts and R replicas of hot experts of other ranks (``placement.py``), and an
expert's routed copies are shared among its copies in the placement's proportions.

Routing stays in logical expert ids: the router, the balance losses, the routing statistics and
the capacity drops see the same ids as without replicas. Only the dispatch maps each routed copy
to a slot, as the step before ``AllToAllDispatcher.route`` (which then runs unchanged over P * S
"experts", rank p holding slots p*S .. p*S+S-1):

* Each expert's copies on this rank, in drop-priority order (token order dropless), are cut into
  consecutive runs by the placement's shares: the copy at position i of n goes to the copy
  (slot) whose share range holds ``i * SHARE_UNITS // n``. Deterministic, no communication.
* With a capacity factor the drops are decided first, over logical experts and the global batch,
  exactly as ``AllToAllRouting._global_drops`` decides them without replicas; the kept copies are
  then cut into runs and the dropped ones (the last in priority order) follow the last run into
  the last copy's slot, where the slot-level route drops them again: its kept count is what this
  dispatcher hands it (``_global_drops`` below). So the same copies are kept as without replicas.

The experts of a rank run as one grouped GEMM over its S slots: the home weights (the model's
parameters, this rank's shard) concatenated with the replica ``bank``, plain tensors outside the
model that ``rebalance.Rebalancer`` fills from the homes after every optimizer step and whose
gradients it sums into the homes' before the step.

Shape legend: T tokens on this rank, D model dim, E logical experts, S slots per rank, K experts
per token, N = T*K routed copies, M rows grouped by local slot, C copies of an expert, W
data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fractions import Fraction

import torch
import torch.distributed as dist

from moetrain.distributed.expert_parallel.dispatcher import AllToAllDispatcher
from moetrain.distributed.expert_parallel.placement import SHARE_UNITS, Placement, home_placement
from moetrain.distributed.expert_parallel.route import Route, _KeptCounts
from moetrain.distributed.expert_parallel.wire import TOKEN_BOUND
from moetrain.models.moe.dispatcher import (
    ExpertsFn,
    RoutedOutput,
    count_per_expert,
    expert_capacity,
    sort_by_expert,
)
from moetrain.models.moe.experts import _HAS_GROUPED_MM, GroupedExperts, _aligned, to_autocast_dtype
from moetrain.utils.tensors import local_tensor


class ReplicatedDispatcher(AllToAllDispatcher):
    """``AllToAllDispatcher`` over ``P * slots_per_rank`` slots for ``num_experts`` logical experts
    (see the module docstring). Takes the same settings as the dispatcher it replaces
    (``replacing``)."""

    def __init__(self, num_experts: int, *, slots_per_rank: int, ep_group: dist.ProcessGroup, **settings) -> None:
        num_ranks = dist.get_world_size(ep_group)
        super().__init__(num_ranks * slots_per_rank, ep_group=ep_group, **settings)
        self.num_logical = num_experts
        self.num_home = num_experts // num_ranks
        self.slots_per_rank = slots_per_rank
        self.bank: dict[str, torch.Tensor] = {}
        """Replica weights by the experts' parameter name, ``[R, ...]`` (R = S - L spare slots)."""
        self.load_E = torch.zeros(num_experts, dtype=torch.int64)
        """Kept copies per logical expert (all routed ones when dropless) of this rank's training
        forwards since the last plan."""
        self.recv_copies = 0
        """Copies this rank's slots received in training forwards since the last read (host int)."""
        self.set_placement(home_placement(num_experts, num_ranks=num_ranks, slots_per_rank=slots_per_rank))
        self._slot_drops: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bank_ready: Callable[[], None] | None = None
        """Waits for a bank refresh in flight (set by the rebalancer); called before the bank is read."""

    @classmethod
    def replacing(cls, old: AllToAllDispatcher, *, slots_per_rank: int) -> ReplicatedDispatcher:
        """A dispatcher with ``old``'s groups, wire format, chunks and counters, over slots."""
        assert old.ep_group is not None, "replicas need expert parallelism (the config checks ep > 1)"
        new = cls(old.num_experts, slots_per_rank=slots_per_rank, ep_group=old.ep_group, dp_group=old.dp_group,
                  dedup=old.dedup, dispatch_dtype=old.dispatch_dtype, num_chunks=old.num_chunks,
                  ep_nodes=old.ep_nodes, dp_nodes=old.dp_nodes)
        new.stats, new.timer = old.stats, old.timer
        return new

    def set_placement(self, placement: Placement) -> None:
        assert placement.num_experts == self.num_logical and placement.num_ranks == self.ep_size
        self.placement = placement
        self._tables: tuple[torch.Tensor, torch.Tensor] = placement.tables(self.load_E.device)

    def attach(self, experts: GroupedExperts) -> None:
        """Allocate the replica bank for ``experts`` (filled by the rebalancer before use)."""
        spare = self.slots_per_rank - self.num_home
        for name, p in experts.named_parameters(recurse=False):
            local = local_tensor(p).detach()
            self.bank[name] = local.new_zeros(spare, *local.shape[1:]).requires_grad_(p.requires_grad)

    # ----- logical copies -> slots (no communication) ----------------------------------------------

    def to_slots(self, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *, num_routed_E: torch.Tensor,
                 num_kept_E: torch.Tensor | None, drop_policy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot_TK, num_kept_S)``: each copy's global slot, and the copies this rank keeps per
        global slot (``num_kept_E`` None: dropless, all of them)."""
        if self._tables[0].device != idx_TK.device:
            self._tables = (self._tables[0].to(idx_TK.device), self._tables[1].to(idx_TK.device))
        slot_EC, end_EC = self._tables
        idx_N = idx_TK.reshape(-1)
        order_N = sort_by_expert(idx_TK, weights_TK, drop_policy=drop_policy if num_kept_E is not None else "position")
        expert_S = idx_N[order_N]
        block_start_E = torch.cumsum(num_routed_E, dim=0) - num_routed_E
        rank_in_S = torch.arange(expert_S.numel(), device=idx_N.device) - block_start_E[expert_S]
        num_cut_E = num_routed_E if num_kept_E is None else num_kept_E
        # Position in share units; a dropped copy's is >= SHARE_UNITS and lands in the last copy.
        units_S = torch.div(rank_in_S * SHARE_UNITS, num_cut_E[expert_S].clamp(min=1), rounding_mode="floor")
        copy_S = (end_EC[expert_S] <= units_S.unsqueeze(1)).sum(dim=1).clamp(max=slot_EC.shape[1] - 1)
        slot_S = slot_EC[expert_S, copy_S]
        slot_N = torch.empty_like(idx_N).scatter_(0, order_N, slot_S)
        kept_S = rank_in_S < num_cut_E[expert_S]
        num_kept_S = torch.zeros(self.num_experts, dtype=torch.int64, device=idx_N.device)
        num_kept_S.index_put_((slot_S,), kept_S.long(), accumulate=True)
        return slot_N.view_as(idx_TK), num_kept_S

    # ----- the route over slots --------------------------------------------------------------------

    def route(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
              capacity_factor: float | Fraction | None, drop_policy: str, num_chunks: int = 1) -> Route:
        """Steps 1-2 over slots; the route's routed and kept counts are the logical experts'."""
        num_routed_E = count_per_expert(idx_TK.reshape(-1), self.num_logical)
        num_kept_E = None
        if capacity_factor is not None:
            num_kept_E, routed_W = self._logical_drops(num_routed_E, idx_TK, weights_TK,
                                                       capacity_factor=capacity_factor, drop_policy=drop_policy)
        # The load the plan levels: the copies the experts compute (kept ones). Training forwards
        # only (no gradient: evaluation), and not the recompute of activation checkpointing inside
        # backward, which would count a forward twice.
        training = torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
        if training:
            # A new tensor, not an in-place add: the rebalancer keeps the step's starting one (a skipped step).
            self.load_E = self.load_E.to(num_routed_E.device) + (num_routed_E if num_kept_E is None else num_kept_E)
        slot_TK, num_kept_S = self.to_slots(idx_TK, weights_TK, num_routed_E=num_routed_E, num_kept_E=num_kept_E,
                                            drop_policy=drop_policy)
        if num_kept_E is not None:
            self._slot_drops = (num_kept_S, routed_W)
        route = super().route(x_TD, slot_TK, weights_TK, capacity_factor=capacity_factor, drop_policy=drop_policy,
                              num_chunks=num_chunks)
        self._slot_drops = None
        if training:
            self.recv_copies += sum(route.recv_splits)
        return dataclasses.replace(route, num_routed_E=num_routed_E,
                                   num_send_E=num_routed_E if num_kept_E is None else num_kept_E)

    def _logical_drops(self, num_routed_E: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                       capacity_factor: float | Fraction, drop_policy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The copies this rank keeps per logical expert, as without replicas (capacity over the
        global batch and the E logical experts), and the routed copies of every data-parallel rank."""
        if self.dp_group is None:
            raise ValueError("a capacity factor under expert parallelism needs the dispatcher's dp_group")
        num_tokens, top_k = idx_TK.shape
        capacity = expert_capacity(num_tokens * self.dp_size, num_experts=self.num_logical, top_k=top_k,
                                   capacity_factor=capacity_factor)
        num_routed_WE = self._all_gather(num_routed_E, bound=TOKEN_BOUND).view(self.dp_size, self.num_logical)
        kept_WE = self._global_keep_counts(num_routed_WE, idx_TK, weights_TK, capacity=capacity,
                                           drop_policy=drop_policy)
        return kept_WE[self.dp_rank], num_routed_WE.sum(dim=1)

    def _global_drops(self, num_routed_E: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                      capacity_factor: float | Fraction, drop_policy: str) -> _KeptCounts:
        """Step 2 with a capacity factor, over slots: the kept counts ``route`` decided over logical
        experts; the exchange tells each rank what its slots receive."""
        assert self._slot_drops is not None, "route decides the logical drops first"
        num_kept_S, routed_W = self._slot_drops
        P, S, j = self.ep_size, self.num_local_experts, self.ep_rank
        num_recv_PS = self._exchange_counts(num_kept_S.view(P, S), bound=TOKEN_BOUND)
        num_remote = num_kept_S.sum() - num_kept_S[j * S:(j + 1) * S].sum()
        return _KeptCounts(num_kept_S, num_recv_PS, num_remote, routed_W)

    # ----- the experts over slots ------------------------------------------------------------------

    def dispatch(self, *args, **kwargs):
        raise NotImplementedError("ReplicatedDispatcher runs through run_experts only: its rows are grouped by "
                                  "slot, and only run_experts runs the slots' experts (homes and replicas)")

    def run_experts(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertsFn,
                    **kwargs) -> RoutedOutput:
        assert isinstance(experts, GroupedExperts), "the MoE layer's routed experts"
        return super().run_experts(x_TD, idx_TK, weights_TK, self._slot_experts(experts), **kwargs)

    def _slot_experts(self, experts: GroupedExperts) -> ExpertsFn:
        """``experts`` over this rank's S slots: home weights, then the bank, in one grouped GEMM.
        Uses GroupedExperts' own grouped and loop paths (its oracle) with the concatenated weights."""
        def run(x_MD: torch.Tensor, num_tokens_per_slot: torch.Tensor) -> torch.Tensor:
            if self.bank_ready is not None:  # the refresh travelled with this layer's token dispatch
                self.bank_ready()
            x_MD = to_autocast_dtype(x_MD)

            def cat(name: str) -> torch.Tensor | None:
                p = getattr(experts, name, None)
                return None if p is None else torch.cat([local_tensor(p), self.bank[name]]).to(x_MD.dtype)

            weights = {n: (cat(n), cat(f"lora_a_{n}"), cat(f"lora_b_{n}")) for n in experts.projection_names()}
            tensors = [t for ws in weights.values() for t in ws if t is not None]
            if experts.impl == "grouped" and _HAS_GROUPED_MM and _aligned(x_MD, *tensors):
                return experts._forward_grouped(x_MD, num_tokens_per_slot, weights)
            return experts._forward_loop(x_MD, num_tokens_per_slot, weights)

        return run
