"""Routers: which experts each token goes to, and with which gate weight.

``TopKRouter`` is token choice (each token takes its top-k experts) over softmax or sigmoid scores,
optionally with an auxiliary-loss-free selection bias (DeepSeek-V3), two-level group-limited
selection, a scale of the routed gate weights (DeepSeek's routed_scaling_factor), input jitter or
logit noise in training, and a forced balanced assignment for benchmarks (``force_balance``).
``ExpertChoiceRouter`` lets each expert pick its tokens instead; the capacity cut itself is made
by the dispatcher.

Shape legend: T tokens, D model dim, E experts, K experts per token, G expert groups,
X = E/G experts per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FORCE_BALANCE_MODES = ("none", "round_robin", "random")
GROUP_SCORES = ("top2_sum", "max")

SIGMOID_RENORM_EPS = 1e-20
"""Added to the sum of a token's selected sigmoid scores before dividing by it (DeepSeek-V3's
value): sigmoid scores can all underflow to 0 (logits below about -88), and 0 / 0 would be NaN.
It is below half an fp32 ulp of any sum >= 2**-42 (2.3e-13), so it changes no other result. Softmax needs
none: a token's best softmax score is >= 1 / E."""


@dataclass
class RouterOutput:
    weights_TK: torch.Tensor
    """Gate weight of each selected expert (fp32)."""
    idx_TK: torch.Tensor
    """Selected expert ids (int64), best first; ties go to the lower expert id. Expert choice:
    every expert, in id order (K = E; the dispatcher keeps each expert's best tokens)."""
    probs_TE: torch.Tensor
    """Scores over all experts normalised to sum to 1 per token (fp32): the softmax, or the
    sigmoid scores divided by their sum. Used by the load-balancing loss and routing entropy."""
    logits_TE: torch.Tensor
    """Raw router logits (fp32); used by the z-loss."""


