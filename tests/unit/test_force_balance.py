"""``moe.force_balance``: the benchmark routing that ignores the router's choice in training.

Hand-worked counts for round robin, reproducibility and balance in expectation for random, the
gate weights and their gradients, eval mode, the config rules and the metrics tag."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import MoELayer
from moetrain.models.moe.router import TopKRouter, forced_assignment
from moetrain.train.metrics import MetricsLogger, read_metrics, run_tags


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(12, 8, 2), (7, 8, 2), (5, 6, 4), (3, 256, 8), (9, 4, 4)])
def test_round_robin_counts_are_exact(num_tokens, num_experts, top_k):
    """Copy n goes to expert n mod E: floor(T*K/E) copies each, one more for the first (T*K) mod E
    experts, and a token's K experts are distinct."""
    idx_TK = forced_assignment(num_tokens, num_experts, top_k, mode="round_robin")
    assert idx_TK.shape == (num_tokens, top_k) and idx_TK.dtype == torch.int64
    n = num_tokens * top_k
    expected_E = torch.tensor([n // num_experts + (e < n % num_experts) for e in range(num_experts)])
    assert torch.equal(torch.bincount(idx_TK.flatten(), minlength=num_experts), expected_E)
    assert all(len(set(row)) == top_k for row in idx_TK.tolist())


def test_round_robin_by_hand():
    assert forced_assignment(3, 4, 2, mode="round_robin").tolist() == [[0, 1], [2, 3], [0, 1]]
    assert forced_assignment(2, 3, 2, mode="round_robin").tolist() == [[0, 1], [2, 0]]


def test_random_is_reproducible_with_the_seed_and_distinct_per_token():
    torch.manual_seed(7)
    a = forced_assignment(64, 16, 4, mode="random")
    b = forced_assignment(64, 16, 4, mode="random")
    torch.manual_seed(7)
    assert torch.equal(forced_assignment(64, 16, 4, mode="random"), a)
    assert not torch.equal(a, b), "the next draw must differ"
    assert all(len(set(row)) == 4 for row in a.tolist())


def test_random_is_balanced_in_expectation():
    """T*K/E copies per expert in expectation: over 200000 tokens top-2 of 8 (each expert's count is
    Binomial(T, K/E), relative std sqrt((1 - 1/4) / (T / 4)) = 0.39%), every expert's share is
    within 2.5% (6 std) of 1/8; and a skewed count (one expert's share doubled) would fail."""
    torch.manual_seed(0)
    counts_E = torch.bincount(forced_assignment(200_000, 8, 2, mode="random").flatten(), minlength=8)
    share_E = counts_E.double() / counts_E.sum()
    uniform_E = torch.full((8,), 1 / 8, dtype=torch.float64)
    assert torch.allclose(share_E, uniform_E, rtol=0.025, atol=0)
    skewed_E = counts_E.double().clone()
    skewed_E[0] *= 2
    assert not torch.allclose(skewed_E / skewed_E.sum(), uniform_E, rtol=0.025, atol=0)


def _router(mode: str, **kw) -> TopKRouter:
    torch.manual_seed(0)
    return TopKRouter(16, 8, top_k=2, force_balance=mode, **kw)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_forced_routing_weights_are_the_router_scores_and_train_the_gate(score_func):
    router = _router("round_robin", score_func=score_func)
    x_TD = torch.randn(6, 16)
    out = router(x_TD)
    assert out.idx_TK.tolist() == forced_assignment(6, 8, 2, mode="round_robin").tolist()
    scores_TE = torch.softmax(out.logits_TE, -1) if score_func == "softmax" else torch.sigmoid(out.logits_TE)
    picked_TK = scores_TE.gather(1, out.idx_TK)
    torch.testing.assert_close(out.weights_TK, picked_TK / picked_TK.sum(-1, keepdim=True))
    # The router's own probabilities still go to the balance losses.
    torch.testing.assert_close(out.probs_TE, scores_TE / scores_TE.sum(-1, keepdim=True))
    (out.weights_TK * torch.arange(2.0)).sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


def test_eval_mode_routes_by_the_router():
    forced, free = _router("round_robin"), _router("none")
    forced.eval(), free.eval()
    x_TD = torch.randn(10, 16)
    assert torch.equal(forced(x_TD).idx_TK, free(x_TD).idx_TK)
    forced.train()
    assert not torch.equal(forced(x_TD).idx_TK, free(x_TD).idx_TK)


def test_moe_layer_with_forced_routing_balances_exactly():
    """Through the whole layer (dispatch, experts, combine): every expert gets T*K/E copies."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=8, force_balance="round_robin")
    torch.manual_seed(0)
    layer = MoELayer(16, cfg)
    assert layer.router.force_balance == "round_robin"  # the config reaches the router
    x = torch.randn(2, 6, 16, requires_grad=True)
    out, aux = layer(x)
    assert aux.num_routed_per_expert.tolist() == [6, 6, 6, 6]
    (out.sum() + aux.loss).backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"force_balance": "uniform"}, r"moe.force_balance \('uniform'\) must be one of"),
    ({"force_balance": "random", "router": "expert_choice", "capacity_factor": 1.0},
     r"moe.force_balance \('random'\) must be \"none\" with moe.router \"expert_choice\""),
])
def test_config_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)
    assert MoEConfig().force_balance == "none"


def test_every_metrics_record_says_when_it_is_on(tmp_path):
    assert run_tags(MoEConfig()) == {} and run_tags(None) == {}
    tags = run_tags(MoEConfig(force_balance="random"))
    assert tags == {"force_balance": "random"}
    logger = MetricsLogger(tmp_path, tensorboard=False, tags=tags)
    for step in (1, 2):
        logger.log(step, {"loss": 1.0})
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["force_balance"] for r in records] == ["random", "random"]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
