"""Hand-worked cases of every router, and the MoE layer with each router against the naive
reference (routing_reference.py): outputs, gradients of the input and of every parameter.

Identity gates (dim == E) make each input row the router logits, so scores are set by hand.
"""

import math

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import MoELayer
from moetrain.models.moe.balance import load_balancing_loss, sequence_load_balancing_loss
from moetrain.models.moe.router import ExpertChoiceRouter, TopKRouter, limit_to_groups
from tests.helpers.routing_reference import (
    apply_routes,
    expert_choice_routes,
    sequence_balance_loss,
    token_choice_routes,
)

# fp32, three summation orders (grouped GEMM, per-expert loop, dense reference): a gradient element
# sums ~100 products of size ~0.1, and AVX2 and AVX-512 kernels round those sums apart by ~1e-6.
FP32_TOL = {"rtol": 1e-5, "atol": 4e-6}


def identity(router: TopKRouter) -> TopKRouter:
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(router.num_experts))
    return router


def logit(p: float) -> float:
    """The logit whose sigmoid is p."""
    return math.log(p / (1.0 - p))


# ----- sigmoid scores and the auxiliary-loss-free bias -------------------------------------------

SIGMOID_SCORES = [0.9, 0.75, 0.5, 0.25]


def test_sigmoid_router_weights_are_the_selected_scores_renormalised():
    router = identity(TopKRouter(4, 4, top_k=2, score_func="sigmoid"))
    out = router(torch.tensor([[logit(p) for p in SIGMOID_SCORES]]))
    assert out.idx_TK.tolist() == [[0, 1]]
    torch.testing.assert_close(out.weights_TK, torch.tensor([[0.9 / 1.65, 0.75 / 1.65]]))
    # probs: the sigmoid scores over their sum (2.4), for the balance loss and the entropy.
    torch.testing.assert_close(out.probs_TE, torch.tensor([SIGMOID_SCORES]) / 2.4)
    raw = identity(TopKRouter(4, 4, top_k=2, score_func="sigmoid", renormalize=False))(
        torch.tensor([[logit(p) for p in SIGMOID_SCORES]]))
    torch.testing.assert_close(raw.weights_TK, torch.tensor([[0.9, 0.75]]))


def test_bias_changes_the_selection_but_not_the_gate_weights():
    router = identity(TopKRouter(4, 4, top_k=2, score_func="sigmoid", bias=True))
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.5, 0.0]))
    x = torch.tensor([[logit(p) for p in SIGMOID_SCORES]], requires_grad=True)
    out = router(x)
    # Selection scores 0.9, 0.75, 1.0, 0.25: experts 2 then 0. Weights from the unbiased 0.5, 0.9.
    assert out.idx_TK.tolist() == [[2, 0]]
    torch.testing.assert_close(out.weights_TK, torch.tensor([[0.5 / 1.4, 0.9 / 1.4]]))
    # The gradient flows through the unbiased scores only: d w_0 / d x_2 = -s2'(x) * 0.9 / 1.4^2 ...
    out.weights_TK[0, 0].backward()
    s = torch.tensor(SIGMOID_SCORES)
    ds = s * (1 - s)
    expected = torch.tensor([-0.5 / 1.4 ** 2 * ds[0], 0.0, (1.4 - 0.5) / 1.4 ** 2 * ds[2], 0.0])
    torch.testing.assert_close(x.grad[0], expected)
    assert not router.expert_bias.requires_grad


def test_bias_on_a_softmax_router_also_only_selects():
    router = identity(TopKRouter(4, 4, top_k=1, bias=True))
    router.expert_bias.copy_(torch.tensor([0.0, 0.3, 0.0, 0.0]))
    probs = [0.4, 0.3, 0.2, 0.1]
    out = router(torch.tensor([probs]).log())
    assert out.idx_TK.tolist() == [[1]]  # 0.3 + 0.3 > 0.4
    torch.testing.assert_close(out.weights_TK, torch.tensor([[0.3]]))


