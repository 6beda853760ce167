"""The between-step balancing of ``install_balancing``: the selection-bias update, the dynamic
capacity factor, per-expert learning rates, the collapse alarm and the expert-health metrics,
against hand-worked values and plain references (torch's AdamW with one parameter per expert).
"""

import math
import warnings

import pytest
import torch
from torch import nn

from moetrain.config.moe import MoEConfig
from moetrain.distributed.parallelize import apply_activation_checkpointing
from moetrain.models.moe import MoELayer
from moetrain.models.moe.dispatcher import expert_capacity
from moetrain.train.balancing import expert_lr_scales, install_balancing, seed_capacity_factor
from moetrain.train.checkpoint.index import load_model_weights
from moetrain.train.checkpoint.state import load_checkpoint, save_checkpoint
from moetrain.train.health import expert_health_summary, load_entropy

DIM = 8


class TwoLayers(nn.Module):
    """Two residual MoE layers and a head; ``forward`` returns (output, auxes)."""

    def __init__(self, cfg: MoEConfig, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(MoELayer(DIM, cfg) for _ in range(2))
        self.head = nn.Linear(DIM, DIM, bias=False)
        with torch.no_grad():
            for layer in self.layers:
                layer.router.gate.weight.normal_(0.0, 1.0)  # decisive routing, few near-ties

    def forward(self, x):
        auxes = []
        for layer in self.layers:
            out, aux = layer(x)
            x = x + out
            auxes.append(aux)
        return self.head(x), auxes


def moe(**overrides) -> MoEConfig:
    # collapse_threshold above top_k / E = 0.5, or the alarm would be off (with a warning).
    return MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_hidden_dim": 16, "collapse_threshold": 0.9,
                        **overrides})


def batch(step: int, tokens: int = 32):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(tokens, DIM, generator=g), torch.randn(tokens, DIM, generator=g)


