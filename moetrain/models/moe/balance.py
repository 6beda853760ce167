"""Auxiliary losses that keep routing balanced. They are returned by the layer, never stored
in module-global state.

Shape legend: T tokens, E experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn


def load_balancing_loss(probs_TE: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, *,
                        top_k: int, num_tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """Switch/GShard loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the T*K routed token copies that chose expert e (before any
    capacity drop; a constant, no gradient) and ``P_e`` the mean router probability of e.
    Perfectly uniform routing gives 1.0.

    Under data parallelism pass the counts summed over ranks and the global ``num_tokens``:
    each rank's loss is then linear in its own probabilities and, with equal token counts per
    rank, the mean over ranks equals the single-process loss of the whole batch (with unequal
    counts the caller scales each rank's loss by its token share, ``MoELayer``'s masked path).
    """
    num_experts = probs_TE.shape[1]
    num_tokens = probs_TE.shape[0] if num_tokens is None else num_tokens
    f_E = num_tokens_per_expert_E.detach().float() / (num_tokens * top_k)
    P_E = probs_TE.float().mean(dim=0)
    return num_experts * torch.sum(f_E * P_E)


def routed_frequencies(num_routed_E: torch.Tensor) -> torch.Tensor:
    """``f_e = n_e / sum_e n_e`` of routed-copy counts (fp32), uniform ``1 / E`` when there are
    none (no host sync: the choice is a ``torch.where``)."""
    counts_E = num_routed_E.detach().float()
    total = counts_E.sum()
    return torch.where(total > 0, counts_E / total.clamp(min=1), torch.full_like(counts_E, 1 / counts_E.numel()))


def frequency_load_balancing_loss(probs_TE: torch.Tensor, freq_E: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` with given frequencies ``freq_E`` (constants, summing to 1) and
    ``P_e`` the mean router probability of e over these T tokens: the Switch term when f comes
    from elsewhere than this batch (``moe.aux_loss_type="global_batch"``, the previous optimizer
    step's global counts). Linear in the probabilities, so the token-weighted mean of its values
    over micro-batches and ranks is its value over their union."""
    num_experts = probs_TE.shape[1]
    return num_experts * torch.sum(freq_E.detach().float() * probs_TE.float().mean(dim=0))


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss ``mean_t logsumexp(logits_t)^2``: keeps router logits small so the fp32
    softmax stays well conditioned."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


def all_reduce_counts(num_routed_E: torch.Tensor, group) -> torch.Tensor:
    """Sum routing counts over ``group``. Counts carry no gradient, so a plain collective on a
    copy is enough (no autograd, the local tensor is left untouched)."""
    total_E = num_routed_E.clone()
    dist.all_reduce(total_E, group=group)
    return total_E


def sequence_load_balancing_loss(probs_BSE: torch.Tensor, idx_BSK: torch.Tensor, *,
                                 sequence_group=None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the Switch term ``E * sum_e f_e * P_e`` of each
    sequence alone, averaged over the B sequences.

    ``f_e`` is the fraction of the sequence's S*K routed copies that chose e (a constant) and
    ``P_e`` the sequence's mean normalised score of e. Each sequence's term needs only its own
    tokens, so no counts cross data-parallel ranks: the mean over them of their per-rank means is
    the mean over the global batch's sequences (equal sequences per rank).

    ``sequence_group``: the ranks over which every sequence's positions are spread (the tp group
    under sequence parallelism, each rank holding S of them): the per-sequence counts and score
    sums are summed over it, so every rank of the group computes the whole sequences' loss. The
    score sum's backward sums the group's gradients, because each rank's scores enter every
    rank's loss (the tensor-parallel wrapper then averages the equal losses over the group).
    """
    B, S, E = probs_BSE.shape
    K = idx_BSK.shape[-1]
    counts_BE = torch.zeros(B, E, dtype=torch.float32, device=probs_BSE.device)
    counts_BE.scatter_add_(1, idx_BSK.reshape(B, S * K), torch.ones(B, S * K, device=probs_BSE.device))
    score_sum_BE = probs_BSE.float().sum(dim=1)
    if sequence_group is not None:
        counts_BE = all_reduce_counts(counts_BE, sequence_group)
        score_sum_BE = dist_nn.all_reduce(score_sum_BE, group=sequence_group)
        S = S * dist.get_world_size(sequence_group)
    f_BE = counts_BE / (S * K)
    P_BE = score_sum_BE / S
    return E * (f_BE * P_BE).sum(dim=-1).mean()


def masked_sequence_load_balancing_loss(probs_NE: torch.Tensor, idx_NK: torch.Tensor, sequence_ids_N: torch.Tensor,
                                        num_sequences: int, *, sequence_group=None) -> torch.Tensor:
    """:func:`sequence_load_balancing_loss` of sequences whose padded positions were removed: the N
    real tokens of ``num_sequences`` sequences, token n in sequence ``sequence_ids_N[n]``. Each
    sequence's ``f_e`` and ``P_e`` are over its real tokens (every sequence has at least one).
    ``sequence_group``: as there, the ranks over which each sequence's positions are spread (its
    real-token count, counts and score sums are summed over them)."""
    N, E = probs_NE.shape
    K = idx_NK.shape[-1]
    device = probs_NE.device
    lengths_B = torch.bincount(sequence_ids_N, minlength=num_sequences).float()
    counts_BE = torch.zeros(num_sequences * E, dtype=torch.float32, device=device)
    slots_NK = sequence_ids_N.unsqueeze(1) * E + idx_NK
    counts_BE.index_add_(0, slots_NK.reshape(-1), torch.ones(N * K, device=device))
    score_sum_BE = torch.zeros(num_sequences, E, dtype=torch.float32, device=device).index_add(
        0, sequence_ids_N, probs_NE.float())
    if sequence_group is not None:
        lengths_B = all_reduce_counts(lengths_B, sequence_group)
        counts_BE = all_reduce_counts(counts_BE, sequence_group)
        score_sum_BE = dist_nn.all_reduce(score_sum_BE, group=sequence_group)
    lengths_B1 = lengths_B.clamp(min=1).unsqueeze(1)
    f_BE = counts_BE.view(num_sequences, E) / (lengths_B1 * K)
    return E * (f_BE * (score_sum_BE / lengths_B1)).sum(dim=-1).mean()


def routing_entropy(probs_TE: torch.Tensor) -> torch.Tensor:
    """Per-token entropy (nats) of the normalised router scores, summed over tokens (fp32, no
    gradient). ln(E) is a router that cannot tell experts apart; 0 a one-hot decision."""
    p_TE = probs_TE.detach().float()
    return -(p_TE * torch.log(p_TE.clamp(min=1e-30))).sum()