def test_routed_scaling_factor_multiplies_the_weights_after_renormalisation():
    x = torch.tensor([[logit(p) for p in SIGMOID_SCORES]])
    out = identity(TopKRouter(4, 4, top_k=2, score_func="sigmoid", scaling_factor=2.5))(x)
    assert out.idx_TK.tolist() == [[0, 1]]
    torch.testing.assert_close(out.weights_TK, 2.5 * torch.tensor([[0.9 / 1.65, 0.75 / 1.65]]))
    torch.testing.assert_close(out.probs_TE, torch.tensor([SIGMOID_SCORES]) / 2.4)  # the balance loss's: unscaled
    raw = identity(TopKRouter(4, 4, top_k=2, score_func="sigmoid", renormalize=False, scaling_factor=16.0))(x)
    torch.testing.assert_close(raw.weights_TK, 16.0 * torch.tensor([[0.9, 0.75]]))


def test_sigmoid_weights_stay_finite_when_every_selected_score_underflows():
    """Logits far below -88 give sigmoid scores of exactly 0 in fp32: the renormalisation's eps
    (DeepSeek-V3's 1e-20) turns 0 / 0 into 0 instead of NaN."""
    router = identity(TopKRouter(4, 4, top_k=2, score_func="sigmoid"))
    out = router(torch.full((1, 4), -200.0))
    assert torch.sigmoid(torch.tensor(-200.0)) == 0
    assert torch.equal(out.weights_TK, torch.zeros(1, 2))


@pytest.mark.parametrize("cast", [
    lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.double(),
    lambda m: m.to("meta"),
], ids=["to_bf16", "half", "bfloat16", "double", "to_meta"])
def test_the_selection_bias_stays_fp32_under_module_casts(cast):
    layer = MoELayer(8, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8, router="sigmoid", expert_bias=True))
    # Values bf16 cannot hold (8 mantissa bits): a cast there and back would change them.
    bias = torch.tensor([1.001234567, -0.000123456, 0.25 + 2.0**-20, -0.3 - 2.0**-18])
    layer.router.expert_bias.copy_(bias)
    cast(layer)
    assert layer.router.expert_bias.dtype == torch.float32
    assert "router.expert_bias" in dict(layer.named_buffers())
    if layer.router.expert_bias.is_meta:
        return
    assert torch.equal(layer.router.expert_bias, bias)
    assert layer.router.gate.weight.dtype != torch.float32  # the cast did reach the parameters


def test_a_bf16_layer_selects_with_its_fp32_bias():
    """Biases 0.3 and 0.3 + 2**-12 differ by less than bf16's resolution there (2**-9): rounded
    to bf16 they would tie (and the tie would go to expert 1); in fp32 expert 2 wins, in the bf16
    layer as in the fp32 one."""
    layer = MoELayer(4, MoEConfig(num_experts=4, top_k=1, expert_hidden_dim=8, router="sigmoid", expert_bias=True))
    identity(layer.router)
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.3, 0.3 + 2.0**-12, 0.0]))
    assert torch.equal(layer.router.expert_bias.bfloat16()[1], layer.router.expert_bias.bfloat16()[2])
    x = torch.zeros(1, 4)  # every score 0.5: the bias alone decides
    assert layer.router(x).idx_TK.tolist() == [[2]]
    layer.to(torch.bfloat16)
    assert layer.router(x.bfloat16()).idx_TK.tolist() == [[2]]
    assert layer(x.bfloat16())[0].dtype == torch.bfloat16


def test_a_fixed_bias_is_registered_and_saved_without_an_update_rate():
    layer = MoELayer(8, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8, router="sigmoid", expert_bias=True))
    assert layer.config.router_bias_update_rate == 0
    assert layer.router.expert_bias.dtype == torch.float32 and torch.equal(layer.router.expert_bias, torch.zeros(4))
    assert "router.expert_bias" in layer.state_dict()
    fresh = MoELayer(8, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8, router="sigmoid", expert_bias=True))
    layer.router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, -0.4]))
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.router.expert_bias, layer.router.expert_bias)


