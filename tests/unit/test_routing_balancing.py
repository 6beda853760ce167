"""The between-step balancing of ``install_balancing``: the selection-bias update, the dynamic
capacity factor, per-expert learning rates, the collapse alarm and the expert-health metrics,
against hand-worked values and plain references (torch's AdamW with one parameter per expert).
"""

import logging
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


# ----- collapse alarm ----------------------------------------------------------------------------

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


# The raw rule (alarm at every check above the threshold): no warm-up, no persistence.
RAW_RULE = {"collapse_warmup_steps": 0, "collapse_consecutive_checks": 1}


def test_collapse_alarm_fires_on_a_forced_collapse(caplog):
    cfg = moe(top_k=1, balance_interval=2, collapse_threshold=0.5, **RAW_RULE)
    layer = forced_layer(cfg)
    x_TD = torch.tensor([[5.0, 0.0, 0.0, 0.0]] * 7 + [[0.0, 5.0, 0.0, 0.0]])  # 7/8 of tokens to expert 0
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        balancer = run_forced(layer, x_TD, steps=4)
    alarms = [r.getMessage() for r in caplog.records if "ROUTING COLLAPSE" in r.getMessage()]
    assert len(alarms) == 2  # one per interval of 2 steps
    assert "MoE layer 0" in alarms[0] and "expert 0" in alarms[0] and "87.5%" in alarms[0]
    assert balancer.total_alarms == 2
    m = balancer.metrics()
    assert m["routing_collapse_alarms"] == [2]
    assert m["max_token_fraction"] == [0.875]


def test_collapse_alarm_stays_quiet_on_a_balanced_run(caplog):
    cfg = moe(top_k=1, balance_interval=1, collapse_threshold=0.5, **RAW_RULE)
    layer = forced_layer(cfg)
    x_TD = 5.0 * torch.eye(4).repeat(4, 1)  # every expert gets exactly 1/4 of the tokens
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        balancer = run_forced(layer, x_TD, steps=3)
    assert not [r for r in caplog.records if "ROUTING COLLAPSE" in r.getMessage()]
    m = balancer.metrics()
    assert m["routing_collapse_alarms"] == [0] and m["max_token_fraction"] == [0.25]
    assert m["load_cv"] == [0.0] and m["load_max_over_mean"] == [1.0]


def test_collapse_alarm_raises_the_aux_coefficient_up_to_its_ceiling(caplog):
    cfg = moe(top_k=1, balance_interval=1, collapse_threshold=0.5, aux_loss_coef=0.01,
              collapse_aux_increase=0.02, collapse_aux_max=0.04, **RAW_RULE)
    layer = forced_layer(cfg)
    x_TD = torch.tensor([[5.0, 0.0, 0.0, 0.0]] * 4)
    coefs = []
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    install_balancing(opt, layer)
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        for _ in range(3):
            out, aux = layer(x_TD)
            torch.testing.assert_close(aux.loss, layer.aux_loss_coef * aux.load_balancing
                                       + cfg.z_loss_coef * aux.z_loss)
            (out.sum() + aux.loss).backward()
            opt.step()
            coefs.append(layer.aux_loss_coef)
    assert coefs == pytest.approx([0.03, 0.04, 0.04])
    assert "aux_loss_coef of this layer 0.01 -> 0.03" in caplog.text
    assert "aux_loss_coef_now" in layer.state_dict()  # a resumed run keeps the raised value


COLLAPSED_TD = torch.tensor([[5.0, 0.0, 0.0, 0.0]] * 7 + [[0.0, 5.0, 0.0, 0.0]])  # 7/8 to expert 0
BALANCED_TD = 5.0 * torch.eye(4).repeat(2, 1)  # 1/4 to each expert


