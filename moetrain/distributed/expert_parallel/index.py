"""Index math of the all-to-all dispatcher (``moetrain.distributed.expert_parallel.dispatcher``): pure functions
of routing counts, no communication.

Shape legend: E experts, L local experts, P ranks in the ep group, R copies received.
"""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor | None) -> list[list[int] | None]:
    """Several small integer tensors read in one host sync (None stays None)."""
    present = [t.reshape(-1) for t in tensors if t is not None]
    flat = torch.cat(present).tolist()
    out, start = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(flat[start:start + t.numel()])
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
