"""Hand-worked cases of the permutation: capacity, sort order, which copies are dropped, combine.

The running example (T=4 tokens, K=2, E=5; expert 4 gets no token)::

    token  experts  weights        flat copies n = t*K + k
    t0     [0, 1]   [0.6, 0.4]     n0 -> e0 (0.6)   n1 -> e1 (0.4)
    t1     [1, 2]   [0.7, 0.3]     n2 -> e1 (0.7)   n3 -> e2 (0.3)
    t2     [1, 0]   [0.6, 0.4]     n4 -> e1 (0.6)   n5 -> e0 (0.4)
    t3     [1, 3]   [0.6, 0.4]     n6 -> e1 (0.6)   n7 -> e3 (0.4)

Expert 1 is over-subscribed (4 copies). With capacity 2, "position" keeps t0, t1 and "score"
keeps t1 (0.7) and t2 (0.6; it ties with t3, the earlier token wins).
"""

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import LocalDispatcher, MoELayer, expert_capacity
from moetrain.models.moe.dispatcher import capacity_keep_mask, sort_by_expert
from tests.helpers.moe_reference import reference_capacity

NUM_EXPERTS = 5
IDX_TK = torch.tensor([[0, 1], [1, 2], [1, 0], [1, 3]])
WEIGHTS_TK = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.6, 0.4], [0.6, 0.4]])
NUM_ROUTED_E = [2, 4, 1, 1, 0]


def token_rows(num_tokens: int) -> torch.Tensor:
    """x[t] = (t+1) * [1, 10, -1]: each row names its token and no row is zero."""
    return torch.arange(1, num_tokens + 1, dtype=torch.float32)[:, None] * torch.tensor([1.0, 10.0, -1.0])


# ---------------------------------------------------------------- capacity

@pytest.mark.parametrize("num_tokens, num_experts, top_k, factor, expected", [
    (8, 4, 2, 1.0, 4),      # exactly T*K/E
    (8, 4, 2, 1.25, 5),     # 1.25 * 4 = 5
    (10, 4, 2, 1.0, 5),
    (10, 4, 1, 1.0, 3),     # ceil(2.5)
    (3, 8, 1, 1.0, 1),      # ceil(0.375): never zero
    (7, 3, 2, 0.5, 3),      # ceil(2.33)
    (6, 4, 2, 4.0, 12),     # factor E: T*K, nothing can drop
    (16, 8, 2, 0.25, 1),
])
def test_expert_capacity_is_ceil_of_factor_times_tokens_per_expert(num_tokens, num_experts, top_k, factor,
                                                                   expected):
    ref = reference_capacity(num_tokens, num_experts=num_experts, top_k=top_k, capacity_factor=factor)
    assert ref == expected
    got = expert_capacity(num_tokens, num_experts=num_experts, top_k=top_k, capacity_factor=factor)
    assert got == expected


@pytest.mark.parametrize("num_tokens, num_experts, top_k, factor, expected", [
    (50, 2, 2, 1.1, 55),    # 1.1 * 100 / 2 = 55 exactly; in doubles 55.00000000000001 -> ceil 56
    (100, 10, 1, 1.1, 11),  # 1.1 * 100 / 10 = 11; in doubles 11.000000000000002 -> ceil 12
])
def test_expert_capacity_is_not_rounded_up_by_float_error(num_tokens, num_experts, top_k, factor, expected):
    """A decimal factor whose product is a whole number must not gain a slot from binary rounding."""
    got = expert_capacity(num_tokens, num_experts=num_experts, top_k=top_k, capacity_factor=factor)
    assert got == expected


# ---------------------------------------------------------------- sort order and keep mask

def test_sort_by_expert_position_keeps_token_order_inside_each_expert():
    order_N = sort_by_expert(IDX_TK, WEIGHTS_TK, drop_policy="position")
    assert order_N.tolist() == [0, 5, 1, 2, 4, 6, 3, 7]


def test_sort_by_expert_score_puts_the_highest_weight_first_inside_each_expert():
    order_N = sort_by_expert(IDX_TK, WEIGHTS_TK, drop_policy="score")
    # e1's copies: n2 (0.7), then n4 and n6 (0.6, token order), then n1 (0.4).
    assert order_N.tolist() == [0, 5, 2, 4, 6, 1, 3, 7]


@pytest.mark.parametrize("capacity, expected", [
    (4, [True] * 8),
    (2, [True, True, True, True, False, False, True, True]),
    (1, [True, False, True, False, False, False, True, True]),
])
def test_capacity_keep_mask_keeps_the_first_copies_of_each_expert(capacity, expected):
    sorted_expert_N = torch.tensor([0, 0, 1, 1, 1, 1, 2, 3])
    keep_N = capacity_keep_mask(sorted_expert_N, torch.tensor(NUM_ROUTED_E), capacity)
    assert keep_N.tolist() == expected