def alarms_per_step(layer: MoELayer, inputs: list[torch.Tensor]) -> tuple[list[int], list[float]]:
    """Real steps (forward, backward, ``optimizer.step()`` with the balancing hooks) on one input
    per step: the balancer's alarm count and the layer's aux coefficient after each step."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    balancer = install_balancing(opt, layer)
    alarms, coefs = [], []
    for x_TD in inputs:
        out, aux = layer(x_TD)
        (out.sum() + aux.loss).backward()
        opt.step()
        opt.zero_grad()
        alarms.append(balancer.total_alarms)
        coefs.append(layer.aux_loss_coef)
    return alarms, coefs


def test_collapse_alarm_is_silent_during_the_warmup_and_fires_after_it_when_collapse_persists(caplog):
    # Checks every 2 steps; the warm-up covers the checks at steps 2, 4 and 6.
    cfg = moe(top_k=1, balance_interval=2, collapse_threshold=0.5, collapse_warmup_steps=6,
              collapse_consecutive_checks=1, collapse_aux_increase=0.02, aux_loss_coef=0.01)
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        alarms, coefs = alarms_per_step(forced_layer(cfg), [COLLAPSED_TD] * 10)
    assert alarms == [0, 0, 0, 0, 0, 0, 0, 1, 1, 2]  # first alarm at the check of step 8
    # The aux-coefficient increase follows the same rule: untouched during the warm-up.
    assert coefs[:7] == [0.01] * 7 and coefs[7] == pytest.approx(0.03) and coefs[9] == pytest.approx(0.05)
    messages = [r.getMessage() for r in caplog.records if "ROUTING COLLAPSE" in r.getMessage()]
    assert len(messages) == 2 and "steps 7-8" in messages[0] and "87.5%" in messages[0]


def test_collapse_alarm_stays_silent_when_an_initial_collapse_ends_within_the_warmup():
    cfg = moe(top_k=1, balance_interval=2, collapse_threshold=0.5, collapse_warmup_steps=4,
              collapse_consecutive_checks=1)
    alarms, _ = alarms_per_step(forced_layer(cfg), [COLLAPSED_TD] * 4 + [BALANCED_TD] * 8)
    assert alarms == [0] * 12
    # The same start with the alarm unguarded fires at both checks of the collapsed steps.
    raw = moe(top_k=1, balance_interval=2, collapse_threshold=0.5, **RAW_RULE)
    alarms, _ = alarms_per_step(forced_layer(raw), [COLLAPSED_TD] * 4 + [BALANCED_TD] * 8)
    assert alarms[-1] == 2


def test_collapse_alarm_needs_consecutive_checks_above_the_threshold(caplog):
    cfg = moe(top_k=1, balance_interval=1, collapse_threshold=0.5, collapse_warmup_steps=0,
              collapse_consecutive_checks=3)
    c, b = COLLAPSED_TD, BALANCED_TD
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        alarms, _ = alarms_per_step(forced_layer(cfg), [c, c, b, c, c, c, c, b, c])
    # Two above, one below (the streak restarts), then four above: alarms at the 3rd and 4th.
    assert alarms == [0, 0, 0, 0, 0, 1, 2, 2, 2]
    messages = [r.getMessage() for r in caplog.records if "ROUTING COLLAPSE" in r.getMessage()]
    assert "above it at 3 checks in a row" in messages[0] and "at 4 checks in a row" in messages[1]


def test_a_collapse_since_initialisation_is_reported_at_the_first_check_after_the_warmup():
    cfg = moe(top_k=1, balance_interval=2, collapse_threshold=0.5, collapse_warmup_steps=6,
              collapse_consecutive_checks=3)
    alarms, _ = alarms_per_step(forced_layer(cfg), [COLLAPSED_TD] * 8)
    assert alarms == [0] * 7 + [1]  # the streak counted through the warm-up: 4 checks at step 8


def test_collapse_streak_is_checkpointed_so_a_resumed_run_alarms_at_the_same_step():
    cfg = moe(top_k=1, balance_interval=1, collapse_threshold=0.5, collapse_warmup_steps=0,
              collapse_consecutive_checks=3)
    layer = forced_layer(cfg)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    balancer = install_balancing(opt, layer)
    for _ in range(2):  # two checks above the threshold: one short of the alarm
        out, aux = layer(COLLAPSED_TD)
        (out.sum() + aux.loss).backward()
        opt.step()
        opt.zero_grad()
    state = balancer.state_dict()
    assert state["collapse_streak"] == [2] and balancer.total_alarms == 0
    balancer.remove()

    resumed_layer = forced_layer(cfg)
    resumed_opt = torch.optim.SGD(resumed_layer.parameters(), lr=0.0)
    resumed = install_balancing(resumed_opt, resumed_layer)
    resumed.load_state_dict(state)
    out, aux = resumed_layer(COLLAPSED_TD)
    (out.sum() + aux.loss).backward()
    resumed_opt.step()
    assert resumed.total_alarms == 1  # the third check in a row, as without the stop


@pytest.mark.parametrize("field, value, rule", [
    ("collapse_warmup_steps", -1, "an int >= 0"),
    ("collapse_warmup_steps", 2.5, "an int >= 0"),
    ("collapse_consecutive_checks", 0, "an int >= 1"),
    ("collapse_consecutive_checks", True, "an int >= 1"),
])
def test_collapse_rule_fields_are_validated(field, value, rule):
    with pytest.raises(ValueError) as excinfo:
        MoEConfig(**{field: value})
    assert f"moe.{field} ({value!r}) must be {rule}" in str(excinfo.value)


def test_collapse_alarm_is_disabled_with_a_warning_when_balance_already_exceeds_it():
    cfg = moe(num_experts=4, top_k=2, collapse_threshold=0.5)  # balanced = 2/4 of the tokens each
    layer = MoELayer(DIM, cfg)
    with pytest.warns(UserWarning, match=r"collapse alarm is off for MoE layers \[''\]"):
        install_balancing(torch.optim.SGD(layer.parameters(), lr=0.0), layer)


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
