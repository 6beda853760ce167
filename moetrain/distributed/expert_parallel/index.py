"""Index math of the all-to-all dispatcher (``moetrain.distributed.expert_parallel.dispatcher``): pure
functions of routing counts, no communication.

Chunks (``moe.dispatch_chunks``) are ranges of this rank's tokens: chunk c holds tokens
``bounds[c]:bounds[c+1]`` and all their kept copies.

Shape legend: T tokens on this rank, E experts, L local experts, K experts per token, N = T*K
routed copies, M kept copies, P ranks in the ep group, R copies received, C chunks, S copies
sorted by expert (S = N).
"""

from __future__ import annotations

from itertools import pairwise

import torch


def to_host(**tensors: torch.Tensor | None) -> dict[str, list[int]]:
    """Several small integer tensors read in one host sync, flattened, by name (None ones are
    left out)."""
    present = {name: t.reshape(-1) for name, t in tensors.items() if t is not None}
    flat = torch.cat(list(present.values())).tolist()
    out, start = {}, 0
    for name, t in present.items():
        out[name] = flat[start:start + t.numel()]
        start += t.numel()
    return out


def group_by_local_expert(num_recv_PL: torch.Tensor, num_recv: int) -> torch.Tensor:
    """Order that turns rows received as [source rank][local expert] into [local expert][source
    rank] (stable: a rank's rows keep their order inside an expert's block)."""
    P, L = num_recv_PL.shape
    local_expert_R = torch.repeat_interleave(
        torch.arange(L, device=num_recv_PL.device).repeat(P), num_recv_PL.reshape(-1), output_size=num_recv)
    return torch.sort(local_expert_R, stable=True).indices


def kept_positions(num_routed_E: torch.Tensor, num_kept_E: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Positions, in expert-sorted order, of the first ``num_kept_E[e]`` copies of each expert's
    block. ``num_kept`` (their total, known on the host) sizes the result without a host sync."""
    E = num_routed_E.numel()
    block_start_E = torch.cumsum(num_routed_E, dim=0) - num_routed_E
    kept_start_E = torch.cumsum(num_kept_E, dim=0) - num_kept_E
    expert_M = torch.repeat_interleave(torch.arange(E, device=num_routed_E.device), num_kept_E,
                                       output_size=num_kept)
    return block_start_E[expert_M] + torch.arange(num_kept, device=num_routed_E.device) - kept_start_E[expert_M]


def kept_mask(idx_N: torch.Tensor, order_N: torch.Tensor, num_routed_E: torch.Tensor,
              num_kept_E: torch.Tensor) -> torch.Tensor:
    """True for the expert-sorted copies that are kept, ``[S]``: the kept copies of expert e are
    the first ``num_kept_E[e]`` of its block of ``order_N`` (the sort is in drop-priority order)."""
    expert_S = idx_N[order_N]
    block_start_E = torch.cumsum(num_routed_E, dim=0) - num_routed_E
    rank_in_expert_S = torch.arange(expert_S.numel(), device=idx_N.device) - block_start_E[expert_S]
    return rank_in_expert_S < num_kept_E[expert_S]


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[int]:
    """Token boundaries of ``num_chunks`` contiguous chunks whose sizes differ by at most one, the
    larger first; with fewer tokens than chunks the last chunks are empty. ``[0, ..., T]``."""
    base, extra = divmod(num_tokens, num_chunks)
    bounds = [0]
    for c in range(num_chunks):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def chunk_of_tokens(bounds: list[int], device: torch.device) -> torch.Tensor:
    """Chunk of each token, ``[T]``."""
    sizes = torch.tensor([b - a for a, b in pairwise(bounds)], device=device)
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes, output_size=bounds[-1])


def kept_per_chunk(idx_N: torch.Tensor, order_N: torch.Tensor, num_routed_E: torch.Tensor,
                   num_send_E: torch.Tensor, chunk_T: torch.Tensor, *, num_chunks: int, top_k: int) -> torch.Tensor:
    """Kept copies per (chunk, global expert), ``[C, E]``."""
    E = num_routed_E.numel()
    expert_S = idx_N[order_N]
    keep_S = kept_mask(idx_N, order_N, num_routed_E, num_send_E)
    chunk_S = chunk_T[torch.div(order_N, top_k, rounding_mode="floor")]
    counts_CE = torch.zeros(num_chunks * E, dtype=torch.int64, device=idx_N.device)
    return counts_CE.index_put_((chunk_S * E + expert_S,), keep_S.long(), accumulate=True).view(num_chunks, E)
