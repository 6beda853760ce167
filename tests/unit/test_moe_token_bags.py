"""The fused gather / per-token sum primitives against plain autograd on index ops.

The reference for every case is what autograd computes through ``index_select``, ``mul`` and
``index_add`` (the obvious implementation), forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.models.moe.token_bags import (
    bags_by_index,
    bags_from_copies,
    gather_rows,
    permute_rows,
    sum_rows,
    weighted_scatter,
)


def _ref_weighted(y_MD, w_M, index_M, num_bags):
    out_ND = torch.zeros(num_bags, y_MD.shape[1], dtype=y_MD.dtype)
    return out_ND.index_add(0, index_M, y_MD * w_M[:, None].to(y_MD.dtype))


def _grads(fn, *inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs]


def test_bags_by_index_lists_rows_per_bag_in_row_order_with_empty_bags():
    index_M = torch.tensor([2, 0, 2, 4, 0])
    bags = bags_by_index(index_M, 6)
    assert bags.rows_I.tolist() == [1, 4, 0, 2, 3]
    assert bags.offsets_T.tolist() == [0, 2, 2, 4, 4, 5]  # bags 1, 3 and 5 are empty
    assert bags.num_bags == 6


def test_bags_from_copies_inverts_a_full_permutation_and_sorts_a_partial_one():
    # Copies t*K+k of T=3 tokens, K=2, in some expert order.
    order_M = torch.tensor([3, 0, 5, 1, 2, 4])
    full = bags_from_copies(order_M, num_tokens=3, top_k=2)
    assert full.rows_I.tolist() == [1, 3, 4, 0, 5, 2]  # row holding copy 0, copy 1, ...
    assert full.offsets_T.tolist() == [0, 2, 4]
    # Copies 1 and 4 dropped: token 0 keeps copy 0, token 1 copy 3, token 2 copy 5.
    kept_M = torch.tensor([3, 0, 5, 2])
    part = bags_from_copies(kept_M, num_tokens=3, top_k=2)
    assert part.rows_I.tolist() == [1, 0, 3, 2]
    assert part.offsets_T.tolist() == [0, 1, 3]


@pytest.mark.parametrize("num_rows,num_bags", [(40, 10), (7, 12), (0, 4)])
def test_weighted_scatter_matches_index_add_forward_and_backward(num_rows, num_bags):
    g = torch.Generator().manual_seed(num_rows)
    index_M = torch.randint(0, num_bags, (num_rows,), generator=g)
    y_MD = torch.randn(num_rows, 16, generator=g, dtype=torch.float64)
    w_M = torch.rand(num_rows, generator=g, dtype=torch.float64)
    grad_TD = torch.randn(num_bags, 16, generator=g, dtype=torch.float64)
    out, (gy, gw) = _grads(lambda y, w: weighted_scatter(y, w, index_M, num_bags), y_MD, w_M, grad_out=grad_TD)
    ref, (ry, rw) = _grads(lambda y, w: _ref_weighted(y, w, index_M, num_bags), y_MD, w_M, grad_out=grad_TD)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gy, ry, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-12)


def test_weighted_scatter_in_bf16_keeps_fp32_weight_gradients_close():
    g = torch.Generator().manual_seed(3)
    index_M = torch.randint(0, 8, (24,), generator=g)
    y_MD = torch.randn(24, 32, generator=g)
    w_M = torch.rand(24, generator=g)
    grad_TD = torch.randn(8, 32, generator=g)
    out, (gy, gw) = _grads(lambda y, w: weighted_scatter(y, w, index_M, 8), y_MD.bfloat16(), w_M,
                           grad_out=grad_TD.bfloat16())
    ref, (ry, rw) = _grads(lambda y, w: _ref_weighted(y, w, index_M, 8), y_MD, w_M, grad_out=grad_TD)
    assert out.dtype == torch.bfloat16 and gw.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gy.float(), ry, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, rw, rtol=5e-2, atol=5e-2)


def test_gather_rows_backward_sums_the_gradients_of_repeated_rows():
    g = torch.Generator().manual_seed(1)
    index_M = torch.tensor([3, 1, 3, 3, 0])  # token 2 never gathered, token 3 three times
    x_TD = torch.randn(4, 8, generator=g, dtype=torch.float64)
    grad_MD = torch.randn(5, 8, generator=g, dtype=torch.float64)
    bags = bags_by_index(index_M, 4)
    out, (gx,) = _grads(lambda x: gather_rows(x, index_M, bags), x_TD, grad_out=grad_MD)
    ref, (rx,) = _grads(lambda x: x.index_select(0, index_M), x_TD, grad_out=grad_MD)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, rx, rtol=1e-12, atol=1e-12)
    assert torch.all(gx[2] == 0)


def test_sum_rows_and_permute_rows_match_index_ops():
    g = torch.Generator().manual_seed(2)
    index_M = torch.tensor([1, 4, 1, 0])
    y_MD = torch.randn(4, 8, generator=g, dtype=torch.float64)
    grad_TD = torch.randn(5, 8, generator=g, dtype=torch.float64)
    bags = bags_by_index(index_M, 5)
    out, (gy,) = _grads(lambda y: sum_rows(y, index_M, bags), y_MD, grad_out=grad_TD)
    ref, (ry,) = _grads(lambda y: torch.zeros(5, 8, dtype=y.dtype).index_add(0, index_M, y), y_MD, grad_out=grad_TD)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gy, ry, rtol=0, atol=0)

    perm_M = torch.tensor([2, 0, 3, 1])
    inverse_M = torch.argsort(perm_M)
    grad_MD = torch.randn(4, 8, generator=g, dtype=torch.float64)
    out, (gy,) = _grads(lambda y: permute_rows(y, perm_M, inverse_M), y_MD, grad_out=grad_MD)
    ref, (ry,) = _grads(lambda y: y.index_select(0, perm_M), y_MD, grad_out=grad_MD)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(gy, ry, rtol=0, atol=0)