class TopKRouter(nn.Module):
    """Token choice: a linear projection, scores, then the top-k experts per token.

    ``score_func="softmax"`` (default) or ``"sigmoid"``. ``bias=True`` adds the buffer
    ``expert_bias`` [E] to the scores used for *selection* only; it is moved by
    :meth:`update_bias` (called from an optimizer pre-step hook, never in forward).
    ``num_groups > 1`` restricts each token to its ``top_groups`` best groups of consecutive
    experts before the top-k, a group scored by ``group_score`` ("top2_sum" or "max", see
    :func:`limit_to_groups`). ``scaling_factor`` multiplies the gate weights after the optional
    renormalisation. ``jitter``/``noise_std`` perturb the routing in training mode only.
    ``force_balance`` ("round_robin", "random") replaces the selection in training mode only by
    :func:`forced_assignment`; the gate weights are then the scores of the forced experts.
    """

    expert_bias: torch.Tensor | None

    def __init__(self, dim: int, num_experts: int, *, top_k: int, renormalize: bool = True,
                 init_std: float = 0.02, score_func: str = "softmax", bias: bool = False,
                 num_groups: int = 1, top_groups: int = 1, group_score: str = "top2_sum",
                 scaling_factor: float = 1.0, jitter: float = 0.0, noise_std: float = 0.0,
                 force_balance: str = "none") -> None:
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func ({score_func!r}) must be 'softmax' or 'sigmoid'")
        if force_balance not in FORCE_BALANCE_MODES:
            raise ValueError(f"moe.force_balance ({force_balance!r}) must be one of "
                             f"{', '.join(map(repr, FORCE_BALANCE_MODES))}")
        if force_balance != "none" and top_k > num_experts:
            raise ValueError(f"moe.top_k ({top_k}) must be <= moe.num_experts ({num_experts}) to force a balance")
        self.force_balance = force_balance
        # Expert ids of the tokens of the next training forwards, set and cleared by the routing
        # replay (moetrain.train.routing_trace); None = the router chooses.
        self.replay_idx_TK: torch.Tensor | None = None
        if num_experts % num_groups != 0 or not 1 <= top_groups <= num_groups:
            raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts}) and "
                             f"top_groups ({top_groups}) must be in [1, num_groups]")
        if not (isinstance(scaling_factor, (int, float)) and 0 < scaling_factor < float("inf")):
            raise ValueError(f"moe.routed_scaling_factor ({scaling_factor!r}) must be a finite number > 0")
        if group_score not in GROUP_SCORES:
            raise ValueError(f"moe.group_score ({group_score!r}) must be one of "
                             f"{', '.join(map(repr, GROUP_SCORES))}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.init_std = init_std
        self.score_func = score_func
        self.num_groups, self.top_groups, self.group_score = num_groups, top_groups, group_score
        self.scaling_factor = scaling_factor
        self.jitter, self.noise_std = jitter, noise_std
        self.gate = nn.Linear(dim, num_experts, bias=False)
        if bias:
            # fp32 and persistent: it is training state (saved in checkpoints), moved in steps of
            # ~1e-3 that bf16 could not represent next to values ~1e-1. _apply keeps it fp32.
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate.weight, std=self.init_std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def _apply(self, fn, recurse: bool = True):
        # Module casts (``model.to(torch.bfloat16)``, ``.half()``) convert every floating buffer.
        # The selection bias stays fp32: in bf16 its ~1e-3 steps vanish next to values ~1e-1 and
        # biased scores tie. Device moves apply to it; its values come from the fp32 original,
        # so a cast there and back loses nothing.
        bias = self.expert_bias
        super()._apply(fn, recurse=recurse)
        applied = self.expert_bias
        if bias is not None and applied is not None and applied.dtype != torch.float32:
            self.expert_bias = bias.to(device=applied.device)
        return self

    def _logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        # Routing runs in fp32 whatever the compute dtype: in bf16 nearby scores collapse to
        # equal values, so top-k flips between runs, layouts and ranks, and the softmax of the
        # z-loss overflows sooner. Autocast is switched off here, or it would run the fp32
        # F.linear in bf16 anyway.
        with torch.autocast(x_TD.device.type, enabled=False):
            x_TD = x_TD.float()
            if self.training and self.jitter > 0:
                x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            logits_TE = F.linear(x_TD, self.gate.weight.float())
            if self.training and self.noise_std > 0:
                logits_TE = logits_TE + torch.randn_like(logits_TE) * self.noise_std
        return logits_TE

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        logits_TE = self._logits(x_TD)
        if self.score_func == "softmax":
            probs_TE = scores_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        if self.training and self.replay_idx_TK is not None:
            # R3 replay: the recorded ids, weighted by this router's current (differentiable) scores.
            if self.replay_idx_TK.shape != (logits_TE.shape[0], self.top_k):
                raise ValueError(f"moe.routing_replay: replayed ids {list(self.replay_idx_TK.shape)} do not fit "
                                 f"this forward's {logits_TE.shape[0]} tokens x top_k {self.top_k}")
            idx_TK = self.replay_idx_TK
            weights_TK = scores_TE.gather(1, idx_TK)
        elif self.training and self.force_balance != "none":
            # Benchmark routing: the router's choice is ignored, its scores still weight the
            # forced experts (so the gate gets gradients, as torchtitan's debug switch does).
            idx_TK = forced_assignment(logits_TE.shape[0], self.num_experts, self.top_k, mode=self.force_balance,
                                       device=logits_TE.device)
            weights_TK = scores_TE.gather(1, idx_TK)
        elif self.expert_bias is None and self.num_groups == 1:
            idx_TK = top_k_lowest_id_first(scores_TE.detach(), self.top_k)
            weights_TK = scores_TE.gather(1, idx_TK)
        else:
            # The bias and the group limit change *which* experts are chosen; the gate weights
            # are still the unbiased scores of the chosen ones.
            select_TE = scores_TE.detach()
            if self.expert_bias is not None:
                select_TE = select_TE + self.expert_bias
            if self.num_groups > 1:
                select_TE = limit_to_groups(select_TE, num_groups=self.num_groups, top_groups=self.top_groups,
                                            score=self.group_score)
            idx_TK = torch.sort(select_TE, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
            weights_TK = scores_TE.gather(1, idx_TK)
        if self.renormalize and self.top_k > 1:
            total_T1 = weights_TK.sum(dim=-1, keepdim=True)
            if self.score_func == "sigmoid":
                total_T1 = total_T1 + SIGMOID_RENORM_EPS
            weights_TK = weights_TK / total_T1
        if self.scaling_factor != 1.0:
            weights_TK = weights_TK * self.scaling_factor
        return RouterOutput(weights_TK=weights_TK, idx_TK=idx_TK, probs_TE=probs_TE, logits_TE=logits_TE)

    @torch.no_grad()
    def update_bias(self, num_routed_E: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free update: raise the bias of under-loaded experts and
        lower it for over-loaded ones by ``rate``, ``b_e += rate * sign(mean - load_e)``, then
        subtract the mean step (a common shift of every bias changes no selection; centring keeps
        the bias from drifting). ``num_routed_E`` must be the same on every rank."""
        bias_E = self.expert_bias
        assert bias_E is not None, "update_bias needs a router built with bias=True"
        load_E = num_routed_E.to(bias_E.device, torch.float64)
        step_E = rate * torch.sign(load_E.mean() - load_E)
        bias_E.add_((step_E - step_E.mean()).float())


def forced_assignment(num_tokens: int, num_experts: int, top_k: int, *, mode: str,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """``idx_TK`` of a forced, balanced routing (``moe.force_balance``), independent of the scores.

    "round_robin": copy ``n = t * K + j`` goes to expert ``n mod E``. A token's K copies are K
    consecutive, distinct experts (K <= E), and expert e gets ``floor(T*K/E)`` copies, plus one for
    ``e < (T*K) mod E``: exactly equal loads when E divides T*K. Stateless, so a recomputed forward
    (activation checkpointing) routes alike.
    "random": each token's K distinct experts uniformly at random (the top K of E uniform keys),
    from the global torch RNG on ``device``: reproducible from its seed, replayed alike by
    activation checkpointing (which restores the RNG state), and each expert's expected load is
    T*K/E.
    """
    if mode == "round_robin":
        return (torch.arange(num_tokens * top_k, device=device) % num_experts).view(num_tokens, top_k)
    if mode == "random":
        keys_TE = torch.rand(num_tokens, num_experts, device=device)
        return keys_TE.topk(top_k, dim=-1).indices
    raise ValueError(f"moe.force_balance ({mode!r}) must be 'round_robin' or 'random' to force an assignment")


def top_k_lowest_id_first(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best (non-negative) scores per row, best first, equal scores in expert-id order.

    torch.topk leaves the order of equal values unspecified, and a full stable sort over E is
    2-3x slower than topk. So topk runs on an fp64 key ``s * (1 - e * 2**-32) - e * 2**-160``:
    for E <= 128 the factor moves a score by less than 2**-25 of itself, under half the gap
    between two fp32 values, so it never reorders different scores; it makes equal scores
    distinct with the lower id larger, and the additive term does the same for exact zeros
    (at most 2**-153: a quarter of the smallest gap between fp32 values, 2**-149). Both terms
    stay normal fp64 numbers: a subnormal one (2**-1066 was tried) sends every addition through
    the CPU's slow path, ~1 ms per forward at E=64.
    """
    num_experts = scores_TE.shape[-1]
    if num_experts > 128:
        return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    e_E = torch.arange(num_experts, dtype=torch.float64, device=scores_TE.device)
    key_TE = torch.addcmul(-e_E * 2.0**-160, scores_TE.double(), 1.0 - e_E * 2.0**-32)
    return torch.topk(key_TE, k, dim=-1).indices


def limit_to_groups(select_TE: torch.Tensor, *, num_groups: int, top_groups: int,
                    score: str = "top2_sum") -> torch.Tensor:
    """Two-level routing: -inf for every expert outside the token's ``top_groups`` best groups.

    ``score="top2_sum"``: a group's score is the sum of its two best selection scores (one when
    the group has a single expert), DeepSeek-V3's rule: a group with two good experts beats one
    with a single outlier. ``"max"``: its best score, DeepSeek-V2's group_limited_greedy.
    Equal group scores go to the lower group id (stable sort), as equal expert scores do.
    """
    T, E = select_TE.shape
    select_TGX = select_TE.view(T, num_groups, E // num_groups)
    if score == "max":
        group_score_TG = select_TGX.amax(dim=-1)
    else:
        group_score_TG = select_TGX.topk(min(2, E // num_groups), dim=-1).values.sum(dim=-1)
    top_group_TG = torch.sort(group_score_TG, dim=-1, descending=True, stable=True).indices[:, :top_groups]
    keep_TG = torch.zeros(T, num_groups, dtype=torch.bool, device=select_TE.device).scatter_(1, top_group_TG, True)
    return select_TGX.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)


class ExpertChoiceRouter(TopKRouter):
    """Expert choice (Zhou et al. 2022): softmax scores; every expert is a candidate for every
    token (``idx_TK`` = all E experts, ``weights_TK`` = the scores), and the dispatcher, in
    capacity mode with the "score" drop policy, keeps each expert's ``capacity`` best-scoring
    tokens (equal scores: the earlier token). Under data/expert parallelism the all-to-all
    dispatcher makes that cut over the global batch, exactly as one process would.

    A subclass of ``TopKRouter`` so that code initialising routers (``Transformer.init_weights``)
    treats its gate like any router's.
    """

    def __init__(self, dim: int, num_experts: int, *, init_std: float = 0.02, jitter: float = 0.0,
                 noise_std: float = 0.0) -> None:
        super().__init__(dim, num_experts, top_k=num_experts, renormalize=False, init_std=init_std,
                         jitter=jitter, noise_std=noise_std)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        logits_TE = self._logits(x_TD)
        probs_TE = torch.softmax(logits_TE, dim=-1)
        idx_TE = torch.arange(self.num_experts, device=logits_TE.device).expand(logits_TE.shape[0], -1)
        return RouterOutput(weights_TK=probs_TE, idx_TK=idx_TE, probs_TE=probs_TE, logits_TE=logits_TE)
