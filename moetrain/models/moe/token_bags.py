"""Row gathers and per-token (weighted) sums for dispatch and combine, one memory pass each.

Dispatch gathers token rows into expert order (``x_MD = x_TD[token_idx_M]``); the backward of that
gather and the combine both sum rows back per token. ``index_add_`` into a zero-filled output does
the sum in three passes (fill, scaled copy, scattered add) and the combine's weight gradient needs
an ``[M, D]`` temporary. ``torch.embedding_bag`` sums (optionally weighted) lists of rows straight
into its output, so each token's kept rows are described once as a *bag*: the row ids of all kept
copies in token order plus each token's offset. The expert GEMMs evict these tensors from the CPU
caches, so every pass saved is a full trip to memory: against index_add and a gathered temporary
this cut the layer's forward+backward by ~7% on the fine-grained benchmark shape B (314 -> 292 ms)
and ~2% on shape A (see BENCHMARKS.md).

Shape legend: T tokens (bags), M rows (kept copies; each row belongs to exactly one bag),
D model dim, I = M entries of the bags (row ids, grouped by bag).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_SUM = 0  # embedding_bag mode "sum"


@dataclass
class TokenBags:
    """Which rows make up each bag: ``rows_I[offsets_T[t]:offsets_T[t+1]]`` are the rows of token t."""

    rows_I: torch.Tensor
    offsets_T: torch.Tensor
    num_bags: int


def bags_by_index(index_M: torch.Tensor, num_bags: int) -> TokenBags:
    """Bags from each row's bag id (any order, repeats allowed, bags may be empty)."""
    # Stable, so a bag lists its rows in row order: the sums are deterministic.
    rows_I = torch.sort(index_M, stable=True).indices
    counts_T = torch.zeros(num_bags, dtype=torch.int64, device=index_M.device)
    counts_T.scatter_add_(0, index_M, torch.ones_like(index_M))
    return TokenBags(rows_I, torch.cumsum(counts_T, dim=0) - counts_T, num_bags)


def bags_from_copies(copy_idx_M: torch.Tensor, num_tokens: int, top_k: int) -> TokenBags:
    """Bags from the token-major copy id ``t * K + k`` of each row (ids unique).

    Dropless, the rows are a permutation of all T*K copies: inverting it is one scatter instead of
    a sort, and every bag has exactly K rows.
    """
    num_rows = copy_idx_M.numel()
    if num_rows != num_tokens * top_k:
        return bags_by_index(torch.div(copy_idx_M, top_k, rounding_mode="floor"), num_tokens)
    dev = copy_idx_M.device
    rows_I = torch.empty_like(copy_idx_M).index_copy_(0, copy_idx_M, torch.arange(num_rows, device=dev))
    return TokenBags(rows_I, torch.arange(0, num_rows, top_k, device=dev), num_tokens)


class _GatherRows(torch.autograd.Function):
    """``x[index_M]``; backward sums each bag's row gradients with one ``embedding_bag``."""

    @staticmethod
    def forward(ctx, x_TD, index_M, rows_I, offsets_T):
        ctx.save_for_backward(rows_I, offsets_T)
        return x_TD.index_select(0, index_M)

    @staticmethod
    def backward(ctx, grad_MD):
        rows_I, offsets_T = ctx.saved_tensors
        grad_TD = F.embedding_bag(rows_I, grad_MD.contiguous(), offsets_T, mode="sum")
        return grad_TD, None, None, None


def gather_rows(x_TD: torch.Tensor, index_M: torch.Tensor, bags: TokenBags) -> torch.Tensor:
    """Rows ``x_TD[index_M]``; ``bags`` must describe ``index_M`` (see :func:`bags_by_index`)."""
    return _GatherRows.apply(x_TD, index_M, bags.rows_I, bags.offsets_T)


