"""Aux losses against hand computation: load balancing ``E * sum_e f_e * P_e`` and the router
z-loss ``mean_t logsumexp(logits_t)^2``, alone and as combined by ``MoELayer`` into ``MoEAux.loss``."""

import math

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import MoELayer
from moetrain.models.moe.balance import load_balancing_loss, router_z_loss

LN2, LN10 = math.log(2.0), math.log(10.0)


@pytest.mark.parametrize("counts", [[4, 4, 4, 4], [16, 0, 0, 0], [8, 8, 0, 0], [1, 2, 5, 8]])
def test_uniform_router_probabilities_give_exactly_one(counts):
    # P_e = 1/E for every e, so E * sum_e f_e / E = sum_e f_e = 1 whatever the counts.
    probs_TE = torch.full((8, 4), 0.25)
    lb = load_balancing_loss(probs_TE, torch.tensor(counts), top_k=2)
    torch.testing.assert_close(lb, torch.tensor(1.0))


def test_load_balancing_hand_case_and_its_gradient():
    # T=2, K=2, E=4: both tokens pick experts 2 and 3, so f = [0, 0, 1/2, 1/2];
    # P = [0.1, 0.2, 0.3, 0.4]; loss = 4 * (0.5 * 0.3 + 0.5 * 0.4) = 1.4.
    probs_TE = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 2, requires_grad=True)
    lb = load_balancing_loss(probs_TE, torch.tensor([0, 0, 2, 2]), top_k=2)
    torch.testing.assert_close(lb, torch.tensor(1.4))
    lb.backward()
    # d loss / d p_te = E * f_e / T = 4 * f_e / 2.
    torch.testing.assert_close(probs_TE.grad, torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2))


def test_load_balancing_of_a_skewed_top1_batch():
    # K=1, T=4, E=2: three tokens chose e0. f = [3/4, 1/4]; P = mean rows = [0.6, 0.4].
    probs_TE = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.2, 0.8]])
    lb = load_balancing_loss(probs_TE, torch.tensor([3, 1]), top_k=1)
    torch.testing.assert_close(lb, torch.tensor(2 * (0.75 * 0.6 + 0.25 * 0.4)))


def test_load_balancing_with_global_counts_averages_to_the_whole_batch_loss():
    # What a data-parallel rank computes: its own probabilities, the counts and token count of the
    # whole batch. The mean over the two halves equals the single-process loss.
    torch.manual_seed(0)
    probs_TE = torch.softmax(torch.randn(8, 4), dim=-1)
    counts_E = torch.tensor([5, 3, 6, 2])  # 16 = T * K copies
    whole = load_balancing_loss(probs_TE, counts_E, top_k=2)
    halves = [load_balancing_loss(p, counts_E, top_k=2, num_tokens=8) for p in probs_TE.chunk(2)]
    torch.testing.assert_close((halves[0] + halves[1]) / 2, whole)
    f_E = counts_E.float() / 16
    torch.testing.assert_close(whole, 4 * (f_E * probs_TE.mean(0)).sum())


def test_z_loss_hand_case_and_its_gradient():
    # Row 0: logsumexp(0, 0) = ln 2. Row 1: logsumexp(ln 1, ln 3) = ln 4 = 2 ln 2.
    logits_TE = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]], requires_grad=True)
    z = router_z_loss(logits_TE)
    torch.testing.assert_close(z, torch.tensor((LN2 ** 2 + 4 * LN2 ** 2) / 2))
    z.backward()
    # d/dl_te of mean_t lse_t^2 = 2 * lse_t * softmax_te / T.
    expected = torch.tensor([[LN2 * 0.5, LN2 * 0.5], [2 * LN2 * 0.25, 2 * LN2 * 0.75]])
    torch.testing.assert_close(logits_TE.grad, expected)


def test_z_loss_is_stable_for_large_logits_and_fp32_for_bf16_ones():
    z = router_z_loss(torch.tensor([[1000.0, 1000.0]]))
    torch.testing.assert_close(z, torch.tensor((1000.0 + LN2) ** 2, dtype=torch.float32))
    z_bf16 = router_z_loss(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert z_bf16.dtype == torch.float32
    torch.testing.assert_close(z_bf16, torch.tensor(math.log(4.0) ** 2))


def layer_with_identity_gate(*, aux_loss_coef: float, z_loss_coef: float, top_k: int = 2) -> MoELayer:
    """dim == E == 4 and the identity gate: each input row is that token's router logits."""
    cfg = MoEConfig(num_experts=4, top_k=top_k, expert_hidden_dim=8, aux_loss_coef=aux_loss_coef,
                    z_loss_coef=z_loss_coef)
    layer = MoELayer(4, cfg)
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.eye(4))
    return layer


def test_layer_aux_is_the_weighted_sum_of_the_hand_computed_losses():
    # Both tokens have logits ln[1, 2, 3, 4]: softmax [0.1, 0.2, 0.3, 0.4], so lb = 1.4 (as above),
    # and logsumexp = ln(1 + 2 + 3 + 4), so z = (ln 10)^2.
    x_TD = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 2).log()
    layer = layer_with_identity_gate(aux_loss_coef=0.1, z_loss_coef=0.01)
    _, aux = layer(x_TD)
    torch.testing.assert_close(aux.load_balancing, torch.tensor(1.4))
    torch.testing.assert_close(aux.z_loss, torch.tensor(LN10 ** 2))
    torch.testing.assert_close(aux.loss, torch.tensor(0.1 * 1.4 + 0.01 * LN10 ** 2))
    assert aux.num_routed_per_expert.tolist() == [0, 0, 2, 2]
    assert aux.num_routed == 4


def test_layer_with_uniform_routing_has_balance_loss_one():
    # A zero gate: every probability is 1/E (all tokens tie and go to experts 0 and 1), lb = 1,
    # and every logsumexp is ln E.
    layer = layer_with_identity_gate(aux_loss_coef=1.0, z_loss_coef=0.5)
    with torch.no_grad():
        layer.router.gate.weight.zero_()
    _, aux = layer(torch.randn(5, 4))
    assert aux.num_routed_per_expert.tolist() == [5, 5, 0, 0]
    torch.testing.assert_close(aux.load_balancing, torch.tensor(1.0))
    torch.testing.assert_close(aux.z_loss, torch.tensor(math.log(4.0) ** 2))
    torch.testing.assert_close(aux.loss, torch.tensor(1.0 + 0.5 * math.log(4.0) ** 2))


def test_aux_loss_gradient_reaches_the_router():
    torch.manual_seed(0)
    layer = layer_with_identity_gate(aux_loss_coef=1.0, z_loss_coef=0.0)
    x_TD = torch.randn(6, 4)
    _, aux = layer(x_TD)
    aux.loss.backward()
    grad_lb = layer.router.gate.weight.grad.clone()
    # The same gradient by hand: lb = E * sum_e f_e * mean_t softmax(x W^T)_te, f fixed.
    gate = torch.eye(4, requires_grad=True)
    f_E = aux.num_routed_per_expert.float() / (6 * 2)
    (4 * (f_E * torch.softmax(x_TD @ gate.t(), dim=-1).mean(0)).sum()).backward()
    torch.testing.assert_close(grad_lb, gate.grad)
    assert grad_lb.abs().sum() > 0
    for p in layer.experts.parameters():
        assert p.grad is None or p.grad.abs().sum() == 0
