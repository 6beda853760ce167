"""Validation of the routing and balancing fields of MoEConfig (and of the Hugging Face families'
routed scaling, shared-expert gate, fixed selection bias and group score): each bad value raises
ValueError naming the field, the value and the rule."""

import pytest

from moetrain.config.loader import load_config
from moetrain.config.moe import MoEConfig

# field, bad value, other fields the case needs, a fragment of the rule
BAD = [
    ("router", "topk", {}, "must be one of"),
    ("capacity_factor", None, {"router": "expert_choice"}, 'when moe.router is "expert_choice"'),
    ("router_bias_update_rate", -0.001, {}, ">= 0"),
    ("router_bias_update_rate", float("inf"), {}, "finite"),
    ("router_bias_update_rate", 0.001, {"router": "expert_choice", "capacity_factor": 1.0}, "must be 0"),
    ("router_jitter", 1.0, {}, "< 1"),
    ("router_jitter", -0.1, {}, ">= 0"),
    ("router_noise_std", -1.0, {}, ">= 0"),
    ("num_expert_groups", 3, {}, "must divide moe.num_experts (8)"),
    ("num_expert_groups", 0, {}, "int >= 1"),
    ("num_expert_groups", 2, {"router": "expert_choice", "capacity_factor": 1.0}, "must be 1"),
    ("top_groups", 3, {"num_expert_groups": 2}, "must be <= moe.num_expert_groups (2)"),
    ("top_groups", 1, {"num_expert_groups": 8, "top_k": 2}, "fewer than moe.top_k (2)"),
    ("aux_loss_type", "token", {}, "must be one of"),
    ("aux_loss_type", "sequence", {"router": "expert_choice", "capacity_factor": 1.0}, 'must be "batch"'),
    ("aux_loss_type", "global_batch", {"router": "expert_choice", "capacity_factor": 1.0}, 'must be "batch"'),
    ("dynamic_capacity", "yes", {}, "true or false"),
    ("capacity_factor", None, {"dynamic_capacity": True}, "moe.dynamic_capacity is true"),
    ("dynamic_capacity", True, {"router": "expert_choice", "capacity_factor": 1.0}, "must be false"),
    ("dynamic_capacity_base", 0.0, {}, "> 0"),
    ("dynamic_capacity_scale", -0.5, {}, ">= 0"),
    ("dynamic_capacity_shift", float("nan"), {}, "finite"),
    ("balance_interval", 0, {}, "int >= 1"),
    ("expert_lr_scale_max", 0.5, {}, ">= 1"),
    ("collapse_threshold", 0.0, {}, "(0, 1]"),
    ("collapse_threshold", 1.5, {}, "(0, 1]"),
    ("collapse_aux_increase", -0.01, {}, ">= 0"),
    ("collapse_aux_max", -1.0, {}, ">= 0"),
    ("unused_expert_steps", 0, {}, "int >= 1"),
    ("routed_scaling_factor", 0.0, {}, "> 0"),
    ("routed_scaling_factor", -2.5, {}, "> 0"),
    ("routed_scaling_factor", float("inf"), {}, "finite"),
    ("routed_scaling_factor", 2.5, {"router": "expert_choice", "capacity_factor": 1.0}, "must be 1.0"),
    ("shared_expert_gate", True, {}, "needs moe.num_shared_experts > 0"),
    ("shared_expert_gate", 1, {"num_shared_experts": 1}, "true or false"),
    ("expert_bias", "yes", {}, "true or false"),
    ("expert_bias", True, {"router": "expert_choice", "capacity_factor": 1.0}, "must be false"),
    ("group_score", "sum", {"num_expert_groups": 2}, "must be one of 'top2_sum', 'max'"),
    ("group_score", "max", {}, "acts only with moe.num_expert_groups > 1"),
]


@pytest.mark.parametrize("field, value, others, rule", BAD, ids=[f"{f}={v!r}" for f, v, _, _ in BAD])
def test_bad_routing_field_names_field_value_and_rule(field, value, others, rule):
    with pytest.raises(ValueError) as excinfo:
        MoEConfig(**{field: value, **others})
    message = str(excinfo.value)
    assert f"moe.{field} ({value!r})" in message
    assert rule in message


@pytest.mark.parametrize("kwargs", [
    {"router": "sigmoid", "router_bias_update_rate": 0.001, "aux_loss_coef": 0.0},
    {"router": "expert_choice", "capacity_factor": 1.25},
    {"num_expert_groups": 4, "top_groups": 2, "top_k": 4},
    {"num_expert_groups": 8, "top_groups": 2, "top_k": 2},
    {"capacity_factor": 1.0, "dynamic_capacity": True, "balance_interval": 5},
    {"expert_lr_scale_max": 2.0, "aux_loss_type": "sequence"},
    {"router_jitter": 0.01, "router_noise_std": 0.1, "collapse_threshold": 1.0},
    {"router": "sigmoid", "expert_bias": True, "routed_scaling_factor": 2.5, "num_expert_groups": 4,
     "top_groups": 2},
    {"num_expert_groups": 4, "top_groups": 2, "group_score": "max", "renormalize": False,
     "routed_scaling_factor": 16.0},
    {"num_shared_experts": 1, "shared_expert_gate": True},
])
def test_valid_routing_configs_construct(kwargs):
    cfg = MoEConfig(**kwargs)
    assert {k: getattr(cfg, k) for k in kwargs} == kwargs


def test_routing_fields_load_from_overrides():
    cfg = load_config(None, ["--moe.router=sigmoid", "--moe.router_bias_update_rate=1e-3",
                             "--moe.num_expert_groups=2", "--moe.top_groups=1", "--moe.dynamic_capacity=true",
                             "--moe.capacity_factor=1.0", "--moe.aux_loss_type=sequence"])
    m = cfg.moe
    assert (m.router, m.router_bias_update_rate, m.num_expert_groups, m.top_groups) == ("sigmoid", 1e-3, 2, 1)
    assert m.dynamic_capacity is True and m.aux_loss_type == "sequence"


def test_hf_family_fields_load_from_overrides():
    cfg = load_config(None, ["--moe.router=sigmoid", "--moe.expert_bias=true", "--moe.routed_scaling_factor=2.5",
                             "--moe.num_expert_groups=4", "--moe.top_groups=2", "--moe.group_score=max",
                             "--moe.num_shared_experts=1", "--moe.shared_expert_gate=true"])
    m = cfg.moe
    assert (m.expert_bias, m.routed_scaling_factor, m.group_score, m.shared_expert_gate) == (True, 2.5, "max", True)
    assert m.has_expert_bias


@pytest.mark.parametrize("kwargs, has_bias", [
    ({}, False),
    ({"expert_bias": True}, True),
    ({"router_bias_update_rate": 1e-3}, True),
    ({"router": "expert_choice", "capacity_factor": 1.0}, False),
])
def test_has_expert_bias(kwargs, has_bias):
    assert MoEConfig(**kwargs).has_expert_bias is has_bias