# ---------------------------------------------------------------- dispatch and combine

# capacity factor, drop_policy -> tokens each expert receives, dropped copies, kept weight sum per
# token. The dispatcher turns the factor into a capacity over its T=4 tokens: ceil(f * 4 * 2 / 5),
# 2 for f=1.0 ("cap2") and 1 for f=0.5 ("cap1").
DISPATCH_CASES = {
    "dropless": (None, "position", [[0, 2], [0, 1, 2, 3], [1], [3], []], 0, [1.0, 1.0, 1.0, 1.0]),
    "position_cap2": (1.0, "position", [[0, 2], [0, 1], [1], [3], []], 2, [1.0, 1.0, 0.4, 0.4]),
    "score_cap2": (1.0, "score", [[0, 2], [1, 2], [1], [3], []], 2, [0.6, 1.0, 1.0, 0.4]),
    # Capacity 1: token 2 loses both its copies and must come back as an exact zero row.
    "position_cap1": (0.5, "position", [[0], [0], [1], [3], []], 4, [1.0, 0.3, 0.0, 0.4]),
    "score_cap1": (0.5, "score", [[0], [1], [1], [3], []], 4, [0.6, 1.0, 0.0, 0.4]),
}


@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_dispatch_cases_have_the_capacity_their_name_says(case):
    factor = DISPATCH_CASES[case][0]
    if factor is not None:
        capacity = expert_capacity(4, num_experts=NUM_EXPERTS, top_k=2, capacity_factor=factor)
        assert capacity == int(case[-1])

# Which copy (t, k) each case keeps; the others are dropped.
KEEP_TK = {
    "dropless": [[1, 1], [1, 1], [1, 1], [1, 1]],
    "position_cap2": [[1, 1], [1, 1], [0, 1], [0, 1]],
    "score_cap2": [[1, 0], [1, 1], [1, 1], [0, 1]],
    "position_cap1": [[1, 1], [0, 1], [0, 0], [0, 1]],
    "score_cap1": [[1, 0], [1, 1], [0, 0], [0, 1]],
}


@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_dispatch_groups_copies_by_expert_and_drops_the_right_ones(case):
    factor, policy, tokens_per_expert, num_dropped, _ = DISPATCH_CASES[case]
    x_TD = token_rows(4)
    d = LocalDispatcher(NUM_EXPERTS).dispatch(x_TD, IDX_TK, WEIGHTS_TK, capacity_factor=factor, drop_policy=policy)

    assert d.num_routed_per_expert.tolist() == NUM_ROUTED_E
    assert d.num_tokens_per_expert.tolist() == [len(toks) for toks in tokens_per_expert]
    assert int(d.num_dropped) == num_dropped
    assert d.x_MD.shape == (8 - num_dropped, 3)
    # Block e of x_MD holds copies of exactly the tokens expert e keeps (expert 0 first).
    token_of_row_M = (d.x_MD[:, 0] - 1).long()
    blocks = token_of_row_M.split(d.num_tokens_per_expert.tolist())
    assert [sorted(b.tolist()) for b in blocks] == tokens_per_expert
    torch.testing.assert_close(d.x_MD, x_TD[token_of_row_M], rtol=0, atol=0)
    assert d.token_idx_M.tolist() == token_of_row_M.tolist()
    assert d.num_token_rank_sends is None, "all experts are local: nothing is sent"


@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_combine_sums_the_kept_copies_and_dropped_copies_add_zero(case):
    factor, policy, _, _, kept_weight_T = DISPATCH_CASES[case]
    x_TD = token_rows(4).requires_grad_()
    weights_TK = WEIGHTS_TK.clone().requires_grad_()
    dispatcher = LocalDispatcher(NUM_EXPERTS)
    d = dispatcher.dispatch(x_TD, IDX_TK, weights_TK, capacity_factor=factor, drop_policy=policy)
    # A stand-in expert e that multiplies by (e + 1), so a copy paired with the wrong weight shows.
    scale_M = torch.repeat_interleave(torch.arange(1.0, NUM_EXPERTS + 1), d.num_tokens_per_expert)
    out_TD = dispatcher.combine(d.x_MD * scale_M[:, None], d.state)

    keep_TK = torch.tensor(KEEP_TK[case], dtype=torch.float32)
    factor_T = (keep_TK * WEIGHTS_TK * (IDX_TK + 1)).sum(dim=1)
    torch.testing.assert_close(out_TD, factor_T[:, None] * x_TD.detach(), rtol=1e-6, atol=1e-6)
    # The plain weight sums of the docstring table, for the reader.
    torch.testing.assert_close((keep_TK * WEIGHTS_TK).sum(dim=1), torch.tensor(kept_weight_T))
    if case.endswith("cap1"):
        assert torch.equal(out_TD[2], torch.zeros(3)), "a token whose copies all dropped must be a zero row"

    # d out / d w_tk is the copy's expert output (zero when dropped); d out / d x_t sums the kept paths.
    out_TD.sum().backward()
    row_sum_T = x_TD.detach().sum(dim=1)
    torch.testing.assert_close(weights_TK.grad, keep_TK * (IDX_TK + 1) * row_sum_T[:, None])
    torch.testing.assert_close(x_TD.grad, factor_T[:, None].expand(4, 3))