class _WeightedSum(torch.autograd.Function):
    """``out[t] = sum of w * y over the rows of bag t`` as one weighted ``embedding_bag``.

    Backward: the gradient of y is the output gradient of each row's bag scaled by its weight
    (again one ``embedding_bag``, of single-row bags); the gradient of a weight is the dot product
    of that output gradient with the row, which is what embedding_bag's own per-sample-weight
    backward computes without materialising the gathered ``[M, D]`` gradient.
    """

    @staticmethod
    def forward(ctx, y_MD, weights_M, index_M, rows_I, offsets_T):
        y_MD = y_MD.contiguous()
        weights_I = weights_M.index_select(0, rows_I).to(y_MD.dtype)
        out_TD, offset2bag, _, _ = torch.ops.aten._embedding_bag(
            y_MD, rows_I, offsets_T, False, _SUM, False, weights_I)
        ctx.save_for_backward(y_MD, weights_M, index_M, rows_I, offsets_T, offset2bag)
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        y_MD, weights_M, index_M, rows_I, offsets_T, offset2bag = ctx.saved_tensors
        grad_TD = grad_TD.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            # Bags of one row each. The weights are detached: embedding_bag otherwise prepares
            # for their gradient (the slower kernel that also builds offset2bag and bag sizes).
            one_row_M = torch.arange(index_M.numel(), device=index_M.device)
            grad_y = F.embedding_bag(index_M, grad_TD, one_row_M, mode="sum",
                                     per_sample_weights=weights_M.detach().to(grad_TD.dtype))
        if ctx.needs_input_grad[1]:
            grad_w_I = torch.ops.aten._embedding_bag_per_sample_weights_backward(
                grad_TD, y_MD, rows_I, offsets_T, offset2bag, _SUM)
            # Every row is in exactly one bag: rows_I is a permutation of the M rows.
            grad_w = torch.empty_like(weights_M).index_copy_(0, rows_I, grad_w_I.to(weights_M.dtype))
        return grad_y, grad_w, None, None, None


def weighted_scatter(y_MD: torch.Tensor, weights_M: torch.Tensor, token_idx_M: torch.Tensor,
                     num_tokens: int, bags: TokenBags | None = None) -> torch.Tensor:
    """``out[t] = sum of w * y over the rows whose token is t`` (``[num_tokens, D]``); tokens
    without rows (all copies dropped) get zeros. Pass ``bags`` when the caller has them already."""
    if bags is None:
        bags = bags_by_index(token_idx_M, num_tokens)
    return _WeightedSum.apply(y_MD, weights_M, token_idx_M, bags.rows_I, bags.offsets_T)


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MD, index_M, rows_I, offsets_T):
        ctx.save_for_backward(index_M)
        return F.embedding_bag(rows_I, y_MD.contiguous(), offsets_T, mode="sum")

    @staticmethod
    def backward(ctx, grad_TD):
        (index_M,) = ctx.saved_tensors
        return grad_TD.index_select(0, index_M), None, None, None


def sum_rows(y_MD: torch.Tensor, index_M: torch.Tensor, bags: TokenBags) -> torch.Tensor:
    """``out[t] = sum of the rows whose bag id (index_M) is t``, unweighted; backward is a gather."""
    return _SumRows.apply(y_MD, index_M, bags.rows_I, bags.offsets_T)


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation; backward gathers with the inverse instead of scattering."""

    @staticmethod
    def forward(ctx, x_MD, perm_M, inverse_M):
        ctx.save_for_backward(inverse_M)
        return x_MD.index_select(0, perm_M)

    @staticmethod
    def backward(ctx, grad_MD):
        (inverse_M,) = ctx.saved_tensors
        return grad_MD.index_select(0, inverse_M), None, None


def permute_rows(x_MD: torch.Tensor, perm_M: torch.Tensor, inverse_M: torch.Tensor) -> torch.Tensor:
    """Rows ``x_MD[perm_M]`` where ``perm_M`` is a permutation and ``inverse_M`` its inverse."""
    return _PermuteRows.apply(x_MD, perm_M, inverse_M)
