"""Hand-worked cases of the top-k router.

The gate is set to the identity (dim == num_experts), so each input row *is* the logits row and
the scores, top-k choices and weights below are worked out by hand.
"""

import math

import pytest
import torch

from moetrain.models.moe import TopKRouter


def identity_router(num_experts: int, *, top_k: int, renormalize: bool = True) -> TopKRouter:
    router = TopKRouter(num_experts, num_experts, top_k=top_k, renormalize=renormalize)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(num_experts))
    return router


def logits_for(probs: list[list[float]]) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (each row sums to 1)."""
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_known_scores_give_known_topk_and_weights():
    probs = [[0.1, 0.2, 0.3, 0.4],
             [0.4, 0.3, 0.2, 0.1],
             [0.1, 0.4, 0.2, 0.3],
             [0.05, 0.05, 0.6, 0.3]]
    out = identity_router(4, top_k=2)(logits_for(probs))
    assert out.idx_TK.dtype == torch.int64
    assert out.idx_TK.tolist() == [[3, 2], [0, 1], [1, 3], [2, 3]]
    expected_TK = torch.tensor([[4 / 7, 3 / 7], [4 / 7, 3 / 7], [4 / 7, 3 / 7], [2 / 3, 1 / 3]])
    torch.testing.assert_close(out.weights_TK, expected_TK, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.probs_TE, torch.tensor(probs), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logits_TE, logits_for(probs), rtol=0, atol=0)


def test_without_renormalisation_weights_are_the_softmax_probabilities():
    probs = [[0.1, 0.2, 0.3, 0.4], [0.05, 0.05, 0.6, 0.3]]
    out = identity_router(4, top_k=2, renormalize=False)(logits_for(probs))
    assert out.idx_TK.tolist() == [[3, 2], [2, 3]]
    torch.testing.assert_close(out.weights_TK, torch.tensor([[0.4, 0.3], [0.6, 0.3]]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("logits, top_k, expected_idx", [
    ([0.0, 0.0, 0.0, 0.0], 2, [0, 1]),        # all equal: the lowest ids
    ([0.0, 1.0, 1.0, 0.0], 2, [1, 2]),        # a tie for first place
    ([1.0, 0.0, 1.0, 1.0], 2, [0, 2]),        # three-way tie, lower ids win
    ([0.0, 0.0, 0.0, 1.0], 2, [3, 0]),        # a tie for second place
    ([2.0, 1.0, 2.0, 1.0], 3, [0, 2, 1]),     # ties at both cut points
    ([5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0], 3, [0, 1, 2]),
])
def test_ties_go_to_the_lower_expert_id(logits, top_k, expected_idx):
    router = identity_router(len(logits), top_k=top_k)
    # The same tied row at several batch positions, so a sort that is not stable would show.
    x_TE = torch.tensor([logits] * 5)
    for _ in range(2):  # deterministic: repeated calls agree
        out = router(x_TE)
        assert out.idx_TK.tolist() == [expected_idx] * 5


def test_tied_scores_give_equal_weights():
    out = identity_router(4, top_k=2)(torch.zeros(3, 4))
    assert out.idx_TK.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(out.weights_TK, torch.full((3, 2), 0.5))
    out = identity_router(4, top_k=2, renormalize=False)(torch.zeros(3, 4))
    torch.testing.assert_close(out.weights_TK, torch.full((3, 2), 0.25))


@pytest.mark.parametrize("renormalize", [True, False])
def test_top_k_equal_to_num_experts_ranks_every_expert(renormalize):
    probs = [[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.4, 0.1]]
    out = identity_router(4, top_k=4, renormalize=renormalize)(logits_for(probs))
    assert out.idx_TK.tolist() == [[3, 2, 1, 0], [2, 0, 1, 3]]
    # The K weights are all the probabilities, so renormalising changes nothing.
    expected_TK = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.25, 0.25, 0.1]])
    torch.testing.assert_close(out.weights_TK, expected_TK, rtol=1e-5, atol=1e-6)


def test_all_tokens_choose_the_same_expert():
    # Expert 2 dominates every token; the others tie, so the second choice is expert 0.
    x_TE = torch.tensor([[0.0, 0.0, 3.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 0.0]])
    out = identity_router(4, top_k=2)(x_TE)
    assert out.idx_TK.tolist() == [[2, 0]] * 3
    for t, logit in enumerate([3.0, 1.0, 0.5]):
        w_top = math.exp(logit) / (math.exp(logit) + 1.0)
        torch.testing.assert_close(out.weights_TK[t], torch.tensor([w_top, 1.0 - w_top]))


def test_routing_runs_in_fp32_for_bf16_inputs():
    router = identity_router(4, top_k=2)
    x_TE = logits_for([[0.1, 0.2, 0.3, 0.4]])
    out = router(x_TE.bfloat16())
    for t in (out.weights_TK, out.probs_TE, out.logits_TE):
        assert t.dtype == torch.float32
    assert out.idx_TK.tolist() == [[3, 2]]
    torch.testing.assert_close(out.logits_TE, x_TE.bfloat16().float(), rtol=0, atol=0)


def test_router_gate_gets_gradient_through_the_weights():
    torch.manual_seed(0)
    router = TopKRouter(8, 4, top_k=2, init_std=0.5)
    out = router(torch.randn(6, 8))
    # Weight each slot differently, or the renormalised weights' gradient would sum to zero.
    (out.weights_TK * torch.tensor([1.0, -2.0])).sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