@pytest.mark.parametrize("counts, expected", [
    # mean 4: expert 0 over-loaded (-r), expert 1 under-loaded (+r), the others exactly at the mean.
    ([6, 2, 4, 4], [-1.0, 1.0, 0.0, 0.0]),
    # mean 2: signs [-1, 1, 1, 1] (mean step 0.5), centred to [-1.5, 0.5, 0.5, 0.5].
    ([5, 1, 1, 1], [-1.5, 0.5, 0.5, 0.5]),
    ([3, 3, 3, 3], [0.0, 0.0, 0.0, 0.0]),
])
def test_bias_update_hand_cases(counts, expected):
    router = TopKRouter(4, 4, top_k=2, score_func="sigmoid", bias=True)
    router.update_bias(torch.tensor(counts), rate=0.01)
    torch.testing.assert_close(router.expert_bias, 0.01 * torch.tensor(expected))
    router.update_bias(torch.tensor(counts), rate=0.01)  # the steps add up
    torch.testing.assert_close(router.expert_bias, 0.02 * torch.tensor(expected))


# ----- two-level (group-limited) routing ---------------------------------------------------------

def test_group_limit_keeps_the_best_groups_by_their_two_best_scores():
    # Groups of 2: g0 = {0,1} sums 0.09, g1 = {2,3} 0.22, g2 = {4,5} 0.35, g3 = {6,7} 0.34.
    # Expert 2 ties for the best score (0.20) but its group is third, so with 2 groups it is out.
    probs = [0.05, 0.04, 0.20, 0.02, 0.18, 0.17, 0.20, 0.14]
    x = torch.tensor([probs]).log()
    free = identity(TopKRouter(8, 8, top_k=2))(x)
    assert free.idx_TK.tolist() == [[2, 6]]  # the tie between 2 and 6 goes to the lower id
    limited = identity(TopKRouter(8, 8, top_k=2, num_groups=4, top_groups=2))(x)
    assert limited.idx_TK.tolist() == [[6, 4]]
    torch.testing.assert_close(limited.weights_TK, torch.tensor([[0.20 / 0.38, 0.18 / 0.38]]))
    one_group = identity(TopKRouter(8, 8, top_k=2, num_groups=4, top_groups=1))(x)
    assert one_group.idx_TK.tolist() == [[4, 5]]  # g2 = {4, 5} (0.35) alone: expert 6 is out too
    torch.testing.assert_close(one_group.weights_TK, torch.tensor([[0.18 / 0.35, 0.17 / 0.35]]))


def test_group_score_is_the_sum_of_two_not_the_max():
    # g0 = {0, 1}: one outlier 0.30 and 0.01 (sum 0.31); g1 = {2, 3}: 0.20 + 0.19 = 0.39 wins.
    probs = [0.30, 0.01, 0.20, 0.19, 0.10, 0.10, 0.05, 0.05]
    out = identity(TopKRouter(8, 8, top_k=2, num_groups=4, top_groups=1))(torch.tensor([probs]).log())
    assert out.idx_TK.tolist() == [[2, 3]]


def test_max_group_score_takes_the_group_of_the_best_expert():
    # The case above with DeepSeek-V2's "max": g0's outlier 0.30 beats g1's best 0.20.
    probs = [0.30, 0.01, 0.20, 0.19, 0.10, 0.10, 0.05, 0.05]
    out = identity(TopKRouter(8, 8, top_k=2, num_groups=4, top_groups=1, group_score="max"))(
        torch.tensor([probs]).log())
    assert out.idx_TK.tolist() == [[0, 1]]
    # Two groups: g0 (0.30) and g1 (0.20); the best two experts of those are 0 and 2.
    out = identity(TopKRouter(8, 8, top_k=2, num_groups=4, top_groups=2, group_score="max", renormalize=False))(
        torch.tensor([probs]).log())
    assert out.idx_TK.tolist() == [[0, 2]]
    torch.testing.assert_close(out.weights_TK, torch.tensor([[0.30, 0.20]]))


