"""``moe.aux_loss_type="global_batch"``: the balance loss ``E * sum_e f_e * P_e`` with f_e the routed
copies of the previous optimizer step (kept by install_balancing's pre-step hook) and P_e over the
forward's tokens, against the formula written out here from the router's own weight.
(tests/distributed/test_aux_invariance.py: the same gradient at dp = 2, tp = 2 and any micro-batch count.)
"""

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import MoELayer
from moetrain.train.balancing import install_balancing

DIM, E, K = 8, 4, 2
PRESET = torch.tensor([30, 10, 5, 19])


def layer_of(router: str = "softmax", aux_loss_type: str = "global_batch") -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(DIM, MoEConfig(num_experts=E, top_k=K, expert_hidden_dim=16, router=router,
                                    aux_loss_type=aux_loss_type, aux_loss_coef=1.0, z_loss_coef=0.0,
                                    collapse_threshold=1.0))
    with torch.no_grad():
        layer.router.gate.weight.normal_(0.0, 1.0)  # decisive routing
    return layer


def reference_probs(x_TD: torch.Tensor, weight_ED: torch.Tensor, router: str) -> torch.Tensor:
    logits_TE = x_TD @ weight_ED.T
    if router == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    s_TE = torch.sigmoid(logits_TE)
    return s_TE / s_TE.sum(dim=-1, keepdim=True)


def reference_loss(x_TD, weight_ED, counts_E, router: str = "softmax") -> torch.Tensor:
    f_E = counts_E.double() / counts_E.sum()
    return E * (f_E * reference_probs(x_TD.double(), weight_ED.double(), router).mean(dim=0)).sum()


def reference_counts(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    idx_TK = reference_probs(x_TD, weight_ED, "softmax").topk(K, dim=-1).indices
    return torch.bincount(idx_TK.reshape(-1), minlength=E)


def tokens(seed: int, shape=(2, 6)) -> torch.Tensor:
    return torch.randn(*shape, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_loss_and_gradients_match_the_formula(router):
    layer = layer_of(router)
    layer.track_routing_stats = layer.balancing_installed = True  # what install_balancing does
    layer.prev_step_routed_E.copy_(PRESET)
    x = tokens(1).requires_grad_()
    _, aux = layer(x)
    w = layer.router.gate.weight
    want = reference_loss(x.reshape(-1, DIM), w, PRESET, router)
    torch.testing.assert_close(aux.load_balancing.double(), want, rtol=1e-6, atol=1e-7)
    got_w, got_x = torch.autograd.grad(aux.load_balancing, (w, x))
    want_w, want_x = torch.autograd.grad(want, (w, x))
    assert got_w.abs().max() > 1e-3
    torch.testing.assert_close(got_w, want_w.float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_x, want_x.float(), rtol=1e-5, atol=1e-7)


def test_before_the_first_step_f_is_uniform_one_and_no_gradient():
    layer = layer_of()
    layer.track_routing_stats = layer.balancing_installed = True
    _, aux = layer(tokens(2))
    torch.testing.assert_close(aux.load_balancing, torch.tensor(1.0))
    (grad,) = torch.autograd.grad(aux.load_balancing, layer.router.gate.weight)
    assert grad.abs().max() < 1e-6


def test_the_hook_keeps_the_steps_counts_over_its_micro_batches_for_the_next_step():
    layer = layer_of()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    install_balancing(opt, layer)
    micro = [tokens(3), tokens(4)]
    want_counts = torch.zeros(E, dtype=torch.int64)
    for x in micro:
        want_counts += reference_counts(x.reshape(-1, DIM), layer.router.gate.weight.detach())
        out, aux = layer(x)
        ((out.square().mean() + aux.loss) / len(micro)).backward()
        assert torch.equal(layer.prev_step_routed_E, torch.zeros(E, dtype=torch.int64)), "changed inside the step"
    opt.step()
    assert torch.equal(layer.prev_step_routed_E, want_counts)
    x = tokens(5)
    _, aux = layer(x)
    torch.testing.assert_close(aux.load_balancing.double(),
                               reference_loss(x.reshape(-1, DIM), layer.router.gate.weight.detach(), want_counts))


def test_two_micro_batches_give_the_gradient_of_the_whole_step():
    layer = layer_of()
    layer.track_routing_stats = layer.balancing_installed = True
    layer.prev_step_routed_E.copy_(PRESET)
    x = tokens(6, shape=(4, 6))
    w = layer.router.gate.weight
    (whole,) = torch.autograd.grad(layer(x)[1].load_balancing, w)
    split = sum(torch.autograd.grad(layer(x[m::2])[1].load_balancing / 2, w)[0] for m in range(2))
    assert whole.abs().max() > 1e-3
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)


def test_padded_positions_take_no_share():
    layer = layer_of()
    layer.track_routing_stats = layer.balancing_installed = True
    layer.prev_step_routed_E.copy_(PRESET)
    x = tokens(7)
    mask = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    _, aux = layer(x, token_mask=mask)
    want = reference_loss(x[mask], layer.router.gate.weight.detach(), PRESET)
    torch.testing.assert_close(aux.load_balancing.double(), want, rtol=1e-6, atol=1e-7)


def test_training_without_the_balancing_hooks_is_refused():
    layer = layer_of()
    with pytest.raises(RuntimeError, match="install_balancing"):
        layer(tokens(8))
    layer.eval()
    layer(tokens(8))  # evaluation only reads the counts


def test_the_counts_travel_with_the_balancer_state():
    src = layer_of()
    src_balancer = install_balancing(torch.optim.SGD(src.parameters(), lr=0.1), src)
    src.prev_step_routed_E.copy_(PRESET)
    state = src_balancer.state_dict()
    assert state["prev_step_routed"] == [PRESET.tolist()]
    dst = layer_of()
    install_balancing(torch.optim.SGD(dst.parameters(), lr=0.1), dst).load_state_dict(state)
    assert torch.equal(dst.prev_step_routed_E, PRESET)
    assert "prev_step_routed_E" not in dst.state_dict()  # training state, not a model weight
    other = layer_of(aux_loss_type="batch")
    assert "prev_step_routed" not in install_balancing(torch.optim.SGD(other.parameters(), lr=0.1), other).state_dict()


def test_config_accepts_global_batch_and_names_it_in_the_refusal():
    assert MoEConfig(aux_loss_type="global_batch").aux_loss_type == "global_batch"
    with pytest.raises(ValueError, match="moe.aux_loss_type.*'global_batch'"):
        MoEConfig(aux_loss_type="global")
