"""MoEConfig validation: every bad field raises ValueError naming the field and its value."""

import pytest

from moetrain.config.moe import MoEConfig

# field, bad value, other fields the case needs
BAD_FIELDS = [
    ("num_experts", 0, {}),
    ("num_experts", -4, {"top_k": 1}),
    ("num_experts", "8", {}),
    ("num_experts", True, {"top_k": 1}),
    ("top_k", 0, {}),
    ("top_k", -1, {}),
    ("top_k", 9, {"num_experts": 8}),
    ("expert_hidden_dim", 0, {}),
    ("expert_hidden_dim", -256, {}),
    ("activation", "relu", {}),
    ("activation", "SwiGLU", {}),
    ("capacity_factor", 0.0, {}),
    ("capacity_factor", -1.25, {}),
    ("capacity_factor", float("nan"), {}),
    ("drop_policy", "random", {}),
    ("router_init_std", 0.0, {}),
    ("router_init_std", -0.02, {}),
    ("num_shared_experts", -1, {}),
    ("shared_hidden_dim", 0, {"num_shared_experts": 1}),
    ("aux_loss_coef", -0.01, {}),
    ("z_loss_coef", -1e-3, {}),
    ("expert_impl", "fast", {}),
]


@pytest.mark.parametrize("field, value, others", BAD_FIELDS,
                         ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_bad_field_raises_value_error_naming_field_and_value(field, value, others):
    with pytest.raises(ValueError) as excinfo:
        MoEConfig(**{field: value, **others})
    message = str(excinfo.value)
    assert f"moe.{field}" in message
    assert str(value) in message


def test_top_k_above_num_experts_message_states_the_rule():
    with pytest.raises(ValueError) as excinfo:
        MoEConfig(num_experts=8, top_k=9)
    assert str(excinfo.value) == "moe.top_k (9) must be <= moe.num_experts (8)"


# Integer fields given a non-integer pass ``> 0`` but break later, deep inside torch (e.g.
# ``torch.empty(4.5, ...)`` raises TypeError) or silently mean something else.
NON_INTEGER_FIELDS = [
    ("num_experts", 4.5, {"top_k": 1}),
    ("top_k", 1.5, {}),
    ("expert_hidden_dim", 16.5, {}),
    ("num_shared_experts", 0.5, {}),
    ("shared_hidden_dim", 8.5, {"num_shared_experts": 1}),
]


@pytest.mark.parametrize("field, value, others", NON_INTEGER_FIELDS,
                         ids=[f"{f}={v!r}" for f, v, _ in NON_INTEGER_FIELDS])
def test_integer_fields_reject_non_integers(field, value, others):
    with pytest.raises(ValueError) as excinfo:
        MoEConfig(**{field: value, **others})
    assert f"moe.{field}" in str(excinfo.value)
    assert str(value) in str(excinfo.value)


@pytest.mark.parametrize("kwargs", [
    {},
    {"num_experts": 8, "top_k": 8},                     # top_k == num_experts is allowed
    {"num_experts": 1, "top_k": 1},
    {"capacity_factor": 1.25, "drop_policy": "score"},
    {"capacity_factor": 2},                             # an int factor is fine
    {"activation": "swiglu", "expert_impl": "loop"},
    {"num_shared_experts": 2, "shared_hidden_dim": 64},
    {"aux_loss_coef": 0.0, "z_loss_coef": 0.0, "renormalize": False},
])
def test_valid_configs_construct(kwargs):
    cfg = MoEConfig(**kwargs)
    assert {k: getattr(cfg, k) for k in kwargs} == kwargs


def test_shared_hidden_dim_defaults_to_num_shared_times_expert_hidden():
    assert MoEConfig(num_shared_experts=2, expert_hidden_dim=32).resolved_shared_hidden_dim == 64
    assert MoEConfig(num_shared_experts=2, expert_hidden_dim=32,
                     shared_hidden_dim=48).resolved_shared_hidden_dim == 48