def test_group_limit_max_masks_whole_groups():
    select = torch.tensor([[0.1, 0.95, 0.9, 0.8, 0.3, 0.4]])
    inf = math.inf
    torch.testing.assert_close(limit_to_groups(select, num_groups=3, top_groups=1, score="max"),
                               torch.tensor([[0.1, 0.95, -inf, -inf, -inf, -inf]]))
    torch.testing.assert_close(limit_to_groups(select, num_groups=3, top_groups=1),
                               torch.tensor([[-inf, -inf, 0.9, 0.8, -inf, -inf]]))


def test_group_limit_masks_whole_groups():
    select = torch.tensor([[0.1, 0.2, 0.9, 0.8, 0.3, 0.4]])
    masked = limit_to_groups(select, num_groups=3, top_groups=1)
    inf = math.inf
    torch.testing.assert_close(masked, torch.tensor([[-inf, -inf, 0.9, 0.8, -inf, -inf]]))


def test_groups_aligned_to_ranks_keep_each_token_on_one_rank():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, top_k=2, num_groups=2, top_groups=1, init_std=1.0)
    out = router(torch.randn(64, 16))
    ranks_TK = out.idx_TK // 4  # 2 ranks of 4 experts
    assert (ranks_TK[:, 0] == ranks_TK[:, 1]).all()


# ----- expert choice -----------------------------------------------------------------------------

def test_expert_choice_each_expert_takes_its_best_tokens():
    # T=3, E=3, K=1, factor 1: capacity ceil(1 * 3 * 1 / 3) = 1 token per expert.
    # Expert 0 takes t0 (0.5), expert 1 takes t0 too (0.45 > 0.3, 0.2), expert 2 takes t2 (0.6):
    # t0 gets two experts, t1 none.
    probs = [[0.5, 0.45, 0.05], [0.3, 0.3, 0.4], [0.2, 0.2, 0.6]]
    cfg = MoEConfig(num_experts=3, top_k=1, expert_hidden_dim=8, router="expert_choice", capacity_factor=1.0,
                    z_loss_coef=0.0)
    torch.manual_seed(0)
    layer = MoELayer(3, cfg)
    identity(layer.router)
    x_TD = torch.tensor(probs).log()
    out_TD, aux = layer(x_TD)
    assert layer.capacity(3) == 1
    assert aux.num_routed_per_expert.tolist() == [1, 1, 1]
    assert int(aux.num_dropped) == 1 and aux.num_routed == 3  # one of three tokens skipped
    torch.testing.assert_close(aux.dropped_fraction, torch.tensor(1 / 3))
    torch.testing.assert_close(aux.load_balancing, torch.tensor(0.0))

    def expert(e, t):
        w1, w2 = layer.experts.w1[e], layer.experts.w2[e]
        return torch.nn.functional.gelu(x_TD[t] @ w1) @ w2

    with torch.no_grad():
        expected = torch.stack([0.5 * expert(0, 0) + 0.45 * expert(1, 0), torch.zeros(3), 0.6 * expert(2, 2)])
    torch.testing.assert_close(out_TD, expected, **FP32_TOL)


def test_expert_choice_router_offers_every_expert_with_its_softmax_score():
    router = identity(ExpertChoiceRouter(4, 4))
    probs = [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]
    out = router(torch.tensor(probs).log())
    assert out.idx_TK.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(out.weights_TK, torch.tensor(probs))


