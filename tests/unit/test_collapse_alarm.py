"""The collapse alarm of ``install_balancing`` (between-step balancing, see test_routing_balancing.py):
when it fires, how the warm-up and the consecutive-check rule hold it back, that it raises the aux
coefficient up to its ceiling, that its streak is checkpointed, and its config rules.
"""

import logging

import pytest
import torch

from moetrain.config.moe import MoEConfig
from moetrain.models.moe import MoELayer
from moetrain.train.balancing import install_balancing
from tests.unit.test_routing_balancing import DIM, forced_layer, moe, run_forced

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