def test_all_copies_to_one_expert_and_experts_with_no_token():
    # K=1, every token to expert 3 of 4: the other experts get empty blocks.
    idx_TK = torch.full((6, 1), 3)
    weights_TK = torch.linspace(0.2, 0.7, 6)[:, None]
    x_TD = token_rows(6)
    dispatcher = LocalDispatcher(4)
    d = dispatcher.dispatch(x_TD, idx_TK, weights_TK)
    assert d.num_tokens_per_expert.tolist() == [0, 0, 0, 6]
    torch.testing.assert_close(d.x_MD, x_TD, rtol=0, atol=0)
    torch.testing.assert_close(dispatcher.combine(d.x_MD, d.state), weights_TK * x_TD)

    # Capacity ceil(1.0 * 6 * 1 / 4) = ceil(1.5) = 2.
    for policy, kept in (("position", [0, 1]), ("score", [4, 5])):
        d = dispatcher.dispatch(x_TD, idx_TK, weights_TK, capacity_factor=1.0, drop_policy=policy)
        assert d.num_tokens_per_expert.tolist() == [0, 0, 0, 2]
        assert d.num_routed_per_expert.tolist() == [0, 0, 0, 6]
        assert int(d.num_dropped) == 4
        out_TD = dispatcher.combine(d.x_MD, d.state)
        expected_TD = torch.zeros_like(x_TD)
        expected_TD[kept] = weights_TK[kept] * x_TD[kept]
        torch.testing.assert_close(out_TD, expected_TD)


def test_top_k_equal_to_num_experts_sends_every_token_everywhere():
    idx_TK = torch.tensor([[2, 0, 1], [0, 1, 2], [1, 2, 0]])
    weights_TK = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.35, 0.25], [0.6, 0.3, 0.1]])
    x_TD = token_rows(3)
    dispatcher = LocalDispatcher(3)
    d = dispatcher.dispatch(x_TD, idx_TK, weights_TK)
    assert d.num_tokens_per_expert.tolist() == [3, 3, 3]
    blocks = (d.x_MD[:, 0] - 1).long().split([3, 3, 3])
    assert [sorted(b.tolist()) for b in blocks] == [[0, 1, 2]] * 3
    torch.testing.assert_close(dispatcher.combine(d.x_MD, d.state), x_TD)  # weights sum to 1


# ---------------------------------------------------------------- drops seen through the layer

def test_layer_drops_by_position_or_score_and_reports_the_dropped_fraction():
    # dim == E and an identity gate: each row of x is its token's logits. K=1, capacity
    # ceil(1.0 * 8 * 1 / 4) = 2. Expert 2 is asked by six tokens, expert 3 by none.
    e2_logit_T = [1.0, 3.0, 2.0, 3.0, 0.5, None, None, 4.0]
    x_TD = torch.zeros(8, 4)
    for t, logit in enumerate(e2_logit_T):
        if logit is not None:
            x_TD[t, 2] = logit
    x_TD[5, 0] = 2.0
    x_TD[6, 1] = 2.0
    for policy, kept_on_e2 in (("position", {0, 1}), ("score", {7, 1})):  # score: t1 beats t3 (tie, earlier)
        cfg = MoEConfig(num_experts=4, top_k=1, expert_hidden_dim=8, capacity_factor=1.0, drop_policy=policy,
                        expert_impl="loop")
        torch.manual_seed(0)
        layer = MoELayer(4, cfg)
        with torch.no_grad():
            layer.router.gate.weight.copy_(torch.eye(4))
            for w in (layer.experts.w1, layer.experts.w2):
                w.normal_(0.0, 1.0)
        out_TD, aux = layer(x_TD)
        assert aux.num_routed_per_expert.tolist() == [1, 1, 6, 0]
        assert int(aux.num_dropped) == 4
        assert aux.num_routed == 8
        assert float(aux.dropped_fraction) == pytest.approx(0.5)
        for t in range(8):
            dropped = t not in kept_on_e2 and t not in (5, 6)
            if dropped:
                assert torch.equal(out_TD[t], torch.zeros(4)), f"{policy}: dropped token {t} must output zero"
            else:
                assert out_TD[t].abs().sum() > 0, f"{policy}: kept token {t} has no expert output"