def test_expert_choice_ties_go_to_the_earlier_token():
    cfg = MoEConfig(num_experts=2, top_k=1, expert_hidden_dim=8, router="expert_choice", capacity_factor=1.0)
    layer = MoELayer(2, cfg)
    identity(layer.router)
    # T=4, capacity 2: all rows equal (scores 0.5, 0.5), so each expert takes tokens 0 and 1;
    # tokens 2 and 3 are skipped.
    out_TD, aux = layer(torch.ones(4, 2))
    assert int(aux.num_dropped) == 2
    assert (out_TD[2:] == 0).all() and (out_TD[:2] != 0).any()


# ----- jitter and noise --------------------------------------------------------------------------

def test_jitter_and_noise_only_in_training_and_within_bounds():
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    plain = identity(TopKRouter(4, 4, top_k=2))(x)
    jittery = identity(TopKRouter(4, 4, top_k=2, jitter=0.1, noise_std=0.0))
    jittery.eval()
    torch.testing.assert_close(jittery(x).logits_TE, plain.logits_TE, rtol=0, atol=0)
    jittery.train()
    logits = jittery(x).logits_TE
    ratio = logits / x  # identity gate: logit = x * u with u ~ U(0.9, 1.1)
    assert (ratio >= 0.9 - 1e-6).all() and (ratio <= 1.1 + 1e-6).all() and not torch.equal(logits, x)
    noisy = identity(TopKRouter(4, 4, top_k=2, noise_std=0.5))
    noisy.train()
    torch.manual_seed(1)
    got = noisy(x).logits_TE
    torch.manual_seed(1)
    torch.testing.assert_close(got, x + 0.5 * torch.randn_like(x))


# ----- sequence-level auxiliary loss -------------------------------------------------------------

def test_sequence_balance_loss_hand_case():
    # Sequence 0 sends both tokens to e0: f = [1, 0], P = [0.7, 0.3], loss 2 * 0.7 = 1.4.
    # Sequence 1 splits: f = [1/2, 1/2], P = [0.45, 0.55], loss 2 * 0.5 = 1.0. Mean 1.2.
    probs = [[[0.8, 0.2], [0.6, 0.4]], [[0.6, 0.4], [0.3, 0.7]]]
    idx = [[[0], [0]], [[0], [1]]]
    got = sequence_load_balancing_loss(torch.tensor(probs), torch.tensor(idx))
    torch.testing.assert_close(got, torch.tensor(1.2))
    assert sequence_balance_loss(probs, idx) == pytest.approx(1.2)
    # The batch-level loss of the same tokens is smaller: it does not see sequence 0's imbalance.
    batch = load_balancing_loss(torch.tensor(probs).view(4, 2), torch.tensor([3, 1]), top_k=1)
    torch.testing.assert_close(batch, torch.tensor(2 * (0.75 * 0.575 + 0.25 * 0.425)))


def test_layer_uses_the_sequence_dim_for_the_sequence_loss():
    cfg = MoEConfig(num_experts=2, top_k=1, expert_hidden_dim=8, aux_loss_type="sequence", aux_loss_coef=1.0,
                    z_loss_coef=0.0)
    layer = MoELayer(2, cfg)
    identity(layer.router)
    x_BSD = torch.tensor([[[0.8, 0.2], [0.6, 0.4]], [[0.6, 0.4], [0.3, 0.7]]]).log()
    _, aux = layer(x_BSD)
    torch.testing.assert_close(aux.load_balancing, torch.tensor(1.2))
    torch.testing.assert_close(aux.loss, torch.tensor(1.2))


# ----- each router in the layer against the naive reference --------------------------------------