def train(model, cfg_steps: int, *, micro_batches: int = 1, lr: float = 1e-2, tokens: int = 32,
          record=None):
    """AdamW steps on fixed batches; each step's batch split into ``micro_batches``."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    balancer = install_balancing(opt, model)
    for step in range(cfg_steps):
        x, target = batch(step, tokens)
        routed = [torch.zeros(4, dtype=torch.int64) for _ in model.layers]
        for xm, tm in zip(x.chunk(micro_batches), target.chunk(micro_batches), strict=True):
            out, auxes = model(xm)
            loss = (out - tm).square().mean() + sum(a.loss for a in auxes)
            (loss / micro_batches).backward()
            for i, a in enumerate(auxes):
                routed[i] += a.num_routed_per_expert
        if record is not None:
            record.append(routed)
        opt.step()
        opt.zero_grad()
    return balancer


# ----- the auxiliary-loss-free bias --------------------------------------------------------------

def test_hook_moves_the_bias_by_the_step_counts():
    cfg = moe(router="sigmoid", router_bias_update_rate=0.01, aux_loss_coef=0.0)
    model = TwoLayers(cfg)
    counts = []
    train(model, 1, record=counts)
    for i, layer in enumerate(model.layers):
        load = counts[0][i].double()
        step = 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(layer.router.expert_bias, (step - step.mean()).float())
        assert layer.router.expert_bias.abs().sum() > 0, "the case must be unbalanced"


def test_a_fixed_bias_selects_but_never_moves():
    """moe.expert_bias with rate 0 (an imported DeepSeek-V3 e_score_correction_bias): the hooks
    leave it bit for bit as it was over training steps, while it keeps changing selections."""
    cfg = moe(router="sigmoid", expert_bias=True, aux_loss_coef=0.0)
    model = TwoLayers(cfg)
    bias = torch.tensor([0.3, -0.1, 0.05, -0.25])
    for layer in model.layers:
        layer.router.expert_bias.copy_(bias)
    x, _ = batch(0)
    with torch.no_grad():
        biased = model.layers[0].router(x).idx_TK
        unbiased = TwoLayers(moe(router="sigmoid", aux_loss_coef=0.0)).layers[0].router(x).idx_TK
    assert not torch.equal(biased, unbiased), "the bias must change some selection"
    counts = []
    train(model, 3, record=counts)
    assert any(c.max() != c.min() for step in counts for c in step), "unbalanced load: a rate would move it"
    for layer in model.layers:
        assert torch.equal(layer.router.expert_bias, bias)


def test_a_fixed_bias_round_trips_through_a_checkpoint(tmp_path):
    cfg = moe(router="sigmoid", expert_bias=True)
    model, fresh = TwoLayers(cfg), TwoLayers(cfg, seed=1)
    bias = torch.tensor([0.3, -0.1 + 2.0**-20, 0.05, -0.25])  # not a bf16 value
    for layer in model.layers:
        layer.router.expert_bias.copy_(bias)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        path = save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=optimizer, trainer_state={"step": 1})
        tensors, _ = load_model_weights(path)
        load_checkpoint(path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    for i in range(2):
        saved = tensors[f"layers.{i}.router.expert_bias"]
        assert saved.dtype == torch.float32 and torch.equal(saved, bias)
        assert torch.equal(fresh.layers[i].router.expert_bias, bias)


def test_bias_update_is_the_same_with_and_without_gradient_accumulation():
    cfg = moe(router="sigmoid", router_bias_update_rate=0.01, aux_loss_coef=0.0)
    whole, accumulated = TwoLayers(cfg), TwoLayers(cfg)
    counts_whole, counts_acc = [], []
    train(whole, 3, micro_batches=1, record=counts_whole)
    train(accumulated, 3, micro_batches=4, record=counts_acc)
    for step in range(3):
        for i in range(2):
            assert counts_whole[step][i].tolist() == counts_acc[step][i].tolist()
    for a, b in zip(whole.layers, accumulated.layers, strict=True):
        torch.testing.assert_close(a.router.expert_bias, b.router.expert_bias, rtol=0, atol=0)


def test_recomputed_and_eval_forwards_are_not_counted():
    cfg = moe(router="sigmoid", router_bias_update_rate=0.01)
    model = TwoLayers(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    install_balancing(opt, model)
    apply_activation_checkpointing(list(model.layers))
    x, _ = batch(0, tokens=10)
    out, _ = model(x)
    out.sum().backward()  # recomputes both layers' forwards
    model.eval()
    with torch.no_grad():
        model(x)
    for layer in model.layers:
        assert int(layer.step_routed_E.sum()) == 10 * 2  # T * K, once
        assert layer.step_local_stats[3].item() == 10


# ----- dynamic capacity factor -------------------------------------------------------------------

def test_seed_capacity_formula_hand_case():
    # Relative loads [2, 0, 1, 1]: unbiased std sqrt((1 + 1 + 0 + 0) / 3) = 0.8165.
    std = math.sqrt(2 / 3)
    expected = 1.0 + 0.5 / (1.0 + math.exp(-(std - 1.0)))
    assert seed_capacity_factor(torch.tensor([2.0, 0.0, 1.0, 1.0])) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(1.22712, abs=1e-5)
    # Balanced: 1 + 0.5 * sigmoid(-1).
    assert seed_capacity_factor(torch.ones(8)) == pytest.approx(1.0 + 0.5 / (1.0 + math.e), rel=1e-12)
    assert seed_capacity_factor(torch.ones(4), base=2.0, scale=1.0, shift=0.0) == pytest.approx(2.5)


def test_dynamic_capacity_updates_at_the_interval_from_the_interval_load():
    cfg = moe(capacity_factor=1.0, dynamic_capacity=True, balance_interval=2)
    model = TwoLayers(cfg)
    counts = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    install_balancing(opt, model)
    factors = []
    for step in range(4):
        x, target = batch(step)
        out, auxes = model(x)
        for layer, a in zip(model.layers, auxes, strict=True):
            # The layer's capacity and drops follow its current factor.
            cap = expert_capacity(32, num_experts=4, top_k=2, capacity_factor=layer.capacity_factor)
            assert int(a.num_dropped) == int((a.num_routed_per_expert - cap).clamp(min=0).sum())
        counts.append([a.num_routed_per_expert.clone() for a in auxes])
        ((out - target).square().mean() + sum(a.loss for a in auxes)).backward()
        opt.step()
        opt.zero_grad()
        factors.append([layer.capacity_factor for layer in model.layers])
    assert factors[0] == [1.0, 1.0]  # unchanged until the first interval ends
    for i in range(2):
        for end in (1, 3):
            load = (counts[end - 1][i] + counts[end][i]).double()
            expected = seed_capacity_factor(load / load.mean())
            assert factors[end][i] == pytest.approx(expected, rel=1e-12)
        assert factors[2][i] == factors[1][i]


def test_capacity_fn_replaces_the_formula():
    cfg = moe(capacity_factor=1.0, dynamic_capacity=True, balance_interval=1)
    model = TwoLayers(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    install_balancing(opt, model, capacity_fn=lambda load_E: 1.0 + float(load_E.max()))
    out, auxes = model(batch(0)[0])
    out.sum().backward()
    opt.step()
    for layer, a in zip(model.layers, auxes, strict=True):
        load = a.num_routed_per_expert.double()
        assert layer.capacity_factor == pytest.approx(1.0 + float(load.max() / load.mean()))


# ----- per-expert learning rates -----------------------------------------------------------------

def test_expert_lr_scales_hand_case():
    got = expert_lr_scales(torch.tensor([2.0, 0.5, 1.0, 0.25, 0.0]), max_scale=3.0)
    torch.testing.assert_close(got, torch.tensor([1.0, 2.0, 1.0, 3.0, 3.0]))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_expert_lr_scale_equals_adamw_with_one_learning_rate_per_expert(activation):
    """The reference: torch's AdamW with every expert's weights as separate parameters in their
    own parameter group at lr * scale_e (weight decay included)."""
    cfg = moe(expert_lr_scale_max=4.0, balance_interval=10_000, activation=activation)
    torch.manual_seed(0)
    layer = MoELayer(DIM, cfg)
    scales = [1.0, 2.5, 1.0, 4.0]
    layer.expert_lr_scale.copy_(torch.tensor(scales))
    lr, wd = 0.05, 0.1
    names = [n for n in ("w1", "w2", "w3") if getattr(layer.experts, n) is not None]
    ref = {"router": layer.router.gate.weight.detach().clone().requires_grad_()}
    for n in names:
        ref[n] = [w.detach().clone().requires_grad_() for w in getattr(layer.experts, n)]
    groups = [{"params": [ref["router"]], "lr": lr}]
    groups += [{"params": [ref[n][e] for n in names], "lr": lr * scales[e]} for e in range(4)]
    ref_opt = torch.optim.AdamW(groups, lr=lr, weight_decay=wd)
    opt = torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=wd)
    install_balancing(opt, layer)
    for step in range(3):
        x, g = batch(step, tokens=16)
        out, _ = layer(x)
        (out * g).sum().backward()
        opt.step()
        opt.zero_grad()
        stacked = {"router.gate.weight": ref["router"], **{f"experts.{n}": torch.stack(ref[n]) for n in names}}
        ref_out, _ = torch.func.functional_call(layer, stacked, (x,))
        (ref_out * g).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(out.detach(), ref_out.detach(), rtol=1e-5, atol=1e-6)
    for n in names:
        torch.testing.assert_close(getattr(layer.experts, n).detach(), torch.stack(ref[n]).detach(),
                                   rtol=1e-5, atol=1e-6)
    # The scaled experts really moved further than the base-rate ones would have.
    assert scales[1] > 1 and scales[3] > 1


def test_lr_scales_follow_the_interval_load():
    cfg = moe(expert_lr_scale_max=3.0, balance_interval=1)
    model = TwoLayers(cfg)
    counts = []
    train(model, 1, record=counts)
    for i, layer in enumerate(model.layers):
        load = counts[0][i].double()
        torch.testing.assert_close(layer.expert_lr_scale, expert_lr_scales(load / load.mean(), max_scale=3.0).float())


# ----- layers with forced routing (also the collapse alarm's, test_collapse_alarm.py) ------------

def forced_layer(cfg: MoEConfig) -> MoELayer:
    layer = MoELayer(4, cfg)
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.eye(4))
    return layer


def run_forced(layer: MoELayer, x_TD: torch.Tensor, steps: int):
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    balancer = install_balancing(opt, layer)
    for _ in range(steps):
        out, aux = layer(x_TD)
        (out.sum() + aux.loss).backward()
        opt.step()
        opt.zero_grad()
    return balancer


# ----- expert-health statistics ------------------------------------------------------------------

def test_health_summary_hand_case():
    # T = 4 tokens, K = 2: counts [4, 2, 2, 0]; shares [0.5, 0.25, 0.25, 0]; mean 2, population
    # std sqrt((4 + 0 + 0 + 4) / 4) = sqrt(2); expert 0 is chosen by every token (fraction 1.0).
    m = expert_health_summary(torch.tensor([[4, 2, 2, 0]]), dropped_L=torch.tensor([1.0]),
                              routed_L=torch.tensor([8.0]), entropy_sum_L=torch.tensor([2.0]),
                              tokens_L=torch.tensor([4.0]), idle_steps_LE=torch.tensor([[0, 0, 2, 5]]),
                              unused_after=5)
    assert m["expert_share"] == [[0.5, 0.25, 0.25, 0.0]]
    assert m["load_cv"] == [pytest.approx(math.sqrt(2) / 2, abs=1e-5)]
    assert m["load_max_over_mean"] == [2.0]
    assert m["max_token_fraction"] == [1.0]
    assert m["dropped_fraction"] == [0.125]
    assert m["routing_entropy"] == [0.5]
    # -(0.5 ln 0.5 + 2 * 0.25 ln 0.25) / ln 4 = 0.75
    assert m["load_entropy"] == [pytest.approx(0.75, abs=1e-5)]
    assert m["unused_experts"] == [[3]] and m["num_unused_experts"] == [1]
    torch.testing.assert_close(load_entropy(torch.tensor([[3, 3, 3]])), torch.tensor([1.0], dtype=torch.float64))


def test_metrics_report_entropy_idle_experts_and_reset():
    cfg = moe(top_k=1, unused_expert_steps=3, balance_interval=100)
    layer = forced_layer(cfg)
    # Two tokens, each with scores [0.5, 0.5, 0, 0]-like logits: expert 0 (ties to the lower id).
    x_TD = torch.tensor([[2.0, 2.0, -30.0, -30.0]] * 2)
    balancer = run_forced(layer, x_TD, steps=2)
    m = balancer.metrics()
    assert m["routing_entropy"] == [pytest.approx(math.log(2), abs=1e-5)]
    assert m["unused_experts"] == [[]]  # idle for 2 < 3 steps
    assert m["expert_share"] == [[1.0, 0.0, 0.0, 0.0]]
    assert balancer.window_steps == 0  # metrics() restarted the window
    out, aux = layer(x_TD)
    (out.sum() + aux.loss).backward()
    balancer._pre_step(None, (), {})  # the third step's hook, as optimizer.step() would run it
    m = balancer.metrics()
    assert m["unused_experts"] == [[1, 2, 3]] and m["num_unused_experts"] == [3]
    assert m["expert_share"] == [[1.0, 0.0, 0.0, 0.0]]  # this window only: one step
    assert balancer.metrics() == {}  # nothing since the last read


def test_a_discarded_step_leaves_no_counts_behind():
    """A step skipped without optimizer.step() (non-finite loss) must not add its routing counts to
    the next step's bias update."""
    cfg = moe(router="sigmoid", router_bias_update_rate=0.01, aux_loss_coef=0.0)
    skipped, clean = TwoLayers(cfg), TwoLayers(cfg)
    opts = []
    for model in (skipped, clean):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        opts.append((opt, install_balancing(opt, model)))
    x, _ = batch(0)
    out, _ = skipped(x[:16])  # the skipped step's forward/backward
    out.sum().backward()
    opts[0][1].discard_step()
    for model, (opt, _) in zip((skipped, clean), opts, strict=True):
        opt.zero_grad()
        out, _ = model(x[16:])
        out.sum().backward()
        opt.step()
    for a, b in zip(skipped.layers, clean.layers, strict=True):
        torch.testing.assert_close(a.router.expert_bias, b.router.expert_bias, rtol=0, atol=0)
        assert a.router.expert_bias.abs().sum() > 0


def test_balancer_state_round_trips_and_refuses_another_model():
    cfg = moe(unused_expert_steps=3, balance_interval=4)
    model = TwoLayers(cfg)
    balancer = train(model, 6)  # mid-interval: 2 steps counted since the update at step 4
    state = balancer.state_dict()
    assert state["steps"] == 6 and state["window_steps"] == 6
    assert [sum(row) for row in state["interval_routed"]] == [2 * 32 * 2] * 2  # 2 steps x 32 tokens x K

    fresh = install_balancing(torch.optim.SGD(model.parameters(), lr=0.0), TwoLayers(cfg))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert torch.equal(fresh.interval_routed_LE, balancer.interval_routed_LE)
    assert fresh.metrics() == balancer.metrics()

    one_layer = install_balancing(torch.optim.SGD(model.parameters(), lr=0.0), forced_layer(cfg))
    with pytest.raises(ValueError, match=r"balancer state \(num_layers, num_experts\) \(2, 4\) does not match"):
        one_layer.load_state_dict(state)