DIM, NUM_EXPERTS = 16, 8
ROUTER_CASES = {
    "softmax_groups": {"num_expert_groups": 4, "top_groups": 2},
    "sigmoid": {"router": "sigmoid"},
    "sigmoid_bias_groups": {"router": "sigmoid", "router_bias_update_rate": 1e-3, "num_expert_groups": 2,
                            "top_groups": 1},
    "softmax_bias_raw_weights": {"router_bias_update_rate": 1e-3, "renormalize": False},
    "expert_choice": {"router": "expert_choice", "capacity_factor": 1.0},
    "expert_choice_swiglu": {"router": "expert_choice", "capacity_factor": 0.5, "activation": "swiglu"},
}


def build_layer(overrides: dict, *, num_shared: int, seed: int = 0) -> MoELayer:
    cfg = MoEConfig(**{"num_experts": NUM_EXPERTS, "top_k": 2, "expert_hidden_dim": 24, "aux_loss_coef": 0.0,
                       "z_loss_coef": 0.0, "num_shared_experts": num_shared, **overrides})
    torch.manual_seed(seed)
    layer = MoELayer(DIM, cfg)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.5 if name == "router.gate.weight" else p.shape[1] ** -0.5)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.normal_(0.0, 0.1)  # a bias that changes some selections
    return layer


@pytest.mark.parametrize("num_shared", [0, 1])
@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_layer_matches_reference(case, num_shared):
    layer = build_layer(ROUTER_CASES[case], num_shared=num_shared)
    c = layer.config
    gen = torch.Generator().manual_seed(1)
    x_TD = torch.randn(24, DIM, generator=gen)
    grad_TD = torch.randn(24, DIM, generator=gen)

    x = x_TD.clone().requires_grad_()
    out_TD, aux = layer(x)
    (out_TD * grad_TD).sum().backward()

    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    xr = x_TD.clone().requires_grad_()
    logits_TE = xr @ params["router.gate.weight"].t()
    if c.is_expert_choice:
        routes, capacity = expert_choice_routes(logits_TE, capacity_factor=c.capacity_factor, top_k=c.top_k)
        assert layer.capacity(24) == capacity
        skipped = sum(1 for r in routes if not r)
        assert int(aux.num_dropped) == skipped
        if case == "expert_choice_swiglu":
            assert skipped > 0, "the case must skip some tokens"
    else:
        bias = layer.router.expert_bias.tolist() if layer.router.expert_bias is not None else None
        routes = token_choice_routes(logits_TE, top_k=c.top_k, score_func=c.router, bias=bias,
                                     num_groups=c.num_expert_groups, top_groups=c.top_groups,
                                     renormalize=c.renormalize)
        counts = [sum(e == ex for r in routes for ex, _ in r) for e in range(NUM_EXPERTS)]
        assert aux.num_routed_per_expert.tolist() == counts
    ref_TD = apply_routes(xr, routes, params, c.activation)
    (ref_TD * grad_TD).sum().backward()

    torch.testing.assert_close(out_TD.detach(), ref_TD.detach(), **FP32_TOL)
    torch.testing.assert_close(x.grad, xr.grad, **FP32_TOL)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, **FP32_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_bias_changes_some_routes_in_the_reference_cases():
    """Guard: the bias cases above really exercise the bias (some selection differs without it)."""
    layer = build_layer(ROUTER_CASES["softmax_bias_raw_weights"], num_shared=0)
    x_TD = torch.randn(24, DIM, generator=torch.Generator().manual_seed(1))
    with_bias = layer.router(x_TD).idx_TK
    layer.router.expert_bias.zero_()
    assert not torch.equal(with_bias, layer.router(x_TD).idx_TK)


def test_default_router_is_the_unchanged_softmax_path():
    """The default config builds a plain softmax TopKRouter with no bias, groups or noise."""
    layer = MoELayer(8, MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8))
    r = layer.router
    assert type(r) is TopKRouter and r.score_func == "softmax" and r.expert_bias is None
    assert (r.num_groups, r.jitter, r.noise_std) == (1, 0.0, 0.0)
    assert set(layer.state_dict()) == {"router.gate.weight", "experts.w1", "experts.w2"}
